"""Reliability: exact resume after SIGKILL, the catalogue of bad inputs and their one-line CLI errors, the divergence
guard, a 20,000-step float32 soak of the Kalman update, and device hygiene (no host syncs in the hot path, float32
Kalman arithmetic under mixed precision, CUDA = CPU)."""

import collections
import contextlib
import copy
import math
import os
import signal
import subprocess
import sys
import time
import urllib.error
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import runs
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from runs import assert_same_tensors, stream, tiny, trainable, trainer
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from loko_lightning import JacobianEngine, LoKO, jacobian
from loko_lightning.cli import main
from loko_lightning.data import MNIST5k, StreamDataModule
from loko_lightning.errors import ConfigError, DivergenceError
from loko_lightning.jacobians.blocks import OuterJacobian
from loko_lightning.kalman.filters import Covariance
from loko_lightning.learner.callbacks import GOOD_STATE_NAME, DivergenceGuard, RNGStateCheckpoint
from loko_lightning.learner.checkpoint_io import AtomicCheckpointIO

ROOT = Path(__file__).resolve().parents[1]
DEBUG = str(ROOT / "configs" / "debug.yaml")


# Tiny models: more intra-op threads only add synchronisation (conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- helpers
def outputs(tmp_path, name="run", every=10, keep_all=False):
    """Logs and checkpoints (every 10 samples) into tmp_path, no plot."""
    return runs.outputs(tmp_path, name, every=every, keep_all=keep_all, plot=False)


def run_cli(args, capsys):
    """``loko <args>`` in-process: (exit status, last stderr line, number of stderr lines that start with loko:)."""
    capsys.readouterr()
    try:
        main(args)
        code = 0
    except SystemExit as exit_info:
        code = exit_info.code
    err = capsys.readouterr().err.strip().splitlines()
    return code, (err[-1] if err else ""), sum(line.startswith("loko:") for line in err)


