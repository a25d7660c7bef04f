"""The Lightning side: the online learner (a ``LightningModule``), its metrics, selection and callbacks."""

# Register the peers' steps and those of the heads on frozen features (loko_lightning.peers) with the learner.
import loko_lightning.learner.frozen_heads  # noqa: F401
import loko_lightning.learner.peer_steps  # noqa: F401
from loko_lightning.learner.callbacks import DivergenceGuard, OnlineReport, RNGStateCheckpoint
from loko_lightning.learner.module import OnlineClassifier, ignore_intended_warnings
from loko_lightning.learner.selection import Candidates

__all__ = [
    "Candidates",
    "DivergenceGuard",
    "OnlineClassifier",
    "OnlineReport",
    "RNGStateCheckpoint",
    "ignore_intended_warnings",
]
