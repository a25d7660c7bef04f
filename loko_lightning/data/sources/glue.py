"""``sst2``, ``cola``, ``mrpc``: the paper's GLUE tasks through Hugging Face ``datasets``.

``datasets.load_dataset("nyu-mll/glue", task)``; the held-out split is GLUE's validation split (GLUE's test labels
are hidden). MRPC is a sentence pair.
"""

from __future__ import annotations

from typing import Literal

from loko_lightning.data.sources.base import DataNotFoundError, Splits, hf_datasets
from loko_lightning.data.sources.text_source import TextSource, text_dataset, text_splits
from loko_lightning.errors import ConfigError

# GLUE task -> (text column, pair column or None, class names).
GLUE_TASKS = {
    "sst2": ("sentence", None, ["negative", "positive"]),
    "cola": ("sentence", None, ["unacceptable", "acceptable"]),
    "mrpc": ("sentence1", "sentence2", ["not_equivalent", "equivalent"]),
}


class Glue(TextSource):
    """A GLUE task from the Hugging Face hub through ``datasets`` (cached in the Hugging Face cache, ``HF_HOME``).

    Args:
        task: ``sst2``, ``cola`` or ``mrpc`` (:data:`GLUE_TASKS`).
        max_length: at most this many tokens per sample (longer texts are truncated).
    """

    def __init__(self, task: Literal["sst2", "cola", "mrpc"] = "sst2", max_length: int = 128) -> None:
        super().__init__(max_length)
        if task not in GLUE_TASKS:
            raise ConfigError(
                f"task={task!r} is not a GLUE task loko reads; choose one of {', '.join(GLUE_TASKS)}.",
                field="task",
                owner=type(self),
            )
        self.task = task
        self.name = task
        self.num_classes = len(GLUE_TASKS[task][2])

    def location(self) -> str:
        """The Hugging Face datasets cache."""
        return "the Hugging Face datasets cache (HF_HOME)"

    def load(self) -> Splits:
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
                "splits to train.tsv and validation.tsv and use the TextFile source with root set to their folder.",
                field="source",
            ) from err
        out = []
        for split in ("train", "validation"):
            rows = glue[split]
            columns = {"text_column": rows[text], "label_column": [classes[i] for i in rows["label"]]}
            if pair is not None:
                columns["text_pair_column"] = rows[pair]
            out.append(text_dataset(f"GLUE {self.name} {split}", columns, classes, {"text_column": "dataset"}))
        return text_splits(*out)
