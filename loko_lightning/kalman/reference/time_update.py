"""The time update (:class:`~loko_lightning.kalman.time_update.TimeUpdate`) from its process model, in float64."""

from __future__ import annotations

import torch
from torch import Tensor

from loko_lightning.kalman.time_update import TimeUpdate

__all__ = ["floored", "time_update_reference"]


def _double(value: float | Tensor) -> float | Tensor:
    return value.double() if isinstance(value, Tensor) else value


def time_update_reference(theta: Tensor, p: Tensor, time_update: TimeUpdate) -> tuple[Tensor, Tensor]:
    r"""The time update after an applied step, from the process model, in float64 (not the paper when not 0).

    The process model :math:`\tilde\theta_{k+1} = (1 - \lambda)\tilde\theta_k + w_k` with
    :math:`\operatorname{Cov}(w_k) = (1 + \alpha) P_k - (1 - \lambda)^2 P_k` predicts
    :math:`\tilde\theta_{k+1|k} = (1 - \lambda)\tilde\theta_k` and :math:`P_{k+1|k} = (1 + \alpha) P_k`: the mean
    shrinks, the covariance is kept (shrinkage alone) or inflated. Stabilised forgetting then takes the geometric
    mixture :math:`p^{1-\gamma} p_{\mathrm{ref}}^{\gamma}` of that Gaussian with a reference one of the same mean and
    covariance ``reference · I``: the precisions mix, :math:`P^{-1} \leftarrow (1 - \gamma) P^{-1} + \gamma /
    p_{\mathrm{ref}}`, and the mean is kept. The process noise ``q`` is added at the next step, as in Algorithm 1; the
    floor applies to the result. ``λ = α = γ = 0`` is Algorithm 1's identity model.

    Args:
        theta: ``θ̃_k``, flat.
        p: ``p̂_k``, flat.
        time_update: the process model, its values one or one per entry.

    Returns:
        ``(θ̃_{k+1|k}, p̂ before the next step's process noise)``, float64.
    """
    lam, alpha, gamma = (_double(v) for v in (time_update.shrinkage, time_update.inflation, time_update.forgetting))
    ref = _double(time_update.reference)
    p = (1 + alpha) * p
    if isinstance(gamma, Tensor) or gamma:
        p = 1.0 / ((1 - gamma) / p + gamma / ref)
    return (1 - lam) * theta, floored(p, time_update.p_floor)


def floored(p: Tensor, p_floor: float | Tensor) -> Tensor:
    """``max(p̂, p_floor)`` entrywise; no floor (``0``): ``p̂`` as it is."""
    if isinstance(p_floor, Tensor):
        return torch.maximum(p, p_floor.double())
    return p.clamp_min(float(p_floor)) if p_floor else p
