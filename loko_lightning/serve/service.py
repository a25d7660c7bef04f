"""``FeedbackService``: predictions, durable feedback and one learner thread around a :class:`ServingLearner`.

What ``loko serve`` does, without HTTP (the web layer, :mod:`loko_lightning.serve.app`, only reads requests and
writes answers):

- :meth:`FeedbackService.predict` answers class probabilities and keeps each input under a new ``id`` (at most
  ``pending_size`` of them and ``pending_bytes`` of inputs, each for ``pending_seconds``) so that its label can come
  later. An image is kept as it was sent (base64), or as its preprocessed tensor when that is smaller (a large image
  for a small model); the log then holds the tensor, which is learned exactly as the image would be;
- :meth:`FeedbackService.feedback` takes a label for a kept ``id``, or an input with its label; once accepted, the
  sample is in the feedback log on disk (:class:`~loko_lightning.serve.log.FeedbackLog`) before the call returns,
  then learned by the learner thread, one LoKO step per sample, in the order of the log. A full queue refuses it
  (status 429) before anything is written;
- every ``checkpoint_every`` samples the learner is saved atomically with its position in the log; opening the state
  folder again loads that checkpoint and learns the log's records after it, so that a killed server resumes exactly
  where an uninterrupted one would be.
"""

from __future__ import annotations

import collections
import math
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from torch import Tensor

from loko_lightning.errors import ConfigError
from loko_lightning.serve.batcher import PredictionBatcher
from loko_lightning.serve.images import ImageTooLarge
from loko_lightning.serve.inputs import input_bytes, loggable
from loko_lightning.serve.learner import ServingLearner
from loko_lightning.serve.learning import SAVE_RETRY_SECONDS, LearningLoop
from loko_lightning.serve.limits import MAX_PIXELS, PENDING_BYTES, QUEUE_BYTES
from loko_lightning.serve.lock import CHECKPOINT_NAME, LOG_NAME, StateLock, check_base
from loko_lightning.serve.log import FeedbackLog
from loko_lightning.serve.metrics import WINDOW, service_metrics
from loko_lightning.serve.pending import PendingPredictions


class Rejected(Exception):
    """A request refused: its HTTP status, the field it is about, and one line saying why."""

    def __init__(self, status: int, field: str, message: str) -> None:
        super().__init__(message)
        self.status, self.field, self.message = status, field, message


