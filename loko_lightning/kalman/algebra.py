"""The per-kind algebra of the LoKO update: how each kind of Jacobian block enters the three products it needs.

:class:`~loko_lightning.kalman.plan.UpdatePlan` puts the parameters in one flat order, dense blocks first, then
blocks with one position, then factored blocks with ``k > 1``, and hands each kind to one of the classes below.
They share one small interface (:class:`Blocks`): in every step

1. :meth:`Blocks.hpht` returns the kind's term of ``H P Hᵀ`` (``P = diag(p̂)``), and
2. :meth:`Blocks.gain_and_quad` writes the kind's entries of ``Hᵀ w`` (``w = S⁺ e``; times ``p̂`` this is the
   update ``K e``) and of ``diag(Hᵀ S⁺ H)`` (times ``p̂`` this is ``diag(K H)``) into flat vectors,

given ``[Wᵀ; wᵀ]`` with ``S⁺ = W Wᵀ``. What the second call reuses from the first (the Jacobian factors cast and
stacked) is kept on the object in between and dropped after it. None of the three products is ever formed with a
dense ``H`` for the factored kinds: each has a closed form in the factors. The weights whose rows share one full
covariance are a kind with an update of its own (:class:`~loko_lightning.kalman.shared_rows.SharedRowBlocks`,
re-exported here).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from loko_lightning.jacobians.blocks import JacobianBlock, kind
from loko_lightning.kalman.shared_rows import SharedRowBlocks

__all__ = ["Blocks", "DenseBlocks", "FactoredBlocks", "OuterBlocks", "SharedRowBlocks"]


def _weighted_gram(jac: Tensor, weight: Tensor) -> Tensor:
    """``H diag(w) Hᵀ`` for a wide ``(m, n)`` matrix ``H``.

    BLAS runs a product with a huge inner dimension and a small output at low efficiency; splitting the inner
    dimension (a batch of products for small ``m``, cache-sized chunks for large ``m``) and summing the parts is
    exact up to the order of summation and markedly faster.
    """
    m, n = jac.shape
    if m >= 32:
        chunk = 8192
        if n <= chunk:
            return (jac * weight) @ jac.T
        gram = torch.zeros(m, m, dtype=jac.dtype, device=jac.device)
        scratch = torch.empty(m * chunk, dtype=jac.dtype, device=jac.device)
        for start in range(0, n, chunk):
            part = jac[:, start : start + chunk]
            width = part.shape[1]
            scaled = torch.mul(part, weight[start : start + width], out=scratch[: m * width].view(m, width))
            gram.addmm_(scaled, part.T)
        return gram
    scaled = jac * weight
    split = min(16, n // 4096)
    if split < 2:
        return scaled @ jac.T
    body = n - n % split
    a = scaled[:, :body].reshape(m, split, -1).transpose(0, 1)
    b = jac[:, :body].reshape(m, split, -1).permute(1, 2, 0)
    gram = torch.bmm(a, b).sum(0)
    if body < n:
        gram = gram + scaled[:, body:] @ jac[:, body:].T
    return gram


def _gain_quad(
    jac: Tensor, factor: Tensor, ones: Tensor, gain: Tensor | None = None, quad: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``Hᵀ w`` and ``diag(Hᵀ S⁺ H)`` for a wide ``(m, n)`` matrix ``H``, in one pass over ``H``.

    ``factor`` is ``[Wᵀ; wᵀ]`` (``(m + 1, m)``) with ``S⁺ = W Wᵀ``, so ``factor · H`` gives ``WᵀH``, whose squared
    columns sum to ``diag(Hᵀ S⁺ H)``, and ``wᵀH`` together; it is formed in chunks of columns that stay in cache
    while they are squared and summed (with ``ones``, ``m`` ones). The results are written into ``gain`` and
    ``quad`` (shape ``(n,)``) when both are given.
    """
    m, n = jac.shape
    chunk = max(4096, 409600 // m)
    if gain is None or quad is None:
        if n <= chunk:
            products = factor @ jac
            return products[m], ones @ products[:m].square_()
        gain = torch.empty(n, dtype=jac.dtype, device=jac.device)
        quad = torch.empty(n, dtype=jac.dtype, device=jac.device)
    scratch = torch.empty((m + 1) * min(chunk, n), dtype=jac.dtype, device=jac.device)
    for start in range(0, n, chunk):
        part = jac[:, start : start + chunk]
        width = part.shape[1]
        products = torch.mm(factor, part, out=scratch[: (m + 1) * width].view(m + 1, width))
        gain[start : start + width] = products[m]
        torch.mv(products[:m].square_().T, ones, out=quad[start : start + width])
    return gain, quad


class Blocks:
    """The Jacobian blocks of one kind, with the parameters they belong to at ``start:end`` of the flat order.

    Attributes:
        order: the indices of the kind's parameters, in flat order.
        start: where the kind's parameters begin in the flat order.
        end: where they end.
    """

    order: list[int]
    start: int
    end: int

    def __init__(self, m: int, dtype: torch.dtype, device: torch.device) -> None:
        self.m, self.dtype, self.device = m, dtype, device
        self._ones = torch.ones(m, dtype=dtype, device=device)

    def __bool__(self) -> bool:
        return bool(self.order)

    def hpht(self, jacobians: Sequence[JacobianBlock], prior: Tensor) -> Tensor:
        """This kind's term of ``H P Hᵀ`` (``m x m``) for ``p̂ = prior`` (the whole flat vector)."""
        raise NotImplementedError

    def gain_and_quad(self, factor: Tensor, gain: Tensor, quad: Tensor) -> None:
        """Write this kind's entries of ``Hᵀ w`` into ``gain`` and of ``diag(Hᵀ S⁺ H)`` into ``quad``.

        Args:
            factor: ``[Wᵀ; wᵀ]``, ``(m + 1, m)``, with ``S⁺ = W Wᵀ`` and ``w = S⁺ e``.
            gain: the whole flat vector, written at ``start:end``.
            quad: the same for ``diag(Hᵀ S⁺ H)``.

        Uses the factors of the Jacobian that the preceding :meth:`hpht` of the same step received.
        """
        raise NotImplementedError


class DenseBlocks(Blocks):
    """Dense blocks ``(m, *shape)``: together one ``(m, n)`` matrix ``H``, so every product is a few large ones.

    Args:
        jacobians: one block per parameter; the dense ones (:class:`~torch.Tensor`) are this kind's.
        shapes: the parameters' shapes.
        m: number of outputs.
        dtype: dtype of the Kalman arithmetic.
        device: device of ``p̂``.
        exclude: parameters another kind takes (:class:`SharedRowBlocks`).
    """

    def __init__(
        self,
        jacobians: Sequence[JacobianBlock],
        shapes: Sequence[torch.Size],
        m: int,
        dtype: torch.dtype,
        device: torch.device,
        exclude: frozenset[int] = frozenset(),
    ) -> None:
        super().__init__(m, dtype, device)
        self.order = [i for i, jac in enumerate(jacobians) if i not in exclude and kind(jac).group_key(jac) is None]
        self._columns, column = [], 0
        for i in self.order:
            self._columns.append(column)
            column += shapes[i].numel()
        self.start, self.end = 0, column
        # Expected layout of blocks that are column blocks of one (m, n) buffer (see matrix).
        self._strides = [_contiguous_strides(shapes[i]) for i in self.order]
        self._matrix: Tensor | None = None

    def matrix(self, jacobians: Sequence[JacobianBlock]) -> Tensor:
        """The dense blocks as one ``(m, n)`` matrix.

        A view when they are consecutive column blocks of one buffer, as :func:`loko_lightning.jacobian` returns
        them (checked by address and strides), else a copy.
        """
        blocks = [jacobians[i] for i in self.order]
        first = blocks[0]
        m, n, itemsize = self.m, self.end - self.start, first.element_size()
        base, row_stride = first.data_ptr(), first.stride(0) if first.dim() else 0
        tiled = first.dtype == self.dtype and (m == 1 or row_stride >= n)
        if tiled:
            for block, column, strides in zip(blocks, self._columns, self._strides, strict=True):
                if (
                    block.dtype != first.dtype
                    or block.data_ptr() != base + column * itemsize
                    or (m > 1 and block.stride(0) != row_stride)
                    or not _strides_match(block, strides)
                ):
                    tiled = False
                    break
        if tiled:
            return torch.as_strided(first, (m, n), (row_stride if m > 1 else n, 1))
        return torch.cat([block.reshape(m, -1) for block in blocks], dim=1).to(self.dtype)

    def hpht(self, jacobians: Sequence[JacobianBlock], prior: Tensor) -> Tensor:
        """``H diag(p̂) Hᵀ`` of the dense matrix (see :meth:`Blocks.hpht`)."""
        self._matrix = self.matrix(jacobians)
        return _weighted_gram(self._matrix, prior[self.start : self.end])

    def gain_and_quad(self, factor: Tensor, gain: Tensor, quad: Tensor) -> None:
        """``Hᵀ w`` and ``diag(Hᵀ S⁺ H)`` in one pass over ``H`` (see :meth:`Blocks.gain_and_quad`)."""
        span = slice(self.start, self.end)
        _gain_quad(self._matrix, factor, self._ones, gain[span], quad[span])
        self._matrix = None


@dataclass(frozen=True)
class _Group:
    """Factored blocks of one shape, processed together.

    Parameters ``indices``, each ``rows x cols`` with ``k`` positions, stored consecutively from ``start`` in the
    flat order; ``lo:hi`` are their columns among the stacked left factors (``rows`` per block for ``k = 1``,
    ``rows · k`` otherwise).
    """

    indices: tuple[int, ...]
    k: int
    rows: int
    cols: int
    start: int
    lo: int
    hi: int

    @property
    def count(self) -> int:
        return len(self.indices)

    @property
    def end(self) -> int:
        return self.start + len(self.indices) * self.rows * self.cols


def _groups(
    jacobians: Sequence[JacobianBlock], start: int, one_position: bool, exclude: frozenset[int] = frozenset()
) -> list[_Group]:
    """The factored blocks with ``k = 1`` (``one_position``) or ``k > 1`` grouped by shape, ordered by ``k``."""
    by_shape: dict[tuple[int, int, int], list[int]] = {}
    for i, jac in enumerate(jacobians):
        key = kind(jac).group_key(jac)
        if key is None or i in exclude:
            continue
        if (key[0] == 1) == one_position:
            by_shape.setdefault(key, []).append(i)
    groups, column = [], 0
    # Groups with the same k are adjacent: the products on their left factors are batched by k.
    for (k, rows, cols), indices in sorted(by_shape.items(), key=lambda item: item[0][0]):
        width = len(indices) * rows * k
        groups.append(_Group(tuple(indices), k, rows, cols, start, column, column + width))
        start, column = groups[-1].end, column + width
    return groups


class OuterBlocks(Blocks):
    """Blocks with one position, ``L ⊗ R`` (:class:`OuterJacobian`, :class:`FactoredJacobian` with ``k = 1``).

    For ``L`` (``m x rows``) and ``R`` (``cols``): ``H P Hᵀ = L diag(p R²) Lᵀ`` (``p R²`` summed over the ``cols``
    of each row), ``Hᵀ w = (Lᵀ w) ⊗ R`` and ``diag(Hᵀ S⁺ H) = diag(Lᵀ S⁺ L) ⊗ R²``: the ``L`` of all such blocks side
    by side are one wide matrix that is treated like the dense ``H``.

    Args:
        jacobians: one block per parameter; those with one position are this kind's.
        start: where the kind begins in the flat order.
        m: number of outputs.
        dtype: dtype of the Kalman arithmetic.
        device: device of ``p̂``.
        exclude: parameters another kind takes (:class:`SharedRowBlocks`).
    """

    def __init__(
        self,
        jacobians: Sequence[JacobianBlock],
        start: int,
        m: int,
        dtype: torch.dtype,
        device: torch.device,
        exclude: frozenset[int] = frozenset(),
    ) -> None:
        super().__init__(m, dtype, device)
        self.groups = _groups(jacobians, start, one_position=True, exclude=exclude)
        self.order = [i for g in self.groups for i in g.indices]
        self.start, self.end = start, self.groups[-1].end if self.groups else start
        self.width = self.groups[-1].hi if self.groups else 0
        self._left: Tensor | None = None
        self._rights: list[Tensor] = []
        self._rights_sq: list[Tensor] = []

    def hpht(self, jacobians: Sequence[JacobianBlock], prior: Tensor) -> Tensor:
        """``L diag(p R²) Lᵀ`` of the stacked ``L`` (see :meth:`Blocks.hpht`)."""
        m, dtype = self.m, self.dtype
        lefts = [jacobians[i].left.reshape(m, -1).to(dtype) for g in self.groups for i in g.indices]
        self._left = lefts[0] if len(lefts) == 1 else torch.cat(lefts, dim=1)
        weight = torch.empty(self.width, dtype=dtype, device=self.device)
        self._rights, self._rights_sq = [], []
        for g in self.groups:
            rights = [jacobians[i].right.reshape(-1).to(dtype) for i in g.indices]
            right = rights[0][None] if g.count == 1 else torch.stack(rights)  # (G, cols)
            right_sq = right.square()
            prior_g = prior[g.start : g.end].view(g.count, g.rows, g.cols)
            torch.bmm(prior_g, right_sq[:, :, None], out=weight[g.lo : g.hi].view(g.count, g.rows, 1))
            self._rights.append(right)
            self._rights_sq.append(right_sq)
        return _weighted_gram(self._left, weight)

    def gain_and_quad(self, factor: Tensor, gain: Tensor, quad: Tensor) -> None:
        """``(Lᵀ w) ⊗ R`` and ``diag(Lᵀ S⁺ L) ⊗ R²`` (see :meth:`Blocks.gain_and_quad`)."""
        gain_l, quad_l = _gain_quad(self._left, factor, self._ones)
        for g, right, right_sq in zip(self.groups, self._rights, self._rights_sq, strict=True):
            shape, rows = (g.count, g.rows, g.cols), (g.count, g.rows, 1)
            torch.mul(gain_l[g.lo : g.hi].view(rows), right[:, None], out=gain[g.start : g.end].view(shape))
            torch.mul(quad_l[g.lo : g.hi].view(rows), right_sq[:, None], out=quad[g.start : g.end].view(shape))
        self._left, self._rights, self._rights_sq = None, [], []


@dataclass(frozen=True)
class _Run:
    """Consecutive factored groups with one ``k``.

    Their columns ``lo:hi`` among the stacked left factors, and their ``k x k`` matrices at ``grams`` of the buffer.
    """

    k: int
    lo: int
    hi: int
    grams: slice


class FactoredBlocks(Blocks):
    """:class:`FactoredJacobian` blocks with ``k > 1`` positions: ``H_i = L_i Rᵀ`` per row ``i`` of the weight.

    With ``L_i`` (``m x k``, the cotangents of output row ``i``) and ``R`` (``cols x k``, the inputs):
    ``H P Hᵀ = Σ_i L_i M_i L_iᵀ`` with ``M_i = Rᵀ diag(p_i) R``; ``Hᵀ w = (wᵀ L_i) Rᵀ``;
    ``diag(Hᵀ S⁺ H)_ij = R_j N_i R_jᵀ`` with ``N_i = L_iᵀ S⁺ L_i``. Blocks of one shape are one group of batched
    products, and the products on the left factors run once per ``k``.

    Args:
        jacobians: one block per parameter; the factored ones with ``k > 1`` are this kind's.
        start: where the kind begins in the flat order.
        m: number of outputs.
        dtype: dtype of the Kalman arithmetic.
        device: device of ``p̂``.
        exclude: parameters another kind takes (:class:`SharedRowBlocks`).
    """

    def __init__(
        self,
        jacobians: Sequence[JacobianBlock],
        start: int,
        m: int,
        dtype: torch.dtype,
        device: torch.device,
        exclude: frozenset[int] = frozenset(),
    ) -> None:
        super().__init__(m, dtype, device)
        self.groups = _groups(jacobians, start, one_position=False, exclude=exclude)
        self.order = [i for g in self.groups for i in g.indices]
        self.start, self.end = start, self.groups[-1].end if self.groups else start
        # Where each group's k x k matrices (one per row) lie in one flat buffer, and the runs of groups with one k.
        self._spans: list[slice] = []
        self._runs: list[_Run] = []
        position = 0
        for g in self.groups:
            span = slice(position, position + g.count * g.rows * g.k * g.k)
            self._spans.append(span)
            if self._runs and self._runs[-1].k == g.k:
                last = self._runs[-1]
                self._runs[-1] = _Run(g.k, last.lo, g.hi, slice(last.grams.start, span.stop))
            else:
                self._runs.append(_Run(g.k, g.lo, g.hi, span))
            position = span.stop
        # The k x k matrices: first M_i, then (once H P Hᵀ is formed) N_i; and M_i L_iᵀ stacked.
        width = self.groups[-1].hi if self.groups else 0
        self._grams = torch.empty(position, dtype=dtype, device=device)
        self._ml_t = torch.empty(width, m, dtype=dtype, device=device)
        self._left: Tensor | None = None
        self._rights: list[Tensor] = []
        self._outer_r: list[Tensor | None] = []

    def hpht(self, jacobians: Sequence[JacobianBlock], prior: Tensor) -> Tensor:
        """``Σ_i L_i M_i L_iᵀ`` (see :meth:`Blocks.hpht`).

        The left factors of all blocks side by side are one matrix ``L`` (``m x Σ rows·k``); ``M_i L_iᵀ`` stacked
        below each other is another (``(Σ rows·k) x m``), so the sum is one product. ``M_i`` depends on the group's
        shape, the rest only on ``k``.
        """
        m, dtype = self.m, self.dtype
        lefts = [jacobians[i].left.reshape(m, -1) for g in self.groups for i in g.indices]
        self._left = torch.cat(lefts, dim=1).to(dtype)  # (m, Σ rows·k)
        self._rights, self._outer_r = [], []
        for g, span in zip(self.groups, self._spans, strict=True):
            rights = [jacobians[i].right for i in g.indices]
            right = (rights[0][None] if g.count == 1 else torch.stack(rights)).to(dtype)  # (G, cols, k)
            prior_g = prior[g.start : g.end].view(g.count, g.rows, g.cols)
            grams = self._grams[span].view(g.count, g.rows, g.k, g.k)
            if g.k <= g.rows:
                # With few positions the outer products R_j R_jᵀ (k² numbers per column j) are no larger than
                # p_i ⊙ R: then M_i = Σ_j p_ij R_j R_jᵀ is one batched product, and so is the quadratic term.
                right_t = right.transpose(1, 2).contiguous()  # (G, k, cols): the products below run along cols
                outer_r = (right_t[:, :, None, :] * right_t[:, None, :, :]).view(g.count, g.k * g.k, g.cols)
                torch.bmm(prior_g, outer_r.transpose(1, 2), out=grams.view(g.count, g.rows, g.k * g.k))
            else:
                # p_i ⊙ R of every row i side by side, (G, cols, rows·k): one product with Rᵀ gives all M_i.
                outer_r = None
                scaled = torch.empty(g.count, g.cols, g.rows, g.k, dtype=dtype, device=self.device)
                torch.mul(prior_g.transpose(1, 2)[:, :, :, None], right[:, :, None, :], out=scaled)
                stacked = torch.bmm(right.transpose(1, 2), scaled.view(g.count, g.cols, -1))  # (G, k, rows·k)
                grams.copy_(stacked.view(g.count, g.k, g.rows, g.k).transpose(1, 2))
            self._rights.append(right)
            self._outer_r.append(outer_r)
        for run in self._runs:
            rows = (run.hi - run.lo) // run.k
            grams = self._grams[run.grams].view(rows, run.k, run.k)
            left = self._left[:, run.lo : run.hi].view(m, rows, run.k).permute(1, 2, 0)  # (Σ rows, k, m)
            torch.bmm(grams, left, out=self._ml_t[run.lo : run.hi].view(rows, run.k, m))
        return self._left @ self._ml_t

    def gain_and_quad(self, factor: Tensor, gain: Tensor, quad: Tensor) -> None:
        """``(wᵀ L_i) Rᵀ`` and ``R_j N_i R_jᵀ`` (see :meth:`Blocks.gain_and_quad`)."""
        m = self.m
        products = factor @ self._left  # [Wᵀ L; wᵀ L]
        for run in self._runs:  # N_i = (Wᵀ L_i)ᵀ Wᵀ L_i, (Σ rows, k, k), over the M_i that are used up
            rooted = products[:m, run.lo : run.hi].view(m, -1, run.k)
            inner = self._grams[run.grams].view(-1, run.k, run.k)
            torch.bmm(rooted.permute(1, 2, 0), rooted.transpose(0, 1), out=inner)
        for g, span, right, outer_r in zip(self.groups, self._spans, self._rights, self._outer_r, strict=True):
            gains = products[m, g.lo : g.hi].view(g.count, g.rows, g.k)
            torch.bmm(gains, right.transpose(1, 2), out=gain[g.start : g.end].view(g.count, g.rows, g.cols))
            inner = self._grams[span]
            quad_g = quad[g.start : g.end].view(g.count, g.rows, g.cols)
            if outer_r is not None:  # Σ_ab N_i,ab (R_j R_jᵀ)_ab
                torch.bmm(inner.view(g.count, g.rows, g.k * g.k), outer_r, out=quad_g)
            else:  # T = R [N_1 … N_rows], (G, cols, rows·k), and quad_ij = Σ_b T_j,ib R_jb
                inner = inner.view(g.count, g.rows, g.k, g.k).transpose(1, 2).reshape(g.count, g.k, -1)
                t = torch.bmm(right, inner).view(g.count, g.cols, g.rows, g.k)
                torch.sum(t.mul_(right[:, :, None, :]), -1, out=quad_g.transpose(1, 2))
        self._left, self._rights, self._outer_r = None, [], []


def _contiguous_strides(shape: torch.Size) -> tuple[tuple[int, int], ...]:
    """``(dim, stride)`` of a contiguous tensor of ``shape``, for the dimensions of size > 1 (others are free)."""
    strides, stride = [], 1
    for dim in range(len(shape) - 1, -1, -1):
        if shape[dim] > 1:
            strides.append((dim + 1, stride))
        stride *= shape[dim]
    return tuple(strides)


def _strides_match(block: Tensor, expected: tuple[tuple[int, int], ...]) -> bool:
    strides = block.stride()
    return all(strides[dim] == stride for dim, stride in expected)
