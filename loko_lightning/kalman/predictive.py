r"""Predictions from the posterior: class probabilities averaged over the filter's belief, not only at its mean.

Before a sample the filter believes :math:`\tilde\theta \sim \mathcal N(\hat\theta, P)`. Linearised at the mean, the
probabilities :math:`\hat y = \mathrm{softmax}(z)` have the covariance :math:`C = H P H^\top`, which the step forms for
:math:`S` anyway. With :math:`A = \mathrm{diag}(\hat y) - \hat y \hat y^\top` the softmax's Jacobian,
:math:`H = A J_z` and :math:`C = A \Sigma_z A`, so

.. math::

    A^{+} C A^{+} = \Pi \Sigma_z \Pi, \qquad \Pi = I - \tfrac{1}{m} \mathbf 1 \mathbf 1^\top:

the logits' covariance up to their common shift, the one direction the softmax does not see. The predictive
:math:`\int \mathrm{softmax}(z)\, \mathcal N(z; \hat z, \Sigma_z)\, dz` in the mean-field approximation of Lu, Ie and
Sha (2021), which needs only the variances of logit differences (shift-free):

.. math::

    p_i \approx \Big(\sum_j \exp\big(-(\hat z_i - \hat z_j) / \sqrt{1 + \lambda v_{ij}}\big)\Big)^{-1}, \qquad
    v_{ij} = \mathrm{Var}(z_i - z_j) = \Sigma_{ii} + \Sigma_{jj} - 2\Sigma_{ij}, \quad \lambda = \pi / 8,

normalised to sum to 1. With :math:`P = 0` it is the mean's softmax exactly; a class whose logit differences are
uncertain moves toward the others, so a confident mistake costs less log-loss.

The filter's :math:`P` is not a calibrated posterior: :math:`p_0` is a step size, and a diagonal :math:`P` ignores the
correlations the data impose, so :math:`H P H^\top` overstates the spread (on the debug stream the predictive with
the whole :math:`P` was underconfident: ECE 30% against the mean's 8%). :class:`PredictiveScale` therefore averages over
:math:`\kappa P`, with :math:`\kappa` chosen online among :data:`KAPPAS` by each one's prequential log-loss so far
(empirical Bayes on the scale; :math:`\kappa = 0` is the mean, which it keeps where the spread does not help).

Precision: :math:`C` carries the arithmetic's rounding (float32: about :math:`\epsilon |C|`), which :math:`A^{+}`
multiplies by up to :math:`1/\lambda_{\min}(A)^2`. Directions of :math:`A` with an eigenvalue below
:math:`\sqrt{\epsilon}\,\lambda_{\max}(A)` (classes of probability below about that) are cut: their logit variance is
not recoverable from :math:`C` at that precision and is taken as 0, which keeps those classes at the mean's
(conservative: never an invented uncertainty).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

__all__ = ["KAPPAS", "PREDICTIVES", "PredictiveScale", "mean_field_predictive", "sample_blocks"]

#: How a learner's scored probabilities are made: at the filter's mean (the paper), or averaged over its belief.
PREDICTIVES = ("mean", "posterior")

#: The scales of ``H P Hᵀ`` :class:`PredictiveScale` chooses among (0: the mean's prediction).
KAPPAS = (0.0, 1 / 64, 1 / 16, 1 / 4, 1.0)

# λ of the probit approximation of the logistic sigmoid, σ(x) ≈ Φ(√λ x): π/8.
PROBIT_LAMBDA = math.pi / 8


def sample_blocks(cov: Tensor, samples: int) -> Tensor:
    """The ``(samples, m, m)`` diagonal blocks of a stacked ``(samples·m) x (samples·m)`` covariance."""
    m = cov.shape[-1] // samples
    return torch.stack([cov[b * m : (b + 1) * m, b * m : (b + 1) * m] for b in range(samples)])


def mean_field_predictive(probabilities: Tensor, cov: Tensor, eps: float | None = None) -> Tensor:
    r"""The posterior predictive of the module's equations, ``(B, m)``, from the mean's ``probabilities`` ``(B, m)``.

    Args:
        probabilities: the softmax at the filter's mean, one row per sample.
        cov: ``H P Hᵀ`` of the probabilities, ``(B, m, m)`` (one block per sample, :func:`sample_blocks`).
        eps: the relative precision of ``cov`` (default: that of its dtype), which sets the cut of :math:`A^{+}`.

    Returns:
        The probabilities averaged over the belief, in the dtype of ``probabilities``; a sample whose inputs are not
        finite keeps its mean prediction.
    """
    eps = torch.finfo(cov.dtype).eps if eps is None else eps
    p = probabilities.to(torch.float64)
    C = cov.to(torch.float64)
    A = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    # eigh must not see NaN (LAPACK raises): a row that is not finite decomposes I, and keeps its prediction below.
    scorable = torch.isfinite(p).all(-1)[:, None, None]
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    values, vectors = torch.linalg.eigh(torch.where(scorable, A, eye))
    keep = values > math.sqrt(eps) * values[:, -1:].clamp_min(torch.finfo(torch.float64).tiny)
    inverse = torch.where(keep, 1.0 / torch.where(keep, values, 1.0), 0.0)
    pinv = (vectors * inverse[:, None, :]) @ vectors.transpose(-1, -2)
    sigma = pinv @ C @ pinv
    diagonal = torch.diagonal(sigma, dim1=-2, dim2=-1)
    v = (diagonal[:, :, None] + diagonal[:, None, :] - 2.0 * sigma).clamp_min(0.0)
    z = p.clamp_min(torch.finfo(torch.float64).tiny).log()
    gaps = (z[:, :, None] - z[:, None, :]) / torch.sqrt(1.0 + PROBIT_LAMBDA * v)
    averaged = torch.exp(-torch.logsumexp(-gaps, dim=-1))
    averaged = averaged / averaged.sum(-1, keepdim=True)
    finite = torch.isfinite(averaged).all(-1, keepdim=True)
    return torch.where(finite, averaged, p).to(probabilities.dtype)


class PredictiveScale:
    """The posterior predictive over ``κ · H P Hᵀ``, ``κ`` chosen online by the prequential log-loss of each.

    Before a step the scale with the least cumulative log-loss so far predicts (ties: the smaller, so the mean first);
    after it is scored, every scale's loss on the step's samples is added where all are finite (a prediction that is
    not finite adds nothing, as the online metrics leave it out; one whose update was then skipped counts). Every
    process of a DDP run sees the same gathered predictions and labels, so the choice is the same everywhere.
    """

    def __init__(self, kappas: tuple[float, ...] = KAPPAS) -> None:
        self.kappas = kappas
        self.losses = torch.zeros(len(kappas), dtype=torch.float64)

    @property
    def kappa(self) -> float:
        """The scale that predicts the next step."""
        return self.kappas[int(torch.argmin(self.losses))]  # the first of equal losses: the smallest scale

    def __call__(self, probabilities: Tensor, cov: Tensor, label: Tensor) -> Tensor:
        """The predictive with the chosen scale for ``probabilities`` ``(B, m)`` and their blocks ``cov`` ``(B, m, m)``.

        Then every scale's log-loss on ``label`` ``(B,)`` joins its total, if every one is finite.
        """
        candidates = torch.stack([mean_field_predictive(probabilities, kappa * cov) for kappa in self.kappas])
        chosen = candidates[int(torch.argmin(self.losses))]
        likelihood = candidates.to(torch.float64).gather(-1, label.view(1, -1, 1).expand(len(self.kappas), -1, 1))
        loss = -likelihood.clamp_min(torch.finfo(torch.float64).tiny).log().sum((1, 2)).cpu()
        if bool(torch.isfinite(loss).all()):
            self.losses += loss
        return chosen

    def state_dict(self) -> dict[str, Any]:
        """The scales and their losses so far (a resumed run chooses as an uninterrupted one)."""
        return {"kappas": list(self.kappas), "losses": self.losses.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (its scales must be these)."""
        if tuple(state["kappas"]) != tuple(self.kappas):
            raise ValueError(f"Invalid predictive state: scales {state['kappas']}, expected {list(self.kappas)}")
        self.losses = state["losses"].to(torch.float64).cpu().clone()
