"""What a network needs its inputs to be: the description a network factory gives and the data module follows.

A network factory (:meth:`loko_lightning.models.NetworkFactory.preprocessing`) answers with one of these values; the
data module (:class:`loko_lightning.data.StreamDataModule`, argument ``preprocessing``) turns it into the transform of
its samples, with its own overrides on top (image size, normalisation, token budget). The two layers share only
this module: a new network family brings its own numbers here without changing the data layer, and the data layer
never looks a model up by name.

The values are plain frozen dataclasses, registered with :func:`torch.serialization.add_safe_globals` so that a
checkpoint holding them (the data module's hyperparameters) still loads with ``weights_only=True``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class ImagePreprocessing:
    """Evaluation preprocessing of an image network: resize, centre crop, normalise (the fields of timm's data config).

    The image is resized so that the crop of ``crop_pct`` of it has the input size, then cropped and normalised.

    Args:
        input_size: ``(channels, height, width)`` the network takes.
        interpolation: resize interpolation (``"bilinear"``, ``"bicubic"``, ...).
        mean: per-channel normalisation mean.
        std: per-channel normalisation standard deviation.
        crop_pct: the crop's fraction of the resized image (1.0: no margin).
        crop_mode: ``"center"``, ``"squash"`` or ``"border"`` (timm's crop modes).

    Example:
        >>> ImagePreprocessing(input_size=(3, 32, 32), mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)).modality
        'image'
    """

    modality: ClassVar[str] = "image"

    input_size: tuple[int, int, int] = (3, 224, 224)
    interpolation: str = "bicubic"
    mean: tuple[float, ...] = (0.485, 0.456, 0.406)  # ImageNet
    std: tuple[float, ...] = (0.229, 0.224, 0.225)
    crop_pct: float = 0.875
    crop_mode: str = "center"


@dataclass(frozen=True)
class TextPreprocessing:
    """Tokenisation for a text network: where its tokenizer is.

    Args:
        tokenizer: what ``AutoTokenizer.from_pretrained`` loads: a local directory or a hub name.

    Example:
        >>> TextPreprocessing("roberta-base").modality
        'text'
    """

    modality: ClassVar[str] = "text"

    tokenizer: str


Preprocessing = ImagePreprocessing | TextPreprocessing

torch.serialization.add_safe_globals([ImagePreprocessing, TextPreprocessing])
