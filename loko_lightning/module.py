"""The LightningModule: a timm backbone with peft adapters, trained online by LoKO, AdamW or AdaGrad."""

from __future__ import annotations

import contextlib
import copy
import math
import random
import re
import time
import warnings
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.nn import functional as F
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from loko_lightning.adapters import build_model, count_parameters, freeze_normalization
from loko_lightning.functional import REstimator
from loko_lightning.jacobian import jacobian
from loko_lightning.metrics import MovingAverage
from loko_lightning.optim import LoKO

# The frozen backbone's normalisation layers are in eval mode on purpose (batch size 1); Lightning warns about it.
warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode at the start of training")
# Checkpoints are meant to hold the state *after* the sample's update (the next sample starts from it).
warnings.filterwarnings("ignore", message=r"Using ModelCheckpoint with manual optimization and every_n_train_steps")

OptimizerName = Literal["loko", "adamw", "adagrad"]
# The paper's baselines (batch size 1): AdamW lr 1e-4 decaying linearly to 0, weight decay 1e-4;
# AdaGrad lr 1e-3, no weight decay.
# LoKO's p̂ only shrinks without process noise; an entry 1,000 times its initial scale means it ran away.
P_EXPLODES = 1e3
# Where the divergence guard saves the last good state, beside the periodic checkpoints. Its name must not start with
# "last": Lightning's ``ckpt_path="last"`` picks the newest ``last*.ckpt`` and would resume a diverged run from it.
GOOD_STATE_NAME = "good-before-divergence.ckpt"
BASELINE_DEFAULTS: dict[str, dict[str, Any]] = {
    "adamw": {"lr": 1e-4, "weight_decay": 1e-4, "lr_decay": "linear"},
    "adagrad": {"lr": 1e-3, "weight_decay": 0.0, "lr_decay": "constant"},
}


class DivergenceError(RuntimeError):
    """The online run diverged; the message names the cause, the hyperparameter to change and the saved state."""


