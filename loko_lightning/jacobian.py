"""Prediction and Jacobian of a model's outputs w.r.t. its trainable parameters, for one sample.

:class:`JacobianEngine` is built once per model (scan, hooks, caches) and called once per sample; :func:`jacobian`
is the same for a single call.

The ``m`` rows of the Jacobian come from one forward pass and one *batched* reverse pass (``torch.func.vmap``
over :func:`torch.autograd.grad` with the ``m`` cotangents), never from ``ñ`` forward passes or ``m`` separate
backward passes.

Fast path for weights of ``nn.Linear`` and ``nn.Conv2d`` layers (every LoRA ``A``/``B`` factor of peft, and a
new classification head, are such layers): a layer ``z_p = W x_p + b`` applied at ``k`` positions ``p`` (output
pixels of a convolution with ``x_p`` its unfolded input patch, or tokens) has the per-sample-gradient structure
``∂ŷ_a/∂W = Σ_p (∂ŷ_a/∂z_p) x_pᵀ``. So the batched reverse pass only has to deliver the ``m`` cotangents at the
layer *output*; the layer's input is captured in the forward pass (batch 1, shared by all rows) and the weight
Jacobian is one matrix product, or is returned in that exact factored form
(:class:`~loko_lightning.FactoredJacobian`). While the forward pass runs through such a layer its
trainable weight is swapped for a detached alias, so the reverse pass never forms a weight gradient there; any
other use of the same weight elsewhere in the model still reaches the real parameter and is added. Everything
else (other parameter kinds, ``groups > 1`` convolutions, layers called with keyword arguments, ...) goes
through the generic batched reverse pass. Both paths give the same Jacobian up to floating-point rounding.

With softmax outputs the rows sum to zero (``Σ_a ŷ_a = 1``), so only ``m - 1`` rows go through the reverse pass
and the last is minus their sum: exact, one reverse row fewer.

Frozen layers only pass cotangents through. Where their generic batched backward is mostly overhead (eval-mode
batch norms, pointwise convolutions, convolutions on small maps) it is replaced, during engine calls only, by the
matrix product it amounts to (:mod:`loko_lightning._backward`); the forward values are the layers' own. The engine
caches the dense matrices of small-map convolutions while their weights do not change (19 MiB for a ResNet-18 at
32 x 32 inputs, 26 MiB for a ResNet-50), and releases them with itself.
"""

from __future__ import annotations

import math
import sys
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import is_not
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.nn import functional as F
from torch.utils.hooks import RemovableHandle

from loko_lightning import _backward
from loko_lightning.blocks import FactoredJacobian, JacobianBlock, OuterJacobian, factored_is_cheaper

Output = Literal["softmax", "identity"]
_BATCH_NORMS = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)


