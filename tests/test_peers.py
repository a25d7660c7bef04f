"""The peers (schedule-free AdamW, IVON, the posteriors EKF, the constant-lr AdamW) and the calibration metrics."""

import math
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from runs import assert_same_tensors, fit_full_and_resumed, trainable
from torch.nn import functional as F

from loko_lightning import JacobianEngine, LoKO
from loko_lightning.cli import main
from loko_lightning.learner.metrics import CalibrationError
from loko_lightning.learner.module import OnlineClassifier
from loko_lightning.learner.peer_steps import averaged_point
from loko_lightning.learner.steps import GradientStep
from loko_lightning.models import TimmClassifier

pytest.importorskip("schedulefree")
pytest.importorskip("ivon")
pytest.importorskip("posteriors")

from loko_lightning.peers import IVON, DiagonalFisherEKF, ScheduleFreeAdamW  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEBUG = str(ROOT / "configs" / "debug.yaml")
BASELINES = ROOT / "configs" / "baselines"
PEERS = ("adamw_const", "schedulefree", "ivon", "posteriors")


# ------------------------------------------------------------------ calibration
def test_calibration_error_of_a_hand_computed_stream():
    """Bins of width 0.1: 0.9 right and 0.65 wrong -> (|1 - 0.9| + |0 - 0.65|) / 2; 0.95 and 0.92 right share a bin
    -> |2 - 1.87| / 2; the window of 2 forgets the first two."""
    stream = CalibrationError(n_bins=10)
    recent = CalibrationError(n_bins=10, window=2)
    cases = [([0.9, 0.1], 0), ([0.35, 0.65], 0)]
    for probabilities, label in cases:
        for metric in (stream, recent):
            metric.update(torch.tensor(probabilities), torch.tensor(label))
    assert float(stream.compute()) == pytest.approx((0.1 + 0.65) / 2)
    for probabilities in ([0.95, 0.05], [0.92, 0.08]):
        for metric in (stream, recent):
            metric.update(torch.tensor(probabilities), torch.tensor(0))
    assert float(recent.compute()) == pytest.approx(abs(2 - 1.87) / 2)
    # Stream: the 0.9 bin holds 0.9, 0.95 and 0.92 (all right), the 0.6 bin 0.65 (wrong).
    assert float(stream.compute()) == pytest.approx((abs(3 - 2.77) + 0.65) / 4)
    # A skipped prediction is in neither.
    for metric in (stream, recent):
        metric.update(torch.tensor([0.1, 0.9]), torch.tensor(0), keep=torch.tensor(False))
    assert float(recent.compute()) == pytest.approx(abs(2 - 1.87) / 2)
    assert float(stream.compute()) == pytest.approx((abs(3 - 2.77) + 0.65) / 4)


def test_calibration_error_is_torchmetrics_definition():
    """The streamed ECE equals torchmetrics' MulticlassCalibrationError (15 bins, L1) over the stream and the last
    100, saturated predictions (confidence exactly 1) included. torchmetrics sums 300 float32 values per bin: its
    relative rounding is at most 300 * 2^-24 = 1.8e-5; ours are float64 sums."""
    from torchmetrics.classification import MulticlassCalibrationError

    gen = torch.Generator().manual_seed(0)
    probabilities = (3 * torch.randn(300, 5, generator=gen)).softmax(-1)
    probabilities[7] = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0])
    labels = torch.randint(5, (300,), generator=gen)
    stream, recent = CalibrationError(), CalibrationError(window=100)
    for p, y in zip(probabilities, labels, strict=True):
        stream.update(p, y)
        recent.update(p, y)
    reference = MulticlassCalibrationError(5, n_bins=15, norm="l1")
    reference.update(probabilities, labels)
    assert float(stream.compute()) == pytest.approx(float(reference.compute()), rel=2e-5)
    reference = MulticlassCalibrationError(5, n_bins=15, norm="l1")
    reference.update(probabilities[-100:], labels[-100:])
    assert float(recent.compute()) == pytest.approx(float(reference.compute()), rel=2e-5)


