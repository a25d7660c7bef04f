"""What the text families share: :class:`TextSource` (their modality) and their checked in-memory splits."""

from __future__ import annotations

from typing import Any

import numpy as np

from loko_lightning.data.sources.base import Source, Split, Splits, holdout_split
from loko_lightning.data.text import TextDataset, check_texts, encode_labels


class TextSource(Source):
    """A source of text samples (``modality = "text"``): a string, or a pair of strings, per sample."""

    modality = "text"


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