# ================================================================ 1. crash and resume
def assert_checkpoints_match(full, resumed):
    """Parameters, filter state (p̂, R, step), online metrics, stream position and RNG states, bit for bit."""
    assert full["global_step"] == resumed["global_step"]
    full_params, resumed_params = trainable(full["state_dict"]), trainable(resumed["state_dict"])
    assert full_params and full_params.keys() == resumed_params.keys()
    assert_same_tensors(full_params, resumed_params, "parameters")
    metrics = [
        k
        for k in full["state_dict"]
        if k.split(".")[0] in ("online_acc", "online_acc_top5", "loss_avg", "ce_avg", "skipped")
    ]
    assert len(metrics) == 9
    for key in metrics:
        assert torch.equal(full["state_dict"][key], resumed["state_dict"][key]), key
    assert_same_tensors(full["optimizer_states"], resumed["optimizer_states"], "optimizer")
    assert_same_tensors(full["callbacks"]["RNGStateCheckpoint"], resumed["callbacks"]["RNGStateCheckpoint"], "rng")
    assert (
        full["loops"]["fit_loop"]["state_dict"]["combined_loader"]
        == resumed["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    )


@pytest.mark.slow
def test_sigkilled_run_resumes_exactly(tmp_path):
    """A real `loko fit` killed with SIGKILL right after its step-20 checkpoint appears (mid-write of last.ckpt, or
    just after), restarted with the same command plus `--ckpt_path last`, ends bit for bit like an uninterrupted run:
    on the CPU every operation is deterministic, so exactness (torch.equal), not a tolerance, is the right check."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # all three runs: same threads, same sums
    common = [
        sys.executable,
        "-m",
        "loko_lightning.cli",
        "fit",
        "--config",
        DEBUG,
        "--data.max_samples",
        "60",
        "--data.eval_max_samples",
        "8",
    ]
    subprocess.run([*common, *outputs(tmp_path, "full")], cwd=ROOT, env=env, check=True, capture_output=True)

    crash = [*common, *outputs(tmp_path, "crash", keep_all=True)]
    checkpoints = tmp_path / "crash" / "checkpoints"
    with open(tmp_path / "crash.log", "w") as log:
        process = subprocess.Popen(crash, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while not (checkpoints / "epoch=0-step=20.ckpt").exists():
            assert process.poll() is None, (tmp_path / "crash.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint after 10 minutes"
            time.sleep(0.02)
        process.send_signal(signal.SIGKILL)
        assert process.wait() == -signal.SIGKILL
    killed = torch.load(checkpoints / "last.ckpt", weights_only=True)  # intact, whatever the kill interrupted
    assert killed["global_step"] in (10, 20, 30)
    print(f"killed after step {killed['global_step']}; left behind: {sorted(p.name for p in checkpoints.iterdir())}")

    resumed_run = subprocess.run([*crash, "--ckpt_path", "last"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert resumed_run.returncode == 0, resumed_run.stderr[-3000:]
    assert "over 60 samples" in resumed_run.stdout + resumed_run.stderr  # OnlineReport: no sample lost or repeated

    full = torch.load(tmp_path / "full" / "checkpoints" / "last.ckpt", weights_only=True)
    resumed = torch.load(checkpoints / "last.ckpt", weights_only=True)
    assert full["global_step"] == 60 and float(full["state_dict"]["online_acc.weight"]) == 60
    assert_checkpoints_match(full, resumed)
    assert not list(checkpoints.glob(".*.partial")), "a partial checkpoint file was left behind"


@pytest.mark.slow
def test_resume_restores_the_rng_states_for_lora_dropout(tmp_path):
    """AdamW with LoRA dropout draws from the global RNG every step: resuming from a mid-stream checkpoint (real
    stream, stateful loader) equals an uninterrupted run only because the checkpoint carries the RNG states."""

    class Crash(Exception):
        pass

    class CrashAfter12(pl.Callback):  # not max_steps: the resumed run must go on to the end of the stream
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 12:
                raise Crash

    def run(name, ckpt_path=None, crash=False, restore=True):
        pl.seed_everything(0, verbose=False)
        model = tiny(num_classes=10, optimizer="adamw", dropout=0.25)
        data = StreamDataModule(MNIST5k(image_size=32), num_classes=10, max_samples=18, eval_max_samples=4)
        checkpoint = ModelCheckpoint(dirpath=tmp_path / name, every_n_train_steps=6, save_top_k=-1, save_last=True)
        callbacks = [checkpoint, RNGStateCheckpoint()] if restore else [checkpoint]
        callbacks += [CrashAfter12()] if crash else []
        fit = trainer(enable_checkpointing=True, callbacks=callbacks, limit_val_batches=0)
        fit.fit(model, datamodule=data, ckpt_path=ckpt_path)
        return torch.load(tmp_path / name / "last.ckpt", weights_only=True)

    full = run("full")
    with pytest.raises(Crash):  # goes on past the checkpoint we resume from: the RNG moves on too
        run("part", crash=True)
    middle = tmp_path / "part" / "epoch=0-step=6.ckpt"
    assert torch.load(middle, weights_only=True)["callbacks"]["RNGStateCheckpoint"]["numpy"][0] == "MT19937"
    resumed = run("resumed", ckpt_path=middle)
    assert full["global_step"] == resumed["global_step"] == 18
    assert_checkpoints_match(full, resumed)

    # Control: resumed without the callback, the dropout masks differ.
    unrestored = run("unrestored", ckpt_path=middle, restore=False)
    assert not all(
        torch.equal(v, trainable(unrestored["state_dict"])[k]) for k, v in trainable(full["state_dict"]).items()
    )


def test_checkpoint_writes_are_atomic(tmp_path, monkeypatch):
    """A write that dies half-way (here an exception; SIGKILL in the test above) leaves the old checkpoint intact."""
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"step": torch.tensor(1)}, path)
    real_save = torch.save

    def dies_half_way(obj, handle, *args, **kwargs):
        handle.write(b"PK\x03\x04 half a zip")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"step": torch.tensor(2)}, path)
    monkeypatch.setattr(torch, "save", real_save)
    assert torch.load(path, weights_only=True)["step"] == 1
    (tmp_path / ".last.ckpt.999-dead.partial").write_bytes(b"left by a SIGKILL")
    io.save_checkpoint({"step": torch.tensor(3)}, path)
    assert torch.load(path, weights_only=True)["step"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_truncated_checkpoint_is_a_one_line_error(tmp_path, capsys):
    torch.save({"global_step": 3, "state_dict": {}}, tmp_path / "torn.ckpt")
    data = (tmp_path / "torn.ckpt").read_bytes()
    (tmp_path / "torn.ckpt").write_bytes(data[: len(data) // 2])
    code, last, count = run_cli(
        ["fit", "--config", DEBUG, "--ckpt_path", str(tmp_path / "torn.ckpt"), *outputs(tmp_path)], capsys
    )
    assert code == 2 and count == 1
    assert last.startswith(f"loko: error: --ckpt_path: {tmp_path / 'torn.ckpt'} is not a readable checkpoint")
    assert "pass an earlier checkpoint of that folder" in last


# ================================================================ 2. the bad-input catalogue
def _empty_imagefolder(tmp_path):
    (tmp_path / "empty" / "train").mkdir(parents=True)
    return ["--data.source", "ImageFolder", "--data.source.root", str(tmp_path / "empty")]


def _bad_key_file(tmp_path):
    (tmp_path / "bad.yaml").write_text("model:\n  optimizer:\n    init_args:\n      seeed: 3\n")
    return ["--config", str(tmp_path / "bad.yaml")]


_FILTER, _TIME_UPDATE = ["--model.optimizer.filter"], ["--model.optimizer.time_update"]
CATALOGUE = {
    "unknown backbone": (
        ["--model.network.backbone", "resnet181"],
        ["--model.network.backbone: unknown backbone='resnet181'", "'resnet18'"],
    ),
    "unknown option": (["--model.network.rr", "3"], ["--model.network.rr is not an option", "did you mean 'r'?"]),
    "unknown section": (["--model.netwrk.r", "3"], ["--model.netwrk.r", "did you mean 'model.network.r'"]),
    "unknown option of the optimizer": (
        ["--model.optimizer.p00", "0.1"],
        ["--model.optimizer.p00 is not an option of loko_lightning.LoKO; did you mean 'p0'?"],
    ),
    "unknown key in a config file": (
        _bad_key_file,
        ["--model.optimizer.seeed is not an option", "did you mean 'seed'"],
    ),
    "ill-typed option": (
        ["--model.optimizer.p0", "big"],
        ["--model.optimizer.p0: expected a float or 'auto', got 'big'"],
    ),
    "ill-typed option (float)": (
        ["--model.optimizer.average", "big"],
        ["--model.optimizer.average: expected a float, got 'big'"],
    ),
    "a filter setting given to LoKO": (
        ["--model.optimizer.beta", "0.9"],
        ["--model.optimizer.beta is a setting of the filter", "--model.optimizer.filter '{name: covariance, beta"],
    ),
    "a time-update field given to LoKO": (
        ["--model.optimizer.process_noise", "1e-6"],
        ["--model.optimizer.process_noise is a setting of the time update", "--model.optimizer.time_update"],
    ),
    "unknown adapter target": (
        ["--model.network.target", "[blocks.0.0.conv_dww]"],
        ["--model.network.target: unknown module(s)", "'blocks.0.0.conv_dw'"],
    ),
    "target regex matching nothing": (
        ["--model.network.target", "head_.*"],
        ["--model.network.target: target='head_.*' matches no"],
    ),
    "grouped-conv target": (
        ["--model.network.target", "[blocks.1.0.conv_dw]"],
        ["--model.network.target:", "grouped convolution", "'convs' preset"],
    ),
    "p0 zero": (["--model.optimizer.p0", "0"], ["--model.optimizer.p0: Invalid p0: 0.0", "> 0"]),
    "p0 negative": (["--model.optimizer.p0", "-0.1"], ["--model.optimizer.p0: Invalid p0: -0.1"]),
    "p0 infinite": (["--model.optimizer.p0", ".inf"], ["--model.optimizer.p0: Invalid p0: inf"]),
    "beta 0": (_FILTER + ["{name: covariance, beta: 0.0}"], ["--model.optimizer.filter: Invalid beta: 0.0", "(0, 1)"]),
    "beta 1": (_FILTER + ["{name: covariance, beta: 1.0}"], ["--model.optimizer.filter: Invalid beta: 1.0"]),
    "beta above 1": (_FILTER + ["{name: covariance, beta: 1.5}"], ["--model.optimizer.filter: Invalid beta: 1.5"]),
    "negative process noise": (
        _TIME_UPDATE + ["{process_noise: -1e-4}"],
        ["--model.optimizer.time_update: Invalid process_noise"],
    ),
    "negative p floor": (_TIME_UPDATE + ["{p_floor: -0.01}"], ["--model.optimizer.time_update: Invalid p_floor"]),
    "dropout with LoKO": (
        ["--model.network.dropout", "0.1"],
        ["--model.network.dropout: dropout=0.1 with LoKO", "set it to 0"],
    ),
    "label >= num_classes": (["--model.network.num_classes", "5"], ["--model.network.num_classes:", "has label 9"]),
    "guard check_every negative": (
        ["--trainer.callbacks+=loko_lightning.learner.DivergenceGuard", "--trainer.callbacks.check_every=-1"],
        ["check_every must be >= 0"],
    ),
    "empty dataset": (_empty_imagefolder, ["--data.", "is empty"]),
    "max_samples 0": (["--data.max_samples", "0"], ["--data.max_samples:", "must be a positive integer"]),
    "data root missing, offline": (
        lambda tmp_path: ["--data.source", "MNIST", "--data.source.root", str(tmp_path / "nothing")],
        ["no data found at", "download"],
    ),
}


@pytest.mark.parametrize("case", list(CATALOGUE))
def test_bad_input_ends_with_one_actionable_line(case, tmp_path, capsys):
    extra, expected = CATALOGUE[case]
    extra = extra(tmp_path) if callable(extra) else extra
    code, last, count = run_cli(["fit", "--config", DEBUG, *outputs(tmp_path), *extra], capsys)
    assert code == 2, last
    assert count == 1 and last.startswith("loko: error: "), last
    for text in expected:
        assert text in last, (text, last)


@pytest.mark.parametrize(
    ("extra", "error", "key"),
    [
        (["--model.optimizer.p0", "-0.1"], ConfigError, "model.optimizer.p0"),  # refused by LoKO
        (["--model.optimizer.p00", "0.1"], ValueError, None),  # refused by the parser
    ],
    ids=["bad value", "unknown option"],
)
def test_loko_traceback_raises_the_error_itself_instead_of_one_line(extra, error, key, tmp_path, capsys, monkeypatch):
    """By default a user error is one ``loko: error:`` line and exit status 2; with ``LOKO_TRACEBACK=1`` the same error
    propagates out of ``main`` (a full traceback from the console script), with the flag it names still attached."""
    args = ["fit", "--config", DEBUG, *outputs(tmp_path), *extra]
    code, last, count = run_cli(args, capsys)
    assert code == 2 and count == 1 and last.startswith("loko: error: ")
    monkeypatch.setenv("LOKO_TRACEBACK", "1")
    with pytest.raises(error) as info:
        main(args)
    assert last.endswith(" ".join(str(info.value).split()))  # the same error as the one line
    assert getattr(info.value, "key", None) == key
    assert "loko: error:" not in capsys.readouterr().err


def test_download_while_offline_says_how_to_get_the_files(tmp_path, capsys, monkeypatch):
    def offline(*args, **kwargs):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr("urllib.request.urlopen", offline)
    args = ["--data.source", "MNIST", "--data.source.root", str(tmp_path / "data"), "--data.source.download", "true"]
    code, last, count = run_cli(["fit", "--config", DEBUG, *outputs(tmp_path), *args], capsys)
    assert code == 2 and count == 1
    assert f"--data.source.download: dataset='mnist': downloading into {tmp_path / 'data'} failed" in last
    assert "Temporary failure in name resolution" in last and "put the files at" in last


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_sample_is_skipped_counted_and_checkpointed(bad, tmp_path):
    """NaN/Inf input: the sample is skipped and counted (the run goes on, never a NaN update); the count is part of
    the checkpoint, so a resumed run keeps it."""
    torch.manual_seed(0)
    model = tiny()
    items = stream(6)
    items[2]["inputs"] = items[2]["inputs"].clone()
    items[2]["inputs"][1, 3, 4] = bad
    seen = []

    class Snapshot(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            optimizer = trainer.optimizers[0]
            seen.append(
                (
                    [p.detach().clone() for p in pl_module.trainable_parameters],
                    [optimizer.state[p]["cov"].clone() for p in pl_module.trainable_parameters],
                )
            )

    fit = trainer(callbacks=[Snapshot()], default_root_dir=tmp_path)
    fit.fit(model, DataLoader(items, batch_size=1))
    assert int(model.skipped) == 1 and int(fit.optimizers[0].diagnostics["step"]) == 5
    for before, after in zip(seen[1], seen[2], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert all(torch.isfinite(p).all() for p in model.trainable_parameters)
    fit.save_checkpoint(tmp_path / "after.ckpt")
    assert int(torch.load(tmp_path / "after.ckpt", weights_only=True)["state_dict"]["skipped"]) == 1


def _closure_cases(m=3):
    model = nn.Linear(4, m)
    params = list(model.parameters())
    x, y = torch.randn(1, 4), F.one_hot(torch.tensor(1), m).float()
    prediction, jacobians = jacobian(model, x, params)
    return (
        model,
        params,
        {
            "not a tuple": (lambda: prediction, "Invalid closure result"),
            "two values": (lambda: (prediction, y), "Invalid closure result"),
            # A 2-d prediction is a batch (B, m): then the target and the blocks must be batched too.
            "batched prediction": (
                lambda: (prediction[None], y, jacobians),
                r"Invalid target: expected shape \(1, 3\)",
            ),
            "batch with unbatched jacobians": (
                lambda: (prediction[None], y[None], jacobians),
                r"Invalid jacobians\[0\]: expected shape \(1, 3, 3, 4\)",
            ),
            "target of another size": (
                lambda: (prediction, y[:2], jacobians),
                r"Invalid target: expected shape \(3,\)",
            ),
            "a jacobian missing": (lambda: (prediction, y, jacobians[:1]), r"Invalid jacobians: expected 2"),
            "jacobian of another shape": (
                lambda: (prediction, y, [jacobians[0][:, :2], jacobians[1]]),
                r"Invalid jacobians\[0\]: expected shape",
            ),
            "transposed jacobian": (
                lambda: (prediction, y, [jacobians[0].transpose(1, 2), jacobians[1]]),
                r"Invalid jacobians\[0\]",
            ),
            "outer jacobian of another shape": (
                lambda: (prediction, y, [OuterJacobian(torch.zeros(m, 2), torch.zeros(4)), jacobians[1]]),
                r"Invalid jacobians\[0\]",
            ),
        },
    )


@pytest.mark.parametrize("case", list(_closure_cases()[2]))
def test_closure_with_wrong_shapes_is_refused_and_changes_nothing(case):
    model, params, cases = _closure_cases()
    opt = LoKO(params, p0=0.1, seed=0)
    closure, message = cases[case]
    before = ([p.detach().clone() for p in params], [opt.state[p]["cov"].clone() for p in params])
    with pytest.raises(ValueError, match=message):
        opt.step(closure)
    assert all(torch.equal(a, p) for a, p in zip(before[0], params, strict=True))
    assert all(torch.equal(a, opt.state[p]["cov"]) for a, p in zip(before[1], params, strict=True))


def test_closure_changing_the_number_of_outputs_is_refused():
    model = nn.Linear(4, 3)
    params = list(model.parameters())
    opt = LoKO(params, p0=0.1, seed=0)
    prediction, jacobians = jacobian(model, torch.randn(1, 4), params)
    opt.step(lambda: (prediction, torch.eye(3)[0], jacobians))
    four = [torch.zeros(4, *p.shape) for p in params]  # consistent shapes, but 4 outputs where R is 3 x 3
    with pytest.raises(ValueError, match="expected 3 outputs, got 4"):
        opt.step(lambda: (torch.full((4,), 0.25), torch.eye(4)[0], four))


# ================================================================ 3. divergence guard
def test_divergence_from_the_cli_is_one_line_with_the_p0_to_try(tmp_path, capsys):
    args = [
        "fit",
        "--config",
        DEBUG,
        "--data.max_samples",
        "40",
        "--model.optimizer.p0",
        "1e6",
        "--model.optimizer.p0_init",
        "constant",
        *runs.outputs(tmp_path, every=10, plot=False, guard_every=10),
    ]
    code, last, count = run_cli(args, capsys)
    assert code == 3 and count == 1
    assert last.startswith("loko: error: --model.optimizer.p0: LoKO diverged by sample 10: the cross-entropy")
    assert "restart with p0 = 100000." in last
    saved = tmp_path / "run" / "checkpoints" / GOOD_STATE_NAME
    assert f"after sample 0 are saved in {saved}" in last  # diverged at the first check: the initial state
    state = torch.load(saved, weights_only=True)
    assert all(torch.isfinite(v).all() for v in trainable(state["state_dict"]).values())
    cov = [s["cov"] for s in state["optimizer_states"][0]["state"].values()]
    assert all(torch.all(c == 1e6) for c in cov)  # p̂ as initialised: nothing of the diverged updates
    # `--ckpt_path last` must not pick the good state up as a periodic checkpoint of the diverged run.
    last_files = ModelCheckpoint(dirpath=saved.parent, save_last=True)._find_last_checkpoints(None)
    assert str(saved) not in last_files


def test_divergence_guard_stops_a_growing_p_hat_and_names_the_process_noise(tmp_path):
    """p̂ only grows by the process noise (p̂ ≤ p0 + k q): with p0 = q = 1e-6 its largest entry is 6e-6 after 5 samples
    (below 8 p0: the check passes) and 1.1e-5 after 10 (the guard trips). The state of sample 5 is restored and
    saved, and the error names process_noise (a smaller p0 would lower the limit and trip sooner)."""
    torch.manual_seed(0)
    model = tiny(p0=1e-6, p0_init="constant", time_update={"process_noise": 1e-6})
    guard = DivergenceGuard(check_every=5, divergence_ce=None, p_limit=8)
    fit = trainer(callbacks=[guard], default_root_dir=tmp_path)
    with pytest.raises(
        DivergenceError,
        match=r"^LoKO diverged by sample 10: the largest covariance entry p̂ is 1\.1e-05, above 8 x p0 = 8e-06\. "
        r"p̂ grows by the process noise q each sample: restart with time_update: \{process_noise: 1e-07\}\. "
        r"The parameters and filter state after sample 5 are saved in .*good-before-divergence\.ckpt\.$",
    ) as info:
        fit.fit(model, DataLoader(stream(20), batch_size=1))
    assert (info.value.field, info.value.owner) == ("process_noise", LoKO)
    saved = torch.load(tmp_path / GOOD_STATE_NAME, weights_only=True)
    cov = torch.cat([s["cov"].reshape(-1) for s in saved["optimizer_states"][0]["state"].values()])
    # p0 + 5 q in float32: five roundings of at most eps32 / 2 each, under 1e-6 relative (the largest entry is one
    # whose Jacobian was zero or negligible, so the update did not shrink it).
    assert cov.max().item() == pytest.approx(6e-6, rel=1e-6)
    live = torch.cat([fit.optimizers[0].state[p]["cov"].reshape(-1) for p in model.trainable_parameters])
    assert torch.equal(live, cov)  # the live filter state is restored too
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert torch.equal(saved["state_dict"][name], param.detach())


def test_divergence_guard_catches_nonfinite_baseline_parameters(tmp_path):
    """A baseline parameter that became NaN makes every later loss NaN (all skipped, silently): the guard stops."""
    torch.manual_seed(0)
    model = tiny(optimizer="adamw", lr=1e-4)

    class Poison(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 5:
                with torch.no_grad():
                    pl_module.trainable_parameters[-1].fill_(float("nan"))

    with pytest.raises(
        DivergenceError,
        match=r"^AdamW diverged by sample 8: a trainable parameter is NaN .*"
        r"lr = 1e-05\. .*after sample 4 are saved",
    ) as info:
        fit = trainer(callbacks=[Poison(), DivergenceGuard(check_every=4)], default_root_dir=tmp_path)
        fit.fit(model, DataLoader(stream(12), batch_size=1))
    assert (info.value.field, info.value.owner) == ("lr", torch.optim.AdamW)
    saved = torch.load(tmp_path / GOOD_STATE_NAME, weights_only=True)
    assert all(torch.isfinite(v).all() for v in trainable(saved["state_dict"]).values())


def test_divergence_guard_stops_a_loko_that_applies_none_of_its_updates(tmp_path, monkeypatch):
    """From sample 5 on the filter refuses every update of a finite stream (its prior scale forced not finite, as the
    collapsed r_estimator: softmax run's was): its predictions are still scored, so only the count of applied updates
    shows it. The guard passes at 4 (updates applied), stops at 8 (none applied since 4) and names the filter."""
    from loko_lightning.kalman.filters import covariance as covariance_module

    torch.manual_seed(0)
    model = tiny(p0=0.1, filter={"name": "covariance", "prior_scale_rate": 0.03})
    real, calls = covariance_module.prior_scale_gradient, []

    def failing_from_the_fifth(*args):
        calls.append(None)
        return torch.tensor(float("nan")) if len(calls) >= 5 else real(*args)

    monkeypatch.setattr(covariance_module, "prior_scale_gradient", failing_from_the_fifth)
    with pytest.raises(
        DivergenceError,
        match=r"^LoKO diverged by sample 8: none of its last 4 updates was applied: .*r_estimator: taylor .*"
        r"after sample 4 are saved",
    ) as info:
        fit = trainer(callbacks=[DivergenceGuard(check_every=4)], default_root_dir=tmp_path)
        fit.fit(model, DataLoader(stream(12), batch_size=1))
    assert (info.value.field, info.value.owner) == ("filter", LoKO)
    assert int(model.skipped) == 4


# ================================================================ 4. numerical soak
@pytest.mark.slow
def test_float32_soak_of_20000_steps_on_a_100_class_head():
    """20,000 float32 LoKO steps, 100 classes, a stream of exact duplicates (runs of 8 repeats) and inputs scaled so
    that the softmax is near one-hot (often exactly one-hot in float32, so H ≈ 0 and S ≈ R, singular). Nothing may go
    non-finite, p̂ stays > 0 and the S pseudo-inverse never fails (every step applied, none skipped)."""
    torch.manual_seed(0)
    m, d, steps = 100, 16, 20_000
    model = nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Linear(32, m))
    params = list(model.parameters())
    opt = LoKO(params, p0=0.2, seed=0, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    pool_x, pool_y = torch.randn(40, d, generator=gen), torch.randint(m, (40,), generator=gen)
    draws = torch.randint(40, (steps,), generator=gen)
    cond, p_min, top = torch.empty(steps), torch.empty(steps), torch.empty(steps)
    start = time.perf_counter()
    for k in range(steps):
        i = draws[k - k % 8] if (k // 8) % 4 == 0 else draws[k]  # one block of 8 in 4 repeats a single sample
        x = pool_x[i][None] * (20.0 if k % 3 == 0 else 1.0)  # ReLU net: logits x20, softmax near one-hot
        y = F.one_hot(pool_y[i], m).float()

        def closure(x=x, y=y):
            prediction, jacobians = jacobian(model, x, params, factorize=True)
            return prediction, y, jacobians

        prediction, _, _ = opt.step(closure)
        diagnostics = opt.diagnostics
        cond[k], p_min[k], top[k] = diagnostics["cond"], diagnostics["p_min"], prediction.max()
    elapsed = time.perf_counter() - start
    state = opt.state[params[0]]
    assert int(diagnostics["step"]) == steps and int(diagnostics["skipped"]) == 0
    assert all(torch.isfinite(p).all() for p in params)
    assert all(torch.isfinite(opt.state[p]["cov"]).all() and (opt.state[p]["cov"] > 0).all() for p in params)
    assert torch.isfinite(state["R"]).all() and state["R"].dtype == torch.float32
    assert torch.isfinite(cond).all() and (p_min > 0).all()
    assert (top > 1 - 1e-6).float().mean() > 0.1, "the stream should hold many near-one-hot predictions"
    print(
        f"soak: {steps} steps in {elapsed:.0f} s; worst kept-spectrum condition number of S {cond.max():.3g} "
        f"(cut-off 1/rcond = {1 / (10 * m * torch.finfo(torch.float32).eps):.3g}); min p̂ {p_min.min():.3g}; "
        f"{100 * (top > 1 - 1e-6).float().mean():.0f}% predictions within 1e-6 of one-hot"
    )


# ================================================================ 5. device hygiene
HOST_READS = ("item", "cpu", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__")


@contextlib.contextmanager
def count_host_reads():
    """Count the Python-level ways to read a tensor on the host (each a device sync on a GPU)."""
    counts = collections.Counter()
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counting(name, method):
        def wrapper(self, *args, **kwargs):
            # torch.optim's AdamW/Adagrad read their step counters, kept on the CPU by design: no device sync.
            if f"torch{os.sep}optim{os.sep}" not in sys._getframe(1).f_code.co_filename:
                counts[name] += 1
            return method(self, *args, **kwargs)

        return wrapper

    for name, method in saved.items():
        setattr(torch.Tensor, name, counting(name, method))
    try:
        yield counts
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def check_warmup():
    """``(steps, reads)`` of the observation check's warm-up after a layout's first step: its count is read after
    1, 2, 4, ... steps below CHECK_EVERY (so a prediction gone wrong early is refused early), then every CHECK_EVERY."""
    from loko_lightning.kalman.optimizer import CHECK_EVERY

    steps, reads, window = 0, 0, 1
    while window < CHECK_EVERY:
        steps, reads, window = steps + window, reads + 1, 2 * window
    return steps, reads


def test_loko_step_and_jacobian_read_nothing_on_the_host():
    """Past the check's warm-up (one int read after 1, 2, 4, ... 64 steps of a layout), a step reads nothing."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 10))
    params = list(model.parameters())
    opt = LoKO(params, p0=0.1, seed=0)
    x, y = torch.randn(1, 3, 8, 8), F.one_hot(torch.tensor(2), 10).float()

    def closure():
        prediction, jacobians = jacobian(model, x, params, factorize=True)
        return prediction, y, jacobians

    opt.step(closure)
    warmup_steps, warmup_reads = check_warmup()
    with count_host_reads() as counts:
        for _ in range(warmup_steps):
            opt.step(closure)
    assert dict(counts) == {"__int__": warmup_reads}
    with count_host_reads() as counts:
        for _ in range(3):
            opt.step(closure)
        diagnostics = opt.diagnostics
    assert not counts, counts
    assert bool(diagnostics["applied"])


@pytest.mark.parametrize(("optimizer", "allowed"), [("loko", {}), ("adamw", {"__bool__": 1})])
def test_training_step_reads_nothing_on_the_host_beyond_the_documented(optimizer, allowed):
    """LoKO's training step (prediction, Jacobian, update, metrics, logging without a progress bar) reads nothing on
    the host past its observation check's warm-up (a few reads early in a stream); the baselines read one bool per
    step (a NaN loss must not reach AdamW's moments). The divergence guard (every guard_every samples) and Lightning's
    logger are outside the step and read by design."""
    torch.manual_seed(0)
    model = tiny(optimizer=optimizer)
    counts, steps = collections.Counter(), []
    original = model.training_step
    warmup_steps, _ = check_warmup()  # LoKO's observation check reads early in a stream (test above)

    def counted(batch, batch_idx):
        with count_host_reads() as step_counts:
            original(batch, batch_idx)
        if batch_idx > warmup_steps:  # the first step creates the filter state
            counts.update(step_counts)
            steps.append(batch_idx)

    model.training_step = counted
    trainer().fit(model, DataLoader(stream(warmup_steps + 4), batch_size=1))
    assert len(steps) == 3
    assert dict(counts) == {name: n * len(steps) for name, n in allowed.items()}


def test_float16_mixed_precision_is_refused_with_the_fix():
    """``16-mixed`` would scale a loss LoKO never backpropagates (on a GPU the scaler calls step() without the
    closure): refused in one error naming the precision and the fix, before any step; bf16-mixed is tested below.
    On a CPU Lightning turns ``precision="16-mixed"`` into bf16, so the GPU's plugin (with its gradient scaler) is
    built by hand."""
    fit = trainer(plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))])
    with pytest.raises(
        ConfigError, match=r"precision '16-mixed'.*To fix it: precision bf16-mixed .* or 32-true"
    ) as err:
        fit.fit(tiny(), DataLoader(stream(2), batch_size=1))
    assert err.value.field == "precision" and fit.global_step == 0