def test_the_learner_logs_prequential_nll_and_ece(monkeypatch):
    """Three predictions of a known stream: the logged NLL is the mean of -log p(label), the ECE by hand."""
    factory = TimmClassifier(backbone="test_resnet", num_classes=2, pretrained=False, r=2)
    module = OnlineClassifier(factory, partial(torch.optim.AdamW, lr=1e-3), recent_window=2)
    logged = {}
    monkeypatch.setattr(module, "log_dict", lambda values, **kwargs: logged.update(values))
    module.online_step = GradientStep()
    wrapper = SimpleNamespace(optimizer=SimpleNamespace(param_groups=[{"lr": 0.1}]))
    monkeypatch.setattr(type(module), "optimizers", lambda self: wrapper)
    stream = [([0.8, 0.2], 0), ([0.3, 0.7], 0), ([0.4, 0.6], 1)]
    for probabilities, label in stream:
        module._log_online(torch.tensor([probabilities]), torch.tensor([label]), 0.0)
    nll = [-math.log(p[y]) for p, y in stream]
    assert float(logged["train/nll"]) == pytest.approx(sum(nll) / 3)
    assert float(logged["train/nll_recent2"]) == pytest.approx(sum(nll[1:]) / 2)
    # 15 bins: 0.8 (right) alone; 0.7 (wrong) and 0.6 (right) in their own bins.
    assert float(logged["train/ece"]) == pytest.approx((0.2 + 0.7 + 0.4) / 3)
    assert float(logged["train/ece_recent2"]) == pytest.approx((0.7 + 0.4) / 2)


# ------------------------------------------------------------------ posteriors vs the natural filter
def test_the_posteriors_ekf_is_the_natural_filter_where_they_coincide():
    """One sample a step, lr 1, no process noise, every p̂₀ entry p0: posteriors' diagonal EKF and LoKO's natural
    filter (empirical Fisher) are the same equations (peers/ekf.py), so in float64 they agree to rounding over 20
    steps: the two compute the same quantities in other orders, a few ulps (2^-52) per step; 1e-12 leaves room."""
    torch.manual_seed(0)
    xs, ys = torch.randn(20, 1, 6, dtype=torch.float64), torch.randint(3, (20, 1))
    nets = []
    for _ in range(2):
        torch.manual_seed(1)
        nets.append(torch.nn.Linear(6, 3).double())
    loko_net, ekf_net = nets
    loko = LoKO(loko_net.parameters(), p0=0.05, p0_init="constant", filter="natural", dtype=torch.float64)
    ekf = DiagonalFisherEKF(list(ekf_net.parameters()), p0=0.05)
    names = [name for name, _ in ekf_net.named_parameters()]

    def log_likelihood(params, batch):
        x, y = batch
        weights = {name: params[f"p{i}"] for i, name in enumerate(names)}
        logits = torch.func.functional_call(ekf_net, weights, (x,))
        return logits.log_softmax(-1).gather(-1, y[:, None])[:, 0], logits

    engine = JacobianEngine(loko_net, observation=loko.observation)
    for x, y in zip(xs, ys, strict=True):
        loko_prediction, _, _ = loko.step(lambda x=x, y=y: engine.observe(x, y))
        logits, applied = ekf.step(lambda x=x, y=y: (log_likelihood, (x, y)))
        assert bool(applied)
        torch.testing.assert_close(logits.softmax(-1)[0], loko_prediction, rtol=0, atol=1e-12)
    for a, b in zip(loko_net.parameters(), ekf_net.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
        torch.testing.assert_close(loko.state[a]["cov"].view_as(a), ekf.state[b]["sd"] ** 2, rtol=1e-12, atol=0)


# ------------------------------------------------------------------ the steps
def test_schedule_free_predicts_with_its_average_and_never_moves_y():
    """Predicting with x and coming back leaves y bit for bit; x is the optimizer's own eval() point."""
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    optimizer = ScheduleFreeAdamW(net.parameters(), lr=0.1)
    optimizer.train()
    for _ in range(3):
        optimizer.zero_grad()
        F.cross_entropy(net(torch.randn(2, 4)), torch.tensor([0, 1])).backward()
        optimizer.step()
    y = [p.detach().clone() for p in net.parameters()]
    with averaged_point(optimizer):
        x = [p.detach().clone() for p in net.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(y, net.parameters(), strict=True))
    assert optimizer.param_groups[0]["train_mode"]
    assert not all(torch.equal(a, b) for a, b in zip(x, y, strict=True))
    optimizer.eval()
    assert all(torch.equal(a, b) for a, b in zip(x, net.parameters(), strict=True))


def test_ivon_without_a_draw_changes_nothing_and_resumes_its_step_counter():
    net = torch.nn.Linear(4, 3)
    optimizer = IVON(net.parameters(), lr=0.01, ess=100)
    before = [p.detach().clone() for p in net.parameters()]
    optimizer.step(lambda: None)  # Lightning's closure, no draw: a skipped sample
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))
    for _ in range(2):
        with optimizer.sampled_params(train=True):
            optimizer.zero_grad()
            F.cross_entropy(net(torch.randn(2, 4)), torch.tensor([0, 1])).backward()
        optimizer.step()
    state = optimizer.state_dict()
    assert state["current_step"] == 2
    fresh = IVON(net.parameters(), lr=0.01, ess=100)
    fresh.load_state_dict(state)
    assert fresh.current_step == 2 and torch.equal(fresh.param_groups[0]["hess"], optimizer.param_groups[0]["hess"])


