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

import base64
import collections
import hashlib
import json
import math
import os
import sys
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from loko_lightning.errors import ConfigError
from loko_lightning.serve.batcher import PredictionBatcher
from loko_lightning.serve.images import ImageTooLarge
from loko_lightning.serve.learner import ServingLearner
from loko_lightning.serve.limits import MAX_PIXELS, PENDING_BYTES, QUEUE_BYTES
from loko_lightning.serve.lock import StateLock
from loko_lightning.serve.log import FeedbackLog

CHECKPOINT_NAME = "learner.ckpt"
LOG_NAME = "feedback.log"
# The base checkpoint a state folder was started from, by hash: another one is refused.
BASE_NAME = "base.json"
# How many of the last step times and feedback lags the quantiles in /metrics are computed over.
WINDOW = 1000
# The inputs of kept predictions, and of queued feedback, at most (bytes of their JSON strings).
# A prediction pass waits for the learner's next step at most this long (see FeedbackService._yield_to_learner).
PASS_WAIT_SECONDS = 1.0
# A checkpoint that could not be written (disk full, ...) is tried again after this many seconds.
SAVE_RETRY_SECONDS = 5.0


class Rejected(Exception):
    """A request refused: its HTTP status, the field it is about, and one line saying why."""

    def __init__(self, status: int, field: str, message: str) -> None:
        super().__init__(message)
        self.status, self.field, self.message = status, field, message


