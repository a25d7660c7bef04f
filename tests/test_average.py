"""LoKO(average=δ): predicting with an exponential average of the filter's mean (the late-stream study's option)."""

import copy

import pytest
import torch
from loko_helpers import flat, mlp, teacher_stream

from loko_lightning import JacobianEngine, LoKO
from loko_lightning.errors import ConfigError


def _train(model, opt, stream):
    trajectory = [flat(p.detach().clone() for p in model.parameters())]
    engine = JacobianEngine(model, observation=opt.observation)
    for x, y in stream:
        opt.step(lambda x=x, y=y: engine.observe(x, y.argmax()[None]))
        trajectory.append(flat(p.detach().clone() for p in model.parameters()))
    return trajectory


@pytest.mark.parametrize("filter_", ["covariance", "natural", "lofi2"])
def test_average_off_is_the_paper_and_on_leaves_the_filter_s_trajectory_alone(filter_):
    """The average is read, never fed back: the filter's means with average=0.99 are those without, bit for bit,
    and without it the optimizer keeps no average."""
    plain, averaged = mlp(), mlp()
    options = dict(p0=0.5, seed=3, filter=filter_)
    first = LoKO(plain.parameters(), **options)
    second = LoKO(averaged.parameters(), average=0.99, **options)
    stream = list(teacher_stream(15))
    a, b = _train(plain, first, stream), _train(averaged, second, stream)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert all("average" not in first.state[p] for p in plain.parameters())


def test_the_average_is_the_exponential_average_of_the_means():
    """θ̄_0 = θ_0 and θ̄_k = δ_k θ̄_{k-1} + (1 − δ_k) θ_k after step k, δ_k = min(δ, (1 + k)/(10 + k)), against the
    trajectory recorded in float64 (the fast path's lerp and this recursion round differently: a few ulps of values
    of order 1). 40 steps with δ = 0.8: the warm-up ends at k = 36."""
    model = mlp()
    opt = LoKO(model.parameters(), p0=0.5, seed=3, average=0.8)
    trajectory = _train(model, opt, list(teacher_stream(40)))
    expected = trajectory[0]
    for k, theta in enumerate(trajectory[1:], start=1):
        decay = min(0.8, (1 + k) / (10 + k))
        expected = decay * expected + (1 - decay) * theta
    got = flat(opt.state[p]["average"] for p in model.parameters())
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
    before = flat(p.detach().clone() for p in model.parameters())
    with opt.averaged():
        torch.testing.assert_close(flat(p.detach() for p in model.parameters()), expected, rtol=1e-12, atol=1e-14)
    assert torch.equal(flat(p.detach() for p in model.parameters()), before)  # θ back exactly


def test_the_average_resumes_exactly():
    model = mlp()
    opt = LoKO(model.parameters(), p0=0.5, seed=3, average=0.95)
    stream = list(teacher_stream(12))
    _train(model, opt, stream[:6])
    twin = copy.deepcopy(model)
    second = LoKO(twin.parameters(), p0=0.5, seed=3, average=0.95)
    second.load_state_dict(opt.state_dict())
    _train(model, opt, stream[6:])
    _train(twin, second, stream[6:])
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q) and torch.equal(opt.state[p]["average"], second.state[q]["average"])


@pytest.mark.parametrize("value", [-0.1, 1.0, 1.5, "0.9", True, float("nan")])
def test_a_bad_average_is_refused_naming_the_field(value):
    with pytest.raises(ConfigError, match=r"Invalid average") as raised:
        LoKO(mlp().parameters(), average=value)
    assert raised.value.field == "average"


@pytest.mark.slow
def test_loko_fit_with_an_average_checkpoints_the_average_and_resumes_exactly(tmp_path):
    """24 samples of the debug config, stopped after 12 with a checkpoint at 6 and resumed: the same weights (the
    average θ̄, what predicts), training point θ and optimizer state as one uninterrupted run, bit for bit on the CPU;
    and the prediction scored is the average's, so the online accuracy differs from the paper's run."""
    from pathlib import Path

    from runs import assert_same_tensors, outputs, trainable

    from loko_lightning.cli import main

    debug = str(Path(__file__).resolve().parents[1] / "configs" / "debug.yaml")
    common = ["--config", debug, "--data.max_samples", "24", "--data.eval_max_samples", "8"]
    averaged = [*common, "--model.optimizer.init_args.average", "0.9"]
    main(["fit", *averaged, *outputs(tmp_path, "full", every=24)])
    main(["fit", *averaged, "--trainer.max_steps", "12", *outputs(tmp_path, "part", every=6, keep_all=True)])
    part = tmp_path / "part" / "checkpoints" / "epoch=0-step=6.ckpt"
    main(["fit", *averaged, "--ckpt_path", str(part), *outputs(tmp_path, "resumed", every=24)])
    main(["fit", *common, *outputs(tmp_path, "paper", every=24)])

    load = lambda name: torch.load(tmp_path / name / "checkpoints" / "last.ckpt", weights_only=False)  # noqa: E731
    full, resumed, paper = load("full"), load("resumed"), load("paper")
    assert full["global_step"] == resumed["global_step"] == 24
    weights = trainable(full["state_dict"])
    assert weights and weights.keys() == trainable(resumed["state_dict"]).keys()
    for key in weights:
        assert torch.equal(full["state_dict"][key], resumed["state_dict"][key]), key
    assert_same_tensors(full["loko_train_point"], resumed["loko_train_point"], "loko_train_point")
    assert_same_tensors(full["optimizer_states"], resumed["optimizer_states"], "optimizer_states")
    # The training point is the paper's run's weights (the average never feeds back); the weights are the average.
    theta, paper_weights = full["loko_train_point"], trainable(paper["state_dict"])
    assert all(torch.equal(theta[key], paper_weights[key]) for key in theta)
    assert any(not torch.equal(weights[key], theta[key]) for key in theta)
    nll = [key for key in full["state_dict"] if key.startswith("nll.")]
    assert nll and any(not torch.equal(full["state_dict"][key], paper["state_dict"][key]) for key in nll)


