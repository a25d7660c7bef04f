"""The LightningModule: a network from an injected factory, trained online by LoKO or by a torch optimizer."""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

from loko_lightning.errors import ConfigError
from loko_lightning.kalman.optimizer import LoKO
from loko_lightning.learner.checks import (
    check_head_size,
    check_optimizer_kind,
    check_predictive,
    check_schedule_length,
    describe,
    optimizer_config,
    optimizer_from_config,
    probe,
    resolve_selection,
)
from loko_lightning.learner.groups import build_optimizer, check_head_covariance, check_step_scales, parameter_groups
from loko_lightning.learner.metrics import (
    ONLINE_METRICS,
    HeldOutMetric,
    make_held_out_metrics,
    make_online_metrics,
    online_values,
    update_online,
)
from loko_lightning.learner.mixture import FrozenHeadMixture
from loko_lightning.learner.selection import Candidates
from loko_lightning.learner.steps import KalmanStep, OnlineStep, SelectionStep, nested_steps, step_for
from loko_lightning.learner.transfer import data_preprocessing, load_adapters
from loko_lightning.models.adapters import freeze_normalization
from loko_lightning.models.factory import NetworkFactory


@contextlib.contextmanager
def ignore_intended_warnings() -> Iterator[None]:
    """Silence, while the context lasts, Lightning's warnings about what :class:`OnlineClassifier` does on purpose.

    The ``loko`` command runs the trainer inside it; wrap your own ``trainer.fit(...)`` in it for the same quiet log.
    Nothing is changed outside the context (the previous warning filters are restored on exit).
    """
    with warnings.catch_warnings():
        # The frozen backbone's normalisation layers are in eval mode on purpose (batch size 1).
        warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode at the start of training")
        # Checkpoints are meant to hold the state *after* the sample's update (the next sample starts from it).
        warnings.filterwarnings(
            "ignore", message=r"Using ModelCheckpoint with manual optimization and every_n_train_steps"
        )
        # A streamed source's length is its steps, exact: it is read in the training process (no workers).
        warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined")
        yield


