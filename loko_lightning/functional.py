"""The LoKO Kalman update on plain tensors.

Everything here is stateless: the optimizer (:mod:`loko_lightning.optim`) owns the state and calls
:func:`loko_update`. Notation follows the paper: ``H`` is the ``m x ñ`` Jacobian of the prediction ``ŷ``
with respect to the trainable parameters ``θ̃``, ``p`` the diagonal of the covariance ``P``, ``e = y - ŷ``
the innovation, ``R`` the ``m x m`` observation noise, ``S = H P Hᵀ + R`` and ``K = P Hᵀ S⁻¹``.

The Jacobian of one parameter is a dense tensor of shape ``(m, *param.shape)``, an :class:`OuterJacobian`
(the exact factored form of a Linear layer's weight Jacobian for a single input vector) or a
:class:`FactoredJacobian` (the same for a Linear/Conv2d layer that saw ``k`` positions: pixels, tokens). The
update never materialises a factored block: every product it needs has a closed form in the factors. Dense
blocks are treated as one ``m x n`` matrix (without a copy when they come from
:func:`loko_lightning.jacobian`, which lays them out side by side in one buffer), so the work on them is a few
large matrix products whatever the number of parameters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from loko_lightning.blocks import FactoredJacobian, JacobianBlock, OuterJacobian

REstimator = Literal["taylor", "residual", "identity", "decay", "softmax"]
R_ESTIMATORS: tuple[str, ...] = ("taylor", "residual", "identity", "decay", "softmax")


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


def innovation_covariance(jacobians: Sequence[JacobianBlock], covs: Sequence[Tensor]) -> Tensor:
    """``H P Hᵀ`` summed over parameter blocks (``P`` diagonal, one ``cov`` per parameter).

    Args:
        jacobians: per-parameter Jacobians, dense ``(m, *shape)``, :class:`OuterJacobian` or
            :class:`FactoredJacobian`.
        covs: per-parameter diagonal covariances ``p̂``, each of the parameter's shape.

    Returns:
        The ``m x m`` matrix ``H P Hᵀ``.
    """
    if not jacobians:
        raise ValueError("Invalid jacobians: expected at least one parameter block, got none")
    plan = UpdatePlan(jacobians, [c.shape for c in covs], [0.0] * len(covs), covs[0].dtype, covs[0].device)
    return plan._hpht(jacobians, plan.flatten(covs))[0]


def observation_noise(
    r_estimator: REstimator,
    previous: Tensor,
    innovation: Tensor,
    hpht: Tensor,
    prediction: Tensor,
    step: Tensor,
    beta: float,
) -> Tensor:
    """Observation-noise covariance ``R_k`` for one step.

    Args:
        r_estimator: ``"taylor"`` (paper method 2): ``R̂ = e eᵀ + H P Hᵀ``; ``"residual"`` (method 1):
            ``R̂ = e eᵀ``; both smoothed as ``R_k = β R_{k-1} + (1-β) R̂``. Literature alternatives, used
            as they are: ``"identity"`` ``R = I``; ``"decay"`` ``R = I e^{-k/50}``; ``"softmax"``
            ``R = diag(ŷ) - ŷ ŷᵀ``.
        previous: ``R_{k-1}``, ``m x m``.
        innovation: ``e = y - ŷ``, shape ``(m,)``.
        hpht: ``H P_{k|k-1} Hᵀ``.
        prediction: ``ŷ``, shape ``(m,)``.
        step: ``k``, the 1-based index of this update (0-d tensor).
        beta: forgetting factor of the EMA.

    Returns:
        ``R_k``.
    """
    if r_estimator in ("taylor", "residual"):
        estimate = torch.outer(innovation, innovation)
        if r_estimator == "taylor":
            estimate = estimate + hpht
        return beta * previous + (1.0 - beta) * estimate
    eye = torch.eye(innovation.shape[0], dtype=hpht.dtype, device=hpht.device)
    if r_estimator == "identity":
        return eye
    if r_estimator == "decay":
        return eye * torch.exp(-step.to(hpht.dtype) / 50.0)
    if r_estimator == "softmax":
        return torch.diag(prediction) - torch.outer(prediction, prediction)
    raise ValueError(f"Invalid r_estimator: {r_estimator!r}; expected one of {R_ESTIMATORS}")


def psd_pinv(matrix: Tensor, rcond: float | None = None) -> tuple[Tensor, Tensor]:
    """Pseudo-inverse of a symmetric positive semi-definite matrix by eigendecomposition.

    With softmax outputs ``S`` is singular by construction (the all-ones vector is in its null space), so a
    plain inverse returns garbage. Eigenvalues at or below ``rcond · λ_max`` (including the small negative
    ones rounding produces) are treated as zero, which also keeps the result positive semi-definite, so the
    covariance update can only shrink ``p̂``.

    Args:
        matrix: symmetric ``m x m`` matrix (only its lower triangle is read, so rounding asymmetry is harmless).
        rcond: relative eigenvalue cut-off; default ``m · eps(dtype) · 10``.

    Returns:
        ``(pinv, cond)``: the pseudo-inverse and the condition number of the kept spectrum
        (``λ_max / smallest kept λ``).
    """
    eigvecs, inv_vals, cond = _psd_eigh(matrix, rcond)
    return (eigvecs * inv_vals) @ eigvecs.T, cond


def _psd_eigh(matrix: Tensor, rcond: float | None) -> tuple[Tensor, Tensor, Tensor]:
    """Eigenvectors, the reciprocals of the kept eigenvalues (0 for the others) and the condition number."""
    m = matrix.shape[-1]
    if rcond is None:
        rcond = 10.0 * m * torch.finfo(matrix.dtype).eps
    # eigh reads one triangle only, i.e. it decomposes the symmetric matrix that triangle defines: the
    # symmetrisation against rounding costs nothing.
    eigvals, eigvecs = torch.linalg.eigh(matrix)
    top = eigvals[-1].clamp_min(torch.finfo(matrix.dtype).tiny)
    keep = eigvals > rcond * top
    inv_vals = torch.where(keep, eigvals.reciprocal(), 0.0)  # the discarded reciprocals (maybe inf) are dropped
    return eigvecs, inv_vals, top / torch.where(keep, eigvals, math.inf).amin()


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


class UpdatePlan:
    """The part of a LoKO update that depends only on the layout of the Jacobian, computed once per layout.

    Parameters are put in one flat order: dense blocks first (together they are one ``(m, n)`` matrix ``H``),
    then blocks with one position (``k = 1``, :class:`OuterJacobian`-like), then factored blocks with ``k > 1``,
    each kind grouped by shape so that a group is processed by batched products (factored groups ordered by ``k``:
    their left factors are one matrix, and the products on them run once per ``k``). Everything elementwise (``p̂``,
    the gain, the covariance update) runs on flat vectors in that order. :class:`~loko_lightning.LoKO` keeps
    ``p̂`` in such a flat vector (the per-parameter state tensors are views of it) and reuses one plan while
    the layout does not change, so a step does no planning, no concatenation of ``p̂`` and no copy back;
    :func:`loko_update` builds a plan per call.

    Args:
        jacobians: one block per parameter (only the kinds and shapes are used).
        shapes: the parameters' shapes.
        process_noise: ``q`` per parameter.
        dtype: dtype of the Kalman arithmetic.
        device: device of ``p̂``.
    """

    def __init__(
        self,
        jacobians: Sequence[JacobianBlock],
        shapes: Sequence[torch.Size],
        process_noise: Sequence[float],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if not jacobians:
            raise ValueError("Invalid jacobians: expected at least one parameter block, got none")
        self.dtype, self.device = dtype, device
        self.m = jacobians[0].shape[0]
        self.shapes = [torch.Size(s) for s in shapes]
        numels = [s.numel() for s in self.shapes]
        self.dense = [i for i, j in enumerate(jacobians) if isinstance(j, Tensor)]
        by_shape: dict[tuple[int, int, int], list[int]] = {}
        for i, jac in enumerate(jacobians):
            if isinstance(jac, FactoredJacobian):
                key = (jac.left.shape[2], jac.left.shape[1], jac.right.shape[0])
            elif isinstance(jac, OuterJacobian):
                key = (1, jac.left.shape[1], jac.right.shape[0])
            else:
                continue
            by_shape.setdefault(key, []).append(i)
        self.order = list(self.dense)
        start = self.n_dense = sum(numels[i] for i in self.dense)
        self.outer: list[_Group] = []
        self.factored: list[_Group] = []
        columns = {1: 0, 2: 0}
        for kind, groups in ((1, self.outer), (2, self.factored)):
            # Factored groups with the same k are adjacent: the products on their left factors are batched by k.
            for (k, rows, cols), indices in sorted(by_shape.items(), key=lambda item: item[0][0]):
                if (k == 1) != (kind == 1):
                    continue
                width = len(indices) * rows * (1 if k == 1 else k)
                group = _Group(tuple(indices), k, rows, cols, start, columns[kind], columns[kind] + width)
                groups.append(group)
                self.order.extend(indices)
                start = group.end
                columns[kind] += width
        self.outer_width, self.factored_width = columns[1], columns[2]
        self.n = start
        # Where each factored group's k x k matrices (one per row) lie in one flat buffer, and the runs of groups
        # with one k as (k, lo, hi) in the stacked left factors and (a, b) in that buffer.
        self._gram_spans, self._segments, position = [], [], 0
        for g in self.factored:
            span = (position, position + g.count * g.rows * g.k * g.k)
            self._gram_spans.append(span)
            if self._segments and self._segments[-1][0] == g.k:
                k, lo, _, a, _ = self._segments[-1]
                self._segments[-1] = (k, lo, g.hi, a, span[1])
            else:
                self._segments.append((g.k, g.lo, g.hi, *span))
            position = span[1]
        # The k x k matrices: first M_i, then (once H P Hᵀ is formed) N_i; and M_i L_iᵀ stacked.
        self._grams = torch.empty(position, dtype=dtype, device=device)
        self._ml_t = torch.empty(self.factored_width, self.m, dtype=dtype, device=device)
        self.offsets = [0] * len(numels)
        position = 0
        for i in self.order:
            self.offsets[i] = position
            position += numels[i]
        # Expected layout of dense blocks that are column blocks of one (m, N) buffer (see _dense_matrix).
        self._dense_strides = [_contiguous_strides(self.shapes[i]) for i in self.dense]
        self._dense_columns = [self.offsets[i] for i in self.dense]
        qs = [float(process_noise[i]) for i in self.order]
        if not any(qs):
            self.q: Tensor | float | None = None
        elif len(set(qs)) == 1:
            self.q = qs[0]
        else:
            fills = zip(self.order, qs, strict=True)
            self.q = torch.cat([torch.full((numels[i],), q, dtype=dtype, device=device) for i, q in fills])
        # Work vectors of every step: the update K e and diag(Hᵀ S⁺ H) (then the new p̂).
        self._delta = torch.empty(self.n, dtype=dtype, device=device)
        self._quad = torch.empty(self.n, dtype=dtype, device=device)
        self._delta_views = self.views(self._delta)
        # Constants of every step.
        self._eye = torch.eye(self.m, dtype=dtype, device=device)
        self._ones = torch.ones(self.m, dtype=dtype, device=device)
        self._one = torch.ones((), dtype=dtype, device=device)
        self._zero = torch.zeros((), dtype=dtype, device=device)

    def views(self, flat: Tensor) -> list[Tensor]:
        """Per-parameter views of a flat vector in this plan's order, shaped like the parameters, in parameter order."""
        return [flat[o : o + s.numel()].view(s) for o, s in zip(self.offsets, self.shapes, strict=True)]

    def flatten(self, tensors: Sequence[Tensor]) -> Tensor:
        """One flat vector (in this plan's order and dtype) from per-parameter tensors (in parameter order)."""
        return torch.cat([tensors[i].reshape(-1).to(device=self.device, dtype=self.dtype) for i in self.order])

    def _dense_matrix(self, jacobians: Sequence[JacobianBlock]) -> Tensor:
        """The dense blocks as one ``(m, n_dense)`` matrix.

        A view when they are consecutive column blocks of one buffer, as :func:`loko_lightning.jacobian` returns
        them (checked by address and strides), else a copy.
        """
        blocks = [jacobians[i] for i in self.dense]
        first = blocks[0]
        m, itemsize = self.m, first.element_size()
        base, row_stride = first.data_ptr(), first.stride(0) if first.dim() else 0
        tiled = first.dtype == self.dtype and (m == 1 or row_stride >= self.n_dense)
        if tiled:
            origin = self._dense_columns[0]
            for block, column, strides in zip(blocks, self._dense_columns, self._dense_strides, strict=True):
                if (
                    block.dtype != first.dtype
                    or block.data_ptr() != base + (column - origin) * itemsize
                    or (m > 1 and block.stride(0) != row_stride)
                    or not _strides_match(block, strides)
                ):
                    tiled = False
                    break
        if tiled:
            return torch.as_strided(first, (m, self.n_dense), (row_stride if m > 1 else self.n_dense, 1))
        return torch.cat([block.reshape(m, -1) for block in blocks], dim=1).to(self.dtype)

    def _hpht(self, jacobians: Sequence[JacobianBlock], prior: Tensor) -> tuple[Tensor, tuple]:
        """``H P Hᵀ`` for ``p̂ = prior`` (flat, this plan's order), and what the rest of :meth:`run` reuses."""
        m, dtype = self.m, self.dtype
        jac_d = outer_left = left_all = None
        # H P Hᵀ. All dense blocks are one matrix H (m x n). A block with k = 1 is L ⊗ R: its term is
        # L diag(p R²) Lᵀ, so the L of all of them side by side are one more matrix (m x Σ rows) with weights.
        terms = []
        if self.dense:
            jac_d = self._dense_matrix(jacobians)
            terms.append(_weighted_gram(jac_d, prior[: self.n_dense]))
        outer = []
        if self.outer:
            lefts = [jacobians[i].left.reshape(m, -1).to(dtype) for g in self.outer for i in g.indices]
            outer_left = lefts[0] if len(lefts) == 1 else torch.cat(lefts, dim=1)
            weight = torch.empty(self.outer_width, dtype=dtype, device=self.device)
            for g in self.outer:
                rights = [jacobians[i].right.reshape(-1).to(dtype) for i in g.indices]
                right = rights[0][None] if g.count == 1 else torch.stack(rights)  # (G, cols)
                right_sq = right.square()
                prior_g = prior[g.start : g.end].view(g.count, g.rows, g.cols)
                torch.bmm(prior_g, right_sq[:, :, None], out=weight[g.lo : g.hi].view(g.count, g.rows, 1))
                outer.append((g, right, right_sq))
            terms.append(_weighted_gram(outer_left, weight))
        # Blocks with k > 1: Σ_i L_i M_i L_iᵀ over rows i, with M_i = Rᵀ diag(p_i) R (k x k). The left factors of all
        # of them side by side are one matrix L (m x Σ rows·k); M_i L_iᵀ stacked below each other is another
        # ((Σ rows·k) x m), so the sum is one product. M_i depends on the group's shape, the rest only on k.
        factored = []
        if self.factored:
            lefts = [jacobians[i].left.reshape(m, -1) for g in self.factored for i in g.indices]
            left_all = torch.cat(lefts, dim=1).to(dtype)  # (m, Σ rows·k)
            grams_all, ml_t = self._grams, self._ml_t
            for g, (a, b) in zip(self.factored, self._gram_spans, strict=True):
                rights = [jacobians[i].right for i in g.indices]
                right = (rights[0][None] if g.count == 1 else torch.stack(rights)).to(dtype)  # (G, cols, k)
                prior_g = prior[g.start : g.end].view(g.count, g.rows, g.cols)
                grams = grams_all[a:b].view(g.count, g.rows, g.k, g.k)
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
                factored.append((g, right, outer_r, a, b))
            for k, lo, hi, a, b in self._segments:
                rows = (hi - lo) // k
                grams = grams_all[a:b].view(rows, k, k)
                left_seg = left_all[:, lo:hi].view(m, rows, k).permute(1, 2, 0)  # (Σ rows, k, m)
                torch.bmm(grams, left_seg, out=ml_t[lo:hi].view(rows, k, m))
            terms.append(left_all @ ml_t)
        hpht = terms[0] if len(terms) == 1 else torch.stack(terms).sum(0)
        return hpht, (jac_d, outer_left, outer, left_all, factored)

    def run(
        self,
        params: Sequence[Tensor],
        jacobians: Sequence[JacobianBlock],
        cov: Tensor,
        prediction: Tensor,
        target: Tensor,
        noise: Tensor,
        step: Tensor,
        *,
        beta: float,
        r_estimator: REstimator,
        rcond: float | None = None,
        statistics: bool = True,
    ) -> dict[str, Tensor]:
        """One update with ``p̂`` as the flat vector ``cov`` (this plan's order), updated in place.

        See :func:`loko_update` for everything else.
        """
        m, dtype = self.m, self.dtype
        prediction = prediction.to(dtype)
        innovation = target.to(dtype) - prediction
        prior = cov if self.q is None else cov + self.q

        hpht, (jac_d, outer_left, outer, left_all, factored) = self._hpht(jacobians, prior)

        new_noise = observation_noise(r_estimator, noise, innovation, hpht, prediction, step + 1, beta)
        s_matrix = hpht + new_noise
        finite = torch.isfinite(innovation).all() & torch.isfinite(s_matrix).all()
        # eigh must never see NaN/Inf (LAPACK fails); a skipped step decomposes the identity instead.
        s_matrix = torch.where(finite, s_matrix, self._eye)
        eigvecs, inv_vals, cond = _psd_eigh(s_matrix, rcond)
        # S⁺ = W Wᵀ with W = V Λ^(-1/2) (zero columns for the dropped eigenvalues). [Wᵀ; wᵀ] with w = S⁺ e: every
        # gain and quadratic term below comes from products with it, and the quadratic terms are sums of squares.
        root_t = (eigvecs * inv_vals.sqrt()).T
        solve_e = root_t.T @ (root_t @ torch.where(finite, innovation, 0.0))
        factor = torch.cat([root_t, solve_e[None]])
        ones = self._ones

        # K e = p ⊙ Hᵀ w and (K H)_ii = p_i (Hᵀ S⁺ H)_ii, written straight into flat vectors in plan order.
        delta, quad = self._delta, self._quad
        if self.dense:
            _gain_quad(jac_d, factor, ones, delta[: self.n_dense], quad[: self.n_dense])
        if outer:
            # For L ⊗ R: Hᵀ w = (Lᵀ w) ⊗ R and diag(Hᵀ S⁺ H) = diag(Lᵀ S⁺ L) ⊗ R².
            gain_l, quad_l = _gain_quad(outer_left, factor, ones)
            for g, right, right_sq in outer:
                shape, rows = (g.count, g.rows, g.cols), (g.count, g.rows, 1)
                torch.mul(gain_l[g.lo : g.hi].view(rows), right[:, None], out=delta[g.start : g.end].view(shape))
                torch.mul(quad_l[g.lo : g.hi].view(rows), right_sq[:, None], out=quad[g.start : g.end].view(shape))
        if factored:
            # Hᵀ w = (wᵀ L_i) Rᵀ per row i; diag(Hᵀ S⁺ H)_ij = R_j N_i R_jᵀ with N_i = L_iᵀ S⁺ L_i (k x k).
            products = factor @ left_all  # [Wᵀ L; wᵀ L]
            inner_all = self._grams  # the M_i are used up
            for k, lo, hi, a, b in self._segments:  # N_i = (Wᵀ L_i)ᵀ Wᵀ L_i, (Σ rows, k, k)
                rooted = products[:m, lo:hi].view(m, -1, k)
                torch.bmm(rooted.permute(1, 2, 0), rooted.transpose(0, 1), out=inner_all[a:b].view(-1, k, k))
            for g, right, outer_r, a, b in factored:
                gains = products[m, g.lo : g.hi].view(g.count, g.rows, g.k)
                torch.bmm(gains, right.transpose(1, 2), out=delta[g.start : g.end].view(g.count, g.rows, g.cols))
                inner = inner_all[a:b]
                quad_g = quad[g.start : g.end].view(g.count, g.rows, g.cols)
                if outer_r is not None:  # Σ_ab N_i,ab (R_j R_jᵀ)_ab
                    torch.bmm(inner.view(g.count, g.rows, g.k * g.k), outer_r, out=quad_g)
                else:  # T = R [N_1 … N_rows], (G, cols, rows·k), and quad_ij = Σ_b T_j,ib R_jb
                    inner = inner.view(g.count, g.rows, g.k, g.k).transpose(1, 2).reshape(g.count, g.k, -1)
                    t = torch.bmm(right, inner).view(g.count, g.cols, g.rows, g.k)
                    torch.sum(t.mul_(right[:, :, None, :]), -1, out=quad_g.transpose(1, 2))
        delta.mul_(prior)
        # (K H)_ii lies in [0, 1] in exact arithmetic; the floor keeps p̂ > 0 under rounding.
        posterior = torch.addcmul(self._one, prior, quad, value=-1.0, out=quad)
        posterior.clamp_min_(torch.finfo(dtype).eps).mul_(prior)
        # A NaN or Inf anywhere makes the sum non-finite (so does an overflowing sum, which is skipped as well).
        applied = finite & torch.isfinite(delta.sum() + posterior.sum())

        torch.where(applied, delta, self._zero, out=delta)
        torch.where(applied, posterior, cov, out=cov)
        if all(p.dtype == dtype for p in params):
            torch._foreach_add_(list(params), self._delta_views)
        else:
            for param, d in zip(params, self._delta_views, strict=True):
                param.add_(d.to(param.dtype))
        torch.where(applied, new_noise, noise, out=noise)
        step.add_(applied.to(step.dtype))

        diagnostics = {"applied": applied, "innovation_norm": torch.linalg.vector_norm(innovation), "cond": cond}
        return {**diagnostics, **self.statistics(cov)} if statistics else diagnostics

    def statistics(self, cov: Tensor) -> dict[str, Tensor]:
        """``p_mean``, ``p_min``, ``p_max`` of the flat ``p̂`` ``cov`` and ``gain_norm`` of the last :meth:`run`."""
        p_min, p_max = torch.aminmax(cov)
        return {
            "p_mean": cov.sum() / cov.numel(),
            "p_min": p_min,
            "p_max": p_max,
            "gain_norm": torch.linalg.vector_norm(self._delta),
        }


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


