"""benchmarks/results_table.py on the repository's own results/: the rows, and every number read from a file."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def results_table():
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(ROOT / "benchmarks"))
        import results_table

        yield results_table
    sys.modules.pop("results_table", None)


@pytest.fixture(scope="module")
def text(results_table):
    return results_table.table(ROOT / "results")


def rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()[2:] if line.startswith("|")]


def test_every_stream_has_the_four_rows(results_table, text):
    """The default, the rows beside it (its filter alone), the paper's LoKO, the best frozen head and fine-tuner."""
    table = rows(text)
    sizes = [4 + len(stream.also) for stream in results_table.STREAMS]
    assert len(table) == sum(sizes)
    start = 0
    for stream, size in zip(results_table.STREAMS, sizes, strict=True):
        block = table[start : start + size]
        start += size
        learners = [row[1] for row in block]
        assert all(row[0].startswith(stream.name) for row in block)
        assert learners[0].startswith("the ") and "default" in learners[0]
        assert learners[1 : 1 + len(stream.also)] == [entry.name for entry in stream.also]
        assert learners[-3].startswith("the paper's LoKO")
        assert learners[-2].startswith("best frozen head")
        assert learners[-1].startswith("best fine-tuning peer")
    assert len({len(row) for row in table}) == 1


def test_a_cell_is_the_recorded_number(text):
    """The image default's filter's end accuracy on Fashion-MNIST at 32 px: the mean of the three recorded runs."""
    finals = []
    for seed in range(3):
        summary = json.loads((ROOT / f"results/shared_rows/epyc/fm32/shared_avg_h0.1_s{seed}/summary.json").read_text())
        finals.append(100 * summary["results"]["loko"]["final_online_acc"][str(seed)])
    row = next(r for r in rows(text) if r[0].startswith("Fashion-MNIST 32 px") and "filter alone" in r[1])
    assert row[5].startswith(f"{sum(finals) / 3:.1f} ± ")


def test_a_checkpoint_of_a_longer_run_is_its_recorded_point(results_table, text):
    """The image default after 1,000 Fashion-MNIST samples: the point its 5,000-sample runs recorded, not their end
    (read from the study's folded ``runs.json`` by the script's own loader)."""
    points = []
    for seed in range(3):
        summary = results_table.load_run(ROOT / "results", f"default_study/fm32_cal_s{seed}")
        points.append(100 * summary["results"]["loko_default"]["online_acc_at"][str(seed)]["1000"])
    row = next(r for r in rows(text) if r[0].startswith("Fashion-MNIST 32 px") and "default" in r[1])
    assert row[3].startswith(f"{sum(points) / 3:.1f} ± ") and row[3] != row[4]


def test_every_number_is_one_it_read(results_table, monkeypatch):
    """Each cell is a number the script read or `not recorded`: with no run readable, nothing but `not recorded`."""
    seen = []
    original = results_table.load_run

    def spy(results, folder):
        seen.append(folder)
        return original(results, folder)

    monkeypatch.setattr(results_table, "load_run", spy)
    text = results_table.table(ROOT / "results")
    assert seen  # it read recorded runs
    cell = re.compile(r"^(not recorded|[\d.]+( ± [\d.]+)?( \(\d seeds?\))?( @[\d,]+)?|[\d.]+-[\d.]+)$")
    for row in rows(text):
        for value in row[2:]:
            assert cell.match(value), value


def test_missing_run_is_an_error(results_table, tmp_path):
    with pytest.raises(SystemExit, match="no summary"):
        results_table.table(tmp_path)


def test_the_horizon_note_is_read_from_the_longer_run(results_table, text):
    """The note on the tuned AdamW's schedule quotes its NLL after 2,000 samples of its 4,000-sample runs (nll_at) and
    counts the seeds where it is above the text default's 2,000-sample runs, both read from results/."""
    runs = json.loads((ROOT / "results" / "default_study" / "runs.json").read_text())["runs"]
    told = {
        s: p["2000"]
        for s, p in runs["default_study/wordnet4k_adamw"]["summary"]["results"]["adamw_tuned"]["nll_at"].items()
    }
    default = {}
    for seed in range(3):
        default.update(runs[f"default_study/wordnet_scale_s{seed}"]["summary"]["results"]["loko_default"]["final_nll"])
    mean = sum(told.values()) / len(told)
    above = sum(told[s] > default[s] for s in default)
    assert f"NLL {mean:.3f} ± " in text and f"above the text default on {above} of 3 seeds" in text