def test_a_skipped_step_moves_neither_the_mean_nor_its_average():
    """A non-finite prediction is skipped: θ did not move, so θ̄ must not move towards it either (the average lerps
    only on applied steps; a lerp on every step pulled θ̄ towards θ on a skipped one)."""
    model = mlp()
    opt = LoKO(model.parameters(), p0=0.5, seed=3, average=0.8)
    stream = list(teacher_stream(6))
    _train(model, opt, stream[:5])
    theta = [p.detach().clone() for p in model.parameters()]
    averages = [opt.state[p]["average"].clone() for p in model.parameters()]
    assert any(not torch.equal(a, t) for a, t in zip(averages, theta, strict=True))  # θ̄ ≠ θ: a lerp would move it
    engine = JacobianEngine(model, observation=opt.observation)
    x, y = stream[5]
    prediction, target, jacobians = engine.observe(x, y.argmax()[None])
    bad = prediction.clone()
    bad[0] = float("nan")
    opt.step(lambda: (bad, target, jacobians))
    assert not bool(opt.diagnostics["applied"]) and int(opt.diagnostics["skipped"]) == 1
    for param, before, average in zip(model.parameters(), theta, averages, strict=True):
        assert torch.equal(param.detach(), before) and torch.equal(opt.state[param]["average"], average)
    # The next applied step continues the average as if the skipped one had not been there.
    opt.step(lambda: (prediction, target, jacobians))
    twin = mlp()
    twin_opt = LoKO(twin.parameters(), p0=0.5, seed=3, average=0.8)
    _train(twin, twin_opt, stream)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(opt.state[p]["average"], twin_opt.state[q]["average"])


def test_the_learner_scores_each_sample_with_the_average_it_had_before_that_sample(monkeypatch):
    """The prequential contract at the learner level: the prediction the online metrics score for sample t is made by
    the averaged parameters θ̄ as they were before sample t's update (the model a user would have been served).

    Recorded independently of the learner's step: just before each LoKO.step, the network's prediction under
    ``averaged()``. A prediction made after the update (a look-ahead) differs from it, because θ̄ moves every step."""
    from runs import loader, stream, tiny, trainer

    from loko_lightning.learner.module import OnlineClassifier

    torch.manual_seed(0)
    module = tiny(average=0.9, seed=0)
    batches, before, scored = [], [], []
    original_step, original_log = LoKO.step, OnlineClassifier._log_online
    original_training_step = OnlineClassifier.training_step

    def training_step(self, batch, batch_idx):
        batches.append(batch)
        return original_training_step(self, batch, batch_idx)

    def step(self, closure=None):
        with torch.no_grad(), self.averaged():
            logits = module.network(batches[-1]["inputs"])
            before.append(self.observation.predict(logits.reshape(1, -1)).detach().clone())
        return original_step(self, closure)

    def log_online(self, prediction, label, elapsed):
        scored.append(prediction.detach().clone())
        return original_log(self, prediction, label, elapsed)

    monkeypatch.setattr(OnlineClassifier, "training_step", training_step)
    monkeypatch.setattr(LoKO, "step", step)
    monkeypatch.setattr(OnlineClassifier, "_log_online", log_online)
    trainer().fit(module, loader(stream(6)))
    assert len(scored) == len(before) == 6
    for t, (got, want) in enumerate(zip(scored, before, strict=True)):
        assert torch.equal(got, want.to(got.dtype)), t
    assert not torch.equal(before[-1], before[-2])  # θ̄ moved between the samples: a look-ahead would show


def test_the_swap_restores_the_parameters_exactly_every_time_nested_too():
    """``averaged()`` keeps the tensors that hold θ while θ̄ is swapped in from one call to the next: a second call
    restores the θ of its own time, not the first call's, and a call inside another restores the outer θ̄."""
    model = mlp()
    opt = LoKO(model.parameters(), p0=0.5, seed=3, average=0.9)
    stream = list(teacher_stream(4))
    for x, y in stream[:2]:
        _train(model, opt, [(x, y)])
        theta = flat(p.detach().clone() for p in model.parameters())
        average = flat(opt.state[p]["average"] for p in model.parameters())
        assert not torch.equal(theta, average)
        with opt.averaged():
            assert torch.equal(flat(p.detach() for p in model.parameters()), average)
            with opt.averaged():
                assert torch.equal(flat(p.detach() for p in model.parameters()), average)
            assert torch.equal(flat(p.detach() for p in model.parameters()), average)
        assert torch.equal(flat(p.detach() for p in model.parameters()), theta)