@pytest.mark.parametrize("kalman_dtype", ["float32", "float64"])
def test_kalman_update_keeps_its_dtype_under_bf16_mixed_precision(kalman_dtype, monkeypatch):
    """Under `precision="bf16-mixed"` the forward pass and the Jacobian run under autocast (bf16), the Kalman update
    with autocast off in the filter dtype: p̂ and R stay float32 (or float64) and nothing is NaN."""
    calls = []
    real_propose, real_observe = Covariance.propose, JacobianEngine.observe

    def propose(self, plan, evidence, belief, reduce=None):
        calls.append(("update", torch.is_autocast_enabled("cpu"), belief.cov.dtype, belief.R.dtype))
        return real_propose(self, plan, evidence, belief, reduce)

    def jacobian_under(engine, inputs, label, **kwargs):
        calls.append(("jacobian", torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return real_observe(engine, inputs, label, **kwargs)

    monkeypatch.setattr(Covariance, "propose", propose)
    monkeypatch.setattr(JacobianEngine, "observe", jacobian_under)
    torch.manual_seed(0)
    model = tiny(dtype=getattr(torch, kalman_dtype))
    fit = trainer(precision="bf16-mixed")
    fit.fit(model, DataLoader(stream(6), batch_size=1))
    dtype = getattr(torch, kalman_dtype)
    assert calls[0::2] == [("jacobian", True, torch.bfloat16)] * 6
    assert calls[1::2] == [("update", False, dtype, dtype)] * 6
    opt = fit.optimizers[0]
    assert int(opt.diagnostics["step"]) == 6 and int(model.skipped) == 0
    for param in model.trainable_parameters:
        assert param.dtype == torch.float32 and torch.isfinite(param).all()
        assert opt.state[param]["cov"].dtype == dtype and (opt.state[param]["cov"] > 0).all()
    R = opt.state[model.trainable_parameters[0]]["R"]
    assert R.dtype == dtype and torch.isfinite(R).all()
    assert math.isfinite(float(fit.logged_metrics["train/loss_avg1000"]))


def _mlp_problem(m=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, m))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    xs = torch.randn(4, 1, 8, generator=gen)
    ys = F.one_hot(torch.randint(m, (4,), generator=gen), m).float()
    return model, xs, ys


def _run_loko(model, xs, ys, device, dtype=torch.float32):
    model = model.to(device=device, dtype=dtype)
    params = list(model.parameters())
    opt = LoKO(params, p0=0.1, p0_init="constant", dtype=dtype)
    conds = []
    for x, y in zip(xs, ys, strict=True):
        x, y = x.to(device, dtype), y.to(device, dtype)

        def closure(x=x, y=y):
            prediction, jacobians = jacobian(model, x, params, factorize=True)
            return prediction, y, jacobians

        opt.step(closure)
        conds.append(opt.diagnostics["cond"])
    flat = torch.cat([p.detach().reshape(-1) for p in params]).double().cpu()
    cov = torch.cat([opt.state[p]["cov"].reshape(-1) for p in params]).double().cpu()
    return flat, cov, max(float(c) for c in conds)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_float32_loko_is_within_rounding_of_float64(device):
    """Four float32 LoKO steps (on the CPU, and on CUDA where there is one) against float64 from the same state: the
    CUDA and CPU steps agree because each lies within float32 rounding of the exact result. The bound, per norm: each
    step rounds the stored parameters (|θ|·eps) and computes the update from sums of <= n = 229 products (relative
    error <= n·eps of H P Hᵀ, S, Hᵀw), which the pseudo-inverse of S amplifies by at most its kept condition number
    κ; so |θ_32 - θ_64| <= eps·(4·|θ| + κ·n·|θ_64 - θ_0|), and likewise for p̂. A worst-case bound (on the CPU the
    error is ~1e-3 of it), yet a wrong kernel or a lost update misses it by orders of magnitude."""
    model, xs, ys = _mlp_problem()
    start = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
    exact, exact_cov, kappa = _run_loko(copy.deepcopy(model), xs, ys, "cpu", torch.float64)
    params, cov, _ = _run_loko(copy.deepcopy(model), xs, ys, device)
    n, eps, steps = start.numel(), torch.finfo(torch.float32).eps, len(xs)
    assert n == 229 and kappa < 1e4
    assert (params - exact).norm() <= eps * (steps * exact.norm() + kappa * n * (exact - start).norm())
    assert (cov - exact_cov).norm() <= eps * (steps * exact_cov.norm() + kappa * n * (exact_cov - 0.1).norm())


@pytest.mark.gpu
def test_loko_hot_path_syncs_on_cuda_only_in_the_eigendecomposition():
    """With CUDA's sync debug mode, a LoKO step (Jacobian + update) syncs no more than one `torch.linalg.eigh` of the
    same size does alone (LAPACK-style error checking reads an info flag on the host); nothing else may sync."""
    model, xs, ys = _mlp_problem(m=10)
    model = model.cuda()
    params = list(model.parameters())
    opt = LoKO(params, p0=0.1, seed=0)
    x, y = xs[0].cuda(), ys[0].cuda()

    def closure():
        prediction, jacobians = jacobian(model, x, params, factorize=True)
        return prediction, y, jacobians

    opt.step(closure)
    spd = torch.eye(10, device="cuda") + 0.1
    torch.linalg.eigh(spd)
    torch.cuda.synchronize()

    def syncs(fn, repeat=3):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(repeat):
                    fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in record)

    baseline = syncs(lambda: torch.linalg.eigh(spd))
    assert syncs(lambda: opt.step(closure)) <= baseline
