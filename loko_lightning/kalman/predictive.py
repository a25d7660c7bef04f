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

Precision: :math:`C` carries the arithmetic's rounding (float32: about :math:`\epsilon |C|`), which :math:`A^{+}`
multiplies by up to :math:`1/\lambda_{\min}(A)^2`. Directions of :math:`A` with an eigenvalue below
:math:`\sqrt{\epsilon}\,\lambda_{\max}(A)` (classes of probability below about that) are cut: their logit variance is
not recoverable from :math:`C` at that precision and is taken as 0, which keeps those classes at the mean's
(conservative: never an invented uncertainty).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["PREDICTIVES", "mean_field_predictive", "sample_blocks"]

#: How a learner's scored probabilities are made: at the filter's mean (the paper), or averaged over its belief.
PREDICTIVES = ("mean", "posterior")

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
    values, vectors = torch.linalg.eigh(A)
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
