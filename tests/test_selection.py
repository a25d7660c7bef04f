"""Online selection of one optimizer argument (``p0: auto``, the tuned-lr AdamW) and the recent-window accuracy."""

import logging
import math
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from runs import fit_full_and_resumed, loader, outputs, stream, trainable, trainer
from torch.nn import functional as F

from loko_lightning import LoKO, jacobian
from loko_lightning.cli import main
from loko_lightning.errors import ConfigError
from loko_lightning.learner.module import OnlineClassifier
from loko_lightning.learner.selection import AUTO_P0, AUTO_SAMPLES, Candidates, CandidateStates
from loko_lightning.learner.steps import GradientStep
from loko_lightning.models import TimmClassifier

ROOT = Path(__file__).resolve().parents[1]
DEBUG = str(ROOT / "configs" / "debug.yaml")


def linear_stream(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(3, 6, generator=gen)
    xs = torch.randn(n, 1, 6, generator=gen)
    return [(x, (x @ w.T).argmax(-1)) for x in xs]


def closure_for(model, x, label):
    target = F.one_hot(label[0], 3).float()

    def closure():
        prediction, jacobians = jacobian(model, x)
        return prediction, target, jacobians

    return closure


def alone(value, samples, n):
    """One LoKO(p0=value) over the stream: its prequential cross-entropy on the first ``samples`` and its run."""
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    optimizer = LoKO(model.parameters(), p0=value, seed=0)
    score, predictions, params_at = 0.0, [], None
    for t, (x, label) in enumerate(linear_stream(n)):
        prediction, _, _ = optimizer.step(closure_for(model, x, label))
        predictions.append(prediction.detach().clone())
        if t < samples:
            score += -math.log(max(float(prediction[label]), torch.finfo(torch.float64).tiny))
        if t == samples - 1:
            params_at = [p.detach().clone() for p in model.parameters()]
    return score, predictions, params_at, [p.detach().clone() for p in model.parameters()]


def test_selection_picks_the_lowest_prequential_loss_and_continues_with_its_state():
    """Three candidate filters on a toy stream: the one whose predictions (each made before its own update) have
    the lowest cross-entropy wins; the learner predicted with the leader of the samples before each one; after the
    selection the winner's parameters and filter go on exactly as if it had run alone from the start."""
    values, samples, n = (1e-3, 1.0, 100.0, 1000.0), 30, 40
    runs = {value: alone(value, samples, n) for value in values}
    best = min(range(len(values)), key=lambda i: runs[values[i]][0])
    assert values[best] == 100.0  # the toy stream's winner lies inside the grid: 1e-3 barely learns, 1000 overshoots
    assert runs[values[best]][0] < min(runs[v][0] for v in values if v != values[best]) - 0.1

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    params = list(model.parameters())
    live = LoKO(params, p0=values[0], seed=0)
    states = CandidateStates(Candidates("p0", values, samples), params, partial(LoKO, seed=0))
    scores = [0.0] * len(values)
    for t, (x, label) in enumerate(linear_stream(n)):
        if states.done:
            prediction, _, _ = live.step(closure_for(model, x, label))
            assert torch.equal(prediction, runs[values[best]][1][t])
            continue
        leader = min(range(len(values)), key=lambda i: (scores[i], i))
        assert states.leader == leader
        results = []
        for index in range(len(states)):
            states.load(index, live)
            prediction, _, _ = live.step(closure_for(model, x, label))
            assert torch.equal(prediction, runs[values[index]][1][t])  # each candidate is its own filter
            results.append((prediction[None], label, live.diagnostics["applied"]))
            states.save(index, live)
        for index, (prediction, _, _) in enumerate(results):
            scores[index] += -math.log(float(prediction[0, label]))
        states.record(results)
        ended = states.advance(1, live)
        assert ended == (t == samples - 1)
    assert states.chosen == best and live.param_groups[0]["p0"] == values[best]
    assert states.scores == pytest.approx(scores, rel=1e-12)  # float64 sums of the same float32 probabilities
    for param, expected in zip(params, runs[values[best]][3], strict=True):
        assert torch.equal(param, expected)


def test_a_candidate_that_alone_skips_a_sample_has_diverged():
    states = CandidateStates.__new__(CandidateStates)
    states.scores, states.seen, states.chosen = [0.0, 0.0], 0, None
    states.candidates = Candidates("p0", (0.1, 1.0), 4)
    label = torch.tensor([1])
    good = torch.tensor([[0.25, 0.5, 0.25]])
    states.record([(good, label, torch.tensor(True)), (torch.full((1, 3), math.nan), label, torch.tensor(False))])
    assert states.scores == [pytest.approx(math.log(2)), math.inf]
    # Skipped by every candidate (a NaN input): nobody scores.
    states.record([(good, label, torch.tensor(False)), (good, label, torch.tensor(False))])
    assert states.scores == [pytest.approx(math.log(2)), math.inf]


def test_the_summary_names_a_candidate_that_diverged():
    """A candidate whose mean prequential cross-entropy is above the divergence guard's limit (3 log m, uniform
    guessing) is named in the summary, not only outscored."""
    states = CandidateStates.__new__(CandidateStates)
    states.scores, states.seen, states.chosen, states.classes = [0.0, 0.0, 0.0], 0, None, 0
    states.candidates = Candidates("p0", (0.03, 0.1, 0.3), 2)
    label = torch.tensor([1])
    wrong = torch.tensor([[1 - 2e-9, 1e-9, 1e-9]])  # -log 1e-9 = 20.7 > 3 log 3 = 3.30
    uniform = torch.full((1, 3), 1 / 3)
    for _ in range(2):
        states.record([(uniform, label, True), (torch.tensor([[0.2, 0.6, 0.2]]), label, True), (wrong, label, True)])
        states.seen += 1
    states.chosen = 1
    text = states.summary()
    assert "p0=0.3: 20.7233 (diverged)" in text and "p0=0.03: 1.0986," in text and "p0=0.1: 0.5108," in text
    assert text.endswith("p0=0.3 diverged (mean cross-entropy above 3 log m = 3.30, uniform guessing), so the grid "
                         "reaches past the stable range there")  # fmt: skip


def tiny_selecting(select, optimizer=None, **kwargs):
    factory = TimmClassifier("test_resnet", 4, pretrained=False, r=2)
    return OnlineClassifier(factory, optimizer or partial(LoKO, seed=0), select=select, **kwargs)


def predictions_of(module, items, monkeypatch):
    seen = []
    original = OnlineClassifier._log_online

    def record(self, prediction, label, elapsed):
        seen.append(prediction.detach().clone())
        return original(self, prediction, label, elapsed)

    monkeypatch.setattr(OnlineClassifier, "_log_online", record)
    trainer().fit(module, loader(items))
    monkeypatch.undo()
    return seen


@pytest.mark.parametrize("optimizer", ["loko", "adamw"])
def test_the_learner_never_uses_a_label_before_predicting_its_sample(optimizer, monkeypatch):
    """Two streams that differ only in the label of sample 5: every prediction up to and including sample 5 is the
    same (the leader and every candidate predicted before seeing that label); the selection counts one trainer
    step per sample."""
    items = stream(12)
    changed = [dict(item) for item in items]
    changed[5]["label"] = (items[5]["label"] + 1) % 4
    if optimizer == "loko":
        build, select = partial(LoKO, seed=0), Candidates("p0", (0.01, 0.3), samples=8)
    else:
        build, select = partial(torch.optim.AdamW, lr=1e-4), Candidates("lr", (1e-4, 1e-2), samples=8)
    runs = []
    for data in (items, changed):
        torch.manual_seed(0)
        module = tiny_selecting(select, build)
        runs.append(predictions_of(module, data, monkeypatch))
        assert module.trainer.global_step == 12 and module.online_step.done
    for t in range(6):
        assert torch.equal(runs[0][t], runs[1][t]), t
    assert any(not torch.equal(a, b) for a, b in zip(runs[0][6:], runs[1][6:], strict=True))


def test_p0_auto_selects_among_the_auto_candidates_and_its_budget_is_the_tuned_adamws():
    module = tiny_selecting(None, partial(LoKO, p0="auto", seed=0))
    assert module.select == Candidates("p0", AUTO_P0, AUTO_SAMPLES)
    assert module.is_kalman
    # The tuned-lr AdamW baseline gets the same budget: as many candidates, on as many samples, the paper's lr among
    # them.
    overlay = yaml.safe_load((ROOT / "configs" / "baselines" / "adamw_tuned.yaml").read_text())
    select = overlay["model"]["select"]
    assert select["name"] == "lr" and 1e-4 in select["values"]
    assert len(select["values"]) == len(AUTO_P0) and select["samples"] == AUTO_SAMPLES
    assert overlay["model"]["optimizer"]["class_path"] == "torch.optim.AdamW"


@pytest.mark.parametrize(
    ("build", "select", "field", "message"),
    [
        (partial(LoKO, p0="auto"), Candidates("lr", (1e-4, 1e-3)), "select.name", "one selection at a time"),
        (partial(LoKO), Candidates("lr", (1e-4, 1e-3)), "lr", "no learning rate"),
        (partial(torch.optim.AdamW), Candidates("p0", (0.1, 0.2)), "select.name", "not an argument"),
    ],
)
def test_a_selection_the_optimizer_cannot_take_is_a_config_error(build, select, field, message):
    with pytest.raises(ConfigError, match=message) as info:
        tiny_selecting(select, build)
    assert info.value.field == field


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"values": (0.1,)}, "select.values"),
        ({"values": (0.1, 0.1)}, "select.values"),
        ({"values": (0.1, -1.0)}, "select.values"),
        ({"samples": 0}, "select.samples"),
        ({"name": "not a name"}, "select.name"),
    ],
)
def test_bad_candidates_name_the_field(kwargs, field):
    with pytest.raises(ConfigError) as info:
        Candidates(**kwargs)
    assert info.value.field == field


