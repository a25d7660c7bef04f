"""Jacobians of a network's observed outputs with respect to its trainable parameters (torch only).

- :mod:`~loko_lightning.jacobians.blocks`: the forms one parameter's Jacobian takes (dense, outer, factored).
- :mod:`~loko_lightning.jacobians.engine`: :class:`JacobianEngine` (built once per model) and :func:`jacobian`.
- :mod:`~loko_lightning.jacobians.reverse`: one pass: the hooks, the batched reverse pass, the factors.
- :mod:`~loko_lightning.jacobians.frozen`: cheaper reverse passes through frozen layers.
"""

from loko_lightning.jacobians.blocks import FactoredJacobian, JacobianBlock, OuterJacobian
from loko_lightning.jacobians.engine import JacobianEngine, jacobian

__all__ = ["FactoredJacobian", "JacobianBlock", "JacobianEngine", "OuterJacobian", "jacobian"]
