"""benchmarks/compare.py and benchmarks/p0_range.py on a tiny setting built from configs/debug.yaml."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DEBUG = ["--config", str(ROOT / "configs" / "debug.yaml")]
# A random-weight timm test network on 20 mnist5k digits at 32 px (debug.yaml's data), windows of 10 samples.
NETWORK = ["--model.network.backbone", "test_resnet", "--model.network.pretrained", "false"]
NETWORK += ["--model.network.weights", "null"]
TINY = [*NETWORK, "--model.window", "10"]
# One thread: tiny tensors gain nothing from two, and two threads crawl on a loaded shared machine.
SCRIPT = [*DEBUG, "--samples", "20", "--threads", "1"]


@pytest.fixture(scope="module")
def scripts():
    """The benchmark modules, imported as the scripts import each other (benchmarks/ on sys.path)."""
    pytest.importorskip("mlxtend")
    pytest.importorskip("matplotlib")
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))
        import common
        import compare
        import drift_recovery
        import p0_range
        import peers_table
        import scale

    return SimpleNamespace(
        common=common,
        compare=compare,
        drift_recovery=drift_recovery,
        p0_range=p0_range,
        scale=scale,
        peers_table=peers_table,
    )


@pytest.fixture(autouse=True)
def _restore_threads():
    """The scripts' --threads sets torch's global thread count; give the next tests theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_compare_end_to_end(scripts, tmp_path):
    compare = scripts.compare
    summary = compare.main([*SCRIPT, "--seeds", "0", "--warmup", "2", "--out", str(tmp_path), "--", *TINY])

    with (tmp_path / "metrics.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0]) == list(compare.CSV_FIELDS)
    assert len(rows) == 3 * 20
    for optimizer in ("loko", "adamw", "adagrad"):
        mine = [r for r in rows if r["optimizer"] == optimizer]
        assert [int(r["step"]) for r in mine] == list(range(1, 21))
        for r in mine:
            assert 0.0 <= float(r["online_acc"]) <= 1.0
            assert 0.0 <= float(r["loss_avg"]) <= 2.0
            assert float(r["step_time"]) > 0
    assert (tmp_path / "compare.png").read_bytes()[:8] == PNG_MAGIC
    assert (tmp_path / "reliability.png").read_bytes()[:8] == PNG_MAGIC
    # The calibration columns: the learner's prequential NLL and ECE (a fraction) after every step.
    for r in rows:
        assert float(r["nll"]) > 0 and 0.0 <= float(r["ece"]) <= 1.0 and 0.0 <= float(r["ece_recent"]) <= 1.0

    text = (tmp_path / "results.md").read_text()
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| optimizer")
    body = table[1:]
    assert [line.split("|")[1].strip() for line in body] == ["LoKO", "LoRA/AdamW", "LoRA/AdaGrad"]
    for line in body:
        cells = [c.strip() for c in line.strip("|").split("|")]
        mean = float(re.match(r"([\d.]+) ±", cells[1]).group(1))
        assert 0.0 <= mean <= 100.0
        nll, ece = (float(re.match(r"([\d.]+) ±", cell).group(1)) for cell in cells[3:5])
        assert nll > 0 and 0.0 <= ece <= 100.0
        assert float(cells[6]) > 0
    assert body[1].strip("|").split("|")[6].strip() == "1.00"
    assert summary["adamw"]["step_time_ratio_vs_adamw"] == pytest.approx(1.0)
    # Each run is a `loko fit` command on the config: AdamW's linear decay runs over the 20-sample stream.
    assert "baselines/adamw.yaml" in text
    assert "--model.lr_scheduler.total_iters=20" in text
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["results"]["loko"]["steps"] == {"0": 20}
    assert "test_resnet" in saved["setting"]
    # What a results table quotes stays in git with summary.json: the recent accuracy at the end, the average online
    # accuracy at the checkpoints reached (none in 20 samples: checkpoint_values' own test has them).
    last = [r for r in rows if r["optimizer"] == "loko"][-1]
    assert saved["results"]["loko"]["final_recent_acc"]["0"] == pytest.approx(float(last["recent_acc"]))
    assert saved["results"]["loko"]["online_acc_at"] == {"0": {}}
    assert saved["results"]["loko"]["nll_at"] == saved["results"]["loko"]["ece_at"] == {"0": {}}


def test_the_summary_keeps_the_accuracy_at_each_checkpoint_reached(scripts):
    common, compare = scripts.common, scripts.compare
    samples = list(range(1, 1201))
    result = common.RunResult(
        online_acc=[s / 10_000 for s in samples], loss_avg=[], ce_avg=[], step_time=[], window=1, wall_s=0.0,
        samples=samples, nll=[3.0 - s / 1_000 for s in samples],
    )  # fmt: skip
    assert compare.checkpoint_values(result) == {100: 0.01, 250: 0.025, 500: 0.05, 750: 0.075, 1000: 0.1}
    # The NLL so far too, at the same samples (summary.json's nll_at: a longer run read at a shorter stream's end).
    assert compare.checkpoint_values(result, "nll") == pytest.approx(
        {100: 2.9, 250: 2.75, 500: 2.5, 750: 2.25, 1000: 2.0}
    )


@pytest.mark.slow
def test_compare_runs_every_peer_on_the_same_stream(scripts, tmp_path, capsys):
    """The peers on 20 samples, each choosing its rate (or p0) on the first 8: every step recorded, IVON's effective
    sample size is the stream's, and the --table-from table shows calibration beside accuracy."""
    pytest.importorskip("schedulefree")
    pytest.importorskip("ivon")
    pytest.importorskip("posteriors")
    compare = scripts.compare
    peers = ["adamw_const", "schedulefree", "ivon", "posteriors"]
    args = [*SCRIPT, "--seeds", "0", "--warmup", "2", "--select-samples", "8", "--optimizers", *peers]
    summary = compare.main([*args, "--out", str(tmp_path), "--", *TINY])
    with (tmp_path / "metrics.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    for peer in peers:
        mine = [r for r in rows if r["optimizer"] == peer]
        assert [int(r["step"]) for r in mine] == list(range(1, 21)), peer
        assert all(math.isfinite(float(r["nll"])) and 0 <= float(r["ece"]) <= 1 for r in mine), peer
        assert summary[peer]["selection"][0].startswith("chose"), peer
    text = (tmp_path / "results.md").read_text()
    assert "baselines/ivon.yaml" in text and "--model.optimizer.init_args.ess=20" in text
    assert (tmp_path / "reliability.png").read_bytes()[:8] == PNG_MAGIC
    capsys.readouterr()
    compare.main(["--table-from", str(tmp_path), "--at", "10", "20"])
    table = capsys.readouterr().out
    for peer in peers:
        assert compare.LABELS[peer] in table
    assert "NLL" in table and "ECE" in table


def test_compare_runs_the_learning_rate_free_peers_with_nothing_chosen(scripts, tmp_path):
    """Prodigy, D-Adaptation, DoG and Mechanic from their packages on the same 12 samples: each runs its own overlay
    (configs/baselines/<name>.yaml), records every step, and chooses nothing online (they have no rate to choose)."""
    for package in ("prodigyopt", "dadaptation", "dog", "mechanic_pytorch"):
        pytest.importorskip(package)
    compare = scripts.compare
    peers = ["prodigy", "dadaptation", "dog", "mechanic"]
    args = [*SCRIPT, "--seeds", "0", "--warmup", "2", "--samples", "12", "--optimizers", *peers]
    summary = compare.main([*args, "--out", str(tmp_path), "--", *TINY])
    with (tmp_path / "metrics.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    text = (tmp_path / "results.md").read_text()
    for peer in peers:
        assert [int(r["step"]) for r in rows if r["optimizer"] == peer] == list(range(1, 13)), peer
        assert not summary[peer].get("selection"), peer
        assert f"baselines/{peer}.yaml" in text and compare.LABELS[peer] in text, peer


@pytest.mark.slow
def test_every_optimizer_starts_from_the_same_adapters_and_reads_the_same_stream(scripts):
    """The comparison's premise: for one seed, the three runs differ only in the optimizer."""
    common, compare = scripts.common, scripts.compare

    def built(optimizer, seed, *overrides):
        args = compare.parse_args([*SCRIPT, "--", *TINY, *overrides])
        cli = common.build(compare.run_args(args, optimizer, seed))
        data = {k: v for k, v in cli.datamodule.hparams.items() if not k.startswith("_")}  # the arguments
        return cli, [p.detach().clone() for p in cli.model.trainable_parameters], data

    # AdamW on a stream with OOD samples: its linear decay must run over 20 normal + 4 OOD samples, not 20.
    adamw, adamw_params, adamw_data = built(
        "adamw", 0, "--data.perturbation", "RotationJitter", "--data.perturbation.every", "5"
    )
    loko, loko_params, loko_data = built("loko", 0)
    adagrad, adagrad_params, adagrad_data = built("adagrad", 0)
    _, other_params, other_data = built("loko", 1)

    assert isinstance(loko.model.configure_optimizers(), common.LoKO)
    assert loko.resolved == {"model.optimizer.seed": 0}  # p̂₀ from its own generator, not the global RNG
    assert isinstance(adagrad.model.configure_optimizers(), torch.optim.Adagrad)
    adamw_setup = adamw.model.configure_optimizers()
    assert isinstance(adamw_setup["optimizer"], torch.optim.AdamW)
    assert adamw_setup["lr_scheduler"]["scheduler"].total_iters == 24 == adamw.datamodule.stream_length
    assert adamw.resolved == {"model.lr_scheduler.total_iters": 24}
    # The LoRA A factors are random: equal for one seed, different for another (so the check can fail).
    for params in (adamw_params, adagrad_params):
        assert len(params) == len(loko_params)
        assert all(torch.equal(a, b) for a, b in zip(loko_params, params, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(loko_params, other_params, strict=True))
    # The same stream: the data module's arguments (its seed orders the stream) agree but for the OOD samples.
    assert loko_data == adagrad_data == {**adamw_data, "perturbation": None}
    assert loko_data["seed"] == 0 and other_data["seed"] == 1 and loko_data["max_samples"] == 20


def test_optimizer_overrides_go_to_the_loko_runs_only(scripts):
    compare = scripts.compare
    overrides = ["--data.source.image_size", "48", "--model.optimizer.p0", "0.05", "--model.lr_scheduler=null"]
    overrides += ["--model.head_covariance", "shared"]  # LoKO's covariance: a gradient optimizer refuses it
    args = compare.parse_args([*SCRIPT, "--", *overrides])
    loko = compare.run_args(args, "loko", 3)
    adamw = compare.run_args(args, "adamw", 3)
    assert loko[-len(overrides) :] == overrides
    assert adamw[-2:] == ["--data.source.image_size", "48"] and "--model.optimizer.p0" not in adamw
    assert "--model.head_covariance" not in adamw
    assert "--config" in adamw and adamw[adamw.index("--seed_everything=3") - 1].endswith("baselines/adamw.yaml")
    for run in (loko, adamw):
        assert {"--seed_everything=3", "--data.seed=3", "--data.max_samples=20"} <= set(run)


def test_a_loko_preset_configures_the_loko_runs_only(scripts):
    """--config debug --config presets/loko_images.yaml: the preset's shared head covariance and head step scale
    reach the loko runs, not AdamW's (a gradient optimizer refuses a LoKO covariance: the run failed)."""
    common, compare = scripts.common, scripts.compare
    preset = str(ROOT / "configs" / "presets" / "loko_images.yaml")
    args = compare.parse_args([*SCRIPT, "--config", preset, "--", *TINY])
    loko, adamw = compare.run_args(args, "loko", 0), compare.run_args(args, "adamw", 0)
    assert any(a.endswith("presets/loko_images.yaml") for a in loko)
    assert not any("presets" in a for a in adamw)
    assert compare.loko_overlay(preset) and not compare.loko_overlay(ROOT / "configs" / "debug.yaml")
    assert not compare.loko_overlay(common.BASELINES / "adamw.yaml")
    built = common.build(adamw)
    assert built.model.hparams.head_covariance == "diagonal" and built.model.hparams.step_scales is None
    assert isinstance(built.model.configure_optimizers()["optimizer"], torch.optim.AdamW)


def test_compare_csv_thinning(scripts, tmp_path):
    compare, common = scripts.compare, scripts.common
    result = common.RunResult([0.5] * 20, [1.0] * 20, [2.0] * 20, [0.01] * 20, window=10, wall_s=1.0)
    rows = compare.csv_rows([compare.Run("adamw", 0, result)], every=7)
    common.write_csv(tmp_path / "metrics.csv", compare.CSV_FIELDS, rows)
    with (tmp_path / "metrics.csv").open(newline="") as handle:
        steps = [int(r["step"]) for r in csv.DictReader(handle)]
    assert steps == [7, 14, 20]


def test_compare_table_marks_diverged_runs_and_late_convergence(scripts):
    """A diverged seed is named and left out of the mean; '*' marks a run still moving in its last window."""
    compare, common = scripts.compare, scripts.common

    def run(optimizer, seed, acc, loss, step_time, diverged=None):
        n = len(loss)
        result = common.RunResult([acc] * n, loss, [1.0] * n, [step_time] * n, window=10, wall_s=1.0, diverged=diverged)
        result.nll, result.ece = [1 - acc] * n, [acc / 10] * n  # made-up calibration: the mean of the kept seeds
        return compare.Run(optimizer, seed, result)

    moving = [1.5 - 0.05 * k for k in range(20)]  # 0.05 per step: within 0.05 of the end only from step 20
    runs = [
        run("loko", 0, 0.5, moving, 0.02),
        run("loko", 1, 0.9, [1.0] * 9, 0.02, diverged="LoKO diverged by sample 10"),
        run("adamw", 0, 0.3, [1.0] * 20, 0.01),
        run("adamw", 1, 0.4, [1.0] * 20, 0.01),
    ]
    summary = compare.summarize(runs, ["loko", "adamw"], warmup=0, conv_tol=0.05)
    assert summary["loko"]["steps_to_convergence"] == {0: 20}
    assert summary["loko"]["converged_in_last_window"] == {0: True}
    lines = compare.markdown_table(summary).splitlines()
    assert lines[2] == (
        "| LoKO | 50.00 ± 0.00 (diverged: seeds 1) | 50.00, 90.00 | 0.500 ± 0.000 | 5.0 ± 0.0 | 20 ± 0* | 2.00 |"
    )
    assert lines[3] == "| LoRA/AdamW | 35.00 ± 7.07 | 30.00, 40.00 | 0.650 ± 0.071 | 3.5 ± 0.7 | 1 ± 0 | 1.00 |"


def test_curve_table_from_a_written_csv(scripts, tmp_path, capsys):
    """--table-from recomputes mean ± std over seeds at the given samples from metrics.csv, running nothing."""
    compare = scripts.compare
    # A CSV from before the samples and recent_acc columns: step = samples, no recent accuracy.
    old_fields = ("optimizer", "seed", "step", "online_acc", "loss_avg", "ce_avg", "step_time")
    rows = [("loko", 0, 10, 0.5, 1.0), ("loko", 1, 10, 0.7, 0.8)]
    rows += [("adamw", 0, 10, 0.4, 1.2), ("adamw", 1, 10, 0.4, 1.0)]
    with (tmp_path / "metrics.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(old_fields)
        for optimizer, seed, step, acc, loss in rows:
            writer.writerow([optimizer, seed, step, acc, loss, 1.0, 0.01])
    compare.main(["--table-from", str(tmp_path), "--at", "10"])
    lines = capsys.readouterr().out.splitlines()
    # mean 60, sample std of (50, 70) = 14.142...; AdamW's two seeds agree: std 0.
    assert lines[2] == "| LoKO | 60.0 ± 14.1 % (L1 0.900) |"
    assert lines[3] == "| LoRA/AdamW | 40.0 ± 0.0 % (L1 1.100) |"
    with pytest.raises(SystemExit, match="no rows for loko@20, adamw@20"):
        compare.main(["--table-from", str(tmp_path), "--at", "20"])


def test_curve_table_pools_the_seeds_that_ran_past_a_stopped_one(scripts, tmp_path, capsys):
    """A run whose CSV ends before N while other runs reached N stopped there (a diverged run): its cell pools the
    seeds that reached N and says how many stopped; where none of its seeds did, the cell says only that. A row
    missing inside a run (thinned) is still an error."""
    compare = scripts.compare
    fields = ("optimizer", "seed", "step", "online_acc", "loss_avg", "ce_avg", "step_time")
    rows = [("dog", 0, step, 0.1 * step) for step in (1, 2, 3)] + [("dog", 1, 1, 0.5)]  # seed 1 stopped after 1
    rows += [("prodigy", 0, 1, 0.2), ("prodigy", 1, 1, 0.4)]  # both stopped after 1
    with (tmp_path / "metrics.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(fields)
        for optimizer, seed, step, acc in rows:
            writer.writerow([optimizer, seed, step, acc, 1.0, 1.0, 0.01])
    compare.main(["--table-from", str(tmp_path), "--at", "1", "3"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == "| Prodigy (no lr) | 30.0 ± 14.1 % (L1 1.000) | stopped before in 2 of 2 seeds |"
    stopped = "30.0 ± 0.0 % (L1 1.000; stopped before in 1 of 2 seeds)"  # seed 0's 30%, alone
    assert lines[3] == f"| DoG (no lr) | 30.0 ± 28.3 % (L1 1.000) | {stopped} |"
    with pytest.raises(SystemExit, match="no rows for dog@4, prodigy@4"):  # beyond every run
        compare.main(["--table-from", str(tmp_path), "--at", "4"])


def test_curve_table_counts_samples_with_batches(scripts, tmp_path, capsys):
    """With B samples a step, 'after N samples' is the step that reaches N; the recent accuracy is tabled too."""
    compare = scripts.compare
    with (tmp_path / "metrics.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, compare.CSV_FIELDS)
        writer.writeheader()
        for seed, accs in ((0, (0.25, 0.5, 0.75)), (1, (0.5, 0.5, 0.5))):
            for step, acc in enumerate(accs, start=1):  # B = 4: 4, 8, 12 samples
                writer.writerow(
                    dict(
                        optimizer="loko",
                        seed=seed,
                        step=step,
                        samples=4 * step,
                        online_acc=acc,
                        recent_acc=acc / 2,
                        loss_avg=1.0,
                        ce_avg=2.0,
                        step_time=0.1,
                    )
                )
    compare.main(["--table-from", str(tmp_path), "--at", "4", "6", "12"])
    lines = capsys.readouterr().out.splitlines()
    # After 6 samples: the step that reaches 8 (seed 0: 50%, seed 1: 50%); recent = half of it.
    assert lines[2] == (
        "| LoKO | 37.5 ± 17.7 %, recent 18.8 ± 8.8 % (L1 1.000) | 50.0 ± 0.0 %, recent 25.0 ± 0.0 % (L1 1.000) | "
        "62.5 ± 17.7 %, recent 31.2 ± 8.8 % (L1 1.000) |"
    )
    with pytest.raises(SystemExit, match="no rows for loko@13"):
        compare.main(["--table-from", str(tmp_path), "--at", "13"])


def test_steps_to_convergence(scripts):
    steps_to_convergence = scripts.compare.steps_to_convergence
    assert steps_to_convergence([1.0, 0.5, 0.31, 0.3, 0.3], tol=0.05) == 3
    assert steps_to_convergence([0.3, 0.3], tol=0.05) == 1
    assert steps_to_convergence([0.3, float("nan")], tol=0.05) is None
    # Leaving the band and coming back restarts the count.
    assert steps_to_convergence([0.3, 0.9, 0.3, 0.3], tol=0.05) == 3


@pytest.mark.slow
def test_p0_range_end_to_end(scripts, tmp_path):
    """A huge p0 is stopped by the divergence guard; a p0 too small to move anything keeps the uniform prediction."""
    argv = [*SCRIPT, "--p0s", "1e4", "1e-12", "--guard-every", "10", "--window", "10", "--out", str(tmp_path)]
    rows = scripts.p0_range.main([*argv, "--", *TINY])
    assert [row["p0"] for row in rows] == [1e-12, 1e4]
    tiny, huge = rows
    # The zero head predicts 1/10 for every class: L1 loss 0.9 + 9 x 0.1 and cross-entropy log 10, to the end.
    assert tiny["steps"] == 20
    assert tiny["final_loss_avg"] == pytest.approx(1.8, abs=1e-6)
    assert tiny["final_ce_avg"] == pytest.approx(math.log(10), abs=1e-6)
    assert huge["class"] == "diverged" and huge["steps"] == 9  # stopped at the check after sample 10
    assert huge["reason"].startswith("LoKO diverged by sample 10: the cross-entropy averaged over the last 10")
    assert (tmp_path / "p0_range.png").read_bytes()[:8] == PNG_MAGIC
    text = (tmp_path / "p0_range.md").read_text()
    assert [line.split(" | ")[0] for line in text.splitlines() if line.startswith("| 1e")] == ["| 1e-12", "| 1e+04"]
    assert "window 10, divergence check every 10 samples" in text
    with (tmp_path / "p0_range.csv").open(newline="") as handle:
        saved = list(csv.DictReader(handle))
    assert [(float(r["p0"]), r["class"]) for r in saved] == [(1e-12, tiny["class"]), (1e4, "diverged")]


def test_p0_range_builds_each_run_from_the_config(scripts):
    """The config and the overrides reach the run; the swept p0, window and guard period win."""
    common, p0_range = scripts.common, scripts.p0_range
    argv = [*SCRIPT, "--p0s", "0.05", "--guard-every", "7", "--window", "12", "--", *NETWORK, "--model.network.r", "2"]
    args = p0_range.parse_args(argv)
    cli = common.build(p0_range.run_args(args, 0.05), guard_every=args.guard_every)
    assert cli.model.configure_optimizers().param_groups[0]["p0"] == 0.05
    assert cli.model.hparams.window == 12 and cli.model.network_factory.r == 2
    assert cli.datamodule.max_samples == 20 and cli.datamodule.source.image_size == 32  # debug.yaml's
    guards = [c for c in cli.trainer.callbacks if isinstance(c, scripts.common.DivergenceGuard)]
    assert [g.check_every for g in guards] == [7]
    assert cli.trainer.checkpoint_callback is None and cli.trainer.logger is None


def _run(correct, ce_final=1.0, loss=None, diverged=None, num_classes=10):
    """A recorded run whose sample k was right iff ``correct[k]``."""
    online_acc = [sum(correct[: k + 1]) / (k + 1) for k in range(len(correct))]
    loss = loss if loss is not None else [1.5 - k / len(correct) for k in range(len(correct))]
    ce = [2.0] * (len(correct) - 1) + [ce_final]
    return SimpleNamespace(
        online_acc=online_acc,
        loss_avg=loss,
        ce_avg=ce,
        steps=len(correct),
        diverged=diverged,
        num_classes=num_classes,
    )


def test_p0_range_classes(scripts):
    """Each class from a run built to be in it (chance + margin = 0.2 with 10 classes)."""
    classify = scripts.p0_range.classify
    learns = [0] * 10 + [1] * 30  # quarters 0, 1, 1, 1
    assert classify(_run(learns))[0] == "admissible"
    assert classify(_run(learns, loss=[1.0] * 40)) == ("no-learning", "L1 loss not decreasing (1.000 -> 1.000)")
    chance = [1, 0, 0, 0, 0, 0, 0, 0, 0, 0] * 4  # 10 % in every quarter
    assert classify(_run(chance))[0] == "no-learning"
    assert classify(_run(chance, ce_final=5.0))[0] == "diverged"  # 5 > 1.5 log 10 = 3.45: confidently wrong
    collapse = [1] * 10 + [0] * 30  # learned the first quarter, then lost it
    assert classify(_run(collapse))[0] == "diverged"
    assert classify(_run(collapse), collapse_drop=1.01)[0] == "no-learning"
    stopped = _run(learns, diverged="LoKO diverged by sample 50: the cross-entropy is 9. Too large a p0")
    assert classify(stopped) == ("diverged", "LoKO diverged by sample 50: the cross-entropy is 9")
    assert classify(_run([1, 1, 1]))[0] == "no-learning"  # fewer than 4 steps


def test_p0_range_correctness_and_range(scripts):
    p0_range = scripts.p0_range
    # Right, wrong, right, right: running averages 1, 1/2, 2/3, 3/4.
    assert p0_range.correctness([1.0, 0.5, 2 / 3, 0.75]).tolist() == [1.0, 0.0, 1.0, 1.0]
    assert p0_range.quarter_accuracies([1.0, 0.5, 2 / 3, 0.75]) == [1.0, 0.0, 1.0, 1.0]
    grid = [{"p0": p, "class": c} for p, c in [(1e-4, "no-learning"), (1e-2, "admissible"), (1.0, "diverged")]]
    text = p0_range.admissible_range(grid)
    assert "[0.01, 0.01]" in text and "(0.0001, 0.01]" in text and "[0.01, 1)" in text
    assert p0_range.admissible_range(grid[:1]) == "No admissible p0 on this grid."
    gap = [{"p0": p, "class": c} for p, c in [(1e-3, "admissible"), (1e-2, "no-learning"), (0.1, "admissible")]]
    assert p0_range.admissible_range(gap).endswith("not contiguous: 0.01 inside it failed.")


def test_scale_measures_a_joint_step(scripts):
    """benchmarks/scale.py's measurement on a batch of 2: a step time, samples per second and the bytes one process
    would contribute to the all-gather (prediction, target and Jacobian factors of its 2 samples)."""
    row = scripts.scale.run(batch=2, m=4, steps=1, warmup=1, threads=1)
    assert row["step_s"] > 0 and row["samples_per_s"] == pytest.approx(2 / row["step_s"])
    assert 0 < row["jacobian_s"] < row["step_s"]
    assert row["bytes_per_step_per_process"] > 2 * 2 * 4 * 4  # more than the predictions and targets alone
    assert row["peak_mib"] > 0


def test_scale_shard_measures_an_update_and_estimates_the_bytes(scripts):
    """benchmarks/scale.py --shard's measurement in one process (no exchange: nothing sent, an update's peak memory),
    and --estimate's byte counts: the replicated all-gather receives W − 1 observations; the sharded exchange the
    largest shard's blocks from each of the others, plus S's all-reduce and the parameters; whole tensors while there
    are enough of them, an even split beyond (ResNet-18 with LoRA on its convs has 42 tensors)."""
    row = scripts.scale.shard_run(m=4, steps=1, warmup=1, shard=False)
    assert row["sent"] == row["received"] == 0 and row["step_s"] > 0 and row["parameters"] > 0
    assert row["update_peak_mib"] >= 0 or math.isnan(row["update_peak_mib"])
    four, many = scripts.scale.estimate("resnet18", 10, 4), scripts.scale.estimate("resnet18", 10, 64)
    assert four["replicated"] == 3 * four["per_sample"] and four["split"] == "tensors" and four["tensors"] == 42
    assert four["exchange"] > four["replicated"] / 4 / 3  # at least the largest shard's quarter, from 3 processes
    assert four["sharded"] == four["exchange"] + four["reduce"] + four["parameters"] < four["replicated"]
    assert many["split"] == "even" and many["reduce"] == 2 * 63 / 64 * (640 * 641 // 2) * 4  # S's lower triangle


@pytest.mark.slow
def test_the_traffic_model_is_the_bytes_counted_in_real_2_and_3_process_runs(scripts):
    """benchmarks/scale.py --estimate's bytes per process and step (behind the docs' 64-process projection) against
    what LoKO's collectives counted in real gloo runs of 2 and 3 processes on the same model: the replicated
    all-gather on every process, the sharded step on its largest receiver, exactly, once the counts all-gather
    the estimate leaves out (2 + one per parameter tensor, int64, from each other process) is added."""
    rows = scripts.scale.shard_rows([2, 3], m=4, steps=2, warmup=1, backbone="test_resnet")
    for world in (2, 3):
        estimate = scripts.scale.estimate("test_resnet", 4, world)
        counts = (world - 1) * (2 + estimate["tensors"]) * 8
        replicated = [r["received"] for r in rows if r["world"] == world and not r["shard"]]
        sharded = [r["received"] for r in rows if r["world"] == world and r["shard"]]
        assert len(replicated) == len(sharded) == world
        assert replicated == [estimate["replicated"] + counts] * world
        assert max(sharded) == estimate["sharded"] + counts


@pytest.mark.slow
def test_compare_on_a_text_config_reports_cross_entropy(scripts, tmp_path):
    """The text quick-start config on a local CSV and a tiny local BERT: the comparison plots and tables CE."""
    from text_helpers import sentiment_rows, tiny_bert_dir, write_text_file

    model = tiny_bert_dir(tmp_path / "model")
    data = write_text_file(tmp_path / "reviews.csv", sentiment_rows(30))
    text = ["--config", str(ROOT / "configs" / "text_quickstart.yaml"), "--samples", "12", "--threads", "1"]
    overrides = ["--model.network.backbone", str(model), "--model.network.weights", "null", "--model.window", "5",
                 "--data.source", "TextFile", "--data.source.root", str(data),
                 "--data.source.max_length", "16"]  # fmt: skip
    summary = scripts.compare.main([*text, "--seeds", "0", "--warmup", "2", "--out", str(tmp_path / "out"), "--",
                                    *overrides])  # fmt: skip
    assert set(summary) == {"loko", "adamw", "adagrad"}
    saved = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert saved["loss"] == "ce" and "max 16 tokens" in saved["setting"]
    assert "moving-average cross-entropy" in (tmp_path / "out" / "results.md").read_text()
    assert (tmp_path / "out" / "compare.png").read_bytes()[:8] == PNG_MAGIC
    table = scripts.compare.curve_table(tmp_path / "out" / "metrics.csv", [6, 12], loss="ce")
    assert "(CE " in table and "cross-entropy then" in table


def test_curve_table_of_several_comparisons_names_each_row_after_its_folder(scripts, tmp_path, capsys):
    compare = scripts.compare
    for name, acc in (("p0_0.05", 0.75), ("paper", 0.5)):
        folder = tmp_path / "stream" / name
        folder.mkdir(parents=True)
        with (folder / "metrics.csv").open("w", newline="") as handle:
            writer = csv.DictWriter(handle, compare.CSV_FIELDS)
            writer.writeheader()
            writer.writerow(
                dict(
                    optimizer="loko",
                    seed=0,
                    step=10,
                    samples=10,
                    online_acc=acc,
                    recent_acc=acc,
                    loss_avg=1.0,
                    ce_avg=2.0,
                    step_time=0.1,
                )
            )
    compare.main(
        ["--table-from", str(tmp_path / "stream" / "p0_0.05"), str(tmp_path / "stream" / "paper"), "--at", "10"]
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].startswith("| LoKO (stream/p0_0.05) | 75.0 ± 0.0 %")
    assert lines[3].startswith("| LoKO (stream/paper) | 50.0 ± 0.0 %")


def test_curve_table_pools_the_seeds_of_one_setting_run_twice(scripts, tmp_path, capsys):
    """--pool: seed 0 in one folder, seeds 1 and 2 in another give one row over 3 seeds; a seed twice is refused."""
    compare = scripts.compare
    folders = {"seed0": [(0, 0.5)], "seeds12": [(1, 0.6), (2, 0.7)], "again": [(2, 0.9)]}
    for name, runs in folders.items():
        (tmp_path / name).mkdir()
        with (tmp_path / name / "metrics.csv").open("w", newline="") as handle:
            writer = csv.DictWriter(handle, compare.CSV_FIELDS)
            writer.writeheader()
            for seed, acc in runs:
                row = dict(optimizer="loko", seed=seed, step=10, samples=10, online_acc=acc, recent_acc=acc)
                writer.writerow(dict(row, loss_avg=1.0, ce_avg=2.0, step_time=0.1))
    compare.main(["--table-from", str(tmp_path / "seed0"), str(tmp_path / "seeds12"), "--pool", "--at", "10"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].startswith("| LoKO | 60.0 ± 10.0 %") and len(lines) == 5 and "over 3 seeds" in lines[4]
    with pytest.raises(SystemExit, match="loko seed 2 is in both"):
        compare.main(["--table-from", str(tmp_path / "seeds12"), str(tmp_path / "again"), "--pool", "--at", "10"])


@pytest.mark.slow
def test_step_size_measures_each_step_and_the_shrinking_p_hat(scripts, tmp_path):
    """benchmarks/step_size.py: one size per step (LoKO's equals its own ‖K e‖), p̂ quantiles that only shrink."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))
        import step_size

    class GainNorms(scripts.common.pl.Callback):
        """LoKO's own ‖K e‖ of every step (its diagnostics), to check the measured parameter change against."""

        def __init__(self):
            self.norms = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            optimizer = pl_module.optimizers().optimizer
            if isinstance(optimizer, step_size.LoKO):
                self.norms.append(float(optimizer.diagnostics["gain_norm"]))

    argv = [*SCRIPT, "--optimizers", "loko", "adamw", "--at", "10", "20", "--window", "5", "--out", str(tmp_path)]
    args = step_size.parse_args([*argv, "--", *TINY])
    sizes, gains = step_size.StepSizes(args.at), GainNorms()
    scripts.common.fit(scripts.compare.run_args(args, "loko", args.seed), callbacks=[sizes, gains])
    assert len(sizes.sizes) == len(gains.norms) == 20
    # float32 parameters θ ~ 0.1-1 and steps ~ 1e-3: the difference θ_k − θ_(k-1) carries ~ eps32 · |θ| / |Δθ|
    # ~ 1e-4 relative error; the filter's ‖K e‖ is computed from the update itself.
    torch.testing.assert_close(
        torch.tensor(sizes.sizes, dtype=torch.float64),
        torch.tensor(gains.norms, dtype=torch.float64),
        rtol=1e-3,
        atol=0,
    )
    steps = {row["step"] for row in sizes.p_hat}
    assert steps == {0, 10, 20}
    by = {(row["step"], row["kind"]): row for row in sizes.p_hat}
    kinds = {kind for _, kind in by}
    assert {"lora_A", "lora_B", "head"} <= kinds
    for kind in kinds:
        start, end = by[(0, kind)], by[(20, kind)]
        assert start["count"] == end["count"] > 0
        # Without process noise every entry of p̂ only shrinks (the update subtracts a product of non-negative
        # factors, and rounding is monotone), so every quantile and the mean do, exactly; the initial draw is U(0, 0.2].
        for name in ("mean", "q01", "q10", "q50", "q90", "min"):
            assert end[name] <= start[name], (kind, name)
        assert start["min"] > 0 and start["q90"] <= 0.2

    # A checkpoint inside the first window (5) would repeat the first column: it is left out of the table.
    recorded = step_size.main([*argv, "--at", "5", "10", "20", "--", *TINY])
    assert set(recorded) == {"loko", "adamw"}
    assert recorded["adamw"]["p_hat"] == [] and len(recorded["adamw"]["sizes"]) == 20
    assert all(size > 0 and math.isfinite(size) for size in recorded["adamw"]["sizes"])
    text = (tmp_path / "step_size.md").read_text()
    assert "| LoKO | " in text and "| LoRA/AdamW | " in text
    assert "| optimizer | steps 1-5 | steps 6-10 | steps 16-20 | last / first |" in text
    assert (tmp_path / "step_size.png").read_bytes()[:8] == PNG_MAGIC
    with (tmp_path / "step_size.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [(row["optimizer"], row["first_step"], row["last_step"]) for row in rows][:4] == [
        ("loko", "1", "5"), ("loko", "6", "10"), ("loko", "11", "15"), ("loko", "16", "20")
    ]  # fmt: skip
    loko = recorded["loko"]["sizes"]
    assert float(rows[0]["mean_step_size"]) == pytest.approx(sum(loko[:5]) / 5, rel=1e-12)


def test_drift_recovery_counts_samples_until_a_post_change_window_is_back_to_90_percent(scripts, tmp_path, capsys):
    drift = scripts.drift_recovery
    # Recent accuracy (window 2) per sample: 0.8 before the change at 4, then 0.0, 0.5, 0.75 (>= 0.72), 1.0.
    recent = {1: 0.5, 2: 0.7, 3: 0.8, 4: 0.8, 5: 0.4, 6: 0.0, 7: 0.5, 8: 0.75, 9: 1.0, 10: 1.0, 11: 0.0, 12: 0.0}
    assert drift.recoveries(recent, every=4, window=2, fraction=0.9, end=12) == [
        (4, 0.8, 4, 4),  # sample 8 = change + 4; sample 5 (0.4) and 6 still held pre-change predictions or failed
        (8, 0.75, 2, 4),  # the window of samples 9-10 is all after the change and at 1.0
    ]
    path = tmp_path / "metrics.csv"
    rows = [{"optimizer": "loko", "seed": s, "samples": t, "recent_acc": a} for s in (0, 1) for t, a in recent.items()]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["optimizer", "seed", "samples", "recent_acc"])
        writer.writeheader()
        writer.writerows(rows)
    drift.main([str(path), "--drift-every", "4", "--window", "2"])
    out = capsys.readouterr().out
    assert "| loko | 2 | 4 ± 0 (pre 80.0%) | 2 ± 0 (pre 75.0%) |" in out

    # One folder per run: LABEL=PATH names the rows, and the seeds of one label are pooled across files.
    later = {t: (a if t < 9 else 0.9) for t, a in recent.items()}  # the second window 9-10 at 0.9 of 0.75 -> 2
    other = tmp_path / "other.csv"
    with other.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["optimizer", "seed", "samples", "recent_acc"])
        writer.writeheader()
        writer.writerows({"optimizer": "loko", "seed": 2, "samples": t, "recent_acc": a} for t, a in later.items())
    drift.main([f"preset={path}", f"preset={other}", "--drift-every", "4", "--window", "2"])
    assert "| preset | 3 | 4 ± 0 (pre 80.0%) | 2 ± 0 (pre 75.0%) |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="seed 0 is in an earlier file"):  # the same run given twice
        drift.main([f"preset={path}", f"preset={path}", "--drift-every", "4", "--window", "2"])


def test_a_run_with_an_online_selection_reports_what_it_chose(scripts):
    """The tuned AdamW's choice of learning rate (and p0: auto's choice of p0) reaches the run's result, the progress
    line and results.md: where it sits in the grid is part of the study."""
    tuned = ["--config", str(ROOT / "configs" / "baselines" / "adamw_tuned.yaml")]
    select = ["--model.select.samples", "4", "--model.lr_scheduler.total_iters", "8"]
    result = scripts.common.fit([*DEBUG, *tuned, *TINY, "--data.max_samples", "8", *select])
    assert result.selection is not None and "lr" in result.selection
    # p0: auto inside the mixture (the text default's parts before its prior's scale was set online): the choice is
    # found through the mixture's step.
    mixture = ["--config", str(ROOT / "configs" / "presets" / "loko_mixture_lda.yaml")]
    auto = ["--model.optimizer.init_args.p0", "auto", "--model.select.samples", "4"]
    result = scripts.common.fit([*DEBUG, *mixture, *TINY, "--data.max_samples", "8", *auto])
    assert result.selection is not None and result.selection.startswith("chose p0=")


def test_peers_table_pools_each_learners_seeds_and_marks_a_choice_on_an_edge(scripts, tmp_path):
    """Two seeds of one learner: mean ± std at each checkpoint, the end's recent accuracy, NLL and ECE, and the
    choice at the top of the grid marked ^ (the one at the bottom v)."""
    compare = scripts.compare
    for seed, (acc, chosen) in enumerate([(0.5, "0.003"), (0.7, "0.0001")]):
        run = tmp_path / f"adamw_tuned_s{seed}"
        run.mkdir()
        rows = [
            {"optimizer": "adamw_tuned", "seed": seed, "step": n, "samples": n, "online_acc": acc, "recent_acc": acc,
             "loss_avg": 1.0, "ce_avg": 1.0, "step_time": 0.1, "nll": 1.0 + seed, "nll_recent": 1.0, "ece": 0.1,
             "ece_recent": 0.1}
            for n in (10, 20)
        ]  # fmt: skip
        scripts.common.write_csv(run / "metrics.csv", compare.CSV_FIELDS, rows)
        grid = "lr=0.0001: 1.0, lr=0.0003: 1.0, lr=0.001: 1.0, lr=0.003: 0.9"
        selection = f"chose lr={chosen} after 500 samples (mean prequential cross-entropy: {grid})"
        (run / "summary.json").write_text(json.dumps({"results": {"adamw_tuned": {"selection": {seed: selection}}}}))
    lines = scripts.peers_table.table(tmp_path, [10, 20], ["adamw_tuned", "ivon"]).splitlines()
    assert len(lines) == 3  # header, rule, one learner (no ivon runs)
    cells = [cell.strip() for cell in lines[2].strip("|").split("|")]
    assert cells[1:3] == ["60.0 ± 14.1", "60.0 ± 14.1"]
    assert cells[3] == "60.0 ± 14.1" and cells[4] == "1.500 ± 0.707" and cells[5] == "10.0 ± 0.0"
    assert cells[6] == "0.003^, 0.0001v" and cells[7] == "0, 1"


def test_step_parts_times_each_part_of_the_default_and_the_papers_step(tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))
        import step_parts
    originals = {name: getattr(step_parts.LoKO, name) for name in ("step", "averaged")}
    rows, steps = step_parts.main([*DEBUG, "--samples", "14", "--warmup", "4", "--", *TINY])

    assert len(steps["default"]) == len(steps["paper"]) == 10
    # The default's step has every part but the frozen pass alone (its averaged mean predicts in the mixture's joint
    # pass with the frozen features; LDA updates); the paper's has the Jacobian and the filter only.
    default_parts = set(step_parts.PARTS) - {"frozen forward"}
    missing = [sorted(default_parts - set(step)) for step in steps["default"]]
    assert not any(missing) and all(set(step) == default_parts for step in steps["default"]), missing
    assert all(set(step) == {"step", "Jacobian", "filter", "rest"} for step in steps["paper"])
    # The parts are disjoint calls inside the step: none is negative and they never add up to more than the step.
    for step in steps["default"] + steps["paper"]:
        assert all(value >= 0.0 for value in step.values()) and step["rest"] >= 0.0
    assert {(learner, part) for learner, part, *_ in rows} == {
        *(("default", part) for part in default_parts),
        *(("paper", part) for part in ("step", "Jacobian", "filter", "rest")),
    }
    # The methods are the package's again after the script.
    assert {name: getattr(step_parts.LoKO, name) for name in ("step", "averaged")} == originals


def test_step_parts_lockstep_takes_turns_of_n_steps_and_survives_a_learner_that_fails(capsys):
    """``--lockstep N``: the learners' turns of N steps alternate strictly (each waits while the other steps), the
    paired ratio is printed, and a learner whose fit raises hands the turn on for good (the other finishes alone; the
    error is raised after both threads end, not a deadlock)."""
    pytest.importorskip("matplotlib")
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))
        import step_parts
    order: list[str] = []

    class Recording(step_parts.PartTimes):
        def __init__(self, name: str, active: step_parts.Active, fail_at: int | None = None) -> None:
            super().__init__(active)
            self.name, self.fail_at = name, fail_at

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            order.append(self.name)
            if batch_idx == self.fail_at:
                raise RuntimeError("learner b fails")
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    run = [*DEBUG, "--seed_everything=0", "--data.max_samples=6", *TINY, "--loko=as_configured"]
    active = step_parts.Active()
    times = [Recording("a", active), Recording("b", active)]
    with step_parts.timed(active):
        step_parts.lockstep_fit([run, run], times)
    assert order == ["a", "b"] * 6 and [len(t.steps) for t in times] == [6, 6]

    order.clear()
    times = [Recording("a", active), Recording("b", active, fail_at=2)]
    with step_parts.timed(active), pytest.raises(RuntimeError, match="learner b fails"):
        step_parts.lockstep_fit([run, run], times)
    assert order == ["a", "b", "a", "b", "a", "b", "a", "a", "a"] and len(times[0].steps) == 6

    order.clear()
    times = [Recording("a", active), Recording("b", active)]
    with step_parts.timed(active):
        step_parts.lockstep_fit([run, run], times, steps=4)
    assert order == ["a"] * 4 + ["b"] * 4 + ["a"] * 2 + ["b"] * 2

    rows, steps = step_parts.main([*DEBUG, "--samples", "8", "--warmup", "2", "--learners", "paper", "paper",
                                   "--lockstep", "1", "--", *TINY])  # fmt: skip
    assert set(steps) == {"paper 1", "paper 2"} and all(len(s) == 6 for s in steps.values())
    out = capsys.readouterr().out
    assert "the learners in lockstep" in out and "- paper 2: " in out


def test_mixture_replay_starts_from_the_mixtures_prior_and_updates_as_it_does():
    """The replay of recorded experts with ``prior_learner`` is the learner's mixture arithmetic, bit for bit: the same
    prior over the same experts' order (MixtureStep's learner indices), the same Bayes and fixed-share updates, or
    with the share to the past's posteriors, the step's own update."""
    pytest.importorskip("matplotlib")
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))
        import mixture_replay
    from loko_lightning.learner.mixing import mixture_log_predictive, update_log_weights
    from loko_lightning.learner.mixture_step import MixtureStep
    from loko_lightning.peers import StreamingLDA

    step = MixtureStep(None, StreamingLDA, temperatures=[1.0, 8.0], prior_learner=0.2, learner_temperatures=[0.5, 0.8])
    torch.manual_seed(0)
    experts = torch.randn(30, len(step.log_weights), 5, dtype=torch.float64).log_softmax(-1)
    labels = torch.randint(5, (30,))
    got = mixture_replay.replay_one(experts, labels, 0.01, step.learner_experts, 0.2)
    log_weights, want = step.log_weights, []
    for log_probabilities, label in zip(experts, labels, strict=True):
        want.append(mixture_log_predictive(log_weights, log_probabilities[:, None])[0].exp())
        log_weights = update_log_weights(log_weights, log_probabilities[:, label], 0.01)
    assert torch.equal(got, torch.stack(want))
    # Without prior_learner: the uniform prior, another mixture.
    assert not torch.equal(mixture_replay.replay_one(experts, labels, 0.01), got)
    # A share to the past's posteriors too: the step's own update, bit for bit, and not fixed share's alone.
    past = MixtureStep(None, StreamingLDA, temperatures=[1.0, 8.0], share=0.001, prior_learner=0.2,
                       learner_temperatures=[0.5, 0.8], share_past=0.01)  # fmt: skip
    got_past, want = mixture_replay.replay_one(experts, labels, 0.001, step.learner_experts, 0.2, 0.01), []
    for count, (log_probabilities, label) in enumerate(zip(experts, labels, strict=True), start=1):
        want.append(mixture_log_predictive(past.log_weights, log_probabilities[:, None])[0].exp())
        past._update_weights(log_probabilities[:, label], count - 1)  # its index (seen stays 0 here)
    assert torch.equal(got_past, torch.stack(want)) and not torch.equal(got_past, got)


def test_mixture_replay_recalibrates_as_the_learners_calibration_option():
    """``replay --recalibrate κ`` (a loop over plain floats) is the learner's ``calibration`` (``MixtureStep``'s
    ``recalibrated`` before each sample, ``update_bins`` after it): equal to float64 rounding (1e-12 over 300 samples;
    the loop and the tensors round ``1 − c`` and the scaling apart), the argmax unchanged, and not the mixture's own
    prediction (the test can fail)."""
    pytest.importorskip("matplotlib")
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))
        import mixture_replay
    from loko_lightning.learner.mixing import update_bins
    from loko_lightning.learner.mixture_step import MixtureStep
    from loko_lightning.peers import StreamingLDA

    step = MixtureStep(None, StreamingLDA, temperatures=[1.0, 8.0], calibration=30.0)
    torch.manual_seed(1)
    predictions = torch.softmax(torch.randn(300, 4, dtype=torch.float64), -1)
    labels = torch.where(torch.rand(300) < 0.8, predictions.argmax(-1), torch.randint(4, (300,)))  # underconfident
    got = mixture_replay.recalibrate(predictions, labels, 30.0)
    want = []
    for p, label in zip(predictions[:, None], labels[:, None], strict=True):
        want.append(step.recalibrated(p)[0])
        step.bin_gaps, step.bin_counts = update_bins(step.bin_gaps, step.bin_counts, p, label)
    torch.testing.assert_close(got, torch.stack(want), rtol=0, atol=1e-12)
    assert torch.equal(got.argmax(-1), predictions.argmax(-1)) and (got - predictions).abs().max() > 1e-2


def test_mixture_replay_builds_the_learners_experts_with_its_pools():
    """The replay's experts of a setting from a recording (LoKO, LDA at each temperature, the vote) with the learner's
    tempered experts and the pools are MixtureStep's experts with those settings, in its order (float64: LDA's logits
    are read from its recorded T = 1 log probabilities, a constant apart, so a pool agrees to rounding, 1e-12), and the
    learner's indices are MixtureStep's."""
    pytest.importorskip("matplotlib")
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))
        import mixture_replay
    from loko_lightning.learner.mixture_step import MixtureStep
    from loko_lightning.peers import StreamingLDA

    torch.manual_seed(1)
    learner = torch.softmax(torch.randn(6, 4), -1)
    logits = 3 * torch.randn(6, 4, dtype=torch.float64)
    recorder = MixtureStep(None, StreamingLDA, temperatures=[1.0, 2.0, 8.0])
    recorder.hits, recorder.seen = torch.tensor(3.0, dtype=torch.float64), torch.tensor(5.0, dtype=torch.float64)
    recorded = recorder.experts(learner, logits).transpose(0, 1)  # (N, K, m) as `record` keeps them
    step = MixtureStep(
        None, StreamingLDA, temperatures=[1.0, 2.0], learner_temperatures=[0.5, 0.8], pools=[0.5, 1.0]
    )  # fmt: skip
    step.hits, step.seen = recorder.hits, recorder.seen
    want = step.experts(learner, logits).transpose(0, 1)
    got, learners = mixture_replay.setting_experts(recorded, [0, 1, 2, 4], [1.0, 2.0], [0.5, 0.8], [0.5, 1.0])
    assert got.shape == want.shape and learners == step.learner_experts
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # Without the pools, the experts before them, exactly.
    plain, _ = mixture_replay.setting_experts(recorded, [0, 1, 2, 4], [1.0, 2.0], [0.5, 0.8])
    assert torch.equal(plain, want[:, : plain.shape[1]])