class JacobianEngine:
    """Prediction ``ŷ`` and ``∂ŷ/∂θ`` of one model, one sample per call, with the per-model work done once.

    Building the engine scans the model once for the layers with a faster path (``nn.Linear``/``nn.Conv2d`` layers
    whose weight is differentiated, frozen batch norms and convolutions; see the module docstring) and registers
    forward hooks on them once. Outside the engine's own calls those hooks read one flag and return: the model computes
    exactly what it computes without them, for evaluation or for another optimizer's forward and backward pass.

    Checked on every call, cheaply:

    - the model's structure: the submodules and parameters of every module (and the buffers of normalisation
      layers), by identity. If one was added, removed or replaced, the engine scans the model again (its hooks move
      with it, its caches are emptied). Module attributes (a convolution's padding, ...) are taken as fixed.
    - normalisation layers with running statistics must be in eval mode (at batch size 1 their batch statistics are
      meaningless and every call would overwrite the running ones), whenever they were switched; so must random
      layers (dropout of any kind, timm's ``DropPath``/``DropBlock2d``, ``nn.RReLU``), whose prediction would differ
      from call to call. A batch norm without running statistics that sees one value per channel is refused by name.
    - every parameter differentiated must have ``requires_grad``.
    - autocast: under autocast the hooks stay inert and every parameter goes through the generic batched reverse pass.
    - the caches: a weight or running variance replaced, or changed in place, rebuilds its entry.

    The differentiated parameters are fixed when the engine is built, as an optimizer's are: build both after the
    model is complete and on its device. A layer added later is differentiated through, not differentiated.

    The caches (dense matrices of small-map frozen convolutions, batch-norm scales) belong to the engine and are
    released with it, or by :meth:`close`, which also removes the hooks; the engine is a context manager that closes
    on exit. One call at a time: the engine is not thread-safe.

    Args:
        model: maps ``inputs`` (batch dimension 1) to ``(1, m)`` logits or regression outputs.
        params: the parameters to differentiate (each with ``requires_grad``), default all with ``requires_grad``
            when the engine is built. Frozen weights get no gradient and cost nothing beyond the backward pass
            through them.
        output: ``"softmax"`` (classification, ``ŷ`` = class probabilities) or ``"identity"``
            (regression, ``ŷ`` = the model output).
        chunk_size: at most this many Jacobian rows per batched backward pass, to bound memory for
            large ``m``; default all ``m`` at once.
        factorize: return the weight Jacobian of every fast-path ``nn.Linear``/``nn.Conv2d`` layer in its exact
            factored form: :class:`~loko_lightning.OuterJacobian` (``∂ŷ/∂z ⊗ x``) when the layer saw one position, as
            a classification head does, otherwise :class:`~loko_lightning.FactoredJacobian` wherever that makes the
            Kalman update cheaper (:func:`~loko_lightning.blocks.factored_is_cheaper`: few positions against ``m``,
            i.e. deep layers and many classes). :class:`~loko_lightning.LoKO` consumes every form exactly.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        >>> with JacobianEngine(model, factorize=True) as engine:
        ...     for x in torch.randn(5, 1, 4):  # a stream of samples, batch dimension 1
        ...         prediction, jacobians = engine(x)
        >>> prediction.shape, type(jacobians[2]).__name__, jacobians[2].shape
        (torch.Size([3]), 'OuterJacobian', torch.Size([3, 3, 8]))
    """

    def __init__(
        self,
        model: nn.Module,
        params: Sequence[Tensor] | None = None,
        *,
        output: Output = "softmax",
        chunk_size: int | None = None,
        factorize: bool = False,
    ) -> None:
        if output not in get_args(Output):
            raise ValueError(f"Invalid output: {output!r} (expected 'softmax' or 'identity')")
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"Invalid chunk_size: {chunk_size} (must be >= 1 or None)")
        params = [p for p in model.parameters() if p.requires_grad] if params is None else list(params)
        if not params:
            raise ValueError("Invalid params: no trainable parameters (none has requires_grad=True)")
        _check_requires_grad(model, params)
        self._model = model
        self._params = params
        self._output = output
        self._chunk_size = chunk_size
        self._factorize = factorize
        self._wanted = frozenset(map(id, params))
        self._hooks = _Hooks()
        self._handles: list[RemovableHandle] = []
        # Removes the hooks when the engine is closed or garbage collected; holds no reference to the engine.
        self._finalizer = weakref.finalize(self, _remove, self._handles)
        self._scan()

    @property
    def model(self) -> nn.Module:
        """The model the engine differentiates."""
        return self._model

    @property
    def params(self) -> list[Tensor]:
        """The parameters differentiated, in the order of the returned Jacobians."""
        return list(self._params)

    @property
    def cache_nbytes(self) -> int:
        """Bytes held by the engine's caches (dense matrices of small-map frozen convolutions, batch-norm scales)."""
        entries = chain(self._hooks.conv_matrices.values(), self._hooks.norm_scales.values())
        return sum(entry[-1].numel() * entry[-1].element_size() for entry in entries)

    def __call__(self, inputs: Tensor) -> tuple[Tensor, list[JacobianBlock]]:
        """Prediction ``ŷ`` and ``∂ŷ/∂θ`` for one sample.

        Args:
            inputs: one sample with a leading batch dimension of 1.

        Returns:
            ``(prediction, jacobians)``: ``ŷ`` of shape ``(m,)`` (detached) and one Jacobian per parameter, each of
            shape ``(m, *param.shape)`` or a factored block of that shape (see ``factorize``). Dense Jacobians are
            column blocks of one shared ``(m, n)`` buffer (``H``), which :func:`~loko_lightning.loko_update` uses
            without a copy, so they need not be contiguous.
        """
        if not self._finalizer.alive:
            raise RuntimeError("Invalid call: this JacobianEngine is closed (build a new one)")
        if not isinstance(inputs, Tensor) or inputs.dim() == 0 or inputs.shape[0] != 1:
            got = tuple(inputs.shape) if isinstance(inputs, Tensor) else type(inputs).__name__
            raise ValueError(f"Invalid inputs: expected one sample with batch dimension 1, got shape {got}")
        if self._structure_changed():
            _remove(self._handles)
            self._scan()
        if not all(p.requires_grad for p in self._params):
            _check_requires_grad(self._model, self._params)
        for module in self._norms:
            if module.training and module.track_running_stats:
                raise ValueError(
                    f"Invalid model: normalisation layer {_name(self._model, module)!r} ({type(module).__name__}) "
                    "is in training mode; at batch size 1 put it in eval mode (model.eval() or "
                    "loko_lightning.adapters.freeze_normalization)"
                )
        for module in self._random:
            if module.training and _randomness(module):
                name = _name(self._model, module)
                raise ValueError(
                    f"Invalid model: {name!r} ({type(module).__name__}, {_randomness(module)}) is random in training "
                    "mode, so every call would give another prediction and Jacobian; put it in eval mode "
                    f"(model.eval(), or model.get_submodule({name!r}).eval())"
                )
        fast = not torch.is_autocast_enabled(inputs.device.type)
        result = self._run(inputs, fast)
        if result is None:  # a fast-path layer's input was modified in place after the call: redo it generically
            result = self._run(inputs, False)
        return result

    def close(self) -> None:
        """Remove the hooks from the model and release the caches; the engine cannot be called afterwards."""
        self._finalizer()
        self._hooks.conv_matrices.clear()
        self._hooks.norm_scales.clear()

    def __enter__(self) -> JacobianEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _scan(self) -> None:
        """Find and hook the fast-path layers, frozen batch norms and frozen convolutions; record the structure.

        Fast path: ``nn.Linear`` and ``nn.Conv2d`` (``groups == 1``, the plain ``forward``) whose weight is
        differentiated, so that ``∂ŷ/∂W = Σ_p (∂ŷ/∂z_p) x_pᵀ`` over the positions ``p`` the layer saw. Frozen batch
        norms and convolutions get a cheaper backward where one exists (:mod:`loko_lightning._backward`).
        """
        hooks, wanted, handles = self._hooks, self._wanted, self._handles
        hooks.conv_matrices.clear()
        hooks.norm_scales.clear()
        layers: dict[nn.Module, _Layer] = {}
        norms: list[nn.Module] = []
        random: list[nn.Module] = []
        dicts: list[dict] = []  # what the structure check compares: children, parameters, norm buffers
        kinds: dict[type, int] = {}
        for module in _modules(self._model):
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
                if _backward.is_frozen_norm(module, wanted):
                    handles.append(module.register_forward_hook(_norm_hook(hooks), prepend=True))
                elif _uses_batch_statistics(module):
                    hook = _batch_size_hook(hooks, _name(self._model, module))
                    handles.append(module.register_forward_pre_hook(hook))
                continue
            if kind == _CONV and _backward.is_frozen_conv(module, wanted):
                handles.append(module.register_forward_hook(_conv_hook(hooks), prepend=True))
                continue
            if kind == _CONV and module.groups != 1:
                continue
            weight = module._parameters.get("weight")
            if not isinstance(weight, Tensor) or id(weight) not in wanted:
                continue
            bias = module._parameters.get("bias")
            swap = ["weight", "bias"] if isinstance(bias, Tensor) and id(bias) in wanted else ["weight"]
            layer = layers[module] = _Layer(module, swap)
            handles.append(module.register_forward_pre_hook(_pre_hook(layer, hooks), with_kwargs=True))
            handles.append(module.register_forward_hook(_post_hook(layer), with_kwargs=True, prepend=True))
        self._layers, self._norms, self._random, self._dicts = layers, norms, random, dicts
        self._structure = list(chain.from_iterable(map(dict.values, dicts)))  # holding them keeps `is` reliable

    def _structure_changed(self) -> bool:
        now = list(chain.from_iterable(map(dict.values, self._dicts)))
        return len(now) != len(self._structure) or any(map(is_not, now, self._structure))

    def _run(self, inputs: Tensor, fast: bool) -> tuple[Tensor, list[JacobianBlock]] | None:
        """One forward pass with the hooks on (``fast``) or inert, then the batched reverse pass."""
        layers = self._layers if fast else {}
        self._hooks.calling, self._hooks.fast = True, fast
        try:
            try:
                with torch.enable_grad():
                    raw = self._model(inputs)
            finally:
                self._hooks.calling = self._hooks.fast = False
                for layer in layers.values():  # only left over if the forward pass raised inside the layer
                    layer.module._parameters.update(layer.saved)
                    layer.saved.clear()
            return _jacobian(raw, self._params, layers, self._output, self._chunk_size, self._factorize)
        finally:
            for layer in layers.values():  # the calls hold the layers' inputs and graph: not beyond the call
                layer.calls.clear()


