"""A slow, obviously correct LoKO step: Algorithm 1 with dense matrices in float64, in the paper's names.

:func:`loko_step_reference` is the specification that the fast update (:func:`loko_lightning.kalman.update.loko_update`)
is tested against. It takes the whole Jacobian ``H`` as one dense ``m x ñ`` matrix and the parameters ``θ̃`` and the
diagonal covariance ``p̂`` as flat vectors, forms ``P Hᵀ``, ``S`` and the gain ``K`` explicitly, line by line as
the paper writes them, and returns the new state; nothing is done in place and no arithmetic is shared with the
fast path. Memory is ``O(m ñ)`` (``H``, ``P Hᵀ`` and ``K``), time ``O(m² ñ + m³)``.

Two things the fast path does on top are not part of the algorithm and are left out here: it keeps ``p̂`` above
``eps · p̂_{k|k-1}`` against rounding, and it skips a step (changing nothing) when anything is non-finite.

Example:
    >>> import torch
    >>> from loko_lightning.kalman.reference import loko_step_reference
    >>> m, n = 3, 5
    >>> H = torch.randn(m, n, dtype=torch.float64)
    >>> theta, p, R = torch.zeros(n), torch.full((n,), 0.2), torch.zeros(m, m)
    >>> prediction, target = torch.softmax(torch.randn(m), 0), torch.tensor([0.0, 1.0, 0.0])
    >>> theta, p, R = loko_step_reference(theta, p, R, H, prediction, target, 1, beta=0.95, r_estimator="taylor")
    >>> bool((p > 0).all() and (p <= 0.2).all())
    True
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from loko_lightning.kalman.update import R_ESTIMATORS, REstimator

__all__ = ["loko_step_reference", "loko_step_reference_batch", "pinv_reference"]


def pinv_reference(S: Tensor, rcond: float | None = None) -> Tensor:
    """Pseudo-inverse of a symmetric positive semi-definite ``S``: eigenvalues ``λ <= rcond · λ_max`` count as 0.

    Args:
        S: symmetric ``m x m`` matrix.
        rcond: relative cut-off; default ``10 · m · eps(float64)``, the fast path's default in float64.

    Returns:
        ``S⁺ = V diag(1/λ for the kept λ, else 0) Vᵀ``, float64.
    """
    S = S.double()
    m = S.shape[0]
    if rcond is None:
        rcond = 10.0 * m * torch.finfo(torch.float64).eps
    lam, V = torch.linalg.eigh(S)
    keep = lam > rcond * lam.max()
    inv_lam = torch.zeros_like(lam)
    inv_lam[keep] = 1.0 / lam[keep]
    return V @ torch.diag(inv_lam) @ V.T


def loko_step_reference(
    theta: Tensor,
    p: Tensor,
    R: Tensor,
    H: Tensor,
    prediction: Tensor,
    target: Tensor,
    k: int,
    *,
    beta: float,
    r_estimator: REstimator,
    process_noise: float | Tensor = 0.0,
    rcond: float | None = None,
    p_floor: float | Tensor = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """One LoKO step (Algorithm 1), dense and in float64.

    Args:
        theta: ``θ̃_{k-1}``, the trainable parameters as one flat vector, shape ``(ñ,)``.
        p: ``p̂_{k-1}``, the diagonal of the covariance ``P``, shape ``(ñ,)``.
        R: ``R_{k-1}``, the observation noise, ``m x m`` (zeros before the first step).
        H: ``∂ŷ/∂θ̃`` at ``θ̃_{k|k-1} = θ̃_{k-1}``, shape ``(m, ñ)``.
        prediction: ``ŷ_k = h(x_k, θ̃_{k|k-1})``, shape ``(m,)``.
        target: ``y_k``, shape ``(m,)``.
        k: the 1-based index of this step (used by ``r_estimator="decay"``).
        beta: forgetting factor of the ``R`` EMA.
        r_estimator: ``"taylor"`` (paper method 2), ``"residual"`` (method 1), ``"identity"``, ``"decay"`` or
            ``"softmax"`` (see :class:`loko_lightning.LoKO`).
        process_noise: ``q`` added to ``p̂`` in the predict step, one value or one per entry of ``θ̃``.
        rcond: relative eigenvalue cut-off of the pseudo-inverse of ``S`` (see :func:`pinv_reference`).
        p_floor: a floor on ``p̂_k`` (not the paper), one value or one per entry of ``θ̃``.

    Returns:
        ``(θ̃_k, p̂_k, R_k)``, float64.
    """
    theta, p, R, H = theta.double(), p.double(), R.double(), H.double()
    y_hat, y = prediction.double(), target.double()
    m = y.shape[0]
    q = process_noise.double() if isinstance(process_noise, Tensor) else process_noise

    # 1. Predict: the process model is the identity, with process noise q.
    p = p + q
    # 3. Innovation, P Hᵀ = p̂ ⊙ Hᵀ (row i of Hᵀ scaled by p̂_i) and H P Hᵀ.
    e = y - y_hat
    PHt = p[:, None] * H.T
    HPHt = H @ PHt
    # 4. Observation noise.
    if r_estimator == "taylor":
        R = beta * R + (1 - beta) * (torch.outer(e, e) + HPHt)
    elif r_estimator == "residual":
        R = beta * R + (1 - beta) * torch.outer(e, e)
    elif r_estimator == "identity":
        R = torch.eye(m, dtype=torch.float64)
    elif r_estimator == "decay":
        R = torch.eye(m, dtype=torch.float64) * math.exp(-k / 50)
    elif r_estimator == "softmax":
        R = torch.diag(y_hat) - torch.outer(y_hat, y_hat)
    else:
        raise ValueError(f"Invalid r_estimator: {r_estimator!r} (expected one of {R_ESTIMATORS})")
    # 5. Gain.
    S = HPHt + R
    K = PHt @ pinv_reference(S, rcond)
    # 6. Update: θ̃_k = θ̃_{k|k-1} + K e and p̂_k,i = p̂_i - (Σ_j K_ij H_ji) p̂_i, the diagonal of P - K H P.
    theta = theta + K @ e
    p = p - (K * H.T).sum(1) * p
    return theta, _floored(p, p_floor), R


def loko_step_reference_batch(
    theta: Tensor,
    p: Tensor,
    R: Tensor,
    H: Tensor,
    prediction: Tensor,
    target: Tensor,
    k: int,
    *,
    beta: float,
    r_estimator: REstimator,
    process_noise: float | Tensor = 0.0,
    rcond: float | None = None,
    p_floor: float | Tensor = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """One joint LoKO step on ``B`` samples (the multistream EKF), dense and in float64.

    The ``B`` observations are one of ``B·m`` outputs: ``H`` stacked (``B·m x ñ``), ``e`` stacked, ``R``
    block-diagonal (``R_k`` on every block; ``"softmax"``: each sample's own ``diag(ŷ_b) - ŷ_b ŷ_bᵀ``),
    ``S`` (``B·m x B·m``) and one gain. The EMA estimators take one step with the mean of the per-sample estimates
    ``R̂_b = e_b e_bᵀ (+ H_b P H_bᵀ)``; the returned ``R`` is that EMA (``"softmax"``: the mean of the blocks).

    Args:
        theta: ``θ̃_{k-1}``, shape ``(ñ,)``.
        p: ``p̂_{k-1}``, shape ``(ñ,)``.
        R: ``R_{k-1}``, ``m x m``.
        H: the ``B`` Jacobians at ``θ̃_{k-1}``, shape ``(B, m, ñ)``.
        prediction: ``ŷ`` of each sample, shape ``(B, m)``.
        target: ``y`` of each sample, shape ``(B, m)``.
        k: the 1-based index of this joint update (used by ``r_estimator="decay"``).
        beta: forgetting factor of the ``R`` EMA.
        r_estimator: as in :func:`loko_step_reference`.
        process_noise: ``q`` added to ``p̂`` in the predict step.
        rcond: relative eigenvalue cut-off of the pseudo-inverse of ``S``.
        p_floor: a floor on ``p̂_k``.

    Returns:
        ``(θ̃_k, p̂_k, R_k)``, float64.
    """
    theta, p, R, H = theta.double(), p.double(), R.double(), H.double()
    y_hat, y = prediction.double(), target.double()
    B, m = y.shape
    q = process_noise.double() if isinstance(process_noise, Tensor) else process_noise

    p = p + q
    Hs = H.reshape(B * m, -1)  # sample b's rows are b·m ... b·m + m - 1
    e = (y - y_hat).reshape(B * m)
    PHt = p[:, None] * Hs.T
    HPHt = Hs @ PHt
    eye = torch.eye(m, dtype=torch.float64)
    if r_estimator in ("taylor", "residual"):
        estimates = []
        for b in range(B):
            rows = slice(b * m, (b + 1) * m)
            estimate = torch.outer(e[rows], e[rows])
            if r_estimator == "taylor":
                estimate = estimate + HPHt[rows, rows]
            estimates.append(estimate)
        R = beta * R + (1 - beta) * sum(estimates) / B
        blocks = [R] * B
    elif r_estimator == "identity":
        R = eye
        blocks = [R] * B
    elif r_estimator == "decay":
        R = eye * math.exp(-k / 50)
        blocks = [R] * B
    elif r_estimator == "softmax":
        blocks = [torch.diag(y_hat[b]) - torch.outer(y_hat[b], y_hat[b]) for b in range(B)]
        R = sum(blocks) / B
    else:
        raise ValueError(f"Invalid r_estimator: {r_estimator!r} (expected one of {R_ESTIMATORS})")
    S = HPHt + torch.block_diag(*blocks)
    K = PHt @ pinv_reference(S, rcond)
    theta = theta + K @ e
    p = p - (K * Hs.T).sum(1) * p
    return theta, _floored(p, p_floor), R


def _floored(p: Tensor, p_floor: float | Tensor) -> Tensor:
    """``max(p̂, p_floor)`` entrywise; no floor (``0``): ``p̂`` as it is."""
    if isinstance(p_floor, Tensor):
        return torch.maximum(p, p_floor.double())
    return p.clamp_min(float(p_floor)) if p_floor else p
