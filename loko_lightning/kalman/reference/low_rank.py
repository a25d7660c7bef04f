"""LoFi's step from its definition, dense and in float64: the ``n x n`` precision formed and solved as written."""

from __future__ import annotations

import torch
from torch import Tensor

from loko_lightning.kalman.reference.information import categorical_terms, information_factors
from loko_lightning.kalman.reference.time_update import time_update_reference
from loko_lightning.kalman.time_update import TimeUpdate

__all__ = ["lofi_step_reference"]


def _double(value: float | Tensor) -> float | Tensor:
    return value.double() if isinstance(value, Tensor) else value


def lofi_step_reference(
    theta: Tensor,
    p: Tensor,
    W: Tensor,
    Jz: Tensor,
    prediction: Tensor,
    target: Tensor,
    *,
    fisher: str = "exact",
    sampled: Tensor | None = None,
    time_update: TimeUpdate | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    r"""One step of the low-rank plus diagonal precision filter on ``B`` samples, dense and in float64, by definition.

    The filter is :class:`~loko_lightning.kalman.filters.low_rank.LowRankPrecision` (``LoKO(filter="lofi<L>")``).
    With the categorical noise :math:`R_b = J_{s,b}` and :math:`H_b = J_{s,b} J_{z,b}` as in
    :func:`~loko_lightning.kalman.reference.natural_step_reference`, the precision :math:`\Lambda =
    \mathrm{diag}(\upsilon) + W W^\top` (:math:`\upsilon = 1/(\hat p + q)`) gets the information of the samples,
    :math:`\Lambda' = \Lambda + \sum_b H_b^\top R_b^{+} H_b`, and

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
            :math:`d_b d_b^\top` of :math:`d_b = H_b^\top R_b^{+} e_b` in its place; ``"sampled"``: the outer
            product of :math:`H_b^\top R_b^{+} (u_{s_b} - \hat y_b)` for the drawn label :math:`s_b`.
        sampled: the drawn labels, ``(B,)``, with ``fisher="sampled"``.
        time_update: the process model (:class:`~loko_lightning.kalman.time_update.TimeUpdate`): ``q`` on the
            diagonal part, then :func:`time_update_reference` on the new ``1/υ`` (the floor last); inflation and
            forgetting scale ``W`` by :math:`\sqrt{(1 - \gamma)/(1 + \alpha)}`.

    Returns:
        ``(θ̃_k, 1/υ_k, W_k)``, float64.
    """
    time_update = TimeUpdate() if time_update is None else time_update
    q = _double(time_update.process_noise)
    W = W.double()
    ups = 1.0 / (p.double() + q)
    low = W @ W.T
    direction = torch.zeros_like(ups)
    terms = categorical_terms(Jz, prediction, target)
    for (information, d), f in zip(terms, information_factors(fisher, terms, Jz, prediction, sampled), strict=True):
        low = low + (information if f is None else torch.outer(f, f))
        direction = direction + d
    theta_new = theta.double() + torch.linalg.solve(torch.diag(ups) + low, direction)
    values, vectors = torch.linalg.eigh(low)
    rank = W.shape[1]
    W_new = vectors[:, -rank:] * values[-rank:].clamp_min(0).sqrt()
    ups_new = ups + torch.diagonal(low) - (W_new * W_new).sum(1)
    # The mean does not read the new diagonal: the floor applies once, after the time update (as in Algorithm 1's form).
    theta_new, p_new = time_update_reference(theta_new, 1.0 / ups_new, time_update)
    alpha = torch.as_tensor(time_update.inflation, dtype=torch.float64)
    gamma = torch.as_tensor(time_update.forgetting, dtype=torch.float64)
    return theta_new, p_new, W_new * ((1 - gamma) / (1 + alpha)).sqrt().reshape(-1, 1)
