"""The predictions ``loko serve`` keeps for a later label: bounded in number, in bytes of inputs and in time.

Each ``/predict`` answer's ``id`` keeps its input and predicted class until its label comes with ``/feedback``, it
expires, or newer predictions push it out (the oldest first).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

from loko_lightning.serve.inputs import input_bytes


class PendingPredictions:
    """Kept predictions by id, at most ``size`` of them and ``max_bytes`` of inputs, each for ``seconds``; thread-safe.

    Args:
        size: predictions kept, at most (the oldest is forgotten first).
        seconds: how long a prediction is kept.
        max_bytes: the kept inputs, at most, in bytes (:func:`~loko_lightning.serve.inputs.input_bytes`; the oldest
            is forgotten first).

    Attributes:
        bytes_used: the bytes of the kept inputs.
    """

    def __init__(self, size: int, seconds: float, max_bytes: int) -> None:
        self.size, self.seconds, self.max_bytes = size, seconds, max_bytes
        self.bytes_used = 0
        # id -> (input, predicted class, expiry time, input bytes)
        self._kept: collections.OrderedDict[str, tuple[Any, int, float, int]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def remember(self, ident: str, value: Any, predicted: int) -> None:
        """Keep ``value`` and its predicted class under ``ident``; forget the oldest beyond the bounds."""
        size = input_bytes(value)
        with self._lock:
            self._forget_expired()
            self._kept[ident] = (value, predicted, time.monotonic() + self.seconds, size)
            self.bytes_used += size
            while len(self._kept) > self.size or self.bytes_used > self.max_bytes:
                self._forget(next(iter(self._kept)))

    def get(self, ident: str) -> tuple[Any, int] | None:
        """The input and predicted class kept under ``ident``; ``None`` when it is unknown or expired."""
        with self._lock:
            self._forget_expired()
            kept = self._kept.get(ident)
        return None if kept is None else (kept[0], kept[1])

    def forget(self, ident: str) -> None:
        """Forget what ``ident`` keeps (nothing if it keeps nothing)."""
        with self._lock:
            self._forget(ident)

    def _forget(self, ident: str) -> None:
        kept = self._kept.pop(ident, None)
        if kept is not None:
            self.bytes_used -= kept[3]

    def _forget_expired(self) -> None:
        now = time.monotonic()
        while self._kept:
            ident, (_, _, expires, _) = next(iter(self._kept.items()))
            if expires > now:
                return
            self._forget(ident)
