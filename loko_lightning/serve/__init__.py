"""Learn while serving: predictions, delayed labels, a durable feedback log, one learner thread (``loko serve``).

- :mod:`~loko_lightning.serve.learner`: :class:`ServingLearner`, a checkpoint's learner that predicts and learns one
  labelled sample at a time, without HTTP.
- :mod:`~loko_lightning.serve.log`: :class:`FeedbackLog`, the write-ahead log of accepted feedback.
- :mod:`~loko_lightning.serve.service`: :class:`FeedbackService`, predictions, feedback, the learner thread,
  checkpoints and recovery, without HTTP.
- :mod:`~loko_lightning.serve.app`: the FastAPI routes (the ``serve`` extra: ``pip install "loko-lightning[serve]"``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported on first use: `loko serve --help` reads serve.limits without importing torch
    from loko_lightning.serve.learner import LearnResult, ServingLearner
    from loko_lightning.serve.log import FeedbackLog
    from loko_lightning.serve.service import FeedbackService, Rejected

__all__ = ["FeedbackLog", "FeedbackService", "LearnResult", "Rejected", "ServingLearner"]
_WHERE = {
    "FeedbackLog": "loko_lightning.serve.log",
    "FeedbackService": "loko_lightning.serve.service",
    "LearnResult": "loko_lightning.serve.learner",
    "Rejected": "loko_lightning.serve.service",
    "ServingLearner": "loko_lightning.serve.learner",
}


def __getattr__(name: str) -> Any:
    """The server's classes, imported when first used."""
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'loko_lightning.serve' has no attribute {name!r}")
