"""``imagefolder``: ``torchvision.datasets.ImageFolder`` at ``root/train`` and, if present, ``root/val``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from torchvision import datasets

from loko_lightning.data.sources.base import DataNotFoundError, ImageSource, Split, Splits, held_out_of_train
from loko_lightning.errors import ConfigError


class ImageFolder(ImageSource):
    """``imagefolder``: ``torchvision.datasets.ImageFolder`` at ``root/train`` and, if present, ``root/val``.

    One sub-folder of images per class (e.g. ImageNet100). Without ``val/``, :data:`HOLDOUT_FRACTION` of ``train/``
    is held out.

    Args:
        root: the folder holding ``train/`` (and optionally ``val/``).
        image_size: square input size, overriding the network's (e.g. 32 for CPU debug runs).
        mean: per-channel normalisation mean, overriding the network's.
        std: per-channel normalisation std, overriding the network's.
    """

    name = "imagefolder"

    def __init__(
        self,
        root: str = "data",
        image_size: int | None = None,
        mean: tuple[float, float, float] | None = None,
        std: tuple[float, float, float] | None = None,
    ) -> None:
        super().__init__(image_size, mean, std)
        self.root = Path(root).expanduser()

    def location(self) -> str:
        """``root/train``."""
        return str(self.root / "train")

    def missing(self, download: bool, reason: str = "") -> DataNotFoundError:
        """No ``train/`` folder: say which layout is expected."""
        root = self.root
        return DataNotFoundError(
            f"dataset='imagefolder': no data found at {root / 'train'}. Put one sub-folder of images per class at "
            f"{root / 'train'} (and optionally {root / 'val'}), or set root to the folder that holds train/.",
            field="root",
        )

    def load(self) -> Splits:
        """``train/`` and ``val/`` (or a held-out part of ``train/``), with the same class numbers."""
        train_dir, val_dir = self.root / "train", self.root / "val"
        if not train_dir.is_dir():
            raise self.missing(False)
        train = self._folder(train_dir)
        if not val_dir.is_dir():
            return held_out_of_train(train)
        val = self._folder(val_dir)
        if val.classes != train.classes:
            differ = sorted(set(train.classes) ^ set(val.classes))
            raise ConfigError(
                f"dataset='imagefolder': {train_dir} and {val_dir} must have the same class folders (they differ "
                f"in {differ[:10]}); otherwise their label numbers would disagree. To fix it: make the class folders "
                "match, or remove val/ to hold out part of train/ instead.",
                field="root",
            )
        return Splits(Split(train, np.arange(len(train))), Split(val, np.arange(len(val))), list(train.classes))

    @staticmethod
    def _folder(folder: Path) -> datasets.ImageFolder:
        try:
            return datasets.ImageFolder(str(folder))
        except FileNotFoundError as err:  # torchvision: no class folder / no image file
            raise ConfigError(
                f"dataset='imagefolder': {folder} is empty ({err}). To fix it: put one sub-folder of images (.png, "
                ".jpg, ...) per class there.",
                field="root",
            ) from err
