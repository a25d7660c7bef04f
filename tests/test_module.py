import copy
import math
import subprocess
import sys
import warnings
from functools import partial
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from loko_helpers import variant
from runs import loader, outputs, stream, tiny, trainer
from torch.nn import functional as F

from loko_lightning import JacobianEngine, LoKO, jacobian
from loko_lightning.cli import LoKOCLI, main
from loko_lightning.data import StreamDataModule
from loko_lightning.errors import ConfigError, DivergenceError
from loko_lightning.learner.callbacks import DivergenceGuard, OnlineReport
from loko_lightning.learner.module import OnlineClassifier, ignore_intended_warnings
from loko_lightning.models import TimmClassifier

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("optimizer", ["loko", "adamw", "adagrad"])
def test_every_optimizer_steps_and_counts_global_steps(optimizer):
    torch.manual_seed(0)
    module = tiny(optimizer=optimizer)
    before = [p.detach().clone() for p in module.trainable_parameters]
    t = trainer()
    t.fit(module, loader(stream(12)))
    assert t.global_step == 12
    moved = [not torch.equal(a, b) for a, b in zip(before, module.trainable_parameters, strict=True)]
    assert any(moved)
    metrics = t.logged_metrics
    assert 0.0 <= float(metrics["train/online_acc"]) <= 1.0
    assert float(metrics["train/online_acc_top5"]) >= float(metrics["train/online_acc"])
    assert math.isfinite(float(metrics["train/loss_avg1000"]))
    if optimizer == "loko":
        assert isinstance(t.optimizers[0], LoKO)
        assert int(t.optimizers[0].diagnostics["step"]) == 12
        assert float(metrics["train/skipped"]) == 0
    # Frozen backbone: normalisation layers stayed in eval mode through training.
    assert not any(m.training for m in module.network.modules() if isinstance(m, torch.nn.BatchNorm2d))


def baseline(name, *overrides):
    """The optimizer and scheduler callables of ``configs/baselines/<name>.yaml``, as the CLI builds them."""
    args = ["--config", str(CONFIGS / "debug.yaml"), "--config", str(CONFIGS / "baselines" / f"{name}.yaml")]
    cli = LoKOCLI(OnlineClassifier, StreamDataModule, args=[*args, "--trainer.logger", "false", *overrides], run=False)
    return cli.model.optimizer_factory, cli.model.lr_scheduler_factory


