"""loko-lightning: online fine-tuning of LoRA adapters with LoKO, the Low-Rank Kalman Optimizer.

The top level re-exports the torch-only API; it imports no ``lightning``. The LightningModule, DataModule and
CLI live in :mod:`loko_lightning.learner.module`, :mod:`loko_lightning.data` and :mod:`loko_lightning.cli`.
"""

from loko_lightning.jacobians.blocks import FactoredJacobian, OuterJacobian
from loko_lightning.jacobians.engine import JacobianEngine, jacobian
from loko_lightning.kalman.optimizer import LoKO
from loko_lightning.kalman.reference import loko_step_reference
from loko_lightning.kalman.update import loko_update

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
