"""The pretrained backbone's features on a peft network: its forward pass with the adapters off.

The frozen heads that ride beside a fine-tuner (the mixture's streaming LDA, :mod:`loko_lightning.learner.mixture`;
LDA's head on pretrained features, :mod:`loko_lightning.learner.lda_head`) read the features the backbone had before
any update: the input of the output layer in a forward pass with every adapter disabled and every module in eval mode.
:class:`FrozenFeatures` finds what it toggles once and swaps each adapter layer for the module it would call when
disabled (:func:`passthrough`), bit for bit what peft's ``disable_adapter()`` gives, without its walks of the network.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from peft import PeftModel
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import ModulesToSaveWrapper
from torch import Tensor, nn

from loko_lightning.errors import ConfigError
from loko_lightning.learner.frozen_heads import evaluating

try:  # the layers peft's disable_adapter() switches: its adapter layers and the wrapper of modules_to_save
    from peft.utils.other import AuxiliaryTrainingWrapper as _Wrapper
except ImportError:  # peft < 0.15
    _Wrapper = ModulesToSaveWrapper
ADAPTER_LAYERS = (BaseTunerLayer, _Wrapper)


def peft_model(network: nn.Module, owner: type | None = None) -> PeftModel:
    """The peft model in ``network`` (the network itself for timm; inside the wrapper for text).

    Raises:
        ConfigError: a network without peft (``field="network"``, ``owner`` the class that needs it).
    """
    for module in network.modules():
        if isinstance(module, PeftModel):
            return module
    raise ConfigError(
        "a head on the frozen features needs a peft network (its adapters are disabled for the frozen features); "
        "this one has none. To fix it: use TimmClassifier or TransformersClassifier",
        field="network",
        owner=owner,
    )


def passthrough(layer: nn.Module) -> nn.Module | None:
    """The module a peft adapter layer calls alone when its adapters are disabled; None where it does more.

    A tuner layer (LoRA's) runs its base layer, unless adapters are merged into it (disabling unmerges them first); the
    wrapper of ``modules_to_save`` runs the original module. Other wrappers (trainable tokens) are switched instead.
    """
    if isinstance(layer, BaseTunerLayer):
        return None if layer.merged else layer.get_base_layer()
    if isinstance(layer, ModulesToSaveWrapper):
        return layer.original_module
    return None


class FrozenFeatures:
    """The pretrained backbone's features ``(B, d)``: the input of the output layer, adapters off, eval mode.

    No gradient. With the adapters disabled peft runs the original head (``modules_to_save``' frozen copy): the
    features are the input of the last ``nn.Linear`` with ``num_classes`` outputs that runs. The modules this reads
    and toggles (the network's, peft's outermost adapter layers, the candidate output layers) are found once, when it
    is built: peft's ``disable_adapter()`` walks the whole network three times on each call, which cost more than the
    forward pass itself a sample (EfficientNet-Lite0 with LoRA on its convs). For the forward pass each adapter layer
    is replaced in its parent by the module it would call with its adapters disabled (:func:`passthrough`: the same
    computation, bit for bit, without peft's dispatch in every layer: 9.0 against 11.5 ms a sample for Lite0 at 32 px
    on one CPU thread) and put back after, even on an error; a layer that does more when disabled (merged adapters,
    trainable tokens) is switched off and back on by its own ``enable_adapters``, as peft's context does, if it was
    on.

    Raises:
        ConfigError: a network without peft (``field="network"``).
    """

    def __init__(self, network: nn.Module, num_classes: int, owner: type | None = None) -> None:
        peft_model(network, owner)
        self.network, self.num_classes, self.owner = network, num_classes, owner
        self.modules = list(network.modules())
        self.layers = [m for m in self.modules if isinstance(m, nn.Linear) and m.out_features == num_classes]
        self.placed: list[tuple[nn.Module, str, nn.Module]] = []  # (parent, name, adapter layer), outermost layers
        self._find_adapters(network)
        self.adapters = [layer for _, _, layer in self.placed]

    def _find_adapters(self, module: nn.Module) -> None:
        for name, child in module.named_children():
            if isinstance(child, ADAPTER_LAYERS):
                self.placed.append((module, name, child))
            else:
                self._find_adapters(child)

    @contextlib.contextmanager
    def _adapters_disabled(self) -> Iterator[None]:
        swapped: list[tuple[nn.Module, str, nn.Module]] = []
        switched: list[nn.Module] = []
        try:
            for parent, name, layer in self.placed:
                base = passthrough(layer)
                if base is not None:
                    parent._modules[name] = base
                    swapped.append((parent, name, layer))
                elif not layer.disable_adapters:
                    layer.enable_adapters(False)
                    switched.append(layer)
            yield
        finally:
            for parent, name, layer in swapped:
                parent._modules[name] = layer
            for layer in switched:
                layer.enable_adapters(True)

    def __call__(self, inputs: Any) -> Tensor:
        """The features of ``inputs``.

        Raises:
            ConfigError: no ``nn.Linear`` with ``num_classes`` outputs ran (``field="network"``).
        """
        captured: list[Tensor] = []
        hooks = [m.register_forward_hook(lambda _, args, __: captured.append(args[0].detach())) for m in self.layers]
        try:
            with torch.no_grad(), evaluating(self.network, self.modules), self._adapters_disabled():
                self.network(inputs)
        finally:
            for hook in hooks:
                hook.remove()
        if not captured:
            raise ConfigError(
                f"the frozen features: no nn.Linear with {self.num_classes} outputs ran in the network's forward pass",
                field="network",
                owner=self.owner,
            )
        return captured[-1].reshape(captured[-1].shape[0], -1)


def frozen_features(network: nn.Module, inputs: Any, num_classes: int, owner: type | None = None) -> Tensor:
    """The pretrained backbone's features ``(B, d)`` of ``inputs`` (:class:`FrozenFeatures`, for one call)."""
    return FrozenFeatures(network, num_classes, owner)(inputs)
