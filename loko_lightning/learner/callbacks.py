"""Callbacks for online runs: the end-of-run report, the divergence guard and the RNG states in checkpoints."""

from __future__ import annotations

import copy
import math
import random
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from loko_lightning.errors import ConfigError, DivergenceError
from loko_lightning.kalman.optimizer import LoKO, group_p0

# Where the divergence guard saves the last good state, beside the periodic checkpoints. Its name must not start with
# "last": Lightning's ``ckpt_path="last"`` picks the newest ``last*.ckpt`` and would resume a diverged run from it.
GOOD_STATE_NAME = "good-before-divergence.ckpt"


class OnlineReport(pl.Callback):
    """When training ends: print the average online accuracy and where the outputs are, and plot the run.

    The report keeps its own history of the run (every ``log_every_n_steps`` samples and the last one: the
    moving-average loss and the average online accuracy), saved in checkpoints so that a resumed run plots the whole
    stream. The plot (``online.png`` in the logger's folder, or in the trainer's ``default_root_dir`` without a
    logger) has the paper's two panels: the moving-average loss (L1 for images, cross-entropy for text, as in the
    paper) and the average online top-1 accuracy against the number of samples seen. It works with any logger (CSV,
    TensorBoard, W&B) or none, and names only files that exist. It needs matplotlib (``pip install matplotlib``);
    without it the summary is printed and the plot is skipped with a note.

    The summary's accuracy is over the samples scored, its count of skipped updates over every step's samples: a
    sample whose update was refused (by the filter's checks) is scored all the same, one whose prediction is not finite
    (NaN in its input) is not scored and its update skipped, so the two counts can add up to more than the stream.

    Args:
        plot: write the PNG.
        loss: the moving-average loss reported and plotted: ``"l1"`` (``‖y − ŷ‖₁``) or ``"ce"`` (cross-entropy).
    """

    def __init__(self, plot: bool = True, loss: Literal["l1", "ce"] = "l1") -> None:
        if loss not in ("l1", "ce"):
            raise ConfigError(f"loss must be 'l1' or 'ce', got {loss!r}", field="loss", owner=self)
        self.plot = plot
        self.loss = loss
        self.lines: list[str] = []
        # (samples seen, moving-average loss, average online accuracy) at the recorded steps.
        self.history: list[tuple[int, float, float]] = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Record the step's values every ``log_every_n_steps`` samples and at the last step (one host sync)."""
        step = trainer.global_step
        last = trainer.max_steps > 0 and step >= trainer.max_steps
        every = max(1, trainer.log_every_n_steps)
        if step % every and not last and not _last_batch(trainer, batch_idx):
            return
        self._record(pl_module)

    def _record(self, module: Any) -> None:
        samples = int(module.online_acc.weight.item()) if hasattr(module.online_acc, "weight") else 0
        if samples == 0 or (self.history and self.history[-1][0] == samples):
            return
        average = module.ce_avg if self.loss == "ce" else module.loss_avg
        self.history.append((samples, float(average.compute()), float(module.online_acc.compute())))

    def state_dict(self) -> dict[str, Any]:
        """The history so far (a resumed run's plot starts at the first sample)."""
        return {"history": [list(point) for point in self.history]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue the history of the run a checkpoint comes from."""
        self.history = [(int(n), float(loss), float(acc)) for n, loss, acc in state_dict.get("history", [])]

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Summarise the run (rank zero only)."""
        if not trainer.is_global_zero:
            return
        module = pl_module
        self._record(module)
        samples = int(module.online_acc.weight.item()) if hasattr(module.online_acc, "weight") else trainer.global_step
        skipped = int(module.skipped)
        lines = [
            f"Average online top-1 accuracy: {100 * float(module.online_acc.compute()):.2f}% over {samples:,} samples "
            f"({100 * float(module.online_acc_top5.compute()):.2f}% top-5; {skipped} "
            f"update{'' if skipped == 1 else 's'} skipped)"
        ]
        if self.loss == "ce":
            window = min(int(module.ce_avg.count), module.ce_avg.window)
            ce = float(module.ce_avg.compute())
            lines.append(f"Moving-average cross-entropy over the last {window:,} samples: {ce:.4f}")
        if hasattr(module, "nll") and hasattr(module, "ece"):
            recent = min(int(module.ece_recent.seen), module.ece_recent.window)
            lines.append(
                f"Calibration: prequential negative log-likelihood {float(module.nll.compute()):.4f} "
                f"({float(module.nll_recent.compute()):.4f} over the last {recent:,}), expected calibration error "
                f"{100 * float(module.ece.compute()):.2f}% ({100 * float(module.ece_recent.compute()):.2f}% over the "
                f"last {recent:,}; {module.ece.n_bins} bins)"
            )
        logger = trainer.logger
        if logger is not None:
            logger.save()
        # The logger's own folder: Trainer.log_dir broadcasts, and only rank 0 is here (the others would never answer).
        log_dir = None if logger is None else getattr(logger, "log_dir", None) or getattr(logger, "save_dir", None)
        folder = Path(log_dir) if log_dir else Path(trainer.default_root_dir)
        if logger is not None:
            metrics = folder / "metrics.csv"
            lines.append(
                f"Per-step metrics: {metrics}" if metrics.is_file() else f"Logs: {type(logger).__name__} in {folder}"
            )
        if self.plot:
            lines.append(
                plot_history(self.history, folder / "online.png", window=module.hparams.window, loss=self.loss)
            )
        if trainer.checkpoint_callback is not None and trainer.checkpoint_callback.last_model_path:
            lines.append(f"Last checkpoint: {trainer.checkpoint_callback.last_model_path}")
        self.lines = lines
        for line in lines:
            rank_zero_info(line)


def _last_batch(trainer: pl.Trainer, batch_idx: int) -> bool:
    total = trainer.num_training_batches
    return isinstance(total, int) and batch_idx + 1 >= total


def plot_history(history: list[tuple[int, float, float]], out: Path, *, window: int = 1000, loss: str = "l1") -> str:
    """Plot ``(samples, moving-average loss, average online accuracy)`` points in the paper's two panels.

    Returns:
        A line saying where the plot is, or why there is none.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "No plot: matplotlib is not installed (pip install matplotlib)"
    if not history:
        return "No plot: no step was recorded"
    steps = [point[0] for point in history]
    losses = [point[1] for point in history]
    accs = [100 * point[2] for point in history]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax_loss.plot(steps, losses)
    name = "cross-entropy" if loss == "ce" else "L1 loss"
    ax_loss.set(xlabel="samples", ylabel=f"{name}, moving average ({window})", title="Loss")
    ax_acc.plot(steps, accs)
    ax_acc.set(xlabel="samples", ylabel="average online accuracy (%)", title="Online accuracy")
    for axis in (ax_loss, ax_acc):
        axis.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return f"Plot: {out}"


class DivergenceGuard(pl.Callback):
    """Stop a diverging online run, keeping the state of its last check that passed.

    Every ``check_every`` samples (one host sync) the run stops with :class:`~loko_lightning.errors.DivergenceError`
    when the moving-average cross-entropy of the learner exceeds ``divergence_ce × log m`` (``log m`` is that of
    uniform guessing over ``m`` classes: the run is confidently wrong), when an entry of LoKO's ``p̂`` exceeds
    ``p_limit × p0`` or is not finite (possible only with process noise: without it ``p̂`` only shrinks), when LoKO
    applied none of its updates since the last check (each was not finite: its predictions are still scored, so the
    metrics alone would not show that it stopped learning), or when a parameter of a gradient optimizer is not
    finite. The parameters and optimizer state of the last check that passed (or of the start of training) are then
    restored and saved as ``good-before-divergence.ckpt`` beside the checkpoints, and the error names the
    hyperparameter to change (``p0`` or ``lr``; ``process_noise`` when ``p̂`` alone grew past its limit) and the value
    to try: ten times smaller (or, when no update was applied, the filter's settings). A check that passes with
    updates skipped since the last one (a sample whose prediction is not finite, NaN in its input; an update the filter
    refused) warns with their count, where the run goes on: a bad sample is neither fatal nor silent.

    Args:
        check_every: check every this many samples; 0 disables the guard.
        divergence_ce: the cross-entropy limit in units of ``log m``; ``None`` disables that check.
        p_limit: the limit on LoKO's ``p̂`` in units of its ``p0``.
    """

    def __init__(self, check_every: int = 100, divergence_ce: float | None = 3.0, p_limit: float = 1e3) -> None:
        if not isinstance(check_every, int) or check_every < 0:
            raise ConfigError(
                f"check_every must be >= 0 (0 disables the guard), got {check_every}", field="check_every", owner=self
            )
        if divergence_ce is not None and not divergence_ce > 0:
            message = f"divergence_ce must be > 0, or null to disable the check, got {divergence_ce}"
            raise ConfigError(message, field="divergence_ce", owner=self)
        if not p_limit > 0:
            raise ConfigError(f"p_limit must be > 0, got {p_limit}", field="p_limit", owner=self)
        self.check_every, self.divergence_ce, self.p_limit = check_every, divergence_ce, p_limit
        self._last_good: dict[str, Any] | None = None
        self._start_step = 0
        self._skipped = 0  # the learner's skipped updates at the last check

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The state training starts from (initial or resumed) is the first good state."""
        self._start_step = trainer.global_step
        self._skipped = int(getattr(pl_module, "skipped", 0))
        if self.check_every:
            self._record(trainer, pl_module)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Check after every ``check_every``-th sample of the epoch."""
        if self.check_every and (batch_idx + 1) % self.check_every == 0:
            self._check(trainer, pl_module)

    def _check(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizer = trainer.optimizers[0]
        if not isinstance(optimizer, LoKO) and "lr" not in optimizer.param_groups[0]:
            return  # a head fitted in closed form (streaming LDA): sums of samples, no step size that could diverge
        m = pl_module.num_classes
        ce = float(pl_module.ce_avg.compute())
        limit = self.divergence_ce * math.log(m) if self.divergence_ce else math.inf
        reasons = []
        count = int(pl_module.ce_avg.count)
        if count >= self.check_every and ce > limit:
            reasons.append(
                f"the cross-entropy averaged over the last {min(count, pl_module.ce_avg.window)} samples is "
                f"{ce:.2f}, above {limit:.2f} ({self.divergence_ce:g} x log {m}, uniform guessing)"
            )
        kalman = isinstance(optimizer, LoKO)
        p_grew = refused = False
        if kalman:
            refused = self._refused_every_update(trainer, optimizer)
            if refused:
                reasons.append(
                    f"none of its last {trainer.global_step - self._last_good['step']} updates was applied: each was "
                    "not finite (counted in train/skipped), so the learner has stopped learning"
                )
            p0 = max(group["p0"] for group in optimizer.param_groups)
            prior = max(group_p0(group) for group in optimizer.param_groups)  # p0 x a group's p0_scale
            q = max(group["process_noise"] for group in optimizer.param_groups)
            p_max = float(optimizer.diagnostics["p_max"])
            p_grew = not p_max <= self.p_limit * prior
            if p_grew:
                reasons.append(
                    f"the largest covariance entry p̂ is {p_max:.3g}, above {self.p_limit:g} x p0"
                    + (" x the largest p0_scale" if prior != p0 else "")
                    + f" = {self.p_limit * prior:.3g}"
                )
        elif not bool(torch.stack([p.isfinite().all() for p in pl_module.trainable_parameters]).all()):
            # LoKO never writes a non-finite update; a gradient step can (a finite loss with an overflowing gradient).
            reasons.append("a trainable parameter is NaN or infinite")
        if not reasons:
            self._warn_skipped(trainer, pl_module)
            self._record(trainer, pl_module)
            return
        saved = self._restore_and_save(trainer, pl_module)
        if refused and len(reasons) == 1:
            field, value = "filter", optimizer.filter.config()
            hint = (
                "Either the stream's inputs are NaN (each such sample is skipped) or the filter's arithmetic broke "
                "down (S, its prior scale or the Jacobian not finite; r_estimator: softmax collapsed so on text): "
                "check the stream, or restart with the filter's r_estimator: taylor (the paper's) or LoKO's dtype: "
                "torch.float64"
            )
        elif p_grew and len(reasons) == 1 and q > 0:
            # p̂ grows only by the process noise (p̂ ≤ p0 + k q): a smaller p0 would lower the limit and trip sooner.
            field, value = "process_noise", q
            hint = (
                f"p̂ grows by the process noise q each sample: restart with time_update: {{process_noise: {q / 10:g}}}"
            )
        elif kalman:
            field, value = "p0", p0
            hint = f"Too large a p0 diverges (the paper's p0 bounds table): restart with p0 = {p0 / 10:g}"
        else:
            group = optimizer.param_groups[0]
            field, value = "lr", group.get("initial_lr", group["lr"])
            hint = f"Restart with a smaller learning rate, e.g. lr = {value / 10:g}"
        first_check = self._last_good is not None and self._last_good["step"] == self._start_step
        if ce > limit and first_check and getattr(pl_module.network_factory, "head_init", "zeros") != "zeros":
            # Nothing passed a check since training started: the random head itself may be confidently wrong.
            hint += (
                " (or: it was above the limit at the first check, and a large random head is confidently wrong "
                "before any update: try head_init = 'zeros')"
            )
        name = type(optimizer).__name__
        message = f"{name} diverged by sample {trainer.global_step}: {'; '.join(reasons)}. {hint}. {saved}"
        raise DivergenceError(message, field=field, owner=type(optimizer))

    def _record(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizer = trainer.optimizers[0]
        if hasattr(optimizer, "consolidate_state_dict"):  # a sharded LoKO's p̂ is spread over the processes, which
            optimizer.consolidate_state_dict()  # all check alike (the metrics and p̂'s statistics are global)
        self._last_good = {
            "step": trainer.global_step,
            "applied": _applied_updates(optimizer),
            "params": [p.detach().clone() for p in pl_module.trainable_parameters],
            "optimizer": copy.deepcopy(optimizer.state_dict()),
        }

    def _warn_skipped(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Warn when updates were skipped since the last check (the run goes on; ``train/skipped`` counts them)."""
        skipped = int(getattr(pl_module, "skipped", 0))
        new, self._skipped = skipped - self._skipped, skipped
        if new > 0:
            rank_zero_warn(
                f"{new} update{' was' if new == 1 else 's were'} skipped in the {self.check_every} steps before step "
                f"{trainer.global_step} ({skipped} in all, train/skipped): a prediction not finite (NaN or Inf in the "
                "sample's input: check the stream) or an update the filter refused. Each such prediction that is "
                "finite is scored; the run goes on"
            )

    def _refused_every_update(self, trainer: pl.Trainer, optimizer: LoKO) -> bool:
        """Whether LoKO took steps since the last check that passed and applied none of them.

        With ``p0: auto`` the live state is the leader's, which may have changed since that check; every candidate
        that can lead has applied the same updates (the selection scores one that alone skipped a step infinity), so
        their counts compare.
        """
        if self._last_good is None or trainer.global_step <= self._last_good["step"]:
            return False
        return _applied_updates(optimizer) == self._last_good["applied"]

    def _restore_and_save(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> str:
        snapshot = self._last_good
        if snapshot is None:
            return "No good state was recorded before the divergence."
        with torch.no_grad():
            for param, value in zip(pl_module.trainable_parameters, snapshot["params"], strict=True):
                param.copy_(value)
        trainer.optimizers[0].load_state_dict(snapshot["optimizer"])
        directory = Path(trainer.default_root_dir)
        if trainer.checkpoint_callback is not None and trainer.checkpoint_callback.dirpath:
            directory = Path(trainer.checkpoint_callback.dirpath)
        path = directory / GOOD_STATE_NAME
        trainer.save_checkpoint(path)
        return f"The parameters and filter state after sample {snapshot['step']} are saved in {path}."


def _applied_updates(optimizer: Any) -> int | None:
    """LoKO's count of applied updates (one host read); ``None`` for another optimizer."""
    if not isinstance(optimizer, LoKO):
        return None
    counts = [state["step"] for state in optimizer.state.values() if "step" in state]  # the shared state's, one
    return int(counts[0]) if counts else 0


class RNGStateCheckpoint(pl.Callback):
    """Save the global RNG states (torch, CUDA, numpy, Python) in every checkpoint and restore them on resume.

    LoRA dropout (gradient optimizers) and anything else drawing from the global generators then continues exactly
    as in an uninterrupted run. The states are restored at the first training batch of the resumed run: nothing draws
    from the global RNG between a checkpoint (saved after a sample's update) and the next sample's step, while setup
    between loading and that batch may. The state is stored as tensors and Python numbers, so checkpoints still load
    with ``torch.load(weights_only=True)``.
    """

    def __init__(self) -> None:
        self._pending: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        """The global RNG states now (called when a checkpoint is saved)."""
        return rng_states()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep the saved states until the first training batch."""
        self._pending = dict(state_dict) if state_dict else None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """On the first step of a resumed run, restore the checkpoint's RNG states."""
        if self._pending is not None:
            set_rng_states(self._pending)
            self._pending = None


def rng_states() -> dict[str, Any]:
    """The global RNG states as tensors and Python numbers (loadable with ``torch.load(weights_only=True)``)."""
    name, keys, position, has_gauss, gauss = np.random.get_state()
    version, state, python_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        # Only if this process uses CUDA: asking an unused device for its state would create a CUDA context on it.
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(position), int(has_gauss), float(gauss)],
        "python": [version, list(state), python_gauss],
    }


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what :func:`rng_states` saved (CUDA states only if this process has as many devices)."""
    torch.set_rng_state(states["torch"])
    cuda = states.get("cuda") or []
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    name, keys, position, has_gauss, gauss = states["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, gauss))
    version, state, python_gauss = states["python"]
    random.setstate((version, tuple(state), python_gauss))
