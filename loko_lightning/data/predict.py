"""What ``loko predict`` predicts: image files and folders, texts and text files, or the held-out split.

:class:`PredictDataset` yields ``{"inputs", "index"}`` (and ``"label"`` for held-out samples); :attr:`~PredictDataset.
names` says what each index was (a file path, the text, or ``held-out[i]``), for the rows a prediction writer writes.
The inputs are checked when the dataset is built, so a bad one is refused before any prediction is written.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset

from loko_lightning.errors import ConfigError

# The suffixes read as images (what PIL opens on every platform); a folder contributes its files with these.
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")
FIELD = "predict_inputs"


class PredictDataset(Dataset):
    """Samples to predict on, each with its position (``index``) and, where known, its label.

    Args:
        samples: the raw sample at a position (an image opened from its file, a text, a held-out sample).
        names: what each sample is, in order (a path, a text, ``held-out[i]``).
        transform: the network's preprocessing of a raw sample.
        labels: the samples' labels, or ``None`` when unknown.
    """

    def __init__(
        self,
        samples: Callable[[int], Any],
        names: Sequence[str],
        transform: Callable[[Any], Any],
        labels: Sequence[int] | None = None,
    ) -> None:
        self.samples = samples
        self.names = list(names)
        self.transform = transform
        self.labels = None if labels is None else [int(label) for label in labels]

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, index: int) -> dict[str, Any]:
        item = {"inputs": self.transform(self.samples(index)), "index": torch.tensor(index, dtype=torch.int64)}
        if self.labels is not None:
            item["label"] = torch.tensor(self.labels[index], dtype=torch.int64)
        return item

    @classmethod
    def from_inputs(cls, inputs: Sequence[str], modality: str, transform: Callable[[Any], Any]) -> PredictDataset:
        """The dataset of what a user gave: image files or folders (images), texts or ``.txt`` files (text).

        Raises:
            ConfigError: (field ``predict_inputs``) nothing given, a path that is not there, a file that is not a
                readable image, an image given to a text model, or a folder without images.
        """
        if isinstance(inputs, str) or not inputs:
            wanted = "image files or folders" if modality == "image" else "texts"
            raise ConfigError(
                f"predict_inputs must be a non-empty list of {wanted}, got {inputs!r}",
                field=FIELD,
            )
        if modality == "image":
            paths = [path for item in inputs for path in _image_files(item)]
            return cls(lambda i: _open_image(paths[i]), [str(p) for p in paths], transform)
        texts = [text for item in inputs for text in _texts(item)]
        return cls(texts.__getitem__, texts, transform)

    @classmethod
    def held_out(cls, base: Any, indices: Sequence[int], transform: Callable[[Any], Any]) -> PredictDataset:
        """The held-out samples ``base[indices]`` (``(raw sample, label)`` pairs), named ``held-out[i]``."""
        indices = [int(i) for i in indices]
        labels = [int(base.targets[i]) for i in indices]
        return cls(lambda i: base[indices[i]][0], [f"held-out[{i}]" for i in indices], transform, labels)


def _image_files(item: str) -> list[Path]:
    path = Path(item).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise ConfigError(
                f"the folder {str(path)!r} holds no image files ({', '.join(IMAGE_SUFFIXES)})", field=FIELD
            )
        for file in files:
            _check_image(file)
        return files
    if not path.is_file():
        raise ConfigError(
            f"no image file or folder at {item!r}: an image model predicts image files (or folders of them); for "
            "text, use a text model's checkpoint and config",
            field=FIELD,
        )
    _check_image(path)
    return [path]


# What PIL raises for bytes that are not a readable image (a decompression bomb included).
UNREADABLE_IMAGE = (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError)


def decode_image(data: bytes, field: str = FIELD) -> Image.Image:
    """The RGB image held in ``data``, the bytes of an image file (PNG, JPEG, ...), checked whole before it is read.

    Raises:
        ConfigError: (field ``field``) the bytes are not a readable image.
    """
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.verify()
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except UnidentifiedImageError:
        raise ConfigError(f"{field} is not an image file PIL can read (PNG, JPEG, ...)", field=field) from None
    except UNREADABLE_IMAGE as err:
        raise ConfigError(f"{field} is a damaged image ({' '.join(str(err).split())[:160]})", field=field) from None


def _check_image(path: Path) -> None:
    try:
        with Image.open(path) as image:
            image.verify()
    except UNREADABLE_IMAGE as err:
        raise ConfigError(f"cannot read {str(path)!r} as an image ({err})", field=FIELD) from None


def _open_image(path: Path) -> Image.Image:
    with Image.open(path) as image:
        return image.convert("RGB")


def _texts(item: str) -> list[str]:
    path = Path(item).expanduser() if len(item) < 4096 else None
    is_file = path is not None and path.is_file()
    if is_file and path.suffix.lower() in IMAGE_SUFFIXES:
        raise ConfigError(
            f"{item!r} is an image file, but this is a text model: it predicts texts (or .txt files, one text a "
            "line); for images, use an image model's checkpoint and config",
            field=FIELD,
        )
    if path is not None and path.is_dir():
        raise ConfigError(
            f"{item!r} is a folder, but a text model predicts texts, or .txt files with one text a line: give the "
            "files (e.g. [reviews.txt]), or the texts themselves",
            field=FIELD,
        )
    if not is_file and path is not None and path.suffix.lower() == ".txt" and not any(c.isspace() for c in item):
        raise ConfigError(
            f"no text file at {item!r} (a .txt name, not a text to classify); give the path of a .txt file with one "
            "text a line, or the text itself",
            field=FIELD,
        )
    if is_file and path.suffix.lower() == ".txt":
        try:
            lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"cannot read {item!r} as UTF-8 text ({err})", field=FIELD) from None
        texts = [line for line in lines if line]
        if not texts:
            raise ConfigError(f"the text file {item!r} holds no text (one text a line)", field=FIELD)
        return texts
    if not item.strip():
        raise ConfigError("predict_inputs holds an empty text", field=FIELD)
    return [item]