def test_baseline_schedules_are_the_papers():
    torch.manual_seed(0)
    optimizer, scheduler = baseline("adamw", "--model.lr_scheduler.total_iters", "10")
    module = OnlineClassifier(tiny().network_factory, optimizer, scheduler)
    t = trainer()
    lrs = []

    class Record(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    t.callbacks.append(Record())
    t.fit(module, loader(stream(10)))
    opt = t.optimizers[0]
    assert isinstance(opt, torch.optim.AdamW)
    group = opt.param_groups[0]
    assert group["weight_decay"] == 1e-4 and group["betas"] == (0.9, 0.999)
    # lr 1e-4 decaying linearly to 0 over the 10-sample stream: sample k uses 1e-4 (1 - k/10).
    assert lrs == pytest.approx([1e-4 * (1 - k / 10) for k in range(10)], rel=1e-12)
    assert group["lr"] == 0.0

    optimizer, scheduler = baseline("adagrad")
    assert scheduler is None
    module = OnlineClassifier(tiny().network_factory, optimizer)
    t = trainer()
    t.fit(module, loader(stream(5)))
    opt = t.optimizers[0]
    assert isinstance(opt, torch.optim.Adagrad)
    assert opt.param_groups[0]["lr"] == 1e-3 and opt.param_groups[0]["weight_decay"] == 0


def test_online_accuracy_is_prequential():
    """Repeat one sample the model gets wrong: LoKO learns it on the first update, so the post-update
    prediction is right, yet the first sample must count as a miss (test-then-train)."""
    torch.manual_seed(0)
    module = tiny(p0=5.0, p0_init="constant")
    item = stream(1)[0]
    module.eval()
    with torch.no_grad():
        first = module(item["inputs"][None]).argmax().item()
    wrong = (first + 1) % 4
    item["label"] = torch.tensor(wrong)
    t = trainer(max_steps=1)
    t.fit(module, loader([item]))
    with torch.no_grad():
        after = module(item["inputs"][None]).argmax().item()
    assert after == wrong, "the update should have taught the model this sample"
    assert float(t.logged_metrics["train/online_acc"]) == 0.0

    # One more step on the same sample: now the pre-update prediction is right, so the average is 1/2.
    module2 = copy.deepcopy(module)
    t2 = trainer()
    t2.fit(module2, loader([item]))
    assert module2.online_acc.compute().item() == pytest.approx(0.5)


def test_loko_updates_match_the_plain_optimizer():
    """The module's LoKO step is exactly LoKO.step on the same Jacobian: the Lightning plumbing adds nothing."""
    torch.manual_seed(0)
    module = tiny(p0=0.05, p0_init="constant")  # deterministic p̂0, so both sides start from the same state
    reference = copy.deepcopy(module.network)
    items = stream(5)
    trainer().fit(module, loader(items))

    params = [p for p in reference.parameters() if p.requires_grad]
    opt = LoKO(params, p0=0.05, p0_init="constant")
    for item in items:
        x, y = item["inputs"][None], F.one_hot(item["label"], 4).float()

        def closure(x=x, y=y):
            prediction, jacobians = jacobian(reference, x, params, factorize=True)
            return prediction, y, jacobians

        opt.step(closure)
    for p, q in zip(params, module.trainable_parameters, strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("observation", ["natural", "natural_exact", "topk1"])
def test_label_dependent_updates_in_the_learner_match_the_plain_optimizer(observation):
    """The learner hands the optimizer's observation to its Jacobian engine, which then takes the label."""
    torch.manual_seed(0)
    module = tiny(p0=0.05, p0_init="constant", **variant(observation))
    reference = copy.deepcopy(module.network)
    items = stream(5)
    trainer().fit(module, loader(items))
    assert module.online_acc.update_count == 5

    params = [p for p in reference.parameters() if p.requires_grad]
    opt = LoKO(params, p0=0.05, p0_init="constant", **variant(observation))
    engine = JacobianEngine(reference, params, observation=opt.observation, factorize=True)
    for item in items:
        opt.step(lambda item=item: engine.observe(item["inputs"][None], item["label"][None]))
    for p, q in zip(params, module.trainable_parameters, strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    ("kwargs", "field", "owner", "message"),
    [
        ({"dropout": 0.1}, "dropout", TimmClassifier, r"^dropout=0.1 with LoKO"),
        ({"p0": -1.0}, "p0", LoKO, r"^Invalid p0"),
        ({"filter": {"name": "covariance", "beta": 1.5}}, "filter", LoKO, r"^Invalid beta"),
        ({"time_update": {"process_noise": -1.0}}, "process_noise", LoKO, r"^Invalid process_noise"),
        ({"dtype": torch.float16}, "dtype", LoKO, r"^Invalid dtype"),
        ({"optimizer": "adamw", "lr": -1.0}, None, torch.optim.AdamW, r"^Invalid learning rate"),
        ({"window": 0}, "window", OnlineClassifier, r"^window must be a positive integer"),
    ],
)
def test_bad_hyperparameters_fail_before_the_network_is_built(kwargs, field, owner, message, monkeypatch):
    """The error names the argument and its owner (the CLI turns them into a flag) and comes before any download."""

    def never(self):
        raise AssertionError("the network was built before the hyperparameters were checked")

    monkeypatch.setattr(TimmClassifier, "__call__", never)
    with pytest.raises(ConfigError, match=message) as info:
        tiny(**kwargs)
    assert (info.value.field, info.value.owner) == (field, owner)
    assert "--" not in str(info.value) and "model." not in str(info.value)


def test_a_schedule_shorter_or_longer_than_the_stream_is_reported():
    module = tiny(optimizer="adamw", lr_scheduler=partial(torch.optim.lr_scheduler.LinearLR, total_iters=50))
    with pytest.warns(UserWarning, match="total_iters=50 steps but this stream has 6 samples; set total_iters to 6"):
        trainer().fit(module, loader(stream(6)))


def test_loko_with_a_scheduler_or_lr_monitor_is_a_config_error_naming_p_hat(tmp_path):
    """LoKO has no learning rate: OnlineClassifier refuses a scheduler at construction (before the network is built)
    and Lightning's real LearningRateMonitor when the fit starts, naming what plays that role (p-hat, loko/p_mean)."""
    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import CSVLogger

    scheduler = partial(torch.optim.lr_scheduler.LinearLR, total_iters=10)
    with pytest.raises(ConfigError, match="LoKO has no learning rate to schedule.*p0.*remove lr_scheduler") as err:
        tiny(lr_scheduler=scheduler)
    assert err.value.field == "lr_scheduler"
    tiny(optimizer="adamw", lr_scheduler=scheduler)  # gradient optimizers take one as before
    t = trainer(logger=CSVLogger(tmp_path), callbacks=[LearningRateMonitor()])
    with pytest.raises(ConfigError, match="LearningRateMonitor has nothing to log with LoKO.*loko/p_mean") as err:
        t.fit(tiny(), loader(stream(2)))
    assert err.value.owner is LearningRateMonitor
    monitor = LearningRateMonitor()
    t = trainer(logger=CSVLogger(tmp_path), callbacks=[monitor], log_every_n_steps=1)
    t.fit(tiny(optimizer="adamw", lr=1e-3), loader(stream(2)))
    assert list(monitor.lrs) == ["lr-AdamW"] and set(monitor.lrs["lr-AdamW"]) == {1e-3}


@pytest.mark.parametrize("optimizer", ["loko", "adamw", "adagrad"])
def test_nan_sample_is_skipped_counted_and_left_out_of_the_metrics(optimizer):
    torch.manual_seed(0)
    module = tiny(optimizer=optimizer)
    items = stream(6)
    items[3]["inputs"] = items[3]["inputs"].clone()
    items[3]["inputs"][0, 0, 0] = float("nan")
    snapshots = []

    class Snapshot(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            snapshots.append([p.detach().clone() for p in pl_module.trainable_parameters])

    t = trainer(callbacks=[Snapshot()])
    t.fit(module, loader(items))
    assert t.global_step == 6
    assert int(module.skipped) == 1
    assert float(t.logged_metrics["train/skipped"]) == 1
    for before, after in zip(snapshots[2], snapshots[3], strict=True):
        assert torch.equal(before, after), "the NaN sample changed a parameter"
    assert all(torch.isfinite(p).all() for p in module.trainable_parameters)
    assert int(module.loss_avg.count) == 5
    # The online accuracy averages the 5 finite samples only; the stream's NLL and ECE stay finite (NaN x 0 is NaN).
    assert module.online_acc.weight.item() == 5
    assert module.nll.weight.item() == 5 and math.isfinite(float(module.nll.compute()))
    assert int(module.ece.count.sum()) == 5 and math.isfinite(float(module.ece.compute()))


@pytest.mark.parametrize("optimizer", ["loko", "adamw"])
def test_the_guard_warns_of_updates_skipped_since_its_last_check(optimizer):
    """A NaN sample is neither fatal nor silent: the check after it (every 3 samples) warns with the count, the
    checks before and after it do not, and the run goes on to the end."""
    torch.manual_seed(0)
    items = stream(9)
    items[4]["inputs"] = items[4]["inputs"].clone()
    items[4]["inputs"][0, 0, 0] = float("nan")
    t = trainer(callbacks=[DivergenceGuard(check_every=3)])
    with pytest.warns(UserWarning, match=r"update was skipped") as caught:
        t.fit(tiny(optimizer=optimizer), loader(items))
    messages = [str(w.message) for w in caught if "skipped in the" in str(w.message)]
    assert messages == [messages[0]] and "1 update was skipped in the 3 steps before step 6 (1 in all" in messages[0]
    assert t.global_step == 9


def test_a_finite_prediction_is_scored_though_the_filter_skips_its_update(monkeypatch):
    """Prequential: the prediction is made before the update, so whether the update is then applied does not decide
    whether it is scored. A filter that refuses a step (its prior scale not finite, as a collapsed filter's was) on a
    finite prediction: the step is counted as skipped and nothing is updated, but the sample counts in the accuracy,
    the NLL and the windows (only a prediction that is not finite, from NaN in the input, is left out)."""
    from loko_lightning.kalman.filters import covariance as covariance_module

    torch.manual_seed(0)
    module = tiny(filter={"name": "covariance", "prior_scale_rate": 0.03})
    real, calls = covariance_module.prior_scale_gradient, []

    def failing_once(*args):
        calls.append(None)
        return torch.tensor(float("nan")) if len(calls) == 4 else real(*args)

    monkeypatch.setattr(covariance_module, "prior_scale_gradient", failing_once)
    snapshots = []

    class Snapshot(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            snapshots.append([p.detach().clone() for p in pl_module.trainable_parameters])

    report = OnlineReport(plot=False)
    t = trainer(callbacks=[Snapshot(), report])
    t.fit(module, loader(stream(6)))
    assert int(module.skipped) == 1
    # The summary says what each count counts: 6 samples scored, 1 update skipped (7 > 6 by design, not a sample lost).
    assert "over 6 samples" in report.lines[0] and "; 1 update skipped)" in report.lines[0]
    assert all(torch.equal(a, b) for a, b in zip(snapshots[2], snapshots[3], strict=True))
    assert module.online_acc.weight.item() == 6
    assert int(module.loss_avg.count) == 6 and int(module.nll_recent.count) == 6


def test_guard_tripping_at_its_first_check_points_at_a_confidently_wrong_head(tmp_path):
    """A huge random head is confidently wrong before any update: the message says so, not only "p0 too large"."""
    torch.manual_seed(0)
    module = tiny(p0=1e-8, head_init="timm")
    with torch.no_grad():
        for param in module.network.base_model.model.fc.modules_to_save.default.parameters():
            param.mul_(1e3)
    with pytest.raises(
        DivergenceError,
        match=r"by sample 10: the cross-entropy .* p0 = 1e-09 \(or: it was "
        r"above the limit at the first check.*head_init = 'zeros'\)",
    ) as info:
        trainer(default_root_dir=tmp_path, callbacks=[DivergenceGuard(10)]).fit(module, loader(stream(40)))
    assert (info.value.field, info.value.owner) == ("p0", LoKO)


def test_divergence_guard_stops_with_the_p0_to_try_and_saves_the_last_good_state(tmp_path):
    """The guard passes at sample 20, trips at 40 and restores and saves the state of sample 20.

    The divergence is made deterministic rather than left to a chaotic trajectory (whether p0 = 1e6 blows up
    on this stream depends on the seed and on the machine's rounding): from sample 20 on the images are scaled
    by 1e3, so the logits of the (nearly frozen, p0 = 1e-8) ReLU network grow about 1e3-fold and every sample it
    gets wrong costs a cross-entropy in the hundreds, far above the limit 3 log 4 = 4.2.
    """
    torch.manual_seed(0)
    module = tiny(p0=1e-8, p0_init="constant", head_init="timm")
    items = stream(60)
    for item in items[20:]:
        item["inputs"] = item["inputs"] * 1e3
    t = trainer(default_root_dir=tmp_path, callbacks=[DivergenceGuard(check_every=20)])
    with pytest.raises(
        DivergenceError,
        match=r"^LoKO diverged by sample 40: the cross-entropy .* "
        r"restart with p0 = 1e-09\. The parameters and filter state "
        r"after sample 20 .*good-before-divergence.ckpt",
    ):
        t.fit(module, loader(items))
    checkpoint = torch.load(tmp_path / "good-before-divergence.ckpt", weights_only=False)
    saved = checkpoint["state_dict"]
    for name, param in module.named_parameters():
        if param.requires_grad:
            assert torch.equal(saved[name], param.detach())
    assert all(torch.isfinite(v).all() for v in saved.values() if v.is_floating_point())


INTENDED = (
    "Found 3 module(s) in eval mode at the start of training. This may lead to unexpected behavior",
    "Using ModelCheckpoint with manual optimization and every_n_train_steps, but no pre-optimization state was saved",
)


def test_importing_the_package_leaves_the_warning_filters_alone():
    """A user's own Trainer run shows Lightning's warnings as it would without the package imported."""
    code = (
        "import warnings\n"
        "import loko_lightning, loko_lightning.cli, loko_lightning.learner\n"
        f"for message in {INTENDED!r}:\n"
        "    assert not any(f[1] is not None and f[1].match(message) for f in warnings.filters), message\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_intended_warnings_are_ignored_inside_the_context_and_the_cli_only(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ignore_intended_warnings():
            for message in INTENDED:
                warnings.warn(message, stacklevel=1)
        assert not caught
        warnings.warn(INTENDED[0], stacklevel=1)
        assert len(caught) == 1
        caught.clear()
        config = ["--config", str(CONFIGS / "debug.yaml"), "--data.max_samples", "4", "--data.eval_max_samples", "2"]
        main(["fit", *config, *outputs(tmp_path, every=2)])
    assert not [w for w in caught if any(str(w.message).startswith(m[:40]) for m in INTENDED)]
