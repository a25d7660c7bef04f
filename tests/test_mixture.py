"""The mixture of the learner and streaming LDA on frozen features: its arithmetic against float64 products of
likelihoods, the prequential contract at the learner level (each sample scored before any part updates on it), and
the learner the user gets: an exact resume, ``predict`` and the serving learner predicting with the mixture."""

import math
from functools import partial

import lightning.pytorch as pl
import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from runs import loader, stream, trainer

from loko_lightning import LoKO
from loko_lightning.errors import ConfigError
from loko_lightning.learner.frozen_features import FrozenFeatures, passthrough
from loko_lightning.learner.frozen_heads import output_layer
from loko_lightning.learner.mixing import (
    mix_past_posteriors,
    mixture_log_predictive,
    pooled_log_probabilities,
    recalibrated,
    tempered_log_probabilities,
    update_bins,
    update_log_weights,
    vote_log_probabilities,
)
from loko_lightning.learner.mixture import FrozenHeadMixture
from loko_lightning.learner.mixture_step import MixtureStep
from loko_lightning.learner.module import OnlineClassifier
from loko_lightning.models import TimmClassifier
from loko_lightning.peers import FrozenLinearHead, NearestClassMean, StreamingLDA


def likelihoods(steps=60, experts=5, seed=0, dtype=torch.float64):
    """``(steps, K)`` log-likelihoods of the labels under ``K`` experts: softmaxes of random logits over 10 classes."""
    gen = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(steps, experts, 10, generator=gen, dtype=torch.float64)
    labels = torch.randint(10, (steps,), generator=gen)
    log_p = torch.log_softmax(logits, -1)[torch.arange(steps), :, labels]
    return log_p.to(dtype)


def run(log_likelihoods, prior, share=0.0):
    """The weights before every step and after the last, and the mixture's log-likelihood of each label."""
    log_weights = prior.log().to(log_likelihoods.dtype)
    before, scores = [], []
    for ll in log_likelihoods:
        before.append(log_weights.exp())
        scores.append(torch.logsumexp(log_weights + ll, 0))
        log_weights = update_log_weights(log_weights, ll, share)
    return torch.stack(before), log_weights.exp(), torch.stack(scores)


# ------------------------------------------------------------------ the arithmetic against float64 references
def test_bayes_weights_are_the_normalised_product_of_likelihoods():
    """w_k after t samples = π_k Π_{s<t} p_k(y_s) / Σ_j π_j Π_{s<t} p_j(y_s), computed directly in float64 (products of
    probabilities, no logarithm); the two float64 paths differ by rounding, a few ulps per step: 1e-12 relative."""
    ll = likelihoods()
    prior = torch.tensor([0.5, 0.2, 0.1, 0.1, 0.1], dtype=torch.float64)
    before, after, _ = run(ll, prior)
    for t in range(len(ll) + 1):
        product = prior * ll[:t].exp().prod(0)
        expected = product / product.sum()
        got = before[t] if t < len(ll) else after
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-300)


def test_the_mixtures_cumulative_log_loss_is_the_marginal_likelihood_and_within_log_k_of_the_best_expert():
    """Σ_t log p_mix(y_t) = log Σ_k π_k Π_t p_k(y_t) (Bayes' chain rule); with a uniform prior it is never more than
    log K below the best expert's: the bound the mixture is built on (docs/results/mixture.md)."""
    ll = likelihoods(steps=80, experts=4, seed=1)
    prior = torch.full((4,), 0.25, dtype=torch.float64)
    _, _, scores = run(ll, prior)
    marginal = torch.log((prior * ll.exp().prod(0)).sum())
    torch.testing.assert_close(scores.sum(), marginal, rtol=1e-12, atol=0)
    assert scores.sum() >= ll.sum(0).max() - math.log(4) - 1e-12


def test_fixed_share_is_the_dense_switching_recursion():
    """Fixed share against its dense float64 form: w ← M (w ⊙ p) / Σ(w ⊙ p), M = (1 − α) I + α/K 11ᵀ."""
    ll = likelihoods(steps=40, experts=3, seed=2)
    prior = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    alpha = 0.05
    before, after, _ = run(ll, prior, share=alpha)
    switching = (1 - alpha) * torch.eye(3, dtype=torch.float64) + alpha / 3
    w = prior.clone()
    for t in range(len(ll)):
        torch.testing.assert_close(before[t], w, rtol=1e-12, atol=0)
        posterior = w * ll[t].exp()
        w = switching @ (posterior / posterior.sum())
    torch.testing.assert_close(after, w, rtol=1e-12, atol=0)
    assert after.min() >= alpha / 3 - 1e-15  # the floor: no expert's weight ever vanishes


@pytest.mark.parametrize("alpha", [0.0, 0.002])
def test_mixing_past_posteriors_is_its_dense_recursion(alpha):
    """Mixing past posteriors against its float64 form in probabilities, every posterior kept: v_t = w_t ⊙ p_t / Σ,
    w_{t+1} = (1 − α − β) v_t + α / K + β (v_0 + … + v_{t−1}) / t, v_0 the prior; the log-space recursion keeps only
    the mean. The two float64 paths differ by rounding, a few ulps per step: 1e-12 relative; with no share, the
    posterior."""
    ll = likelihoods(steps=40, experts=3, seed=2)
    prior = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    beta = 0.05
    log_weights, past = prior.log(), prior.log()
    posteriors, w = [prior.clone()], prior.clone()
    for t, step in enumerate(ll, start=1):
        torch.testing.assert_close(log_weights.exp(), w, rtol=1e-12, atol=0)
        log_weights, past = mix_past_posteriors(update_log_weights(log_weights, step), past, t, beta, alpha)
        posterior = w * step.exp()
        posterior = posterior / posterior.sum()
        w = (1 - alpha - beta) * posterior + alpha / 3 + beta * torch.stack(posteriors).mean(0)
        posteriors.append(posterior)
        torch.testing.assert_close(past.exp(), torch.stack(posteriors).mean(0), rtol=1e-12, atol=0)
    torch.testing.assert_close(log_weights.exp(), w, rtol=1e-12, atol=0)
    torch.testing.assert_close(log_weights.exp().sum(), torch.ones((), dtype=torch.float64), rtol=1e-14, atol=0)
    no_share, _ = mix_past_posteriors(update_log_weights(prior.log(), ll[0]), prior.log(), 1, 0.0)
    torch.testing.assert_close(no_share, update_log_weights(prior.log(), ll[0]), rtol=0, atol=0)


