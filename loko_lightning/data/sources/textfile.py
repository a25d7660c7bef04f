"""``textfile``: local CSV, TSV or JSON Lines files, one file (10 % held out) or a folder with a held-out file.

``root`` is a ``.csv``/``.tsv``/``.jsonl`` file or a directory with ``train.<ext>`` and ``validation.<ext>`` (or
``dev``/``test``); columns named by ``text_column``, ``text_pair_column`` and ``label_column``; string labels become
ids in the order of their sorted names.
"""

from __future__ import annotations

from pathlib import Path

from loko_lightning.data.sources.base import DataNotFoundError, Splits
from loko_lightning.data.sources.text_source import FORMATS, TextSource, read_text_file, text_dataset, text_splits

_SPLIT_NAMES = ("validation", "dev", "test")


class TextFile(TextSource):
    """``textfile``: local text files, ``root`` one file or a directory with ``train.<ext>`` and a held-out file.

    Args:
        root: a ``.csv``/``.tsv``/``.jsonl`` file, or a directory holding ``train.<ext>`` and optionally
            ``validation.<ext>`` (or ``dev``/``test``).
        text_column: the column holding the text.
        text_pair_column: the column holding the second text of a pair (``None``: single texts).
        label_column: the column holding the label (class ids, or names mapped to ids in sorted order; the mapping is
            saved in checkpoints and printed at setup).
        max_length: at most this many tokens per sample (longer texts are truncated).
    """

    name = "textfile"

    def __init__(
        self,
        root: str = "data",
        text_column: str = "text",
        text_pair_column: str | None = None,
        label_column: str = "label",
        max_length: int = 128,
    ) -> None:
        super().__init__(max_length)
        self.root = Path(root).expanduser()
        self.text_column, self.text_pair_column, self.label_column = text_column, text_pair_column, label_column
        self.columns: dict[str, str | None] = {
            "text_column": text_column, "text_pair_column": text_pair_column, "label_column": label_column,
        }  # fmt: skip

    def missing(self, download: bool, reason: str = "") -> DataNotFoundError:
        """No file: say which layout is expected."""
        return DataNotFoundError(
            f"dataset='textfile': no text file at {self.root}. Set root to a .csv/.tsv/.jsonl file, or to a directory "
            "holding train.csv (or .tsv/.jsonl) and optionally validation.csv.",
            field="root",
        )

    def load(self) -> Splits:
        """The training file and the held-out one (or 10 % of the training file), labels mapped alike."""
        root = self.root
        if root.is_file():
            train_file, held_file = root, None
        elif root.is_dir():
            found = {p.stem: p for p in sorted(root.iterdir()) if p.suffix.lower() in FORMATS}
            if "train" not in found:
                raise self.missing(False)
            train_file = found["train"]
            held_file = next((found[name] for name in _SPLIT_NAMES if name in found), None)
        else:
            raise self.missing(False)
        train = text_dataset(str(train_file), read_text_file(train_file, self.columns))
        held_out = None
        if held_file is not None:
            held_out = text_dataset(str(held_file), read_text_file(held_file, self.columns), train.classes)
        return text_splits(train, held_out)
