r"""How large are the learners' steps along the stream, and how much does LoKO's ``p̂`` shrink?

The hypothesis this measures: LoKO's ``p̂`` only shrinks (no process noise), so its steps would shrink like
``1/k`` while AdamW keeps learning. Each run (one optimizer, one seed, built from ``loko`` configs exactly as
``benchmarks/compare.py`` builds it) records after every step the size of the parameter change
``‖θ_k − θ_{k-1}‖`` over the trainable parameters (adapters and head), and for LoKO the quantiles of ``p̂`` per
kind of parameter (LoRA A, LoRA B, head, other) before the first sample and at the ``--at`` checkpoints.

Outputs in ``--out``: ``step_size.md`` (the tables and the command), ``step_size.csv`` (mean step size per window
of ``--window`` steps), ``p_hat.csv`` (the quantiles) and ``step_size.png`` (step size against samples, log-log,
with a ``1/k`` line for reference).

Example::

    python benchmarks/step_size.py --config configs/fashion_mnist_lite0.yaml --samples 5000 --threads 1 \
        --optimizers loko adamw --out results/late_stream/step_size/fmnist32
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import common
import compare
import lightning.pytorch as pl
import torch

from loko_lightning import LoKO

QUANTILES = (0.01, 0.1, 0.5, 0.9)
KINDS = ("lora_A", "lora_B", "head", "other")


HEAD_NAMES = ("classifier", "head", "fc")


def kind_of(name: str) -> str:
    """The kind of a trainable parameter from its name: LoRA's A or B factor, the head, or other."""
    if "lora_A" in name:
        return "lora_A"
    if "lora_B" in name:
        return "lora_B"
    return "head" if any(part in HEAD_NAMES for part in name.split(".")) else "other"


