r"""The mixture's arithmetic, pure functions on log probabilities: its experts and Bayes' weights with fixed share.

The experts of :class:`~loko_lightning.learner.mixture_step.MixtureStep` are built from two predictions, the learner's
probabilities :math:`p` and a frozen head's logits :math:`z`: :math:`z` tempered, :math:`\log\mathrm{softmax}(z /
T)` (:func:`tempered_log_probabilities`, the learner's :math:`\log p` the same way); the frozen head's argmax with its
past accuracy as its confidence (:func:`vote_log_probabilities`); the log-linear pools :math:`p^a \exp(z / T)`,
renormalised (:func:`pooled_log_probabilities`). The mixture predicts :math:`\sum_k w_k p_k(y \mid x)`
(:func:`mixture_log_predictive`) and, once the label is known, updates :math:`w_k \propto w_k p_k(y)` then
:math:`w \leftarrow (1 - \alpha) w + \alpha / K` (:func:`update_log_weights`; fixed share), or with :math:`\beta\,\bar
v` more, :math:`\bar v` the mean of the past posteriors (:func:`mix_past_posteriors`). With
``calibration``, the mixture's top-1 confidence is moved by the past gap between accuracy and confidence in its bin,
shrunk by a prior (:func:`recalibrated`, :func:`update_bins`).
Everything in log space but the recalibration; the callers keep it in float64 (docs/results/mixture.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


def tempered_log_probabilities(logits: Tensor, temperatures: Sequence[float]) -> Tensor:
    """``log softmax(logits / T)`` for each ``T``: ``(len(temperatures), B, m)`` from logits ``(B, m)``."""
    scale = torch.tensor(temperatures, dtype=logits.dtype, device=logits.device)
    return torch.log_softmax(logits[None] / scale[:, None, None], -1)


def pooled_log_probabilities(
    learner_log_probabilities: Tensor, logits: Tensor, powers: Sequence[float], temperatures: Sequence[float]
) -> Tensor:
    """Log-linear pools ``log softmax(a · log p + z / T)`` for each power ``a``, then each ``T``: ``(A·T, B, m)``.

    ``log p`` ``(B, m)``: the learner's log probabilities; ``z`` ``(B, m)``: the frozen head's logits. Each pool
    adds the two predictions' log evidence (a product of experts, renormalised): where the learner and the frozen
    head are each unsure but in different ways, the pool can be right and confident where both are not.
    """
    power = torch.tensor(powers, dtype=logits.dtype, device=logits.device)[:, None, None, None]
    scale = torch.tensor(temperatures, dtype=logits.dtype, device=logits.device)[None, :, None, None]
    pooled = power * learner_log_probabilities[None, None] + logits[None, None] / scale
    return torch.log_softmax(pooled, -1).reshape(-1, *logits.shape)


def vote_log_probabilities(predicted: Tensor, hits: Tensor, seen: Tensor, num_classes: int) -> Tensor:
    """A classifier's argmax as a calibrated forecast: ``c`` on ``predicted`` ``(B,)``, ``(1 − c)/(m − 1)`` elsewhere.

    ``c = (hits + 1) / (seen + 2)``, Laplace's rule on the classifier's past top-1 hits (prequential: from the samples
    before). Returns ``(B, m)`` log probabilities in ``hits``' dtype.
    """
    confidence = (hits + 1) / (seen + 2)
    rest = torch.log((1 - confidence) / (num_classes - 1))
    out = rest.expand(predicted.shape[0], num_classes).clone()
    return out.scatter_(1, predicted[:, None], torch.log(confidence).expand(predicted.shape[0], 1))


def mixture_log_predictive(log_weights: Tensor, log_probabilities: Tensor) -> Tensor:
    """``log Σ_k w_k p_k(y|x)`` ``(B, m)`` from normalised log weights ``(K,)`` and experts' ``(K, B, m)``."""
    return torch.logsumexp(log_weights[:, None, None] + log_probabilities, 0)


def update_log_weights(log_weights: Tensor, log_likelihoods: Tensor, share: float = 0.0) -> Tensor:
    """The normalised log weights after one scored sample: Bayes' ``w_k ∝ w_k p_k(y)``, then fixed share.

    Args:
        log_weights: ``(K,)`` normalised log weights before the sample.
        log_likelihoods: ``(K,)`` each expert's ``log p_k(y_t | x_t)``, from its prediction before the update.
        share: fixed share's ``α`` in ``[0, 1)``: ``w ← (1 − α) w + α / K`` (0: the plain Bayesian mixture).
    """
    posterior = log_weights + log_likelihoods
    posterior = posterior - torch.logsumexp(posterior, 0)
    if share:
        floor = torch.full_like(posterior, math.log(share / posterior.shape[0]))
        posterior = torch.logaddexp(posterior + math.log1p(-share), floor)
    return posterior


