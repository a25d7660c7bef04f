"""Jacobian blocks: the forms in which the Jacobian of one parameter reaches the Kalman update.

A block is a dense tensor of shape ``(m, *param.shape)``, an :class:`OuterJacobian` (the exact factored form of a
Linear layer's weight Jacobian for one input vector) or a :class:`FactoredJacobian` (the same for a Linear/Conv2d
layer that saw ``k`` positions). :mod:`loko_lightning.jacobians.engine` produces them,
:mod:`loko_lightning.kalman.update`
consumes them; neither imports the other's internals.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class OuterJacobian:
    """Jacobian of ``m`` outputs w.r.t. a weight ``W`` (``out x in``) of a Linear layer seen by one input.

    For ``z = W f + b`` with a single input vector ``f``, ``∂ŷ_a/∂W_jk = left[a, j] * right[k]`` where
    ``left = ∂ŷ/∂z`` (``m x out``) and ``right = f`` (``in``). Storing the two factors costs
    ``m·out + in`` numbers instead of ``m·out·in``, and every Kalman product on this block has a closed form.

    A batch of ``B`` samples (:meth:`loko_lightning.JacobianEngine.batch`) carries a leading batch dimension on
    both factors: ``left`` ``(B, m, out)``, ``right`` ``(B, in)``, sample ``b``'s Jacobian ``left[b] ⊗ right[b]``.

    Args:
        left: ``∂ŷ/∂z``, shape ``(m, out)``.
        right: the layer's input ``f``, shape ``(in,)``.
    """

    left: Tensor
    right: Tensor

    @property
    def shape(self) -> torch.Size:
        """Shape of the dense Jacobian this object stands for, ``(m, out, in)`` (``(B, m, out, in)`` for a batch)."""
        return torch.Size((*self.left.shape, self.right.shape[-1]))

    def to_dense(self) -> Tensor:
        """Materialise the dense ``(m, out, in)`` (or ``(B, m, out, in)``) Jacobian (for tests and debugging)."""
        right = self.right[..., None, None, :] if self.right.dim() == 2 else self.right[None, None, :]
        return self.left[..., :, None] * right

    def to(self, dtype: torch.dtype) -> OuterJacobian:
        """Return a copy with both factors cast to ``dtype``."""
        return OuterJacobian(self.left.to(dtype), self.right.to(dtype))


@dataclass(frozen=True)
class FactoredJacobian:
    """Exact factored Jacobian of a Linear or Conv2d weight that sees ``k`` input positions.

    A layer ``z_p = W x_p (+ b)`` applied at ``k`` positions ``p`` (the output pixels of a convolution, with
    ``x_p`` the unfolded input patch, or the tokens of a Linear layer) has
    ``∂ŷ_a/∂W_ij = Σ_p left[a, i, p] · right[j, p]``, with ``left[a, :, p] = ∂ŷ_a/∂z_p`` and
    ``right[:, p] = x_p``. For ``W`` of shape ``(rows, *rest)`` the Jacobian of sample row ``a`` is
    ``left[a] @ right.T`` reshaped to ``W``'s shape. It is the per-sample-gradient structure that LoRA factors
    inherit, and it generalises :class:`OuterJacobian` (``k = 1``). Storing ``m·rows·k + cols·k`` numbers
    instead of ``m·rows·cols`` pays off, and makes the Kalman products cheaper, when ``k`` is small against
    ``m`` (deep layers with few pixels, many classes); see :func:`factored_is_cheaper`.

    A batch of ``B`` samples carries a leading batch dimension on both factors (each sample has its own inputs):
    ``left`` ``(B, m, rows, k)``, ``right`` ``(B, cols, k)``.

    Args:
        left: cotangents at the layer output, shape ``(m, rows, k)``.
        right: the layer input at each position, shape ``(cols, k)`` with ``cols = prod(param_shape[1:])``.
        param_shape: shape of the weight, ``(rows, *rest)``.
    """

    left: Tensor
    right: Tensor
    param_shape: torch.Size

    @property
    def shape(self) -> torch.Size:
        """Shape of the dense Jacobian this object stands for, ``(m, *param_shape)`` (``(B, m, ...)`` for a batch)."""
        return torch.Size((*self.left.shape[:-2], *self.param_shape))

    def to_dense(self) -> Tensor:
        """Materialise the dense ``(m, *param_shape)`` (or batched) Jacobian (for tests and debugging)."""
        right = self.right.transpose(-1, -2)
        if right.dim() == 3:  # a batch: sample b's inputs for sample b's rows
            right = right[:, None]
        return torch.matmul(self.left, right).reshape(self.shape)

    def to(self, dtype: torch.dtype) -> FactoredJacobian:
        """Return a copy with both factors cast to ``dtype``."""
        return FactoredJacobian(self.left.to(dtype), self.right.to(dtype), self.param_shape)


JacobianBlock = Tensor | OuterJacobian | FactoredJacobian

# Equivalent multiply-adds charged for the dozen small tensor ops a factored block with k > 1 adds; a dense
# block instead joins one big matrix product with all the other dense blocks, and blocks with k = 1 are
# processed together (see loko_update).
_BLOCK_OVERHEAD = 5e5
_OUTER_OVERHEAD = 2e5


def factored_is_cheaper(m: int, rows: int, cols: int, k: int) -> bool:
    """Whether the Kalman update costs less with a :class:`FactoredJacobian` than with its dense form.

    Rough multiply-add counts per step: dense ``m·rows·cols·(k + 2m)`` (forming the block, then ``H P Hᵀ`` and
    ``diag(Hᵀ S⁺ H)``); factored ``rows·cols·k·(2k + 4) + 2·rows·m·k·(k + m)`` plus a fixed overhead per
    block (``k = 1``: ``2·m²·rows`` plus a few passes over ``rows·cols``). Either form gives the same update to
    rounding; this only picks the faster one.

    Args:
        m: number of outputs (Jacobian rows).
        rows: the weight's first dimension.
        cols: the product of its other dimensions.
        k: number of input positions the layer saw.
    """
    dense = m * rows * cols * (k + 2 * m + 3)
    if k == 1:
        factored = 2 * m * rows * (m + 1) + 4 * rows * cols + _OUTER_OVERHEAD
    else:
        factored = rows * cols * k * (2 * k + 4) + 2 * rows * m * k * (k + m) + _BLOCK_OVERHEAD
    return factored < dense


def block_key(jac: JacobianBlock) -> tuple | None:
    """The layout of one Jacobian block that an :class:`UpdatePlan` depends on (kind and shapes).

    ``None`` if ``jac`` is not a Jacobian block at all.
    """
    if isinstance(jac, Tensor):
        return (0, jac.shape)
    if isinstance(jac, FactoredJacobian):
        return (2, jac.left.shape, jac.right.shape, jac.param_shape)
    if isinstance(jac, OuterJacobian):
        return (1, jac.left.shape, jac.right.shape)
    return None
