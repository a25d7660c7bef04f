"""loko-lightning: online fine-tuning of LoRA adapters with LoKO, the Low-Rank Kalman Optimizer.

The top level re-exports the torch-only API; it imports no ``lightning``. The LightningModule, DataModule and
CLI live in :mod:`loko_lightning.learner.module`, :mod:`loko_lightning.data` and :mod:`loko_lightning.cli`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported on first use (PEP 562), so that `loko serve --help` answers before torch is imported
    from loko_lightning.jacobians.blocks import FactoredJacobian, OuterJacobian
    from loko_lightning.jacobians.engine import JacobianEngine, jacobian
    from loko_lightning.kalman.optimizer import LoKO
    from loko_lightning.kalman.reference import loko_step_reference
    from loko_lightning.kalman.update import loko_update

_WHERE = {
    "FactoredJacobian": "loko_lightning.jacobians.blocks",
    "OuterJacobian": "loko_lightning.jacobians.blocks",
    "JacobianEngine": "loko_lightning.jacobians.engine",
    "jacobian": "loko_lightning.jacobians.engine",
    "LoKO": "loko_lightning.kalman.optimizer",
    "loko_step_reference": "loko_lightning.kalman.reference",
    "loko_update": "loko_lightning.kalman.update",
}

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


def __getattr__(name: str) -> Any:
    """The torch API's names, imported when first used."""
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'loko_lightning' has no attribute {name!r}")