def test_mixture_replay_scores_the_posterior_predictive_as_the_learner_does():
    """``--posterior`` from a recorded ``H P Hᵀ``: each κ's experts are ``mean_field_predictive`` of ``κ · H P Hᵀ``,
    and the choice online is :class:`PredictiveScale`'s, sample by sample (float64 both ways, the same operations
    but a log and an exp: 1e-12)."""
    pytest.importorskip("matplotlib")
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))
        import mixture_replay
    from loko_lightning.kalman.predictive import KAPPAS, PredictiveScale

    generator = torch.Generator().manual_seed(4)
    probabilities = torch.softmax(2 * torch.randn(40, 4, generator=generator, dtype=torch.float64), -1)
    roots = torch.randn(40, 4, 4, generator=generator, dtype=torch.float64)
    cov = 0.5 * roots @ roots.transpose(-1, -2)
    labels = torch.randint(4, (40,), generator=generator)
    experts = mixture_replay.posterior_experts(probabilities.log(), cov, KAPPAS)
    scale, want = PredictiveScale(), []
    for i in range(40):
        want.append(scale(probabilities[i : i + 1], cov[i : i + 1], labels[i : i + 1])[0])
    got = mixture_replay.chosen_online(experts, labels)
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-12, atol=1e-12)
    assert scale.kappa != 0.0  # the choice moved off the mean's κ 0: more than one candidate was taken