# ------------------------------------------------------------------ through loko fit
@pytest.mark.slow
@pytest.mark.parametrize("peer", PEERS)
@pytest.mark.usefixtures("one_thread")  # bit for bit: the bits depend on the intra-op threads
def test_each_peer_fits_the_debug_config_and_resumes_exactly(peer, tmp_path):
    """24 samples, the learning rate (p0) chosen on the first 8; stopped after 12 with a checkpoint at 6 (mid-
    selection) and resumed: the same weights, optimizer state, selection and online metrics as one uninterrupted
    run, bit for bit on the CPU."""
    common = ["--config", DEBUG, "--config", str(BASELINES / f"{peer}.yaml")]
    common += ["--data.max_samples", "24", "--data.eval_max_samples", "8", "--model.select.samples", "8"]
    full, resumed = fit_full_and_resumed(tmp_path, common)
    assert full["global_step"] == resumed["global_step"] == 24
    assert full["loko_selection"]["chosen"] == resumed["loko_selection"]["chosen"] is not None
    assert full["loko_selection"]["scores"] == resumed["loko_selection"]["scores"]
    weights = trainable(full["state_dict"])
    assert weights and weights.keys() == trainable(resumed["state_dict"]).keys()
    for key in full["state_dict"]:
        if key in weights or key.startswith(("online_acc", "nll", "ece")):
            assert torch.equal(full["state_dict"][key], resumed["state_dict"][key]), key
    assert_same_tensors(full["optimizer_states"], resumed["optimizer_states"], "optimizer_states")
    if peer == "schedulefree":  # the weights are the average x, the training point y beside them
        assert_same_tensors(full["loko_train_point"], resumed["loko_train_point"], "loko_train_point")
        x, y = trainable(full["state_dict"]), full["loko_train_point"]
        assert any(not torch.equal(x[key], y[key]) for key in x)


# ------------------------------------------------------------------ bad input
def test_a_missing_peer_package_is_one_line_naming_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "schedulefree", None)
    monkeypatch.delitem(sys.modules, "loko_lightning.peers.schedule_free", raising=False)
    args = ["fit", "--config", DEBUG, "--config", str(BASELINES / "schedulefree.yaml")]
    with pytest.raises(SystemExit) as info:
        main([*args, "--data.max_samples", "4"])
    assert info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and 'pip install "loko-lightning[peers]"' in error[0] and "schedulefree" in error[0]


@pytest.mark.parametrize(
    ("overlay", "flag", "named"),
    [("ivon.yaml", "--model.optimizer.init_args.p0", "p0"), (None, "--model.optimizer.init_args.lr", "lr")],
)
def test_an_option_the_learner_does_not_have_is_one_line(overlay, flag, named, capsys):
    configs = ["--config", DEBUG] + (["--config", str(BASELINES / overlay)] if overlay else [])
    with pytest.raises(SystemExit) as info:
        main(["fit", *configs, flag, "0.1", "--data.max_samples", "4"])
    assert info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and f"--model.optimizer.{named} is not an option" in error[0]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"p0": 0.0}, "p0"),
        ({"p0": float("nan")}, "p0"),
        ({"lr": -1.0}, "lr"),
        ({"transition_sd": -0.1}, "transition_sd"),
    ],
)
def test_the_posteriors_ekf_refuses_bad_values_naming_the_field(kwargs, field):
    from loko_lightning.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        DiagonalFisherEKF([torch.nn.Parameter(torch.zeros(2))], **kwargs)
    assert info.value.field == field


@pytest.mark.parametrize("values", ["[0.01]", "[0.01, -0.1]"])
def test_a_peer_selection_grid_with_one_or_a_non_positive_value_is_one_line(values, capsys):
    args = ["fit", "--config", DEBUG, "--config", str(BASELINES / "ivon.yaml"), "--model.select.values", values]
    with pytest.raises(SystemExit):
        main([*args, "--data.max_samples", "4"])
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "select.values" in error[0] and "at least two distinct finite numbers > 0" in error[0]