def test_float32_weights_follow_the_float64_product():
    """The same 60 steps in float32: each step rounds the log weights (here |log w| < 50, checked) with a relative
    error of 2^-24 ≈ 6e-8, so after 60 steps a log weight is off by at most about 60 · 50 · 6e-8 ≈ 1.8e-4, a weight
    w by w · 1.8e-4 ≤ 1.8e-4, and the mixture's log-likelihood of a label as much: 2e-4 absolute holds that bound."""
    ll = likelihoods()
    prior = torch.full((5,), 0.2, dtype=torch.float64)
    log_weights, largest = prior.log(), 0.0
    for step in ll:
        log_weights = update_log_weights(log_weights, step)
        largest = max(largest, float(log_weights.abs().max()))
    assert largest < 50
    _, after64, scores64 = run(ll, prior)
    _, after32, scores32 = run(ll.float(), prior)
    torch.testing.assert_close(after32.double(), after64, rtol=0, atol=2e-4)
    torch.testing.assert_close(scores32.double(), scores64, rtol=0, atol=2e-4)


class SilentStep:
    """An inner step that logs nothing: the mixture's own logged values alone."""

    def logged(self, optimizer):
        return {}


def test_tempered_experts_and_the_predictive():
    """log softmax(z / T) for each T, and log Σ_k w_k p_k against the direct sum of probabilities (float64)."""
    gen = torch.Generator().manual_seed(3)
    logits = 5 * torch.randn(2, 4, generator=gen, dtype=torch.float64)
    tempered = tempered_log_probabilities(logits, [1.0, 3.0])
    for k, t in enumerate([1.0, 3.0]):
        torch.testing.assert_close(tempered[k], torch.log_softmax(logits / t, -1), rtol=1e-14, atol=0)
    weights = torch.tensor([0.3, 0.7], dtype=torch.float64)
    direct = (weights[:, None, None] * tempered.exp()).sum(0)
    torch.testing.assert_close(mixture_log_predictive(weights.log(), tempered).exp(), direct, rtol=1e-14, atol=0)


def test_the_learners_tempered_experts_follow_the_vote_and_share_its_prior():
    """With learner temperatures the experts are the learner, LDA at each T, the vote, then softmax(log p / T) of the
    learner's p at each of its T (float64); the prior is uniform over all of them, or, with prior_learner, that weight
    shared by the learner's experts; the logged learner weight is their sum."""
    gen = torch.Generator().manual_seed(5)
    step = MixtureStep(None, StreamingLDA, temperatures=[1.0, 8.0], learner_temperatures=[0.5, 0.8])
    step.head = torch.nn.Linear(4, 3, dtype=torch.float64)
    learner = torch.softmax(torch.randn(2, 3, generator=gen), -1)
    lda_logits = torch.randn(2, 3, generator=gen, dtype=torch.float64)
    experts = step.experts(learner, lda_logits)
    assert experts.shape == (6, 2, 3)
    log_p = learner.double().log()
    for k, t in zip((4, 5), (0.5, 0.8), strict=True):
        torch.testing.assert_close(experts[k].exp(), torch.softmax(log_p / t, -1), rtol=1e-12, atol=0)
    torch.testing.assert_close(experts[:3], MixtureStep(None, StreamingLDA, temperatures=[1.0, 8.0]).experts(
        learner, lda_logits)[:3], rtol=0, atol=0)  # fmt: skip
    torch.testing.assert_close(step.log_weights.exp(), torch.full((6,), 1 / 6, dtype=torch.float64))
    shared = MixtureStep(None, StreamingLDA, temperatures=[1.0, 8.0], prior_learner=0.6, learner_temperatures=[0.5])
    expected = torch.tensor([0.3, 0.4 / 3, 0.4 / 3, 0.4 / 3, 0.3], dtype=torch.float64)
    torch.testing.assert_close(shared.log_weights.exp(), expected, rtol=1e-14, atol=0)

    shared.inner = SilentStep()
    assert abs(float(shared.logged(None)["mixture/weight_learner"]) - 0.6) < 1e-7  # float32: its rounding


def test_the_pools_are_the_renormalised_products_and_come_last_among_the_other_experts():
    """A pool is softmax(a log p + z / T) of the learner's p and the frozen head's logits z, for each power a, then
    each T (float64, against the product p^a exp(z / T) normalised by its sum); the pools follow the learner's
    tempered experts, the prior is uniform over all, or with prior_learner the pools share the rest with LDA's; the
    logged pooled weight is their sum."""
    gen = torch.Generator().manual_seed(7)
    learner = torch.softmax(torch.randn(2, 3, generator=gen), -1)
    lda_logits = torch.randn(2, 3, generator=gen, dtype=torch.float64)
    log_p = learner.double().log()
    pools = pooled_log_probabilities(log_p, lda_logits, [0.5, 1.0], [1.0, 8.0])
    assert pools.shape == (4, 2, 3)
    for k, (a, t) in enumerate([(0.5, 1.0), (0.5, 8.0), (1.0, 1.0), (1.0, 8.0)]):
        product = learner.double() ** a * torch.exp(lda_logits / t)
        torch.testing.assert_close(pools[k].exp(), product / product.sum(-1, keepdim=True), rtol=1e-12, atol=0)
    step = MixtureStep(None, StreamingLDA, temperatures=[1.0, 8.0], learner_temperatures=[0.5], pools=[0.5, 1.0])
    experts = step.experts(learner, lda_logits)
    assert experts.shape == (9, 2, 3)
    torch.testing.assert_close(experts[5:], pools, rtol=0, atol=0)
    without = MixtureStep(None, StreamingLDA, temperatures=[1.0, 8.0], learner_temperatures=[0.5])
    torch.testing.assert_close(experts[:5], without.experts(learner, lda_logits), rtol=0, atol=0)
    torch.testing.assert_close(step.log_weights.exp(), torch.full((9,), 1 / 9, dtype=torch.float64))
    shared = MixtureStep(None, StreamingLDA, temperatures=[1.0, 8.0], prior_learner=0.6, pools=[1.0])
    expected = torch.tensor([0.6, 0.08, 0.08, 0.08, 0.08, 0.08], dtype=torch.float64)
    torch.testing.assert_close(shared.log_weights.exp(), expected, rtol=1e-14, atol=0)

    shared.inner = SilentStep()
    assert abs(float(shared.logged(None)["mixture/weight_pooled"]) - 0.16) < 1e-7  # float32: its rounding
    without.inner = SilentStep()
    assert "mixture/weight_pooled" not in without.logged(None)


def test_the_vote_is_laplaces_rule_on_the_argmax():
    """c = (hits + 1)/(seen + 2) on the predicted class, the rest shared equally: a distribution (float64)."""
    votes = vote_log_probabilities(
        torch.tensor([2, 0]), torch.tensor(3.0, dtype=torch.float64), torch.tensor(8.0, dtype=torch.float64), 4
    ).exp()
    c = 4 / 10
    expected = torch.tensor([[(1 - c) / 3] * 2 + [c] + [(1 - c) / 3], [c] + [(1 - c) / 3] * 3], dtype=torch.float64)
    torch.testing.assert_close(votes, expected, rtol=1e-14, atol=0)


