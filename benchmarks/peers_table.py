r"""The peers study's table of one stream: one row per learner, its seeds pooled (``benchmarks/peers_study.sh`` runs).

Usage:
    python benchmarks/peers_table.py results/peers/bbc --at 250 500 1000 [--learners paper best adamw_tuned ...]

For each learner, the runs ``DIR/<learner>_s<seed>`` (each a ``compare.py`` output folder): average online accuracy
after each of ``--at`` samples and, at the last one, the recent accuracy, the prequential negative log-likelihood and
the expected calibration error (15 bins), mean ± sample std over the seeds found; and the value each seed's online
selection chose (an ``^`` or ``v`` marks a choice at the top or bottom of its grid).
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
import sys
from pathlib import Path

LEARNERS = ("paper", "best", "adamw_tuned", "adamw_const", "schedulefree", "ivon", "posteriors")
NAMES = {
    "paper": "LoKO, paper",
    "best": "LoKO, best preset",
    "adamw_tuned": "AdamW, lr chosen online, annealed",
    "adamw_const": "AdamW, lr chosen online, constant",
    "schedulefree": "schedule-free AdamW",
    "ivon": "IVON",
    "posteriors": "posteriors EKF",
}


def spread(values: list[float], digits: int = 1) -> str:
    """``mean ± std`` (sample std; 0 for one value)."""
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def at(rows: list[dict[str, str]], samples: int) -> dict[str, str]:
    """The first recorded row with at least ``samples`` samples."""
    for row in rows:
        if int(row.get("samples") or row["step"]) >= samples:
            return row
    raise SystemExit(f"peers_table.py: no row at {samples} samples (the stream is shorter?)")


def choice(run: Path) -> str:
    """What the run's selection chose, marked when it sits on an edge of its grid."""
    summary = json.loads((run / "summary.json").read_text())
    for entry in summary["results"].values():
        for text in entry.get("selection", {}).values():
            chosen = re.match(r"chose (\w+)=([^ ]+)", text)
            grid = re.findall(r"(?:\(mean prequential cross-entropy: |, )\w+=([^:]+):", text)
            if chosen:
                value = chosen.group(2)
                mark = "^" if grid and value == grid[-1] else "v" if grid and value == grid[0] else ""
                return f"{value}{mark}"
    return "–"


def table(folder: Path, checkpoints: list[int], learners: list[str]) -> str:
    """The markdown table of ``folder``'s runs."""
    header = " | ".join(f"@{n:,}" for n in checkpoints)
    lines = [
        f"| learner | {header} | recent | NLL | ECE (%) | chose | seeds |",
        "|---|" + "---|" * (len(checkpoints) + 5),
    ]
    for learner in learners:
        runs = sorted(p for p in folder.glob(f"{learner}_s*") if (p / "metrics.csv").is_file())
        if not runs:
            continue
        per_run = []
        for run in runs:
            with (run / "metrics.csv").open(newline="") as handle:
                per_run.append(list(csv.DictReader(handle)))
        cells = [spread([100 * float(at(rows, n)["online_acc"]) for rows in per_run]) for n in checkpoints]
        last = [at(rows, checkpoints[-1]) for rows in per_run]
        recent = spread([100 * float(row["recent_acc"]) for row in last])
        nll = spread([float(row["nll"]) for row in last], 3)
        ece = spread([100 * float(row["ece"]) for row in last])
        chose = ", ".join(choice(run) for run in runs)
        seeds = ", ".join(run.name.rsplit("_s", 1)[1] for run in runs)
        lines.append(
            f"| {NAMES.get(learner, learner)} | {' | '.join(cells)} | {recent} | {nll} | {ece} | {chose} | {seeds} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path, help="a stream's folder of runs (OUT/<stream>)")
    parser.add_argument("--at", type=int, nargs="+", required=True, help="samples; the last is the stream's end")
    parser.add_argument("--learners", nargs="+", default=list(LEARNERS), help="rows, in order")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    print(table(args.folder, args.at, args.learners))


if __name__ == "__main__":
    main()