def test_mixture_replay_reads_the_nearest_mean_experts_and_their_vote():
    """A recording with ``nearest_mean`` ends with nearest class mean's experts at each recorded temperature: the
    replay's setting with them kept at the kept temperatures is MixtureStep's experts with ``nearest_mean`` (1e-12, as
    the pools above), in its order; their vote is Laplace's rule on the nearest mean's hits before each sample."""
    pytest.importorskip("matplotlib")
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))
        import mixture_replay
    from loko_lightning.learner.mixture_step import MixtureStep
    from loko_lightning.peers import StreamingLDA

    torch.manual_seed(2)
    learner = torch.softmax(torch.randn(6, 4), -1)
    logits, nearest = 3 * torch.randn(6, 4, dtype=torch.float64), 5 * torch.randn(6, 4, dtype=torch.float64)
    temperatures = [1.0, 2.0, 8.0]
    recorder = MixtureStep(None, StreamingLDA, temperatures=temperatures, nearest_mean=True)
    recorded = recorder.experts(learner, logits, nearest).transpose(0, 1)
    experts, near = recorded[:, : -len(temperatures)], recorded[:, -len(temperatures) :]  # as replay splits them
    step = MixtureStep(
        None, StreamingLDA, temperatures=[1.0, 2.0], learner_temperatures=[0.5], pools=[1.0], nearest_mean=True
    )  # fmt: skip
    want = step.experts(learner, logits, nearest).transpose(0, 1)
    got, learners = mixture_replay.setting_experts(experts, [0, 1, 2, 4], [1.0, 2.0], [0.5], [1.0], [near[:, :2]])
    assert got.shape == want.shape and learners == step.learner_experts
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # The vote: predicted 0, 1, 1 against labels 0, 0, 1 (3 classes): confidence 1/2, then 2/3, then 2/4.
    recorded_t1 = torch.tensor([[0.0, -1, -2], [-1, 0, -2], [-2, 0, -1]], dtype=torch.float64)
    votes = mixture_replay.nearest_vote(recorded_t1, torch.tensor([0, 0, 1]))
    by_hand = [[1 / 2, 1 / 4, 1 / 4], [1 / 6, 2 / 3, 1 / 6], [1 / 4, 2 / 4, 1 / 4]]
    want_votes = torch.tensor(by_hand, dtype=torch.float64)
    assert votes.shape == (3, 1, 3)
    # exp of a float64 log: a few ulp (the log and the exp each round once).
    torch.testing.assert_close(votes[:, 0].exp(), want_votes, rtol=1e-15, atol=0)


