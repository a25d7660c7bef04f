r"""The paper's filter: Algorithm 1, the extended Kalman filter with a diagonal covariance (covariance form).

.. math::

    \hat p_{k|k-1} &= \hat p_{k-1} + q, \quad e_k = y_k - \hat y_k \\
    R_k &= \beta R_{k-1} + (1-\beta)\hat R_k \\
    S_k &= H_k (\hat p_{k|k-1} \bullet H_k^\top) + R_k \\
    K_k &= (\hat p_{k|k-1} \bullet H_k^\top) S_k^{+} \\
    \tilde\theta_k &= \tilde\theta_{k|k-1} + K_k e_k \\
    (\hat p_k)_i &= (\hat p_{k|k-1})_i - (K_k)_{ij} (H_k)_{ji} (\hat p_{k|k-1})_i

Only an ``m x m`` system (``B·m`` for a joint step of ``B`` samples) is solved. With softmax outputs ``S`` is
singular by construction, so :math:`S^{+}` is a pseudo-inverse by eigendecomposition with a relative cut-off. Its
float64 specification is :func:`loko_lightning.kalman.reference.loko_step_reference`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from loko_lightning.errors import ConfigError
from loko_lightning.kalman.filters.base import Belief, Evidence, Filter, Proposal, Reduce
from loko_lightning.kalman.noise import R_ESTIMATORS, REstimator, noise_before, observation_noise, softmax_covariance
from loko_lightning.kalman.plan import UpdatePlan
from loko_lightning.kalman.shared_rows import Downdate
from loko_lightning.kalman.state import check_block
from loko_lightning.kalman.time_update import real_number
from loko_lightning.observation import Observation, Softmax, TopK

__all__ = ["PRIOR_SCALE_CLIP", "Covariance", "prior_scale_gradient", "psd_pinv"]


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


def prior_scale_gradient(hpht: Tensor, S: Tensor, innovation: Tensor, rcond: float | None = None) -> Tensor:
    r"""``g``, the gradient in ``log s`` at ``s = 1`` of the log density of the innovation when the prior is ``s P``.

    With ``A = H P Hᵀ`` and ``S = A + R`` the innovation ``e`` has the predictive density ``N(0, S(s))``,
    ``S(s) = s A + R``, when the prior's covariance is ``s P`` (on the range of ``S``: with softmax outputs it is
    singular, and the pseudo-inverse is the update's):

    .. math::

        g = \tfrac12 \left( e^\top S^{+} A S^{+} e - \operatorname{tr}(S^{+} A) \right),

    positive when the innovation is larger than the prior predicts.

    Args:
        hpht: ``A``, ``(B·m) x (B·m)``.
        S: ``A + R``, the update's ``S`` at ``s = 1``.
        innovation: ``e``, ``(B·m,)``.
        rcond: the pseudo-inverse's cut-off, as the update's.
    """
    factor, _ = _pinv_factor(S, innovation, rcond)
    root_t, w = factor[:-1], factor[-1]  # S⁺ = W Wᵀ with Wᵀ = root_t, w = S⁺ e
    trace = (root_t @ hpht * root_t).sum()  # tr(S⁺ A) = tr(Wᵀ A W)
    return 0.5 * (w @ hpht @ w - trace)


#: The most one sample moves the prior's log scale: ``s`` lies in ``[e^-0.5, e^0.5]``.
PRIOR_SCALE_CLIP = 0.5


@dataclass(frozen=True)
class Covariance(Filter):
    """Algorithm 1 (the module's equations): a diagonal covariance ``p̂`` and the EMA estimate of ``R``.

    Args:
        beta: the forgetting factor of the ``R`` EMA, in ``(0, 1)`` (paper: 0.95).
        r_estimator: a name in :data:`~loko_lightning.kalman.noise.R_ESTIMATORS` (paper: ``"taylor"``).
        rcond: the relative eigenvalue cut-off of the ``S`` pseudo-inverse (default ``10 · m · eps``).
        debias: the noise in ``S`` is ``R_k / (1 - β^k)``, the EMA corrected for its start at 0 (not the paper;
            :mod:`~loko_lightning.kalman.noise`); a smoothed ``r_estimator`` only.
        prior_scale_rate: ``η`` of the prior's scale set by its own predictive likelihood (not the paper; 0: off, the
            paper's update). Before each update the step's prior covariance ``P`` (``p̂`` and the shared rows' ``Σ``)
            is multiplied by ``s = exp(clip(η g, ±0.5))``, ``g`` the gradient in ``log s`` at ``s = 1`` of the log
            density of the innovation under ``N(0, s·HPHᵀ + R_{k-1})`` (:func:`prior_scale_gradient`, the noise
            before the sample): one step a sample of type-II maximum likelihood on the prior's scale, so a ``p0`` set
            too large shrinks (docs/results/prior_scale.md).
        prior_scale_until: the prior's scale is set on the first this many updates only, then kept (0: on every
            update). The rule drifts the scale up late in a long stream, where rare confident misses dominate ``g``
            (docs/results/prior_scale.md); set early, it is the prior's scale and the filter then runs as the paper's.
        softmax_noise: the noise in ``S`` (and in the prior scale's) gets ``diag(ŷ) − ŷ ŷᵀ`` on each sample's block
            too (not the paper; the softmax observation only): the covariance of a label drawn from the prediction,
            the categorical likelihood's own noise, on top of the EMA's estimate (the state's ``R_k`` stays the
            EMA). With it alone as the noise, the update is the Gauss-Newton step of the cross-entropy (the natural
            gradient's); added to the estimate, the gain shrinks on the samples the model is unsure of and keeps the
            paper's damping where it is sure (docs/filters.md).
    """

    name: ClassVar[str] = "covariance"
    estimates_noise: ClassVar[bool] = True
    shares_rows: ClassVar[bool] = True

    beta: float = 0.95
    r_estimator: REstimator = "taylor"
    rcond: float | None = None
    debias: bool = False
    prior_scale_rate: float = 0.0
    prior_scale_until: int = 0
    softmax_noise: bool = False

    def __post_init__(self) -> None:
        """Refuse a setting outside its range, naming it."""
        if not (real_number(self.beta) and 0.0 < self.beta < 1.0):
            raise ConfigError(
                f"Invalid beta: {self.beta!r} ({type(self.beta).__name__}; must be a number in (0, 1); the paper "
                "uses 0.95)",
                field="beta",
                owner=Covariance,
            )
        if self.r_estimator not in R_ESTIMATORS:
            raise ConfigError(
                f"Invalid r_estimator: {self.r_estimator!r} (expected one of {tuple(R_ESTIMATORS)})",
                field="r_estimator",
                owner=Covariance,
            )
        if self.rcond is not None and not (real_number(self.rcond) and 0.0 <= self.rcond < 1.0):
            raise ConfigError(f"Invalid rcond: {self.rcond} (must lie in [0, 1))", field="rcond", owner=Covariance)
        if not isinstance(self.debias, bool):
            raise ConfigError(
                f"Invalid debias: {self.debias!r} (must be true or false)", field="debias", owner=Covariance
            )
        if not (real_number(self.prior_scale_rate) and 0.0 <= self.prior_scale_rate <= 1.0):
            raise ConfigError(
                f"Invalid prior_scale_rate: {self.prior_scale_rate!r} (must be a number in [0, 1]; 0 keeps the "
                "paper's fixed prior, the text default uses 0.03)",
                field="prior_scale_rate",
                owner=Covariance,
            )
        until = self.prior_scale_until
        if isinstance(until, bool) or not isinstance(until, int) or until < 0:
            raise ConfigError(
                f"Invalid prior_scale_until: {until!r} (must be a number of updates >= 0; 0 sets the prior's scale on "
                "every update, the text default uses 500)",
                field="prior_scale_until",
                owner=Covariance,
            )
        if not isinstance(self.softmax_noise, bool):
            raise ConfigError(
                f"Invalid softmax_noise: {self.softmax_noise!r} (must be true or false)",
                field="softmax_noise",
                owner=Covariance,
            )
        if self.debias and not R_ESTIMATORS[self.r_estimator].smoothed:
            raise ConfigError(
                f"Invalid debias: r_estimator {self.r_estimator!r} is not an EMA, there is nothing to debias (set "
                "debias: false, or r_estimator: taylor or residual)",
                field="debias",
                owner=Covariance,
            )

    def observation_for(self, observation: Observation) -> Observation:
        """As given; with ``prior_scale_rate`` not an aggregation of the outputs (top-k: its noise is elsewhere).

        Raises:
            ConfigError: ``prior_scale_rate`` with a top-k observation (``field="prior_scale_rate"``);
                ``softmax_noise`` with another observation than the softmax's (``field="softmax_noise"``).
        """
        if self.prior_scale_rate and isinstance(observation, TopK):
            raise ConfigError(
                f"Invalid prior_scale_rate: {self.prior_scale_rate} with the top-k observation (the prior's scale is "
                "built for the softmax and logits observations; set prior_scale_rate: 0 or observation: softmax)",
                field="prior_scale_rate",
                owner=Covariance,
            )
        if self.softmax_noise and (not isinstance(observation, Softmax) or isinstance(observation, TopK)):
            raise ConfigError(
                f"Invalid softmax_noise: true with the {observation.name!r} observation (it is the covariance of a "
                "label drawn from softmax probabilities; set softmax_noise: false or observation: softmax)",
                field="softmax_noise",
                owner=Covariance,
            )
        return observation

    def propose(self, plan: UpdatePlan, evidence: Evidence, belief: Belief, reduce: Reduce | None = None) -> Proposal:
        """Steps 1-6 of Algorithm 1 without writing any state; ``reduce`` sums ``H P Hᵀ`` over the shards."""
        dtype = plan.dtype
        # 1. Predict: θ̃_{k|k-1} = θ̃_{k-1}, p̂_{k|k-1} = p̂_{k-1} + q.
        prior = plan.time.prior(belief.cov)
        # 2-3. Innovation e = y - ŷ and H P Hᵀ with P = diag(p̂_{k|k-1}).
        prediction = evidence.prediction.to(dtype)
        innovation = evidence.target.to(dtype) - prediction
        hpht = plan.hpht(evidence.blocks, prior)
        if plan.rows:  # weights whose rows share a full covariance Σ (not the paper): Σ_i L_i Rᵀ Σ R L_iᵀ
            hpht = hpht + plan.rows.hpht(evidence.blocks, belief.shared_rows)
        if reduce is not None:
            hpht = reduce(hpht)
        # 4. Observation noise R_k (B samples: one EMA step with the mean of their estimates, block-diagonal in S).
        R_k, noise = observation_noise(
            self.r_estimator, belief.R, innovation, hpht, prediction, belief.step + 1, self.beta, plan.samples,
            evidence.aggregation, self.debias,
        )  # fmt: skip
        # Not the paper: the categorical likelihood's own noise on top of the estimate (in the prior scale's S too).
        categorical = softmax_covariance(prediction, plan.samples) if self.softmax_noise else None
        if categorical is not None:
            noise = noise + categorical
        S = hpht + noise
        finite = torch.isfinite(innovation).all() & torch.isfinite(S).all()
        scale, predictive = None, hpht  # the prediction's covariance: before the scale, which reads this sample's label
        if self.prior_scale_rate:  # not the paper: P ← s P, s from the predictive likelihood of e under this prior
            scale = self._prior_scale(plan, belief, hpht, innovation, finite, categorical)
            prior, hpht = prior * scale, hpht * scale
            S = hpht + noise
            # A scale that is not finite (g = NaN where H P Hᵀ and R collapsed in float32) makes S so: skip the step.
            finite = finite & torch.isfinite(S).all()
        # 5. S = H P Hᵀ + R_k and S⁺ = W Wᵀ by eigendecomposition with a relative cut-off (S is singular with
        # softmax outputs). eigh must never see NaN/Inf (LAPACK fails): a step to be skipped decomposes I instead.
        factor, cond = _pinv_factor(torch.where(finite, S, plan.eye), torch.where(finite, innovation, 0.0), self.rcond)
        # 5. The gain K = P Hᵀ S⁺ is never formed: K e = p̂ ⊙ Hᵀ S⁺ e and (K H)_ii = p̂_i (Hᵀ S⁺ H)_ii, per kind.
        update, quad = plan.update, plan.work
        for kind in plan.kinds:
            kind.gain_and_quad(factor, update, quad)
        update.mul_(prior)
        # 6. p̂_k,i = p̂_i - (K H)_ii p̂_i; (K H)_ii lies in [0, 1] in exact arithmetic, the floor keeps p̂ > 0.
        posterior = torch.addcmul(plan.one, prior, quad, value=-1.0, out=quad)
        posterior.clamp_min_(torch.finfo(dtype).eps).mul_(prior)
        plan.time.covariance(posterior)
        # The shared-row weights: ΔW_i = Σ R L_iᵀ w and Σ⁺ (their entries of update and posterior overwritten).
        shared_rows = plan.rows.update(factor, belief.shared_rows, update, posterior, scale) if plan.rows else []
        return Proposal(
            posterior=posterior, finite=finite, innovation=innovation, R=R_k, cond=cond, shared_rows=shared_rows,
            hpht=predictive,
        )  # fmt: skip

    def _prior_scale(
        self,
        plan: UpdatePlan,
        belief: Belief,
        hpht: Tensor,
        innovation: Tensor,
        finite: Tensor,
        categorical: Tensor | None,
    ) -> Tensor:
        """``s = exp(clip(η g, ±0.5))``, ``g`` of the prequential predictive ``N(0, s A + R_{k-1})``.

        ``s = 1`` at ``k = 1`` and after ``prior_scale_until`` updates. The noise is the one before this sample
        (``R_{k-1}``, debiased as the update's, on every sample's block): the update's ``R_k`` holds this innovation's
        own ``e eᵀ``, which would explain it away and shrink the prior. ``categorical``: with ``softmax_noise`` the
        step's ``diag(ŷ) − ŷ ŷᵀ`` blocks (known before the label), in this noise too.
        """
        S = hpht + noise_before(belief.R, belief.step, self.beta, plan.samples, self.debias)
        if categorical is not None:
            S = S + categorical
        ok = finite & (belief.step > 0)  # R_{k-1} is state, finite: finite covers S
        if self.prior_scale_until:  # kept after the first prior_scale_until updates: s = exp(0) = 1
            ok = ok & (belief.step < self.prior_scale_until)
        gradient = prior_scale_gradient(torch.where(ok, hpht, 0.0), torch.where(ok, S, plan.eye),
                                        torch.where(ok, innovation, 0.0), self.rcond)  # fmt: skip
        return torch.exp(torch.clamp(self.prior_scale_rate * gradient, -PRIOR_SCALE_CLIP, PRIOR_SCALE_CLIP))

    def init_param(self, param: Tensor, cov: Tensor, group: Mapping[str, Any]) -> dict[str, Tensor]:
        """With the group's ``shared_rows``: ``Σ₀`` = the diagonal of the rows' mean ``p̂₀``.

        And ``p̂₀ = diag(Σ₀)`` on every row (``cov`` made so in place).
        """
        if not group.get("shared_rows"):
            return {}
        mean = cov.reshape(param.shape[0], -1).mean(0)
        cov.view(param.shape[0], -1).copy_(mean[None].expand(param.shape[0], -1))
        return {"row_cov": torch.diag(mean)}

    def state_keys(self) -> frozenset[str]:
        """``row_cov``: the ``Σ`` of a shared-rows parameter (``cols x cols``)."""
        return frozenset({"row_cov"})

    def check_param(self, index: int, param: Tensor, state: Mapping[str, Any]) -> None:
        """A saved ``Σ`` must be ``cols x cols`` for its parameter."""
        if "row_cov" in state:
            cols = param.numel() // param.shape[0] if param.dim() else 1
            check_block(index, "shared row covariance", state["row_cov"], (cols, cols))

    def row_cov(self, param: Tensor, state: dict[str, Any], dtype: torch.dtype) -> Tensor:
        """The ``Σ`` shared by ``param``'s rows; from ``p̂`` (the diagonal of its rows' mean) when a state holds none.

        :meth:`init_param` always makes one and a state with the other ``shared_rows`` is refused on load, so only a
        state dict written without ``row_cov`` for a shared group gets here; its ``Σ`` starts as a new one does.
        """
        if "row_cov" not in state:
            state["row_cov"] = torch.diag(state["cov"].reshape(param.shape[0], -1).mean(0).to(dtype))
        return state["row_cov"]

    def commit(self, proposal: Proposal, applied: Tensor, belief: Belief) -> None:
        """``R_k`` and the shared rows' ``Σ`` where the step was applied."""
        torch.where(applied, proposal.R, belief.R, out=belief.R)
        for new, old in zip(proposal.shared_rows, belief.shared_rows, strict=True):
            if isinstance(new, Downdate):
                new.commit(old, applied)
            else:
                torch.where(applied, new, old, out=old)