def test_loko_itself_refuses_p0_auto_and_says_where_it_works():
    with pytest.raises(ConfigError, match="OnlineClassifier") as info:
        LoKO([torch.nn.Parameter(torch.zeros(2))], p0="auto")
    assert info.value.field == "p0"


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")  # bit for bit: the bits depend on the intra-op threads
@pytest.mark.parametrize("head_covariance", ["diagonal", "shared"])  # shared: the text default's
def test_a_run_stopped_mid_selection_resumes_exactly(tmp_path, head_covariance):
    """Stop after sample 12 of 24 (checkpoint at 6, mid-selection of 16 samples) and resume: same parameters,
    filter state, scores, choice and online metrics as one uninterrupted run, bit for bit on the CPU."""
    common = ["--config", DEBUG, "--data.max_samples", "24", "--data.eval_max_samples", "8"]
    common += ["--model.select.values", "[0.01, 0.1]", "--model.select.samples", "16"]
    common += ["--model.head_covariance", head_covariance]

    def check_part(saved):
        assert saved["loko_selection"]["seen"] == 6 and saved["loko_selection"]["chosen"] is None

    full, resumed = fit_full_and_resumed(tmp_path, common, check_part)
    assert full["global_step"] == resumed["global_step"] == 24
    assert full["loko_selection"]["chosen"] == resumed["loko_selection"]["chosen"] is not None
    assert full["loko_selection"]["scores"] == resumed["loko_selection"]["scores"]
    full_params, resumed_params = trainable(full["state_dict"]), trainable(resumed["state_dict"])
    assert full_params.keys() == resumed_params.keys() and full_params
    for key in full_params:
        assert torch.equal(full_params[key], resumed_params[key]), key
    for key in ("online_acc.mean_value", "online_acc.weight", "online_acc_recent.buffer", "online_acc_recent.count"):
        assert torch.equal(full["state_dict"][key], resumed["state_dict"][key]), key
    full_opt, resumed_opt = full["optimizer_states"][0], resumed["optimizer_states"][0]
    assert full_opt["param_groups"][0]["p0"] == resumed_opt["param_groups"][0]["p0"]
    for index, state in full_opt["state"].items():
        for key, value in state.items():
            assert torch.equal(value, resumed_opt["state"][index][key]), (index, key)