def _expert_bound():
    pytest.importorskip("matplotlib")
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))
        import expert_bound
    return expert_bound


def test_expert_bound_records_what_the_learner_scores(tmp_path):
    """``record`` keeps each step's prediction as the learner scored it: a distribution per sample whose argmaxes give
    the run's own online accuracy."""
    pytest.importorskip("mlxtend")
    expert_bound = _expert_bound()
    expert_bound.main(["record", *DEBUG, "--samples", "12", "--threads", "1", "--optimizers", "adamw", "--seeds", "0",
                       "--out", str(tmp_path), "--", *TINY])  # fmt: skip
    saved = torch.load(tmp_path / "adamw_seed0.pt")
    predictions, labels = saved["predictions"], saved["labels"]
    assert predictions.dtype == torch.float64 and predictions.shape[0] == labels.shape[0] == 12
    assert torch.allclose(predictions.sum(-1), torch.ones(12, dtype=torch.float64), atol=1e-6)  # float32 softmax
    online = next(token for token in saved["command"] if token.startswith("--data.max_samples"))
    assert online.endswith("12")
    hits = (predictions.argmax(-1) == labels).double().mean()
    assert float(hits) == pytest.approx(saved["online_acc"], abs=1e-6)  # the run's own metric (float32)


def test_expert_bound_hindsight_mixture_is_the_best_fixed_weighting():
    """EM's weights reach the best likelihood of any fixed weighting of two experts (a grid of 201 weights: EM is at
    least as good, to its convergence, 1e-9)."""
    expert_bound = _expert_bound()
    torch.manual_seed(0)
    likelihoods = torch.rand(200, 2, dtype=torch.float64)
    weights = expert_bound.hindsight_mixture(likelihoods)
    best = max(float((likelihoods @ torch.tensor([w, 1 - w], dtype=torch.float64)).log().sum())
               for w in torch.linspace(0, 1, 201).tolist())  # fmt: skip
    assert float(weights.sum()) == pytest.approx(1.0) and float((likelihoods @ weights).log().sum()) >= best - 1e-9
    # One expert always right with certainty, the other never: all the weight on the first.
    certain = torch.tensor([[1.0, 0.0]] * 5, dtype=torch.float64)
    assert expert_bound.hindsight_mixture(certain).tolist() == [1.0, 0.0]