def test_the_nearest_mean_experts_are_nearest_class_mean_on_ldas_statistics_and_come_last():
    """``StreamingLDA.nearest_mean()`` is the head NearestClassMean fits on the same samples (float64: the pooled
    variance from the scatter's trace rather than summed as it goes, rounding apart); the mixture's nearest-mean
    experts are its logits tempered at each of LDA's temperatures, after every other expert, with the prior shared
    with LDA's and a logged weight; without a sample the logits are 0 (the uniform prediction)."""
    gen = torch.Generator().manual_seed(9)
    y = torch.arange(40) % 3  # class 3 unseen
    x = torch.randn(40, 5, generator=gen, dtype=torch.float64) + 3 * torch.eye(5, dtype=torch.float64)[y]
    heads, layers = {}, {}
    for cls in (StreamingLDA, NearestClassMean):
        layers[cls] = layer = torch.nn.Linear(5, 4, dtype=torch.float64)
        heads[cls] = head = cls(layer.parameters())
        head.bind(layer.weight, layer.bias)
        assert head.nearest_mean() is None
        head.step(lambda: (x, y))
    ncm = layers[NearestClassMean]
    for ours, theirs in zip(heads[StreamingLDA].nearest_mean(), (ncm.weight, ncm.bias), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    step = MixtureStep(None, StreamingLDA, temperatures=[1.0, 8.0], pools=[1.0], nearest_mean=True)
    step.head = torch.nn.Linear(5, 4, dtype=torch.float64)
    assert torch.equal(step.nearest_logits(x[:2]), torch.zeros(2, 4, dtype=torch.float64))
    step.nearest = heads[StreamingLDA].nearest_mean()
    weight, bias = step.nearest
    nearest_logits = step.nearest_logits(x[:2])
    torch.testing.assert_close(nearest_logits, x[:2] @ weight.T + bias, rtol=1e-14, atol=1e-12)
    learner = torch.softmax(torch.randn(2, 4, generator=gen), -1)
    lda_logits = torch.randn(2, 4, generator=gen, dtype=torch.float64)
    experts = step.experts(learner, lda_logits, nearest_logits)
    assert experts.shape == (8, 2, 4) and step.nearest_experts == slice(6, 8)
    torch.testing.assert_close(experts[6:], tempered_log_probabilities(nearest_logits, [1.0, 8.0]), rtol=0, atol=0)
    without = MixtureStep(None, StreamingLDA, temperatures=[1.0, 8.0], pools=[1.0])
    torch.testing.assert_close(experts[:6], without.experts(learner, lda_logits), rtol=0, atol=0)
    with pytest.raises(ValueError, match="nearest_logits"):
        step.experts(learner, lda_logits)
    shared = MixtureStep(None, StreamingLDA, temperatures=[1.0, 8.0], prior_learner=0.5, nearest_mean=True)
    nearest_prior = shared.log_weights.exp()[shared.nearest_experts].sum()
    torch.testing.assert_close(nearest_prior, torch.tensor(0.2, dtype=torch.float64), rtol=1e-14, atol=0)

    shared.inner = SilentStep()
    assert abs(float(shared.logged(None)["mixture/weight_nearest"]) - 0.2) < 1e-7  # float32: its rounding


def reference_recalibrated(p, gaps, counts, strength, bins=15):
    """One prediction ``(m,)`` recalibrated, written from the rule: ``c + g_b / (n_b + κ)``, at most half way to a tie
    with the runner-up or to certainty, the other classes scaled."""
    c, top = float(p.max()), int(p.argmax())
    b = min(int(c * bins), bins)
    runner = float(p[torch.arange(len(p)) != top].max())
    tie = runner / (1 - c + runner)
    moved = min(max(c + gaps[b] / (counts[b] + strength), (c + tie) / 2), (1 + c) / 2)
    out = p * (1 - moved) / (1 - c)
    out[top] = moved
    return out


def test_the_recalibration_moves_the_top_confidence_by_its_bins_shrunk_past_gap():
    """Against the rule written per sample (float64, 1e-15: a few roundings of numbers below 1): a bin with past gaps
    moves its confidence by g_b / (n_b + κ) (up and down), within half the way to a tie or to certainty, the other
    classes keep their ratios, the rows sum to 1 and the argmax stays; an empty bin or κ = ∞ moves nothing; a certain
    prediction stays certain. ``update_bins`` adds each prediction's hit minus its confidence to its bin."""
    torch.manual_seed(0)
    p = torch.softmax(3 * torch.randn(200, 5, dtype=torch.float64), -1)
    labels = torch.randint(5, (200,))
    gaps, counts = update_bins(torch.zeros(16, dtype=torch.float64), torch.zeros(16, dtype=torch.float64), p, labels)
    confidence = p.max(-1).values
    bins = (confidence * 15).floor().long()
    for b in range(15):
        inside = bins == b
        hits = (p.argmax(-1) == labels)[inside].double()
        assert counts[b] == inside.sum() and math.isclose(
            gaps[b], float((hits - confidence[inside]).sum()), abs_tol=1e-12
        )
    gaps = counts * torch.linspace(-0.3, 0.3, 16, dtype=torch.float64)  # bins too confident and too shy, some clamped
    new = torch.softmax(3 * torch.randn(100, 5, dtype=torch.float64), -1)
    got = recalibrated(new, gaps, counts, 4.0)
    want = torch.stack([reference_recalibrated(q, gaps.tolist(), counts.tolist(), 4.0) for q in new])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-15)
    # Each row's sum rounds as 1 − c does: a few ulps of 1 over 1 − c (the other classes are scaled by 1 / (1 − c)).
    rest = 1 - new.max(-1).values
    assert ((got.sum(-1) - 1).abs() <= 4 * torch.finfo(torch.float64).eps / rest).all()
    assert torch.equal(got.argmax(-1), new.argmax(-1))
    moved = got.max(-1).values - new.max(-1).values
    assert (moved > 1e-3).any() and (moved < -1e-3).any()
    torch.testing.assert_close(recalibrated(new, gaps, counts, math.inf), new, rtol=0, atol=1e-16)
    empty = torch.zeros(16, dtype=torch.float64)
    torch.testing.assert_close(recalibrated(new, empty, empty, 4.0), new, rtol=0, atol=1e-16)
    certain = torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64)
    assert torch.equal(recalibrated(certain, gaps, counts, 4.0), certain)


