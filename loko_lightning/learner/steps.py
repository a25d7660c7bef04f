"""How the learner updates on a step's samples: a Kalman step, a gradient step, or either one run by every candidate.

The learner chooses its strategy once, when it is built (:class:`SelectionStep` around one of the other two for
``select`` and ``p0: auto``). Each strategy predicts on the step's samples and then updates on them, says what it
logs, and checks the configuration it needs (when the learner is built and when training starts). A step returns
``(prediction, label, applied)``: the ``(N, m)`` predictions made before the update, their ``(N,)`` labels (under DDP
those of every process), and whether the update was applied (a 0-d bool tensor: a step whose prediction or loss is
not finite changes nothing).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.nn import functional as F

from loko_lightning.errors import ConfigError
from loko_lightning.jacobians.engine import JacobianEngine
from loko_lightning.kalman.distributed import all_gather_observations
from loko_lightning.kalman.optimizer import LoKO
from loko_lightning.kalman.predictive import PredictiveScale, sample_blocks
from loko_lightning.learner.checks import check_selection_trainer, refuse_learning_rate_tools
from loko_lightning.learner.selection import Candidates, CandidateStates

StepResult = tuple[Tensor, Tensor, Tensor]


class OnlineStep:
    """One online step of the learner (``module``): predict on the step's samples, then update on them.

    The hooks besides :meth:`step` do nothing unless a strategy needs them.
    """

    #: The strategy runs in one process only (the peers: their packages' updates are not wired to Lightning's DDP).
    single_process: ClassVar[bool] = False

    @staticmethod
    def check(network: Any, lr_scheduler: Any, owner: Any) -> None:
        """Refuse a network or scheduler this strategy cannot run with (when the learner is built); any by default."""

    def step(self, module: pl.LightningModule, optimizer: Any, inputs: Any, label: Tensor) -> StepResult:
        """Predict on ``inputs`` and update on them with ``optimizer`` (Lightning's wrapper or the torch optimizer)."""
        raise NotImplementedError

    def logged(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's values logged every step, besides the online metrics."""
        return {}

    def predicts_apart(self, optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager[None] | None:
        """Where the step scores a forward pass of its own: the context in which the network's no-grad outputs are it.

        ``None`` (the default) where the prediction comes out of the update's own pass. A step that returns a context
        takes ``outputs=``, the network's outputs on the step's inputs made in that context by its caller (the
        mixture's pass with the frozen features, :meth:`FrozenFeatures.with_adapted
        <loko_lightning.learner.frozen_features.FrozenFeatures.with_adapted>`), in place of its own pass.
        """
        return None

    def check_trainer(self, trainer: pl.Trainer, owner: Any) -> None:
        """Refuse a trainer this strategy cannot run with (called when fitting starts).

        By default: several processes where the strategy runs in one (:attr:`single_process`).
        """
        if self.single_process and trainer.world_size > 1:
            raise ConfigError(
                f"the peer optimizers (loko_lightning.peers) run in one process; this trainer has "
                f"{trainer.world_size}: set --trainer.devices 1 (or use LoKO or AdamW for DDP)",
                field="optimizer",
                owner=owner,
            )

    def start(self, module: pl.LightningModule) -> None:
        """Prepare for training, once the optimizer is in place (from a checkpoint's state when resuming)."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add this strategy's state to ``checkpoint``."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Read this strategy's state from ``checkpoint`` (applied by :meth:`start`)."""

    def close(self) -> None:
        """Release what the steps held on to (called when training ends)."""

    def evaluate(self, module: pl.LightningModule, entering: bool) -> None:
        """Set the parameters evaluation and prediction use (``entering``), or back to the training ones."""

    def predict(self, module: pl.LightningModule, inputs: Any) -> Tensor:
        """Class probabilities ``(B, m)``, float32, outside training (evaluation, ``loko predict``, serving).

        By default the network's (with the parameters :meth:`evaluate` set); a mixture predicts as it is scored.
        """
        return module.network(inputs).float().softmax(-1)

    def follow(self, other: OnlineStep) -> None:
        """Predict as ``other`` (the same strategy, learning in another copy of the learner) now does.

        The parameters are copied by the caller; a strategy with a prediction state of its own copies it here.
        """


def nested_steps(step: OnlineStep | None) -> Iterator[OnlineStep]:
    """``step`` and the steps it wraps, outermost first (a mixture's or a selection's ``inner`` step, and so on)."""
    while step is not None:
        yield step
        step = getattr(step, "inner", None)


def collective_timeout(module: pl.LightningModule) -> float | None:
    """The seconds the step's gather waits for the other processes (``OnlineClassifier.collective_timeout``)."""
    return getattr(module, "collective_timeout", None)


class ServesAnAverage(OnlineStep):
    """A step whose model predicts with an average of its training point (:meth:`serving`, None: with that point).

    Evaluation, testing and prediction during a fit then use the average too, and a checkpoint's weights are the
    average, with the training point beside them (:func:`save_served_weights`).
    """

    def __init__(self) -> None:
        self._module: pl.LightningModule | None = None
        self._evaluating: contextlib.ExitStack | None = None

    def serving(self, optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager[None] | None:
        """Inside, the parameters hold the average (None: this optimizer keeps none)."""
        raise NotImplementedError

    def start(self, module: pl.LightningModule) -> None:
        """Remember the learner (its checkpoints need the optimizer's average)."""
        self._module = module

    def evaluate(self, module: pl.LightningModule, entering: bool) -> None:
        """Move the parameters to the average for evaluation and prediction during a fit (and back after)."""
        optimizers = module._trainer.optimizers if module._trainer is not None else []
        if entering and optimizers and self._evaluating is None:
            serving = self.serving(optimizers[0])
            if serving is not None:
                self._evaluating = contextlib.ExitStack()
                self._evaluating.enter_context(serving)
        elif not entering and self._evaluating is not None:
            self._evaluating.close()
            self._evaluating = None

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The weights are the average; the training point is kept as ``"loko_train_point"`` for resuming."""
        module = self._module
        if module is None or not module._trainer or not module.trainer.optimizers or self._evaluating is not None:
            return
        serving = self.serving(module.trainer.optimizers[0])
        if serving is not None:
            save_served_weights(module, checkpoint, serving)


class KalmanStep(ServesAnAverage):
    """:class:`~loko_lightning.LoKO`'s step: the Jacobian engine observes the samples, the filter updates on them.

    The engine is built at the first step, with the optimizer's observation model, so the prediction, the target
    made from the label and the Jacobian are the ones the filter expects. One sample is the paper's update; a batch,
    and under DDP the samples of all processes (gathered, so that every process applies the same update), make one
    joint update; with ``LoKO(shard=True)`` the optimizer exchanges each process's shard of the blocks instead and each
    process updates its own parameters (:mod:`loko_lightning.kalman.sharded`). Under mixed precision the forward pass
    and the Jacobian run under the trainer's autocast, the Kalman update (whose matrix products autocast would run in
    bf16/fp16) in the filter's own dtype. Logged:
    ``loko/innovation_norm``, ``loko/p_mean``, ``loko/p_min``, ``loko/cond`` (and ``loko/predictive_kappa`` with the
    posterior predictive).
    """

    def __init__(self) -> None:
        super().__init__()
        self._engine: JacobianEngine | None = None
        #: With the learner's ``predictive="posterior"``: the scale of the posterior predictive and its losses.
        self.predictive: PredictiveScale | None = None

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The average's training point (:class:`ServesAnAverage`) and the posterior predictive's losses."""
        super().on_save_checkpoint(checkpoint)
        if self.predictive is not None:
            checkpoint["loko_predictive"] = self.predictive.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Read the posterior predictive's losses (a checkpoint without them: the scales start again)."""
        super().on_load_checkpoint(checkpoint)
        if checkpoint.get("loko_predictive") is not None:
            self.predictive = PredictiveScale()
            self.predictive.load_state_dict(checkpoint["loko_predictive"])

    @staticmethod
    def check(network: Any, lr_scheduler: Any, owner: Any) -> None:
        """The network must be deterministic (no dropout), and LoKO has no learning rate to schedule."""
        if getattr(network, "dropout", 0.0):
            raise ConfigError(
                f"dropout={network.dropout} with LoKO: the Kalman Jacobian needs a deterministic network; set it to 0",
                field="dropout",
                owner=network,
            )
        refuse_learning_rate_tools(owner, lr_scheduler=lr_scheduler)

    def check_trainer(self, trainer: pl.Trainer, owner: Any) -> None:
        """A ``LearningRateMonitor`` has nothing to log with LoKO; float16 mixed precision is refused.

        ``16-mixed`` scales the loss for a backward pass LoKO does not take (on a GPU Lightning's gradient scaler would
        call ``step()`` without the closure), and float16 Jacobians of probabilities underflow where bfloat16's do not.
        """
        refuse_learning_rate_tools(owner, callbacks=trainer.callbacks)
        if str(trainer.precision) == "16-mixed" or getattr(trainer.precision_plugin, "scaler", None) is not None:
            raise ConfigError(
                f"precision {trainer.precision!r} scales a loss gradient that LoKO does not use (its update needs the "
                "Jacobian, not a scaled backward pass). To fix it: precision bf16-mixed (forward pass and Jacobian "
                "in bfloat16, the Kalman update in float32) or 32-true",
                field="precision",
                owner=pl.Trainer,
            )

    def predicts_apart(self, optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager[None] | None:
        """With ``LoKO(average=...)``: :meth:`~loko_lightning.LoKO.averaged`, in which the scored prediction is made."""
        loko = getattr(optimizer, "optimizer", optimizer)
        return loko.averaged() if loko.average else None

    def step(
        self, module: pl.LightningModule, optimizer: Any, inputs: Any, label: Tensor, outputs: Tensor | None = None
    ) -> StepResult:
        """One Kalman update on the step's samples (see the class); ``outputs``: see :meth:`predicts_apart`."""
        loko = getattr(optimizer, "optimizer", optimizer)
        if self._engine is None:
            self._engine = JacobianEngine(
                module.network, module.trainable_parameters, observation=loko.observation, factorize=True
            )
        engine = self._engine
        device = label.device.type
        mixed = torch.is_autocast_enabled(device)
        autocast_dtype = torch.get_autocast_dtype(device) if mixed else None
        world = world_size(module)
        joint = label.shape[0] > 1 or world > 1
        if world > 1:  # LoKO's exchange gathers every process's observations (or, sharded, exchanges their blocks)
            loko.exchange.gather = True
            if loko.collective_timeout is None:
                loko.collective_timeout = collective_timeout(module)

        def closure() -> tuple[Tensor, Tensor, list]:
            forward = torch.autocast(device, dtype=autocast_dtype) if mixed else contextlib.nullcontext()
            with forward:
                return engine.observe(inputs, label, batched=joint)

        averaged = None
        if loko.average:  # the prediction scored (and served) is the averaged mean's, made before the update
            if outputs is None:
                with torch.no_grad(), loko.averaged():
                    outputs = module.network(inputs)
            averaged = loko.observation.predict(outputs.reshape(label.shape[0], -1))
        if averaged is not None and world > 1:  # every process's, in the exchange's order (rank order, as its gather)
            own = F.one_hot(label, averaged.shape[-1]).to(averaged.dtype)
            averaged, _, _ = all_gather_observations(averaged, own, [], timeout=loko.collective_timeout)
        with torch.autocast(device, enabled=False) if mixed else contextlib.nullcontext():
            prediction, target, _ = optimizer.step(closure=closure)
        if not joint:
            prediction = prediction[None]
        elif world > 1:
            label = target.argmax(-1)
        if averaged is not None:
            prediction = averaged.to(prediction.dtype)
        applied = loko.diagnostics["applied"]
        if getattr(module, "predictive", "mean") == "posterior" and loko.prediction_cov is not None:
            self.predictive = self.predictive or PredictiveScale()
            blocks = sample_blocks(loko.prediction_cov, prediction.shape[0])
            prediction = self.predictive(prediction, blocks, label)
        return prediction, label, applied

    def serving(self, optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager[None] | None:
        """With ``LoKO(average=...)``: :meth:`~loko_lightning.LoKO.averaged` (the checkpoints hold ``θ̄``)."""
        return optimizer.averaged() if getattr(optimizer, "average", 0.0) else None

    def logged(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The filter's diagnostics of the last step."""
        diagnostics = optimizer.diagnostics
        logged = {f"loko/{key}": diagnostics[key].float() for key in ("innovation_norm", "p_mean", "p_min", "cond")}
        if self.predictive is not None:  # the scale that predicts the next sample
            logged["loko/predictive_kappa"] = self.predictive.kappa
        return logged

    def close(self) -> None:
        """Close the Jacobian engine: its hooks live on the network only while training runs."""
        if self._engine is not None:
            self._engine.close()
            self._engine = None


class GradientStep(OnlineStep):
    """A torch optimizer's step (the baselines AdamW, AdaGrad) on the cross-entropy of the step's samples.

    A batch, and under DDP the samples of all processes (gradients all-reduced), make one step on their mean loss
    (:func:`descend`); the scheduler is stepped every step. Logged: ``train/lr``.
    """

    def step(self, module: pl.LightningModule, optimizer: Any, inputs: Any, label: Tensor) -> StepResult:
        """One gradient step on the mean cross-entropy of the step's samples."""
        logits = module.network(inputs)
        loss = F.cross_entropy(logits, label)
        applied = descend(module, optimizer, loss)
        prediction = logits.detach().softmax(-1)
        return (*gather_scored(module, prediction, label), applied)

    def logged(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The learning rate of the last step."""
        return learning_rate(optimizer)


def descend(module: pl.LightningModule, optimizer: Any, loss: Tensor, finite: Tensor | None = None) -> Tensor:
    """Backward through ``loss`` and step (and the scheduler), unless it (or ``finite``) is not finite."""
    optimizer.zero_grad(set_to_none=True)
    # One host sync per step, for gradient optimizers only: a NaN loss must not reach AdamW's moments. Under DDP
    # the processes agree first (a process skipping backward alone would leave the others waiting in all-reduce).
    applied = torch.isfinite(loss) if finite is None else torch.isfinite(loss) & finite
    if world_size(module) > 1:
        applied = module.all_gather(applied).all()
    if applied:
        module.manual_backward(loss)
    # With no gradients the torch optimizers leave every parameter alone; the step still counts a sample.
    optimizer.step()
    scheduler = module.lr_schedulers()
    if scheduler is not None:
        scheduler.step()
    return applied


def gather_scored(module: pl.LightningModule, prediction: Tensor, label: Tensor) -> tuple[Tensor, Tensor]:
    """Under DDP every process's predictions and labels (the metrics score them all); else as they are."""
    if world_size(module) > 1:
        target = F.one_hot(label, module.num_classes).to(prediction.dtype)
        prediction, target, _ = all_gather_observations(prediction, target, [], timeout=collective_timeout(module))
        label = target.argmax(-1)
    return prediction, label


def learning_rate(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``train/lr``: the learning rate of the last step (the scheduler's ``get_last_lr()`` after its step)."""
    return {"train/lr": optimizer.param_groups[0]["lr"]}


def save_served_weights(
    module: pl.LightningModule, checkpoint: dict[str, Any], serving: contextlib.AbstractContextManager[None]
) -> None:
    """A checkpoint's weights are those that predict (inside ``serving``), the training point beside them.

    The training point is ``"loko_train_point"``, from which a resumed fit continues exactly.
    """
    named = [(f"network.{name}", p) for name, p in module.network.named_parameters() if p.requires_grad]
    checkpoint["loko_train_point"] = {name: p.detach().clone() for name, p in named}
    with torch.no_grad(), serving:
        checkpoint["state_dict"].update({name: p.detach().clone() for name, p in named})


#: The peers' steps, by the qualified name of the peer's class (their packages are imported only when used).
#: Registered by the modules that define them (:mod:`~loko_lightning.learner.peer_steps`,
#: :mod:`~loko_lightning.learner.frozen_heads`), which the learner package imports.
PEER_STEPS: dict[str, type[OnlineStep]] = {}


def step_for(optimizer: torch.optim.Optimizer) -> type[OnlineStep]:
    """The step strategy of an optimizer: LoKO's, a peer's (or a subclass's), else the gradient step."""
    if isinstance(optimizer, LoKO):
        return KalmanStep
    for cls in type(optimizer).__mro__:
        step = PEER_STEPS.get(f"{cls.__module__}.{cls.__qualname__}")
        if step is not None:
            return step
    return GradientStep


class SelectionStep(OnlineStep):
    """Every candidate of ``select`` steps (with ``inner``) on each sample until the selection ends; then the winner.

    The candidates' states live in :class:`~loko_lightning.learner.selection.CandidateStates`, built when training
    starts and kept in every checkpoint (``"loko_selection"``), so a run resumes exactly mid-selection. The learner's
    prediction for a sample is the leader's, from the samples before it (no look-ahead). Logged while it runs:
    ``select/<name>``, the leader's value.

    Args:
        inner: the step every candidate makes.
        candidates: what to choose, among which values, on how many samples.
    """

    def __init__(self, inner: OnlineStep, candidates: Candidates) -> None:
        self.inner = inner
        self.candidates = candidates
        self.states: CandidateStates | None = None  # built when training starts
        self._pending: dict[str, Any] | None = None  # from a checkpoint, until then

    @property
    def done(self) -> bool:
        """Whether the selection has ended (the winner alone steps on)."""
        return self.states is not None and self.states.done

    def check_trainer(self, trainer: pl.Trainer, owner: Any) -> None:
        """The inner step's checks; the candidates run one after another in one process."""
        self.inner.check_trainer(trainer, owner)
        check_selection_trainer(trainer, owner=owner)

    def start(self, module: pl.LightningModule) -> None:
        """Set up the candidates (from the checkpoint when resuming)."""
        self.inner.start(module)
        self.states = CandidateStates(
            self.candidates,
            module.trainable_parameters,
            lambda params, **value: module.build_optimizer(**value),
            module.lr_scheduler_factory,
        )
        if self._pending is not None:
            self.states.load_state_dict(self._pending)
            self._pending = None

    def step(self, module: pl.LightningModule, optimizer: Any, inputs: Any, label: Tensor) -> StepResult:
        """Every candidate predicts and updates on the step's samples; the leader's prediction counts."""
        states = self.states
        if states is None or states.done:
            return self.inner.step(module, optimizer, inputs, label)
        live, scheduler = optimizer.optimizer, module.lr_schedulers()
        leader = states.leader  # from the samples before this step: no look-ahead
        results: list[Sequence[Tensor]] = []
        for index in range(len(states)):
            states.load(index, live, scheduler)
            # Lightning counts a step per call of its optimizer wrapper: one candidate goes through it, the others
            # through the torch optimizer itself (the trainer checks that no precision plugin needs the wrapper).
            results.append(self.inner.step(module, optimizer if index == len(states) - 1 else live, inputs, label))
            states.save(index, live, scheduler)
        states.record(results)
        if states.advance(len(results[0][1]), live, scheduler):
            rank_zero_info(f"select: {states.summary()}")
        name = self.candidates.name
        module.log(f"select/{name}", self.candidates.values[states.leader], on_step=True, on_epoch=False, batch_size=1)
        return results[leader]

    def logged(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The inner step's values."""
        return self.inner.logged(optimizer)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The inner step's state, the candidates and their scores."""
        self.inner.on_save_checkpoint(checkpoint)
        if self.states is not None:
            checkpoint["loko_selection"] = self.states.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep the candidates' state until training starts."""
        self._pending = checkpoint.get("loko_selection")

    def evaluate(self, module: pl.LightningModule, entering: bool) -> None:
        """The inner step's evaluation parameters."""
        self.inner.evaluate(module, entering)

    def close(self) -> None:
        """Close the inner step."""
        self.inner.close()


def world_size(module: pl.LightningModule) -> int:
    """The number of processes training ``module`` (1 outside a trainer)."""
    trainer = module._trainer
    return trainer.world_size if trainer is not None else 1
