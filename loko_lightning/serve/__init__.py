"""Learn while serving: predictions, delayed labels, a durable feedback log, one learner thread (``loko serve``).

- :mod:`~loko_lightning.serve.learner`: :class:`ServingLearner`, a checkpoint's learner that predicts and learns one
  labelled sample at a time, without HTTP.
- :mod:`~loko_lightning.serve.log`: :class:`FeedbackLog`, the write-ahead log of accepted feedback.
- :mod:`~loko_lightning.serve.service`: :class:`FeedbackService`, predictions, feedback, the learner thread,
  checkpoints and recovery, without HTTP.
- :mod:`~loko_lightning.serve.app`: the FastAPI routes (the ``serve`` extra: ``pip install "loko-lightning[serve]"``).
"""

from loko_lightning.serve.learner import LearnResult, ServingLearner
from loko_lightning.serve.log import FeedbackLog
from loko_lightning.serve.service import FeedbackService, Rejected

__all__ = ["FeedbackLog", "FeedbackService", "LearnResult", "Rejected", "ServingLearner"]