class StepSizes(pl.Callback):
    """Record ``‖θ_k − θ_{k-1}‖`` after every step and, for LoKO, quantiles of ``p̂`` per kind at given steps.

    Args:
        at: steps after which ``p̂``'s quantiles are taken (and before the first step, as step 0).
    """

    def __init__(self, at: Sequence[int]) -> None:
        self.at = set(at)
        self.sizes: list[float] = []
        self.p_hat: list[dict[str, Any]] = []
        self._previous: list[torch.Tensor] = []
        self._named: list[tuple[str, torch.Tensor]] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Keep the trainable parameters and their initial values; ``p̂`` at step 0."""
        trainable = {id(p) for p in pl_module.trainable_parameters}
        self._named = [(n, p) for n, p in pl_module.named_parameters() if id(p) in trainable]
        self._previous = [p.detach().clone() for _, p in self._named]
        self._record_p_hat(trainer, pl_module, 0)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """The size of this step's change; ``p̂``'s quantiles at a checkpoint."""
        squares = torch.zeros((), dtype=torch.float64)
        with torch.no_grad():
            for (_, p), prev in zip(self._named, self._previous, strict=True):
                squares += (p.detach() - prev).double().square().sum().cpu()
                prev.copy_(p.detach())
        self.sizes.append(math.sqrt(float(squares)))
        if len(self.sizes) in self.at:
            self._record_p_hat(trainer, pl_module, len(self.sizes))

    def _record_p_hat(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        optimizer = pl_module.optimizers()
        optimizer = getattr(optimizer, "optimizer", optimizer)
        if not isinstance(optimizer, LoKO):
            return
        values: dict[str, list[torch.Tensor]] = {}
        for name, param in self._named:
            values.setdefault(kind_of(name), []).append(optimizer.state[param]["cov"].reshape(-1).double())
        for kind in [k for k in KINDS if k in values]:
            flat = torch.cat(values[kind])
            # torch.quantile takes at most 2**24 values: beyond that, an evenly strided subset.
            stride = math.ceil(flat.numel() / 2**24)
            quantiles = torch.quantile(flat[::stride], torch.tensor(QUANTILES, dtype=flat.dtype)).tolist()
            row = {"step": step, "kind": kind, "count": flat.numel(), "mean": float(flat.mean())}
            row.update({f"q{round(100 * q):02d}": v for q, v in zip(QUANTILES, quantiles, strict=True)})
            row["min"] = float(flat.min())
            self.p_hat.append(row)


def window_means(sizes: Sequence[float], window: int) -> list[tuple[int, int, float]]:
    """``(first step, last step, mean size)`` of each window of ``window`` steps (1-based steps; a last partial one)."""
    return [
        (start + 1, min(start + window, len(sizes)), statistics.fmean(sizes[start : start + window]))
        for start in range(0, len(sizes), window)
    ]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line: this script's options, then ``--`` and ``loko`` overrides."""
    own, overrides = common.split_overrides(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        description="Measure the size of each step (||theta_k - theta_k-1|| over the adapters and head) and LoKO's "
        "p-hat quantiles along one stream, per optimizer, built from `loko` configs as benchmarks/compare.py builds "
        "them. Arguments after `--` are `loko fit` overrides."
    )
    parser.add_argument("--config", type=Path, nargs="+", required=True, help="loko config file(s)")
    parser.add_argument("--samples", type=int, default=5000, help="stream length per run")
    parser.add_argument("--seed", type=int, default=0, help="seed of the stream, the initial weights and p-hat0")
    parser.add_argument(
        "--optimizers", nargs="+", default=["loko", "adamw"], choices=compare.OPTIMIZERS, help="learners to run"
    )
    parser.add_argument("--at", type=int, nargs="+", default=[100, 500, 1000, 2000, 5000], help="p-hat checkpoints")
    parser.add_argument("--window", type=int, default=100, help="steps per window of the mean step size")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument(
        "--baseline-dir", type=Path, default=common.BASELINES, help="where the baselines' <name>.yaml overlays are"
    )
    parser.add_argument("--verbose", action="store_true", help="keep Lightning's and the libraries' messages")
    args = parser.parse_args(own)
    if args.samples < 1 or args.window < 1:
        parser.error("--samples and --window must be >= 1")
    args.overrides, args.select_samples = overrides, None
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run every optimizer once and write the outputs; returns the recorded sizes and quantiles per optimizer."""
    args = parse_args(argv)
    command = " ".join(sys.argv[1:] if argv is None else argv)
    with common.quiet(args.verbose):
        return _main(args, command)


def _main(args: argparse.Namespace, command: str) -> dict[str, Any]:
    common.set_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    recorded: dict[str, Any] = {}
    for optimizer in args.optimizers:
        recorder = StepSizes(args.at)
        result = common.fit(compare.run_args(args, optimizer, args.seed), callbacks=[recorder])
        recorded[optimizer] = {"sizes": recorder.sizes, "p_hat": recorder.p_hat, "result": result}
        print(f"[step_size] {optimizer}: {result.steps} steps, {result.wall_s:.0f} s", flush=True)
    size_rows = [
        {"optimizer": name, "first_step": first, "last_step": last, "mean_step_size": mean}
        for name, run in recorded.items()
        for first, last, mean in window_means(run["sizes"], args.window)
    ]
    p_rows = [{"optimizer": name, **row} for name, run in recorded.items() for row in run["p_hat"]]
    common.write_csv(args.out / "step_size.csv", list(size_rows[0]), size_rows)
    if p_rows:
        common.write_csv(args.out / "p_hat.csv", list(p_rows[0]), p_rows)
    text = report(recorded, args, command, time.perf_counter() - started)
    (args.out / "step_size.md").write_text(text)
    plot(recorded, args, args.out / "step_size.png")
    print(text)
    return recorded


def report(recorded: dict[str, Any], args: argparse.Namespace, command: str, wall: float) -> str:
    """The markdown: mean step size over the first window and around each checkpoint, and ``p̂``'s quantiles."""
    first = next(iter(recorded.values()))["result"]
    setting = first.setting
    # A checkpoint within the first window would repeat the first column.
    marks = sorted(
        {min(a, len(run["sizes"])) for run in recorded.values() for a in args.at} - {*range(args.window + 1)}
    )
    header = " | ".join(f"steps {max(1, a - args.window + 1)}-{a}" for a in marks)
    lines = [f"| optimizer | steps 1-{args.window} | {header} | last / first |", "|---" * (len(marks) + 3) + "|"]
    for name, run in recorded.items():
        sizes = run["sizes"]
        means = [statistics.fmean(sizes[max(0, a - args.window) : a]) for a in marks]
        head = statistics.fmean(sizes[: args.window])
        cells = " | ".join(f"{m:.3g}" for m in means)
        lines.append(f"| {compare.LABELS[name]} | {head:.3g} | {cells} | {means[-1] / head:.3f} |")
    text = [
        f"# Step sizes and p̂: {setting['dataset']} / {setting['backbone']} @ {setting['image_size']}",
        "",
        f"Setting: {setting['network']} ({setting['adapters']}), {setting['dataset']} at {setting['image_size']}, "
        f"{args.samples} samples, seed {args.seed}.",
        "",
        f"Mean step size ‖θ_k − θ_(k-1)‖ (adapters and head) over the first {args.window} steps and over the "
        f"{args.window} steps that end at each checkpoint:",
        "",
        *lines,
    ]
    p_rows = [(name, row) for name, run in recorded.items() for row in run["p_hat"]]
    if p_rows:
        names = [f"q{round(100 * q):02d}" for q in QUANTILES]
        text += [
            "",
            "LoKO's p̂ per kind of parameter: mean, quantiles and minimum (step 0: the initial draw):",
            "",
            f"| optimizer | step | kind | entries | mean | {' | '.join(names)} | min |",
            "|---" * (6 + len(names)) + "|",
        ]
        for name, row in p_rows:
            quantiles = " | ".join(f"{row[n]:.3g}" for n in names)
            text.append(
                f"| {compare.LABELS[name]} | {row['step']} | {row['kind']} | {row['count']} | {row['mean']:.4g} | "
                f"{quantiles} | {row['min']:.2g} |"
            )
    runs = "; ".join(f"{compare.LABELS[n]}: `loko fit {' '.join(r['result'].command)}`" for n, r in recorded.items())
    text += ["", f"Command: `python benchmarks/step_size.py {command}` ({wall / 60:.1f} min wall). Runs: {runs}.", ""]
    return "\n".join(text)


def plot(recorded: dict[str, Any], args: argparse.Namespace, path: Path) -> None:
    """Mean step size per window against samples, log-log, with ``c/k`` through LoKO's (or the first) first window."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for name, run in recorded.items():
        means = window_means(run["sizes"], args.window)
        centres = [(first + last) / 2 for first, last, _ in means]
        ax.plot(centres, [m for *_, m in means], color=compare.COLORS[name], label=compare.LABELS[name])
    reference = recorded.get("loko") or next(iter(recorded.values()))
    first_mean = window_means(reference["sizes"], args.window)
    if first_mean:
        k0, size0 = (first_mean[0][0] + first_mean[0][1]) / 2, first_mean[0][2]
        ks = [k0, max(k0 + 1, len(reference["sizes"]))]
        ax.plot(ks, [size0 * k0 / k for k in ks], "k--", linewidth=0.8, label="∝ 1/k")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("samples")
    ax.set_ylabel(f"mean ‖θ_k − θ_(k-1)‖ over {args.window} steps")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
