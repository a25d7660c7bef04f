"""``loko serve --follow STATE_DIR``: a read-only replica that predicts with the learner's latest checkpoint.

Learning is sequential (one learner per state folder, :mod:`~loko_lightning.serve.lock`); predictions are not. A
follower loads the learner's serving checkpoint (``STATE_DIR/learner.ckpt``, else the base checkpoint the folder
records in ``base.json``), predicts with it, and loads it again whenever the learner writes a new one (an atomic
rename, so a follower never reads half a file): the new learner is built aside and swapped in whole, so every
prediction comes from one complete checkpoint, whose version (samples learned) it answers. It takes no lock and
writes nothing; ``/feedback`` is refused (409) with where to send it. Run one learner and N followers behind a load
balancer that sends ``/feedback`` to the learner.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from loko_lightning.errors import ConfigError
from loko_lightning.serve.batcher import PredictionBatcher
from loko_lightning.serve.images import ImageTooLarge
from loko_lightning.serve.learner import ServingLearner
from loko_lightning.serve.limits import MAX_PIXELS
from loko_lightning.serve.lock import BASE_NAME, CHECKPOINT_NAME
from loko_lightning.serve.metrics import prometheus_value
from loko_lightning.serve.service import Rejected, prediction_answer

# How often a follower looks for a new checkpoint, by default (seconds).
FOLLOW_SECONDS = 1.0


class FollowerService:
    """Predict with a state folder's newest checkpoint, reloaded when it changes; no feedback, no writes.

    Args:
        state_dir: the learner's state folder.
        max_batch: inputs per prediction request, at most.
        max_pixels: an image input's width x height, at most (413).
        predict_batch: inputs in one forward pass, at most.
        follow_seconds: how often the checkpoint's file is looked at.

    Raises:
        ConfigError: (field ``follow``) the folder has neither a serving checkpoint nor a recorded base checkpoint.
    """

    def __init__(
        self,
        state_dir: str | Path,
        *,
        max_batch: int = 32,
        max_pixels: int = MAX_PIXELS,
        predict_batch: int = 64,
        follow_seconds: float = FOLLOW_SECONDS,
    ) -> None:
        if not 0 < follow_seconds < math.inf:
            raise ConfigError(f"follow_seconds must be positive and finite, got {follow_seconds!r}", field="follow")
        self.state_dir = Path(state_dir)
        self.max_batch, self.max_pixels, self.follow_seconds = max_batch, max_pixels, follow_seconds
        self._seen: tuple[int, int, int] | None = None
        self.learner = self._load()
        self.reloads = 0
        self.predictions = 0
        self._reload_error: str | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._batcher = PredictionBatcher(
            lambda inputs: self.learner.predict_with_version(inputs), max_inputs=predict_batch
        )

    def _source(self) -> Path:
        saved = self.state_dir / CHECKPOINT_NAME
        if saved.is_file():
            return saved
        base = self.state_dir / BASE_NAME
        if base.is_file():
            return Path(json.loads(base.read_text(encoding="utf-8"))["ckpt_path"])
        raise ConfigError(
            f"{str(self.state_dir)!r} has no {CHECKPOINT_NAME} and no {BASE_NAME}: start the learner on it first "
            "(loko serve --ckpt_path CKPT --state_dir STATE_DIR), then follow it",
            field="follow",
        )

    def _stamp(self) -> tuple[int, int, int] | None:
        try:
            stat = (self.state_dir / CHECKPOINT_NAME).stat()
        except FileNotFoundError:
            return None
        return stat.st_ino, stat.st_mtime_ns, stat.st_size

    def _load(self) -> ServingLearner:
        """The learner of the newest checkpoint, read from one file even if the learner renames a newer one over it.

        ``ServingLearner.from_checkpoint`` reads its path twice (the network, then the filter state); between the two
        the learner may write the next checkpoint. The file is opened once and read through its descriptor, so both
        reads see the same one.
        """
        with open(self._source(), "rb") as handle:
            stat = os.fstat(handle.fileno())
            pinned = Path(f"/proc/self/fd/{handle.fileno()}")
            if pinned.exists():
                learner = ServingLearner.from_checkpoint(pinned)
            else:  # no /proc: a private copy
                with tempfile.TemporaryDirectory(prefix="loko-follow-") as folder:
                    copy = Path(folder) / CHECKPOINT_NAME
                    with open(copy, "wb") as out:
                        shutil.copyfileobj(handle, out)
                    learner = ServingLearner.from_checkpoint(copy)
        if handle.name == str(self.state_dir / CHECKPOINT_NAME):
            self._seen = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        return learner

    # ------------------------------------------------------------------ the follower thread
    def start(self) -> None:
        """Start looking for new checkpoints."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._follow, name="loko-follow", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop looking, and predict no more."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._batcher.close()

    def _follow(self) -> None:
        while not self._stopping.wait(self.follow_seconds):
            if self._stamp() == self._seen:
                continue
            try:
                learner = self._load()
            except Exception as err:  # a damaged file: keep predicting with the last good one, say so
                self._reload_error = (
                    f"the checkpoint {self.state_dir / CHECKPOINT_NAME} could not be loaded "
                    f"({type(err).__name__}: {' '.join(str(err).split())[:200]}); predicting with version "
                    f"{self.learner.version}, tried again every {self.follow_seconds:g} s"
                )
                print(f"loko serve: {self._reload_error}", file=sys.stderr, flush=True)
                continue
            self.learner = learner  # one assignment: a prediction reads the old learner or the new one, whole
            self.reloads += 1
            self._reload_error = None

    # ------------------------------------------------------------------ requests
    def predict(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        """``{"inputs": [...]}`` → one ``{"id": null, "label", "probabilities", "version"}`` per input."""
        inputs = body.get("inputs")
        if not isinstance(inputs, list) or not inputs:
            raise Rejected(400, "inputs", "inputs must be a non-empty list")
        if len(inputs) > self.max_batch:
            raise Rejected(413, "inputs", f"{len(inputs)} inputs: at most {self.max_batch} per request")
        learner = self.learner
        samples = []
        for i, value in enumerate(inputs):
            try:
                samples.append(learner.decode(value, field=f"inputs[{i}]", max_pixels=self.max_pixels))
            except ImageTooLarge as err:
                raise Rejected(413, err.field or f"inputs[{i}]", str(err)) from None
            except ConfigError as err:
                raise Rejected(422, err.field or f"inputs[{i}]", str(err)) from None
        probabilities, version = self._batcher(samples)
        classes = learner.classes
        answers = []
        for scores in probabilities.tolist():
            best = max(range(len(scores)), key=scores.__getitem__)
            answers.append(prediction_answer(None, classes, scores, best, version))
        self.predictions += len(answers)
        return answers

    def feedback(self, body: dict[str, Any]) -> dict[str, Any]:
        """Refused: a follower learns nothing (409)."""
        raise Rejected(
            409,
            "feedback",
            f"this server follows {str(self.state_dir)!r} read-only: send feedback (the input with its label) to the "
            "learner serving that state_dir",
        )

    # ------------------------------------------------------------------ health and metrics
    @property
    def status(self) -> tuple[str, str | None]:
        """``ok``, or ``degraded`` with the reason while the newest checkpoint cannot be loaded."""
        return ("degraded", self._reload_error) if self._reload_error is not None else ("ok", None)

    @property
    def alive(self) -> bool:
        """Liveness: always, while the process answers (a failed reload keeps the last good checkpoint)."""
        return True

    @property
    def ready(self) -> tuple[bool, str | None]:
        """Readiness: following (started, not stopping)."""
        if self._thread is None or self._stopping.is_set():
            return False, "not following (starting or stopping)"
        return True, None

    def health(self) -> dict[str, Any]:
        """Status, the role, the version predictions read, reloads, the classes."""
        status, reason = self.status
        return {
            "status": status,
            **({"reason": reason} if reason is not None else {}),
            "role": "follower",
            "version": self.learner.version,
            "reloads": self.reloads,
            "classes": self.learner.classes,
            "age_seconds": self._age(),
        }

    def _age(self) -> float | None:
        stamp = self._stamp()
        return None if stamp is None else round(time.time() - stamp[1] / 1e9, 3)

    def metrics(self) -> str:
        """The Prometheus text of the follower's gauges and counters."""
        rows = [
            (
                "loko_parameter_version",
                "gauge",
                "samples learned by the checkpoint predictions read",
                self.learner.version,
            ),
            ("loko_predictions_total", "counter", "inputs predicted since the start", self.predictions),
            ("loko_checkpoint_reloads_total", "counter", "newer checkpoints loaded since the start", self.reloads),
        ]
        lines = []
        for name, kind, help_text, value in rows:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {prometheus_value(value)}"]
        return "\n".join(lines) + "\n"