def test_expert_bound_scores_the_replayed_mixture_and_the_peer_as_an_expert(tmp_path, capsys):
    """``bound``'s rows are the replayed mixture's NLL per stretch, the peer's, and the mixture with the peer's
    prediction as one more expert (each the replay's arithmetic); a peer of another stream is refused."""
    expert_bound = _expert_bound()
    import mixture_replay  # on the path: expert_bound imports it

    torch.manual_seed(3)
    n, m, temperatures = 40, 4, [1.0, 4.0]
    lda = torch.randn(n, m, dtype=torch.float64)
    experts = torch.cat([torch.randn(n, 1, m, dtype=torch.float64).log_softmax(-1),
                         torch.stack([(lda / t).log_softmax(-1) for t in temperatures], 1),
                         torch.randn(n, 1, m, dtype=torch.float64).log_softmax(-1)], 1)  # fmt: skip
    labels = torch.randint(m, (n,))
    experts_dir, peers_dir = tmp_path / "experts", tmp_path / "peers"
    experts_dir.mkdir(), peers_dir.mkdir()
    torch.save({"experts": experts, "labels": labels, "temperatures": temperatures, "nearest_mean": False},
               experts_dir / "experts_seed0.pt")  # fmt: skip
    peer = torch.softmax(2 * torch.randn(n, m, dtype=torch.float64), -1)
    torch.save({"predictions": peer, "labels": labels}, peers_dir / "adamw_seed0.pt")
    argv = ["bound", str(experts_dir), str(peers_dir), "--optimizers", "adamw", "--stretches", "0", "10", "40",
            "--pools", "1", "--learner-temperatures", "0.5"]  # fmt: skip
    expert_bound.main(argv)
    stretches, last = capsys.readouterr().out.split("\nSamples 10-40")
    rows = {line.split(" | ")[0][2:]: line for line in stretches.splitlines() if line.startswith("| ")}
    setting, learners = mixture_replay.setting_experts(experts, [0, 1, 2, 3], temperatures, [0.5], [1.0])
    mixture = mixture_replay.replay_one(setting, labels, 0.001, learners, None, 0.01)
    with_peer = torch.cat([setting, peer.log()[:, None]], 1)
    mixed = mixture_replay.replay_one(with_peer, labels, 0.001, learners, None, 0.01)
    for name, predictions in [("the mixture", mixture), ("adamw alone", peer),
                              ("the mixture + adamw as an expert", mixed)]:  # fmt: skip
        nll = -predictions[torch.arange(n), labels].log()
        want = [f"{float(nll[a:b].mean()):.3f}" for a, b in [(0, 10), (10, 40), (0, 40)]]
        assert rows[name] == f"| {name} | {' | '.join(want)} |"
        right = predictions[10:].argmax(-1) == labels[10:]
        assert f"| {name} | {100 * float(right.double().mean()):.1f} | {float(nll[10:][right].mean()):.3f} |" in last
    assert "its experts' best constant mixture, in hindsight per stretch" in rows
    torch.save({"predictions": peer, "labels": (labels + 1) % m}, peers_dir / "adamw_seed0.pt")
    with pytest.raises(SystemExit, match="another stream"):
        expert_bound.main(argv)