class OnlineClassifier(pl.LightningModule):
    """Online (batch size 1) fine-tuning of LoRA/DoRA adapters and a new head on a frozen timm backbone.

    Each training step sees one sample and first records the prediction made *before* updating on it
    (prequential, "test-then-train"): the online top-1/top-5 accuracy, the moving averages of the L1 loss
    ``‖y − ŷ‖₁`` and of the cross-entropy, then updates with the chosen optimizer:

    - ``"loko"``: the Kalman update of :class:`~loko_lightning.LoKO` on the softmax output (``m`` = classes);
    - ``"adamw"``/``"adagrad"``: the paper's baselines on the same adapters, a cross-entropy gradient step.

    Logged every step: ``train/online_acc``, ``train/online_acc_top5``, ``train/loss_avg{window}``,
    ``train/ce_avg{window}``, ``train/step_time`` (seconds), ``train/skipped`` (non-finite samples),
    ``train/lr`` (baselines) and, for LoKO, ``loko/innovation_norm``, ``loko/p_mean``, ``loko/p_min``,
    ``loko/cond``. Validation and test log ordinary top-1 accuracy on the held-out split (``val/acc``,
    ``test/acc``).

    Args:
        backbone: timm model name (a pretrained tag allowed, e.g. ``"vit_base_patch16_224.dino"``).
        num_classes: classes of the new head (``m``).
        pretrained: load the backbone's hub weights (needs internet or the HF cache).
        weights: local weights file for the backbone instead of the hub (offline use).
        target: adapter placement: ``"convs"`` (every Conv2d with ``groups == 1``), ``"query"`` (attention
            query projection), a list of module names, or a regex over module names.
        r: adapter rank.
        alpha: LoRA scaling numerator (scale ``alpha / r``); default ``r``.
        dropout: LoRA dropout (baselines only; LoKO's Jacobian needs a deterministic model, so it must be 0).
        use_dora: DoRA instead of LoRA.
        head_init: initialisation of the new head: ``"zeros"`` (default; the first prediction is uniform) or
            ``"timm"`` (the backbone's own; see :func:`~loko_lightning.adapters.build_model`).
        optimizer: ``"loko"``, ``"adamw"`` or ``"adagrad"``.
        p0: LoKO's initial covariance scale (upper bound of ``U(0, p0)`` or the constant).
        p0_init: ``"uniform"`` (paper method 2) or ``"constant"`` (method 1).
        beta: forgetting factor of the observation-noise EMA.
        r_estimator: observation-noise estimator (see :class:`~loko_lightning.LoKO`).
        process_noise: ``q`` added to ``p̂`` every step (0 = the paper).
        kalman_dtype: dtype of the Kalman arithmetic and filter state.
        lr: baseline learning rate; default the paper's (AdamW 1e-4, AdaGrad 1e-3).
        weight_decay: baseline weight decay; default the paper's (AdamW 1e-4, AdaGrad 0).
        betas: AdamW betas.
        lr_decay: ``"linear"`` (to 0 over the stream) or ``"constant"``; default linear for AdamW, constant
            for AdaGrad.
        window: window of the moving-average losses (paper: 1000).
        divergence_ce: stop when the moving-average cross-entropy exceeds this multiple of ``log m`` (that of
            uniform guessing): the run has diverged (confidently wrong). ``None`` disables the check. LoKO also
            stops when an entry of ``p̂`` exceeds ``1e3 · p0`` or is not finite (possible only with process
            noise: without it ``p̂`` only shrinks), the baselines when a parameter is not finite. On divergence
            the state of the last check that passed (or the state training started from) is saved as
            ``good-before-divergence.ckpt`` beside the checkpoints, and :class:`DivergenceError` names the ``p0``
            (or ``lr``) to try: ten times smaller.
        guard_every: check for divergence every this many samples (one host sync each); 0 disables.

    Checkpoints hold, besides the parameters and the optimizer state (LoKO's ``p̂``, ``R`` and step count), the
    online metrics and the global RNG states (torch, CUDA, numpy, Python; restored before the first step of a resumed
    run, for LoRA dropout), so a run resumed from a checkpoint ends exactly like an uninterrupted one.

    Under mixed precision (``trainer.precision="bf16-mixed"``, ...) the forward pass and the Jacobian run under
    autocast, the Kalman update does not: it stays in ``kalman_dtype``.
    """

    def __init__(
        self,
        backbone: str = "resnet18",
        num_classes: int = 10,
        pretrained: bool = True,
        weights: str | None = None,
        target: str | list[str] = "convs",
        r: int = 4,
        alpha: float | None = None,
        dropout: float = 0.0,
        use_dora: bool = False,
        head_init: Literal["zeros", "timm"] = "zeros",
        optimizer: OptimizerName = "loko",
        p0: float = 0.2,
        p0_init: Literal["uniform", "constant"] = "uniform",
        beta: float = 0.95,
        r_estimator: REstimator = "taylor",
        process_noise: float = 0.0,
        kalman_dtype: Literal["float32", "float64"] = "float32",
        lr: float | None = None,
        weight_decay: float | None = None,
        betas: tuple[float, float] = (0.9, 0.999),
        lr_decay: Literal["linear", "constant"] | None = None,
        window: int = 1000,
        divergence_ce: float | None = 3.0,
        guard_every: int = 100,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        if optimizer not in ("loko", *BASELINE_DEFAULTS):
            raise ValueError(f"Invalid model.optimizer={optimizer!r}: expected 'loko', 'adamw' or 'adagrad'")
        if optimizer == "loko" and dropout:
            raise ValueError(
                f"Invalid model.dropout={dropout} with LoKO: the Kalman Jacobian needs a deterministic network; "
                "set model.dropout to 0"
            )
        if kalman_dtype not in ("float32", "float64"):
            raise ValueError(f"Invalid model.kalman_dtype={kalman_dtype!r}: expected 'float32' or 'float64'")
        self.model = build_model(
            backbone,
            num_classes,
            pretrained=pretrained,
            weights=weights,
            target=target,
            r=r,
            alpha=alpha,
            dropout=dropout,
            use_dora=use_dora,
            head_init=head_init,
        )
        if optimizer == "loko":
            # Validate the filter's hyperparameters now (a bad config fails at parse time, not mid-run).
            try:
                LoKO(
                    [torch.zeros(1)],
                    p0=p0,
                    p0_init=p0_init,
                    beta=beta,
                    r_estimator=r_estimator,
                    process_noise=process_noise,
                )
            except ValueError as err:  # "Invalid p0: ..." -> "model.p0: Invalid p0: ...", the key the user sets
                name = re.match(r"Invalid (\w+)", str(err))
                raise ValueError(f"model.{name.group(1)}: {err}" if name else f"model: {err}") from None
        if guard_every < 0:
            raise ValueError(f"Invalid model.guard_every={guard_every}: must be >= 0 (0 disables the guard)")
        if divergence_ce is not None and not divergence_ce > 0:
            raise ValueError(f"Invalid model.divergence_ce={divergence_ce}: must be > 0, or null to disable the check")
        self.online_acc = _OnlineMean()
        self.online_acc_top5 = _OnlineMean()
        self.loss_avg = MovingAverage(window)
        self.ce_avg = MovingAverage(window)
        for metric in (self.online_acc, self.online_acc_top5):
            metric.persistent(True)  # a resumed run continues the average online accuracy exactly
        self.register_buffer("skipped", torch.zeros((), dtype=torch.long))
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes, average="micro")
        self._pending_rng_states: dict[str, Any] | None = None

    # ------------------------------------------------------------------ setup
    @property
    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The adapter and head parameters, in a fixed order (the optimizer's and the Jacobian's)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def train(self, mode: bool = True) -> OnlineClassifier:
        """Switch modes but keep the backbone's normalisation layers in eval mode (batch size 1)."""
        super().train(mode)
        freeze_normalization(self.model)
        return self

    def setup(self, stage: str) -> None:
        """Report the parameter counts once."""
        trainable, total = count_parameters(self.model)
        rank_zero_info(
            f"{self.hparams.backbone}: {trainable:,} trainable parameters of {total:,} "
            f"({100 * trainable / total:.3f}%), optimizer {self.hparams.optimizer}"
        )

    def configure_optimizers(self) -> Any:
        """LoKO, or the baseline with its learning-rate schedule (stepped manually every sample)."""
        hp = self.hparams
        params = self.trainable_parameters
        if hp.optimizer == "loko":
            return LoKO(
                params,
                p0=hp.p0,
                p0_init=hp.p0_init,
                beta=hp.beta,
                r_estimator=hp.r_estimator,
                process_noise=hp.process_noise,
                dtype=getattr(torch, hp.kalman_dtype),
            )
        defaults = BASELINE_DEFAULTS[hp.optimizer]
        lr = defaults["lr"] if hp.lr is None else hp.lr
        weight_decay = defaults["weight_decay"] if hp.weight_decay is None else hp.weight_decay
        decay = defaults["lr_decay"] if hp.lr_decay is None else hp.lr_decay
        if hp.optimizer == "adamw":
            optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=tuple(hp.betas))
        else:
            optimizer = torch.optim.Adagrad(params, lr=lr, weight_decay=weight_decay)
        total = self.trainer.estimated_stepping_batches if self._trainer is not None else math.inf
        if decay == "linear" and math.isfinite(total):
            schedule = linear_decay(int(total))
        elif decay in ("linear", "constant"):
            schedule = constant
        else:
            raise ValueError(f"Invalid model.lr_decay={decay!r}: expected 'linear' or 'constant'")
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ------------------------------------------------------------------ steps
    def forward(self, image: Tensor) -> Tensor:
        """Logits of the adapted model."""
        return self.model(image)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        """Predict on one sample, record the prequential metrics, then update on it.

        A sample whose prediction or loss is not finite (NaN/Inf in the input) changes nothing: no parameter or
        filter state is updated, it is left out of the metrics, and it is counted in ``train/skipped``.
        """
        image, label = batch["image"], batch["label"]
        if image.shape[0] != 1:
            raise ValueError(f"Online training takes one sample per step (batch size 1), got {image.shape[0]}")
        optimizer = self.optimizers()
        start = time.perf_counter()
        if self.hparams.optimizer == "loko":
            target = F.one_hot(label[0], self.hparams.num_classes).to(image.dtype)
            params = self.trainable_parameters
            # Mixed precision: the forward pass and the Jacobian run under the trainer's autocast, the Kalman update
            # (whose matrix products autocast would run in bf16/fp16) in the filter's own dtype.
            device = image.device.type
            mixed = torch.is_autocast_enabled(device)
            autocast_dtype = torch.get_autocast_dtype(device) if mixed else None

            def closure() -> tuple[Tensor, Tensor, list]:
                forward = torch.autocast(device, dtype=autocast_dtype) if mixed else contextlib.nullcontext()
                with forward:
                    prediction, jacobians = jacobian(self.model, image, params, factorize=True)
                return prediction, target, jacobians

            with torch.autocast(device, enabled=False) if mixed else contextlib.nullcontext():
                prediction, _, _ = optimizer.step(closure=closure)
            applied = optimizer.optimizer.diagnostics["applied"]
        else:
            logits = self.model(image)
            loss = F.cross_entropy(logits, label)
            optimizer.zero_grad(set_to_none=True)
            # One host sync per step, for the baselines only: a NaN loss must not reach AdamW's moments.
            applied = torch.isfinite(loss)
            if applied:
                self.manual_backward(loss)
            # With no gradients the torch optimizers leave every parameter alone; the step still counts a sample.
            optimizer.step()
            self.lr_schedulers().step()
            prediction = logits.detach()[0].softmax(-1)
        self.skipped += (~applied).to(self.skipped.dtype)
        elapsed = time.perf_counter() - start
        self._log_online(prediction, label[0], applied, elapsed)
        if self.hparams.guard_every and (batch_idx + 1) % self.hparams.guard_every == 0:
            self._check_divergence()

    def _log_online(self, prediction: Tensor, label: Tensor, applied: Tensor, elapsed: float) -> None:
        prediction = prediction.float()
        k = min(5, prediction.shape[0])
        weight = applied.float()
        self.online_acc.update((prediction.argmax() == label).float(), weight)
        self.online_acc_top5.update((prediction.topk(k).indices == label).any().float(), weight)
        one_hot = F.one_hot(label, prediction.shape[0]).to(prediction.dtype)
        self.loss_avg.update((one_hot - prediction).abs().sum(), applied)
        self.ce_avg.update(-prediction[label].clamp_min(torch.finfo(prediction.dtype).tiny).log(), applied)
        window = self.hparams.window
        values = {
            "train/online_acc": self.online_acc.compute(),
            "train/online_acc_top5": self.online_acc_top5.compute(),
            f"train/loss_avg{window}": self.loss_avg.compute(),
            f"train/ce_avg{window}": self.ce_avg.compute(),
            "train/step_time": elapsed,
            "train/skipped": self.skipped.float(),
        }
        if self.hparams.optimizer == "loko":
            diagnostics = self.optimizers().optimizer.diagnostics
            for key in ("innovation_norm", "p_mean", "p_min", "cond"):
                values[f"loko/{key}"] = diagnostics[key].float()
        else:
            values["train/lr"] = self.lr_schedulers().get_last_lr()[0]
        self.log_dict(values, on_step=True, on_epoch=False, batch_size=1)
        if self._trainer is not None and self.trainer.progress_bar_callback is not None:
            # Lightning turns progress-bar values into Python numbers after every step: one host sync, only if shown.
            self.log("online_acc", values["train/online_acc"], prog_bar=True, logger=False, batch_size=1)

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Save the global RNG states (torch, CUDA, numpy, Python) with the model: LoRA dropout draws from them."""
        checkpoint["loko_rng_states"] = _rng_states()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep the saved RNG states until training resumes (setup between here and there draws from the RNG)."""
        self._pending_rng_states = checkpoint.get("loko_rng_states")

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """On the first step of a resumed run, restore the RNG states of the checkpoint.

        Nothing draws from the global RNG between a checkpoint (saved after a sample's update) and the next sample's
        step, so this is exactly the state an uninterrupted run has at that step.
        """
        if self._pending_rng_states is not None:
            _set_rng_states(self._pending_rng_states)
            self._pending_rng_states = None

    # ------------------------------------------------------------------ divergence guard
    def _check_divergence(self) -> None:
        """Every ``guard_every`` samples: stop a diverging run, keeping its last good state (one host sync)."""
        hp = self.hparams
        ce = float(self.ce_avg.compute())
        limit = hp.divergence_ce * math.log(hp.num_classes) if hp.divergence_ce else math.inf
        reasons = []
        if int(self.ce_avg.count) >= hp.guard_every and ce > limit:
            reasons.append(
                f"the cross-entropy averaged over the last {min(int(self.ce_avg.count), hp.window)} samples is "
                f"{ce:.2f}, above {limit:.2f} ({hp.divergence_ce:g} x log {hp.num_classes}, uniform guessing)"
            )
        if hp.optimizer == "loko":
            p_max = float(self.optimizers().optimizer.diagnostics["p_max"])
            if not p_max <= P_EXPLODES * hp.p0:
                reasons.append(f"the largest covariance entry p̂ is {p_max:.3g}, above {P_EXPLODES:g} x p0")
        elif not bool(torch.stack([p.isfinite().all() for p in self.trainable_parameters]).all()):
            # LoKO never writes a non-finite update; a baseline can (a finite loss with an overflowing gradient).
            reasons.append("a trainable parameter is NaN or infinite")
        if not reasons:
            self._record_good_state()
            return
        saved = self._save_last_good()
        hint = (
            f"Too large a p0 diverges (the paper's p0 bounds table): restart with --model.p0 {hp.p0 / 10:g}"
            if hp.optimizer == "loko"
            else f"Restart with a smaller learning rate, e.g. --model.lr {self._baseline_lr() / 10:g}"
        )
        snapshot = getattr(self, "_last_good", None)
        first_check = snapshot is not None and snapshot["step"] == self._start_step
        if ce > limit and first_check and hp.head_init != "zeros":
            # Nothing passed a check since training started: the random head itself may be confidently wrong.
            hint += (
                " (or: it was above the limit at the first check, and a large random head is confidently wrong "
                "before any update: try --model.head_init zeros)"
            )
        field = "model.p0" if hp.optimizer == "loko" else "model.lr"
        raise DivergenceError(
            f"{field}: {hp.optimizer} diverged by sample {self.global_step}: {'; '.join(reasons)}. {hint}. {saved}"
        )

    def on_train_start(self) -> None:
        """The state training starts from (initial or resumed) is the first good state of the divergence guard."""
        self._start_step = self.global_step
        if self.hparams.guard_every:
            self._record_good_state()

    def _record_good_state(self) -> None:
        self._last_good = {
            "step": self.global_step,
            "params": [p.detach().clone() for p in self.trainable_parameters],
            "optimizer": copy.deepcopy(self.optimizers().optimizer.state_dict()),
        }

    def _save_last_good(self) -> str:
        snapshot = getattr(self, "_last_good", None)
        if snapshot is None or self._trainer is None:
            return "No good state was recorded before the divergence."
        with torch.no_grad():
            for param, value in zip(self.trainable_parameters, snapshot["params"], strict=True):
                param.copy_(value)
        self.optimizers().optimizer.load_state_dict(snapshot["optimizer"])
        directory = Path(self.trainer.default_root_dir)
        if self.trainer.checkpoint_callback is not None and self.trainer.checkpoint_callback.dirpath:
            directory = Path(self.trainer.checkpoint_callback.dirpath)
        path = directory / GOOD_STATE_NAME
        self.trainer.save_checkpoint(path)
        return f"The parameters and filter state after sample {snapshot['step']} are saved in {path}."

    def _baseline_lr(self) -> float:
        return BASELINE_DEFAULTS[self.hparams.optimizer]["lr"] if self.hparams.lr is None else self.hparams.lr

    def _eval_step(self, batch: dict[str, Tensor], metric: MulticlassAccuracy, name: str) -> None:
        logits = self.model(batch["image"])
        metric.update(logits, batch["label"])
        self.log(name, metric, on_step=False, on_epoch=True, prog_bar=True, batch_size=batch["label"].shape[0])

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        """Top-1 accuracy on the held-out split."""
        self._eval_step(batch, self.val_acc, "val/acc")

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        """Top-1 accuracy on the held-out split."""
        self._eval_step(batch, self.test_acc, "test/acc")