@pytest.mark.slow
def test_loko_fit_with_p0_auto_chooses_the_lowest_prequential_loss(tmp_path, caplog):
    """A real `loko fit --model.optimizer.p0 auto` (8 selection samples of 12): the four AUTO_P0 candidates ran, the
    one with the lowest score won, and the run went on with its p0 and its own filter state."""
    caplog.set_level(logging.INFO)
    common = ["--config", DEBUG, "--data.max_samples", "12", "--data.eval_max_samples", "8"]
    main(["fit", *common, "--model.optimizer.p0", "auto", "--model.select.samples", "8", *outputs(tmp_path, every=12)])
    last = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    selection = last["loko_selection"]
    scores, chosen = selection["scores"], selection["chosen"]
    assert selection["seen"] == 8 and len(scores) == len(AUTO_P0) and all(math.isfinite(s) for s in scores)
    assert chosen == min(range(len(scores)), key=lambda i: (scores[i], i))
    p0 = AUTO_P0[chosen]
    summary = [r.getMessage() for r in caplog.records if r.getMessage().startswith("select: ")]
    assert len(summary) == 1 and summary[0].startswith(f"select: chose p0={p0:g} after 8 samples")
    assert all(f"p0={value:g}: " in summary[0] for value in AUTO_P0)
    optimizer = last["optimizer_states"][0]
    assert all(group["p0"] == p0 for group in optimizer["param_groups"])
    # p̂ is the winner's: drawn from U(0, p0] and only shrunk since, its largest entries still above the next
    # smaller candidate (about 10^5 draws: the chance that none lies above 1/3 of p0 is nil).
    cov = torch.cat([state["cov"].reshape(-1) for state in optimizer["state"].values()])
    assert cov.max() <= p0 and (chosen == 0 or cov.max() > AUTO_P0[chosen - 1])


