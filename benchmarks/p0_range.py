r"""Find LoKO's admissible range of ``p0`` (the paper's p0 bounds table) with short online streams.

Usage:
    python benchmarks/p0_range.py --config configs/quickstart.yaml --samples 500 --p0-min 1e-4 --p0-max 100 \
        --points 7 --out results/p0_range_quickstart [-- loko overrides, e.g. --data.source.image_size 32]

For every ``p0`` of a log grid (or ``--p0s``), one LoKO pass over the same seeded stream from the same initial weights:
the training of ``loko fit`` on the config(s) with ``--seed_everything seed --data.seed seed --data.max_samples N
--model.window W`` and the overrides after ``--``, then ``--model.optimizer.p0 p0`` (built and recorded as in
``compare.py``; see ``benchmarks/common.py``). The divergence guard checks every ``--guard-every`` samples. Each
``p0`` is classified, in this order:

1. **diverged**: the divergence guard fired (moving-average cross-entropy above ``divergence_ce · log m``, or
   ``p̂`` above ``p_limit · p0``), a metric became non-finite, or the online accuracy *collapsed*: the accuracy over
   the last quarter of the stream is at most ``chance + margin`` and either at least ``--collapse-drop`` below that
   of an earlier quarter (it learned, then lost it) or the final moving-average cross-entropy is above
   ``--collapse-ce · log m`` (confidently wrong: worse than uniform guessing by that factor).
2. **no-learning**: the accuracy over the last quarter is at most ``chance + margin`` (chance = 1/m), or the
   moving-average L1 loss did not decrease (its value at the end is not below its value after the first quarter).
3. **admissible** otherwise.

The accuracy over a quarter is recovered exactly from the average online accuracy ``acc(k)``: sample ``k`` was
right iff ``k·acc(k) − (k−1)·acc(k−1)`` rounds to 1.

Outputs in ``--out``: ``p0_range.csv`` (one row per ``p0``), ``p0_range.md`` (the table and the admissible range),
``p0_range.png`` (final online accuracy and last-quarter accuracy against ``p0``, log x, coloured by class).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import common
import numpy as np

CLASS_COLORS = {"admissible": "tab:green", "no-learning": "tab:gray", "diverged": "tab:red"}


def correctness(online_acc: Sequence[float]) -> np.ndarray:
    """Per-sample 0/1 correctness from the running average online accuracy."""
    acc = np.asarray(online_acc, dtype=np.float64)
    k = np.arange(1, len(acc) + 1, dtype=np.float64)
    totals = np.rint(k * acc)
    return np.diff(np.concatenate([[0.0], totals])).clip(0, 1)


def quarter_accuracies(online_acc: Sequence[float]) -> list[float]:
    """Accuracy over each quarter of the stream."""
    right = correctness(online_acc)
    return [float(part.mean()) if part.size else math.nan for part in np.array_split(right, 4)]


def classify(
    result: common.RunResult, *, margin: float = 0.1, collapse_drop: float = 0.25, collapse_ce: float = 1.5
) -> tuple[str, str]:
    """``(class, reason)`` of one run (see the module docstring); chance is ``1 / result.num_classes``."""
    num_classes = result.num_classes
    floor = 1.0 / num_classes + margin
    if result.diverged:
        return "diverged", result.diverged.split(". ")[0]
    if result.steps < 4:
        return "no-learning", "fewer than 4 steps"
    quarters = quarter_accuracies(result.online_acc)
    last, best = quarters[-1], max(quarters[:-1])
    if last <= floor and best - last >= collapse_drop:
        return "diverged", f"collapse: last-quarter accuracy {last:.2f} <= {floor:.2f}, down from {best:.2f}"
    ce_limit = collapse_ce * math.log(num_classes)
    if last <= floor and result.ce_avg[-1] > ce_limit:
        return "diverged", f"confidently wrong: final moving-average CE {result.ce_avg[-1]:.2f} > {ce_limit:.2f}"
    if last <= floor:
        return "no-learning", f"last-quarter accuracy {last:.2f} <= chance + margin {floor:.2f}"
    first_quarter = result.loss_avg[max(0, result.steps // 4 - 1)]
    if not result.loss_avg[-1] < first_quarter:
        return "no-learning", f"L1 loss not decreasing ({first_quarter:.3f} -> {result.loss_avg[-1]:.3f})"
    return "admissible", f"last-quarter accuracy {last:.2f}"


def admissible_range(rows: list[dict[str, Any]]) -> str:
    """A sentence giving the admissible range and where its bounds lie on the grid."""
    p0s = [row["p0"] for row in rows]
    good = [i for i, row in enumerate(rows) if row["class"] == "admissible"]
    if not good:
        return "No admissible p0 on this grid."
    lo, hi = good[0], good[-1]
    text = f"Admissible p0 on this grid: [{p0s[lo]:g}, {p0s[hi]:g}]"
    bounds = []
    if lo > 0:
        bounds.append(f"the lower bound lies in ({p0s[lo - 1]:g}, {p0s[lo]:g}] ({rows[lo - 1]['class']} below)")
    else:
        bounds.append("the lower bound is at or below the grid's smallest p0")
    if hi < len(rows) - 1:
        bounds.append(f"the upper bound lies in [{p0s[hi]:g}, {p0s[hi + 1]:g}) ({rows[hi + 1]['class']} above)")
    else:
        bounds.append("the upper bound is at or above the grid's largest p0")
    gaps = [rows[i]["p0"] for i in range(lo, hi + 1) if rows[i]["class"] != "admissible"]
    text += "; " + "; ".join(bounds)
    if gaps:
        text += f"; not contiguous: {', '.join(f'{g:g}' for g in gaps)} inside it failed"
    return text + "."


def plot(rows: list[dict[str, Any]], path: Path, title: str, floor: float) -> None:
    """Final online accuracy (and last-quarter accuracy) against p0, log x; ``floor`` is chance + margin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(7, 4))
    p0s = [row["p0"] for row in rows]
    axis.plot(p0s, [100 * row["final_online_acc"] for row in rows], color="black", lw=1, label="final online acc")
    axis.plot(p0s, [100 * row["last_quarter_acc"] for row in rows], color="black", lw=1, ls=":", label="last quarter")
    for name, color in CLASS_COLORS.items():
        picked = [row for row in rows if row["class"] == name]
        if picked:
            axis.scatter(
                [row["p0"] for row in picked],
                [100 * row["final_online_acc"] for row in picked],
                color=color,
                s=45,
                zorder=3,
                label=name,
            )
    axis.axhline(100 * floor, color="tab:gray", ls="--", lw=0.8, label="chance + margin")
    axis.set_xscale("log")
    axis.set(xlabel="p0", ylabel="online accuracy (%)", title=title)
    axis.grid(alpha=0.3, which="both")
    axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def run_args(args: argparse.Namespace, p0: float) -> list[str]:
    """The ``loko fit`` arguments of the run at ``p0`` (see the module docstring)."""
    return [
        *common.config_args(args.config),
        f"--seed_everything={args.seed}",
        f"--data.seed={args.seed}",
        f"--data.max_samples={args.samples}",
        f"--model.window={args.window}",
        *args.overrides,
        f"--model.optimizer.p0={p0!r}",
    ]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line: this script's options, then ``--`` and ``loko`` overrides."""
    own, overrides = common.split_overrides(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        description="Sweep LoKO's p0 over a log grid with short online streams built from `loko` configs; classify "
        "each p0 as diverged, no-learning or admissible; print the table and the admissible range; plot accuracy vs "
        "p0. Arguments after `--` are `loko fit` overrides (e.g. -- --data.source.image_size 32).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Classes (first match): diverged = divergence guard, non-finite metric, or last-quarter accuracy <= "
        "chance + margin with either a drop >= collapse-drop from an earlier quarter or a final moving-average "
        "cross-entropy > collapse-ce x log m; no-learning = last-quarter accuracy <= chance + margin, or "
        "moving-average L1 loss at the end not below its value after the first quarter; admissible otherwise.",
    )
    parser.add_argument(
        "--config",
        type=Path,
        action="append",
        required=True,
        help="a `loko` config whose optimizer is LoKO (repeatable, a later one overrides an earlier one)",
    )
    parser.add_argument("--samples", type=int, default=500, help="samples per p0 (data.max_samples)")
    parser.add_argument("--seed", type=int, default=0, help="stream and initialisation seed")
    sweep = parser.add_argument_group("sweep")
    sweep.add_argument("--p0s", type=float, nargs="+", default=None, help="explicit p0 values (overrides the grid)")
    sweep.add_argument("--p0-min", type=float, default=1e-5, help="smallest p0 of the log grid")
    sweep.add_argument("--p0-max", type=float, default=1e3, help="largest p0 of the log grid")
    sweep.add_argument("--points", type=int, default=9, help="grid points (log-spaced, both ends included)")
    classes = parser.add_argument_group("classification")
    classes.add_argument(
        "--window", type=int, default=100, help="moving-average window of the judged losses (model.window)"
    )
    classes.add_argument("--guard-every", type=int, default=50, help="divergence check period in samples (0: off)")
    classes.add_argument("--margin", type=float, default=0.1, help="accuracy margin above chance (1/m)")
    classes.add_argument(
        "--collapse-ce", type=float, default=1.5, help="final CE above this x log m counts as diverged"
    )
    classes.add_argument(
        "--collapse-drop", type=float, default=0.25, help="quarter-accuracy drop that counts as a collapse"
    )
    runtime = parser.add_argument_group("runtime and output")
    runtime.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    runtime.add_argument("--verbose", action="store_true", help="Lightning's info messages")
    runtime.add_argument("--out", type=Path, default=Path("results/p0_range"), help="output directory")
    args = parser.parse_args(own)
    args.overrides = overrides
    if args.p0s is None:
        if not 0 < args.p0_min <= args.p0_max or args.points < 1:
            parser.error("need 0 < --p0-min <= --p0-max and --points >= 1")
        args.p0s = [float(p) for p in np.geomspace(args.p0_min, args.p0_max, args.points)]
    args.p0s = sorted(args.p0s)
    if args.samples < 1 or args.window < 1 or args.guard_every < 0:
        parser.error("--samples and --window must be positive, --guard-every >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Run the sweep and write the outputs; returns one row per p0."""
    args = parse_args(argv)
    command = " ".join(sys.argv[1:] if argv is None else argv)
    with common.quiet(args.verbose):
        return _main(args, command)


def _main(args: argparse.Namespace, command: str) -> list[dict[str, Any]]:
    common.set_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    for p0 in args.p0s:
        result = common.fit(run_args(args, p0), guard_every=args.guard_every)
        name, reason = classify(
            result, margin=args.margin, collapse_drop=args.collapse_drop, collapse_ce=args.collapse_ce
        )
        quarters = quarter_accuracies(result.online_acc) if result.steps >= 4 else [math.nan] * 4
        row = {
            "p0": p0,
            "class": name,
            "steps": result.steps,
            "final_online_acc": result.online_acc[-1] if result.steps else math.nan,
            "last_quarter_acc": quarters[-1],
            "final_loss_avg": result.loss_avg[-1] if result.steps else math.nan,
            "final_ce_avg": result.ce_avg[-1] if result.steps else math.nan,
            "reason": reason,
        }
        rows.append(row)
        print(
            f"[p0_range] p0={p0:<10.3g} {name:12s} acc {100 * row['final_online_acc']:6.2f}% "
            f"(last quarter {100 * row['last_quarter_acc']:6.2f}%) after {result.steps} steps: {reason}",
            flush=True,
        )
    lines = [
        "| p0 | class | steps | final online acc (%) | last-quarter acc (%) | final L1 avg | final CE avg | reason |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['p0']:.3g} | {row['class']} | {row['steps']} | {100 * row['final_online_acc']:.2f} | "
            f"{100 * row['last_quarter_acc']:.2f} | {row['final_loss_avg']:.3f} | {row['final_ce_avg']:.3f} | "
            f"{row['reason']} |"
        )
    table = "\n".join(lines)
    verdict = admissible_range(rows)
    total = time.perf_counter() - started
    setting = result.setting
    floor = 1 / result.num_classes + args.margin
    guard = f"divergence check every {args.guard_every} samples" if args.guard_every else "no divergence check"
    swept = re.sub(r"\bp0=[^,)]*(, )?", "", setting["optimizer"])
    title = f"p0 range: {setting['dataset']} / {setting['backbone']} @ {setting['image_size']}"
    text = (
        f"# {title}\n\nSetting: {setting['network']} ({setting['adapters']}), {setting['dataset']} at "
        f"{setting['image_size']}, {args.samples} samples per p0, seed {args.seed}, {swept} with p0 swept, "
        f"window {args.window}, {guard}, chance + margin = "
        f"{floor:.2f}.\n\n{table}\n\n{verdict}\n\n"
        f"Command: `python benchmarks/p0_range.py {command}` ({total / 60:.1f} min wall). The last p0 trains as "
        f"`loko fit {' '.join(result.command)}`.\n"
    )
    (args.out / "p0_range.md").write_text(text)
    common.write_csv(args.out / "p0_range.csv", list(rows[0]), rows)
    plot(rows, args.out / "p0_range.png", title, floor)
    print(table)
    print(verdict)
    print(f"[p0_range] wrote {args.out}/p0_range.md, p0_range.csv, p0_range.png ({total / 60:.1f} min)")
    return rows


if __name__ == "__main__":
    main()
