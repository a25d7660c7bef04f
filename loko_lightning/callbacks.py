"""Callbacks for online runs."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info


class OnlineReport(pl.Callback):
    """When training ends: print the average online accuracy and where the logs are, and plot the run.

    The plot (``online.png`` beside the logger's ``metrics.csv``) has the paper's two panels: the moving-average
    L1 loss and the average online top-1 accuracy against the number of samples seen. It needs matplotlib
    (``pip install matplotlib``); without it the summary is printed and the plot is skipped with a note.

    Args:
        plot: write the PNG.
    """

    def __init__(self, plot: bool = True) -> None:
        self.plot = plot
        self.lines: list[str] = []

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Summarise the run (rank zero only)."""
        if not trainer.is_global_zero:
            return
        module = pl_module
        samples = int(module.online_acc.weight.item()) if hasattr(module.online_acc, "weight") else trainer.global_step
        lines = [
            f"Average online top-1 accuracy: {100 * float(module.online_acc.compute()):.2f}% over {samples:,} samples "
            f"({100 * float(module.online_acc_top5.compute()):.2f}% top-5; {int(module.skipped)} skipped)"
        ]
        log_dir = Path(trainer.logger.log_dir) if trainer.logger is not None and trainer.logger.log_dir else None
        metrics = log_dir / "metrics.csv" if log_dir is not None else None
        if metrics is not None:
            trainer.logger.save()
            lines.append(f"Per-step metrics: {metrics}")
            if self.plot and metrics.is_file():
                lines.append(plot_metrics(metrics, log_dir / "online.png", window=module.hparams.window))
        if trainer.checkpoint_callback is not None and trainer.checkpoint_callback.last_model_path:
            lines.append(f"Last checkpoint: {trainer.checkpoint_callback.last_model_path}")
        self.lines = lines
        for line in lines:
            rank_zero_info(line)


def plot_metrics(metrics: Path, out: Path, *, window: int = 1000) -> str:
    """Plot ``train/loss_avg{window}`` and ``train/online_acc`` from a Lightning ``metrics.csv``.

    Returns:
        A line saying where the plot is, or why there is none.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "No plot: matplotlib is not installed (pip install matplotlib)"
    loss_key, acc_key = f"train/loss_avg{window}", "train/online_acc"
    steps, losses, accs = [], [], []
    with metrics.open(newline="") as handle:
        for row in csv.DictReader(handle):
            if row.get(acc_key) and row.get(loss_key):
                steps.append(int(row["step"]) + 1)
                losses.append(float(row[loss_key]))
                accs.append(100 * float(row[acc_key]))
    if not steps:
        return f"No plot: {metrics} has no {acc_key} rows yet"
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax_loss.plot(steps, losses)
    ax_loss.set(xlabel="samples", ylabel=f"L1 loss, moving average ({window})", title="Loss")
    ax_acc.plot(steps, accs)
    ax_acc.set(xlabel="samples", ylabel="average online accuracy (%)", title="Online accuracy")
    for axis in (ax_loss, ax_acc):
        axis.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return f"Plot: {out}"
