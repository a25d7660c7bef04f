"""Predictions from the posterior (loko_lightning.kalman.predictive): the mean-field average of the softmax over the
covariance filter's belief, from the H P Hᵀ the step forms, against a float64 reference built from the logits'
Jacobian; and the learner scoring it before each sample's update."""

import copy
import math
from functools import partial
from pathlib import Path

import pytest
import torch
from loko_helpers import flat_cov, jacrev_rows, loko_closure, mlp, teacher_stream
from runs import fit_full_and_resumed, loader, stream, tiny, trainer

from loko_lightning import JacobianEngine, LoKO
from loko_lightning.errors import ConfigError
from loko_lightning.kalman.predictive import (
    KAPPAS,
    PROBIT_LAMBDA,
    PredictiveScale,
    mean_field_predictive,
    sample_blocks,
)
from loko_lightning.learner.module import OnlineClassifier

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
EPS64 = torch.finfo(torch.float64).eps


def reference(z, sigma):
    """The mean-field predictive written from the logits and their covariance (Lu, Ie & Sha), in float64."""
    v = sigma.diagonal()[:, None] + sigma.diagonal()[None, :] - 2 * sigma
    gaps = (z[:, None] - z[None, :]) / torch.sqrt(1 + PROBIT_LAMBDA * v)
    p = 1 / torch.exp(-gaps).sum(-1)
    return p / p.sum()


def test_with_no_uncertainty_it_is_the_softmax_and_more_uncertainty_is_less_confident():
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    p = torch.softmax(z, -1)
    torch.testing.assert_close(mean_field_predictive(p, torch.zeros(3, 5, 5, dtype=torch.float64)), p)
    root = torch.randn(5, 5, generator=gen, dtype=torch.float64)
    A = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    tops = []
    for scale in (0.1, 1.0, 10.0):
        C = A @ (scale * root @ root.T) @ A
        tops.append(mean_field_predictive(p, C).max(-1).values)
    assert all((a > b).all() for a, b in zip(tops, tops[1:], strict=False))  # the top class loses mass as Σ grows
    assert (tops[0] < p.max(-1).values).all()


def test_the_logit_covariance_is_recovered_from_the_probabilities_one_up_to_its_blind_shift():
    """C = A Σ A loses Σ's component along 1 (the softmax's blind direction), which the predictive never reads: the
    result equals the reference on Σ whatever is added along 1. float64; A⁺ multiplies the rounding by at most
    cond(A)² (about 1e2 here), far below the 1e-9 asked."""
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(6, generator=gen, dtype=torch.float64)
    p = torch.softmax(z, -1)
    root = torch.randn(6, 6, generator=gen, dtype=torch.float64)
    sigma = root @ root.T / 6
    ones = torch.ones(6, dtype=torch.float64)
    shifted = sigma + 3.0 * torch.outer(ones, ones) + torch.outer(ones, root[0]) + torch.outer(root[0], ones)
    A = torch.diag(p) - torch.outer(p, p)
    for cov in (sigma, shifted):
        got = mean_field_predictive(p[None], (A @ cov @ A)[None], eps=EPS64)[0]
        torch.testing.assert_close(got, reference(z - z.mean(), sigma), rtol=1e-9, atol=1e-12)


def test_the_step_s_prediction_covariance_is_h_p_ht_at_the_prior_and_the_predictive_its_reference():
    """LoKO's prediction_cov after a step is H diag(p̂ + q) Hᵀ of that sample (the prior: made before the update);
    averaged with it, the prediction equals the reference from the logits' Jacobian J_z: Σ_z = J_z diag(p̂ + q) J_zᵀ.
    float64 on both sides (another order of the same sums; the tolerance as test_covariance_filter's references)."""
    model = mlp()
    q = 1e-3
    opt = LoKO(model.parameters(), p0=0.3, seed=3, time_update={"process_noise": q})
    for x, y in teacher_stream(6):
        prior = flat_cov(opt, model.parameters()) + q
        H, y_hat = jacrev_rows(model, x, probabilities=True)
        J, _ = jacrev_rows(model, x, probabilities=False)
        prediction, _, _ = opt.step(loko_closure(model, x, y, factorize=True))
        torch.testing.assert_close(opt.prediction_cov, H @ torch.diag(prior) @ H.T, rtol=1e-9, atol=1e-14)
        averaged = mean_field_predictive(prediction[None], opt.prediction_cov[None], eps=EPS64)[0]
        z = torch.log(y_hat)
        torch.testing.assert_close(averaged, reference(z, J @ torch.diag(prior) @ J.T), rtol=1e-8, atol=1e-12)


def test_a_joint_step_gives_one_block_per_sample():
    model = mlp()
    opt = LoKO(model.parameters(), p0=0.3, seed=3)
    xs, ys = zip(*teacher_stream(3), strict=True)
    engine = JacobianEngine(model, factorize=True)

    def closure():
        prediction, jacobians = engine.batch(torch.cat(xs))
        return prediction, torch.stack(ys), jacobians

    prediction, _, _ = opt.step(closure)
    blocks = sample_blocks(opt.prediction_cov, 3)
    assert blocks.shape == (3, 4, 4)
    torch.testing.assert_close(blocks[1], opt.prediction_cov[4:8, 4:8])
    assert mean_field_predictive(prediction, blocks).shape == (3, 4)


