"""torchvision's datasets with a ``train`` flag: ``cifar10``, ``cifar100``, ``mnist`` and ``fashion_mnist``.

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

from loko_lightning.data.sources.base import Source, Split, Splits

# Where the Debian package ``dataset-fashion-mnist`` installs the four gzipped idx files.
FASHION_MNIST_DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")


class TorchvisionSource(Source):
    """A torchvision dataset with a ``train`` flag (CIFAR, MNIST, ...), downloaded in ``prepare`` if allowed.

    Args:
        name: dataset name.
        dataset_cls: the torchvision class.
        num_classes: its number of classes.
        folder: where under the data root the class looks for its files.
    """

    def __init__(self, name: str, dataset_cls: type[datasets.VisionDataset], num_classes: int, folder: str) -> None:
        self.name = name
        self.dataset_cls = dataset_cls
        self.num_classes = num_classes
        self.folder = folder

    def location(self, root: Path) -> str:
        """``root/<the class's folder>``."""
        return str(root / self.folder)

    def prepare(self, root: Path, download: bool) -> None:
        """Download both splits with torchvision if ``download``.

        Raises:
            DataNotFoundError: the download failed (no network, bad checksum), with how to get the files offline.
        """
        if not download:
            return
        for train in (True, False):
            try:
                self.dataset_cls(str(root), train=train, download=True)
            except (OSError, RuntimeError) as err:  # URLError/HTTPError are OSErrors; MD5 mismatches RuntimeErrors
                raise self.missing(root, True, " ".join(str(err).split())[:300]) from err

    def load(self, root: Path) -> Splits:
        """The class's train and test splits, as they are on disk."""
        try:
            train = self.dataset_cls(str(root), train=True, download=False)
            test = self.dataset_cls(str(root), train=False, download=False)
        except RuntimeError as err:  # torchvision: "Dataset not found [or corrupted]. You can use download=True ..."
            reason = "not found or failed torchvision's checksum" if "corrupted" in str(err) else ""
            raise self.missing(root, False, reason) from err
        return Splits(Split(train, np.arange(len(train))), Split(test, np.arange(len(test))), list(train.classes))


class FashionMNISTSource(TorchvisionSource):
    """torchvision's Fashion-MNIST, also taken offline from the Debian package ``dataset-fashion-mnist``.

    Args:
        debian_dir: where the Debian package puts its gzipped files; they are gunzipped into torchvision's layout.
    """

    def __init__(self, debian_dir: Path = FASHION_MNIST_DEBIAN_DIR) -> None:
        super().__init__("fashion_mnist", datasets.FashionMNIST, 10, "FashionMNIST/raw")
        self.debian_dir = debian_dir

    def prepare(self, root: Path, download: bool) -> None:
        """Copy the Debian package's files, else download with torchvision if ``download``."""
        if not self.copy_debian_files(root):
            super().prepare(root, download)

    def load(self, root: Path) -> Splits:
        """The splits, after copying the Debian package's files if they are not there yet."""
        self.copy_debian_files(root)
        return super().load(root)

    def offline_fixes(self) -> list[str]:
        """The Debian package."""
        return [
            f"run `apt-get install dataset-fashion-mnist`, whose files in {self.debian_dir} are copied there "
            "automatically"
        ]

    def copy_debian_files(self, root: Path) -> bool:
        """Gunzip the Debian package's files into ``root/FashionMNIST/raw`` (torchvision's layout).

        Args:
            root: the data root.

        Returns:
            Whether all four raw files are now in place.
        """
        raw = root / self.folder
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