def test_mixture_replay_bootstrap_gives_the_ece_its_resolution():
    """``scores(..., bootstrap=B)``: an ECE every resample shares has no spread (every sample right at confidence 0.7:
    ECE 0.3 in each); a mixed stream has one, the same on every call (a fixed generator), and none without ``B``."""
    pytest.importorskip("matplotlib")
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))
        import mixture_replay
    same = torch.tensor([[0.7, 0.3]] * 50, dtype=torch.float64)
    got = mixture_replay.scores(same, torch.zeros(50, dtype=torch.long), [50], bootstrap=20)
    assert got["ece"] == pytest.approx(0.3) and got["ece sd"] == pytest.approx(0.0, abs=1e-15)
    torch.manual_seed(0)
    mixed = torch.softmax(torch.randn(200, 3, dtype=torch.float64), -1)
    labels = torch.randint(3, (200,))
    first = mixture_replay.scores(mixed, labels, [100], bootstrap=30)
    assert first["ece sd"] > 0 and first == mixture_replay.scores(mixed, labels, [100], bootstrap=30)
    assert "ece sd" not in mixture_replay.scores(mixed, labels, [100])


def test_mixture_replay_confidence_gap_has_the_sign_the_ece_hides():
    """``scores(..., gap=True)``: confidence 0.7 on every sample, right on 90% (underconfident) or on 50%
    (overconfident): the same-sized ECE, 0.2, and a gap of −0.2 and +0.2; no column without ``gap``."""
    pytest.importorskip("matplotlib")
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))
        import mixture_replay
    same = torch.tensor([[0.7, 0.3]] * 10, dtype=torch.float64)
    under = mixture_replay.scores(same, torch.tensor([0] * 9 + [1]), [10], gap=True)
    over = mixture_replay.scores(same, torch.tensor([0] * 5 + [1] * 5), [10], gap=True)
    assert under["ece"] == pytest.approx(0.2) and under["conf - acc"] == pytest.approx(-0.2)
    assert over["ece"] == pytest.approx(0.2) and over["conf - acc"] == pytest.approx(0.2)
    assert "conf - acc" not in mixture_replay.scores(same, torch.zeros(10, dtype=torch.long), [10])


