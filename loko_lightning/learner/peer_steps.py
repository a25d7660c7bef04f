"""The peers' steps (:mod:`loko_lightning.peers`): schedule-free AdamW, IVON and the ``posteriors`` EKF.

Each predicts a sample before its update, as every learner step does (:mod:`~loko_lightning.learner.steps`), and runs in
one process. They register themselves in :data:`~loko_lightning.learner.steps.PEER_STEPS` by their optimizer's
qualified name (the peers' packages are imported only when used).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.nn import functional as F

from loko_lightning.learner.steps import (
    PEER_STEPS,
    KalmanStep,
    OnlineStep,
    ServesAnAverage,
    StepResult,
    descend,
    gather_scored,
    learning_rate,
)

__all__ = ["FunctionalStep", "IVONStep", "ScheduleFreeStep", "averaged_point"]


@contextlib.contextmanager
def averaged_point(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Inside, the parameters of a schedule-free optimizer in train mode hold its average ``x``; after, ``y`` again.

    ``optimizer.eval()`` moves them to ``x``; on the way back the saved ``y`` is copied in (not ``optimizer.train()``,
    whose interpolation back would round ``y`` differently), so predicting never changes the training trajectory.
    """
    groups = [group for group in optimizer.param_groups if group.get("train_mode")]
    if not groups:
        yield
        return
    params = [p for group in groups for p in group["params"]]
    saved = [p.detach().clone() for p in params]
    optimizer.eval()
    try:
        yield
    finally:
        with torch.no_grad():
            for param, value in zip(params, saved, strict=True):
                param.copy_(value)
        for group in groups:
            group["train_mode"] = True


class ScheduleFreeStep(ServesAnAverage):
    """Schedule-free AdamW's step (:class:`~loko_lightning.peers.ScheduleFreeAdamW`): predict with ``x``, step at ``y``.

    Each sample is predicted with the average ``x`` (the point whose guarantees schedule-free AdamW gives, and the one a
    deployed model would serve), then the gradient of its cross-entropy is taken at ``y``. Evaluation, testing and
    prediction during or after training use ``x`` too, and a checkpoint's weights are ``x`` (with ``y`` beside them
    as ``"loko_train_point"``, from which a resumed run continues exactly). Costs one forward pass more than AdamW.
    Logged: ``train/lr``.
    """

    single_process = True

    def serving(self, optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager[None] | None:
        """:func:`averaged_point`: the average ``x``."""
        return averaged_point(optimizer)

    def step(self, module: pl.LightningModule, optimizer: Any, inputs: Any, label: Tensor) -> StepResult:
        """Predict with ``x``, then one step at ``y`` on the mean cross-entropy."""
        free = getattr(optimizer, "optimizer", optimizer)
        if not free.param_groups[0]["train_mode"]:
            free.train()  # a fresh optimizer (its first step, or a candidate's): no average yet, so x = y
        with torch.no_grad(), averaged_point(free):
            averaged = module.network(inputs)
        loss = F.cross_entropy(module.network(inputs), label)
        applied = descend(module, optimizer, loss, finite=torch.isfinite(averaged).all())
        return (*gather_scored(module, averaged.softmax(-1), label), applied)

    def logged(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The learning rate of the last step."""
        return learning_rate(optimizer)


class IVONStep(OnlineStep):
    """IVON's step (:class:`~loko_lightning.peers.IVON`): predict with the posterior mean, learn from draws.

    Each sample is predicted with the mean (the parameters, as evaluation and ``loko predict`` use them); then for
    each of IVON's ``mc_samples`` draws the parameters are sampled (``sampled_params(train=True)``), the cross-entropy's
    gradient taken there, and IVON's step applies them. A draw whose loss is not finite contributes a zero gradient; a
    sample whose prediction is not finite draws nothing and changes nothing. Costs one forward pass more than AdamW
    (with ``mc_samples: 1``). Logged: ``train/lr``.
    """

    single_process = True

    def step(self, module: pl.LightningModule, optimizer: Any, inputs: Any, label: Tensor) -> StepResult:
        """Predict with the mean, draw and differentiate, then IVON's step."""
        ivon = getattr(optimizer, "optimizer", optimizer)
        with torch.no_grad():
            logits = module.network(inputs)
        applied = torch.isfinite(F.cross_entropy(logits, label))
        if applied:  # one host sync, as the gradient step's
            params = module.trainable_parameters
            for _ in range(ivon.mc_samples):
                with ivon.sampled_params(train=True):
                    optimizer.zero_grad(set_to_none=True)
                    loss = F.cross_entropy(module.network(inputs), label)
                    finite = bool(torch.isfinite(loss))  # one host read per draw
                    if finite:
                        module.manual_backward(loss)
                    for p in params:
                        if p.grad is None or not finite:
                            p.grad = torch.zeros_like(p)
        optimizer.step()  # no draw (a skipped sample): IVON changes nothing
        scheduler = module.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        return logits.softmax(-1), label, applied

    def logged(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The learning rate of the last step."""
        return learning_rate(optimizer)


class FunctionalStep(OnlineStep):
    """The ``posteriors`` EKF's step (:class:`~loko_lightning.peers.DiagonalFisherEKF`): one update of its state.

    The step hands the optimizer the per-sample log-likelihood of its samples as a function of the trainable
    parameters (``torch.func.functional_call`` of the network); ``posteriors`` differentiates it and updates the mean
    and variances; the prediction is the one it computed at the mean before the update.
    """

    single_process = True

    def __init__(self) -> None:
        self._names: list[str] | None = None

    @staticmethod
    def check(network: Any, lr_scheduler: Any, owner: Any) -> None:
        """A filter: the network must be deterministic, and there is no learning rate to schedule."""
        KalmanStep.check(network, lr_scheduler, owner)

    def step(self, module: pl.LightningModule, optimizer: Any, inputs: Any, label: Tensor) -> StepResult:
        """One ``posteriors`` update on the step's samples."""
        network = module.network
        if self._names is None:
            self._names = [name for name, p in network.named_parameters() if p.requires_grad]
        names = self._names

        def log_likelihood(params: dict[str, Tensor], batch: tuple[Any, Tensor]) -> tuple[Tensor, Tensor]:
            x, y = batch
            weights = {name: params[f"p{index}"] for index, name in enumerate(names)}
            logits = torch.func.functional_call(network, weights, (x,), strict=False)
            return logits.log_softmax(-1).gather(-1, y[:, None])[:, 0], logits

        logits, applied = optimizer.step(closure=lambda: (log_likelihood, (inputs, label)))
        return logits.softmax(-1), label, applied


PEER_STEPS.update(
    {
        "loko_lightning.peers.schedule_free.ScheduleFreeAdamW": ScheduleFreeStep,
        "loko_lightning.peers.ivon.IVON": IVONStep,
        "loko_lightning.peers.ekf.DiagonalFisherEKF": FunctionalStep,
    }
)
