r"""The observation-noise covariance ``R``: one registry of estimators, one rule for a step of several samples.

Each estimator is one small function of the step's per-sample quantities that returns the per-sample estimates
:math:`\hat R_b` (``(B, m, m)``). An estimator is either *smoothed*, the paper's EMA

.. math::  R_k = \beta R_{k-1} + (1 - \beta) \frac{1}{B} \sum_b \hat R_b ,

with :math:`R_k` on every sample's block of :math:`S`, or used *as is*, each sample's :math:`\hat R_b` on its own
block (the filter state then keeps their mean, which is not read back). ``B = 1`` is the paper's single observation.

:func:`observation_noise` applies that rule, written once, for every estimator; the float64 reference
(:mod:`loko_lightning.kalman.reference`) writes the estimators again, separately.

The EMA starts at :math:`R_0 = 0` (the paper), so early on :math:`R_k` is the weighted mean of the estimates so far
scaled down by :math:`1 - \beta^k`: the noise is small and the first gains large. *Debiased* (not the paper), the
noise that enters :math:`S` is :math:`R_k / (1 - \beta^k)`, the weighted mean itself (Adam's correction of its
moments); the state keeps :math:`R_k`, so the EMA runs as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = ["R_ESTIMATORS", "NoiseEstimator", "REstimator", "noise_before", "observation_noise", "softmax_covariance"]

REstimator = Literal["taylor", "residual", "identity", "decay", "softmax"]


@dataclass(frozen=True)
class NoiseEstimator:
    r"""One observation-noise estimator.

    Attributes:
        name: the ``r_estimator`` value that selects it.
        estimate: ``estimate(e, hpht, prediction, step)`` → the per-sample :math:`\hat R_b`, ``(B, m, m)``, from the
            innovations ``e`` ``(B, m)``, the diagonal blocks of :math:`H P H^\top` ``(B, m, m)``, the predictions
            ``(B, m)`` and the 1-based index ``k`` of the update (0-d tensor).
        smoothed: the estimates enter the EMA with ``beta`` (otherwise they are used as they are).
        doc: the formula, for error messages and docs.
    """

    name: str
    estimate: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
    smoothed: bool
    doc: str


def _outer(e: Tensor) -> Tensor:
    return e[:, :, None] * e[:, None, :]


def _eye(e: Tensor, dtype: torch.dtype) -> Tensor:
    m = e.shape[-1]
    return torch.eye(m, dtype=dtype, device=e.device).expand(e.shape[0], m, m)


def _taylor(e: Tensor, hpht: Tensor, prediction: Tensor, step: Tensor) -> Tensor:
    return _outer(e) + hpht


def _residual(e: Tensor, hpht: Tensor, prediction: Tensor, step: Tensor) -> Tensor:
    return _outer(e)


def _identity(e: Tensor, hpht: Tensor, prediction: Tensor, step: Tensor) -> Tensor:
    return _eye(e, hpht.dtype)


def _decay(e: Tensor, hpht: Tensor, prediction: Tensor, step: Tensor) -> Tensor:
    return _eye(e, hpht.dtype) * torch.exp(-step.to(hpht.dtype) / 50.0)


def _categorical(prediction: Tensor) -> Tensor:
    """``diag(ŷ_b) − ŷ_b ŷ_bᵀ`` of each row of ``prediction`` ``(B, m)``: ``(B, m, m)``."""
    return torch.diag_embed(prediction) - prediction[:, :, None] * prediction[:, None, :]


def _softmax(e: Tensor, hpht: Tensor, prediction: Tensor, step: Tensor) -> Tensor:
    return _categorical(prediction)


#: The estimators by name: the paper's methods 2 (``"taylor"``, the default) and 1 (``"residual"``), and the
#: literature baselines of its Table "R estimation".
R_ESTIMATORS: dict[str, NoiseEstimator] = {
    estimator.name: estimator
    for estimator in (
        NoiseEstimator("taylor", _taylor, True, "R̂ = e eᵀ + H P Hᵀ (paper method 2)"),
        NoiseEstimator("residual", _residual, True, "R̂ = e eᵀ (paper method 1)"),
        NoiseEstimator("identity", _identity, False, "R = I"),
        NoiseEstimator("decay", _decay, False, "R = I e^(-k/50)"),
        NoiseEstimator("softmax", _softmax, False, "R = diag(ŷ) - ŷ ŷᵀ"),
    )
}


def observation_noise(
    r_estimator: str,
    previous: Tensor,
    innovation: Tensor,
    hpht: Tensor,
    prediction: Tensor,
    step: Tensor,
    beta: float,
    samples: int = 1,
    aggregation: tuple[Tensor, Tensor] | None = None,
    debias: bool = False,
) -> tuple[Tensor, Tensor]:
    """``R_k`` (``m x m``, the filter's state) and the noise that enters ``S`` (``B·m x B·m``, block-diagonal).

    Args:
        r_estimator: a name in :data:`R_ESTIMATORS`.
        previous: ``R_{k-1}``, ``m x m``.
        innovation: ``e = y - ŷ`` of the ``B`` samples stacked, ``(B·m,)``.
        hpht: ``H P Hᵀ`` of the stacked ``H``, ``B·m x B·m``.
        prediction: ``ŷ`` stacked, ``(B·m,)``.
        step: ``k``, the 1-based index of this update (0-d tensor).
        beta: forgetting factor of the EMA.
        samples: ``B``.
        aggregation: ``(A, G)`` (each ``(B, rows, m)``) when each sample observes an aggregation ``A ŷ`` of the outputs
            (:class:`~loko_lightning.observation.TopK`): ``previous`` is then the ``m x m`` ``R`` of the outputs and
            the other arguments are in the observed coordinates (see :func:`_aggregated`).
        debias: the noise of a smoothed estimator divided by ``1 - β^k`` (the state's ``R_k`` is not).

    Returns:
        ``(R_k, noise)``; for ``B = 1`` and not debiased the noise is ``R_k`` itself.
    """
    estimator = R_ESTIMATORS.get(r_estimator)
    if estimator is None:
        raise ValueError(f"Invalid r_estimator: {r_estimator!r} (expected one of {tuple(R_ESTIMATORS)})")
    m = innovation.shape[0] // samples
    blocks = hpht.view(samples, m, samples, m).diagonal(dim1=0, dim2=2).permute(2, 0, 1)  # (B, m, m)
    estimates = estimator.estimate(innovation.view(samples, m), blocks, prediction.view(samples, m), step)
    if aggregation is not None:
        R_k, noise = _aggregated(estimator, previous, estimates, aggregation, beta)
        return R_k, _debiased(noise, beta, step) if debias else noise
    mean = estimates[0] if samples == 1 else estimates.mean(0)
    if estimator.smoothed:
        R_k = beta * previous + (1.0 - beta) * mean
        noise = _on_blocks(R_k, samples)
        return R_k, _debiased(noise, beta, step) if debias else noise
    if samples == 1:
        return mean, mean
    return mean, torch.block_diag(*estimates.unbind(0))


def noise_before(previous: Tensor, step: Tensor, beta: float, samples: int = 1, debias: bool = False) -> Tensor:
    """The noise in ``S`` before this step's estimate: ``R_{k-1}`` on every sample's block, debiased by its ``k - 1``.

    What the covariance filter's ``prior_scale_rate`` weighs the innovation against (the step's own ``R_k`` holds its
    ``e eᵀ``). ``step``: ``k - 1``, the updates applied so far; at 0 there is no estimate (zeros, not debiased).
    """
    noise = _on_blocks(previous, samples)
    return _debiased(noise, beta, step.clamp_min(1)) if debias else noise


def softmax_covariance(prediction: Tensor, samples: int = 1) -> Tensor:
    """``diag(ŷ_b) − ŷ_b ŷ_bᵀ`` on each sample's diagonal block (``B·m x B·m``) from the stacked ``ŷ`` ``(B·m,)``.

    The covariance of a one-hot label drawn from the softmax's own prediction ``ŷ_b``: the noise the categorical
    likelihood puts on the observation, where the EMA estimates it from the innovations.
    """
    blocks = _categorical(prediction.view(samples, -1))
    return blocks[0] if samples == 1 else torch.block_diag(*blocks.unbind(0))


def _on_blocks(R: Tensor, samples: int) -> Tensor:
    """``R`` (``m x m``) on each of the ``samples`` diagonal blocks of a ``B·m x B·m`` matrix; ``R`` itself for one."""
    m = R.shape[-1]
    return R if samples == 1 else torch.block_diag(*R.expand(samples, m, m).unbind(0))


def _debiased(noise: Tensor, beta: float, step: Tensor) -> Tensor:
    """``noise / (1 - β^k)``: the EMA started at 0, divided by the weight its ``k`` estimates have."""
    return noise / (1.0 - torch.as_tensor(beta, dtype=noise.dtype, device=noise.device) ** step.to(noise.dtype))


def _aggregated(
    estimator: NoiseEstimator, previous: Tensor, estimates: Tensor, aggregation: tuple[Tensor, Tensor], beta: float
) -> tuple[Tensor, Tensor]:
    """The EMA of ``R`` (``m x m``) with each sample's estimate lifted by ``G_b``, and the blocks ``A_b R_k A_bᵀ``.

    ``R_k = β R_{k-1} + (1 - β) mean_b G_bᵀ R̂_b G_b``: positive semi-definite whenever ``R_{k-1}`` and the
    estimates are, and ``A_b R_k A_bᵀ = β A_b R_{k-1} A_bᵀ + (1 - β) R̂_b`` for one sample (``A_b G_bᵀ = I``);
    with ``A_b = G_b = I`` the rule of :func:`observation_noise` for all ``m`` outputs.
    """
    if not estimator.smoothed:
        raise ValueError(f"Invalid r_estimator: {estimator.name!r} is not an EMA; an aggregated observation needs one")
    A, G = aggregation
    lifted = G.transpose(1, 2) @ estimates @ G  # (B, m, m)
    mean = lifted[0] if lifted.shape[0] == 1 else lifted.mean(0)
    R_k = beta * previous + (1.0 - beta) * mean
    blocks = A @ R_k @ A.transpose(1, 2)
    if blocks.shape[0] == 1:
        return R_k, blocks[0]
    return R_k, torch.block_diag(*blocks.unbind(0))
