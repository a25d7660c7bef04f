"""What the text families share: :class:`TextSource`, texts held in memory, read from files and checked.

:class:`TextDataset` holds texts (or pairs of texts) and integer labels in memory; :func:`read_text_file` reads CSV,
TSV and JSON Lines files by column name, :func:`check_texts` refuses empty texts and :func:`encode_labels` maps string
labels to ids (sorted names).
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from loko_lightning.data.sources.base import Source, Split, Splits, holdout_split
from loko_lightning.errors import ConfigError

FORMATS = {".csv": ",", ".tsv": "\t", ".jsonl": None, ".json": None}
_INTEGER = re.compile(r"-?\d+")


class TextSource(Source):
    """A source of text samples (``modality = "text"``): a string, or a pair of strings, per sample.

    Args:
        max_length: at most this many tokens per sample (longer texts are truncated).
    """

    modality = "text"

    def __init__(self, max_length: int = 128) -> None:
        self.max_length = max_length

    def transform_options(self) -> dict[str, Any]:
        """``max_length``."""
        return {"max_length": self.max_length}


def text_dataset(
    where: str, columns: dict[str, list[Any]], classes: list[str] | None = None, fields: dict[str, str] | None = None
) -> TextDataset:
    """A :class:`TextDataset` from read columns, every text and label checked."""
    fields = fields or {}
    check_texts(columns["text_column"], where, fields.get("text_column", "text_column"))
    if "text_pair_column" in columns:
        check_texts(columns["text_pair_column"], where, fields.get("text_pair_column", "text_pair_column"))
    ids, classes = encode_labels(columns["label_column"], where, classes)
    return TextDataset(columns["text_column"], ids, classes, columns.get("text_pair_column"))


def text_splits(train: TextDataset, held_out: TextDataset | None) -> Splits:
    """A text source's splits: ``train`` and ``held_out``, or without it a held-out fraction of ``train``."""
    if held_out is None:
        train_idx, held_idx = holdout_split(len(train))
        return Splits(Split(train, train_idx), Split(train, held_idx), list(train.classes))
    return Splits(Split(train, np.arange(len(train))), Split(held_out, np.arange(len(held_out))), list(train.classes))


class TextDataset(Dataset):
    """Texts (or text pairs) with integer labels in memory, as ``(text, label)`` like torchvision's datasets.

    Args:
        texts: one string per sample.
        labels: one integer label per sample.
        classes: the class names (index = label).
        pairs: a second string per sample (sentence pairs), or ``None``.
    """

    def __init__(
        self, texts: Sequence[str], labels: Sequence[int], classes: list[str], pairs: Sequence[str] | None = None
    ) -> None:
        self.texts, self.pairs = list(texts), None if pairs is None else list(pairs)
        self.targets = [int(y) for y in labels]
        self.classes = classes

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[str | tuple[str, str], int]:
        text = self.texts[index] if self.pairs is None else (self.texts[index], self.pairs[index])
        return text, self.targets[index]


def read_text_file(path: Path, columns: dict[str, str | None]) -> dict[str, list[Any]]:
    """The named columns of a CSV, TSV or JSON Lines file (format from the extension), one list per column.

    Args:
        path: the file.
        columns: argument name (``text_column``, ...) -> column name, or ``None`` for a column not wanted.

    Raises:
        ConfigError: an unknown extension (``field="root"``) or a missing column (``field`` = its argument).
    """
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise ConfigError(
            f"{path} is not a text file loko reads: use .csv, .tsv or .jsonl (one JSON object per line).", field="root"
        )
    with path.open(newline="", encoding="utf-8") as handle:
        if FORMATS[suffix] is None:
            rows = [json.loads(line) for line in handle if line.strip()]
            header = list(rows[0]) if rows else []
        else:
            reader = csv.DictReader(handle, delimiter=FORMATS[suffix])
            rows, header = list(reader), list(reader.fieldnames or [])
    if not header:
        raise ConfigError(
            f"{path} is empty (no header row, no rows). To fix it: give a file whose first "
            f"{'object names' if FORMATS[suffix] is None else 'row names'} its columns, one sample a row",
            field="root",
        )
    out: dict[str, list[Any]] = {}
    for argument, column in columns.items():
        if column is None:
            continue
        if rows and any(column not in row for row in rows) or not rows and column not in header:
            raise ConfigError(
                f"{path} has no column {column!r} (its columns: {header}); set {argument} to one of them.",
                field=argument,
            )
        out[argument] = [row[column] for row in rows]
    return out


def check_texts(texts: Sequence[Any], where: str, field: str) -> None:
    """Every text must be a non-empty string (a tokenizer turns an empty one into special tokens only).

    Raises:
        ConfigError: naming the first bad row.
    """
    for row, text in enumerate(texts):
        if not isinstance(text, str) or not text.strip():
            what = "an empty text" if isinstance(text, str) else f"a {type(text).__name__} ({text!r}), not a string"
            raise ConfigError(
                f"{where}, row {row + 1}: {what}. To fix it: remove the row or fill in its text.", field=field
            )


def encode_labels(labels: Sequence[Any], where: str, classes: list[str] | None = None) -> tuple[list[int], list[str]]:
    """Integer ids for ``labels`` and the class names.

    Integer labels (or strings of digits, as CSV gives them) are kept, with classes ``"0" .. str(max)``; any other
    strings are mapped to the index of their name in the sorted names. With ``classes`` (the training split's), a
    name not among them is refused.

    Raises:
        ConfigError: a negative or missing label, or a name the training split did not have (``field="label_column"``).
    """
    values = [v.strip() if isinstance(v, str) else v for v in labels]
    integer = all(isinstance(v, int) and not isinstance(v, bool) or isinstance(v, str) and _INTEGER.fullmatch(v)
                  for v in values)  # fmt: skip
    if integer and (classes is None or classes == [str(i) for i in range(len(classes))]):
        ids = [int(v) for v in values]
        if ids and min(ids) < 0:
            row = ids.index(min(ids))
            message = f"{where}, row {row + 1}: label {ids[row]} is negative; labels are class ids 0, 1, ..."
            raise ConfigError(message, field="label_column")
        return ids, classes or [str(i) for i in range(max(ids, default=-1) + 1)]
    for row, value in enumerate(values):
        if not isinstance(value, (str, int)) or isinstance(value, bool) or value == "":
            raise ConfigError(f"{where}, row {row + 1}: missing or invalid label {value!r}.", field="label_column")
    names = [str(v) for v in values]
    if classes is None:
        classes = sorted(set(names))
    index = {name: i for i, name in enumerate(classes)}
    unseen = [name for name in names if name not in index]
    if unseen:
        raise ConfigError(
            f"{where}: label {unseen[0]!r} does not occur in the training split (its labels: {classes}); the "
            "held-out split can only use the training split's labels.",
            field="label_column",
        )
    return [index[name] for name in names], classes
