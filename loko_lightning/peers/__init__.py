"""The peers: other online learners, from their own packages, on the learner's stream and adapters.

Each is a torch optimizer that :class:`~loko_lightning.learner.module.OnlineClassifier` takes like AdamW
(``model.optimizer.class_path``), stepped by its own strategy in :mod:`loko_lightning.learner.steps`, with the same
prequential protocol: the prediction scored for a sample is made before the update on it.

- :class:`ScheduleFreeAdamW` (``schedulefree``, Defazio et al. 2024): AdamW without a learning-rate schedule or a
  horizon. It predicts with the averaged point ``x`` (the point its guarantees are for), its gradient is taken at
  the interpolated point ``y``.
- :class:`IVON` (``ivon-opt``, Shen et al. 2024): variational online Newton. It predicts with the posterior mean;
  its gradient is taken at one (``mc_samples``) draw from the posterior.
- :class:`DiagonalFisherEKF` (``posteriors``): the diagonal empirical-Fisher extended Kalman filter of
  ``posteriors.ekf.diag_fisher``, the same family as LoKO's ``natural`` filter, started from the variance ``p0``.

- :class:`Prodigy`, :class:`DAdaptAdam`, :class:`DoG`, :class:`MechanicAdamW` (``prodigyopt``, ``dadaptation``,
  ``dog-optimizer``, ``mechanic-pytorch``): learning-rate-free fine-tuners (:mod:`loko_lightning.peers.lr_free`).
- :class:`StreamingLDA`, :class:`NearestClassMean`, :class:`FrozenLinearHead` (no package; torch only): heads on
  the backbone's frozen features (streaming LDA of Hayes & Kanan 2020 with OAS shrinkage, nearest class mean, a
  linear head trained by AdamW), one forward pass a sample (:mod:`loko_lightning.peers.frozen_heads`).

The packages are the extra ``peers`` (``pip install "loko-lightning[peers]"``); without it, naming a peer is one
error that says so. The classes are imported on first use, so this package imports without them.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "DAdaptAdam",
    "DiagonalFisherEKF",
    "DoG",
    "FrozenLinearHead",
    "IVON",
    "MechanicAdamW",
    "NearestClassMean",
    "Prodigy",
    "ScheduleFreeAdamW",
    "StreamingLDA",
]

_HOMES = {
    "ScheduleFreeAdamW": "loko_lightning.peers.schedule_free",
    "IVON": "loko_lightning.peers.ivon",
    "DiagonalFisherEKF": "loko_lightning.peers.ekf",
    "Prodigy": "loko_lightning.peers.lr_free",
    "DAdaptAdam": "loko_lightning.peers.lr_free",
    "DoG": "loko_lightning.peers.lr_free",
    "MechanicAdamW": "loko_lightning.peers.lr_free",
    "StreamingLDA": "loko_lightning.peers.frozen_heads",
    "NearestClassMean": "loko_lightning.peers.frozen_heads",
    "FrozenLinearHead": "loko_lightning.peers.frozen_heads",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