def test_recent_accuracy_is_the_accuracy_of_the_last_predictions(monkeypatch):
    """A stream whose accuracy is known: 6 wrong predictions, then 4 right, with a window of 5 the recent accuracy
    after the 10th is 4/5 while the cumulative one is 4/10; a prediction that is not finite is in neither."""
    module = tiny_selecting(None, recent_window=5)
    logged = {}
    monkeypatch.setattr(module, "log_dict", lambda values, **kwargs: logged.update(values))
    # Scoring only: as for a gradient optimizer, whose one logged state is its learning rate.
    module.online_step = GradientStep()
    wrapper = SimpleNamespace(optimizer=SimpleNamespace(param_groups=[{"lr": 0.1}]))
    monkeypatch.setattr(type(module), "optimizers", lambda self: wrapper)
    label = torch.tensor([2])
    right, wrong = F.one_hot(label, 4).float(), F.one_hot(label + 1, 4).float()
    history = []
    for correct in [False] * 6 + [True] * 4:
        module._log_online(right if correct else wrong, label, 0.0)
        history.append(float(logged["train/online_acc_recent5"]))
    assert history[-1] == pytest.approx(4 / 5) and float(logged["train/online_acc"]) == pytest.approx(4 / 10)
    assert history[:6] == [0.0] * 6 and history[6:9] == pytest.approx([1 / 5, 2 / 5, 3 / 5])
    module._log_online(wrong * float("nan"), label, 0.0)  # not finite (NaN in the input): no change
    assert float(logged["train/online_acc_recent5"]) == pytest.approx(4 / 5)


@pytest.mark.parametrize(
    ("trainer_state", "message"),
    [
        ({"world_size": 2, "precision_plugin": SimpleNamespace(), "precision": "32-true"}, "several processes"),
        (
            {"world_size": 1, "precision_plugin": SimpleNamespace(scaler=object()), "precision": "16-mixed"},
            "gradient scaler",
        ),
    ],
)
def test_a_selection_refuses_what_it_cannot_run_exactly(trainer_state, message):
    """The candidates step one after another in one process through the torch optimizer: no DDP, no grad scaler."""
    from loko_lightning.learner.checks import check_selection_trainer

    with pytest.raises(ConfigError, match=message) as info:
        check_selection_trainer(SimpleNamespace(**trainer_state), owner=OnlineClassifier)
    assert info.value.field == "select"
    check_selection_trainer(
        SimpleNamespace(world_size=1, precision_plugin=SimpleNamespace(), precision="bf16-mixed"), owner=None
    )


def test_the_scored_prediction_is_the_leader_s_from_before_the_sample_when_the_lead_changes(monkeypatch):
    """The leader after scoring sample t may differ from the one before it; the learner's prediction for t must be the
    one of the leader on the samples before t (a look-ahead would take the new leader's). The stream and candidates are
    chosen so that the lead does change (checked: on this stream it passes from p0=0.01 to 1e-6 and back twice)."""
    leaders, candidates = [], []
    original_record = CandidateStates.record

    def record(self, results):
        leaders.append(self.leader)
        candidates.append([result[0].detach().clone() for result in results])
        original_record(self, results)
        leaders[-1] = (leaders[-1], self.leader)

    monkeypatch.setattr(CandidateStates, "record", record)
    torch.manual_seed(0)
    module = tiny_selecting(Candidates("p0", (0.01, 1e-6), samples=12))
    scored = predictions_of(module, stream(12), monkeypatch)
    changes = [t for t, (before, after) in enumerate(leaders) if before != after]
    assert changes, leaders  # the lead changed at least once: the test can see a look-ahead
    for t, (before, _) in enumerate(leaders):
        assert torch.equal(scored[t], candidates[t][before]), t
    t = changes[0]
    assert not torch.equal(candidates[t][leaders[t][0]], candidates[t][leaders[t][1]])
