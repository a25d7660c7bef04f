"""benchmarks/fold_results.py on a temporary results tree: the runs read the same, a referenced file stays."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def scripts():
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(ROOT / "benchmarks"))
        import fold_results
        import results_table

        yield fold_results, results_table
    sys.modules.pop("fold_results", None)
    sys.modules.pop("results_table", None)


def summary(seed: int, acc: float) -> dict:
    """A compare.py summary.json, NaN included (a run alone records no step-time ratio)."""
    return {
        "setting": {"samples": 20},
        "results": {"loko": {"final_online_acc": {str(seed): acc}, "step_time_ratio_vs_adamw": math.nan}},
    }


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """results/study with two run folders (one with a plot the docs embed and a small table), docs, a hash file."""
    results = tmp_path / "results"
    for seed, acc in ((0, 0.25), (1, 0.5)):
        run = results / "study" / "stream" / f"paper_s{seed}"
        run.mkdir(parents=True)
        (run / "summary.json").write_text(json.dumps(summary(seed, acc), indent=2))
        (run / "results.md").write_text(f"# seed {seed} ± 1\n")
    first = results / "study" / "stream" / "paper_s0"
    (first / "compare.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    (first / "at.csv").write_text("samples,acc\n10,0.2\n")
    (results / "study" / "hashes.txt").write_text("abc\n")
    (results / "other").mkdir()
    (results / "other" / "summary.json").write_text(json.dumps(summary(0, 0.75)))
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "study.md").write_text(
        "![curves](study/stream/paper_s0/compare.png)\n\nRead `results/study/stream/paper_s1/summary.json`.\n"
    )
    return results


def test_fold_keeps_the_runs_and_the_referenced_files(scripts, tree, capsys):
    fold_results, results_table = scripts
    keys = ["study/stream/paper_s0", "study/stream/paper_s1"]
    before = {key: json.dumps(results_table.load_run(tree, key)) for key in keys}

    assert fold_results.main(["--results", str(tree), "--study", "study", "--check"]) == 1
    assert (tree / "study/stream/paper_s0/summary.json").is_file()  # --check writes and removes nothing
    assert not (tree / "study/runs.json").exists()

    assert fold_results.main(["--results", str(tree), "--study", "study"]) == 0
    assert {key: json.dumps(results_table.load_run(tree, key)) for key in keys} == before
    runs = json.loads((tree / "study/runs.json").read_text())["runs"]
    assert sorted(runs) == keys
    assert {key: json.dumps(runs[key]["summary"]) for key in keys} == before  # the kept one too
    assert runs["study/stream/paper_s0"]["results_md"] == "# seed 0 ± 1\n"
    assert runs["study/stream/paper_s0"]["files"] == {"at.csv": "samples,acc\n10,0.2\n"}
    left = sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file())
    assert left == [
        "other/summary.json",  # another study, not asked for
        "study/hashes.txt",  # not in a run folder
        "study/runs.json",
        "study/stream/paper_s0/compare.png",  # the image a page embeds
        "study/stream/paper_s1/summary.json",  # a path a page names
    ]
    assert runs["study/stream/paper_s1"]["results_md"] == "# seed 1 ± 1\n"
    # Folded: nothing left to do, and the kept files agree with their entries.
    assert fold_results.main(["--results", str(tree), "--study", "study", "--check"]) == 0
    assert "DISAGREES" not in capsys.readouterr().out


def test_refuses_to_delete_a_referenced_file(scripts, tree):
    fold_results, _ = scripts
    refs = fold_results.references(tree.parent)
    path = tree / "study/stream/paper_s1/summary.json"
    with pytest.raises(SystemExit, match="refusing to delete"):
        fold_results.remove(path, refs, tree.parent)
    assert path.is_file()


def test_reference_patterns(scripts):
    fold_results, _ = scripts
    assert fold_results.expand("results/a/{x,y}_s{seed}/summary.json") == [
        "results/a/x_s*/summary.json",
        "results/a/y_s*/summary.json",
    ]
    assert fold_results.expand("results/a/run_s$s") == ["results/a/run_s*"]
    refs = [fold_results.Reference("results/a/*", "doc")]
    assert fold_results.referenced_by("results/a/b.md", refs) == ["doc"]
    assert fold_results.referenced_by("results/a/run/summary.json", refs) == []  # `*` stays in one folder
