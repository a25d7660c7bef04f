r"""Samples to recover after each label change of a drifting stream, from a comparison runner's ``metrics.csv``.

Usage:
    python benchmarks/compare.py --config configs/fashion_mnist_lite0.yaml --samples 4000 --seeds 0 1 2 \
        --csv-every 1 --out results/drift -- --data.drift_every 1000 --model.recent_window 100
    python benchmarks/drift_recovery.py results/drift/metrics.csv --drift-every 1000 --window 100
    # one folder per run: name the rows (LABEL=PATH), the seeds of one label pooled
    python benchmarks/drift_recovery.py preset=results/drift_s0/metrics.csv preset=results/drift_s1/metrics.csv \
        --drift-every 1000 --window 100

For a change at stream position ``c`` (the labels of positions ``c, c + 1, ...`` follow a new permutation, see
``StreamDataModule(drift_every=...)``): the *pre-drift accuracy* is the recent-window accuracy after sample ``c``
(the last ``window`` predictions before the change), and the *recovery* is the smallest ``t - c`` with
``t >= c + window`` at which the recent-window accuracy (then made of post-change predictions only) is at least
``--fraction`` (0.9) of it. The smallest possible value is ``window``; a run that never gets there before the next
change (or the end) is reported as ``>`` the samples it had. The CSV must hold every step (``--csv-every 1``) for
the exact value; with ``--csv-every k`` the answer is rounded up to the recorded steps.

Prints one row per optimizer (or per ``LABEL`` given as ``LABEL=PATH``, which replaces the optimizer's name of that
file's rows): mean ± sample std over seeds of the recovery after each change, and the pre-drift accuracy. A label
and seed found in two files is refused (the same run counted twice).
"""

from __future__ import annotations

import argparse
import csv
import statistics
from collections import defaultdict
from pathlib import Path


def recoveries(steps: dict[int, float], every: int, window: int, fraction: float, end: int) -> list[tuple]:
    """``(change, pre-drift accuracy, samples to recover or None, samples available)`` for each change."""
    out = []
    for change in range(every, end, every):
        if change not in steps:
            raise SystemExit(f"no row for sample {change}: rerun the comparison with --csv-every 1")
        pre = steps[change]
        stop = min(change + every, end)
        recovered = next(
            (t - change for t in sorted(steps) if change + window <= t <= stop and steps[t] >= fraction * pre), None
        )
        out.append((change, pre, recovered, stop - change))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "metrics", nargs="+", help="metrics.csv of benchmarks/compare.py, or LABEL=PATH to name its rows LABEL"
    )
    parser.add_argument("--drift-every", type=int, required=True, help="the stream's drift_every")
    parser.add_argument("--window", type=int, required=True, help="the learner's recent_window")
    parser.add_argument("--fraction", type=float, default=0.9)
    args = parser.parse_args(argv)
    runs: dict[tuple[str, str], dict[int, float]] = defaultdict(dict)
    for item in args.metrics:
        label, _, path = item.rpartition("=")
        mine: dict[tuple[str, str], dict[int, float]] = defaultdict(dict)
        with Path(path).open() as f:
            for row in csv.DictReader(f):
                mine[(label or row["optimizer"], row["seed"])][int(row["samples"])] = float(row["recent_acc"])
        for key, steps in mine.items():
            if key in runs:
                raise SystemExit(
                    f"{path}: {key[0]} seed {key[1]} is in an earlier file too: give each run its own LABEL"
                )
            runs[key] = steps
    table: dict[str, list[list[tuple]]] = defaultdict(list)
    for (optimizer, _seed), steps in sorted(runs.items()):
        table[optimizer].append(recoveries(steps, args.drift_every, args.window, args.fraction, max(steps)))
    changes = [c for c, *_ in next(iter(table.values()))[0]]
    print("| optimizer | seeds | " + " | ".join(f"after the change at {c:,}" for c in changes) + " |")
    print("|---|---|" + "---|" * len(changes))
    for optimizer, per_seed in table.items():
        cells = []
        for i in range(len(changes)):
            values = [seed[i][2] for seed in per_seed]
            pre = statistics.mean(seed[i][1] for seed in per_seed)
            if any(v is None for v in values):
                done = [v for v in values if v is not None]
                cell = f"{len(values) - len(done)} of {len(values)} not within {per_seed[0][i][3]:,}"
            else:
                spread = f" ± {statistics.stdev(values):.0f}" if len(values) > 1 else ""
                cell = f"{statistics.mean(values):.0f}{spread}"
            cells.append(f"{cell} (pre {100 * pre:.1f}%)")
        print(f"| {optimizer} | {len(per_seed)} | " + " | ".join(cells) + " |")
    print(
        f"\nSamples after each change until the accuracy of the last {args.window} predictions (all after the "
        f"change) is at least {args.fraction:.0%} of its value just before the change (pre); mean ± std over seeds."
    )


if __name__ == "__main__":
    main()
