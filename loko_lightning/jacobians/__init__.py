"""Jacobians of a network's observed outputs with respect to its trainable parameters (torch only).

- :mod:`~loko_lightning.jacobians.blocks`: the forms one parameter's Jacobian takes (dense, outer, factored).
- :mod:`~loko_lightning.jacobians.engine`: :class:`JacobianEngine` (built once per model) and :func:`jacobian`: the
  per-call checks, one sample or a batch, and the fallbacks.
- :mod:`~loko_lightning.jacobians.hooks`: the scan of a model and the forward hooks on the layers it finds.
- :mod:`~loko_lightning.jacobians.reverse`: the batched reverse pass from the outputs to the Jacobian blocks.
- :mod:`~loko_lightning.jacobians.frozen`: cheaper reverse passes through frozen layers.
"""

from loko_lightning.jacobians.blocks import FactoredJacobian, JacobianBlock, OuterJacobian
from loko_lightning.jacobians.engine import JacobianEngine, jacobian

__all__ = ["FactoredJacobian", "JacobianBlock", "JacobianEngine", "OuterJacobian", "jacobian"]
