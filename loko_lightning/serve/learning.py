"""The learner thread of ``loko serve``: accepted feedback learned in the order of the log, checkpointed with it.

:class:`LearningLoop` is what the learner thread of a :class:`~loko_lightning.serve.service.FeedbackService` runs (and
what replays the log when its state folder is opened); the service's ``/feedback`` fills its queue.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from loko_lightning.errors import ConfigError
from loko_lightning.serve.inputs import logged_tensor
from loko_lightning.serve.learner import ServingLearner
from loko_lightning.serve.lock import CHECKPOINT_NAME

# A prediction pass waits for the learner's next step at most this long (see LearningLoop._yield_to_learner).
PASS_WAIT_SECONDS = 1.0
# A checkpoint that could not be written (disk full, ...) is tried again after this many seconds.
SAVE_RETRY_SECONDS = 5.0


class LearningLoop:
    """The learner thread's side of a feedback service: the queued log records learned in order, and checkpoints.

    Each record is one LoKO step (or one skipped sample) and moves :attr:`position` past it; every
    ``checkpoint_every`` samples the learner is saved with that position, and a checkpoint that cannot be written is
    tried again every ``save_retry_seconds``. An error that ends the thread is kept for /health, never silent.
    :class:`~loko_lightning.serve.service.FeedbackService` is built on this class and sets the attributes below when
    it opens its state folder.

    Attributes:
        learner: the learner the records are learned by.
        state_dir: the folder of the serving checkpoint.
        position: the ``seq`` of the last record learned (the log position the next checkpoint holds).
        checkpoint_every: save the learner every this many learned samples.
        save_retry_seconds: a checkpoint that could not be written is tried again after this many seconds.
        queue_bytes_used: the bytes of the queued records' inputs.
        step_seconds: the wall times of the last steps (with their sum and count over all, ``step_seconds_sum``,
            ``step_count``).
        lags: from the last records' acknowledgements to their updates, in seconds (with ``lag_sum``, ``lag_count``).
    """

    learner: ServingLearner
    state_dir: Path
    position: int
    checkpoint_every: int
    save_retry_seconds: float
    queue_bytes_used: int
    step_seconds: collections.deque[float]
    step_seconds_sum: float
    step_count: int
    lags: collections.deque[float]
    lag_sum: float
    lag_count: int
    # (record, time it was acknowledged, its input's bytes), in log order; guarded by _wake.
    _queue: collections.deque[tuple[dict[str, Any], float, int]]
    _wake: threading.Condition
    _stopping: bool
    _steps_done: int
    _steps_at_pass: int
    _saved_position: int
    _failure: str | None
    _save_error: str | None
    _save_failed_at: float
    _step_error: str | None

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
            sample = logged_tensor(record["input"])
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