def test_the_recalibration_brings_a_shy_forecasters_confidence_to_its_accuracy():
    """A forecaster whose top class is right with probability 0.75 but says 0.6 (underconfident): recalibrated one
    sample after the other with κ = 30, its confidence over the last 1,000 of 3,000 samples is within 0.03 of 0.75
    (the bin's posterior mean after ~2,000 samples: 0.15 · 2000 / 2030 = 0.148 of the 0.15 gap, plus the sampling
    noise of the gap's estimate, sd 0.01: 3 sd), where it said 0.6 (0.75 is below the clamp half way to certainty,
    0.8)."""
    generator = torch.Generator().manual_seed(0)
    predictions = torch.tensor([0.6, 0.2, 0.2], dtype=torch.float64).repeat(3000, 1)
    labels = torch.where(
        torch.rand(3000, generator=generator) < 0.75, 0, torch.randint(1, 3, (3000,), generator=generator)
    )
    gaps, counts = torch.zeros(16, dtype=torch.float64), torch.zeros(16, dtype=torch.float64)
    said = []
    for p, label in zip(predictions, labels, strict=True):
        said.append(float(recalibrated(p[None], gaps, counts, 30.0)[0, 0]))
        gaps, counts = update_bins(gaps, counts, p[None], label[None])
    assert abs(sum(said[-1000:]) / 1000 - 0.75) < 0.03 and said[0] == 0.6


def test_the_nearest_vote_is_nearest_class_means_argmax_confident_by_its_own_hits_and_comes_last():
    """With ``nearest_vote`` the last expert is nearest class mean's argmax with Laplace's rule on its hits (not
    LDA's: LDA's vote keeps its own), one more expert among the nearest mean's (prior and logged weight)."""
    step = MixtureStep(None, StreamingLDA, temperatures=[1.0, 8.0], nearest_mean=True, nearest_vote=True)
    step.hits, step.nearest_hits, step.seen = (torch.tensor(v, dtype=torch.float64) for v in (0.0, 2.0, 3.0))
    learner = torch.full((1, 3), 1 / 3)
    lda_logits = torch.tensor([[2.0, 0.0, 0.0]], dtype=torch.float64)
    nearest_logits = torch.tensor([[0.0, 0.0, 5.0]], dtype=torch.float64)
    experts = step.experts(learner, lda_logits, nearest_logits)
    assert experts.shape == (7, 1, 3) and step.nearest_experts == slice(4, 7)
    # LDA's vote on class 0 with 0 hits in 3: (0 + 1) / (3 + 2); the nearest mean's on class 2 with 2 hits: 3 / 5.
    want = {3: [1 / 5, 2 / 5, 2 / 5], 6: [1 / 5, 1 / 5, 3 / 5]}
    for row, probabilities in want.items():
        expected = torch.tensor(probabilities, dtype=torch.float64)
        torch.testing.assert_close(experts[row, 0].exp(), expected, rtol=1e-15, atol=0)  # exp of a log: an ulp
    assert len(step.log_weights) == 7 and not MixtureStep(None, StreamingLDA, nearest_vote=True).nearest_vote


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperatures": [1.0, 0.0]}, "temperatures"),
        ({"share": 1.0}, "share"),
        ({"prior_learner": 1.0}, "prior"),
        ({"learner_temperatures": [0.5, -1.0]}, "learner_temperatures"),
        ({"pools": [0.5, 0.0]}, "pools"),
        ({"head": FrozenLinearHead, "nearest_mean": True}, "nearest_mean"),
        ({"share_past": -0.01}, "share_past"),
        ({"share": 0.5, "share_past": 0.5}, "share_past"),
        ({"nearest_vote": True}, "nearest_vote"),  # without nearest_mean
        ({"calibration": -1.0}, "calibration"),
        ({"calibration": math.inf}, "calibration"),
    ],
)
def test_bad_arguments_are_refused(kwargs, field):
    kwargs = {"head": StreamingLDA, **kwargs}
    with pytest.raises(ConfigError, match=field) as raised:
        FrozenHeadMixture(**kwargs)
    assert raised.value.field.startswith(field)


# ------------------------------------------------------------------ the learner
TEMPERATURES = (1.0, 4.0)
SHARE = 0.05


def learner(mixture=None, average=0.0, **kwargs):
    torch.manual_seed(0)
    factory = TimmClassifier("test_resnet", num_classes=3, pretrained=False, r=2)
    return OnlineClassifier(factory, partial(LoKO, p0=0.1, seed=0, average=average), mixture=mixture, **kwargs)


def scored(module, monkeypatch):
    predictions = []
    log_online = module._log_online
    monkeypatch.setattr(
        module, "_log_online", lambda p, *args: (predictions.append(p.detach().double()), log_online(p, *args))
    )
    return predictions


def initial_features(module, items, batched=False):
    """The features the output layer reads with the initial adapters (LoRA's B = 0: the pretrained network), float64;
    one sample at a time as the stream has them, or ``batched`` in one forward pass as ``predict`` has them (the
    features' float32 rounding depends on the batch: up to 1.8e-7 apart for these three, torch 2.6 and 2.14 alike)."""
    captured = []
    hook = output_layer(module.network, 3).register_forward_hook(lambda _, a, __: captured.append(a[0].double()))
    module.network.eval()
    with torch.no_grad():
        if batched:
            module.network(torch.stack([item["inputs"] for item in items]))
        for item in [] if batched else items:
            module.network(item["inputs"][None])
    hook.remove()
    module.train()  # the learner's train() keeps the normalisation layers in eval mode
    return torch.cat(captured)


def reference_lda_logits(x, y, z, shrinkage=0.1):
    """Float64 batch LDA of ``(x, y)`` (zero mean for an unseen class; (1 − ε)Σ + εI): its logits on ``z``."""
    means = torch.zeros(3, x.shape[1], dtype=torch.float64)
    for k in range(3):
        if (y == k).any():
            means[k] = x[y == k].mean(0)
    residuals = x - means[y]
    covariance = residuals.T @ residuals / max(len(x), 1)
    precision = torch.linalg.inv((1 - shrinkage) * covariance + shrinkage * torch.eye(x.shape[1], dtype=x.dtype))
    weight = means @ precision
    return z @ weight.T - 0.5 * (weight * means).sum(-1)


def tempered(logits):
    return torch.stack([torch.log_softmax(logits / t, -1) for t in TEMPERATURES])


def test_the_frozen_features_are_peft_disable_adapters_and_leave_the_network_as_it_was():
    """The features read once the adapters are found equal those peft's own ``disable_adapter()`` context gives (the
    same forward pass: exactly), and after the call every module's mode, every parameter's ``requires_grad`` and the
    adapted network's output are as before."""
    network = TimmClassifier("test_resnet", num_classes=3, pretrained=False, r=2)()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in network.named_parameters():
            if "lora_B" in name:
                param.normal_()  # adapters that change the output
    inputs = torch.randn(2, 3, 32, 32)
    heads = [m for m in network.modules() if isinstance(m, torch.nn.Linear) and m.out_features == 3]
    captured = []
    hooks = [head.register_forward_hook(lambda _, a, __: captured.append(a[0])) for head in heads]
    network.eval()
    with torch.no_grad():
        adapted = network(inputs)
        with network.disable_adapter():  # peft's context: the pretrained network, its original head
            network(inputs)
    for hook in hooks:
        hook.remove()
    network.train()
    modes = [m.training for m in network.modules()]
    grads = {name: p.requires_grad for name, p in network.named_parameters()}
    features = FrozenFeatures(network, 3)
    assert features.adapters and len(features.layers) == 2  # the adapted head and peft's copy of the original
    frozen = features(inputs)
    assert torch.equal(frozen, captured[-1]) and not torch.equal(frozen, captured[0])
    assert [m.training for m in network.modules()] == modes
    assert {name: p.requires_grad for name, p in network.named_parameters()} == grads
    network.eval()
    with torch.no_grad():
        assert torch.equal(network(inputs), adapted)