class OnlineClassifier(pl.LightningModule):
    """Online fine-tuning (one sample a step, or a joint step over a batch) of the adapters and head of a network.

    Each training step first scores the prediction made *before* updating on its sample (prequential): online
    top-1/top-5 accuracy, moving averages of the L1 loss ``‖y − ŷ‖₁`` and of the cross-entropy. Then
    :class:`~loko_lightning.LoKO` (recognised by type) makes the Kalman update through its observation model (softmax
    by default), any other ``torch.optim.Optimizer`` (the baselines AdamW, AdaGrad) a cross-entropy step, its
    scheduler stepped per sample: the step strategy (:mod:`loko_lightning.learner.steps`) is chosen once, here.
    Logged every step: ``train/online_acc``, ``train/online_acc_top5``, ``train/online_acc_recent{recent_window}``
    (the accuracy of the last ``recent_window`` predictions: is the learner still improving?),
    ``train/loss_avg{window}``, ``train/ce_avg{window}``, the calibration of the same predictions: ``train/nll`` and
    ``train/nll_recent{recent_window}`` (prequential negative log-likelihood), ``train/ece`` and
    ``train/ece_recent{recent_window}`` (expected calibration error, 15 bins:
    :class:`~loko_lightning.learner.metrics.CalibrationError`), ``train/step_time``, ``train/skipped``, ``train/lr``
    (gradient optimizers),
    ``loko/innovation_norm``, ``loko/p_mean``, ``loko/p_min``, ``loko/cond`` (LoKO); ``val/acc``, ``test/acc``.
    Under mixed precision the forward pass and the Jacobian run under autocast, the Kalman update in LoKO's dtype.
    The divergence guard and the RNG states are callbacks (:mod:`loko_lightning.learner.callbacks`).

    Checkpoints hold the network factory's configuration (:meth:`~loko_lightning.models.factory.NetworkFactory.spec`)
    and the class names of the training data, so ``OnlineClassifier.load_from_checkpoint(path)`` needs no other
    argument, and :meth:`predict_step` returns class probabilities for ``trainer.predict`` (``loko predict``).

    Args:
        network: factory of the network (called once, after the optimizer's hyperparameters are checked), e.g.
            :class:`~loko_lightning.models.TimmClassifier`, or its configuration ``{"class_path", "init_args"}``
            (as a checkpoint holds it). The network maps a batch's ``inputs`` to logits.
        optimizer: called with the trainable parameters; default :class:`~loko_lightning.LoKO` with the paper's
            hyperparameters. In a config: ``class_path: loko_lightning.LoKO`` (or ``torch.optim.AdamW``) with its
            ``init_args``.
        lr_scheduler: called with the optimizer, stepped once per sample (gradient optimizers; e.g. torch's
            ``LinearLR`` for the paper's linear decay). ``None``: a constant learning rate. LoKO has none: a scheduler
            or a ``LearningRateMonitor`` with it is a :class:`ConfigError` (watch ``loko/p_mean``).
        window: window of the moving-average losses (paper: 1000).
        recent_window: window of the recent online accuracy (the cumulative average barely moves late in a long
            stream; this one shows whether the learner still improves).
        held_out_metrics: GLUE's held-out metrics besides accuracy, ``"mcc"`` (CoLA's), ``"f1"`` (MRPC's).
        select: choose one optimizer argument online among candidates (:mod:`loko_lightning.learner.selection`): e.g.
            AdamW's ``lr`` among 1e-4 ... 3e-3 on the first 500 samples. ``p0: auto`` in a LoKO optimizer is
            ``Candidates()`` (p0 among ``AUTO_P0`` on ``AUTO_SAMPLES`` samples; ``select.samples`` or
            ``select.values`` change them). Logged while it runs: ``select/<name>``, the leader's value.
        collective_timeout: under DDP, the seconds the learner's gather of the processes' observations (every step)
            waits for the others before the run stops with a one-line error naming the lost process and the last
            checkpoint (a process killed or hung). The other collectives (metric sync, checkpoint barriers, the
            baselines' gradient all-reduce) use the strategy's own timeout (torch's default: 30 minutes;
            ``--trainer.strategy lightning.pytorch.strategies.DDPStrategy --trainer.strategy.timeout 0:05:00``).
        adapters_from: a checkpoint of a network configured the same way but for another label set (another
            ``num_classes``, other classes): this run starts from its adapters (the LoRA weights and, with LoKO,
            their filter covariance p̂) with a new head for this data; the head's weights and filter state, the
            observation noise R and the counters start fresh. Ignored when a run resumes (``ckpt_path``): the
            checkpoint then holds everything.
        step_scales: a factor on the step size of each kind of trainable parameter (``"head"``: every trainable
            parameter outside the adapters, the new head first; ``"lora_A"``; ``"lora_B"``; ``"lora_magnitude"``,
            DoRA's magnitudes; a kind left out keeps 1): LoKO's prior ``p0`` (the group's ``p0_scale``, so
            ``p0: auto`` chooses the scale and keeps the ratio), a gradient optimizer's ``lr``. E.g.
            ``{"head": 0.1}``: the zero head, whose Jacobian (the features) is large next to LoRA's, starts with a 10x
            smaller prior. ``None`` (default): one step size, the paper's.
        head_covariance: ``"diagonal"`` (default, the paper): a diagonal covariance on every parameter.
            ``"shared"`` (not the paper; LoKO's ``filter: covariance`` only): the rows of each matrix of the head
            (one row per class) share one full ``features x features`` covariance ``Σ``, the param group key
            ``shared_rows`` (:class:`~loko_lightning.kalman.algebra.SharedRowBlocks`); the head's bias and the
            adapters stay diagonal. Costs ``features²`` numbers of state and about ``features²`` operations a sample.
        predictive: the probabilities the online metrics score: ``"mean"`` (default, the paper) at the filter's mean;
            ``"posterior"`` (not the paper; LoKO's covariance filter) averaged over its belief before the sample
            (:mod:`~loko_lightning.kalman.predictive`: the ``H P Hᵀ`` the step forms, no extra pass). ``predict``,
            export and serve use the mean.
        mixture: ``None`` (default, the paper) or a
            :class:`~loko_lightning.learner.mixture.FrozenHeadMixture` (not the paper): every prediction is the
            mixture of the learner's and a frozen head's (streaming LDA on the pretrained backbone's features),
            weighted by their prequential likelihoods: the scores, ``predict`` and ``loko serve``. One more forward
            pass a sample (adapters disabled); one process. ``loko export`` writes the network alone.

    Example:
        >>> from functools import partial
        >>> from loko_lightning.models import TimmClassifier
        >>> learner = OnlineClassifier(TimmClassifier("test_resnet", 4, pretrained=False), partial(LoKO, p0=0.1))
    """

    def __init__(
        self,
        network: NetworkFactory,
        optimizer: OptimizerCallable = LoKO,
        lr_scheduler: LRSchedulerCallable | None = None,
        window: int = 1000,
        recent_window: int = 500,
        held_out_metrics: list[HeldOutMetric] | None = None,
        select: Candidates | None = None,
        collective_timeout: float = 300.0,
        adapters_from: str | None = None,
        step_scales: dict[str, float] | None = None,
        head_covariance: str = "diagonal",
        predictive: str = "mean",
        mixture: FrozenHeadMixture | None = None,
    ) -> None:
        super().__init__()
        if isinstance(network, Mapping):
            network = NetworkFactory.from_spec(network)
        if not isinstance(network, NetworkFactory):
            raise ConfigError(
                f"network must be a network factory, got {network!r} ({type(network).__name__}): e.g. "
                "TimmClassifier('resnet18', num_classes=10) or TransformersClassifier('roberta-base', num_classes=2) "
                "from loko_lightning.models (the learner builds the network after checking the optimizer)",
                field="network",
                owner=OnlineClassifier,
            )
        # The factories are objects; checkpoints keep plain values: the network factory as its configuration (what
        # load_from_checkpoint rebuilds it from), the optimizer and schedule not (a checkpoint is used, or resumed
        # with the optimizer configured by the caller).
        self.save_hyperparameters(ignore=["network", "optimizer", "lr_scheduler", "select", "mixture"])
        self.hparams["network"] = network.spec()
        self.automatic_optimization = False
        if not isinstance(window, int) or window < 1:
            raise ConfigError(f"window must be a positive integer, got {window}", field="window", owner=self)
        if not isinstance(recent_window, int) or recent_window < 1:
            raise ConfigError(
                f"recent_window must be a positive integer, got {recent_window}", field="recent_window", owner=self
            )
        if not (isinstance(collective_timeout, (int, float)) and not isinstance(collective_timeout, bool)) or not (
            0 < collective_timeout < float("inf")
        ):
            raise ConfigError(
                f"collective_timeout must be a finite number of seconds > 0, got {collective_timeout!r}",
                field="collective_timeout",
                owner=self,
            )
        self.collective_timeout = float(collective_timeout)
        self.adapters_from = adapters_from
        self.step_scales = check_step_scales(step_scales, owner=OnlineClassifier)
        optimizer, self.select = resolve_selection(optimizer, select, owner=OnlineClassifier)
        # The optimizer's hyperparameters are checked (on a stand-in parameter) before any backbone is built.
        probed = probe(optimizer)
        step = step_for(probed)
        step.check(network, lr_scheduler, owner=OnlineClassifier)
        self.online_step: OnlineStep = step() if self.select is None else SelectionStep(step(), self.select)
        if isinstance(mixture, Mapping):
            mixture = FrozenHeadMixture.from_spec(mixture)
        if mixture is not None and not isinstance(mixture, FrozenHeadMixture):
            raise ConfigError(
                f"mixture must be a FrozenHeadMixture or None, got {mixture!r}: e.g. "
                "FrozenHeadMixture(StreamingLDA) (configs/presets/loko_mixture_lda.yaml)",
                field="mixture",
                owner=OnlineClassifier,
            )
        self.mixture = mixture
        self.hparams["mixture"] = None if mixture is None else mixture.spec()
        if mixture is not None:
            self.online_step = mixture.wrap(self.online_step)
        self.head_covariance = check_head_covariance(head_covariance, probed, owner=OnlineClassifier)
        self.predictive = check_predictive(predictive, probed, self.select is not None, owner=OnlineClassifier)
        self.network_factory, self.optimizer_factory, self.lr_scheduler_factory = network, optimizer, lr_scheduler
        self.num_classes = network.num_classes
        self.network = network()
        # The prequential metrics, attributes of the module (their states in its state dict, as always).
        for name, metric in make_online_metrics(window, recent_window).items():
            setattr(self, name, metric)
        self.register_buffer("skipped", torch.zeros((), dtype=torch.long))
        # The training data's class names (label ids in order) and preprocessing (the data module's effective image
        # data config, or tokenizer and token budget), taken from the data module at fit; kept in checkpoints.
        self.class_names: list[str] | None = None
        self.preprocessing: dict[str, Any] | None = None
        # predict/validate/test preprocess the data as the checkpoint's data was (False: as the data module says).
        self.use_checkpoint_preprocessing = True
        metrics = make_held_out_metrics(held_out_metrics or [], self.num_classes, owner=self)
        self.val_metrics, self.test_metrics = metrics

    # ------------------------------------------------------------------ setup
    @property
    def is_kalman(self) -> bool:
        """Whether the optimizer is LoKO (the steps are Kalman updates) rather than a gradient optimizer."""
        *_, step = nested_steps(self.online_step)  # inside a selection or a mixture: the learner's own step
        return isinstance(step, KalmanStep)

    @property
    def trainable_parameters(self) -> list[nn.Parameter]:
        """The adapter and head parameters, in a fixed order (the optimizer's and the Jacobian's)."""
        return [p for p in self.network.parameters() if p.requires_grad]

    def parameter_groups(self) -> list[dict[str, Any]]:
        """The trainable parameters in their fixed order, in runs of one factor and one covariance.

        A run's ``"scale"`` is its ``step_scales`` factor, its ``"shared_rows"`` whether it holds the head's matrices
        with ``head_covariance="shared"`` (:func:`~loko_lightning.learner.groups.parameter_groups`).
        """
        return parameter_groups(self.network, self.step_scales, self.head_covariance)

    def build_optimizer(self, optimizer: OptimizerCallable | None = None, **overrides: Any) -> torch.optim.Optimizer:
        """``optimizer`` (default: the learner's) over the trainable parameters, scaled by ``step_scales``.

        ``overrides`` are the optimizer's keyword arguments a selection tries (``p0=0.3``). Without ``step_scales``
        this is ``optimizer(trainable_parameters, **overrides)``; with them LoKO gets one param group per run of one
        factor with that ``p0_scale``, a gradient optimizer the same groups with their ``lr`` multiplied; with
        ``head_covariance="shared"`` LoKO's group of the head's matrices also carries ``shared_rows``.
        """
        factory = self.optimizer_factory if optimizer is None else optimizer
        if self.step_scales is None and self.head_covariance == "diagonal":
            return factory(self.trainable_parameters, **overrides)
        return build_optimizer(factory, self.parameter_groups(), self.is_kalman, OnlineClassifier, **overrides)

    def label_names(self) -> list[str]:
        """A name for each of the network's ``m`` outputs: the training data's class names, the ids beyond them."""
        names = list(self.class_names or [])[: self.num_classes]
        return names + [str(i) for i in range(len(names), self.num_classes)]

    def train(self, mode: bool = True) -> OnlineClassifier:
        """Switch modes but keep the backbone's normalisation layers in eval mode (batch size 1)."""
        super().train(mode)
        freeze_normalization(self.network)
        return self

    def setup(self, stage: str) -> None:
        """Report the parameter counts once; refuse a trainer the step cannot run with (LoKO has no ``lr`` to log)."""
        if stage == "fit":
            self.online_step.check_trainer(self.trainer, owner=OnlineClassifier)
            # Lightning's advice for manual optimization with every_n_train_steps (save the state before the step)
            # does not apply: a checkpoint is meant to hold the state after the sample's update. Quiet while fitting.
            previous = self.__dict__.pop("_quiet", None)
            if previous is not None:  # a fit that ended in an exception, without teardown
                previous.__exit__(None, None, None)
            self._quiet = ignore_intended_warnings()
            self._quiet.__enter__()
        else:
            self._follow_checkpoint_preprocessing()
        rank_zero_info(describe(self.network_factory, self.network, self.optimizer_factory))

    def _follow_checkpoint_preprocessing(self) -> None:
        """Outside ``fit``, the data module preprocesses as the checkpoint's training data was (what it kept).

        Called at ``setup`` (a learner from ``load_from_checkpoint``) and when ``trainer.predict``/``validate``/``test``
        load a ``ckpt_path`` (after ``setup``, before any batch is drawn). A data module that cannot follow (no
        ``use_preprocessing``), or ``use_checkpoint_preprocessing = False``, keeps its own.
        """
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        follow = getattr(datamodule, "use_preprocessing", None)
        if self.preprocessing is None or not self.use_checkpoint_preprocessing or not callable(follow):
            return
        changed = follow(self.preprocessing)
        if changed:
            said = "; ".join(f"{key} {saved} (the data module's: {ours})" for key, (ours, saved) in changed.items())
            rank_zero_info(f"Preprocessing as the checkpoint's training data was: {said}")

    def teardown(self, stage: str) -> None:
        """Let the step release what it held (the Jacobian engine's hooks live on the network only while training)."""
        self.online_step.close()
        quiet = self.__dict__.pop("_quiet", None)
        if quiet is not None:
            quiet.__exit__(None, None, None)

    def configure_optimizers(self) -> Any:
        """The injected optimizer over the trainable parameters, with its scheduler stepped every sample."""
        optimizer = self.build_optimizer()
        if self.lr_scheduler_factory is None:
            return optimizer
        scheduler = self.lr_scheduler_factory(optimizer)
        if self._trainer is not None:
            check_schedule_length(scheduler, self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ------------------------------------------------------------------ steps
    def forward(self, inputs: Any) -> Tensor:
        """Logits of the adapted network."""
        return self.network(inputs)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Predict on the step's samples, record the prequential metrics, then update on them.

        One sample per step is the paper. A batch of ``B`` (``data.batch_size``), and under DDP the samples of all
        processes, make one joint LoKO update (:mod:`loko_lightning.kalman.multistream`) or one gradient step on their
        mean loss;
        every prediction is scored before that update. A step whose prediction or loss is not finite (NaN/Inf in
        the input), or whose filter refuses it (a quantity of the update not finite), updates no parameter and no
        filter state (a mixture's frozen head and weights still learn from finite features) and is counted in
        ``train/skipped``. Its finite predictions are scored all the same; one that is not finite is left out of the
        metrics.
        """
        inputs, label = batch["inputs"], batch["label"]
        optimizer = self.optimizers()
        start = time.perf_counter()
        prediction, label, applied = self.online_step.step(self, optimizer, inputs, label)
        self.skipped += (~applied).to(self.skipped.dtype) * label.shape[0]
        elapsed = time.perf_counter() - start
        self._log_online(prediction, label, elapsed)

    def predict_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> dict[str, Tensor]:
        """Class probabilities ``(B, m)`` (softmax of the logits, float32) of a batch, with its ``index``/``label``."""
        probabilities = self.online_step.predict(self, batch["inputs"])
        out = {"probabilities": probabilities}
        for key in ("index", "label"):
            if key in batch:
                out[key] = batch[key]
        return out

    def on_fit_start(self) -> None:
        """Take the class names (what the label ids mean) and the preprocessing of the data module, where it says.

        A new run with ``adapters_from`` starts from that checkpoint's adapters (:meth:`load_adapters`).
        """
        if self.adapters_from is not None and self.trainer.ckpt_path is None:
            self.load_adapters(self.adapters_from)
        datamodule = getattr(self.trainer, "datamodule", None)
        classes = getattr(datamodule, "classes", None)
        if classes is not None:
            self.class_names = [str(name) for name in classes]
        preprocessing = data_preprocessing(datamodule)
        if preprocessing is not None:
            self.preprocessing = preprocessing

    def on_validation_start(self) -> None:
        """Evaluate with the parameters the optimizer predicts with (schedule-free AdamW's average)."""
        self.online_step.evaluate(self, entering=True)

    def on_validation_end(self) -> None:
        """Back to the training parameters."""
        self.online_step.evaluate(self, entering=False)

    def on_test_start(self) -> None:
        """As :meth:`on_validation_start`."""
        self.online_step.evaluate(self, entering=True)

    def on_test_end(self) -> None:
        """As :meth:`on_validation_end`."""
        self.online_step.evaluate(self, entering=False)

    def on_predict_start(self) -> None:
        """As :meth:`on_validation_start`."""
        self.online_step.evaluate(self, entering=True)

    def on_predict_end(self) -> None:
        """As :meth:`on_validation_end`."""
        self.online_step.evaluate(self, entering=False)

    def load_adapters(self, path: str) -> None:
        """Start from a checkpoint's adapters, with this learner's own (new) head: a new label set on trained adapters.

        The LoRA weights are copied; with LoKO in both runs, so is each adapter parameter's covariance p̂ (what the
        filter learned about them). The head (another ``num_classes``), its covariance, the observation noise R and
        the step counters keep this run's fresh values. Call it after the optimizer is built (``on_fit_start`` does).

        Raises:
            ConfigError: no such file, or a checkpoint of a network configured otherwise (another backbone, target,
                rank, ...: only ``num_classes`` may differ), naming ``adapters_from``.
        """
        load_adapters(self, path)

    def on_train_start(self) -> None:
        """Let the step prepare (the candidates of ``select``, from the checkpoint when resuming)."""
        self.online_step.start(self)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep the step's state (the selection's candidates and scores: a run resumes exactly mid-selection)."""
        self.online_step.on_save_checkpoint(checkpoint)
        if self.class_names is not None:
            checkpoint["class_names"] = list(self.class_names)
        if self.preprocessing is not None:
            checkpoint["preprocessing"] = dict(self.preprocessing)
        config = optimizer_config(self.optimizer_factory)
        if config is not None:  # what load_from_checkpoint rebuilds the optimizer from when it is not given one
            checkpoint["optimizer_config"] = config

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """Lightning's ``load_from_checkpoint``, with the optimizer the checkpoint was trained with when none is given.

        The network's configuration and the class names come from the checkpoint (no argument needed). So does the
        optimizer (class and keyword arguments, e.g. ``partial(LoKO, p0=0.05)``) when it was a class or a
        ``functools.partial`` of one with plain arguments and is not passed here: continuing to train the loaded
        learner uses it, not LoKO's defaults. Pass ``optimizer=...`` to choose another.
        """
        if "optimizer" not in kwargs and isinstance(checkpoint_path, (str, Path)) and Path(checkpoint_path).is_file():
            try:
                saved = torch.load(checkpoint_path, map_location="cpu", weights_only=True, mmap=True)
            except Exception:  # not a readable checkpoint: Lightning's own loading below says so
                saved = {}
            optimizer = optimizer_from_config(saved.get("optimizer_config"))
            if optimizer is not None:
                kwargs["optimizer"] = optimizer
        return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Read the step's state; resume with an empty recent window from a checkpoint that has none.

        Raises:
            ConfigError: resuming training with another kind of optimizer than the checkpoint's (LoKO's state into
                AdamW, or the reverse).
        """
        if self._trainer is not None and self.trainer.state.fn == "fit":
            check_head_size(checkpoint, self.num_classes, OnlineClassifier)
            check_optimizer_kind(checkpoint, self.is_kalman, OnlineClassifier)
        # Trained weights are loaded: a later fit continues from them, not from adapters_from's again.
        self.adapters_from = None
        if checkpoint.get("class_names") is not None:
            self.class_names = [str(name) for name in checkpoint["class_names"]]
        if checkpoint.get("preprocessing") is not None:
            self.preprocessing = dict(checkpoint["preprocessing"])
            if self._trainer is not None and self.trainer.state.fn in ("validate", "test", "predict"):
                self._follow_checkpoint_preprocessing()
        self.online_step.on_load_checkpoint(checkpoint)
        state = checkpoint.get("state_dict")
        if state is not None and self._trainer is not None and self.trainer.state.fn == "fit":
            # Schedule-free AdamW's weights are its average x; training resumes from its point y.
            state.update(checkpoint.get("loko_train_point") or {})
        if state is not None:
            # Checkpoints from before a metric existed: it starts empty.
            for name in ("online_acc_recent", "nll", "nll_recent", "ece", "ece_recent"):
                for key, value in getattr(self, name).state_dict(prefix=f"{name}.").items():
                    state.setdefault(key, value)

    def _log_online(self, prediction: Tensor, label: Tensor, elapsed: float) -> None:
        """Score the step's predictions ``(N, m)`` against their labels ``(N,)``, one sample after the other."""
        metrics = {name: getattr(self, name) for name in ONLINE_METRICS}
        update_online(metrics, prediction, label)
        values = online_values(metrics, self.hparams.window, self.hparams.recent_window)
        values["train/step_time"], values["train/skipped"] = elapsed, self.skipped.float()
        values.update(self.online_step.logged(self.optimizers().optimizer))
        self.log_dict(values, on_step=True, on_epoch=False, batch_size=label.shape[0])
        if self._trainer is not None and self.trainer.progress_bar_callback is not None:
            # Lightning turns progress-bar values into Python numbers after every step: one host sync, only if shown.
            self.log("online_acc", values["train/online_acc"], prog_bar=True, logger=False, batch_size=1)

    def _eval_step(self, batch: dict[str, Any], stage: str, metrics: nn.ModuleDict) -> None:
        predicted = self.online_step.predict(self, batch["inputs"]).argmax(-1)
        for key, metric in metrics.items():
            metric.update(predicted, batch["label"])
            self.log(f"{stage}/{key}", metric, prog_bar=key == "acc", batch_size=predicted.shape[0])

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Top-1 accuracy (and ``held_out_metrics``) on the held-out split."""
        self._eval_step(batch, "val", self.val_metrics)

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Top-1 accuracy (and ``held_out_metrics``) on the held-out split."""
        self._eval_step(batch, "test", self.test_metrics)
