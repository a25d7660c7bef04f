"""The learner's logits plus streaming LDA's: β's fit against a float64 minimiser, LDA's head against a float64 batch
computation, and the prequential contract through trainer.fit (each sample scored before β, LDA or the filter update
on it)."""

from functools import partial

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from runs import loader, stream, trainer
from scipy.optimize import minimize_scalar

from loko_lightning import LoKO
from loko_lightning.errors import ConfigError
from loko_lightning.learner.frozen_heads import output_layer
from loko_lightning.learner.lda_head import LDAHead, LDAHeadStep, fit_weight, weight_objective
from loko_lightning.learner.module import OnlineClassifier
from loko_lightning.models import TimmClassifier
from loko_lightning.peers import StreamingLDA


def reference_weight(f, g, y, prior_scale, upper):
    """β's minimiser by scipy's bounded Brent search on the float64 numpy objective (xatol 1e-12)."""
    f, g, y = (np.asarray(a, dtype=np.float64) for a in (f, g, y))

    def objective(beta):
        logits = f + beta * g
        top = logits.max(-1, keepdims=True)
        lse = top[:, 0] + np.log(np.exp(logits - top).sum(-1))
        return float((lse - logits[np.arange(len(y)), y.astype(int)]).sum() + beta**2 / (2 * prior_scale**2))

    if len(y):  # the objective is convex: 0 where its slope there is not negative (Brent stops short of a bound)
        p = np.exp(f - f.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        if (p * g).sum() - g[np.arange(len(y)), y.astype(int)].sum() >= 0:
            return 0.0, objective
    return minimize_scalar(objective, bounds=(0.0, upper), method="bounded", options={"xatol": 1e-12}).x, objective


def logits(samples=40, classes=5, seed=0, lda_scale=60.0, informative=0.5):
    """Network logits ``f`` (O(1)), LDA logits ``g`` (tens of nats; LDA's argmax right on ``informative`` of them)."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(classes, (samples,), generator=gen)
    f = torch.randn(samples, classes, generator=gen, dtype=torch.float64)
    g = lda_scale * torch.randn(samples, classes, generator=gen, dtype=torch.float64)
    right = torch.rand(samples, generator=gen) < informative
    g[right, y[right]] = g[right].max(-1).values + lda_scale * torch.rand(int(right.sum()), generator=gen)
    return f, g, y


# ------------------------------------------------------------------ β against float64 references
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("prior_scale", [0.1, 1.0])
def test_the_weight_is_the_float64_minimiser(seed, prior_scale):
    """fit_weight (safeguarded Newton, float64) against scipy's bounded Brent search: within 1e-6 (Brent's own xatol is
    1e-12, but near the minimum the objective is flat to its rounding, ~1e-14 relative of a few hundred nats, so the
    two argmins agree to ~sqrt(1e-14 · L / L'') ≲ 1e-6), and the objective no larger than the reference's (+1e-9)."""
    f, g, y = logits(seed=seed)
    beta = fit_weight(f, g, y, prior_scale=prior_scale, upper=1.0)
    expected, objective = reference_weight(f, g, y, prior_scale, 1.0)
    assert 0.0 < beta < 1.0
    assert beta == pytest.approx(expected, abs=1e-6)
    assert float(weight_objective(f, g, y, beta, prior_scale)) <= objective(expected) + 1e-9
    # a warm start anywhere in the bracket gives the same minimiser
    assert fit_weight(f, g, y, start=0.9, prior_scale=prior_scale) == pytest.approx(beta, abs=1e-9)


def test_the_weight_at_its_bounds():
    """An uninformative (here: anti-informative) LDA gets β = 0; a perfect one with a loose prior is held at upper."""
    f, g, y = logits(informative=0.0, seed=3)
    g[torch.arange(len(y)), y] = g.min(-1).values - 1.0  # LDA's logit of the label always its lowest
    assert fit_weight(f, g, y) == 0.0
    f, g, y = logits(informative=1.0, seed=4, lda_scale=0.01)
    assert fit_weight(f, g, y, prior_scale=1e3, upper=2.0) == 2.0
    assert fit_weight(f, g, y, upper=0.0) == 0.0
    assert fit_weight(f[:0], g[:0], y[:0]) == 0.0


