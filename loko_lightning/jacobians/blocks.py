"""Jacobian blocks: the forms in which the Jacobian of one parameter reaches the Kalman update, with their behaviour.

A block is a dense tensor of shape ``(m, *param.shape)``, an :class:`OuterJacobian` (the exact factored form of a
Linear layer's weight Jacobian for one input vector) or a :class:`FactoredJacobian` (the same for a Linear/Conv2d
layer that saw ``k`` positions). :mod:`loko_lightning.jacobians` produces them, :mod:`loko_lightning.kalman`
consumes them. What a block kind does (check its shapes, take its parts apart and put them together for a gather,
stack the samples of a batch, pick one sample, name its layout) is written once here: as methods of the two factored
types, and of :class:`Dense` for plain tensors. :func:`kind` is the one place that tells the kinds apart; code
elsewhere asks ``kind(block).method(block, ...)`` and never tests the type of a block.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


def _lead(batch: int | None) -> tuple[int, ...]:
    return () if batch is None else (batch,)


class Dense:
    """The behaviour of a dense block, a :class:`~torch.Tensor` ``(m, *param.shape)`` (``(B, m, ...)`` for a batch).

    The methods mirror those of :class:`OuterJacobian` and :class:`FactoredJacobian`, taking the tensor first.
    """

    @staticmethod
    def parts(block: Tensor) -> tuple[Tensor, ...]:
        """The tensors that make the block, each with the batch first (what a gather sends)."""
        return (block,)

    @staticmethod
    def with_parts(block: Tensor, parts: Sequence[Tensor]) -> Tensor:
        """A block of this kind and layout made of ``parts`` (as :meth:`parts` gives them)."""
        return parts[0]

    @staticmethod
    def stack(blocks: Sequence[Tensor]) -> Tensor:
        """Single-sample blocks as one batched block."""
        return torch.stack(list(blocks))

    @staticmethod
    def sample(block: Tensor, index: int) -> Tensor:
        """Sample ``index`` of a batched block, as a single-sample block."""
        return block[index]

    @staticmethod
    def layout_key(block: Tensor) -> tuple:
        """What an update plan depends on: the kind and the shapes."""
        return (0, block.shape)

    @staticmethod
    def fits(block: Tensor, m: int, param_shape: torch.Size, batch: int | None = None) -> bool:
        """Whether the block is the Jacobian of ``m`` outputs (of ``batch`` samples) w.r.t. a ``param_shape`` weight."""
        return tuple(block.shape) == (*_lead(batch), m, *param_shape)

    @staticmethod
    def describe(block: Tensor) -> str:
        """The block's shapes, for an error message."""
        return str(tuple(block.shape))

    @staticmethod
    def positions(block: Tensor) -> int | None:
        """Input positions that may differ between processes (factored blocks), else ``None``."""
        return None

    @staticmethod
    def pad_positions(block: Tensor, positions: int) -> Tensor:
        """The block with zero positions up to ``positions`` (they add nothing); dense blocks have none."""
        return block

    @staticmethod
    def group_key(block: Tensor) -> tuple[int, int, int] | None:
        """``(k, rows, cols)`` of a factored block, by which the update groups blocks; ``None`` for dense blocks."""
        return None

    @staticmethod
    def stack_rows(block: Tensor, batch: int, m: int) -> Tensor:
        """The rows of a batched block's ``B`` samples stacked: the block of the ``B·m``-row observation."""
        return block.reshape(batch * m, *block.shape[2:])


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

    def parts(self) -> tuple[Tensor, ...]:
        """The two factors (see :meth:`Dense.parts`)."""
        return self.left, self.right

    def with_parts(self, parts: Sequence[Tensor]) -> OuterJacobian:
        """An outer block made of ``parts`` (see :meth:`Dense.with_parts`)."""
        return OuterJacobian(parts[0], parts[1])

    @staticmethod
    def stack(blocks: Sequence[OuterJacobian]) -> OuterJacobian:
        """Single-sample blocks as one batched block."""
        return OuterJacobian(torch.stack([b.left for b in blocks]), torch.stack([b.right for b in blocks]))

    def sample(self, index: int) -> OuterJacobian:
        """Sample ``index`` of a batched block."""
        return OuterJacobian(self.left[index], self.right[index])

    def layout_key(self) -> tuple:
        """What an update plan depends on: the kind and the shapes."""
        return (1, self.left.shape, self.right.shape)

    def fits(self, m: int, param_shape: torch.Size, batch: int | None = None) -> bool:
        """Whether the block is the Jacobian of ``m`` outputs (of ``batch`` samples) w.r.t. a ``param_shape`` weight."""
        lead = _lead(batch)
        return (
            self.left.dim() == len(lead) + 2
            and self.right.dim() == len(lead) + 1
            and tuple(self.right.shape[: len(lead)]) == lead
            and tuple(self.shape) == (*lead, m, *param_shape)
        )

    def describe(self) -> str:
        """The factors' shapes, for an error message."""
        return f"OuterJacobian with left {tuple(self.left.shape)} and right {tuple(self.right.shape)}"

    def positions(self) -> int | None:
        """One position, the same on every process: ``None`` (see :meth:`Dense.positions`)."""
        return None

    def pad_positions(self, positions: int) -> OuterJacobian:
        """The block itself (see :meth:`Dense.pad_positions`)."""
        return self

    def group_key(self) -> tuple[int, int, int]:
        """``(1, rows, cols)``: one position."""
        return 1, self.left.shape[-1], self.right.shape[-1]

    def stack_rows(self, batch: int, m: int) -> JacobianBlock:
        """The block of the ``B·m``-row observation (see :func:`stack_factors`)."""
        param_shape = torch.Size((self.left.shape[2], self.right.shape[1]))
        return stack_factors(self.left[..., None], self.right[..., None], param_shape)


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

    def parts(self) -> tuple[Tensor, ...]:
        """The two factors (see :meth:`Dense.parts`)."""
        return self.left, self.right

    def with_parts(self, parts: Sequence[Tensor]) -> FactoredJacobian:
        """A factored block of this weight made of ``parts`` (see :meth:`Dense.with_parts`)."""
        return FactoredJacobian(parts[0], parts[1], self.param_shape)

    @staticmethod
    def stack(blocks: Sequence[FactoredJacobian]) -> FactoredJacobian:
        """Single-sample blocks as one batched block."""
        left, right = torch.stack([b.left for b in blocks]), torch.stack([b.right for b in blocks])
        return FactoredJacobian(left, right, blocks[0].param_shape)

    def sample(self, index: int) -> FactoredJacobian:
        """Sample ``index`` of a batched block."""
        return FactoredJacobian(self.left[index], self.right[index], self.param_shape)

    def layout_key(self) -> tuple:
        """What an update plan depends on: the kind and the shapes."""
        return (2, self.left.shape, self.right.shape, self.param_shape)

    def fits(self, m: int, param_shape: torch.Size, batch: int | None = None) -> bool:
        """Whether the block is the Jacobian of ``m`` outputs (of ``batch`` samples) w.r.t. a ``param_shape`` weight."""
        lead = _lead(batch)
        return (
            len(param_shape) >= 1
            and tuple(self.shape) == (*lead, m, *param_shape)
            and self.left.dim() == len(lead) + 3
            and self.right.dim() == len(lead) + 2
            and tuple(self.left.shape[: len(lead) + 2]) == (*lead, m, param_shape[0])
            and tuple(self.right.shape) == (*lead, math.prod(param_shape[1:]), self.left.shape[-1])
        )

    def describe(self) -> str:
        """The factors' shapes, for an error message."""
        return f"FactoredJacobian with left {tuple(self.left.shape)} and right {tuple(self.right.shape)}"

    def positions(self) -> int | None:
        """``k``, which differs between processes that saw texts of different lengths."""
        return self.left.shape[-1]

    def pad_positions(self, positions: int) -> FactoredJacobian:
        """The block with zero positions up to ``positions``: they add nothing to its Jacobian."""
        extra = positions - self.left.shape[-1]
        if not extra:
            return self
        pad = torch.nn.functional.pad
        return FactoredJacobian(pad(self.left, (0, extra)), pad(self.right, (0, extra)), self.param_shape)

    def group_key(self) -> tuple[int, int, int]:
        """``(k, rows, cols)``."""
        return self.left.shape[-1], self.left.shape[-2], self.right.shape[-2]

    def stack_rows(self, batch: int, m: int) -> JacobianBlock:
        """The block of the ``B·m``-row observation (see :func:`stack_factors`)."""
        return stack_factors(self.left, self.right, self.param_shape)