def test_the_frozen_features_put_every_adapter_layer_back_even_on_an_error_and_unmerge_merged_adapters():
    """The frozen pass replaces each adapter layer by its base for the call: after a forward pass that raises, every
    module is where it was (the same objects). Adapters merged into their base layers are not swapped (the base
    layer then holds them) but switched off by peft, which unmerges them: the features are those of the unmerged
    network."""
    network = TimmClassifier("test_resnet", num_classes=3, pretrained=False, r=2)()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in network.named_parameters():
            if "lora_B" in name:
                param.normal_()
    features = FrozenFeatures(network, 3)
    before = [(name, id(module)) for name, module in network.named_modules()]
    with pytest.raises(RuntimeError):
        features(torch.randn(2, 5, 32, 32))  # 5 channels: the stem's convolution fails inside the frozen pass
    assert [(name, id(module)) for name, module in network.named_modules()] == before
    inputs = torch.randn(2, 3, 32, 32)
    frozen = features(inputs)
    lora = [m for m in network.modules() if isinstance(m, BaseTunerLayer) and hasattr(m, "lora_A")]
    for layer in lora:
        layer.merge()
    merged_features = FrozenFeatures(network, 3)
    assert all(layer.merged for layer in lora) and all(passthrough(layer) is None for layer in lora)
    # float32 merge then unmerge rounds each base weight (W + ΔW - ΔW): the features agree to float32 rounding of
    # the network's sums; the adapters move the outputs by far more (the adapted network's are not the frozen ones)
    torch.testing.assert_close(merged_features(inputs), frozen, rtol=1e-4, atol=1e-5)
    assert not any(layer.merged for layer in lora)  # peft's switch left them unmerged, as its own context does


def reference_nearest_logits(x, y, z):
    """Float64 batch nearest class mean of ``(x, y)`` (zero mean for an unseen class; σ² the pooled within-class
    variance per feature, 1 while it is 0): its logits on ``z``."""
    means = torch.zeros(3, z.shape[-1], dtype=torch.float64)
    for k in range(3):
        if (y == k).any():
            means[k] = x[y == k].mean(0)
    variance = float((x - means[y]).square().sum()) / max(len(x), 1) / z.shape[-1]
    variance = variance if variance > 0 else 1.0
    return (z @ means.T - 0.5 * means.square().sum(-1)) / variance


@pytest.mark.parametrize(
    ("pools", "nearest", "average", "share_past", "nearest_vote", "calibration"),
    [([], False, 0.0, 0.0, False, 0.0), ([0.5, 1.0], False, 0.0, 0.0, False, 0.0), ([], True, 0.0, 0.0, False, 0.0),
     ([], False, 0.9, 0.0, False, 0.0), ([0.5, 1.0], True, 0.9, 0.1, False, 0.0), ([], True, 0.0, 0.1, True, 0.0),
     ([0.5, 1.0], True, 0.0, 0.1, False, 0.5)],
)  # fmt: skip
def test_the_learner_scores_the_mixture_made_before_the_sample(
    monkeypatch, one_thread, pools, nearest, average, share_past, nearest_vote, calibration
):
    """Through trainer.fit: the prediction scored for sample i is Σ_k w_k p_k(y | x_i) with LoKO's prediction before
    its update on i (that of a plain LoKO learner on the same stream: the mixture does not change LoKO's path), LDA
    fitted in float64 on samples 0..i-1 of the pretrained features (at each temperature, and its argmax voted with
    its hits on 0..i-1), and the weights of the float64 product of the experts' likelihoods of labels 0..i-1 (fixed
    share), with the pools softmax(a log p + z / T), then nearest class mean at each temperature. The network and
    features are float32 (d = 64 sums): a probability within 1e-4 of the float64 reference, as in the frozen-heads
    test; predicting with sample i included (LDA and the weights) moves the prediction by far more (asserted, so the
    test can fail). With LoKO's average its prediction and the features come from one pass of the sample twice over
    (``FrozenFeatures.with_adapted``): the same float32 sums in another order. With ``share_past`` a share goes to
    the mean of the past posteriors too, every posterior kept in the reference. With ``nearest_vote`` nearest class
    mean's argmax is the last expert, voted with its hits on 0..i-1 as LDA's. With ``calibration`` the score is the
    mixture's recalibrated by the gaps of its own predictions of samples 0..i-1 in their bins (the reference's); κ =
    0.5 moves it by more than the tolerance on these 14 samples (asserted)."""
    items = stream(14, num_classes=3, seed=4)
    labels = torch.stack([item["label"] for item in items])
    plain = learner(average=average)
    plain_scored = scored(plain, monkeypatch)
    trainer().fit(plain, loader(items))
    head = partial(StreamingLDA, shrinkage=0.1)
    mixture = FrozenHeadMixture(
        head, list(TEMPERATURES), SHARE, vote=True, pools=pools, nearest_mean=nearest, share_past=share_past,
        nearest_vote=nearest_vote, calibration=calibration,
    )  # fmt: skip
    module = learner(mixture, average=average)
    features = initial_features(module, items)
    mixed = scored(module, monkeypatch)
    trainer().fit(module, loader(items))
    assert isinstance(module.online_step, MixtureStep)
    assert len(mixed) == len(plain_scored) == 14
    for name, param in plain.network.named_parameters():  # LoKO's path is its own
        torch.testing.assert_close(param, module.network.get_parameter(name), rtol=0, atol=0)
    experts = 2 + len(TEMPERATURES) + len(pools) * len(TEMPERATURES) + nearest * len(TEMPERATURES) + nearest_vote

    def laplace_vote(logits, hits, seen):  # the argmax, confident by Laplace's rule on the past hits
        c = (hits + 1) / (seen + 2)
        vote = torch.full((3,), (1 - c) / 2, dtype=torch.float64)
        vote[logits.argmax()] = c
        return vote

    def reference_experts(log_learner, logits, vote, upto):  # (K, m) in the learner's order
        pooled = [torch.log_softmax(a * log_learner + logits / t, -1) for a in pools for t in TEMPERATURES]
        near = reference_nearest_logits(features[:upto], labels[:upto], features[i])
        means = tempered(near) if nearest else []
        near_vote = [laplace_vote(near, near_hits, i).log()] if nearest_vote else []
        return torch.stack([log_learner, *tempered(logits), vote.log(), *pooled, *means, *near_vote])

    prior = torch.full((experts,), 1 / experts, dtype=torch.float64)
    switching = (1 - SHARE) * torch.eye(experts, dtype=torch.float64) + SHARE / experts
    weights, hits, near_hits, lookahead_gap, posteriors = prior.clone(), 0, 0, 0.0, [prior.clone()]
    gaps, counts, recalibration_moved = [0.0] * 16, [0.0] * 16, 0.0

    def calibrated(mixture):  # the score: the mixture recalibrated by the bins of the past predictions
        return reference_recalibrated(mixture, gaps, counts, calibration) if calibration else mixture

    for i in range(14):
        logits = reference_lda_logits(features[:i], labels[:i], features[i])
        vote = laplace_vote(logits, hits, i)
        log_p = reference_experts(plain_scored[i][0].clamp_min(1e-300).log(), logits, vote, i)
        mixture = (weights[:, None] * log_p.exp()).sum(0)
        expected = calibrated(mixture)
        torch.testing.assert_close(mixed[i][0], expected, rtol=0, atol=1e-4)
        recalibration_moved = max(recalibration_moved, float((expected - mixture).abs().max()))
        bin_of = min(int(float(mixture.max()) * 15), 15)
        gaps[bin_of] += float(mixture.argmax() == labels[i]) - float(mixture.max())
        counts[bin_of] += 1
        posterior = weights * log_p[:, labels[i]].exp()
        posterior = posterior / posterior.sum()
        if share_past:
            mean = torch.stack(posteriors).mean(0)
            weights = (1 - SHARE - share_past) * posterior + SHARE / experts + share_past * mean
            posteriors.append(posterior)
        else:
            weights = switching @ posterior
        hits += int(logits.argmax() == labels[i])
        near_hits += int(reference_nearest_logits(features[:i], labels[:i], features[i]).argmax() == labels[i])
        ahead_logits = reference_lda_logits(features[: i + 1], labels[: i + 1], features[i])
        ahead = reference_experts(log_p[0], ahead_logits, vote, i + 1)
        lookahead = calibrated((weights[:, None] * ahead.exp()).sum(0))
        lookahead_gap = max(lookahead_gap, float((mixed[i][0] - lookahead).abs().max()))
    assert lookahead_gap > 1e-2
    assert (recalibration_moved > 1e-3) == bool(calibration)


