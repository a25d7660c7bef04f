"""The LoKO Kalman update on plain tensors.

Everything here is stateless: the optimizer (:mod:`loko_lightning.optim`) owns the state and calls
:func:`loko_update`. Notation follows the paper: ``H`` is the ``m x ñ`` Jacobian of the prediction ``ŷ``
with respect to the trainable parameters ``θ̃``, ``p`` the diagonal of the covariance ``P``, ``e = y - ŷ``
the innovation, ``R`` the ``m x m`` observation noise, ``S = H P Hᵀ + R`` and ``K = P Hᵀ S⁻¹``.

The Jacobian of one parameter is either a dense tensor of shape ``(m, *param.shape)`` or an
:class:`OuterJacobian`, the exact factored form of a Linear layer's weight Jacobian for a single input
vector. Both are consumed block by block, so the full ``m x ñ`` matrix is never concatenated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

REstimator = Literal["taylor", "residual", "identity", "decay", "softmax"]
R_ESTIMATORS: tuple[str, ...] = ("taylor", "residual", "identity", "decay", "softmax")


@dataclass(frozen=True)
class OuterJacobian:
    """Jacobian of ``m`` outputs w.r.t. a weight ``W`` (``out x in``) of a Linear layer seen by one input.

    For ``z = W f + b`` with a single input vector ``f``, ``∂ŷ_a/∂W_jk = left[a, j] * right[k]`` where
    ``left = ∂ŷ/∂z`` (``m x out``) and ``right = f`` (``in``). Storing the two factors costs
    ``m·out + in`` numbers instead of ``m·out·in``, and every Kalman product on this block has a closed form.

    Args:
        left: ``∂ŷ/∂z``, shape ``(m, out)``.
        right: the layer's input ``f``, shape ``(in,)``.
    """

    left: Tensor
    right: Tensor

    @property
    def shape(self) -> torch.Size:
        """Shape of the dense Jacobian this object stands for, ``(m, out, in)``."""
        return torch.Size((*self.left.shape, *self.right.shape))

    def to_dense(self) -> Tensor:
        """Materialise the dense ``(m, out, in)`` Jacobian (for tests and debugging)."""
        return self.left[:, :, None] * self.right[None, None, :]

    def to(self, dtype: torch.dtype) -> OuterJacobian:
        """Return a copy with both factors cast to ``dtype``."""
        return OuterJacobian(self.left.to(dtype), self.right.to(dtype))


JacobianBlock = Tensor | OuterJacobian


def innovation_covariance(jacobians: Sequence[JacobianBlock], covs: Sequence[Tensor]) -> Tensor:
    """``H P Hᵀ`` summed over parameter blocks (``P`` diagonal, one ``cov`` per parameter).

    Args:
        jacobians: per-parameter Jacobians, dense ``(m, *shape)`` or :class:`OuterJacobian`.
        covs: per-parameter diagonal covariances ``p̂``, each of the parameter's shape.

    Returns:
        The ``m x m`` matrix ``H P Hᵀ``.
    """
    total = None
    for jac, cov in zip(jacobians, covs, strict=True):
        if isinstance(jac, OuterJacobian):
            # Σ_jk L_aj f_k² p_jk L_bj = L diag(p f²) Lᵀ
            weight = cov @ jac.right.square()
            term = (jac.left * weight) @ jac.left.T
        else:
            flat = jac.reshape(jac.shape[0], -1)
            term = (flat * cov.reshape(-1)) @ flat.T
        total = term if total is None else total + term
    if total is None:
        raise ValueError("Invalid jacobians: expected at least one parameter block, got none")
    return total


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
        matrix: symmetric ``m x m`` matrix (symmetrised here against rounding).
        rcond: relative eigenvalue cut-off; default ``m · eps(dtype) · 10``.

    Returns:
        ``(pinv, cond)``: the pseudo-inverse and the condition number of the kept spectrum
        (``λ_max / smallest kept λ``).
    """
    m = matrix.shape[-1]
    if rcond is None:
        rcond = 10.0 * m * torch.finfo(matrix.dtype).eps
    sym = 0.5 * (matrix + matrix.T)
    eigvals, eigvecs = torch.linalg.eigh(sym)
    top = eigvals[-1].clamp_min(torch.finfo(matrix.dtype).tiny)
    keep = eigvals > rcond * top
    inv_vals = torch.where(keep, 1.0 / torch.where(keep, eigvals, top), torch.zeros_like(eigvals))
    pinv = (eigvecs * inv_vals) @ eigvecs.T
    smallest = torch.where(keep, eigvals, torch.full_like(eigvals, math.inf)).min()
    return pinv, top / smallest


