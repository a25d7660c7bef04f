"""The diagonal natural-gradient filter from its definition, dense and in float64: ``H``, ``R⁺`` formed as written."""

from __future__ import annotations

import torch
from torch import Tensor

from loko_lightning.kalman.reference.covariance import pinv_reference
from loko_lightning.kalman.reference.time_update import floored, time_update_reference
from loko_lightning.kalman.time_update import TimeUpdate

__all__ = ["categorical_terms", "information_factors", "natural_step_reference", "sampled_factors"]


def _double(value: float | Tensor) -> float | Tensor:
    return value.double() if isinstance(value, Tensor) else value


def categorical_terms(Jz: Tensor, prediction: Tensor, target: Tensor) -> list[tuple[Tensor, Tensor]]:
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


def sampled_factors(Jz: Tensor, prediction: Tensor, sampled: Tensor) -> list[Tensor]:
    """Per sample, the factor ``Hᵀ R⁺ (u_s − ŷ)`` of the label ``s`` drawn for it, formed as written (float64).

    The sampled Fisher's information is its outer product: ``E_s[(u_s − ŷ)(u_s − ŷ)ᵀ] = J_s = R``, so in
    expectation ``Hᵀ R⁺ R R⁺ H = Hᵀ R⁺ H``, the exact Fisher. ``sampled`` holds the labels, ``(B,)`` (or a scalar).
    """
    Jz, y_hat = Jz.double(), prediction.double()
    if Jz.dim() == 2:
        Jz, y_hat = Jz[None], y_hat[None]
    labels = torch.as_tensor(sampled).reshape(-1)
    factors = []
    for b in range(Jz.shape[0]):
        Js = torch.diag(y_hat[b]) - torch.outer(y_hat[b], y_hat[b])
        drawn = torch.zeros_like(y_hat[b])
        drawn[int(labels[b])] = 1.0
        factors.append((Js @ Jz[b]).T @ pinv_reference(Js) @ (drawn - y_hat[b]))
    return factors


def natural_step_reference(
    theta: Tensor,
    p: Tensor,
    Jz: Tensor,
    prediction: Tensor,
    target: Tensor,
    *,
    fisher: str,
    sampled: Tensor | None = None,
    time_update: TimeUpdate | None = None,
) -> tuple[Tensor, Tensor]:
    r"""One step of the diagonal natural-gradient filter on ``B`` samples, dense and in float64, from its definition.

    The filter is :class:`~loko_lightning.kalman.filters.information.DiagonalInformation` (``LoKO(filter="natural")``).

    The observation is the paper's (``ŷ = softmax(z)``, ``H = J_s J_z`` with ``J_s = diag(ŷ) - ŷŷᵀ``), the noise the
    categorical ``R = J_s`` of each sample, and the filter keeps only the diagonal of the precision:

    .. math::

        \lambda = \frac{1}{\hat p + q} + \sum_b \iota_b, \qquad
        \tilde\theta \leftarrow \tilde\theta + \lambda^{-1} \odot \sum_b H_b^\top R_b^{+} e_b

    with the information :math:`\iota_b = \operatorname{diag}(H_b^\top R_b^{+} H_b)` (``fisher="exact"``) or the
    square of :math:`H_b^\top R_b^{+} e_b` (``"empirical"``), or of :math:`H_b^\top R_b^{+} (u_{s_b} - \hat y_b)` for
    the label :math:`s_b` drawn for sample ``b`` (``"sampled"``, :func:`sampled_factors`). Everything is formed as
    written (``H``, ``R⁺`` by eigendecomposition), none of the identities the fast path uses (:math:`H^\top R^{+} e =
    J_z^\top e`) is assumed.

    Args:
        theta: ``θ̃``, ``(ñ,)``.
        p: ``p̂``, ``(ñ,)``.
        Jz: the Jacobians of the logits, ``(B, m, ñ)`` (or ``(m, ñ)`` for one sample).
        prediction: ``ŷ``, ``(B, m)`` (or ``(m,)``).
        target: ``y``, like ``prediction``.
        fisher: ``"exact"``, ``"empirical"`` or ``"sampled"``.
        sampled: the drawn labels, ``(B,)``, with ``fisher="sampled"``.
        time_update: the process model (:class:`~loko_lightning.kalman.time_update.TimeUpdate`): ``q`` first, the floor
            on the new ``p̂`` before the mean's update with it, then :func:`time_update_reference`.

    Returns:
        ``(θ̃_k, p̂_k)``, float64.
    """
    terms = categorical_terms(Jz, prediction, target)
    factors = information_factors(fisher, terms, Jz, prediction, sampled)
    time_update = TimeUpdate() if time_update is None else time_update
    q = _double(time_update.process_noise)
    precision = 1.0 / (p.double() + q)
    direction = torch.zeros_like(precision)
    for (information, d), f in zip(terms, factors, strict=True):
        direction = direction + d
        precision = precision + (torch.diagonal(information) if f is None else f * f)
    p_new = floored(1.0 / precision, time_update.p_floor)
    theta_new = theta.double() + p_new * direction
    return time_update_reference(theta_new, p_new, time_update)


def information_factors(
    fisher: str, terms: list[tuple[Tensor, Tensor]], Jz: Tensor, prediction: Tensor, sampled: Tensor | None
) -> list[Tensor | None]:
    """Per sample, the vector whose outer product is the information (None: the exact ``Hᵀ R⁺ H``)."""
    if fisher == "exact":
        return [None] * len(terms)
    if fisher == "empirical":
        return [d for _, d in terms]
    if fisher == "sampled":
        if sampled is None:
            raise ValueError("fisher='sampled' needs the drawn labels (sampled=)")
        return sampled_factors(Jz, prediction, sampled)
    raise ValueError(f"Invalid fisher: {fisher!r}")