def test_mixture_replay_ece_floor_is_what_sampling_gives_a_calibrated_learner():
    """``scores(..., floor=F)``: certain predictions (probability 1) draw their own argmax, ECE 0 on every stream; the
    uncertain ones have a floor above 0 that falls with the stream's length (sampling noise, about 1/√n), the same on
    every call (a fixed generator), whatever the true labels; no column without ``F``."""
    pytest.importorskip("matplotlib")
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))
        import mixture_replay
    certain = torch.eye(3, dtype=torch.float64)[torch.arange(30) % 3]
    assert mixture_replay.scores(certain, torch.zeros(30, dtype=torch.long), [30], floor=5)["ece floor"] == 0.0
    torch.manual_seed(0)
    uncertain = torch.softmax(torch.randn(4000, 3, dtype=torch.float64), -1)
    labels = torch.randint(3, (4000,))
    short = mixture_replay.scores(uncertain[:250], labels[:250], [250], floor=40)["ece floor"]
    long = mixture_replay.scores(uncertain, labels, [4000], floor=40)["ece floor"]
    assert 0 < long < short / 2  # 16x the samples: a quarter of the noise, up to the draws' own spread
    again = mixture_replay.scores(uncertain, (labels + 1) % 3, [4000], floor=40)["ece floor"]
    assert again == long and "ece floor" not in mixture_replay.scores(uncertain, labels, [4000])