@torch.no_grad()
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
    is ``False``. The decision is made on the device with :func:`torch.where`, so no host sync is needed.

    Args:
        params: trainable parameters ``θ̃``, updated in place.
        jacobians: per-parameter Jacobians of ``ŷ`` (dense ``(m, *shape)`` or :class:`OuterJacobian`).
        covs: per-parameter ``p̂``, updated in place; their dtype is the arithmetic dtype.
        prediction: ``ŷ``, shape ``(m,)``.
        target: ``y``, shape ``(m,)``.
        noise: ``R_{k-1}``, ``m x m``, updated in place to ``R_k``.
        step: number of updates applied so far (0-d integer tensor), incremented in place.
        beta: EMA forgetting factor.
        r_estimator: see :func:`observation_noise`.
        process_noise: ``q`` added to every ``p̂`` in the predict step, one value or one per parameter.
        rcond: relative eigenvalue cut-off of the ``S`` pseudo-inverse (see :func:`psd_pinv`).

    Returns:
        Diagnostics as 0-d tensors: ``applied``, ``innovation_norm``, ``p_mean``, ``p_min``, ``p_max``,
        ``cond`` (of ``S``'s kept spectrum), ``gain_norm`` (``‖K e‖``).
    """
    dtype = covs[0].dtype
    if isinstance(process_noise, (int, float)):
        process_noise = [float(process_noise)] * len(params)
    jacs = [j.to(dtype) for j in jacobians]
    prediction = prediction.to(dtype)
    innovation = target.to(dtype) - prediction
    prior = [cov + q if q else cov for cov, q in zip(covs, process_noise, strict=True)]

    hpht = innovation_covariance(jacs, prior)
    new_noise = observation_noise(r_estimator, noise, innovation, hpht, prediction, step + 1, beta)
    s_matrix = hpht + new_noise
    finite = torch.isfinite(innovation).all() & torch.isfinite(s_matrix).all()
    # eigh must never see NaN/Inf (LAPACK fails); a skipped step decomposes the identity instead.
    s_matrix = torch.where(finite, s_matrix, torch.eye(s_matrix.shape[0], dtype=dtype, device=s_matrix.device))
    s_pinv, cond = psd_pinv(s_matrix, rcond)
    weights = s_pinv @ torch.where(finite, innovation, torch.zeros_like(innovation))

    deltas, posteriors = [], []
    for jac, cov in zip(jacs, prior, strict=True):
        if isinstance(jac, OuterJacobian):
            delta = cov * torch.outer(jac.left.T @ weights, jac.right)
            # diag(Hᵀ S⁺ H) for an outer-product block: diag(Lᵀ S⁺ L)_j f_k²
            quad = torch.outer(((s_pinv @ jac.left) * jac.left).sum(0), jac.right.square())
        else:
            flat = jac.reshape(jac.shape[0], -1)
            delta = (cov.reshape(-1) * (flat.T @ weights)).view_as(cov)
            quad = ((s_pinv @ flat) * flat).sum(0).view_as(cov)
        # (K H)_ii = p_i (Hᵀ S⁺ H)_ii lies in [0, 1] in exact arithmetic; the floor keeps p̂ > 0 under rounding.
        shrink = (1.0 - cov * quad).clamp_min(torch.finfo(dtype).eps)
        deltas.append(delta)
        posteriors.append(cov * shrink)

    applied = finite
    for delta, post in zip(deltas, posteriors, strict=True):
        applied = applied & torch.isfinite(delta).all() & torch.isfinite(post).all()
    for param, cov, delta, post in zip(params, covs, deltas, posteriors, strict=True):
        param.add_(torch.where(applied, delta, torch.zeros_like(delta)).to(param.dtype))
        cov.copy_(torch.where(applied, post, cov))
    noise.copy_(torch.where(applied, new_noise, noise))
    step.add_(applied.to(step.dtype))

    p_min = torch.stack([c.min() for c in covs]).min()
    p_max = torch.stack([c.max() for c in covs]).max()
    p_mean = sum(c.sum() for c in covs) / sum(c.numel() for c in covs)
    gain_sq = sum(torch.where(applied, d, torch.zeros_like(d)).square().sum() for d in deltas)
    return {
        "applied": applied,
        "innovation_norm": torch.linalg.vector_norm(innovation),
        "p_mean": p_mean,
        "p_min": p_min,
        "p_max": p_max,
        "cond": cond,
        "gain_norm": gain_sq.sqrt(),
    }