class _OnlineMean(MeanMetric):
    """``MeanMetric`` without its NaN scan, which reads ``.any()`` on the host (a device sync) at every update.

    The online accuracies average finite 0/1 values; a skipped sample comes with weight 0. (torchmetrics'
    ``nan_strategy="disable"`` would skip the scan too, but it also drops the weights.)
    """

    def update(self, value: Tensor, weight: Tensor) -> None:
        """Add ``value`` with ``weight``, both 0-d tensors."""
        self.mean_value += (value * weight).to(self.mean_value.dtype)
        self.weight += weight.to(self.weight.dtype)


def _rng_states() -> dict[str, Any]:
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


def _set_rng_states(states: dict[str, Any]) -> None:
    """Restore what :func:`_rng_states` saved (CUDA states only if this process has as many devices)."""
    torch.set_rng_state(states["torch"])
    cuda = states.get("cuda") or []
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    name, keys, position, has_gauss, gauss = states["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, gauss))
    version, state, python_gauss = states["python"]
    random.setstate((version, tuple(state), python_gauss))


def linear_decay(total: int):
    """Learning-rate factor falling linearly from 1 to 0 over ``total`` steps."""

    def factor(step: int) -> float:
        return max(0.0, 1.0 - step / max(1, total))

    return factor


def constant(step: int) -> float:
    """Learning-rate factor 1."""
    return 1.0
