"""The float64 references: each filter and the time update written slowly and obviously, in the paper's names.

One module per filter family (:mod:`loko_lightning.kalman.filters`), none sharing arithmetic with the fast path:

- :mod:`~loko_lightning.kalman.reference.covariance`: Algorithm 1 (one sample, a joint step, the top-k observation),
  and the same filter with a weight's rows sharing a full covariance.
- :mod:`~loko_lightning.kalman.reference.information`: the diagonal natural-gradient filter.
- :mod:`~loko_lightning.kalman.reference.low_rank`: LoFi.
- :mod:`~loko_lightning.kalman.reference.time_update`: the time update from its process model.
"""

from loko_lightning.kalman.reference.covariance import (
    REFERENCE_R_ESTIMATORS,
    loko_step_reference,
    loko_step_reference_batch,
    pinv_reference,
    prior_scale_reference,
    shared_rows_step_reference,
    topk_step_reference,
)
from loko_lightning.kalman.reference.information import natural_step_reference
from loko_lightning.kalman.reference.low_rank import lofi_step_reference
from loko_lightning.kalman.reference.time_update import time_update_reference

__all__ = [
    "REFERENCE_R_ESTIMATORS",
    "lofi_step_reference",
    "loko_step_reference",
    "loko_step_reference_batch",
    "natural_step_reference",
    "pinv_reference",
    "prior_scale_reference",
    "shared_rows_step_reference",
    "time_update_reference",
    "topk_step_reference",
]
