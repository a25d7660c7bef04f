"""loko-lightning: online fine-tuning of LoRA adapters with LoKO, the Low-Rank Kalman Optimizer.

The top level re-exports the torch-only API; it imports no ``lightning``. The LightningModule, DataModule and
CLI live in :mod:`loko_lightning.module`, :mod:`loko_lightning.data` and :mod:`loko_lightning.cli`.
"""

from loko_lightning.blocks import FactoredJacobian, OuterJacobian
from loko_lightning.functional import loko_update
from loko_lightning.jacobian import JacobianEngine, jacobian
from loko_lightning.optim import LoKO
from loko_lightning.reference import loko_step_reference

__all__ = [
    "FactoredJacobian",
    "JacobianEngine",
    "LoKO",
    "OuterJacobian",
    "jacobian",
    "loko_step_reference",
    "loko_update",
]
__version__ = "0.1.0"
