"""The pretrained backbone's features on a peft network: its forward pass with the adapters off.

The frozen heads that ride beside a fine-tuner (the mixture's streaming LDA, :mod:`loko_lightning.learner.mixture`;
LDA's head on pretrained features, :mod:`loko_lightning.learner.lda_head`) read the features the backbone had before
any update: the input of the output layer in a forward pass with every adapter disabled and every module in eval mode.
:class:`FrozenFeatures` finds what it toggles once and swaps each adapter layer for the module it would call when
disabled (:func:`passthrough`), bit for bit what peft's ``disable_adapter()`` gives, without its walks of the network.
:meth:`FrozenFeatures.with_adapted` gives the network's outputs with its adapters and the frozen features together, in
one forward pass of the samples twice over.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from peft import PeftModel
from peft.tuners.lora import Conv2d as LoraConv2d
from peft.tuners.lora import Linear as LoraLinear
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


def vanilla_lora(layer: nn.Module) -> str | None:
    """The active adapter of a LoRA layer that adds ``B(A(x)) · scaling`` to its base layer's output and nothing else.

    ``None`` for any other layer: not peft's LoRA ``Linear`` or ``Conv2d`` (an embedding's adapter is applied
    otherwise), merged, disabled, several adapters active, or a variant (DoRA, ...).
    """
    if not isinstance(layer, (LoraLinear, LoraConv2d)) or layer.merged or layer.disable_adapters:
        return None
    active = layer.active_adapters
    if len(active) != 1 or active[0] not in layer.lora_A:
        return None
    name = active[0]
    if name in getattr(layer, "lora_variant", {}) or getattr(layer, "use_dora", {}).get(name, False):
        return None
    return name


class _NotSplit(Exception):
    """The joint pass met a call it cannot split in two halves of rows (:meth:`FrozenFeatures.with_adapted`)."""


class _Joint:
    """One joint pass: the adapted rows (the first ``rows``), and which rows the modules now running see."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.seeing = "both"  # "both": all 2 x rows; "adapted": the first rows only; "frozen": the others only

    @contextlib.contextmanager
    def only(self, half: str) -> Iterator[None]:
        self.seeing = half
        try:
            yield
        finally:
            self.seeing = "both"


class _Halves(nn.Module):
    """An adapter layer in the joint pass: itself on the adapted rows, the module it calls disabled on the others.

    A vanilla LoRA layer (:func:`vanilla_lora`) runs its base layer once on every row and adds its adapter's term to the
    adapted rows, as its own forward adds it; any other layer runs on the adapted rows and its :func:`passthrough` on
    the others.
    """

    def __init__(self, layer: nn.Module, joint: _Joint) -> None:
        super().__init__()
        self._parts = (layer, joint)  # a tuple: not registered as submodules

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Tensor:
        layer, joint = self._parts
        rows, base = joint.rows, passthrough(layer)
        if base is None or args or kwargs or not isinstance(x, Tensor) or x.shape[0] != 2 * rows:
            raise _NotSplit
        adapter = vanilla_lora(layer)
        if adapter is not None:
            result = base(x)
            with joint.only("adapted"):
                dtype, cast = layer.lora_A[adapter].weight.dtype, getattr(layer, "_cast_input_dtype", None)
                inputs = cast(x[:rows], dtype) if cast is not None else x[:rows].to(dtype)  # peft < 0.15: .to
                term = layer.lora_B[adapter](layer.lora_A[adapter](layer.lora_dropout[adapter](inputs)))
                result[:rows] += (term * layer.scaling[adapter]).to(result.dtype)  # no gradient: in place
            return result
        with joint.only("adapted"):
            adapted = layer(x[:rows])
        with joint.only("frozen"):
            frozen = base(x[rows:])
        return torch.cat([adapted, frozen])


def _twice(inputs: Any) -> tuple[Any, int] | None:
    """``inputs`` with their samples twice over, and how many samples they hold; ``None`` where that is not plain."""
    if isinstance(inputs, Tensor):
        return torch.cat([inputs, inputs]), inputs.shape[0]
    if isinstance(inputs, Mapping) and inputs and all(isinstance(v, Tensor) for v in inputs.values()):
        rows = {v.shape[0] for v in inputs.values()}
        if len(rows) == 1:
            return {k: torch.cat([v, v]) for k, v in inputs.items()}, rows.pop()
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
        self.joint = True  # with_adapted runs one pass (False after a pass it could not split)
        self._state = _Joint(0)
        self._halves = [_Halves(layer, self._state) for layer in self.adapters]  # built once: Module() costs

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
        return self._features(captured)

    def with_adapted(self, inputs: Any) -> tuple[Tensor, Tensor]:
        """The network's outputs on ``inputs`` with its adapters on (``network(inputs)``) and the frozen features.

        One forward pass of the samples twice over, in eval mode, without gradient: each adapter layer runs on the
        first copy and the module it calls disabled (:func:`passthrough`) on the second; a vanilla LoRA layer runs its
        base layer once on both and adds its term to the first (``benchmarks/step_parts.py``, EfficientNet-Lite0 at
        32 px with LoRA on its convs, one CPU thread: 15.7 ms, the two passes 12.7 and 14.3 ms in an earlier run of
        it; ``results/default_study/step_parts_fm32.md``). The values are those of the two passes up
        to floating-point rounding (a convolution of two samples may sum in another order than of one). Two passes
        where that cannot be split: an adapter layer without a passthrough (merged, trainable tokens), inputs other
        than a tensor or a mapping of tensors, or a layer that does not see the samples as the first dimension of its
        one input.

        Raises:
            ConfigError: no ``nn.Linear`` with ``num_classes`` outputs ran (``field="network"``).
        """
        twice = _twice(inputs) if self.joint else None
        if twice is None or any(passthrough(layer) is None for layer in self.adapters):
            with torch.no_grad():
                outputs = self.network(inputs)
            return outputs, self(inputs)
        doubled, rows = twice
        joint = self._state
        joint.rows = rows
        captured: list[Tensor] = []

        def capture(_: nn.Module, args: tuple[Any, ...], __: Any) -> None:
            if joint.seeing == "frozen":
                captured.append(args[0].detach())
            elif joint.seeing == "both":
                if args[0].shape[0] != 2 * rows:
                    raise _NotSplit
                captured.append(args[0][rows:].detach())

        hooks = [m.register_forward_hook(capture) for m in self.layers]
        try:
            with torch.no_grad(), evaluating(self.network, self.modules), self._halved():
                outputs = self.network(doubled)
            self.joint = isinstance(outputs, Tensor) and outputs.shape[0] == 2 * rows
        except _NotSplit:
            self.joint = False
        finally:
            for hook in hooks:
                hook.remove()
        if not self.joint:  # from now on the two passes
            return self.with_adapted(inputs)
        return outputs[:rows], self._features(captured)

    @contextlib.contextmanager
    def _halved(self) -> Iterator[None]:
        try:
            for (parent, name, _), halves in zip(self.placed, self._halves, strict=True):
                parent._modules[name] = halves
            yield
        finally:
            for parent, name, layer in self.placed:
                parent._modules[name] = layer

    def _features(self, captured: list[Tensor]) -> Tensor:
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
