"""The step of the heads on frozen features (:mod:`loko_lightning.peers.frozen_heads`): one forward pass a sample.

:class:`FrozenHeadStep` runs the network once on the step's samples with every module in eval mode (no dropout: the
features are the backbone's own), keeps the input of the network's output layer (the features the head reads: the
penultimate features of a timm model, the pooled embedding of a text model), scores the prediction the network made
with the head as it stood, and then updates the head on those features: the closed-form heads
(:class:`~loko_lightning.peers.frozen_heads.StreamingLDA`, :class:`~loko_lightning.peers.frozen_heads.NearestClassMean`)
by their statistics, :class:`~loko_lightning.peers.frozen_heads.FrozenLinearHead` by an AdamW step on the output
layer's cross-entropy gradient. Importing this module registers the step for those classes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from loko_lightning.errors import ConfigError
from loko_lightning.learner.steps import PEER_STEPS, OnlineStep, StepResult, descend, learning_rate


def output_layer(network: nn.Module, num_classes: int) -> nn.Linear:
    """The network's output layer: its last trainable ``nn.Linear`` with ``num_classes`` outputs.

    Raises:
        ConfigError: the network has none.
    """
    found = [
        module
        for module in network.modules()
        if isinstance(module, nn.Linear) and module.weight.requires_grad and module.out_features == num_classes
    ]
    if not found:
        raise ConfigError(
            f"a head on frozen features needs the network's output layer, a trainable nn.Linear with {num_classes} "
            "outputs, and this network has none. To fix it: use TimmClassifier or TransformersClassifier",
            field="network",
            owner=FrozenHeadStep,
        )
    return found[-1]


@contextlib.contextmanager
def evaluating(network: nn.Module, modules: Sequence[nn.Module] | None = None) -> Iterator[None]:
    """Inside, every module of ``network`` is in eval mode (dropout off); after, each back in its own mode.

    ``modules``: ``network.modules()`` found before (a caller that enters this every sample keeps them).
    """
    training = [module for module in (network.modules() if modules is None else modules) if module.training]
    if any(type(module).train is not nn.Module.train for module in training):
        network.eval()  # a module with a train() of its own sees the switch
    else:  # the attribute nn.Module.train sets, set directly: a pass over a network's modules costs about 1 ms
        for module in training:
            module.__dict__["training"] = False
    try:
        yield
    finally:
        for module in training:
            module.__dict__["training"] = True


class FrozenHeadStep(OnlineStep):
    """Predict with the network, then fit its output layer on the features of that same forward pass (see the module).

    The subclasses say how the head learns (:meth:`update`).
    """

    single_process = True

    def __init__(self) -> None:
        self._layer: nn.Linear | None = None

    @staticmethod
    def check(network: Any, lr_scheduler: Any, owner: Any) -> None:
        """Any network with a linear output layer (found at the first step)."""

    def layer(self, module: pl.LightningModule) -> nn.Linear:
        """The network's output layer (found once)."""
        if self._layer is None:
            self._layer = output_layer(module.network, module.num_classes)
        return self._layer

    def step(self, module: pl.LightningModule, optimizer: Any, inputs: Any, label: Tensor) -> StepResult:
        """One forward pass; the prediction before the update; the head's update on the features."""
        layer = self.layer(module)
        captured: list[Tensor] = []
        hook = layer.register_forward_hook(lambda _, args, __: captured.append(args[0].detach()))
        try:
            with torch.no_grad(), evaluating(module.network):
                logits = module.network(inputs)
        finally:
            hook.remove()
        features = captured[-1].reshape(label.shape[0], -1)
        applied = self.update(module, optimizer, layer, features, label, torch.isfinite(logits).all())
        return logits.softmax(-1), label, applied

    def update(
        self, module: pl.LightningModule, optimizer: Any, layer: nn.Linear, features: Tensor, label: Tensor,
        finite: Tensor,
    ) -> Tensor:  # fmt: skip
        """Update the head on ``features`` ``(B, d)``; ``finite``: whether the prediction was. Returns applied."""
        raise NotImplementedError


class ClosedFormHeadStep(FrozenHeadStep):
    """The step of the heads fitted in closed form from statistics (streaming LDA, nearest class mean)."""

    @staticmethod
    def check(network: Any, lr_scheduler: Any, owner: Any) -> None:
        """A head in closed form has no learning rate: a scheduler is refused."""
        if lr_scheduler is not None:
            raise ConfigError(
                "a head fitted in closed form (streaming LDA, nearest class mean) has no learning rate to schedule. "
                "To fix it: remove model.lr_scheduler (lr_scheduler: null)",
                field="lr_scheduler",
                owner=owner,
            )

    def update(
        self, module: pl.LightningModule, optimizer: Any, layer: nn.Linear, features: Tensor, label: Tensor,
        finite: Tensor,
    ) -> Tensor:  # fmt: skip
        """Bind the output layer to the optimizer; it updates its statistics and writes the head."""
        getattr(optimizer, "optimizer", optimizer).bind(layer.weight, layer.bias)
        if not finite:  # one host read: a non-finite prediction changes nothing
            optimizer.step(closure=lambda: (features.new_full(features.shape, float("nan")), label))
            return finite
        return optimizer.step(closure=lambda: (features, label))


class LinearHeadStep(FrozenHeadStep):
    """The step of :class:`~loko_lightning.peers.frozen_heads.FrozenLinearHead`: AdamW on the output layer alone.

    The cross-entropy is recomputed from the captured features through the output layer, so the backward pass never
    enters the backbone. Logged: ``train/lr``.
    """

    @staticmethod
    def check(network: Any, lr_scheduler: Any, owner: Any) -> None:
        """Any network and scheduler will do."""

    def update(
        self, module: pl.LightningModule, optimizer: Any, layer: nn.Linear, features: Tensor, label: Tensor,
        finite: Tensor,
    ) -> Tensor:  # fmt: skip
        """One AdamW step on the output layer's cross-entropy."""
        loss = F.cross_entropy(F.linear(features, layer.weight, layer.bias), label)
        return descend(module, optimizer, loss, finite=finite)

    def logged(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The learning rate of the last step."""
        return learning_rate(optimizer)


PEER_STEPS.update(
    {
        "loko_lightning.peers.frozen_heads.StreamingLDA": ClosedFormHeadStep,
        "loko_lightning.peers.frozen_heads.NearestClassMean": ClosedFormHeadStep,
        "loko_lightning.peers.frozen_heads.FrozenLinearHead": LinearHeadStep,
    }
)
