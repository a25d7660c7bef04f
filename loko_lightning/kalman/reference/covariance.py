"""The paper's filter (Algorithm 1) written slowly and obviously: dense matrices in float64, in the paper's names.

:func:`loko_step_reference` is the specification that the covariance filter
(:class:`~loko_lightning.kalman.filters.covariance.Covariance`) is tested against. It takes the whole Jacobian ``H`` as
one dense ``m x ñ`` matrix and the parameters ``θ̃`` and the diagonal covariance ``p̂`` as flat vectors, forms
``P Hᵀ``, ``S`` and the gain ``K`` explicitly, line by line as the paper writes them, and returns the new state;
nothing is done in place and no arithmetic is shared with the fast path. Memory is ``O(m ñ)``, time
``O(m² ñ + m³)``.

The observation-noise estimators are written here again, in float64 (:data:`REFERENCE_R_ESTIMATORS`), apart from
the fast path's registry (:mod:`loko_lightning.kalman.noise`); the tests hold the two registries to the same names.
A single sample is the joint step of one sample.

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

from loko_lightning.kalman.noise import REstimator
from loko_lightning.kalman.reference.time_update import time_update_reference
from loko_lightning.kalman.time_update import TimeUpdate

__all__ = [
    "REFERENCE_R_ESTIMATORS",
    "loko_step_reference",
    "loko_step_reference_batch",
    "pinv_reference",
    "shared_rows_step_reference",
    "topk_step_reference",
]


def _double(value: float | Tensor) -> float | Tensor:
    return value.double() if isinstance(value, Tensor) else value


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


def prior_scale_reference(A: Tensor, noise: Tensor, e: Tensor, rate: float, rcond: float | None = None) -> float:
    """``exp(clip(η g, ±0.5))``, ``g = ½ (eᵀ S⁺ A S⁺ e − tr(S⁺ A))``, ``S = A + noise``; 1 where ``η = 0``.

    ``g`` is the derivative in ``log s`` at ``s = 1`` of ``log N(e; 0, s A + noise)`` restricted to the range of ``S``
    (the covariance filter's ``prior_scale_rate``, ``noise`` the one before the sample: :func:`_previous_scale`),
    written out with ``S⁺`` as a matrix; the tests check it against a finite difference of that log density.
    """
    if not rate:
        return 1.0
    S_plus = pinv_reference(A + noise, rcond)
    u = S_plus @ e
    g = 0.5 * (u @ A @ u - torch.trace(S_plus @ A))
    return math.exp(min(max(rate * float(g), -0.5), 0.5))


def _previous_scale(
    A: Tensor, R: Tensor, e: Tensor, k: int, B: int, beta: float, debias: bool, rate: float, until: int,
    rcond: float | None, extra: Tensor | None = None,
) -> float:  # fmt: skip
    """The prior's scale of step ``k`` from ``R_{k-1}`` (debiased by ``1 − β^{k−1}``) on every sample's block.

    1 at ``k = 1``, where there is no noise estimate before the sample, and after step ``until`` (when not 0).
    ``extra``: more noise in ``S`` known before the label (``softmax_noise``'s blocks), ``B·m x B·m``.
    """
    if k == 1 or not rate or (until and k > until):
        return 1.0
    noise = R / (1 - beta ** (k - 1)) if debias else R
    noise = torch.block_diag(*([noise] * B))
    return prior_scale_reference(A, noise if extra is None else noise + extra, e, rate, rcond)


def _softmax_blocks(y_hat: Tensor) -> Tensor:
    """``diag(ŷ_b) − ŷ_b ŷ_bᵀ`` of each sample's prediction ``(B, m)`` on its diagonal block, ``B·m x B·m``."""
    return torch.block_diag(*[torch.diag(y) - torch.outer(y, y) for y in y_hat])


# Per-sample estimate R̂_b from (e_b, (H P Hᵀ)_bb, ŷ_b, k), and whether it is smoothed by the EMA (else used as is).
REFERENCE_R_ESTIMATORS = {
    "taylor": (lambda e, HPHt_b, y_hat, k: torch.outer(e, e) + HPHt_b, True),
    "residual": (lambda e, HPHt_b, y_hat, k: torch.outer(e, e), True),
    "identity": (lambda e, HPHt_b, y_hat, k: torch.eye(e.shape[0], dtype=torch.float64), False),
    "decay": (lambda e, HPHt_b, y_hat, k: torch.eye(e.shape[0], dtype=torch.float64) * math.exp(-k / 50), False),
    "softmax": (lambda e, HPHt_b, y_hat, k: torch.diag(y_hat) - torch.outer(y_hat, y_hat), False),
}


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
    rcond: float | None = None,
    time_update: TimeUpdate | None = None,
    debias: bool = False,
    prior_scale_rate: float = 0.0,
    prior_scale_until: int = 0,
    softmax_noise: bool = False,
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
        rcond: relative eigenvalue cut-off of the pseudo-inverse of ``S`` (see :func:`pinv_reference`).
        time_update: the process model (:class:`~loko_lightning.kalman.time_update.TimeUpdate`, its values one or
            one per entry of ``θ̃``; default: the paper's identity model).
        debias: the noise in ``S`` is ``R_k / (1 - β^k)`` (not the paper; a smoothed ``r_estimator`` only).
        prior_scale_rate: ``η`` of :func:`prior_scale_reference` (not the paper; 0: the paper's update).
        prior_scale_until: the scale is set on steps ``k <= prior_scale_until`` only (0: on every step).
        softmax_noise: ``diag(ŷ) − ŷ ŷᵀ`` added to the noise in ``S`` (and in the prior scale's), not to ``R_k``
            (not the paper).

    Returns:
        ``(θ̃_k, p̂_k, R_k)``, float64.
    """
    return loko_step_reference_batch(
        theta, p, R, H[None], prediction[None], target[None], k, beta=beta, r_estimator=r_estimator, rcond=rcond,
        time_update=time_update, debias=debias, prior_scale_rate=prior_scale_rate, prior_scale_until=prior_scale_until,
        softmax_noise=softmax_noise,
    )  # fmt: skip


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
    rcond: float | None = None,
    time_update: TimeUpdate | None = None,
    debias: bool = False,
    prior_scale_rate: float = 0.0,
    prior_scale_until: int = 0,
    softmax_noise: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """One joint LoKO step on ``B`` samples (the multistream EKF), dense and in float64.

    The ``B`` observations are one of ``B·m`` outputs: ``H`` stacked (``B·m x ñ``), ``e`` stacked, ``R``
    block-diagonal and ``S`` (``B·m x B·m``), one gain. A smoothed estimator (``"taylor"``, ``"residual"``) takes one
    EMA step with the mean of the per-sample estimates ``R̂_b`` and puts ``R_k`` on every block; the others put each
    sample's own ``R̂_b`` on its block and return their mean as ``R_k``. ``B = 1`` is :func:`loko_step_reference`.

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
        rcond: relative eigenvalue cut-off of the pseudo-inverse of ``S``.
        debias: as in :func:`loko_step_reference`.
        time_update: the process model, as in :func:`loko_step_reference`.
        prior_scale_rate: as in :func:`loko_step_reference`.
        prior_scale_until: as in :func:`loko_step_reference`.
        softmax_noise: as in :func:`loko_step_reference`.

    Returns:
        ``(θ̃_k, p̂_k, R_k)``, float64.
    """
    if r_estimator not in REFERENCE_R_ESTIMATORS:
        raise ValueError(f"Invalid r_estimator: {r_estimator!r} (expected one of {tuple(REFERENCE_R_ESTIMATORS)})")
    theta, p, R, H = theta.double(), p.double(), R.double(), H.double()
    y_hat, y = prediction.double(), target.double()
    B, m = y.shape
    time_update = TimeUpdate() if time_update is None else time_update
    q = _double(time_update.process_noise)

    # 1. Predict: the process model is the identity, with process noise q.
    p = p + q
    # 3. Innovation, P Hᵀ = p̂ ⊙ Hᵀ (row i of Hᵀ scaled by p̂_i) and H P Hᵀ, with sample b's rows b·m ... b·m + m - 1.
    Hs = H.reshape(B * m, -1)
    e = (y - y_hat).reshape(B * m)
    PHt = p[:, None] * Hs.T
    HPHt = Hs @ PHt
    # 4. Observation noise.
    # Not the paper: the prior's scale (P ← s P) from the predictive likelihood of e before the sample.
    extra = _softmax_blocks(y_hat) if softmax_noise else None  # not the paper: the categorical likelihood's noise
    s = _previous_scale(HPHt, R, e, k, B, beta, debias, prior_scale_rate, prior_scale_until, rcond, extra)
    R, noise = _observation_noise(R, e, HPHt, y_hat, k, beta, r_estimator, debias)
    noise = noise if extra is None else noise + extra
    p, PHt, HPHt = s * p, s * PHt, s * HPHt
    # 5. Gain.
    S = HPHt + noise
    K = PHt @ pinv_reference(S, rcond)
    # 6. Update: θ̃_k = θ̃_{k|k-1} + K e and p̂_k,i = p̂_i - (Σ_j K_ij H_ji) p̂_i, the diagonal of P - K H P.
    theta = theta + K @ e
    p = p - (K * Hs.T).sum(1) * p
    # 7. Time update to the next step's prior (the identity in Algorithm 1).
    theta, p = time_update_reference(theta, p, time_update)
    return theta, p, R


def _observation_noise(
    R: Tensor, e: Tensor, HPHt: Tensor, y_hat: Tensor, k: int, beta: float, r_estimator: REstimator, debias: bool
) -> tuple[Tensor, Tensor]:
    """``R_k`` and the block-diagonal noise of ``S`` for the ``B`` samples stacked in ``e``.

    Sample ``b`` has rows ``b·m … b·m + m − 1``. A smoothed estimator (``"taylor"``, ``"residual"``) takes one EMA
    step with the mean of the per-sample estimates ``R̂_b`` and puts ``R_k`` on every block; the others put each
    sample's own ``R̂_b`` on its block and return their mean as ``R_k``. Debiased, the blocks are ``R_k / (1 − β^k)``.
    """
    B, m = y_hat.shape
    estimate, smoothed = REFERENCE_R_ESTIMATORS[r_estimator]
    rows = [slice(b * m, (b + 1) * m) for b in range(B)]
    estimates = [estimate(e[r], HPHt[r, r], y_hat[b], k) for b, r in enumerate(rows)]
    if smoothed:
        R = beta * R + (1 - beta) * sum(estimates) / B
        return R, torch.block_diag(*([R / (1 - beta**k) if debias else R] * B))
    if debias:
        raise ValueError(f"debias needs an EMA of R; {r_estimator!r} is not one")
    return sum(estimates) / B, torch.block_diag(*estimates)


def shared_rows_step_reference(
    theta: Tensor,
    p: Tensor,
    sigmas: list[Tensor],
    R: Tensor,
    H: Tensor,
    prediction: Tensor,
    target: Tensor,
    k: int,
    *,
    spans: list[tuple[int, int, int]],
    beta: float,
    r_estimator: REstimator,
    rcond: float | None = None,
    debias: bool = False,
    prior_scale_rate: float = 0.0,
    prior_scale_until: int = 0,
    softmax_noise: bool = False,
    process_noise: float | Tensor = 0.0,
) -> tuple[Tensor, Tensor, list[Tensor], Tensor]:
    """One joint step of the covariance filter where some weights' rows share a full covariance, dense, float64.

    The covariance is the dense ``ñ x ñ`` matrix ``P``: ``diag(p̂)`` but for the entries of each weight in ``spans``,
    whose block is ``I_rows ⊗ Σ`` (the weight's entries row by row, as ``θ̃`` holds them). The step is the Kalman
    update with that ``P``, written out (``K = P Hᵀ S⁺``, ``P⁺ = P − K H P``); the new ``p̂`` is the diagonal of
    ``P⁺`` and each new ``Σ`` the mean of the weight's ``rows`` diagonal blocks of ``P⁺`` (where the weight's
    entries of ``p̂`` are set to its diagonal). The time update is process noise alone: ``P + diag(q)`` before the
    step (Algorithm 1's ``p̂ + q``; ``I ⊗ (Σ + q I)`` on the shared rows).

    Args:
        theta: ``θ̃_{k-1}``, shape ``(ñ,)``.
        p: ``p̂_{k-1}``, shape ``(ñ,)`` (the entries of the ``spans`` are not read).
        sigmas: the ``Σ`` of each weight in ``spans``, ``cols x cols``.
        R: ``R_{k-1}``, ``m x m``.
        H: the ``B`` Jacobians, shape ``(B, m, ñ)``.
        prediction: ``(B, m)``.
        target: ``(B, m)``.
        k: the 1-based index of this joint update.
        spans: ``(start, rows, cols)`` of each weight in ``θ̃``.
        beta: forgetting factor of the ``R`` EMA.
        r_estimator: as in :func:`loko_step_reference`.
        rcond: relative eigenvalue cut-off of the pseudo-inverse of ``S``.
        debias: as in :func:`loko_step_reference`.
        prior_scale_rate: as in :func:`loko_step_reference` (``P``, ``Σ`` included, scaled).
        prior_scale_until: as in :func:`loko_step_reference`.
        softmax_noise: as in :func:`loko_step_reference`.
        process_noise: ``q`` of every entry (a number) or of each, shape ``(ñ,)``.

    Returns:
        ``(θ̃_k, p̂_k, [Σ_k], R_k)``, float64.
    """
    theta, R, H = theta.double(), R.double(), H.double()
    y_hat, y = prediction.double(), target.double()
    B, m = y.shape
    P = torch.diag(p.double())
    for (start, rows, cols), sigma in zip(spans, sigmas, strict=True):
        end = start + rows * cols
        P[start:end, start:end] = torch.kron(torch.eye(rows, dtype=torch.float64), sigma.double())
    P = P + torch.diag(torch.as_tensor(process_noise, dtype=torch.float64).expand(P.shape[0]))  # p̂ + q, Σ + q I
    Hs = H.reshape(B * m, -1)
    e = (y - y_hat).reshape(B * m)
    PHt = P @ Hs.T
    HPHt = Hs @ PHt
    extra = _softmax_blocks(y_hat) if softmax_noise else None  # not the paper: the categorical likelihood's noise
    s = _previous_scale(HPHt, R, e, k, B, beta, debias, prior_scale_rate, prior_scale_until, rcond, extra)
    R, noise = _observation_noise(R, e, HPHt, y_hat, k, beta, r_estimator, debias)
    noise = noise if extra is None else noise + extra
    P, PHt, HPHt = s * P, s * PHt, s * HPHt
    S = HPHt + noise
    K = PHt @ pinv_reference(S, rcond)
    theta = theta + K @ e
    P = P - K @ Hs @ P
    p = P.diagonal().clone()
    new_sigmas = []
    for start, rows, cols in spans:
        sigma = sum(P[start + i * cols : start + (i + 1) * cols, start + i * cols : start + (i + 1) * cols]
                    for i in range(rows)) / rows  # fmt: skip
        new_sigmas.append(sigma)
        p[start : start + rows * cols] = sigma.diagonal().repeat(rows)
    return theta, p, new_sigmas, R


def topk_step_reference(
    theta: Tensor,
    p: Tensor,
    R: Tensor,
    H: Tensor,
    prediction: Tensor,
    target: Tensor,
    k: int,
    *,
    top: int,
    beta: float,
    r_estimator: REstimator,
    debias: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """One LoKO step observing the label, the most probable classes and the rest: dense, float64, by definition.

    The observation is :class:`~loko_lightning.observation.TopK` with ``k = top`` on each of ``B`` samples.

    For sample ``b``: ``I_b`` = its label and the ``top`` most probable other classes, in class order (chosen here
    by sorting in Python); ``A_b`` the aggregation (one-hot rows for ``I_b``, then the indicator of the other
    classes, dropped when there are none) and ``G_b`` the lift (the same one-hot rows, then the other classes
    weighted by ``ŷ`` and normalised to sum 1). The observation is ``A_b ŷ_b`` with Jacobian ``A_b H_b`` and target
    ``A_b y_b``; ``R̂_b`` the Taylor or residual estimate in those coordinates; ``R_k = β R + (1 - β) mean_b G_bᵀ R̂_b
    G_b``; sample ``b``'s block of ``S`` is ``A_b R_k A_bᵀ``. Then Algorithm 1's gain and update.

    Args:
        theta: ``θ̃``, ``(ñ,)``.
        p: ``p̂``, ``(ñ,)``.
        R: the ``m x m`` noise of class pairs.
        H: the full Jacobians ``∂ŷ/∂θ̃``, ``(B, m, ñ)``.
        prediction: ``ŷ``, ``(B, m)``.
        target: one-hot ``y``, ``(B, m)``.
        k: the 1-based index of this step.
        top: how many classes besides the label.
        beta: the EMA's forgetting factor.
        r_estimator: ``"taylor"`` or ``"residual"``.
        debias: each block ``A_b R_k A_bᵀ`` divided by ``1 - β^k`` (as in :func:`loko_step_reference`).

    Returns:
        ``(θ̃_k, p̂_k, R_k)``, float64.
    """
    theta, p, R, H = theta.double(), p.double(), R.double().clone(), H.double()
    y_hat, y = prediction.double(), target.double()
    B, m = y.shape
    rows_H, rows_e, aggregations, lifted = [], [], [], []
    for b in range(B):
        label = int(y[b].argmax())
        others = sorted((c for c in range(m) if c != label), key=lambda c: -float(y_hat[b, c]))[:top]
        classes = sorted([label, *others])
        rest = [c for c in range(m) if c not in classes]
        A = torch.zeros(len(classes) + bool(rest), m, dtype=torch.float64)
        for row, c in enumerate(classes):
            A[row, c] = 1.0
        G = A.clone()
        if rest:
            A[-1, rest] = 1.0
            G[-1, rest] = y_hat[b, rest] / y_hat[b, rest].sum()
        H_b, e_b = A @ H[b], A @ (y[b] - y_hat[b])
        estimate = torch.outer(e_b, e_b)
        if r_estimator == "taylor":
            estimate = estimate + H_b @ (p[:, None] * H_b.T)
        elif r_estimator != "residual":
            raise ValueError(f"Invalid r_estimator: {r_estimator!r}")
        rows_H.append(H_b)
        rows_e.append(e_b)
        aggregations.append(A)
        lifted.append(G.T @ estimate @ G)
    new_R = beta * R + (1 - beta) * sum(lifted) / B
    Hs, e = torch.cat(rows_H), torch.cat(rows_e)
    PHt = p[:, None] * Hs.T
    noise = new_R / (1 - beta**k) if debias else new_R
    S = Hs @ PHt + torch.block_diag(*(A @ noise @ A.T for A in aggregations))
    K = PHt @ pinv_reference(S)
    return theta + K @ e, p - (K * Hs.T).sum(1) * p, new_R