def jacobian(
    model: nn.Module,
    inputs: Tensor,
    params: Sequence[Tensor] | None = None,
    *,
    output: Output = "softmax",
    chunk_size: int | None = None,
    factorize: bool = False,
) -> tuple[Tensor, list[JacobianBlock]]:
    """Prediction ``ŷ`` and ``∂ŷ/∂θ`` for a single sample, by a :class:`JacobianEngine` built for this call.

    A loop over samples should build the engine once instead: it then scans the model and registers its hooks once,
    and keeps its caches between calls.

    Args:
        model: maps ``inputs`` (batch dimension 1) to ``(1, m)`` logits or regression outputs.
            Normalisation layers with running statistics and random layers (dropout, ...) must be in eval mode,
            see :class:`JacobianEngine`.
        inputs: one sample with a leading batch dimension of 1.
        params: the parameters to differentiate (each with ``requires_grad``), default all with ``requires_grad``.
        output: ``"softmax"`` (classification) or ``"identity"`` (regression), see :class:`JacobianEngine`.
        chunk_size: at most this many Jacobian rows per batched backward pass; default all ``m`` at once.
        factorize: return fast-path weight Jacobians in exact factored form, see :class:`JacobianEngine`.

    Returns:
        ``(prediction, jacobians)``: ``ŷ`` of shape ``(m,)`` (detached) and one Jacobian per parameter, each
        of shape ``(m, *param.shape)`` or a factored block of that shape (see ``factorize``). Dense Jacobians are
        column blocks of one shared ``(m, n)`` buffer (``H``), which :func:`~loko_lightning.loko_update` uses
        without a copy, so they need not be contiguous.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        >>> prediction, jacobians = jacobian(model, torch.randn(1, 4))
        >>> prediction.shape, jacobians[0].shape
        (torch.Size([3]), torch.Size([3, 8, 4]))
    """
    with JacobianEngine(model, params, output=output, chunk_size=chunk_size, factorize=factorize) as engine:
        return engine(inputs)


