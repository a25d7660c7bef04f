"""Predictions of concurrent requests made together: one forward pass over the inputs that waited for the last one.

With one forward pass per request, N concurrent requests are N forward passes in N threads, which on a few cores
take the CPU from the learner thread and each other. :class:`PredictionBatcher` runs one pass at a time in its own
thread, over every input that arrived while the previous pass ran (at most ``max_inputs``): at low load a request
is predicted at once, alone; under load the passes grow instead of multiplying ("dynamic batching" without a wait).
Each pass reads one parameter version, which every request of the pass gets back with its rows.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor


class _Request:
    __slots__ = ("done", "error", "inputs", "result")

    def __init__(self, inputs: Sequence[Any]) -> None:
        self.inputs = inputs
        self.done = threading.Event()
        self.result: tuple[Tensor, int] | None = None
        self.error: BaseException | None = None


class PredictionBatcher:
    """One thread that predicts the waiting requests' inputs together.

    Args:
        predict: class probabilities ``(B, m)`` and the parameter version of ``B`` inputs, in one pass
            (:meth:`~loko_lightning.serve.learner.ServingLearner.predict_with_version`).
        max_inputs: inputs in one pass, at most (a request is never split: a larger one is a pass of its own).
        before_pass: called (in the batcher's thread) before each pass; it may wait, to give the learner priority.
    """

    def __init__(
        self,
        predict: Callable[[Sequence[Any]], tuple[Tensor, int]],
        max_inputs: int = 64,
        before_pass: Callable[[], None] | None = None,
    ) -> None:
        self._predict = predict
        self.max_inputs = max_inputs
        self._before_pass = before_pass
        self._waiting: collections.deque[_Request] = collections.deque()
        self._wake = threading.Condition()
        self._closed = False
        self.passes = 0
        self._thread = threading.Thread(target=self._run, name="loko-predict", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        """Requests waiting for a pass."""
        return len(self._waiting)

    def __call__(self, inputs: Sequence[Any]) -> tuple[Tensor, int]:
        """The class probabilities of ``inputs`` and their parameter version (waits for the pass that makes them)."""
        request = _Request(inputs)
        with self._wake:
            if self._closed:
                raise RuntimeError("the prediction batcher is closed")
            self._waiting.append(request)
            self._wake.notify()
        request.done.wait()
        if request.error is not None:
            raise request.error
        assert request.result is not None
        return request.result

    def close(self) -> None:
        """Predict what waits, then end the thread."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            if self._before_pass is not None:
                with self._wake:
                    while not self._waiting and not self._closed:
                        self._wake.wait()
                self._before_pass()  # the requests that arrive meanwhile join this pass
            with self._wake:
                while not self._waiting and not self._closed:
                    self._wake.wait()
                if not self._waiting:
                    return
                batch = [self._waiting.popleft()]
                size = len(batch[0].inputs)
                while self._waiting and size + len(self._waiting[0].inputs) <= self.max_inputs:
                    request = self._waiting.popleft()
                    batch.append(request)
                    size += len(request.inputs)
            self._pass(batch)

    def _pass(self, batch: list[_Request]) -> None:
        try:
            probabilities, version = self._predict([x for request in batch for x in request.inputs])
        except BaseException as err:  # each request gets the error of its pass, the thread goes on
            for request in batch:
                request.error = err
                request.done.set()
            return
        self.passes += 1
        start = 0
        for request in batch:
            request.result = (probabilities[start : start + len(request.inputs)], version)
            start += len(request.inputs)
            request.done.set()
