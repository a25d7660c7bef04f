"""A slow, obviously correct LoKO step: Algorithm 1 with dense matrices in float64, in the paper's names.

:func:`loko_step_reference` is the specification that the fast update (:func:`loko_lightning.kalman.update.loko_update`)
is tested against. It takes the whole Jacobian ``H`` as one dense ``m x ñ`` matrix and the parameters ``θ̃`` and the
diagonal covariance ``p̂`` as flat vectors, forms ``P Hᵀ``, ``S`` and the gain ``K`` explicitly, line by line as
the paper writes them, and returns the new state; nothing is done in place and no arithmetic is shared with the
fast path. Memory is ``O(m ñ)`` (``H``, ``P Hᵀ`` and ``K``), time ``O(m² ñ + m³)``.

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

__all__ = [
    "REFERENCE_R_ESTIMATORS",
    "loko_step_reference",
    "loko_step_reference_batch",
    "natural_step_reference",
    "lofi_step_reference",
    "pinv_reference",
    "time_update_reference",
    "topk_step_reference",
]


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
    process_noise: float | Tensor = 0.0,
    rcond: float | None = None,
    p_floor: float | Tensor = 0.0,
    shrinkage: float | Tensor = 0.0,
    inflation: float | Tensor = 0.0,
    forgetting: float | Tensor = 0.0,
    reference: float | Tensor = 1.0,
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
        shrinkage: ``λ`` of the shrinkage process model (not the paper), see :func:`time_update_reference`.
        inflation: ``α`` of the covariance inflation (not the paper), see :func:`time_update_reference`.
        forgetting: ``γ`` of stabilised forgetting (not the paper), see :func:`time_update_reference`.
        reference: the reference variance of ``forgetting``.

    Returns:
        ``(θ̃_k, p̂_k, R_k)``, float64.
    """
    return loko_step_reference_batch(
        theta,
        p,
        R,
        H[None],
        prediction[None],
        target[None],
        k,
        beta=beta,
        r_estimator=r_estimator,
        process_noise=process_noise,
        rcond=rcond,
        p_floor=p_floor,
        shrinkage=shrinkage,
        inflation=inflation,
        forgetting=forgetting,
        reference=reference,
    )