class FeedbackService(LearningLoop):
    """Predict, accept feedback durably, learn it in order in one thread, checkpoint with the log position.

    Args:
        learner: the learner, as loaded (from the state folder's checkpoint, or from the trained checkpoint).
        state_dir: the folder of the feedback log and the serving checkpoint.
        queue_size: accepted feedback waiting for the learner, at most; beyond it feedback is refused (429).
        checkpoint_every: save the learner every this many learned samples (and when the service stops).
        max_batch: inputs per prediction request, at most.
        pending_size: predictions kept for a later label, at most (the oldest is forgotten first).
        pending_seconds: how long a prediction is kept for its label.
        pending_bytes: the kept predictions' inputs, at most, in bytes (the oldest is forgotten first).
        queue_bytes: the queued feedback's inputs, at most, in bytes; beyond it feedback is refused (429) unless the
            queue is empty (one input is always taken, whatever its size).
        max_pixels: an image input's width x height, at most (413), checked before it is decoded.
        predict_batch: inputs in one forward pass, at most: concurrent requests are predicted together
            (:class:`~loko_lightning.serve.batcher.PredictionBatcher`).
        lock: the state folder's lock, already taken (:meth:`open` takes it before it reads the checkpoint); ``None``:
            taken here. Another owner of the folder is refused (one server per state folder).
    """

    def __init__(
        self,
        learner: ServingLearner,
        state_dir: str | Path,
        *,
        queue_size: int = 1000,
        checkpoint_every: int = 100,
        max_batch: int = 32,
        pending_size: int = 10000,
        pending_seconds: float = 3600.0,
        pending_bytes: int = PENDING_BYTES,
        queue_bytes: int = QUEUE_BYTES,
        max_pixels: int = MAX_PIXELS,
        predict_batch: int = 64,
        lock: StateLock | None = None,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.lock = lock if lock is not None else StateLock(self.state_dir)
        try:
            limits = {
                "queue_size": queue_size,
                "checkpoint_every": checkpoint_every,
                "max_batch": max_batch,
                "pending_size": pending_size,
                "pending_bytes": pending_bytes,
                "queue_bytes": queue_bytes,
                "max_pixels": max_pixels,
                "predict_batch": predict_batch,
            }
            self._open(learner, limits, pending_seconds)
        except BaseException:  # refused (a damaged log, ...): nothing of it stays open
            if hasattr(self, "_batcher"):
                self._batcher.close()
            if hasattr(self, "log"):
                self.log.close()
            self.lock.release()
            raise

    def _open(self, learner: ServingLearner, limits: dict[str, int], pending_seconds: float) -> None:
        for name, value in limits.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}", field=name)
        if not 0 < pending_seconds < math.inf:
            raise ConfigError(
                f"pending_seconds must be positive and finite, got {pending_seconds!r}", field="pending_seconds"
            )
        self.learner = learner
        self.queue_size, self.checkpoint_every = limits["queue_size"], limits["checkpoint_every"]
        self.max_batch, self.max_pixels = limits["max_batch"], limits["max_pixels"]
        self.pending_size, self.pending_seconds = limits["pending_size"], pending_seconds
        self.pending_bytes, self.queue_bytes = limits["pending_bytes"], limits["queue_bytes"]
        self.queue_bytes_used = 0
        # One forward pass at a time, over the requests that waited for it: the learner keeps a core.
        self._steps_done = self._steps_at_pass = 0
        self._batcher = PredictionBatcher(
            lambda inputs: self.learner.predict_with_version(inputs),
            max_inputs=limits["predict_batch"],
            before_pass=self._yield_to_learner,
        )
        self.log = FeedbackLog(self.state_dir / LOG_NAME)
        self.position = int(learner.extra.get("log_position", 0))
        if self.position > self.log.count:
            raise ConfigError(
                f"the checkpoint in {self.state_dir} has learned {self.position} feedback records but the log holds "
                f"{self.log.count}: the log was replaced or cut; serve with the log that goes with it, or a new "
                "state_dir",
                field="state_dir",
            )
        self._keys: dict[str, int] = {}
        for record in self.log.records():
            if record.get("key") is not None:
                self._keys[record["key"]] = record["seq"]
        self._pending = PendingPredictions(self.pending_size, self.pending_seconds, self.pending_bytes)
        self._queue: collections.deque[tuple[dict[str, Any], float, int]] = collections.deque()
        self._accept = threading.Lock()  # one appender: log order is queue order
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        # What keeps the service from its work, for /health: None while all is well.
        self._failure: str | None = None  # the learner thread ended: nothing is learned until a restart
        self._save_error: str | None = None  # the last checkpoint write failed (retried)
        self._save_failed_at = -math.inf
        self._log_error: str | None = None  # the last feedback could not be written to the log
        self._step_error: str | None = None  # the last step raised (its sample was skipped)
        self.save_retry_seconds = SAVE_RETRY_SECONDS
        self.accepted = self.log.count
        self.predictions = 0
        self.refused_busy = 0
        self.step_seconds: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.step_seconds_sum, self.step_count = 0.0, 0
        self.lags: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.lag_sum, self.lag_count = 0.0, 0
        self.replayed = 0
        for record in self.log.records(after=self.position):
            self._learn(record)
            self.replayed += 1
        self._saved_position = self.position
        if self.replayed:
            self.save()

    @classmethod
    def open(cls, ckpt_path: str | Path, state_dir: str | Path, **options: Any) -> FeedbackService:
        """The service of a state folder: its newest checkpoint (else ``ckpt_path``) and the log learned after it."""
        lock = StateLock(state_dir)  # before anything is read: a second server is refused at once
        try:
            check_base(ckpt_path, state_dir)
            saved = Path(state_dir) / CHECKPOINT_NAME
            if not saved.is_file():
                learner = ServingLearner.from_checkpoint(ckpt_path)
            else:
                try:
                    learner = ServingLearner.from_checkpoint(saved)
                except Exception as err:
                    raise ConfigError(
                        f"the serving checkpoint {saved} is damaged ({' '.join(str(err).split())[:300]}): remove it; "
                        f"the next start learns the whole feedback log again from --ckpt_path, which gives the same "
                        "state exactly",
                        field="state_dir",
                    ) from None
            return cls(learner, state_dir, lock=lock, **options)
        except BaseException:
            lock.release()
            raise

    # ------------------------------------------------------------------ the learner thread
    def start(self) -> None:
        """Start the learner thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="loko-learner", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Learn what is queued (it is in the log already), stop the learner thread and save a checkpoint.

        A checkpoint that cannot be written is reported, not raised: the log holds every record after the last one,
        and the next start learns them again (exactly).
        """
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        try:
            if self._thread is not None:
                self._thread.join()
                self._thread = None
            if self.position != self._saved_position and self._failure is None:
                self._try_save()
        finally:
            self._batcher.close()
            self.log.close()
            self.lock.release()

    @property
    def queue_length(self) -> int:
        """Accepted feedback not learned yet (the one being learned included)."""
        return len(self._queue)

    @property
    def pending_bytes_used(self) -> int:
        """The bytes of the kept predictions' inputs."""
        return self._pending.bytes_used

    # ------------------------------------------------------------------ requests
    def predict(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        """``{"inputs": [...]}`` → one ``{"id", "label", "probabilities", "version"}`` per input.

        Raises:
            Rejected: no ``inputs`` list (400), too many (413), an input that does not decode (422).
        """
        inputs = body.get("inputs")
        if not isinstance(inputs, list) or not inputs:
            raise Rejected(400, "inputs", "inputs must be a non-empty list")
        if len(inputs) > self.max_batch:
            raise Rejected(413, "inputs", f"{len(inputs)} inputs: at most {self.max_batch} per request")
        samples = []
        for i, value in enumerate(inputs):
            try:
                samples.append(self.learner.decode(value, field=f"inputs[{i}]", max_pixels=self.max_pixels))
            except ImageTooLarge as err:
                raise Rejected(413, err.field or f"inputs[{i}]", str(err)) from None
            except ConfigError as err:
                raise Rejected(422, err.field or f"inputs[{i}]", str(err)) from None
        if self.learner.modality == "image":  # preprocessed here, in the request's thread: kept if smaller
            samples = [self.learner.transform(sample) for sample in samples]
        probabilities, version = self._batcher(samples)
        classes = self.learner.classes
        answers = []
        for value, sample, scores in zip(inputs, samples, probabilities.tolist(), strict=True):
            best = max(range(len(scores)), key=scores.__getitem__)
            ident = uuid.uuid4().hex
            if isinstance(sample, Tensor) and input_bytes(sample) < input_bytes(value):
                value = sample
            self._pending.remember(ident, value, best)
            answers.append(prediction_answer(ident, classes, scores, best, version))
        self.predictions += len(answers)
        return answers

    def feedback(self, body: dict[str, Any]) -> dict[str, Any]:
        """``{"id", "label"}`` or ``{"input", "label"[, "key"]}``: on disk when this returns, then learned in order.

        A feedback whose ``id`` (or ``key``) was accepted before is not learned again: the answer names the first one's
        ``seq`` with ``"duplicate": true`` (a client may resend what it got no answer for).

        Raises:
            Rejected: a missing or bad field (400), a label not among the classes or an input that does not decode
                (422), an unknown or expired ``id`` (404), a full queue (429).
        """
        if "label" not in body:
            raise Rejected(400, "label", "label is missing")
        try:
            label = self.learner.label_index(body["label"])
        except ConfigError as err:
            raise Rejected(422, "label", str(err)) from None
        predicted = None
        if "id" in body:
            key = body["id"]
            if not isinstance(key, str):
                raise Rejected(400, "id", "id must be the string a prediction answered")
            kept = self._pending.get(key)
            if kept is None:
                if key in self._keys:
                    return {"seq": self._keys[key], "duplicate": True}
                raise Rejected(404, "id", f"id {key[:64]!r} is unknown or expired: send the input with its label")
            value, predicted = kept
            if isinstance(value, Tensor):
                value = loggable(value)
        elif "input" in body:
            value, key = body["input"], body.get("key")
            if key is not None and (not isinstance(key, str) or not 0 < len(key) <= 200):
                raise Rejected(400, "key", "key must be a string of 1 to 200 characters")
            try:
                self.learner.decode(value, field="input", max_pixels=self.max_pixels)
            except ImageTooLarge as err:
                raise Rejected(413, "input", str(err)) from None
            except ConfigError as err:
                raise Rejected(422, "input", str(err)) from None
        else:
            raise Rejected(400, "id", "give the id of a prediction, or the input, with its label")
        record = {"input": value, "label": label, "predicted": predicted, "key": key}
        size = input_bytes(value)
        with self._accept:
            if key is not None and key in self._keys:
                return {"seq": self._keys[key], "duplicate": True}
            if self._failure is not None:
                raise Rejected(
                    503,
                    "feedback",
                    f"{self._failure}: nothing is learned until the server is restarted; restart it "
                    "(the log is kept, nothing acknowledged is lost)",
                )
            if len(self._queue) >= self.queue_size:
                self.refused_busy += 1
                raise Rejected(429, "feedback", f"the learner's queue is full ({self.queue_size}): retry later")
            if self._queue and self.queue_bytes_used + size > self.queue_bytes:
                self.refused_busy += 1
                raise Rejected(
                    429,
                    "feedback",
                    f"the learner's queue holds {self.queue_bytes_used:,} bytes of inputs and this one is {size:,}; "
                    f"at most {self.queue_bytes:,} (--queue_bytes): retry later",
                )
            try:
                seq = self.log.append(record)
            except OSError as err:  # disk full, ...: nothing was accepted
                self._log_error = f"the feedback log {self.log.path} cannot be written ({err.strerror or err})"
                raise Rejected(
                    503,
                    "feedback",
                    f"{self._log_error}: nothing was accepted; free space for --state_dir "
                    f"{str(self.state_dir)!r} (or fix its permissions) and send it again",
                ) from None
            self._log_error = None
            acknowledged = time.monotonic()
            if key is not None:
                self._keys[key] = seq
            with self._wake:
                self._queue.append(({"seq": seq, **record}, acknowledged, size))
                self.queue_bytes_used += size
                self._wake.notify_all()
            self.accepted = seq
        if "id" in body:
            self._pending.forget(key)
        return {"seq": seq, "duplicate": False}

    # ------------------------------------------------------------------ health and metrics
    @property
    def status(self) -> tuple[str, str | None]:
        """The service's status and why: ``ok``, ``degraded`` or ``failed``.

        ``("degraded", reason)``: it learns, but something failed (a checkpoint write, the last step, the last log
        write); ``("failed", reason)``: the learner thread ended, nothing is learned until a restart.
        """
        if self._failure is not None:
            return "failed", self._failure
        reasons = [r for r in (self._log_error, self._save_error, self._step_error) if r is not None]
        return ("degraded", "; ".join(reasons)) if reasons else ("ok", None)

    @property
    def alive(self) -> bool:
        """Liveness: the learner thread has not ended by an error (``False``: restart the process)."""
        return self._failure is None

    @property
    def ready(self) -> tuple[bool, str | None]:
        """Readiness: feedback would be accepted now (the learner runs, the log takes writes, not stopping)."""
        if self._failure is not None:
            return False, self._failure
        if self._thread is None or self._stopping:
            return False, "the learner thread is not running (starting or stopping)"
        if self._log_error is not None:
            return False, self._log_error
        return True, None

    def health(self) -> dict[str, Any]:
        """Status (with its ``reason`` unless ok), samples accepted and learned, queue length, parameter version."""
        status, reason = self.status
        return {
            "status": status,
            **({"reason": reason} if reason is not None else {}),
            "accepted": self.accepted,
            "learned": self.position,
            "queue": self.queue_length,
            "version": self.learner.version,
            "classes": self.learner.classes,
        }

    def metrics(self) -> str:
        """The Prometheus text exposition of the service's counters and gauges."""
        return service_metrics(self)


def prediction_answer(ident: str | None, classes: list[str], scores: list[float], best: int, version: int) -> dict:
    """One input's answer to ``/predict``: its id (``None``: no label can follow), label, probabilities, version."""
    return {
        "id": ident,
        "label": classes[best],
        "probabilities": dict(zip(classes, scores, strict=True)),
        "version": version,
    }
