"""The engine's hooks on one model: the scan that finds the layers it treats specially, and the forward hooks on them.

:class:`ModelHooks` scans a model once for

- fast-path layers: ``nn.Linear`` and ``nn.Conv2d`` (``groups == 1``, the plain ``forward``) whose weight is
  differentiated, and in batches timm's ``Conv2dSame``. While an engine call runs, their weight (and differentiated
  bias) is swapped for a detached alias during their forward, and each call's input and output edge is recorded
  (:class:`FastLayer`, :class:`LayerCall`): the reverse pass (:mod:`loko_lightning.jacobians.reverse`) then needs
  only the cotangents at the layer output;
- frozen batch norms and convolutions, whose backward is replaced by the matrix product it amounts to
  (:mod:`loko_lightning.jacobians.frozen`), with the caches those hooks fill;
- normalisation layers and random layers (dropout, ...), which must be in eval mode for an engine call
  (:meth:`ModelHooks.check_modes`).

Outside engine calls every hook reads one flag and returns, so the model computes what it computes without them.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain
from operator import is_not
from typing import Any

from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils.hooks import RemovableHandle

from loko_lightning.jacobians import frozen

_BATCH_NORMS = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)
# What the scan looks for in a module; _CONV_SAME: timm's Conv2dSame (TensorFlow's "SAME" padding, worked out from
# each input's size in its forward).
_OTHER, _NORM, _LINEAR, _CONV, _RANDOM, _CONV_SAME = range(6)


@dataclass
class LayerCall:
    """One call of a fast-path layer: its input (as the layer saw it) and the gradient edge of its output."""

    inputs: Tensor
    version: int
    edge: GradientEdge


@dataclass
class FastLayer:
    """A fast-path layer, and what its hooks record during one engine call."""

    module: nn.Module
    swap: list[str]  # names of the parameters (weight, maybe bias) swapped for detached aliases
    # On the fast path only in batches (timm's Conv2dSame): for one sample autograd's weight gradient costs as little.
    batch_only: bool = False
    calls: list[LayerCall] = field(default_factory=list)
    saved: dict[str, Any] = field(default_factory=dict)


class ModelHooks:
    """The hooks of one engine on one model, the layers the scan found, and the state the hooks share with the engine.

    The flags say whether an engine call is running (``calling``), with the fast path (``fast``) and on a batch
    (``batched``); the engine sets them around its forward pass. The caches (``conv_matrices``, ``norm_scales``) are
    filled by the frozen layers' hooks and belong to this object alone.

    Nothing is hooked until :meth:`scan`; :meth:`remove` takes the hooks off again.

    Args:
        wanted: the ids of the parameters differentiated.
    """

    def __init__(self, wanted: frozenset[int]) -> None:
        self.calling = False
        self.fast = False
        self.batched = False
        self.norm_scales: dict[nn.Module, tuple] = {}
        self.conv_matrices: dict[nn.Module, tuple] = {}
        self.wanted = wanted
        self.handles: list[RemovableHandle] = []
        self.layers: dict[nn.Module, FastLayer] = {}  # the fast-path layers
        self.norms: list[nn.Module] = []  # normalisation layers, hooked or not
        self.random: list[nn.Module] = []  # random layers (dropout, ...)
        self.uncovered = False  # whether a parameter is reached outside the fast-path layers
        self._dicts: list[dict] = []
        self._structure: list = []

    def remove(self) -> None:
        """Remove the hooks from the model."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def scan(self, model: nn.Module) -> None:
        """Find and hook the fast-path layers, frozen batch norms and frozen convolutions; record the structure.

        Empties the caches. To scan again, :meth:`remove` the hooks first.
        """
        wanted, handles = self.wanted, self.handles
        self.conv_matrices.clear()
        self.norm_scales.clear()
        layers: dict[nn.Module, FastLayer] = {}
        norms: list[nn.Module] = []
        random: list[nn.Module] = []
        dicts: list[dict] = []  # what the structure check compares: children, parameters, norm buffers
        kinds: dict[type, int] = {}
        for module in _modules(model):
            dicts += (module._modules, module._parameters)
            kind = kinds.get(type(module))
            if kind is None:
                kind = kinds[type(module)] = _kind(type(module))
            if kind == _OTHER:
                continue
            if kind == _RANDOM:
                random.append(module)
                continue
            if kind == _NORM:
                norms.append(module)
                dicts.append(module._buffers)
                if frozen.is_frozen_norm(module, wanted):
                    handles.append(module.register_forward_hook(self._norm_hook, prepend=True))
                elif _uses_batch_statistics(module):
                    hook = self._batch_size_hook(_name(model, module))
                    handles.append(module.register_forward_pre_hook(hook))
                continue
            if kind == _CONV and frozen.is_frozen_conv(module, wanted):
                handles.append(module.register_forward_hook(self._conv_hook, prepend=True))
                continue
            grouped = kind in (_CONV, _CONV_SAME) and module.groups != 1
            if grouped or (kind == _CONV_SAME and module.padding != (0, 0)):
                continue
            weight = module._parameters.get("weight")
            if not isinstance(weight, Tensor) or id(weight) not in wanted:
                continue
            bias = module._parameters.get("bias")
            swap = ["weight", "bias"] if isinstance(bias, Tensor) and id(bias) in wanted else ["weight"]
            layer = layers[module] = FastLayer(module, swap, batch_only=kind == _CONV_SAME)
            handles.append(module.register_forward_pre_hook(self._pre_hook(layer), with_kwargs=True))
            handles.append(module.register_forward_hook(_post_hook(layer), with_kwargs=True, prepend=True))
        self.layers, self.norms, self.random, self._dicts = layers, norms, random, dicts
        # Whether a parameter is reached outside the fast-path layers (a batch then goes one sample at a time).
        covered = {id(layer.module._parameters[name]) for layer in layers.values() for name in layer.swap}
        self.uncovered = any(i not in covered for i in wanted)
        self._structure = list(chain.from_iterable(map(dict.values, dicts)))  # holding them keeps `is` reliable

    def structure_changed(self) -> bool:
        """Whether a submodule, parameter or normalisation buffer was added, removed or replaced since the scan."""
        now = list(chain.from_iterable(map(dict.values, self._dicts)))
        return len(now) != len(self._structure) or any(map(is_not, now, self._structure))

    def check_modes(self, model: nn.Module) -> None:
        """Normalisation layers with running statistics and random layers must be in eval mode.

        Raises:
            ValueError: one is in training mode (a random one only where it draws something).
        """
        for module in self.norms:
            if module.training and module.track_running_stats:
                raise ValueError(
                    f"Invalid model: normalisation layer {_name(model, module)!r} ({type(module).__name__}) "
                    "is in training mode; at batch size 1 put it in eval mode (model.eval() or "
                    "loko_lightning.models.adapters.freeze_normalization)"
                )
        for module in self.random:
            if module.training and _randomness(module):
                name = _name(model, module)
                raise ValueError(
                    f"Invalid model: {name!r} ({type(module).__name__}, {_randomness(module)}) is random in training "
                    "mode, so every call would give another prediction and Jacobian; put it in eval mode "
                    f"(model.eval(), or model.get_submodule({name!r}).eval())"
                )

    @property
    def cache_nbytes(self) -> int:
        """Bytes held by the caches (dense matrices of small-map frozen convolutions, batch-norm scales)."""
        entries = chain(self.conv_matrices.values(), self.norm_scales.values())
        return sum(entry[-1].numel() * entry[-1].element_size() for entry in entries)

    def clear_caches(self) -> None:
        """Release the caches."""
        self.conv_matrices.clear()
        self.norm_scales.clear()

    def _pre_hook(self, layer: FastLayer) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            # Outside engine calls, and for any other call signature, the layer runs untouched: its use of the weight
            # reaches the real parameter and is covered by the generic reverse pass.
            if not self.fast or len(args) != 1 or kwargs or not isinstance(args[0], Tensor) or layer.saved:
                return None
            if layer.batch_only and not self.batched:
                return None
            for name in layer.swap:
                param = module._parameters[name]
                layer.saved[name] = param
                module._parameters[name] = param.detach()
            x = args[0]
            if not x.requires_grad:
                # Without a graph input the output would have no gradient edge to collect cotangents at.
                return (x.detach().requires_grad_(True),), kwargs
            return None

        return hook

    def _norm_hook(self, module: nn.Module, args: tuple, out: Any) -> Tensor | None:
        return frozen.norm_hook(module, args, out, scales=self.norm_scales) if self.fast else None

    def _conv_hook(self, module: nn.Module, args: tuple, out: Any) -> Tensor | None:
        return frozen.conv_hook(module, args, out, matrices=self.conv_matrices) if self.fast else None

    def _batch_size_hook(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            x = args[0] if self.calling and args else None
            if not isinstance(x, Tensor) or x.dim() < 2 or not (module.training or _uses_batch_statistics(module)):
                return
            if x.shape[0] * math.prod(x.shape[2:]) == 1:  # where torch's batch_norm refuses, with a message naming it
                raise ValueError(
                    f"Invalid model: normalisation layer {name!r} ({type(module).__name__}) has no running statistics "
                    f"(track_running_stats=False), so it normalises each channel by the statistics of its input, "
                    f"which at batch size 1 has one value per channel (shape {tuple(x.shape)}); give it running "
                    "statistics (track_running_stats=True) and put it in eval mode, or use a per-sample "
                    "normalisation (nn.GroupNorm, nn.LayerNorm)"
                )

        return hook


def _post_hook(layer: FastLayer) -> Callable:
    def hook(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> Tensor | None:
        if not layer.saved:  # a call the pre-hook left alone (always, outside engine calls)
            return None
        module._parameters.update(layer.saved)
        layer.saved.clear()
        if not isinstance(out, Tensor) or not out.requires_grad:  # the layer ran without grad: no contribution
            return None
        out = frozen.pointwise_hook(module, args[0], out)
        layer.calls.append(LayerCall(args[0], args[0]._version, get_gradient_edge(out)))
        return out

    return hook


def is_conv_same(cls: type) -> bool:
    """Whether ``cls`` convolves like timm's ``Conv2dSame`` (its ``forward``), if timm is in use."""
    same = sys.modules.get("timm.layers.conv2d_same")
    return same is not None and getattr(cls, "forward", None) is same.Conv2dSame.forward


def _kind(cls: type) -> int:
    """What the scan looks for in a module of class ``cls``."""
    if issubclass(cls, _BATCH_NORMS):
        return _NORM
    if cls.forward is nn.Linear.forward:
        return _LINEAR
    if cls.forward is nn.Conv2d.forward:
        return _CONV
    if is_conv_same(cls):
        return _CONV_SAME
    if issubclass(cls, (nn.modules.dropout._DropoutNd, nn.RReLU, nn.MultiheadAttention)):
        return _RANDOM
    drop = sys.modules.get("timm.layers.drop")  # timm's stochastic depth and DropBlock, if timm is in use
    if drop is not None and issubclass(cls, (drop.DropPath, drop.DropBlock2d)):
        return _RANDOM
    return _OTHER


def _uses_batch_statistics(module: nn.Module) -> bool:
    """A batch norm that normalises with the statistics of its input in eval mode too (no running statistics)."""
    return isinstance(module, nn.modules.batchnorm._BatchNorm) and (
        not module.track_running_stats or module._buffers.get("running_mean") is None
    )


def _randomness(module: nn.Module) -> str:
    """What makes a random layer random in training mode (``""`` if nothing: zero drop probability)."""
    if isinstance(module, nn.RReLU):
        return f"lower={module.lower}, upper={module.upper}" if module.lower != module.upper else ""
    for attr in ("p", "drop_prob", "dropout"):  # dropout, timm DropPath/DropBlock2d, nn.MultiheadAttention
        value = getattr(module, attr, 0.0)
        if isinstance(value, (int, float)) and value > 0:
            return f"{attr}={value}"
    return ""


def _name(model: nn.Module, module: nn.Module) -> str:
    return next(n for n, mod in model.named_modules() if mod is module)


def _modules(model: nn.Module) -> list[nn.Module]:
    """``model.modules()`` (each module once, depth first in registration order), without building names."""
    seen, order, stack = set(), [], [model]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        order.append(module)
        stack.extend(child for child in reversed(module._modules.values()) if child is not None)
    return order