def mix_past_posteriors(
    posterior: Tensor, past: Tensor, count: Tensor | float, share_past: float, share: float = 0.0
) -> tuple[Tensor, Tensor]:
    """Mixing past posteriors (Bousquet & Warmuth 2002, the uniform past), with fixed share's floor beside it.

    ``w_{t+1} = (1 − α − β) v_t + α / K + β (v_0 + … + v_{t−1}) / t``: ``v_t`` the Bayes posterior after sample ``t``
    (:func:`update_log_weights` with no share), ``v_0`` the prior, ``β`` (``share_past``) the share that goes to the
    experts that held weight before, ``α`` (``share``) fixed share's, to every expert alike. Where fixed share alone
    gives every expert ``α / K`` whatever it ever did, ``β`` lets a leader of the past come back as fast while the
    experts that never led take almost none of the prediction.

    Args:
        posterior: ``(K,)`` the normalised log posterior ``v_t``.
        past: ``(K,)`` the log of the mean of ``v_0 … v_{t−1}`` (before the first sample: the log prior).
        count: ``t``, how many posteriors ``past`` averages (1 before the first sample).
        share_past: ``β ≥ 0``.
        share: ``α ≥ 0``, with ``α + β < 1``.

    Returns:
        The normalised log weights ``w_{t+1}`` and the log of the mean of ``v_0 … v_t``.
    """
    count = torch.as_tensor(count, dtype=posterior.dtype, device=posterior.device)
    updated = torch.logaddexp(past + torch.log(count / (count + 1)), posterior - torch.log(count + 1))
    terms = [posterior + math.log1p(-share - share_past)]
    if share:
        terms.append(torch.full_like(posterior, math.log(share / posterior.shape[0])))
    if share_past:
        terms.append(past + math.log(share_past))
    return torch.logsumexp(torch.stack(terms), 0), updated


def update_mixture_weights(
    log_weights: Tensor,
    log_likelihoods: Tensor,
    share: float,
    share_past: float = 0.0,
    past: Tensor | None = None,
    count: Tensor | float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """One scored sample's update of the mixture's weights: fixed share, or with ``share_past`` the past's share too.

    Without ``share_past`` (0): :func:`update_log_weights` with ``share``, and ``past`` returned as given. With it:
    the Bayes posterior (:func:`update_log_weights`, no share), then :func:`mix_past_posteriors` with ``past`` (the log
    mean of the ``count`` posteriors before) and ``share``. Returns the new log weights and the new ``past``.
    """
    if not share_past:
        return update_log_weights(log_weights, log_likelihoods, share), past
    if past is None or count is None:
        raise ValueError("share_past needs past (the log mean of the posteriors before) and count (how many)")
    posterior = update_log_weights(log_weights, log_likelihoods)
    return mix_past_posteriors(posterior, past, count, share_past, share)


def confidence_bins(probabilities: Tensor, bins: int) -> tuple[Tensor, Tensor]:
    """The top-1 confidences ``c`` ``(B,)`` and their bins: ``bins`` equal ones, ``c = 1`` its own (as the ECE's)."""
    confidence = probabilities.max(-1).values
    return confidence, torch.clamp((confidence * bins).floor().long(), max=bins)


def recalibrated(probabilities: Tensor, gaps: Tensor, counts: Tensor, strength: float) -> Tensor:
    r"""The probabilities ``(B, m)`` with each top-1 confidence moved by its bin's past gap, shrunk towards none.

    In bin :math:`b` of the top-1 confidence (:func:`confidence_bins`) the accuracy is modelled as the confidence plus
    a gap :math:`\delta_b \sim N(0, \tau^2)`; each past sample's hit minus its confidence observes :math:`\delta_b`
    with variance about :math:`\sigma^2 = c(1 - c)`. The posterior mean of the gap is :math:`g_b / (n_b + \kappa)`,
    :math:`g_b` the sum of those differences, :math:`n_b` their number and :math:`\kappa = \sigma^2 / \tau^2` the
    prior's strength in samples (``strength``): a bin moves where its past gap outweighs the noise of its samples
    (histogram binning with a Gaussian prior). The new confidence :math:`c' = c + g_b / (n_b + \kappa)` moves at most
    half way to a tie with the runner-up (the argmax stays: accuracy is unchanged) or to certainty (at most half the
    other classes' mass moves to the top); the other classes keep their ratios, scaled by :math:`(1 - c') / (1 - c)`.
    ``gaps``, ``counts``: ``(bins + 1,)``, from the samples before (:func:`update_bins`). A certain prediction
    (:math:`c = 1`) stays as it is.
    """
    confidence, index = confidence_bins(probabilities, gaps.shape[0] - 1)
    top = probabilities.topk(2, -1)
    runner = top.values[:, 1]
    rest = 1 - confidence
    moved = confidence + gaps[index] / (counts[index] + strength)
    tie = runner / (rest + runner).clamp_min(torch.finfo(probabilities.dtype).tiny)  # the runner-up would tie there
    moved = torch.minimum(torch.maximum(moved, (tie + confidence) / 2), (1 + confidence) / 2)
    certain = rest <= 0
    scale = torch.where(certain, torch.ones_like(rest), (1 - moved) / torch.where(certain, torch.ones_like(rest), rest))
    out = probabilities * scale[:, None]
    return out.scatter(1, top.indices[:, :1], torch.where(certain, confidence, moved)[:, None])


def update_bins(gaps: Tensor, counts: Tensor, probabilities: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """The bins' sums of hit minus confidence and counts ``(bins + 1,)`` after the predictions ``(B, m)``' labels."""
    confidence, index = confidence_bins(probabilities, gaps.shape[0] - 1)
    hits = (probabilities.argmax(-1) == labels).to(gaps.dtype)
    return gaps.index_add(0, index, hits - confidence.to(gaps.dtype)), counts.index_add(0, index, torch.ones_like(hits))
