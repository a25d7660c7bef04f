"""``textfile``: local CSV, TSV or JSON Lines files, one file (10 % held out) or a folder with a held-out file.

``root`` is a ``.csv``/``.tsv``/``.jsonl`` file or a directory with ``train.<ext>`` and ``validation.<ext>`` (or
``dev``/``test``); columns named by ``text_column``, ``text_pair_column`` and ``label_column``; string labels become
ids in the order of their sorted names.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from loko_lightning.data.sources.base import DataNotFoundError, Splits, refuse_unknown_options
from loko_lightning.data.sources.text_source import FORMATS, TextSource, read_text_file, text_dataset, text_splits

_SPLIT_NAMES = ("validation", "dev", "test")


class TextFileSource(TextSource):
    """Local text files: ``root`` is one file, or a directory with ``train.<ext>`` and a held-out file.

    Its options (:meth:`configured`) name the columns: ``text_column`` (default ``"text"``), ``text_pair_column``
    (default ``None``: single texts) and ``label_column`` (default ``"label"``).
    """

    name = "textfile"
    option_names = ("text_column", "text_pair_column", "label_column")

    def __init__(self) -> None:
        self.columns: dict[str, str | None] = {"text_column": "text", "text_pair_column": None, "label_column": "label"}

    def configured(self, modality: str | None = None, **options: Any) -> TextFileSource:
        """A copy reading the given columns.

        Raises:
            ConfigError: an option other than the column names (``field`` is its name).
        """
        refuse_unknown_options(self, options)
        out = copy.copy(self)
        out.columns = {**self.columns, **options}
        return out

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
        train = text_dataset(str(train_file), read_text_file(train_file, self.columns))
        held_out = None
        if held_file is not None:
            held_out = text_dataset(str(held_file), read_text_file(held_file, self.columns), train.classes)
        return text_splits(train, held_out)
