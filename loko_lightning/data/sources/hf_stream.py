"""Streams read as they go: Hugging Face ``datasets`` in streaming mode, for data larger than the disk.

:class:`HFStream` (``path``) reads ``datasets.load_dataset(path, streaming=True)`` without downloading or holding it:

- ``<owner>/<name>`` (e.g. ``stanfordnlp/imdb``): a dataset on the Hugging Face hub, read over the network.
- ``csv``, ``json``, ``parquet``, ``arrow``, ``imagefolder``, ``webdataset``: local files read by that ``datasets``
  builder; ``root`` is a file or a glob (``data_files``) or a folder (``data_dir``, whose file names say the split:
  ``train*``, ``validation*``, ``test*``; an image folder has one sub-folder per class).

Its samples are images or text as the network takes (images: the first ``datasets.Image`` column, or ``image``;
text: ``text_column`` and ``text_pair_column``); its name, in messages and checkpoints, is ``hf:<path>``.

The training split is read in order through a seeded shuffle buffer (``shuffle_buffer`` samples, ``datasets``'
``IterableDataset.shuffle``, which also shuffles the order of the files): stream position ``p`` is the ``p``-th
sample out of the buffer, a function of the files, the seed and the buffer size alone. A resumed run reopens the
stream and skips to its saved position (``IterableDataset.skip``: the skipped samples are read, not decoded or
trained on), so it goes on exactly where the checkpoint was written, with any batch size and number of processes.
``datasets``' own ``state_dict`` is not used: with a shuffle buffer it restores the files' position but not the
buffer's content, so the resumed order would differ.

Under DDP every process reads the whole stream and keeps its share of each step, the same positions as an
in-memory stream gives it (:class:`~loko_lightning.data.stream.StreamDataLoader`): the result does not depend on
how the files are sharded, at the cost of each process reading every sample (images are decoded and transformed
only for its own). Each process reads every step to its end, so a stream that ends early stops all of them at the
same step.

The held-out split is the first of ``validation`` and ``test`` that the dataset has: ``eval_max_samples`` samples
(:data:`EVAL_SAMPLES` by default, 0 for none) read once at setup through a shuffle buffer of the same size seeded
with :data:`~loko_lightning.data.sources.base.HOLDOUT_SEED`, and kept in memory; without such a split, there is no
validation.

Labels are class ids: a ``ClassLabel`` column names the classes; plain integers need ``num_classes`` (the model's
head). A streamed dataset's length is not known ahead unless the hub's metadata has it: ``max_samples`` sets it, and
a stream that ends before ``max_samples`` stops the run with an error instead of ending it early.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from loko_lightning.data.perturbations import Perturbation
from loko_lightning.data.sources.base import (
    HOLDOUT_SEED,
    DataNotFoundError,
    OpenedSource,
    Source,
    Split,
    StreamSettings,
    hf_datasets,
)
from loko_lightning.data.stream import IterableStream, LabelDrift
from loko_lightning.errors import ConfigError

HF_PREFIX = "hf:"
#: ``datasets`` builders that read local files (``root``) instead of a hub dataset.
LOCAL_BUILDERS = ("csv", "json", "parquet", "arrow", "imagefolder", "webdataset")
#: The held-out split: the first of these the dataset has.
HELD_OUT_SPLITS = ("validation", "test")
#: Held-out samples read at setup when ``eval_max_samples`` is not set.
EVAL_SAMPLES = 1000


class ExampleList:
    """Samples read into memory, as a map-style dataset of ``(raw sample, label)`` pairs with ``targets``."""

    def __init__(self, samples: list[Any], targets: list[int]) -> None:
        self.samples, self.targets = samples, targets

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        return self.samples[index], self.targets[index]


class HFStream(Source):
    """A Hugging Face dataset read in streaming mode (see the module's description); images or text, as the network.

    Args:
        path: a hub dataset (``owner/name``) or a local builder of :data:`LOCAL_BUILDERS` (with ``root``).
        root: a local builder's files: a file, a glob or a folder.
        shuffle_buffer: samples in the seeded shuffle buffer the stream is read through (0 or 1: the files' order);
            larger mixes more and holds more samples in memory.
        text_column: text: the column holding the text.
        text_pair_column: text: the column holding the second text of a pair (``None``: single texts).
        label_column: the column holding the label (class ids).
        image_size: images: square input size, overriding the network's.
        mean: images: per-channel normalisation mean, overriding the network's.
        std: images: per-channel normalisation std, overriding the network's.
        max_length: text: at most this many tokens per sample (longer texts are truncated).
    """

    follows_network = True
    optional_held_out = True

    def __init__(
        self,
        path: str,
        root: str = "data",
        shuffle_buffer: int = 10_000,
        text_column: str = "text",
        text_pair_column: str | None = None,
        label_column: str = "label",
        image_size: int | None = None,
        mean: tuple[float, float, float] | None = None,
        std: tuple[float, float, float] | None = None,
        max_length: int = 128,
    ) -> None:
        if not path:
            raise ConfigError(
                "path names no dataset. To fix it: <owner>/<name> for the Hugging Face hub, or a builder with root "
                f"set to local files ({', '.join(LOCAL_BUILDERS)}).",
                field="path",
                owner=type(self),
            )
        if shuffle_buffer < 0:
            raise ConfigError(
                f"shuffle_buffer must be >= 0, got {shuffle_buffer}.", field="shuffle_buffer", owner=type(self)
            )
        self.path = path
        self.name = HF_PREFIX + path
        self.root = Path(root).expanduser()
        self.shuffle_buffer = shuffle_buffer
        self.text_column, self.text_pair_column, self.label_column = text_column, text_pair_column, label_column
        self.columns: dict[str, str | None] = {
            "text_column": text_column, "text_pair_column": text_pair_column, "label_column": label_column,
        }  # fmt: skip
        self.image_size, self.mean, self.std, self.max_length = image_size, mean, std, max_length
        self.class_label = False  # whether the labels are a ClassLabel column (known once opened)

    @property
    def local(self) -> bool:
        """Whether ``path`` is a builder of local files (``root``) rather than a hub dataset."""
        return self.path in LOCAL_BUILDERS

    def for_modality(self, modality: str) -> HFStream:
        """A copy holding ``modality`` samples (``"image"`` or ``"text"``), the network's."""
        out = copy.copy(self)
        out.columns = dict(self.columns)
        out.modality = modality
        return out

    def transform_options(self) -> dict[str, Any]:
        """The image overrides and ``max_length`` (the transform refuses an image one for text)."""
        return {"image_size": self.image_size, "mean": self.mean, "std": self.std, "max_length": self.max_length}

    def location(self) -> str:
        """The local files, or the hub dataset."""
        if self.local:
            return f"{self.root} (read by datasets' {self.path!r} builder)"
        return f"the Hugging Face hub dataset {self.path!r} (read over the network)"

    def check(self, settings: Mapping[str, Any]) -> None:
        """What a stream read as it goes cannot do, refused naming the argument.

        Raises:
            ConfigError: ``epochs > 1``, a ``perturbation`` or ``num_workers > 0``.
        """
        refused = {
            "epochs": (settings["epochs"] != 1, "a streamed source is read once; set epochs to 1"),
            "perturbation": (
                settings["perturbation"] is not None,
                "OOD samples need a stream held in memory; set it to null",
            ),
            "num_workers": (
                settings["num_workers"] != 0,
                "a streamed source is read in order in the training process (datasets would split its files among the "
                "workers and change the order); set num_workers to 0",
            ),
        }
        for name, (bad, fix) in refused.items():
            if bad:
                raise ConfigError(
                    f"dataset={self.name!r} is streamed: {name}={settings[name]}. To fix it: {fix}.", field=name
                )

    def _splits(self) -> Any:
        """``datasets.load_dataset(..., streaming=True)``: an ``IterableDatasetDict``.

        Raises:
            DataNotFoundError: ``datasets`` is missing, or the data cannot be opened (no files, no network).
        """
        datasets = hf_datasets(self.name)
        root = self.root
        kwargs: dict[str, Any] = {}
        if self.local:
            if root.is_dir():
                kwargs["data_dir"] = str(root)
            elif root.is_file() or any(c in str(root) for c in "*?["):
                kwargs["data_files"] = str(root)
            else:
                raise DataNotFoundError(
                    f"dataset={self.name!r}: no files at root={root}. To fix it: set root to a file, a glob such as "
                    f"'data/train-*.{self.path}' or a folder whose file names start with train/validation/test.",
                    field="root",
                )
        try:
            splits = datasets.load_dataset(self.path, streaming=True, **kwargs)
        except Exception as err:  # the library's own errors vary (hub, network, file formats): one actionable line
            reason = " ".join(str(err).split())[:300]
            fix = (
                f"check root={root} and that its files are {self.path} files"
                if self.local
                else "run on a machine that reaches the Hugging Face hub (HF_ENDPOINT for a mirror), check the "
                "name, and log in (HF_TOKEN) for a gated dataset"
            )
            raise DataNotFoundError(
                f"dataset={self.name!r}: datasets.load_dataset({self.path!r}, streaming=True) failed "
                f"({type(err).__name__}: {reason}). To fix it: {fix}.",
                field="root" if self.local else "path",
            ) from err
        if "train" not in splits:
            raise DataNotFoundError(
                f"dataset={self.name!r} has no 'train' split (it has {sorted(splits)}). To fix it: name the training "
                "files train* (or point root at them alone).",
                field="root" if self.local else "path",
            )
        return splits

    def open(self, settings: StreamSettings) -> OpenedSource:
        """Open the stream: its classes, its held-out samples and a reader of the training split.

        The training split is read through a shuffle buffer of ``shuffle_buffer`` samples seeded with ``seed`` (0 or
        1: the files' order); the held-out samples (``eval_max_samples``, default :data:`EVAL_SAMPLES`; 0: none) are
        read through one of the same size seeded with :data:`~loko_lightning.data.sources.base.HOLDOUT_SEED` (a split
        sorted by class would otherwise give a one-class held-out set). ``num_classes`` (the model's head) is needed
        when the labels are plain integers; ``max_samples`` when the dataset's metadata does not give its length.

        Args:
            settings: the data module's stream settings.

        Raises:
            DataNotFoundError: the data cannot be opened.
            ConfigError: a named column is missing, the labels are not class ids, their number is unknown or above
                ``num_classes``, or the length is unknown.
        """
        seed, shuffle_buffer, num_classes = settings.seed, self.shuffle_buffer, settings.num_classes
        splits = self._splits()
        train = splits["train"]
        features = train.features
        if features is None:  # csv/json: the types are known only once a row is read
            features = self._first_row_features(train)
        self._check_columns(features)
        classes = self._classes(features, num_classes)
        decode = _identity
        if self.modality == "image":  # every process reads every row: decode only the ones it trains on
            import datasets

            column = self.columns["image_column"]
            if isinstance(features.get(column), datasets.Image):
                train = train.cast_column(column, datasets.Image(decode=False))
                decode = datasets.Image().decode_example
        held_name = next((name for name in HELD_OUT_SPLITS if name in splits), None)
        held_out = ExampleList([], [])
        wanted = EVAL_SAMPLES if settings.eval_max_samples is None else settings.eval_max_samples
        if held_name is not None and wanted > 0:
            held = splits[held_name]
            if shuffle_buffer > 1:
                held = held.shuffle(seed=HOLDOUT_SEED, buffer_size=shuffle_buffer)
            for row in held.take(wanted):
                held_out.samples.append(self._sample(row))
                held_out.targets.append(self._label(row, classes, held_name))
        info = getattr(train.info, "splits", None)
        known = info["train"].num_examples if info and "train" in info and info["train"].num_examples else None
        length = settings.max_samples if settings.max_samples is not None else known
        if length is None:
            raise ConfigError(
                f"dataset={self.name!r} is streamed and its length is not known ahead. To fix it: set max_samples "
                "(the samples to train on; the run stops with an error if the data ends before).",
                field="max_samples",
            )
        if num_classes is not None and len(classes) > num_classes:
            raise ConfigError(
                f"dataset={self.name!r} has {len(classes)} classes {classes} but num_classes={num_classes}. To fix "
                f"it: set num_classes to {len(classes)}.",
                field="num_classes",
            )

        def examples(start: int) -> Iterator[tuple[Any, int]]:
            stream = train.shuffle(seed=seed, buffer_size=shuffle_buffer) if shuffle_buffer > 1 else train
            if start:
                stream = stream.skip(start)
            for row in stream:
                yield self._sample(row), self._label(row, classes, "train")

        def stream(
            transform: Callable[[Any], Any], perturbation: Perturbation | None, drift: LabelDrift | None
        ) -> IterableStream:
            return IterableStream(examples, length, transform, drift, decode)  # perturbations are refused in check()

        summary = (
            f"{self.name}: streamed, {length} samples through a shuffle buffer of {shuffle_buffer}; classes "
            f"{dict(enumerate(classes))}; {len(held_out)} held-out samples"
        )
        return OpenedSource(
            classes, Split(held_out, np.arange(len(held_out))), stream, shuffle_buffer=shuffle_buffer, summary=summary
        )

    def _image_column(self, features: dict[str, Any]) -> str:
        import datasets

        images = [name for name, feature in features.items() if isinstance(feature, datasets.Image)]
        if images:
            return images[0]
        for name in ("image", "img"):
            if name in features:
                return name
        raise ConfigError(
            f"dataset={self.name!r} has no image column (columns: {sorted(features)}); an image network needs one. "
            "To fix it: cast the column to datasets.Image, or name it 'image'.",
            field="source",
        )

    def _first_row_features(self, split: Any) -> dict[str, Any]:
        """:func:`_first_row_features`; a file with nothing to read (no header row) is named, not pandas' words."""
        try:
            return _first_row_features(split)
        except ValueError as err:
            if type(err).__name__ != "EmptyDataError":  # pandas.errors.EmptyDataError, through the csv builder
                raise
            raise ConfigError(
                f"dataset={self.name!r}: {self.location()} is empty (no header row, no rows). To fix it: give a file "
                "with a header row naming its columns and one row per sample",
                field="root",
                owner=type(self),
            ) from None

    def _check_columns(self, features: dict[str, Any]) -> None:
        """Every named column exists (text: ``text_column`` and ``text_pair_column``; always ``label_column``)."""
        names = ["label_column"] + (["text_column", "text_pair_column"] if self.modality == "text" else [])
        for field in names:
            column = self.columns[field]
            if column is not None and column not in features:
                raise ConfigError(
                    f"dataset={self.name!r} has no column {column!r} (columns: {sorted(features)}). To fix it: set "
                    f"{field} to one of them.",
                    field=field,
                )
        if self.modality == "image":
            self.columns["image_column"] = self._image_column(features)

    def _classes(self, features: dict[str, Any], num_classes: int | None) -> list[str]:
        import datasets

        column = self.columns["label_column"]
        feature = features[column]
        self.class_label = isinstance(feature, datasets.ClassLabel)
        if self.class_label:
            return list(feature.names)
        if getattr(feature, "dtype", "").startswith(("int", "uint")) and num_classes is not None:
            return [str(i) for i in range(num_classes)]
        kind = getattr(feature, "dtype", type(feature).__name__)
        need = "num_classes (the model's head)" if "int" in str(kind) else "integer class ids or a ClassLabel column"
        raise ConfigError(
            f"dataset={self.name!r}: the labels in column {column!r} are {kind}; a streamed dataset cannot be read "
            f"through to count or name its classes, so it needs {need}. To fix it: set num_classes, cast the column "
            "to datasets.ClassLabel, or use a source read into memory (e.g. TextFile).",
            field="num_classes" if "int" in str(kind) else "label_column",
        )

    def _sample(self, row: dict[str, Any]) -> Any:
        if self.modality == "image":
            return row[self.columns["image_column"]]
        texts = []
        for field in ("text_column", "text_pair_column"):
            column = self.columns[field]
            if column is None:
                continue
            if not isinstance(row[column], str):
                raise ConfigError(
                    f"dataset={self.name!r}: column {column!r} holds {row[column]!r} ({type(row[column]).__name__}), "
                    f"not text. To fix it: set {field} to the column that holds the text (a CSV column of numbers is "
                    "read as numbers).",
                    field=field,
                )
            texts.append(row[column])
        return texts[0] if len(texts) == 1 else tuple(texts)

    def _label(self, row: dict[str, Any], classes: list[str], split: str) -> int:
        label = row[self.columns["label_column"]]
        if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(classes):
            if split != "train":  # e.g. GLUE's test splits, whose labels are hidden (-1)
                fix, field = (
                    "set eval_max_samples to 0 to train without a held-out split, or correct the data",
                    ("eval_max_samples"),
                )
            elif self.class_label:
                fix, field = "correct the data, or set label_column to the column of class ids", "label_column"
            else:
                fix, field = "set num_classes to the number of classes, or correct the data", "num_classes"
            raise ConfigError(
                f"dataset={self.name!r}: the {split} split has label {label!r} in column "
                f"{self.columns['label_column']!r}, not a class id in [0, {len(classes)}). To fix it: {fix}.",
                field=field,
            )
        return label


def _identity(sample: Any) -> Any:
    return sample


def _first_row_features(split: Any) -> dict[str, Any]:
    """Column types of a split whose metadata has none (csv, json), inferred from its first row."""
    import datasets

    row = next(iter(split.take(1)), None)
    if row is None:
        return {}
    out: dict[str, Any] = {}
    for name, value in row.items():
        if isinstance(value, bool):
            out[name] = datasets.Value("bool")
        elif isinstance(value, int):
            out[name] = datasets.Value("int64")
        elif isinstance(value, float):
            out[name] = datasets.Value("float64")
        elif isinstance(value, str):
            out[name] = datasets.Value("string")
        else:
            out[name] = datasets.Value("null") if value is None else type(value)
    return out
