"""The Kalman filter: the :class:`LoKO` optimizer, its update on plain tensors and the float64 reference (torch only).

- :mod:`~loko_lightning.kalman.optimizer`: :class:`LoKO`, a :class:`torch.optim.Optimizer` holding the filter state.
- :mod:`~loko_lightning.kalman.update`: one step of Algorithm 1 on plain tensors (:func:`loko_update`, the plan).
- :mod:`~loko_lightning.kalman.algebra`: how each kind of Jacobian block enters the update's products.
- :mod:`~loko_lightning.kalman.noise`: the observation-noise (``R``) estimators, one registry.
- :mod:`~loko_lightning.kalman.multistream`: several observations in one update (a batch, several processes).
- :mod:`~loko_lightning.kalman.distributed`: the gather of every process's observations.
- :mod:`~loko_lightning.kalman.reference`: the same step with dense float64 matrices, the specification.
"""

from loko_lightning.kalman.optimizer import LoKO
from loko_lightning.kalman.reference import loko_step_reference, loko_step_reference_batch
from loko_lightning.kalman.update import UpdatePlan, loko_update

__all__ = ["LoKO", "UpdatePlan", "loko_step_reference", "loko_step_reference_batch", "loko_update"]