JacobianBlock = Tensor | OuterJacobian | FactoredJacobian
BlockKind = type[Dense] | type[OuterJacobian] | type[FactoredJacobian]


def kind(block: object) -> BlockKind:
    """The kind of a Jacobian block, whose methods take the block first: ``kind(block).parts(block)``.

    Raises:
        TypeError: ``block`` is not a Jacobian block.
    """
    if isinstance(block, Tensor):
        return Dense
    if isinstance(block, (OuterJacobian, FactoredJacobian)):
        return type(block)
    raise TypeError(f"not a Jacobian block: {type(block).__name__}")


def layout_key(block: object) -> tuple | None:
    """The layout of one block that an update plan depends on (kind and shapes); ``None`` for a non-block."""
    try:
        return kind(block).layout_key(block)
    except TypeError:
        return None


def stack_factors(left: Tensor, right: Tensor, param_shape: torch.Size) -> JacobianBlock:
    """The ``B·m``-row block of a batch of factored blocks (``left`` ``(B, m, rows, k)``, ``right`` ``(B, cols, k)``).

    Sample ``b``'s rows see only sample ``b``'s ``k`` positions: the factored block with the ``B·k`` positions of all
    samples and the block-diagonal left factor ``diag(L_1, …, L_B)`` (exact), or its dense form where that makes the
    update cheaper (:func:`factored_is_cheaper`).
    """
    batch, m, rows, k = left.shape
    cols = right.shape[1]
    if not factored_is_cheaper(batch * m, rows, cols, batch * k):
        return FactoredJacobian(left, right, param_shape).to_dense().reshape(batch * m, *param_shape)
    stacked = left.new_zeros(batch, m, rows, batch, k)
    index = torch.arange(batch, device=left.device)
    stacked[index, :, :, index, :] = left
    positions = right.permute(1, 0, 2).reshape(cols, batch * k)  # position b·k + p: sample b's p
    return FactoredJacobian(stacked.view(batch * m, rows, batch * k), positions, param_shape)


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