class _Hooks:
    """What the engine's hooks share with it: whether an engine call is running (with shortcuts), and its caches."""

    def __init__(self) -> None:
        self.calling = False
        self.fast = False
        self.norm_scales: dict[nn.Module, tuple] = {}
        self.conv_matrices: dict[nn.Module, tuple] = {}


def _remove(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


@dataclass
class _Call:
    """One call of a fast-path layer: its input (as the layer saw it) and the gradient edge of its output."""

    inputs: Tensor
    version: int
    edge: GradientEdge


@dataclass
class _Layer:
    module: nn.Module
    swap: list[str]  # names of the parameters (weight, maybe bias) swapped for detached aliases
    calls: list[_Call] = field(default_factory=list)
    saved: dict[str, Any] = field(default_factory=dict)


_OTHER, _NORM, _LINEAR, _CONV, _RANDOM = range(5)


def _kind(cls: type) -> int:
    """What the scan looks for in a module of class ``cls``."""
    if issubclass(cls, _BATCH_NORMS):
        return _NORM
    if cls.forward is nn.Linear.forward:
        return _LINEAR
    if cls.forward is nn.Conv2d.forward:
        return _CONV
    if issubclass(cls, (nn.modules.dropout._DropoutNd, nn.RReLU, nn.MultiheadAttention)):
        return _RANDOM
    drop = sys.modules.get("timm.layers.drop")  # timm's stochastic depth and DropBlock, if timm is in use
    if drop is not None and issubclass(cls, (drop.DropPath, drop.DropBlock2d)):
        return _RANDOM
    return _OTHER


def _randomness(module: nn.Module) -> str:
    """What makes a random layer random in training mode (``""`` if nothing: zero drop probability)."""
    if isinstance(module, nn.RReLU):
        return f"lower={module.lower}, upper={module.upper}" if module.lower != module.upper else ""
    for attr in ("p", "drop_prob", "dropout"):  # dropout, timm DropPath/DropBlock2d, nn.MultiheadAttention
        value = getattr(module, attr, 0.0)
        if isinstance(value, (int, float)) and value > 0:
            return f"{attr}={value}"
    return ""


def _uses_batch_statistics(module: nn.Module) -> bool:
    """A batch norm that normalises with the statistics of its input in eval mode too (no running statistics)."""
    return isinstance(module, nn.modules.batchnorm._BatchNorm) and (
        not module.track_running_stats or module._buffers.get("running_mean") is None
    )


def _name(model: nn.Module, module: nn.Module) -> str:
    return next(n for n, mod in model.named_modules() if mod is module)


def _check_requires_grad(model: nn.Module, params: list[Tensor]) -> None:
    for i, param in enumerate(params):
        if not param.requires_grad:
            name = next((n for n, p in model.named_parameters() if p is param), None)
            what = f"parameter {name!r}" if name is not None else f"params[{i}] (not a parameter of the model)"
            raise ValueError(
                f"Invalid params: {what} has requires_grad=False, so the prediction has no derivative with respect "
                "to it; call requires_grad_(True) on it or leave it out of params"
            )


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


def _jacobian(
    raw: Any,
    params: list[Tensor],
    layers: dict[nn.Module, _Layer],
    output: Output,
    chunk_size: int | None,
    factorize: bool,
) -> tuple[Tensor, list[JacobianBlock]] | None:
    """The batched reverse pass from the model output ``raw``, and the Jacobian blocks; ``None`` to redo the call."""
    if not isinstance(raw, Tensor) or raw.shape[0] != 1:
        got = tuple(raw.shape) if isinstance(raw, Tensor) else type(raw).__name__
        raise ValueError(f"Invalid model output: expected a tensor of shape (1, m), got {got}")
    if any(call.inputs._version != call.version for layer in layers.values() for call in layer.calls):
        return None
    logits = raw.reshape(-1)
    with torch.enable_grad():
        prediction = torch.softmax(logits, dim=0) if output == "softmax" else logits
    m = prediction.shape[0]
    dtype, device = prediction.dtype, prediction.device

    # One batched reverse pass: cotangents at every fast-path layer output, and gradients of all parameters
    # (for fast-path weights these are only their uses outside the layer, usually none).
    calls = [call for layer in layers.values() for call in layer.calls]
    targets: list[Tensor | GradientEdge] = [call.edge for call in calls] + params
    if prediction.requires_grad:
        grads = _batched_grad(prediction, targets, m, chunk_size, rows_sum_to_zero=output == "softmax")
    else:
        grads = [None] * len(targets)
    call_grads = dict(zip(map(id, calls), grads[: len(calls)], strict=True))
    param_grads = grads[len(calls) :]

    # Factors per parameter: left (m, rows, k) cotangents, right (cols, k) inputs, summed over calls.
    weight_of: dict[int, list[_Layer]] = {}
    bias_of: dict[int, list[_Layer]] = {}
    for layer in layers.values():
        weight_of.setdefault(id(layer.module._parameters["weight"]), []).append(layer)
        if "bias" in layer.swap:
            bias_of.setdefault(id(layer.module._parameters["bias"]), []).append(layer)
    blocks: list[Any] = []
    for param, extra in zip(params, param_grads, strict=True):
        is_weight = id(param) in weight_of
        owners = weight_of.get(id(param)) or bias_of.get(id(param)) or []
        lefts, rights = [], []
        for layer in owners:
            for call in layer.calls:
                grad = call_grads[id(call)]
                if grad is None:
                    continue
                left = _left_factor(layer.module, grad, m)
                lefts.append(left)
                if is_weight:
                    rights.append(_right_factor(layer.module, call.inputs.detach(), left.shape[2]))
        if lefts and not is_weight:  # a bias: ∂ŷ/∂b = Σ_p ∂ŷ/∂z_p
            total = sum(left.sum(-1) for left in lefts)
            blocks.append(("grad", total if extra is None else total + extra))
            continue
        if not lefts:
            blocks.append(("grad", extra))
            continue
        left = lefts[0] if len(lefts) == 1 else torch.cat(lefts, -1)
        right = rights[0] if len(rights) == 1 else torch.cat(rights, -1)
        rows, cols, k = left.shape[1], right.shape[0], left.shape[2]
        if extra is None and factorize and k == 1 and param.dim() == 2:
            blocks.append(("block", OuterJacobian(left[:, :, 0], right[:, 0])))
        elif extra is None and factorize and factored_is_cheaper(m, rows, cols, k):
            blocks.append(("block", FactoredJacobian(left, right, param.shape)))
        else:
            blocks.append(("factors", (left, right, extra)))

    # Dense blocks are column slices of one (m, n) buffer, i.e. H itself: the Kalman update then needs no copy.
    sizes = [param.numel() if kind != "block" else 0 for (kind, _), param in zip(blocks, params, strict=True)]
    buffer = torch.empty(m, sum(sizes), dtype=dtype, device=device)
    jacobians: list[JacobianBlock] = []
    start = 0
    for (kind, value), param, size in zip(blocks, params, sizes, strict=True):
        if kind == "block":
            jacobians.append(value)
            continue
        block = buffer[:, start : start + size]
        start += size
        if kind == "factors":
            left, right, extra = value
            rows, k = left.shape[1], left.shape[2]
            block3 = block.view(m, rows, right.shape[0])
            if k == 1:
                torch.mul(left, right.T[None], out=block3)
            else:
                block3.copy_(torch.matmul(left, right.T))
            if extra is not None:
                block.add_(extra.reshape(m, -1))
        elif value is None:  # the output does not depend on this parameter
            block.zero_()
        else:
            block.copy_(value.reshape(m, -1))
        jacobians.append(block.view(m, *param.shape))
    return prediction.detach(), jacobians


def _pre_hook(layer: _Layer, hooks: _Hooks) -> Callable:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        # Outside engine calls, and for any other call signature, the layer runs untouched: its use of the weight
        # reaches the real parameter and is covered by the generic reverse pass.
        if not hooks.fast or len(args) != 1 or kwargs or not isinstance(args[0], Tensor) or layer.saved:
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


def _post_hook(layer: _Layer) -> Callable:
    def hook(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> Tensor | None:
        if not layer.saved:  # a call the pre-hook left alone (always, outside engine calls)
            return None
        module._parameters.update(layer.saved)
        layer.saved.clear()
        if not isinstance(out, Tensor) or not out.requires_grad:  # the layer ran without grad: no contribution
            return None
        out = _backward.pointwise_hook(module, args[0], out)
        layer.calls.append(_Call(args[0], args[0]._version, get_gradient_edge(out)))
        return out

    return hook


def _norm_hook(hooks: _Hooks) -> Callable:
    def hook(module: nn.Module, args: tuple, out: Any) -> Tensor | None:
        return _backward.norm_hook(module, args, out, scales=hooks.norm_scales) if hooks.fast else None

    return hook


def _conv_hook(hooks: _Hooks) -> Callable:
    def hook(module: nn.Module, args: tuple, out: Any) -> Tensor | None:
        return _backward.conv_hook(module, args, out, matrices=hooks.conv_matrices) if hooks.fast else None

    return hook


def _batch_size_hook(hooks: _Hooks, name: str) -> Callable:
    def hook(module: nn.Module, args: tuple) -> None:
        x = args[0] if hooks.calling and args else None
        if not isinstance(x, Tensor) or x.dim() < 2 or not (module.training or _uses_batch_statistics(module)):
            return
        if x.shape[0] * math.prod(x.shape[2:]) == 1:  # where torch's batch_norm refuses, with a message naming it
            raise ValueError(
                f"Invalid model: normalisation layer {name!r} ({type(module).__name__}) has no running statistics "
                f"(track_running_stats=False), so it normalises each channel by the statistics of its input, which "
                f"at batch size 1 has one value per channel (shape {tuple(x.shape)}); give it running statistics "
                "(track_running_stats=True) and put it in eval mode, or use a per-sample normalisation "
                "(nn.GroupNorm, nn.LayerNorm)"
            )

    return hook


def _batched_grad(
    prediction: Tensor,
    targets: list[Tensor | GradientEdge],
    m: int,
    chunk_size: int | None,
    *,
    rows_sum_to_zero: bool,
) -> list[Tensor | None]:
    """``∂ŷ_a/∂target`` for every row ``a``, stacked along a new leading dimension (``None`` if unused).

    With ``rows_sum_to_zero`` (softmax: ``Σ_a ŷ_a = 1``, so ``Σ_a ∂ŷ_a/∂θ = 0`` exactly) only the first ``m - 1``
    rows go through the reverse pass and the last one is minus their sum: one reverse row fewer, the same
    Jacobian up to rounding.
    """
    computed = m - 1 if rows_sum_to_zero and m > 1 else m
    eye = torch.eye(m, dtype=prediction.dtype, device=prediction.device)[:computed]
    step = computed if chunk_size is None else chunk_size
    used: list[int] = []  # indices of the targets the prediction depends on (the same for every row)

    def vjp(cotangent: Tensor) -> tuple[Tensor, ...]:
        grads = torch.autograd.grad(prediction, targets, cotangent, retain_graph=True, allow_unused=True)
        used[:] = [i for i, g in enumerate(grads) if g is not None]
        return tuple(grads[i] for i in used)

    chunks: list[tuple[Tensor, ...]] = []
    for start in range(0, computed, step):
        rows = eye[start : start + step]
        try:
            chunks.append(torch.func.vmap(vjp)(rows))
        except (RuntimeError, NotImplementedError):  # an op without a vmap rule: the older batching of autograd
            grads = torch.autograd.grad(
                prediction, targets, rows, retain_graph=True, is_grads_batched=True, allow_unused=True
            )
            used[:] = [i for i, g in enumerate(grads) if g is not None]
            chunks.append(tuple(grads[i] for i in used))
    if computed < m:
        chunks.append(tuple(-sum(chunk[j].sum(0, keepdim=True) for chunk in chunks) for j in range(len(used))))
    stacked = chunks[0] if len(chunks) == 1 else [torch.cat(parts) for parts in zip(*chunks, strict=True)]
    result: list[Tensor | None] = [None] * len(targets)
    for i, grad in zip(used, stacked, strict=True):
        result[i] = grad
    return result


def _left_factor(module: nn.Module, grad: Tensor, m: int) -> Tensor:
    """Cotangents at the layer output as ``(m, out, k)``."""
    if isinstance(module, nn.Conv2d):
        out = module.out_channels
        if grad.dim() == 4:  # unbatched (C, H, W) input
            return grad.reshape(m, out, -1)
        batch = grad.shape[1]
        left = grad.reshape(m, batch, out, -1)
        return left[:, 0] if batch == 1 else left.transpose(1, 2).reshape(m, out, -1)
    out = module.out_features
    left = grad.reshape(m, -1, out)
    return left.transpose(1, 2) if left.shape[1] == 1 else left.transpose(1, 2).contiguous()


def _right_factor(module: nn.Module, x: Tensor, k: int) -> Tensor:
    """The layer input at each of its ``k`` positions as ``(cols, k)``."""
    if isinstance(module, nn.Linear):
        return x.reshape(-1, module.in_features).T
    if x.dim() == 3:
        x = x[None]
    padding = module.padding
    if isinstance(padding, str) or module.padding_mode != "zeros":
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, module._reversed_padding_repeated_twice, mode=mode)
        padding = (0, 0)
    if module.kernel_size == (1, 1) and module.stride == (1, 1) and tuple(padding) == (0, 0):
        cols = x.reshape(x.shape[0], x.shape[1], -1)
    else:
        cols = F.unfold(x, module.kernel_size, module.dilation, padding, module.stride)
    right = cols[0] if cols.shape[0] == 1 else cols.transpose(0, 1).reshape(cols.shape[1], -1)
    if right.shape[1] != k:
        raise RuntimeError(f"Internal error: conv factor positions {right.shape[1]} != {k}")
    return right