def time_update_reference(
    theta: Tensor,
    p: Tensor,
    *,
    shrinkage: float | Tensor,
    inflation: float | Tensor,
    p_floor: float | Tensor,
    forgetting: float | Tensor = 0.0,
    reference: float | Tensor = 1.0,
) -> tuple[Tensor, Tensor]:
    r"""The time update after an applied step, from the process model, in float64 (not the paper when not 0).

    The process model :math:`\tilde\theta_{k+1} = (1 - \lambda)\tilde\theta_k + w_k` with
    :math:`\operatorname{Cov}(w_k) = (1 + \alpha) P_k - (1 - \lambda)^2 P_k` predicts
    :math:`\tilde\theta_{k+1|k} = (1 - \lambda)\tilde\theta_k` and :math:`P_{k+1|k} = (1 + \alpha) P_k`: the mean
    shrinks, the covariance is kept (shrinkage alone) or inflated. Stabilised forgetting then takes the geometric
    mixture :math:`p^{1-\gamma} p_{\mathrm{ref}}^{\gamma}` of that Gaussian with a reference one of the same mean and
    covariance ``reference · I``: the precisions mix, :math:`P^{-1} \leftarrow (1 - \gamma) P^{-1} + \gamma /
    p_{\mathrm{ref}}`, and the mean is kept. The process noise ``q`` is added at the next step, as in Algorithm 1; the
    floor applies to the result. ``λ = α = γ = 0`` is Algorithm 1's identity model.
    """
    lam = shrinkage.double() if isinstance(shrinkage, Tensor) else shrinkage
    alpha = inflation.double() if isinstance(inflation, Tensor) else inflation
    gamma = forgetting.double() if isinstance(forgetting, Tensor) else forgetting
    ref = reference.double() if isinstance(reference, Tensor) else reference
    p = (1 + alpha) * p
    if isinstance(gamma, Tensor) or gamma:
        p = 1.0 / ((1 - gamma) / p + gamma / ref)
    return (1 - lam) * theta, _floored(p, p_floor)


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
    shrinkage: float | Tensor = 0.0,
    inflation: float | Tensor = 0.0,
    forgetting: float | Tensor = 0.0,
    reference: float | Tensor = 1.0,
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
        process_noise: ``q`` added to ``p̂`` in the predict step.
        rcond: relative eigenvalue cut-off of the pseudo-inverse of ``S``.
        p_floor: a floor on ``p̂_k``.
        shrinkage: ``λ`` (:func:`time_update_reference`).
        inflation: ``α`` (:func:`time_update_reference`).
        forgetting: ``γ`` of stabilised forgetting (not the paper), see :func:`time_update_reference`.
        reference: the reference variance of ``forgetting``.

    Returns:
        ``(θ̃_k, p̂_k, R_k)``, float64.
    """
    if r_estimator not in REFERENCE_R_ESTIMATORS:
        raise ValueError(f"Invalid r_estimator: {r_estimator!r} (expected one of {tuple(REFERENCE_R_ESTIMATORS)})")
    theta, p, R, H = theta.double(), p.double(), R.double(), H.double()
    y_hat, y = prediction.double(), target.double()
    B, m = y.shape
    q = process_noise.double() if isinstance(process_noise, Tensor) else process_noise

    # 1. Predict: the process model is the identity, with process noise q.
    p = p + q
    # 3. Innovation, P Hᵀ = p̂ ⊙ Hᵀ (row i of Hᵀ scaled by p̂_i) and H P Hᵀ, with sample b's rows b·m ... b·m + m - 1.
    Hs = H.reshape(B * m, -1)
    e = (y - y_hat).reshape(B * m)
    PHt = p[:, None] * Hs.T
    HPHt = Hs @ PHt
    # 4. Observation noise.
    estimate, smoothed = REFERENCE_R_ESTIMATORS[r_estimator]
    rows = [slice(b * m, (b + 1) * m) for b in range(B)]
    estimates = [estimate(e[r], HPHt[r, r], y_hat[b], k) for b, r in enumerate(rows)]
    if smoothed:
        R = beta * R + (1 - beta) * sum(estimates) / B
        blocks = [R] * B
    else:
        R = sum(estimates) / B
        blocks = estimates
    # 5. Gain.
    S = HPHt + torch.block_diag(*blocks)
    K = PHt @ pinv_reference(S, rcond)
    # 6. Update: θ̃_k = θ̃_{k|k-1} + K e and p̂_k,i = p̂_i - (Σ_j K_ij H_ji) p̂_i, the diagonal of P - K H P.
    theta = theta + K @ e
    p = p - (K * Hs.T).sum(1) * p
    # 7. Time update to the next step's prior (the identity in Algorithm 1).
    theta, p = time_update_reference(
        theta, p, shrinkage=shrinkage, inflation=inflation, p_floor=p_floor, forgetting=forgetting, reference=reference
    )
    return theta, p, R


def _categorical_terms(Jz: Tensor, prediction: Tensor, target: Tensor) -> list[tuple[Tensor, Tensor]]:
    """Per sample, ``(Hᵀ R⁺ H, Hᵀ R⁺ e)`` for the categorical noise ``R = J_s``, formed as written (float64).

    ``H = J_s J_z`` with ``J_s = diag(ŷ) − ŷŷᵀ`` and ``R⁺`` by eigendecomposition (:func:`pinv_reference`); ``Jz``
    is ``(B, m, ñ)`` (or ``(m, ñ)`` for one sample), ``prediction`` and ``target`` ``(B, m)`` (or ``(m,)``).
    """
    Jz, y_hat, y = Jz.double(), prediction.double(), target.double()
    if Jz.dim() == 2:
        Jz, y_hat, y = Jz[None], y_hat[None], y[None]
    terms = []
    for b in range(Jz.shape[0]):
        Js = torch.diag(y_hat[b]) - torch.outer(y_hat[b], y_hat[b])
        H = Js @ Jz[b]
        R_pinv = pinv_reference(Js)
        terms.append((H.T @ R_pinv @ H, H.T @ R_pinv @ (y[b] - y_hat[b])))
    return terms


def natural_step_reference(
    theta: Tensor,
    p: Tensor,
    Jz: Tensor,
    prediction: Tensor,
    target: Tensor,
    *,
    fisher: str,
    process_noise: float | Tensor = 0.0,
    p_floor: float | Tensor = 0.0,
    shrinkage: float | Tensor = 0.0,
    inflation: float | Tensor = 0.0,
    forgetting: float | Tensor = 0.0,
    reference: float | Tensor = 1.0,
) -> tuple[Tensor, Tensor]:
    r"""One step of the diagonal natural-gradient filter on ``B`` samples, dense and in float64, from its definition.

    The filter is :class:`~loko_lightning.observation.NaturalGradient` (``LoKO(observation="natural")``).

    The observation is the paper's (``ŷ = softmax(z)``, ``H = J_s J_z`` with ``J_s = diag(ŷ) - ŷŷᵀ``), the noise the
    categorical ``R = J_s`` of each sample, and the filter keeps only the diagonal of the precision:

    .. math::

        \lambda = \frac{1}{\hat p + q} + \sum_b \iota_b, \qquad
        \tilde\theta \leftarrow \tilde\theta + \lambda^{-1} \odot \sum_b H_b^\top R_b^{+} e_b

    with the information :math:`\iota_b = \operatorname{diag}(H_b^\top R_b^{+} H_b)` (``fisher="exact"``) or the
    square of :math:`H_b^\top R_b^{+} e_b` (``"empirical"``). Everything is formed as written (``H``, ``R⁺`` by
    eigendecomposition), none of the identities the fast path uses (:math:`H^\top R^{+} e = J_z^\top e`) is assumed.

    Args:
        theta: ``θ̃``, ``(ñ,)``.
        p: ``p̂``, ``(ñ,)``.
        Jz: the Jacobians of the logits, ``(B, m, ñ)`` (or ``(m, ñ)`` for one sample).
        prediction: ``ŷ``, ``(B, m)`` (or ``(m,)``).
        target: ``y``, like ``prediction``.
        fisher: ``"exact"`` or ``"empirical"``.
        process_noise: ``q``, one value or one per entry.
        p_floor: a floor on the new ``p̂``.
        shrinkage: ``λ`` (:func:`time_update_reference`, after the mean's update with the floored posterior).
        inflation: ``α`` (:func:`time_update_reference`).
        forgetting: ``γ`` of stabilised forgetting (not the paper), see :func:`time_update_reference`.
        reference: the reference variance of ``forgetting``.

    Returns:
        ``(θ̃_k, p̂_k)``, float64.
    """
    if fisher not in ("exact", "empirical"):
        raise ValueError(f"Invalid fisher: {fisher!r}")
    q = process_noise.double() if isinstance(process_noise, Tensor) else process_noise
    precision = 1.0 / (p.double() + q)
    direction = torch.zeros_like(precision)
    for information, d in _categorical_terms(Jz, prediction, target):
        direction = direction + d
        precision = precision + (torch.diagonal(information) if fisher == "exact" else d * d)
    p_new = _floored(1.0 / precision, p_floor)
    theta_new = theta.double() + p_new * direction
    return time_update_reference(
        theta_new, p_new, shrinkage=shrinkage, inflation=inflation, p_floor=p_floor, forgetting=forgetting,
        reference=reference,
    )  # fmt: skip


def lofi_step_reference(
    theta: Tensor,
    p: Tensor,
    W: Tensor,
    Jz: Tensor,
    prediction: Tensor,
    target: Tensor,
    *,
    fisher: str = "exact",
    process_noise: float | Tensor = 0.0,
    p_floor: float | Tensor = 0.0,
    shrinkage: float | Tensor = 0.0,
    inflation: float | Tensor = 0.0,
    forgetting: float | Tensor = 0.0,
    reference: float | Tensor = 1.0,
) -> tuple[Tensor, Tensor, Tensor]:
    r"""One step of the low-rank plus diagonal precision filter on ``B`` samples, dense and in float64, by definition.

    The filter is :class:`~loko_lightning.observation.LowRankNatural` (``LoKO(observation="lofi<L>")``). With the
    categorical noise :math:`R_b = J_{s,b}` and :math:`H_b = J_{s,b} J_{z,b}` as in :func:`natural_step_reference`,
    the precision :math:`\Lambda = \mathrm{diag}(\upsilon) + W W^\top` (:math:`\upsilon = 1/(\hat p + q)`) gets the
    information of the samples, :math:`\Lambda' = \Lambda + \sum_b H_b^\top R_b^{+} H_b`, and

    .. math::

        \tilde\theta \leftarrow \tilde\theta + \Lambda'^{-1} \sum_b H_b^\top R_b^{+} e_b

    solved densely (``n x n``). Then the low-rank part :math:`M = W W^\top + \sum_b H_b^\top R_b^{+} H_b` is cut to its
    ``L`` leading eigenpairs, :math:`W' = V_L \Sigma_L^{1/2}`, and :math:`\upsilon' = \upsilon +
    \mathrm{diag}(M - W' W'^\top)`, so the diagonal of :math:`\Lambda'` is kept. ``W`` is defined up to the signs and
    rotation of its columns: compare :math:`W W^\top`.

    Args:
        theta: ``θ̃``, ``(n,)``.
        p: ``1/υ`` before the process noise, ``(n,)``.
        W: ``(n, L)``.
        Jz: the Jacobians of the logits, ``(B, m, n)`` (or ``(m, n)``).
        prediction: ``ŷ``, ``(B, m)`` (or ``(m,)``).
        target: ``y``, like ``prediction``.
        fisher: ``"exact"``: the information :math:`H_b^\top R_b^{+} H_b` as above; ``"empirical"``: the outer product
            :math:`d_b d_b^\top` of :math:`d_b = H_b^\top R_b^{+} e_b` in its place.
        process_noise: ``q`` on the diagonal part.
        p_floor: a floor on the new ``1/υ``.
        shrinkage: ``λ`` (:func:`time_update_reference`).
        inflation: ``α`` (:func:`time_update_reference`; ``W`` is scaled by :math:`1/\sqrt{1 + \alpha}`).
        forgetting: ``γ`` (:func:`time_update_reference`; ``W`` is scaled by :math:`\sqrt{1 - \gamma}` too).
        reference: the reference variance of ``forgetting``.

    Returns:
        ``(θ̃_k, 1/υ_k, W_k)``, float64.
    """
    q = process_noise.double() if isinstance(process_noise, Tensor) else process_noise
    W = W.double()
    ups = 1.0 / (p.double() + q)
    low = W @ W.T
    direction = torch.zeros_like(ups)
    if fisher not in ("exact", "empirical"):
        raise ValueError(f"Invalid fisher: {fisher!r}")
    for information, d in _categorical_terms(Jz, prediction, target):
        low = low + (information if fisher == "exact" else torch.outer(d, d))
        direction = direction + d
    theta_new = theta.double() + torch.linalg.solve(torch.diag(ups) + low, direction)
    values, vectors = torch.linalg.eigh(low)
    rank = W.shape[1]
    W_new = vectors[:, -rank:] * values[-rank:].clamp_min(0).sqrt()
    ups_new = ups + torch.diagonal(low) - (W_new * W_new).sum(1)
    p_new = _floored(1.0 / ups_new, p_floor)
    theta_new, p_new = time_update_reference(
        theta_new, p_new, shrinkage=shrinkage, inflation=inflation, p_floor=p_floor, forgetting=forgetting,
        reference=reference,
    )  # fmt: skip
    alpha = torch.as_tensor(inflation, dtype=torch.float64)
    gamma = torch.as_tensor(forgetting, dtype=torch.float64)
    return theta_new, p_new, W_new * ((1 - gamma) / (1 + alpha)).sqrt().reshape(-1, 1)


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
    S = Hs @ PHt + torch.block_diag(*(A @ new_R @ A.T for A in aggregations))
    K = PHt @ pinv_reference(S)
    return theta + K @ e, p - (K * Hs.T).sum(1) * p, new_R


def _floored(p: Tensor, p_floor: float | Tensor) -> Tensor:
    """``max(p̂, p_floor)`` entrywise; no floor (``0``): ``p̂`` as it is."""
    if isinstance(p_floor, Tensor):
        return torch.maximum(p, p_floor.double())
    return p.clamp_min(float(p_floor)) if p_floor else p
