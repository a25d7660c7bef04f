"""torchvision's datasets with a ``train`` flag: CIFAR-10, CIFAR-100, MNIST and Fashion-MNIST.

They are read in torchvision's layout under ``root`` and downloaded in ``prepare_data`` when ``download=True``;
``fashion_mnist`` is also taken offline from the Debian package ``dataset-fashion-mnist``.
"""

from __future__ import annotations

import gzip
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from torchvision import datasets

from loko_lightning.data.sources.base import ImageSource, Split, Splits

# Where the Debian package ``dataset-fashion-mnist`` installs the four gzipped idx files.
FASHION_MNIST_DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")


class TorchvisionSource(ImageSource):
    """A torchvision dataset with a ``train`` flag, read under ``root``, downloaded in ``prepare`` if allowed.

    Subclasses name the dataset: ``name``, ``dataset_cls`` (the torchvision class), ``num_classes`` and ``folder``
    (where under ``root`` the class looks for its files).

    Args:
        root: data directory, in torchvision's layout.
        download: download missing files in ``prepare_data``.
        image_size: square input size, overriding the network's (e.g. 32 for CPU debug runs).
        mean: per-channel normalisation mean, overriding the network's.
        std: per-channel normalisation std, overriding the network's.
    """

    dataset_cls: type[datasets.VisionDataset]
    folder: str

    def __init__(
        self,
        root: str = "data",
        download: bool = False,
        image_size: int | None = None,
        mean: tuple[float, float, float] | None = None,
        std: tuple[float, float, float] | None = None,
    ) -> None:
        super().__init__(image_size, mean, std)
        self.root = Path(root).expanduser()
        self.download = download

    def location(self) -> str:
        """``root/<the class's folder>``."""
        return str(self.root / self.folder)

    def prepare(self) -> None:
        """Download both splits with torchvision if ``download``.

        Raises:
            DataNotFoundError: the download failed (no network, bad checksum), with how to get the files offline.
        """
        if not self.download:
            return
        for train in (True, False):
            try:
                self.dataset_cls(str(self.root), train=train, download=True)
            except (OSError, RuntimeError) as err:  # URLError/HTTPError are OSErrors; MD5 mismatches RuntimeErrors
                raise self.missing(True, " ".join(str(err).split())[:300]) from err

    def load(self) -> Splits:
        """The class's train and test splits, as they are on disk."""
        try:
            train = self.dataset_cls(str(self.root), train=True, download=False)
            test = self.dataset_cls(str(self.root), train=False, download=False)
        except RuntimeError as err:  # torchvision: "Dataset not found [or corrupted]. You can use download=True ..."
            reason = "not found or failed torchvision's checksum" if "corrupted" in str(err) else ""
            raise self.missing(False, reason) from err
        return Splits(Split(train, np.arange(len(train))), Split(test, np.arange(len(test))), list(train.classes))


class CIFAR10(TorchvisionSource):
    """``cifar10``: torchvision's CIFAR-10 (10 classes) under ``root``."""

    name, dataset_cls, num_classes, folder = "cifar10", datasets.CIFAR10, 10, datasets.CIFAR10.base_folder


class CIFAR100(TorchvisionSource):
    """``cifar100``: torchvision's CIFAR-100 (100 classes) under ``root``."""

    name, dataset_cls, num_classes, folder = "cifar100", datasets.CIFAR100, 100, datasets.CIFAR100.base_folder


class MNIST(TorchvisionSource):
    """``mnist``: torchvision's MNIST (10 digits) under ``root``."""

    name, dataset_cls, num_classes, folder = "mnist", datasets.MNIST, 10, "MNIST/raw"


class FashionMNIST(TorchvisionSource):
    """``fashion_mnist``: torchvision's Fashion-MNIST, also offline from the Debian package ``dataset-fashion-mnist``.

    The Debian package's gzipped files (in :data:`FASHION_MNIST_DEBIAN_DIR`) are gunzipped into torchvision's layout
    under ``root``.
    """

    name, dataset_cls, num_classes, folder = "fashion_mnist", datasets.FashionMNIST, 10, "FashionMNIST/raw"
    debian_dir = FASHION_MNIST_DEBIAN_DIR

    def prepare(self) -> None:
        """Copy the Debian package's files, else download with torchvision if ``download``."""
        if not self.copy_debian_files():
            super().prepare()

    def load(self) -> Splits:
        """The splits, after copying the Debian package's files if they are not there yet."""
        self.copy_debian_files()
        return super().load()

    def offline_fixes(self) -> list[str]:
        """The Debian package."""
        return [
            f"run `apt-get install dataset-fashion-mnist`, whose files in {self.debian_dir} are copied there "
            "automatically"
        ]

    def copy_debian_files(self) -> bool:
        """Gunzip the Debian package's files into ``root/FashionMNIST/raw`` (torchvision's layout).

        Returns:
            Whether all four raw files are now in place.
        """
        raw = self.root / self.folder
        names = [os.path.splitext(name)[0] for name, _ in datasets.FashionMNIST.resources]
        if all((raw / name).is_file() for name in names):
            return True
        sources = [self.debian_dir / f"{name}.gz" for name in names]
        if not all(src.is_file() for src in sources):
            return False
        raw.mkdir(parents=True, exist_ok=True)
        for name, src in zip(names, sources, strict=True):
            if (raw / name).is_file():
                continue
            # Write then rename, so a concurrent reader (another process) never sees a half-written file.
            fd, tmp = tempfile.mkstemp(dir=raw, prefix=f".{name}.")
            try:
                with gzip.open(src, "rb") as fin, os.fdopen(fd, "wb") as fout:
                    shutil.copyfileobj(fin, fout)
                os.replace(tmp, raw / name)
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
        return True
