"""The Kalman filter: the :class:`LoKO` optimizer, its filters, its update on plain tensors and the float64 references.

Torch only.

- :mod:`~loko_lightning.kalman.optimizer`: :class:`LoKO`, a :class:`torch.optim.Optimizer` holding the filter state and
  running the one step pipeline.
- :mod:`~loko_lightning.kalman.filters`: the filter families (covariance, information, low-rank), one interface.
- :mod:`~loko_lightning.kalman.time_update`: the process models between steps (:class:`TimeUpdate`).
- :mod:`~loko_lightning.kalman.plan`: the layout of an update (flat order, block kinds) and writing a step.
- :mod:`~loko_lightning.kalman.exchange`: where a step's observations come from (replicated or sharded).
- :mod:`~loko_lightning.kalman.update`: one step on plain tensors (:func:`loko_update`).
- :mod:`~loko_lightning.kalman.algebra`: how each kind of Jacobian block enters the update's products.
- :mod:`~loko_lightning.kalman.shared_rows`: the weights whose rows share one full covariance (``shared_rows``).
- :mod:`~loko_lightning.kalman.noise`: the observation-noise (``R``) estimators, one registry.
- :mod:`~loko_lightning.kalman.multistream`: several observations in one update (a batch, several processes).
- :mod:`~loko_lightning.kalman.distributed`, :mod:`~loko_lightning.kalman.sharded`: the collectives.
- :mod:`~loko_lightning.kalman.reference`: every filter with dense float64 matrices, the specification.
"""

from loko_lightning.kalman.filters import Covariance, DiagonalInformation, Filter, LowRankPrecision, get_filter
from loko_lightning.kalman.optimizer import LoKO
from loko_lightning.kalman.plan import UpdatePlan
from loko_lightning.kalman.reference import loko_step_reference, loko_step_reference_batch
from loko_lightning.kalman.time_update import TimeUpdate
from loko_lightning.kalman.update import loko_update

__all__ = [
    "Covariance",
    "DiagonalInformation",
    "Filter",
    "LoKO",
    "LowRankPrecision",
    "TimeUpdate",
    "UpdatePlan",
    "get_filter",
    "loko_step_reference",
    "loko_step_reference_batch",
    "loko_update",
]