@torch.inference_mode()
def loko_update(
    params: Sequence[Tensor],
    jacobians: Sequence[JacobianBlock],
    covs: Sequence[Tensor],
    prediction: Tensor,
    target: Tensor,
    noise: Tensor,
    step: Tensor,
    *,
    beta: float,
    r_estimator: REstimator,
    process_noise: Sequence[float] | float = 0.0,
    rcond: float | None = None,
    plan: UpdatePlan | None = None,
    cov_flat: Tensor | None = None,
    statistics: bool = True,
) -> dict[str, Tensor]:
    r"""One LoKO step (Algorithm 1 with a diagonal covariance), in place and without host syncs.

    .. math::

        \\hat p_{k|k-1} &= \\hat p_{k-1} + q \\\\
        R_k &= \\beta R_{k-1} + (1-\\beta)\\hat R_k \\\\
        K_k &= \\hat p_{k|k-1} \\bullet H_k^\\top (H_k (\\hat p_{k|k-1} \\bullet H_k^\\top) + R_k)^{+} \\\\
        \\tilde\\theta_k &= \\tilde\\theta_{k|k-1} + K_k (y_k - \\hat y_k) \\\\
        (\\hat p_k)_i &= (\\hat p_{k|k-1})_i - (K_k)_{ij} (H_k)_{ji} (\\hat p_{k|k-1})_i

    The arithmetic runs in the dtype of ``covs``; parameters are updated in their own dtype. If anything
    is non-finite (prediction, target, a Jacobian, the innovation or the resulting update), nothing is
    written: parameters, ``covs``, ``noise`` and ``step`` keep their values and ``diagnostics["applied"]``
    is ``False``. The decision is made on the device with :func:`torch.where`, so no host sync is needed. (The
    update and the new ``p̂`` are tested through their sums, which are non-finite if any entry is; a sum that
    overflows float range also skips the step.)

    It runs under :func:`torch.inference_mode` (cheaper per operation than ``no_grad``; the parameters and states
    it updates in place stay ordinary tensors), so the returned diagnostics are inference tensors: read or log
    them, do not use them in a computation that autograd records.

    Args:
        params: trainable parameters ``θ̃``, updated in place.
        jacobians: per-parameter Jacobians of ``ŷ``: dense ``(m, *shape)``, :class:`OuterJacobian` or
            :class:`FactoredJacobian`.
        covs: per-parameter ``p̂``, updated in place; their dtype is the arithmetic dtype.
        prediction: ``ŷ``, shape ``(m,)``.
        target: ``y``, shape ``(m,)``.
        noise: ``R_{k-1}``, ``m x m``, updated in place to ``R_k``.
        step: number of updates applied so far (0-d integer tensor), incremented in place.
        beta: EMA forgetting factor.
        r_estimator: see :func:`observation_noise`.
        process_noise: ``q`` added to every ``p̂`` in the predict step, one value or one per parameter.
        rcond: relative eigenvalue cut-off of the ``S`` pseudo-inverse (see :func:`psd_pinv`).
        plan: an :class:`UpdatePlan` built for this layout of ``jacobians`` and these parameters (and
            ``process_noise``), to reuse across steps; default: built here.
        cov_flat: ``p̂`` as one flat vector in ``plan``'s order of which ``covs`` are views
            (:meth:`UpdatePlan.views`); then it is updated in place and nothing is copied. Needs ``plan``.
        statistics: also return ``p_mean``, ``p_min``, ``p_max`` and ``gain_norm`` (three passes over ``p̂``); without
            them :meth:`UpdatePlan.statistics` gives them later, until the plan's next update.

    Returns:
        Diagnostics as 0-d tensors: ``applied``, ``innovation_norm``, ``cond`` (of ``S``'s kept spectrum) and, with
        ``statistics``, ``p_mean``, ``p_min``, ``p_max`` and ``gain_norm`` (``‖K e‖``).
    """
    if plan is None:
        if cov_flat is not None:
            raise ValueError("Invalid cov_flat: it is laid out by a plan, so pass the plan as well")
        if isinstance(process_noise, (int, float)):
            process_noise = [float(process_noise)] * len(params)
        plan = UpdatePlan(jacobians, [p.shape for p in params], process_noise, covs[0].dtype, covs[0].device)
    kwargs = dict(beta=beta, r_estimator=r_estimator, rcond=rcond, statistics=statistics)
    if cov_flat is not None:
        return plan.run(params, jacobians, cov_flat, prediction, target, noise, step, **kwargs)
    flat = plan.flatten(covs)
    diagnostics = plan.run(params, jacobians, flat, prediction, target, noise, step, **kwargs)
    torch._foreach_copy_(list(covs), plan.views(flat))
    return diagnostics