def mixed_learner(share_past=0.0, nearest_vote=False, calibration=0.0, **kwargs):
    head = partial(StreamingLDA, shrinkage=0.1)
    mixture = FrozenHeadMixture(
        head, temperatures=[1.0, 4.0], share=0.05, nearest_mean=True, share_past=share_past, nearest_vote=nearest_vote,
        calibration=calibration,
    )  # fmt: skip
    return learner(mixture, **kwargs)


def mixture_state(module):
    step = module.online_step
    nearest = dict(zip(("nearest_weight", "nearest_bias"), step.nearest, strict=True))
    past = {} if step.past is None else {"past": step.past}
    bins = {} if step.bin_gaps is None else {"bin_gaps": step.bin_gaps, "bin_counts": step.bin_counts}
    state = {"log_weights": step.log_weights, "hits": step.hits, "seen": step.seen, "nearest_hits": step.nearest_hits}
    state.update(zip(("lda_weight", "lda_bias"), step.lda.current().dense(), strict=True))  # LDA's head as it stands
    return {**state, **nearest, **past, **bins}


@pytest.mark.parametrize(
    ("share_past", "nearest_vote", "calibration"),
    [(0.0, False, 0.0), (0.1, False, 0.0), (0.1, True, 0.0), (0.0, False, 2.0)],
)
def test_a_fit_resumed_with_the_mixture_continues_exactly(
    tmp_path, one_thread, monkeypatch, share_past, nearest_vote, calibration
):
    """8 samples in one fit, or 4, a checkpoint, and 4 more resumed from it: the same predictions scored for the last
    4 (bit for bit: the same float operations in the same order), the same mixture weights (and past posteriors'
    mean, nearest class mean's hits, the recalibration's bins), LDA head and network."""
    items = stream(8, num_classes=3, seed=5)
    whole = mixed_learner(share_past, nearest_vote, calibration)
    whole_scored = scored(whole, monkeypatch)
    trainer(max_epochs=1).fit(whole, loader(items))
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
    first = mixed_learner(share_past, nearest_vote, calibration)
    trainer(enable_checkpointing=True, callbacks=[checkpoint], max_epochs=1).fit(first, loader(items[:4]))
    resumed = mixed_learner(share_past, nearest_vote, calibration)
    resumed_scored = scored(resumed, monkeypatch)
    trainer(max_epochs=2).fit(resumed, loader(items[4:]), ckpt_path=str(tmp_path / "last.ckpt"))
    assert len(resumed_scored) == 4
    for ours, theirs in zip(resumed_scored, whole_scored[4:], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    for key, value in mixture_state(whole).items():
        torch.testing.assert_close(mixture_state(resumed)[key], value, rtol=0, atol=0)
    for name, param in whole.network.named_parameters():
        torch.testing.assert_close(resumed.network.get_parameter(name), param, rtol=0, atol=0)
    # The resumed mixture is not a fresh one: its weights moved from the prior.
    assert not torch.equal(mixture_state(resumed)["log_weights"], mixed_learner().online_step.log_weights)
    assert ("past" in mixture_state(resumed)) == bool(share_past)
    assert ("bin_counts" in mixture_state(resumed)) == bool(calibration)
    if calibration:  # the bins hold the 8 samples, not only the 4 resumed ones
        assert float(mixture_state(resumed)["bin_counts"].sum()) == 8


def test_a_fixed_share_checkpoint_is_not_resumed_with_the_past_posteriors(tmp_path, one_thread):
    items = stream(4, num_classes=3, seed=5)
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer(enable_checkpointing=True, callbacks=[checkpoint], max_epochs=1).fit(mixed_learner(), loader(items))
    with pytest.raises(ConfigError, match="without share_past") as raised:
        trainer(max_epochs=2).fit(mixed_learner(0.1), loader(items), ckpt_path=str(tmp_path / "last.ckpt"))
    assert raised.value.field == "share_past"


def test_a_checkpoint_without_the_nearest_vote_is_not_resumed_with_it(tmp_path, one_thread):
    items = stream(4, num_classes=3, seed=5)
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer(enable_checkpointing=True, callbacks=[checkpoint], max_epochs=1).fit(mixed_learner(), loader(items))
    with pytest.raises(ConfigError, match="without nearest_vote") as raised:
        trainer(max_epochs=2).fit(mixed_learner(0.0, True), loader(items), ckpt_path=str(tmp_path / "last.ckpt"))
    assert raised.value.field == "nearest_vote"


def test_a_checkpoint_without_the_calibration_is_not_resumed_with_it(tmp_path, one_thread):
    items = stream(4, num_classes=3, seed=5)
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer(enable_checkpointing=True, callbacks=[checkpoint], max_epochs=1).fit(mixed_learner(), loader(items))
    with pytest.raises(ConfigError, match="without calibration") as raised:
        trainer(max_epochs=2).fit(
            mixed_learner(calibration=300.0), loader(items), ckpt_path=str(tmp_path / "last.ckpt")
        )
    assert raised.value.field == "calibration"


def test_a_checkpoint_fitted_without_the_mixture_is_not_resumed_with_it(tmp_path, one_thread):
    items = stream(4, num_classes=3, seed=5)
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer(enable_checkpointing=True, callbacks=[checkpoint], max_epochs=1).fit(learner(), loader(items))
    with pytest.raises(ConfigError, match="fitted without the mixture"):
        trainer(max_epochs=2).fit(mixed_learner(), loader(items), ckpt_path=str(tmp_path / "last.ckpt"))


def test_predict_and_the_loaded_learner_predict_with_the_mixture(tmp_path, one_thread):
    """After a fit, ``predict_step`` is the mixture of the network's softmax and LDA's experts with the weights as
    they stand (float32 of the float64 mixture); the learner loaded from the checkpoint rebuilds the mixture from its
    hyperparameters and predicts the same, bit for bit; the network alone predicts otherwise (the test can fail)."""
    items = stream(10, num_classes=3, seed=6)
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
    module = mixed_learner()
    trainer(enable_checkpointing=True, callbacks=[checkpoint], max_epochs=1).fit(module, loader(items))
    batch = {"inputs": torch.stack([item["inputs"] for item in items[:3]])}
    module.eval()
    with torch.no_grad():
        predicted = module.predict_step(batch, 0)["probabilities"]
        step = module.online_step
        features = initial_features(learner(), items[:3], batched=True)  # the pretrained network's (LoRA's B = 0)
        learner_p = module.network(batch["inputs"]).float().softmax(-1)
        experts = step.experts(learner_p, step.lda_logits(features), step.nearest_logits(features))
        expected = mixture_log_predictive(step.log_weights, experts).exp().float()
    torch.testing.assert_close(predicted, expected, rtol=0, atol=0)
    assert (predicted - learner_p).abs().max() > 1e-3
    loaded = OnlineClassifier.load_from_checkpoint(str(tmp_path / "last.ckpt")).eval()
    assert isinstance(loaded.online_step, MixtureStep) and loaded.hparams["mixture"]["share"] == 0.05
    with torch.no_grad():
        torch.testing.assert_close(loaded.predict_step(batch, 0)["probabilities"], predicted, rtol=0, atol=0)


def test_the_serving_learner_predicts_with_the_mixture_and_learns_it(tmp_path, one_thread):
    """A served mixture checkpoint predicts what the loaded learner predicts; learning a sample moves its weights and
    LDA, and the next prediction is the mixture's after that sample (the serving copy follows the learning one)."""
    from loko_lightning.serve.learner import ServingLearner

    items = stream(10, num_classes=3, seed=7)
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer(enable_checkpointing=True, callbacks=[checkpoint], max_epochs=1).fit(mixed_learner(), loader(items[:6]))
    path = str(tmp_path / "last.ckpt")
    served = ServingLearner.from_checkpoint(path)
    loaded = OnlineClassifier.load_from_checkpoint(path).eval()
    inputs = [item["inputs"] for item in items[6:9]]
    with torch.no_grad():
        expected = loaded.predict_step({"inputs": torch.stack(inputs)}, 0)["probabilities"]
    torch.testing.assert_close(served.predict(inputs), expected, rtol=0, atol=0)
    before = served.module.online_step.log_weights.clone()
    served.learn([items[9]["inputs"]], [int(items[9]["label"])])
    learning = served.module.online_step
    assert not torch.equal(learning.log_weights, before) and int(learning.seen) == 7
    serving = served._serving.online_step
    torch.testing.assert_close(serving.log_weights, learning.log_weights, rtol=0, atol=0)
    for ours, theirs in zip(serving.lda.current(), learning.lda.current(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    for ours, theirs in zip(serving.nearest, learning.nearest, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    # Saved and read back: the mixture's state travels with the serving checkpoint.
    served.save(tmp_path / "served.ckpt")
    again = ServingLearner.from_checkpoint(tmp_path / "served.ckpt")
    torch.testing.assert_close(again.predict(inputs), served.predict(inputs), rtol=0, atol=0)


def test_predict_and_the_served_learner_predict_with_the_recalibrated_mixture(tmp_path, one_thread):
    """With ``calibration``, ``predict_step`` is the mixture's prediction recalibrated by the bins as they stand (not
    the mixture's own: the test can fail), the loaded learner predicts the same bit for bit, and a served learner that
    learns a sample adds it to its bins, which its serving copy follows."""
    from loko_lightning.serve.learner import ServingLearner

    items = stream(18, num_classes=3, seed=6)
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
    module = mixed_learner(calibration=0.5)
    trainer(enable_checkpointing=True, callbacks=[checkpoint], max_epochs=1).fit(module, loader(items[:16]))
    batch = {"inputs": torch.stack([item["inputs"] for item in items[16:]])}
    module.eval()
    with torch.no_grad():
        predicted = module.predict_step(batch, 0)["probabilities"]
        step = module.online_step
        features = initial_features(learner(), items[16:], batched=True)
        learner_p = module.network(batch["inputs"]).float().softmax(-1)
        experts = step.experts(learner_p, step.lda_logits(features), step.nearest_logits(features))
        mixture = mixture_log_predictive(step.log_weights, experts).exp()
        expected = recalibrated(mixture, step.bin_gaps, step.bin_counts, 0.5).float()
    torch.testing.assert_close(predicted, expected, rtol=0, atol=0)
    assert (predicted - mixture.float()).abs().max() > 1e-3
    path = str(tmp_path / "last.ckpt")
    loaded = OnlineClassifier.load_from_checkpoint(path).eval()
    assert loaded.hparams["mixture"]["calibration"] == 0.5
    with torch.no_grad():
        torch.testing.assert_close(loaded.predict_step(batch, 0)["probabilities"], predicted, rtol=0, atol=0)
    served = ServingLearner.from_checkpoint(path)
    assert float(served.module.online_step.bin_counts.sum()) == 16
    served.learn([items[16]["inputs"]], [int(items[16]["label"])])
    learning, serving = served.module.online_step, served._serving.online_step
    assert float(learning.bin_counts.sum()) == 17
    torch.testing.assert_close(serving.bin_gaps, learning.bin_gaps, rtol=0, atol=0)
    torch.testing.assert_close(serving.bin_counts, learning.bin_counts, rtol=0, atol=0)


def test_the_mixtures_head_must_be_a_plain_frozen_head():
    with pytest.raises(ConfigError, match="head"):
        FrozenHeadMixture(lambda params: StreamingLDA(params))
    with pytest.raises(ConfigError, match="not a frozen head"):
        FrozenHeadMixture.from_spec({"head": {"class_path": "os.system"}})
    spec = mixed_learner().hparams["mixture"]
    head = {"class_path": "loko_lightning.peers.frozen_heads.StreamingLDA", "init_args": {"shrinkage": 0.1}}
    assert spec["head"] == head
    assert FrozenHeadMixture.from_spec(spec).spec() == spec


def test_an_export_says_the_mixture_is_not_in_it(tmp_path, monkeypatch):
    """The export's file says the mixture is not in it, and the export warns so (its ``warnings.warn`` calls recorded
    directly: in some orders of the whole suite ``pytest.warns`` saw no warning from this call, cause not found)."""
    from loko_lightning.learner import export as exporting
    from loko_lightning.learner.export import MIXTURE_NOT_EXPORTED, export, read_export

    warned = []
    monkeypatch.setattr(exporting.warnings, "warn", lambda message, *args, **kwargs: warned.append(str(message)))
    export(mixed_learner(), tmp_path / "mixed")
    assert read_export(tmp_path / "mixed")["mixture"] == MIXTURE_NOT_EXPORTED
    assert any("network alone" in message for message in warned)
    warned.clear()
    export(learner(), tmp_path / "plain")
    assert "mixture" not in read_export(tmp_path / "plain")
    assert not any("network alone" in message for message in warned)


def test_a_text_model_predicts_and_learns_with_the_mixture_on_its_sentence_embedding(tmp_path, one_thread):
    """A tiny BERT with a real tokenizer and the mixture (what the text default runs): the served learner predicts
    texts and text pairs as the mixture of the network's softmax and LDA's experts on the frozen sentence embedding,
    with the weights as they stand; each learned text moves the weights and LDA's counts."""
    from text_helpers import tiny_bert_dir

    from loko_lightning.learner.frozen_features import frozen_features
    from loko_lightning.models import TransformersClassifier
    from loko_lightning.serve.learner import ServingLearner

    torch.manual_seed(0)
    factory = TransformersClassifier(str(tiny_bert_dir(tmp_path / "bert")), num_classes=2, pretrained=True)
    mixture = FrozenHeadMixture(partial(StreamingLDA, shrinkage=0.1), temperatures=[1.0, 4.0], share=0.05)
    module = OnlineClassifier(factory, partial(LoKO, p0=0.1, seed=0), mixture=mixture)
    served = ServingLearner(module, LoKO(module.trainable_parameters, p0=0.1, seed=0))
    prior = served.module.online_step.log_weights.clone()
    for text, label in (("an awful ending", 0), ("a wonderful cast", 1), ("dull and slow", 0)):
        served.learn([text], [label])
    step = served.module.online_step
    assert isinstance(step, MixtureStep) and int(step.seen) == 3 and not torch.equal(step.log_weights, prior)
    texts = ["a great film", ["a plot", "that works"], "bad"]
    predicted = served.predict(texts)
    copy = served._serving
    batch = served.batch(texts)
    with torch.no_grad():
        copy.eval()
        features = frozen_features(copy.network, batch, 2)
        network_p = copy.network(batch).float().softmax(-1)
        experts = step.experts(network_p, step.lda_logits(features))
        expected = mixture_log_predictive(step.log_weights, experts).exp().float()
    torch.testing.assert_close(predicted, expected, rtol=0, atol=0)
    assert features.shape[0] == 3 and step.head.in_features == features.shape[1]  # LDA reads the embedding
    assert (predicted - network_p).abs().max() > 1e-4  # the mixture, not the network alone (the test can fail)


def test_the_joint_pass_is_the_adapted_and_the_frozen_pass_and_leaves_the_network_as_it_was():
    """``with_adapted``: one forward pass of the samples twice over gives the adapted network's outputs and the frozen
    features. In float64 the two ways differ only by the summation order of a batch of 4 against 2 (relative error
    ~1e-16 per sum, a few hundred terms through a dozen layers: far below 1e-10), while the adapters move the outputs
    by order 1 (asserted, so the test can fail). Every module is in place and in its mode after it. Merged adapters
    (no passthrough) take the two passes: then exactly their values."""
    network = TimmClassifier("test_resnet", num_classes=3, pretrained=False, r=2)().double()
    torch.manual_seed(0)
    with torch.no_grad():
        for param in network.parameters():
            if param.requires_grad:  # adapters and the new head that change the output
                param.normal_()
    for layer in network.modules():
        if isinstance(layer, BaseTunerLayer) and hasattr(layer, "scaling"):
            layer.scaling["default"] = 0.5  # LoRA's scale, 1 by default here, must be applied
    inputs = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    features = FrozenFeatures(network, 3)
    network.train()
    modes = [m.training for m in network.modules()]
    before = [(name, id(module)) for name, module in network.named_modules()]
    outputs, frozen = features.with_adapted(inputs)
    assert features.joint
    assert [(name, id(module)) for name, module in network.named_modules()] == before
    assert [m.training for m in network.modules()] == modes
    network.eval()
    with torch.no_grad():
        adapted = network(inputs)
        with network.disable_adapter():
            pretrained = network(inputs)
    torch.testing.assert_close(outputs, adapted, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(frozen, features(inputs), rtol=1e-10, atol=1e-12)
    assert (adapted - pretrained).abs().max() > 0.1
    for layer in network.modules():
        if isinstance(layer, BaseTunerLayer) and hasattr(layer, "lora_A"):
            layer.merge()
    merged = FrozenFeatures(network, 3)
    with torch.no_grad():
        adapted = network(inputs)
    outputs, frozen = merged.with_adapted(inputs)  # merged: network(inputs), then the frozen pass (which unmerges)
    assert torch.equal(outputs, adapted) and torch.equal(frozen, merged(inputs))


def test_the_joint_pass_reads_the_features_of_an_output_layer_that_both_halves_run():
    """An output layer that is neither adapted nor saved by peft runs on every row of the joint pass: the frozen
    features are its input's second half (float64, as above)."""
    torch.manual_seed(0)
    body = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(144, 3))
    network = get_peft_model(body.double(), LoraConfig(r=2, target_modules=["0"])).double()
    with torch.no_grad():
        network.base_model.model[0].lora_B["default"].weight.normal_()
    inputs = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    features = FrozenFeatures(network, 3)
    outputs, frozen = features.with_adapted(inputs)
    assert features.joint
    with torch.no_grad():
        adapted = network(inputs)
    torch.testing.assert_close(outputs, adapted, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(frozen, features(inputs), rtol=1e-10, atol=1e-12)
    captured = []
    hook = network.base_model.model[3].register_forward_hook(lambda _, a, __: captured.append(a[0]))
    with torch.no_grad():
        network(inputs)
    hook.remove()
    assert (captured[0] - frozen).abs().max() > 0.1  # the adapted features are another matter