def test_the_scale_is_chosen_by_the_prequential_log_loss_so_far():
    """κ = 0 (the mean) predicts first; each later step the scale with the least summed log-loss of the earlier
    steps; a prediction that is not finite adds nothing; a resumed state chooses as the uninterrupted one."""
    gen = torch.Generator().manual_seed(3)
    scale = PredictiveScale()
    totals = torch.zeros(len(KAPPAS), dtype=torch.float64)
    for step in range(8):
        p = torch.softmax(3 * torch.randn(2, 4, generator=gen, dtype=torch.float64), -1)
        root = torch.randn(2, 4, 4, generator=gen, dtype=torch.float64)
        A = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
        C = A @ (root @ root.transpose(1, 2)) @ A
        label = torch.randint(4, (2,), generator=gen)
        if step == 3:  # NaN in the input
            p = p * float("nan")
        expected_kappa = KAPPAS[int(torch.argmin(totals))]
        assert scale.kappa == expected_kappa and (step > 0 or expected_kappa == 0.0)
        got = scale(p, C, label)
        torch.testing.assert_close(got, mean_field_predictive(p, expected_kappa * C), rtol=0, atol=0, equal_nan=True)
        if step != 3:
            for i, kappa in enumerate(KAPPAS):
                totals[i] -= mean_field_predictive(p, kappa * C)[torch.arange(2), label].log().sum()
        torch.testing.assert_close(scale.losses, totals, rtol=1e-12, atol=0)
    resumed = PredictiveScale()
    resumed.load_state_dict(scale.state_dict())
    assert resumed.kappa == scale.kappa and torch.equal(resumed.losses, scale.losses)


def test_the_learner_scores_the_posterior_predictive_made_before_each_update():
    """predictive: posterior: each scored prediction is the predictive of the mean's prediction and the H P Hᵀ of
    the belief before that sample's update (what a plain LoKO gives at that step), at the scale chosen from the
    earlier samples, bit for bit."""
    torch.manual_seed(0)
    module = tiny(p0=0.05, seed=1)
    module.predictive = "posterior"
    reference_net = copy.deepcopy(module.network)
    scored = []
    log = module._log_online
    module._log_online = lambda prediction, *rest: (scored.append(prediction.clone()), log(prediction, *rest))
    items = stream(8)
    trainer().fit(module, loader(items))

    params = [p for p in reference_net.parameters() if p.requires_grad]
    opt = LoKO(params, p0=0.05, seed=1)
    engine = JacobianEngine(reference_net, params, observation=opt.observation, factorize=True)
    scale = PredictiveScale()
    for item, got in zip(items, scored, strict=True):
        prediction, _, _ = opt.step(lambda item=item: engine.observe(item["inputs"][None], item["label"][None]))
        blocks = sample_blocks(opt.prediction_cov, 1)
        expected = scale(prediction[None], blocks, item["label"][None])
        assert torch.equal(got, expected)
    assert torch.equal(module.online_step.predictive.losses, scale.losses)
    assert scale.losses.min() < scale.losses[0]  # a spread beat the mean's point prediction on this stream


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"optimizer": "adamw", "lr": 1e-3}, "a gradient optimizer keeps no posterior"),
        ({"filter": "natural"}, "filter 'natural'"),
        ({"observation": "topk1"}, "observation 'topk1'"),
        ({"average": 0.9}, "the averaged mean predicts"),
    ],
)
def test_the_posterior_predictive_is_refused_where_the_filter_does_not_form_it(kwargs, message):
    module = tiny(optimizer=kwargs.pop("optimizer", "loko"), **kwargs)
    with pytest.raises(ConfigError, match=f"predictive: posterior is refused: .*{message}") as info:
        OnlineClassifier(module.network_factory, module.optimizer_factory, predictive="posterior")
    assert info.value.field == "predictive"
    with pytest.raises(ConfigError, match="predictive: posterior is refused: a selection"):
        OnlineClassifier(module.network_factory, partial(LoKO, p0="auto"), predictive="posterior")
    with pytest.raises(ConfigError, match="predictive must be one of mean, posterior"):
        OnlineClassifier(tiny().network_factory, predictive="probit")


def test_prediction_cov_is_none_where_the_update_runs_in_other_coordinates():
    model = mlp()
    opt = LoKO(model.parameters(), p0=0.3, seed=3, observation="topk1")
    engine = JacobianEngine(model, observation=opt.observation, factorize=True)
    x, y = next(teacher_stream(1))
    opt.step(lambda: engine.observe(x, y.argmax()[None]))
    assert opt.prediction_cov is None
    assert math.isfinite(float(opt.diagnostics["innovation_norm"]))


@pytest.mark.slow
def test_loko_fit_with_the_posterior_predictive_resumes_exactly(tmp_path, one_thread):
    """24 real MNIST digits (the debug config) with --model.predictive posterior, stopped after 12 with a checkpoint
    at 6 and resumed: the scales' losses, the online metrics and the weights as one uninterrupted run, bit for bit."""
    common = ["--config", str(CONFIGS / "debug.yaml"), "--model.predictive", "posterior"]
    common += ["--data.max_samples", "24", "--data.eval_max_samples", "8"]

    def has_losses(checkpoint):
        assert checkpoint["loko_predictive"]["losses"].shape == (len(KAPPAS),)

    full, resumed = fit_full_and_resumed(tmp_path, common, check_part=has_losses)
    assert full["global_step"] == resumed["global_step"] == 24
    assert torch.equal(full["loko_predictive"]["losses"], resumed["loko_predictive"]["losses"])
    for key in full["state_dict"]:
        assert torch.equal(full["state_dict"][key], resumed["state_dict"][key]), key