class FeedbackService:
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
        self.pending_bytes_used = self.queue_bytes_used = 0
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
        # id -> (input, predicted class, expiry time, input bytes)
        self._pending: collections.OrderedDict[str, tuple[Any, int, float, int]] = collections.OrderedDict()
        self._pending_lock = threading.Lock()
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

    def _run(self) -> None:
        """The learner thread: the queue in order; an error that ends it is kept for /health, never silent."""
        try:
            self._learn_queue()
        except BaseException as err:
            self._failure = f"the learner thread stopped ({type(err).__name__}: {' '.join(str(err).split())[:200]})"
            print(f"loko serve: {self._failure}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            with self._wake:
                self._wake.notify_all()

    def _learn_queue(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._stopping:
                    if self._save_error is not None and self._save_due():
                        break
                    # With a checkpoint to write again, wake up for it even when no feedback comes.
                    self._wake.wait(self.save_retry_seconds if self._save_error is not None else None)
                if not self._queue:
                    if self._stopping:
                        return
                    record = None
                else:
                    record, acknowledged, size = self._queue[0]
            if record is None:  # idle, and a failed checkpoint is due again
                self._try_save()
                continue
            self._learn(record)
            done = time.monotonic()
            with self._wake:
                self._queue.popleft()
                self.queue_bytes_used -= size
                self._steps_done += 1
                self._wake.notify_all()
            self.lags.append(done - acknowledged)
            self.lag_sum += done - acknowledged
            self.lag_count += 1
            if self.position - self._saved_position >= self.checkpoint_every and self._save_due():
                self._try_save()

    def _yield_to_learner(self) -> None:
        """Before a prediction pass: while feedback waits to be learned, one pass per learned sample at most.

        Passes and steps then alternate on the CPU instead of passes crowding out the learner, whose lag stays
        bounded; the requests that wait meanwhile are predicted together in the next pass. Never more than
        ``PASS_WAIT_SECONDS``: predictions go on if the learner is stuck.
        """
        with self._wake:
            self._wake.wait_for(
                lambda: (
                    not self._queue
                    or self._stopping
                    or self._failure is not None
                    or self._steps_done != self._steps_at_pass
                ),
                PASS_WAIT_SECONDS,
            )
            self._steps_at_pass = self._steps_done

    def _save_due(self) -> bool:
        return time.monotonic() - self._save_failed_at >= self.save_retry_seconds

    def _try_save(self) -> None:
        """:meth:`save`; a failure (disk full, ...) is reported (stderr, /health) and tried again later."""
        try:
            self.save()
        except Exception as err:
            self._save_failed_at = time.monotonic()
            self._save_error = (
                f"the checkpoint {self.state_dir / CHECKPOINT_NAME} could not be written ({type(err).__name__}: "
                f"{' '.join(str(err).split())[:200]}); tried again every {self.save_retry_seconds:g} s; the feedback "
                f"log holds every record after position {self._saved_position}, which a restart learns again"
            )
            print(f"loko serve: {self._save_error}", file=sys.stderr, flush=True)
        else:
            if self._save_error is not None:
                print("loko serve: the checkpoint is written again", file=sys.stderr, flush=True)
            self._save_error = None

    def _learn(self, record: dict[str, Any]) -> None:
        """One record of the log: one LoKO step (or one skipped sample), the log position moved past it."""
        learner = self.learner
        try:
            sample = _tensor(record["input"])
            if sample is None:  # accepted, so learned whatever today's --max_pixels
                sample = learner.decode(record["input"], max_pixels=None)
        except ConfigError as err:  # accepted inputs are checked; a log edited by hand may still hold one
            print(f"loko serve: feedback {record['seq']} skipped: {err}", file=sys.stderr)
            learner.skip()
        else:
            try:
                (result,) = learner.learn([sample], [record["label"]])
            except Exception as err:  # the learner thread goes on with the next record whatever one step raises
                reason = f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"
                print(f"loko serve: feedback {record['seq']} skipped: {reason}", file=sys.stderr)
                self._step_error = f"the step of feedback {record['seq']} raised ({reason}); it was skipped"
                learner.skip()
            else:
                self._step_error = None
                self.step_seconds.append(result.seconds)
                self.step_seconds_sum += result.seconds
                self.step_count += 1
        if record.get("predicted") is not None:
            learner.record_served(int(record["predicted"]), int(record["label"]))
        self.position = int(record["seq"])

    def save(self) -> None:
        """Write the learner's checkpoint with the log position it has learned up to (atomically)."""
        self.learner.save(self.state_dir / CHECKPOINT_NAME, log_position=self.position)
        self._saved_position = self.position

    def wait_learned(self, timeout: float | None = None) -> bool:
        """Wait until every accepted feedback is learned; whether it was (``False`` too if the learner stopped)."""
        with self._wake:
            self._wake.wait_for(lambda: not self._queue or self._failure is not None, timeout)
            return not self._queue

    @property
    def queue_length(self) -> int:
        """Accepted feedback not learned yet (the one being learned included)."""
        return len(self._queue)

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
            if isinstance(sample, Tensor) and _input_bytes(sample) < _input_bytes(value):
                value = sample
            self._remember(ident, value, best)
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
            with self._pending_lock:
                self._forget_expired()
                kept = self._pending.get(key)
            if kept is None:
                if key in self._keys:
                    return {"seq": self._keys[key], "duplicate": True}
                raise Rejected(404, "id", f"id {key[:64]!r} is unknown or expired: send the input with its label")
            value, predicted, _, _ = kept
            if isinstance(value, Tensor):
                value = _loggable(value)
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
        size = _input_bytes(value)
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
            with self._pending_lock:
                self._forget(key)
        return {"seq": seq, "duplicate": False}

    def _remember(self, ident: str, value: Any, predicted: int) -> None:
        size = _input_bytes(value)
        with self._pending_lock:
            self._forget_expired()
            self._pending[ident] = (value, predicted, time.monotonic() + self.pending_seconds, size)
            self.pending_bytes_used += size
            while len(self._pending) > self.pending_size or self.pending_bytes_used > self.pending_bytes:
                self._forget(next(iter(self._pending)))

    def _forget(self, ident: str) -> None:
        kept = self._pending.pop(ident, None)
        if kept is not None:
            self.pending_bytes_used -= kept[3]

    def _forget_expired(self) -> None:
        now = time.monotonic()
        while self._pending:
            ident, (_, _, expires, _) = next(iter(self._pending.items()))
            if expires > now:
                return
            self._forget(ident)

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
        learner = self.learner
        rows: list[tuple[str, str, str, list[tuple[str, float]]]] = [
            ("loko_feedback_accepted_total", "counter", "feedback accepted (in the log)", [("", self.accepted)]),
            (
                "loko_samples_learned_total",
                "counter",
                "feedback samples learned (skipped ones included)",
                [("", self.position)],
            ),
            (
                "loko_samples_skipped_total",
                "counter",
                "samples whose update was not finite (nothing changed)",
                [("", learner.skipped)],
            ),
            (
                "loko_feedback_refused_busy_total",
                "counter",
                "feedback refused because the queue was full (429)",
                [("", self.refused_busy)],
            ),
            ("loko_predictions_total", "counter", "inputs predicted since the start", [("", self.predictions)]),
            (
                "loko_online_accuracy",
                "gauge",
                "accuracy of the served predictions that received feedback",
                [("", learner.served_accuracy)],
            ),
            (
                "loko_prequential_accuracy",
                "gauge",
                "accuracy of each learned sample's prediction just before its step",
                [("", learner.online_accuracy)],
            ),
            (
                "loko_status",
                "gauge",
                "1 for the status /health says: ok, degraded (it learns; something failed), failed (it does not)",
                [(f'{{status="{name}"}}', int(name == self.status[0])) for name in ("ok", "degraded", "failed")],
            ),
            ("loko_queue_length", "gauge", "accepted feedback waiting for the learner", [("", self.queue_length)]),
            ("loko_queue_capacity", "gauge", "queue length beyond which feedback is refused", [("", self.queue_size)]),
            ("loko_queue_bytes", "gauge", "bytes of the queued feedback's inputs", [("", self.queue_bytes_used)]),
            ("loko_pending_bytes", "gauge", "bytes of the kept predictions' inputs", [("", self.pending_bytes_used)]),
            (
                "loko_parameter_version",
                "gauge",
                "samples learned by the parameters predictions read",
                [("", learner.version)],
            ),
        ]
        rows.append(
            _summary(
                "loko_step_seconds",
                "wall time of one learner step",
                self.step_seconds,
                self.step_seconds_sum,
                self.step_count,
            )
        )
        rows.append(
            _summary(
                "loko_feedback_lag_seconds",
                "from a feedback's acknowledgement to its update",
                self.lags,
                self.lag_sum,
                self.lag_count,
            )
        )
        lines = []
        for name, kind, help_text, samples in rows:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            lines += [f"{name}{suffix} {prometheus_value(value)}" for suffix, value in samples]
        return "\n".join(lines) + "\n"


def check_base(ckpt_path: str | Path, state_dir: str | Path) -> None:
    """Record the base checkpoint's SHA-256 in a new state folder; refuse another base for an existing one.

    Raises:
        ConfigError: (field ``ckpt_path``) the folder was started from a checkpoint with another hash.
    """
    digest = hashlib.sha256()
    with open(ckpt_path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    sha256 = digest.hexdigest()
    path = Path(state_dir) / BASE_NAME
    if path.is_file():
        recorded = json.loads(path.read_text(encoding="utf-8"))
        if recorded.get("ckpt_sha256") != sha256:
            raise ConfigError(
                f"the state folder {str(state_dir)!r} was started from another checkpoint ({recorded.get('ckpt_path')}"
                f", sha256 {str(recorded.get('ckpt_sha256'))[:12]}...), not {str(ckpt_path)!r} (sha256 "
                f"{sha256[:12]}...): serve that checkpoint, or give another --state_dir for this one",
                field="ckpt_path",
            )
        return
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps({"ckpt_sha256": sha256, "ckpt_path": str(ckpt_path)}) + "\n", encoding="utf-8")
    with open(temporary, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def _loggable(tensor: Tensor) -> dict[str, Any]:
    """A preprocessed input as a JSON value: its bytes in base64, its shape and dtype."""
    data = tensor.detach().contiguous().cpu().numpy().tobytes()
    return {"tensor": base64.b64encode(data).decode(), "shape": list(tensor.shape), "dtype": str(tensor.dtype)[6:]}


def _tensor(value: Any) -> Tensor | None:
    """The preprocessed input a log record holds (:func:`_loggable`), or ``None`` for a raw one (an image, a text)."""
    if not isinstance(value, dict) or "tensor" not in value:
        return None
    data = bytearray(base64.b64decode(value["tensor"]))
    return torch.frombuffer(data, dtype=getattr(torch, value["dtype"])).reshape(value["shape"])


def _input_bytes(value: Any) -> int:
    """The bytes an input holds in memory, about: its strings' lengths (base64 images and texts), a tensor's data."""
    if isinstance(value, Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, str):
        return len(value) if value.isascii() else len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, (list, tuple)):
        return sum(_input_bytes(item) for item in value)
    return 0


def _summary(name: str, help_text: str, window: Any, total: float, count: int) -> tuple[str, str, str, list]:
    """A Prometheus summary: quantiles over the last values, sum and count over all."""
    values = sorted(window)
    samples = []
    for q in (0.5, 0.99):
        value = values[min(len(values) - 1, int(q * len(values)))] if values else math.nan
        samples.append((f'{{quantile="{q}"}}', value))
    samples += [("_sum", total), ("_count", count)]
    return name, "summary", help_text, samples


def prometheus_value(value: float) -> str:
    """A sample's value as the Prometheus text format writes it (``NaN``, an integer, or a float's repr)."""
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    return repr(float(value)) if isinstance(value, float) else str(int(value))


def prediction_answer(ident: str | None, classes: list[str], scores: list[float], best: int, version: int) -> dict:
    """One input's answer to ``/predict``: its id (``None``: no label can follow), label, probabilities, version."""
    return {
        "id": ident,
        "label": classes[best],
        "probabilities": dict(zip(classes, scores, strict=True)),
        "version": version,
    }
