"""Writing what ``trainer.predict`` returns: one row per input, class names and probabilities, as CSV or JSON."""

from __future__ import annotations

import csv
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info

from loko_lightning.errors import ConfigError


class PredictionWriter(pl.Callback):
    """Write the learner's predictions to ``path`` when prediction ends: JSON for a ``.json`` path, else CSV.

    The rows are what :meth:`~loko_lightning.learner.module.OnlineClassifier.predict_step` returns.

    Each row names the input (the file or text the data module read, or ``held-out[i]``), the true label where it is
    known, the predicted class, its probability, and the probability of every class. Class names are the training
    data's (saved in the checkpoint), else the data module's, else the class ids. The file is written whole or not at
    all (a temporary file renamed into place).

    Args:
        path: the file to write; its folder is created.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        if self.path.suffix.lower() not in (".csv", ".json"):
            raise ConfigError(
                f"predictions={str(path)!r}: the file must end in .csv or .json (the format)", field="predictions"
            )
        self._outputs: list[dict[str, torch.Tensor]] = []

    def check_writable(self) -> None:
        """Refuse, before any prediction is made, a path whose folder cannot be made or written to.

        Raises:
            ConfigError: naming ``predictions`` and the reason.
        """
        blocking = next((p for p in self.path.parents if p.exists() and not p.is_dir()), None)
        if blocking is not None:
            raise ConfigError(
                f"cannot write {str(self.path)!r}: {str(blocking)!r} is a file, not a folder; choose another path",
                field="predictions",
            )
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle, probe = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
            os.close(handle)
            Path(probe).unlink()
        except OSError as err:
            raise ConfigError(
                f"cannot write {str(self.path)!r} ({err.strerror or err}); choose a file in a folder you can write to",
                field="predictions",
            ) from None
        if self.path.is_dir():
            raise ConfigError(f"{str(self.path)!r} is a folder; give a file name ending in .csv or .json",
                              field="predictions")  # fmt: skip

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Start empty; refuse several processes (each sees a share) or a path that cannot be written now."""
        self.check_writable()
        if trainer.world_size > 1:
            raise ConfigError(
                "prediction writes one file from one process; run it with trainer.devices=1 (num_nodes=1)",
                field="devices",
                owner=pl.Trainer,
            )
        self._outputs = []

    def on_predict_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """Keep the batch's probabilities, positions and labels (on the CPU)."""
        self._outputs.append({key: value.detach().cpu() for key, value in outputs.items()})

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Write every row at once."""
        rows = prediction_rows(self._outputs, _class_names(trainer, pl_module), _input_names(trainer))
        self._outputs = []
        write_rows(rows, self.path)
        rank_zero_info(f"Predictions: {len(rows)} rows written to {self.path}")


def prediction_rows(
    outputs: list[dict[str, torch.Tensor]], classes: list[str] | None, names: list[str] | None
) -> list[dict[str, Any]]:
    """One dict per input: ``input``, ``label`` (if known), ``predicted``, ``confidence``, ``probabilities``."""
    rows = []
    for output in outputs:
        probabilities = output["probabilities"]
        m = probabilities.shape[-1]
        named = list(classes or [])[:m]
        labels = named + [str(i) for i in range(len(named), m)]  # outputs beyond the data's classes: their ids
        indices = output.get("index", torch.arange(len(rows), len(rows) + len(probabilities)))
        for i, scores in enumerate(probabilities):
            position = int(indices[i])
            row: dict[str, Any] = {"input": names[position] if names is not None else str(position)}
            if "label" in output:
                row["label"] = labels[int(output["label"][i])]
            best = int(scores.argmax())
            row["predicted"] = labels[best]
            row["confidence"] = float(scores[best])
            row["probabilities"] = {label: float(p) for label, p in zip(labels, scores.tolist(), strict=True)}
            rows.append(row)
    return rows


def write_rows(rows: list[dict[str, Any]], path: Path) -> None:
    """``rows`` as JSON (a list of objects) or CSV (one ``p:<class>`` column per class), written atomically."""
    if path.suffix.lower() == ".json":
        text = json.dumps(rows, indent=1, ensure_ascii=False) + "\n"
    else:
        buffer = io.StringIO()
        head = [key for key in ("input", "label", "predicted", "confidence") if not rows or key in rows[0]]
        classes = list(rows[0]["probabilities"]) if rows else []
        writer = csv.writer(buffer)
        writer.writerow(head + [f"p:{name}" for name in classes])
        for row in rows:
            writer.writerow([row[key] for key in head] + [f"{p:.6g}" for p in row["probabilities"].values()])
        text = buffer.getvalue()
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8", newline="") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _class_names(trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[str] | None:
    names = getattr(pl_module, "class_names", None)
    if names is None:
        names = getattr(getattr(trainer, "datamodule", None), "classes", None)
    return None if names is None else [str(name) for name in names]


def _input_names(trainer: pl.Trainer) -> list[str] | None:
    dataset = getattr(getattr(trainer, "datamodule", None), "predict_dataset", None)
    return getattr(dataset, "names", None)