def test_float32_logits_give_the_float64_weight():
    """fit_weight computes in float64 whatever it is given: float32 logits (rounded to 6e-8 relative, up to ~1e-5
    nats on logits of a hundred) move β by at most their rounding over the curvature: within 1e-5 here."""
    f, g, y = logits(seed=5)
    assert fit_weight(f.float(), g.float(), y) == pytest.approx(fit_weight(f, g, y), abs=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"prior_scale": 0.0}, "prior_scale"), ({"upper": -1.0}, "upper"), ({"features": "x"}, "features")],
)
def test_bad_arguments_are_refused(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        LDAHead(StreamingLDA, **kwargs)


# ------------------------------------------------------------------ the learner
SHRINKAGE = 1e-3
PRIOR = 1.0
UPPER = 10.0


def learner():
    torch.manual_seed(0)
    factory = TimmClassifier("test_resnet", num_classes=3, pretrained=False, r=2)
    return OnlineClassifier(factory, partial(LoKO, p0=0.1, seed=0))


def scored(module, monkeypatch):
    predictions = []
    log_online = module._log_online
    monkeypatch.setattr(
        module, "_log_online", lambda p, *args: (predictions.append(p.detach().double()), log_online(p, *args))
    )
    return predictions


def reference_lda_logits(x, y, z, classes=3, shrinkage=SHRINKAGE):
    """Float64 batch LDA of ``(x, y)`` ((1 − ε)Σ + εI, Σ the pooled within-class covariance) on ``z``; a class not in
    ``y`` gets the mean of the seen classes' logits, all zero before two classes are seen; divided by their standard
    deviation over the classes."""
    seen = torch.tensor([bool((y == k).any()) for k in range(classes)])
    if int(seen.sum()) < 2:  # LDA says nothing yet
        return torch.zeros(classes, dtype=torch.float64)
    means = torch.zeros(classes, x.shape[1], dtype=torch.float64)
    for k in range(classes):
        if seen[k]:
            means[k] = x[y == k].mean(0)
    residuals = x - means[y]
    covariance = residuals.T @ residuals / len(x)
    precision = torch.linalg.inv((1 - shrinkage) * covariance + shrinkage * torch.eye(x.shape[1], dtype=x.dtype))
    weight = means @ precision
    out = z @ weight.T - 0.5 * (weight * means).sum(-1)
    out[~seen] = out[seen].mean()
    spread = out.std()
    return out / spread if spread > 0 else out


def test_the_learner_scores_the_sum_made_before_the_sample(monkeypatch, one_thread):
    """Through trainer.fit: the prediction scored for sample i is softmax(f_i + β_i g_i), with f_i the network's own
    logits in that step's forward pass, g_i LDA fitted in float64 (batch) on the features z_0..z_{i-1} the output
    layer read in the steps before, evaluated on z_i and standardised, and β_i scipy's minimiser on samples 0..i-1.
    The network and the features are float32: a probability within 1e-4 of the float64 reference (LDA's raw logits
    are ~1e3 here, rounded in float32 to ~1e-4 relative of their spread, times β ≲ 1). Predicting with sample i
    included in LDA and β moves the prediction by far more (asserted, so the test can fail); β leaves 0 (so the sum
    is tested, not the network alone)."""
    items = stream(16, num_classes=3, seed=4)
    labels = torch.stack([item["label"] for item in items])
    module = learner()
    predictions = scored(module, monkeypatch)
    calls = []  # registered before the step's own hook: sees the network's logits before LDA's are added
    hook = output_layer(module.network, 3).register_forward_hook(
        lambda _, a, out: calls.append((a[0].detach().double(), out.detach().double()))
    )
    callback = LDAHead(partial(StreamingLDA, shrinkage=SHRINKAGE), prior_scale=PRIOR, upper=UPPER)
    trainer(callbacks=[callback]).fit(module, loader(items))
    hook.remove()
    assert isinstance(module.online_step, LDAHeadStep) and module.is_kalman
    assert len(predictions) == len(calls) == 16
    z = torch.cat([c[0] for c in calls])
    f = torch.cat([c[1] for c in calls])
    betas, gs, lookahead_gap = [], [], 0.0
    for i in range(16):
        g = reference_lda_logits(z[:i], labels[:i], z[i])
        beta = reference_weight(f[:i], torch.stack(gs), labels[:i], PRIOR, UPPER)[0] if i else 0.0
        expected = torch.softmax(f[i] + beta * g, -1)
        torch.testing.assert_close(predictions[i][0], expected, rtol=0, atol=1e-4)
        gs.append(g)
        ahead_g = reference_lda_logits(z[: i + 1], labels[: i + 1], z[i])
        ahead_beta = reference_weight(f[: i + 1], torch.stack(gs[:-1] + [ahead_g]), labels[: i + 1], PRIOR, UPPER)[0]
        ahead = torch.softmax(f[i] + ahead_beta * ahead_g, -1)
        lookahead_gap = max(lookahead_gap, float((predictions[i][0] - ahead).abs().max()))
        betas.append(beta)
    assert max(betas) > 1e-3
    assert lookahead_gap > 1e-2


def test_upper_zero_is_the_plain_learner(one_thread):
    """With β held at 0 the hook adds nothing: the parameters after the fit are a plain LoKO learner's, bit for bit."""
    items = stream(8, num_classes=3, seed=6)
    plain = learner()
    trainer().fit(plain, loader(items))
    module = learner()
    trainer(callbacks=[LDAHead(partial(StreamingLDA, shrinkage=SHRINKAGE), upper=0.0)]).fit(module, loader(items))
    for name, param in plain.network.named_parameters():
        torch.testing.assert_close(param, module.network.get_parameter(name), rtol=0, atol=0)


def test_a_fit_resumed_with_the_lda_head_is_refused(tmp_path, one_thread):
    """The head's state is saved but not read back: resuming with it is refused in one line saying so."""
    items = stream(4, num_classes=3, seed=5)
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer(enable_checkpointing=True, callbacks=[checkpoint], max_epochs=1).fit(learner(), loader(items))
    resumed = trainer(max_epochs=2, callbacks=[LDAHead(StreamingLDA)])
    with pytest.raises(ConfigError, match="resuming a fit with the LDA head is not built yet"):
        resumed.fit(learner(), loader(items), ckpt_path=str(tmp_path / "last.ckpt"))
