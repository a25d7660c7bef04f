"""The LoKO Kalman update on plain tensors.

Everything here is stateless: the optimizer (:mod:`loko_lightning.kalman.optimizer`) owns the state and calls
:func:`loko_update`. Notation follows the paper: ``H`` is the ``m x ñ`` Jacobian of the prediction ``ŷ``
with respect to the trainable parameters ``θ̃``, ``p`` the diagonal of the covariance ``P``, ``e = y - ŷ``
the innovation, ``R`` the ``m x m`` observation noise, ``S = H P Hᵀ + R`` and ``K = P Hᵀ S⁻¹``.
:mod:`loko_lightning.kalman.reference` is the same step written with dense matrices in float64, slow and obviously
correct; the tests hold this fast path to it.

The Jacobian of one parameter is a dense tensor of shape ``(m, *param.shape)``, an :class:`OuterJacobian`
(the exact factored form of a Linear layer's weight Jacobian for a single input vector) or a
:class:`FactoredJacobian` (the same for a Linear/Conv2d layer that saw ``k`` positions: pixels, tokens). The
update never materialises a factored block: every product it needs has a closed form in the factors
(:mod:`loko_lightning.kalman.algebra`, one class per kind of block). Dense blocks are treated as one ``m x n``
matrix (without a copy when they come from :func:`loko_lightning.jacobian`, which lays them out side by side in
one buffer), so the work on them is a few large matrix products whatever the number of parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from loko_lightning.jacobians.blocks import JacobianBlock
from loko_lightning.kalman.algebra import Blocks, DenseBlocks, FactoredBlocks, OuterBlocks
from loko_lightning.kalman.noise import REstimator, observation_noise

__all__ = [
    "UpdatePlan",
    "innovation_covariance",
    "loko_update",
    "psd_pinv",
]


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
    return plan.hpht(jacobians, plan.flatten(covs))


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


def _pinv_factor(S: Tensor, innovation: Tensor, rcond: float | None) -> tuple[Tensor, Tensor]:
    """``[Wᵀ; wᵀ]`` (``(m + 1, m)``) with ``S⁺ = W Wᵀ`` and ``w = S⁺ e``, and the condition number of ``S``.

    ``W = V Λ^(-1/2)`` (zero columns for the dropped eigenvalues): every gain and quadratic term of the update
    comes from products with this one matrix, and the quadratic terms are sums of squares.
    """
    eigvecs, inv_vals, cond = _psd_eigh(S, rcond)
    root_t = (eigvecs * inv_vals.sqrt()).T
    w = root_t.T @ (root_t @ innovation)
    return torch.cat([root_t, w[None]]), cond


def _sum_rows(rows: Tensor, out: Tensor, square: bool = False) -> Tensor:
    """``Σ_r rows[r]`` (or of their squares) into ``out``, each entry summed in an order that depends on ``r`` only.

    Elementwise adds round every entry alike wherever its column sits, so a shard of the columns
    (:mod:`loko_lightning.kalman.sharded`) gets the same bits; a reduction kernel's order can depend on the column's
    place in the vector lanes. Up to 16 rows are added one after another; more in a pairwise tree (row ``i`` with row
    ``i + half``), ``log2`` of the rows in kernel launches.
    """
    count = rows.shape[0]
    if count <= 16:
        if square:
            torch.mul(rows[0], rows[0], out=out)
        else:
            out.copy_(rows[0])
        scratch = torch.empty_like(out) if square and count > 1 else None
        for row in rows[1:]:
            out.add_(torch.mul(row, row, out=scratch) if square else row)
        return out
    level = rows * rows if square else rows
    while level.shape[0] > 1:
        half = level.shape[0] // 2
        paired = level[:half] + level[half : 2 * half]
        if level.shape[0] % 2:
            paired[-1] += level[-1]
        level = paired
    return out.copy_(level[0])


class UpdatePlan:
    """The part of a LoKO update that depends only on the layout of the Jacobian, computed once per layout.

    Parameters are put in one flat order: dense blocks first (together they are one ``(m, n)`` matrix ``H``),
    then blocks with one position (``k = 1``, :class:`OuterJacobian`-like), then factored blocks with ``k > 1``,
    each kind grouped by shape so that a group is processed by batched products (factored groups ordered by ``k``:
    their left factors are one matrix, and the products on them run once per ``k``). Each kind's algebra lives
    in one object (:attr:`kinds`, see :mod:`loko_lightning.kalman.algebra`). Everything elementwise (``p̂``, the
    gain, the covariance update) runs on flat vectors in that order. :class:`~loko_lightning.LoKO` keeps ``p̂`` in
    such a flat vector (the per-parameter state tensors are views of it) and reuses one plan while the layout
    does not change, so a step does no planning, no concatenation of ``p̂`` and no copy back; :func:`loko_update`
    builds a plan per call.

    Args:
        jacobians: one block per parameter (only the kinds and shapes are used).
        shapes: the parameters' shapes.
        process_noise: ``q`` per parameter.
        dtype: dtype of the Kalman arithmetic.
        device: device of ``p̂``.
        samples: ``B``, the number of samples the ``m`` rows of the blocks stack (the multistream update):
            ``m / B`` outputs each, with a block-diagonal ``R``. 1: the paper's single observation.
        p_floor: the floor on ``p̂`` per parameter (the updated ``p̂`` is at least this); default: none (0).
        shrinkage: ``λ`` per parameter of the shrinkage process model ``θ̃_{k+1|k} = (1 − λ) θ̃_k`` (not the paper;
            default none, 0): the time update after each applied step scales the parameters by ``1 − λ`` and keeps
            ``p̂`` (the process noise ``(1 − (1 − λ)²) p̂`` that restores it is implied), the Kalman form of decoupled
            weight decay.
        inflation: ``α`` per parameter of multiplicative covariance inflation (not the paper; default none, 0): the
            time update scales ``p̂`` by ``1 + α`` (forgetting: old information loses weight geometrically).
        forgetting: ``γ`` per parameter of stabilised forgetting (not the paper; default none, 0): the time update
            mixes the precision with a reference one, ``1/p̂ ← (1 − γ)/p̂ + γ/reference``, so old information loses
            weight geometrically but ``p̂`` stays below ``reference`` (where inflation lets it grow without bound).
        reference: the reference variance of ``forgetting`` per parameter (``p0``, or ``p0 / fan_in``).
    """

    def __init__(
        self,
        jacobians: Sequence[JacobianBlock],
        shapes: Sequence[torch.Size],
        process_noise: Sequence[float],
        dtype: torch.dtype,
        device: torch.device,
        samples: int = 1,
        p_floor: Sequence[float] | None = None,
        shrinkage: Sequence[float] | None = None,
        inflation: Sequence[float] | None = None,
        forgetting: Sequence[float] | None = None,
        reference: Sequence[float] | None = None,
    ) -> None:
        if not jacobians:
            raise ValueError("Invalid jacobians: expected at least one parameter block, got none")
        self.dtype, self.device = dtype, device
        self.m = m = jacobians[0].shape[0]
        if samples < 1 or m % samples:
            raise ValueError(f"Invalid samples: {samples} (must be >= 1 and divide the {m} rows of the Jacobian)")
        self.samples = samples
        self.shapes = [torch.Size(s) for s in shapes]
        self.dense = DenseBlocks(jacobians, self.shapes, m, dtype, device)
        self.outer = OuterBlocks(jacobians, self.dense.end, m, dtype, device)
        self.factored = FactoredBlocks(jacobians, self.outer.end, m, dtype, device)
        self.kinds: list[Blocks] = [kind for kind in (self.dense, self.outer, self.factored) if kind]
        self.order = [i for kind in self.kinds for i in kind.order]
        self.n = self.factored.end
        numels = [s.numel() for s in self.shapes]
        self.offsets = [0] * len(numels)
        position = 0
        for i in self.order:
            self.offsets[i] = position
            position += numels[i]
        self.q = self._per_entry(process_noise, numels)
        self.floor = None if p_floor is None else self._per_entry(p_floor, numels)
        # The time update after an applied step (not the paper): θ̃ ← keep ⊙ θ̃, p̂ ← scale ⊙ p̂.
        lam = None if shrinkage is None else self._per_entry(shrinkage, numels)
        alpha = None if inflation is None else self._per_entry(inflation, numels)
        self.keep = None if lam is None else torch.as_tensor(1.0 - lam, dtype=dtype, device=device)
        self.scale = None if alpha is None else torch.as_tensor(1.0 + alpha, dtype=dtype, device=device)
        # Stabilised forgetting (not the paper): 1/p̂ ← (1 − γ)/p̂ + γ/reference, i.e. p̂ ← p̂ / ((1 − γ) + (γ/ref) p̂).
        self.forget_keep = self.forget_rate = None
        if forgetting is not None and any(forgetting):
            if reference is None:
                raise ValueError("Invalid reference: forgetting needs the reference variance of every parameter")
            rates = [g / r if g else 0.0 for g, r in zip(forgetting, reference, strict=True)]
            self.forget_keep = torch.as_tensor(1.0 - self._per_entry(forgetting, numels), dtype=dtype, device=device)
            rate = self._per_entry(rates, numels)
            self.forget_rate = torch.as_tensor(0.0 if rate is None else rate, dtype=dtype, device=device)
        # Work vectors of every step: the update K e and diag(Hᵀ S⁺ H) (then the new p̂).
        self._update = torch.empty(self.n, dtype=dtype, device=device)
        self._quad = torch.empty(self.n, dtype=dtype, device=device)
        self._update_views = self.views(self._update)
        # Constants of every step.
        self._eye = torch.eye(m, dtype=dtype, device=device)
        self._one = torch.ones((), dtype=dtype, device=device)
        self._zero = torch.zeros((), dtype=dtype, device=device)

    def _per_entry(self, values: Sequence[float], numels: Sequence[int]) -> Tensor | float | None:
        """One value per parameter, as the flat arithmetic uses it: None (all 0), a float (all equal) or a vector."""
        ordered = [float(values[i]) for i in self.order]
        if not any(ordered):
            return None
        if len(set(ordered)) == 1:
            return ordered[0]
        fills = zip(self.order, ordered, strict=True)
        return torch.cat([torch.full((numels[i],), v, dtype=self.dtype, device=self.device) for i, v in fills])

    def views(self, flat: Tensor) -> list[Tensor]:
        """Per-parameter views of a flat vector in this plan's order, shaped like the parameters, in parameter order."""
        return [flat[o : o + s.numel()].view(s) for o, s in zip(self.offsets, self.shapes, strict=True)]

    def flatten(self, tensors: Sequence[Tensor]) -> Tensor:
        """One flat vector (in this plan's order and dtype) from per-parameter tensors (in parameter order)."""
        return torch.cat([tensors[i].reshape(-1).to(device=self.device, dtype=self.dtype) for i in self.order])

    def _dense_matrix(self, jacobians: Sequence[JacobianBlock]) -> Tensor:
        """The dense blocks as one ``(m, n)`` matrix (see :meth:`DenseBlocks.matrix`)."""
        return self.dense.matrix(jacobians)

    def hpht(self, jacobians: Sequence[JacobianBlock], prior: Tensor) -> Tensor:
        """``H P Hᵀ`` for ``p̂ = prior`` (flat, this plan's order): the sum of every kind's term."""
        terms = [kind.hpht(jacobians, prior) for kind in self.kinds]
        return terms[0] if len(terms) == 1 else torch.stack(terms).sum(0)

    def run(
        self,
        params: Sequence[Tensor],
        jacobians: Sequence[JacobianBlock],
        cov: Tensor,
        prediction: Tensor,
        target: Tensor,
        R: Tensor,
        step: Tensor,
        *,
        beta: float,
        r_estimator: REstimator,
        rcond: float | None = None,
        statistics: bool = True,
        aggregation: tuple[Tensor, Tensor] | None = None,
    ) -> dict[str, Tensor]:
        """One update with ``p̂`` as the flat vector ``cov`` (this plan's order), updated in place.

        See :func:`loko_update` for everything else.
        """
        proposal = self.propose(
            jacobians, cov, prediction, target, R, step, beta=beta, r_estimator=r_estimator, rcond=rcond,
            aggregation=aggregation,
        )  # fmt: skip
        posterior, finite, R_k = proposal["posterior"], proposal["finite"], proposal["R"]
        # 6. θ̃_k = θ̃_{k|k-1} + K e, unless something is non-finite.
        applied = self._apply(params, cov, posterior, finite)
        torch.where(applied, R_k, R, out=R)
        step.add_(applied.to(step.dtype))

        norm = torch.linalg.vector_norm(proposal["innovation"])
        diagnostics = {"applied": applied, "innovation_norm": norm, "cond": proposal["cond"]}
        return {**diagnostics, **self.statistics(cov)} if statistics else diagnostics

    def propose(
        self,
        jacobians: Sequence[JacobianBlock],
        cov: Tensor,
        prediction: Tensor,
        target: Tensor,
        R: Tensor,
        step: Tensor,
        *,
        beta: float,
        r_estimator: REstimator,
        rcond: float | None = None,
        aggregation: tuple[Tensor, Tensor] | None = None,
        reduce: Callable[[Tensor], Tensor] | None = None,
    ) -> dict[str, Tensor]:
        """Steps 1-6 of :meth:`run` without writing any state: the update ``K e`` (in :attr:`update`) and ``p̂_k``.

        The arguments are :meth:`run`'s (``R`` and ``step`` are read, not written), and ``reduce``, applied to this
        plan's ``H P Hᵀ`` before ``R`` and ``S`` are formed: under a sharded update
        (:mod:`loko_lightning.kalman.sharded`) the all-reduce that sums every process's shard of the sum.

        Returns:
            ``posterior`` (``p̂_k`` after the time update and the floor, this plan's work vector), ``finite`` (whether
            the innovation and ``S`` are finite), ``R`` (``R_k``), ``cond`` and ``innovation`` (``e``, as
            :meth:`propose_information` gives it).
        """
        dtype = self.dtype
        # 1. Predict: θ̃_{k|k-1} = θ̃_{k-1}, p̂_{k|k-1} = p̂_{k-1} + q.
        prior = cov if self.q is None else cov + self.q
        # 2-3. Innovation e = y - ŷ and H P Hᵀ with P = diag(p̂_{k|k-1}).
        prediction = prediction.to(dtype)
        innovation = target.to(dtype) - prediction
        hpht = self.hpht(jacobians, prior)
        if reduce is not None:
            hpht = reduce(hpht)
        # 4. Observation noise R_k (B samples: one EMA step with the mean of their estimates, block-diagonal in S).
        R_k, noise = observation_noise(
            r_estimator, R, innovation, hpht, prediction, step + 1, beta, self.samples, aggregation
        )
        S = hpht + noise
        # 5. S = H P Hᵀ + R_k and S⁺ = W Wᵀ by eigendecomposition with a relative cut-off (S is singular with
        # softmax outputs). eigh must never see NaN/Inf (LAPACK fails): a step to be skipped decomposes I instead.
        finite = torch.isfinite(innovation).all() & torch.isfinite(S).all()
        factor, cond = _pinv_factor(torch.where(finite, S, self._eye), torch.where(finite, innovation, 0.0), rcond)
        # 5. The gain K = P Hᵀ S⁺ is never formed: K e = p̂ ⊙ Hᵀ S⁺ e and (K H)_ii = p̂_i (Hᵀ S⁺ H)_ii, per kind.
        update, quad = self._update, self._quad
        for kind in self.kinds:
            kind.gain_and_quad(factor, update, quad)
        update.mul_(prior)
        # 6. p̂_k,i = p̂_i - (K H)_ii p̂_i; (K H)_ii lies in [0, 1] in exact arithmetic, the floor keeps p̂ > 0.
        posterior = torch.addcmul(self._one, prior, quad, value=-1.0, out=quad)
        posterior.clamp_min_(torch.finfo(dtype).eps).mul_(prior)
        self._time_update(posterior)
        return {"posterior": posterior, "finite": finite, "R": R_k, "cond": cond, "innovation": innovation}

    @property
    def update(self) -> Tensor:
        """The work vector holding ``K e`` (this plan's order) after :meth:`propose`, the applied update after a run."""
        return self._update

    @property
    def time_updates_covariance(self) -> bool:
        """Whether the time update changes ``p̂`` (inflation or forgetting), not only the mean (shrinkage)."""
        return self.scale is not None or self.forget_keep is not None

    def _time_update(self, posterior: Tensor) -> Tensor:
        """``p̂`` of the next step's prior, in place: ``scale ⊙ p̂`` (inflation), forgetting, then the floor."""
        if self.scale is not None:
            posterior.mul_(self.scale)
        if self.forget_keep is not None:  # p̂ / ((1 − γ) + (γ/ref) p̂): the precision's mixture with the reference
            posterior.div_(torch.addcmul(self.forget_keep, posterior, self.forget_rate))
        return self._floor(posterior)

    def _low_rank_time_update(self, kept: Tensor) -> Tensor:
        """``W`` of the next step's prior: ``Λ`` scaled by ``(1 − γ)/(1 + α)`` scales ``W`` by its square root."""
        if self.scale is not None:
            kept = kept / self.scale.sqrt().reshape(-1, 1)  # one factor or one per row
        if self.forget_keep is not None:
            kept = kept * self.forget_keep.sqrt().reshape(-1, 1)
        return kept

    def _floor(self, posterior: Tensor) -> Tensor:
        """The floor on ``p̂`` (not the paper), in place: steps stay above a minimum however long the stream."""
        if isinstance(self.floor, Tensor):
            torch.maximum(posterior, self.floor, out=posterior)
        elif self.floor is not None:
            posterior.clamp_min_(self.floor)
        return posterior

    def _apply(self, params: Sequence[Tensor], cov: Tensor, posterior: Tensor, finite: Tensor) -> Tensor:
        """Write the new ``p̂`` into ``cov`` and add the update to ``params``, unless anything is non-finite.

        Returns whether the step was applied (a NaN or Inf anywhere makes a sum non-finite; so does an overflowing
        sum, skipped too).
        """
        update = self._update
        applied = finite & torch.isfinite(update.sum() + posterior.sum())
        torch.where(applied, update, self._zero, out=update)
        torch.where(applied, posterior, cov, out=cov)
        if self.keep is not None:  # θ̃ ← (1 − λ)(θ̃ + K e): the shrinkage time update, on applied steps only
            keep = torch.where(applied, self.keep, self._one)
            update.mul_(keep)
            factors = self.views(keep) if keep.dim() else [keep] * len(params)
            for param, factor in zip(params, factors, strict=True):
                param.mul_(factor.to(param.dtype))
        if all(p.dtype == self.dtype for p in params):
            torch._foreach_add_(list(params), self._update_views)
        else:
            for param, d in zip(params, self._update_views, strict=True):
                param.add_(d.to(param.dtype))
        return applied

    def rows_matrix(self, jacobians: Sequence[JacobianBlock]) -> Tensor:
        """``H`` as one ``(rows, n)`` matrix in this plan's order (factored blocks multiplied out)."""
        parts = [self.dense.matrix(jacobians).to(self.dtype)] if self.dense else []
        for kind in (self.outer, self.factored):
            parts += [jacobians[i].to_dense().reshape(self.m, -1).to(self.dtype) for i in kind.order]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def run_information(
        self,
        params: Sequence[Tensor],
        jacobians: Sequence[JacobianBlock],
        cov: Tensor,
        prediction: Tensor,
        target: Tensor,
        step: Tensor,
        *,
        statistics: bool = True,
    ) -> dict[str, Tensor]:
        r"""One update of the diagonal filter in information form, ``p̂`` the flat vector ``cov``, updated in place.

        The rows of each sample's block of ``H`` are those of a
        :class:`~loko_lightning.observation.NaturalGradient` observation: row 0 is the direction
        :math:`d_b = H_b^\top R_b^{+} e_b` (:math:`= J_z^\top e_b`), the other rows (row 0 itself when there is one
        row) are factors :math:`f_{b,r}` of the information :math:`\operatorname{diag}(H_b^\top R_b^{+} H_b) \approx
        \sum_r f_{b,r}^{\odot 2}`. With ``B`` samples:

        .. math::

            \hat p_k = \Big(\frac{1}{\hat p_{k-1} + q} + \sum_{b,r} f_{b,r}^{\odot 2}\Big)^{-1}, \qquad
            \tilde\theta_k = \tilde\theta_{k-1} + \hat p_k \odot \sum_b d_b

        (computed as :math:`\hat p_{k|k-1} / (1 + \hat p_{k|k-1} \odot \sum f^2)`, which never divides by 0).
        ``R`` is not a filter state here (the categorical noise is known), so there is none to update. The diagnostics
        are those of :meth:`run`; ``cond`` has no meaning without ``S`` and is NaN.
        """
        proposal = self.propose_information(jacobians, cov, prediction, target)
        return self._finish_information(params, cov, proposal["posterior"], proposal["finite"], proposal["innovation"],
                                        step, statistics)  # fmt: skip

    def propose_information(
        self, jacobians: Sequence[JacobianBlock], cov: Tensor, prediction: Tensor, target: Tensor
    ) -> dict[str, Tensor]:
        """:meth:`run_information` without writing any state: the update (in :attr:`update`) and ``p̂_k``.

        Every entry depends on its own column of ``H`` only, so a shard of the parameters needs only its columns.

        Returns:
            ``posterior`` (``p̂_k``, this plan's work vector), ``finite`` (whether the innovation is finite) and
            ``innovation``.
        """
        dtype = self.dtype
        prior = cov if self.q is None else cov + self.q
        innovation = target.to(dtype) - prediction.to(dtype)
        rows = self.rows_matrix(jacobians).view(self.samples, self.m // self.samples, self.n)
        update, info = self._update, self._quad
        factors = rows[:, 0] if rows.shape[1] == 1 else rows[:, 1:].reshape(-1, self.n)
        _sum_rows(rows[:, 0], update)
        _sum_rows(factors, info, square=True)
        # p̂_k = p̂_{k|k-1} / (1 + p̂_{k|k-1} ⊙ info), the mean with the posterior p̂_k.
        posterior = info.mul_(prior).add_(self._one).reciprocal_().mul_(prior)
        update.mul_(self._floor(posterior))
        if self.time_updates_covariance:  # the time update of p̂ after the mean used the posterior
            self._time_update(posterior)
        return {"posterior": posterior, "finite": torch.isfinite(innovation).all(), "innovation": innovation}

    def run_low_rank(
        self,
        params: Sequence[Tensor],
        jacobians: Sequence[JacobianBlock],
        cov: Tensor,
        low_rank: Tensor,
        prediction: Tensor,
        target: Tensor,
        step: Tensor,
        *,
        statistics: bool = True,
    ) -> dict[str, Tensor]:
        r"""One update of the low-rank plus diagonal precision filter (``LowRankNatural``, LoFi).

        ``cov`` is the flat :math:`1/\upsilon` (the diagonal part's variances), ``low_rank`` the flat ``(n, L)``
        ``W`` in this plan's order; both are updated in place. Each sample's rows are :class:`NaturalGradient`'s:
        with the exact Fisher row 0 is :math:`d_b` and rows ``1 … m`` the factors :math:`f_{b,r}`; with the empirical
        one the single row :math:`d_b` is also the only factor. With :math:`\tilde W = [W, f_{b,r}]`
        (``n x (L + B m)``, or ``n x (L + B)``) and :math:`u = 1/\upsilon_{k|k-1}`:

        .. math::

            \tilde\theta_k = \tilde\theta_{k-1} + u \odot d - u \odot \tilde W (I + \tilde W^\top (u \odot
            \tilde W))^{-1} \tilde W^\top (u \odot d), \qquad d = \sum_b d_b

        then the eigendecomposition :math:`\tilde W^\top \tilde W = U \Sigma U^\top` gives :math:`\tilde W U` (the
        left singular vectors times the singular values): the ``L`` leading columns are the new ``W``, the squares of
        the others are added to :math:`\upsilon`. The time update, the floor and the skip of a non-finite step are
        :meth:`run`'s (inflation and forgetting also scale ``W``, by :math:`\sqrt{(1 - \gamma)/(1 + \alpha)}`).
        """
        dtype = self.dtype
        prior = cov if self.q is None else cov + self.q
        innovation = target.to(dtype) - prediction.to(dtype)
        rows = self.rows_matrix(jacobians).view(self.samples, self.m // self.samples, self.n)
        update = self._update
        direction = rows[:, 0].sum(0)
        rank = low_rank.shape[1]
        factors = rows[:, :1] if rows.shape[1] == 1 else rows[:, 1:]  # the empirical Fisher: d_b is the factor
        wide = torch.cat([low_rank, factors.reshape(-1, self.n).T], dim=1)  # n x (L + B m), or n x (L + B)
        finite = torch.isfinite(innovation).all() & torch.isfinite(wide.sum())
        wide = torch.where(finite, wide, 0.0)
        scaled = prior[:, None] * wide
        inner = torch.eye(wide.shape[1], dtype=dtype, device=self.device) + wide.T @ scaled
        v = prior * direction
        torch.sub(v, scaled @ torch.linalg.solve(inner, wide.T @ v), out=update)
        gram = wide.T @ wide
        _, vectors = torch.linalg.eigh(
            torch.where(finite, gram, torch.eye(gram.shape[0], dtype=dtype, device=self.device))
        )
        rotated = wide @ vectors  # ascending: the last L columns are the leading directions
        dropped = rotated[:, : rotated.shape[1] - rank].square().sum(1)
        posterior = self._quad
        torch.reciprocal(prior, out=posterior).add_(dropped).reciprocal_()
        kept = rotated[:, rotated.shape[1] - rank :]
        self._time_update(posterior)
        kept = self._low_rank_time_update(kept)
        diagnostics = self._finish_information(params, cov, posterior, finite, innovation, step, statistics)
        torch.where(diagnostics["applied"], kept, low_rank, out=low_rank)
        return diagnostics

    def _finish_information(
        self,
        params: Sequence[Tensor],
        cov: Tensor,
        posterior: Tensor,
        finite: Tensor,
        innovation: Tensor,
        step: Tensor,
        statistics: bool,
    ) -> dict[str, Tensor]:
        """Apply an information-form step (:meth:`run_information`, :meth:`run_low_rank`) and its diagnostics.

        ``cond`` has no meaning without ``S`` and is NaN.
        """
        applied = self._apply(params, cov, posterior, finite)
        step.add_(applied.to(step.dtype))
        nan = torch.full((), math.nan, dtype=self.dtype, device=self.device)
        diagnostics = {"applied": applied, "innovation_norm": torch.linalg.vector_norm(innovation), "cond": nan}
        return {**diagnostics, **self.statistics(cov)} if statistics else diagnostics

    def statistics(self, cov: Tensor) -> dict[str, Tensor]:
        """``p_mean``, ``p_min``, ``p_max`` of the flat ``p̂`` ``cov`` and ``gain_norm`` of the last :meth:`run`."""
        p_min, p_max = torch.aminmax(cov)
        return {
            "p_mean": cov.sum() / cov.numel(),
            "p_min": p_min,
            "p_max": p_max,
            "gain_norm": torch.linalg.vector_norm(self._update),
        }


@torch.inference_mode()
def loko_update(
    params: Sequence[Tensor],
    jacobians: Sequence[JacobianBlock],
    covs: Sequence[Tensor],
    prediction: Tensor,
    target: Tensor,
    R: Tensor,
    step: Tensor,
    *,
    beta: float,
    r_estimator: REstimator,
    process_noise: Sequence[float] | float = 0.0,
    rcond: float | None = None,
    plan: UpdatePlan | None = None,
    cov_flat: Tensor | None = None,
    statistics: bool = True,
    samples: int = 1,
    p_floor: Sequence[float] | float = 0.0,
    form: str = "covariance",
    aggregation: tuple[Tensor, Tensor] | None = None,
    shrinkage: Sequence[float] | float = 0.0,
    inflation: Sequence[float] | float = 0.0,
    low_rank: Sequence[Tensor] | None = None,
    forgetting: Sequence[float] | float = 0.0,
    reference: Sequence[float] | float | None = None,
    low_rank_flat: Tensor | None = None,
) -> dict[str, Tensor]:
    r"""One LoKO step (Algorithm 1 with a diagonal covariance), in place and without host syncs.

    .. math::

        \hat p_{k|k-1} &= \hat p_{k-1} + q, \quad e_k = y_k - \hat y_k \\
        R_k &= \beta R_{k-1} + (1-\beta)\hat R_k \\
        S_k &= H_k (\hat p_{k|k-1} \bullet H_k^\top) + R_k \\
        K_k &= (\hat p_{k|k-1} \bullet H_k^\top) S_k^{+} \\
        \tilde\theta_k &= \tilde\theta_{k|k-1} + K_k e_k \\
        (\hat p_k)_i &= (\hat p_{k|k-1})_i - (K_k)_{ij} (H_k)_{ji} (\hat p_{k|k-1})_i

    :func:`loko_lightning.kalman.reference.loko_step_reference` is the same step with dense matrices. The arithmetic
    runs
    in the dtype of ``covs``; parameters are updated in their own dtype. If anything is non-finite (prediction,
    target, a Jacobian, the innovation or the resulting update), nothing is written: parameters, ``covs``, ``R``
    and ``step`` keep their values and ``diagnostics["applied"]`` is ``False``. The decision is made on the device
    with :func:`torch.where`, so no host sync is needed. (The update and the new ``p̂`` are tested through their
    sums, which are non-finite if any entry is; a sum that overflows float range also skips the step.)

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
        R: the observation noise ``R_{k-1}``, ``m x m``, updated in place to ``R_k``.
        step: number of updates applied so far (0-d integer tensor), incremented in place.
        beta: EMA forgetting factor.
        r_estimator: a name in :data:`~loko_lightning.kalman.noise.R_ESTIMATORS`.
        process_noise: ``q`` added to every ``p̂`` in the predict step, one value or one per parameter.
        rcond: relative eigenvalue cut-off of the ``S`` pseudo-inverse (see :func:`psd_pinv`).
        plan: an :class:`UpdatePlan` built for this layout of ``jacobians`` and these parameters (and
            ``process_noise``), to reuse across steps; default: built here.
        cov_flat: ``p̂`` as one flat vector in ``plan``'s order of which ``covs`` are views
            (:meth:`UpdatePlan.views`); then it is updated in place and nothing is copied. Needs ``plan``.
        statistics: also return ``p_mean``, ``p_min``, ``p_max`` and ``gain_norm`` (three passes over ``p̂``); without
            them :meth:`UpdatePlan.statistics` gives them later, until the plan's next update.
        samples: ``B`` when ``prediction``, ``target`` and the blocks stack ``B`` samples' observations
            (:func:`loko_lightning.kalman.multistream.stack_observations`): one joint update with a block-diagonal ``R``
            (``m x m``, the EMA of one sample's noise, see
            the rule of :func:`~loko_lightning.kalman.noise.observation_noise`).
            Ignored when ``plan`` is given (the plan's own).
        p_floor: a floor on ``p̂`` (not the paper; 0: none): after the update, :math:`\hat p_k \leftarrow
            \max(\hat p_k, \text{p\_floor})`, one value or one per parameter. Ignored when ``plan`` is given.
        form: ``"covariance"``: the above; ``"information"``: the diagonal information-form update of a
            :class:`~loko_lightning.observation.NaturalGradient` observation (:meth:`UpdatePlan.run_information`;
            ``R``, ``beta``, ``r_estimator`` and ``rcond`` are then unused); ``"low_rank"``: that update with a
            low-rank plus diagonal precision (:class:`~loko_lightning.observation.LowRankNatural`,
            :meth:`UpdatePlan.run_low_rank`; needs ``low_rank``).
        shrinkage: ``λ`` of the shrinkage process model (not the paper; 0: none), see :class:`UpdatePlan`; one value
            or one per parameter. Ignored when ``plan`` is given.
        inflation: ``α`` of the covariance inflation (not the paper; 0: none), see :class:`UpdatePlan`. Ignored when
            ``plan`` is given.
        low_rank: ``form="low_rank"``: the low-rank factor ``W`` of the precision, one ``(numel, L)`` block per
            parameter, updated in place (:meth:`UpdatePlan.run_low_rank`).
        forgetting: ``γ`` of stabilised forgetting (not the paper; 0: none), see :class:`UpdatePlan`; one value or
            one per parameter. Ignored when ``plan`` is given.
        reference: the reference variance of ``forgetting``, one value or one per parameter (needed with it).
        low_rank_flat: ``W`` as one ``(n, L)`` tensor in ``plan``'s order of which the ``low_rank`` blocks are views
            (as ``cov_flat`` for ``p̂``): then it is updated in place and nothing is gathered or copied. Needs ``plan``.
        aggregation: ``(A, G)`` for an observation of an aggregation of the outputs
            (:class:`~loko_lightning.observation.TopK`): ``prediction`` and ``target`` are then the observed
            coordinates and ``R`` the ``m x m`` noise of the outputs
            (:func:`~loko_lightning.kalman.noise.observation_noise`).

    Returns:
        Diagnostics as 0-d tensors: ``applied``, ``innovation_norm``, ``cond`` (of ``S``'s kept spectrum) and, with
        ``statistics``, ``p_mean``, ``p_min``, ``p_max`` and ``gain_norm`` (``‖K e‖``).
    """
    if plan is None:
        if cov_flat is not None:
            raise ValueError("Invalid cov_flat: it is laid out by a plan, so pass the plan as well")
        if isinstance(process_noise, (int, float)):
            process_noise = [float(process_noise)] * len(params)
        if isinstance(p_floor, (int, float)):
            p_floor = [float(p_floor)] * len(params)
        if isinstance(shrinkage, (int, float)):
            shrinkage = [float(shrinkage)] * len(params)
        if isinstance(inflation, (int, float)):
            inflation = [float(inflation)] * len(params)
        if isinstance(forgetting, (int, float)):
            forgetting = [float(forgetting)] * len(params)
        if isinstance(reference, (int, float)):
            reference = [float(reference)] * len(params)
        shapes = [p.shape for p in params]
        plan = UpdatePlan(
            jacobians, shapes, process_noise, covs[0].dtype, covs[0].device, samples=samples, p_floor=p_floor,
            shrinkage=shrinkage, inflation=inflation, forgetting=forgetting, reference=reference,
        )  # fmt: skip
    if form not in ("covariance", "information", "low_rank"):
        raise ValueError(f"Invalid form: {form!r} (expected 'covariance', 'information' or 'low_rank')")
    if form == "low_rank" and not low_rank and low_rank_flat is None:
        raise ValueError("Invalid low_rank: form 'low_rank' needs the factor W, one (numel, L) block per parameter")
    if low_rank_flat is not None and cov_flat is None:
        raise ValueError("Invalid low_rank_flat: it is laid out by a plan, so pass the plan and cov_flat as well")

    def run(flat: Tensor) -> dict[str, Tensor]:
        if form == "low_rank" and low_rank_flat is not None:
            return plan.run_low_rank(params, jacobians, flat, low_rank_flat, prediction, target, step,
                                     statistics=statistics)  # fmt: skip
        if form == "low_rank":
            W = torch.cat([low_rank[i].to(plan.dtype) for i in plan.order])
            diagnostics = plan.run_low_rank(
                params, jacobians, flat, W, prediction, target, step, statistics=statistics
            )  # fmt: skip
            offsets = [plan.offsets[i] for i in range(len(params))]
            for block, start in zip(low_rank, offsets, strict=True):
                block.copy_(W[start : start + block.shape[0]])
            return diagnostics
        if form == "information":
            return plan.run_information(params, jacobians, flat, prediction, target, step, statistics=statistics)
        kwargs = dict(beta=beta, r_estimator=r_estimator, rcond=rcond, statistics=statistics, aggregation=aggregation)
        return plan.run(params, jacobians, flat, prediction, target, R, step, **kwargs)

    if cov_flat is not None:
        return run(cov_flat)
    flat = plan.flatten(covs)
    diagnostics = run(flat)
    torch._foreach_copy_(list(covs), plan.views(flat))
    return diagnostics
