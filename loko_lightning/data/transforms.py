"""Preprocessing of a raw sample into the model's inputs, one transform per modality.

Images: timm's evaluation transform for the backbone (resize, centre crop, normalisation from its pretrained
config), with grayscale images repeated to three channels. Text: the backbone's Hugging Face tokenizer
(:class:`TextTransform`). :func:`build_transform` picks the transform for a source's modality.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import timm
import torch
from PIL import Image
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, create_transform, resolve_data_config

from loko_lightning.data.text import TextTransform
from loko_lightning.errors import ConfigError

Transform = Callable[[Any], Any]


def image_data_config(
    backbone: str | None,
    image_size: int | None = None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
) -> dict[str, Any]:
    """The timm data config of ``backbone`` (or ImageNet defaults at 224 px), with the overrides applied.

    Read from the backbone's pretrained config, without building the model.

    Args:
        backbone: timm model name, optionally with a pretrained tag; ``None``: ImageNet mean/std at 224 px.
        image_size: square input size, overriding the backbone's.
        mean: per-channel normalisation mean, overriding the backbone's.
        std: per-channel normalisation std, overriding the backbone's.

    Raises:
        ConfigError: an unknown backbone or tag, a non-positive size, or a mean/std without 3 positive values.
    """
    if image_size is not None and image_size <= 0:
        raise ConfigError(f"image_size must be a positive integer (or null), got {image_size}.", field="image_size")
    for name, value in {"mean": mean, "std": std}.items():
        if value is not None and len(value) != 3:
            raise ConfigError(f"{name} needs one value per RGB channel (3), got {tuple(value)}.", field=name)
    if std is not None and min(std) <= 0:
        raise ConfigError(f"std must be positive, got {tuple(std)}.", field="std")
    if backbone is None:
        pretrained_cfg: dict[str, Any] = {
            "input_size": (3, 224, 224),
            "mean": IMAGENET_DEFAULT_MEAN,
            "std": IMAGENET_DEFAULT_STD,
        }
    else:
        try:
            cfg = timm.models.get_pretrained_cfg(backbone)
        except RuntimeError as err:  # a known architecture with an unknown pretrained tag
            raise ConfigError(
                f"backbone={backbone!r}: {err} See timm.list_pretrained('{backbone}*').", field="backbone"
            ) from err
        if cfg is None and not timm.is_model(backbone):
            raise ConfigError(
                f"backbone={backbone!r} is not a timm model; see timm.list_models() for the names.", field="backbone"
            )
        pretrained_cfg = cfg.to_dict() if cfg is not None else {"input_size": (3, 224, 224)}
    overrides: dict[str, Any] = {}
    if image_size is not None:
        overrides["input_size"] = (3, image_size, image_size)
    if mean is not None:
        overrides["mean"] = tuple(float(m) for m in mean)
    if std is not None:
        overrides["std"] = tuple(float(s) for s in std)
    return resolve_data_config(args=overrides, pretrained_cfg=pretrained_cfg)


class ImageTransform:
    """timm's evaluation preprocessing for a backbone: a PIL image (any mode) to a float32 ``(3, H, W)`` tensor.

    No augmentation: every sample of the stream is seen once.

    Args:
        backbone: timm model name whose pretrained config sets the preprocessing; ``None``: ImageNet at 224 px.
        image_size: square input size, overriding the backbone's.
        mean: per-channel normalisation mean, overriding the backbone's.
        std: per-channel normalisation std, overriding the backbone's.

    Example:
        >>> from PIL import Image
        >>> transform = ImageTransform("resnet18", image_size=32)
        >>> transform(Image.new("L", (28, 28))).shape
        torch.Size([3, 32, 32])
    """

    def __init__(
        self,
        backbone: str | None = None,
        image_size: int | None = None,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
    ) -> None:
        self.data_config = image_data_config(backbone, image_size, mean, std)
        self.preprocess = create_transform(**self.data_config, is_training=False)

    def __call__(self, image: Image.Image) -> torch.Tensor:
        """Preprocess one image (grayscale is repeated to three channels)."""
        if image.mode != "RGB":
            image = image.convert("RGB")
        return self.preprocess(image)


def build_transform(
    modality: str,
    backbone: str | None = None,
    image_size: int | None = None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    max_length: int = 128,
) -> Transform:
    """The transform for a source's modality, configured from the backbone.

    Args:
        modality: the source's :attr:`~loko_lightning.data.sources.Source.modality`.
        backbone: the model name whose preprocessing to use (text: whose tokenizer).
        image_size: square input size of images, overriding the backbone's.
        mean: image normalisation mean, overriding the backbone's.
        std: image normalisation std, overriding the backbone's.
        max_length: text: at most this many tokens per sample (longer texts are truncated).

    Raises:
        ConfigError: no transform for ``modality`` (``field="dataset"``), or a bad argument of the transform.
    """
    if modality == "image":
        return ImageTransform(backbone, image_size, mean, std)
    if modality == "text":
        for name, value in {"image_size": image_size, "mean": mean, "std": std}.items():
            if value is not None:
                raise ConfigError(f"{name} is an image setting; a text stream takes max_length instead.", field=name)
        if backbone is None:
            raise ConfigError("a text stream needs the backbone whose tokenizer to use.", field="backbone")
        return TextTransform(backbone, max_length)
    raise ConfigError(f"no transform for {modality!r} samples; known: 'image', 'text'.", field="dataset")