def test_expert_bound_scores_prints_a_peers_row_as_the_replay_scores_it(tmp_path, capsys):
    """``scores``: each recorded peer's row per seed, its cells :func:`mixture_replay.scores`' values; a peer not
    recorded is refused, naming the command that records it."""
    expert_bound = _expert_bound()
    import mixture_replay  # on the path: expert_bound imports it

    torch.manual_seed(4)
    predictions = torch.softmax(torch.randn(60, 3, dtype=torch.float64), -1)
    labels = torch.randint(3, (60,))
    torch.save({"predictions": predictions, "labels": labels}, tmp_path / "adamw_seed2.pt")
    expert_bound.main(["scores", str(tmp_path), "--optimizers", "adamw", "--at", "30", "--confidence-gap",
                       "--ece-floor", "5"])  # fmt: skip
    want = mixture_replay.scores(predictions, labels, [30], gap=True, floor=5)
    cells = " | ".join(f"{100 * v:.1f}" if k != "nll" else f"{v:.3f}" for k, v in want.items())
    out = capsys.readouterr().out
    assert "| peer | acc@30 | nll | ece | conf - acc | ece floor |" in out and f"| adamw, seed 2 | {cells} |" in out
    assert "mean of" not in out  # one seed: no mean row
    torch.save({"predictions": predictions.flip(0), "labels": labels.flip(0)}, tmp_path / "adamw_seed3.pt")
    expert_bound.main(["scores", str(tmp_path), "--optimizers", "adamw", "--at", "30"])
    other = mixture_replay.scores(predictions.flip(0), labels.flip(0), [30])
    first = mixture_replay.scores(predictions, labels, [30])
    mean = " | ".join(f"{100 * (first[k] + other[k]) / 2:.1f}" if k != "nll" else f"{(first[k] + other[k]) / 2:.3f}"
                      for k in first)  # fmt: skip
    assert f"| adamw, mean of 2 | {mean} |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="expert_bound.py record"):
        expert_bound.main(["scores", str(tmp_path), "--optimizers", "sgd"])


def test_mixture_replay_learns_the_pools_powers_online_and_scores_a_late_window():
    """``--learned-pool``: the first prediction is LoKO's alone (its powers start at (1, 0)); each prediction is made
    before its label is seen (labels from t on changed: the first t predictions the same, bit for bit); where the second
    prediction is the labels' and the first is noise, its power grows and the pool's log loss falls far below LoKO's.
    ``--late``: the window's NLL, and at the best T in hindsight never above it (T = 1 is among those tried)."""
    pytest.importorskip("matplotlib")
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))
        import mixture_replay

    torch.manual_seed(2)
    labels = torch.randint(4, (200,))
    noise = torch.randn(200, 4, dtype=torch.float64).log_softmax(-1)
    informed = (2.0 * torch.nn.functional.one_hot(labels, 4).double() + torch.randn(200, 4).double()).log_softmax(-1)
    features = torch.stack([noise, informed], 1)
    got = mixture_replay.learned_pool(features, labels, gamma=1.0)
    assert torch.equal(got[0], noise[0].log_softmax(-1))  # 1 · log p + 0 · the other, renormalised
    changed = labels.clone()
    changed[120:] = (changed[120:] + 1) % 4
    assert torch.equal(mixture_replay.learned_pool(features, changed, gamma=1.0)[:121], got[:121])
    late = mixture_replay.nll_of(got.exp(), labels)[-100:].mean()
    assert late < 0.5 * mixture_replay.nll_of(noise.exp(), labels)[-100:].mean()

    out = mixture_replay.scores(got.exp(), labels, at=[100], late=50)
    assert out["nll last 50"] == pytest.approx(float(mixture_replay.nll_of(got.exp(), labels)[-50:].mean()), abs=0)
    assert out["nll last 50 at best T"] <= out["nll last 50"]
