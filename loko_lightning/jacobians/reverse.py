"""One Jacobian pass of :class:`~loko_lightning.JacobianEngine`: the hooks, the batched backward, the factors.

The engine scans the model and registers these hooks once; each call runs :func:`_jacobian`: one forward pass in
which the fast-path layers' weights are swapped for detached aliases and their inputs captured, one ``vmap``-batched
reverse pass for the cotangents at their outputs (and the gradients of every other parameter), then each weight's
Jacobian as the product of its factors, or in that exact factored form.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.nn import functional as F
from torch.utils.hooks import RemovableHandle

from loko_lightning.jacobians import frozen
from loko_lightning.jacobians.blocks import FactoredJacobian, JacobianBlock, OuterJacobian, factored_is_cheaper
from loko_lightning.jacobians.blocks import kind as block_kind
from loko_lightning.observation import Observation


class _Hooks:
    """What the engine's hooks share with it: whether an engine call is running (with shortcuts), and its caches."""

    def __init__(self) -> None:
        self.calling = False
        self.fast = False
        self.batched = False
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
    # On the fast path only in batches (timm's Conv2dSame): for one sample autograd's weight gradient is as cheap and
    # gives the rounding of the numbers measured before this layer had a fast path (LoKO's first steps amplify it).
    batch_only: bool = False
    calls: list[_Call] = field(default_factory=list)
    saved: dict[str, Any] = field(default_factory=dict)


# _CONV_SAME: timm's Conv2dSame (TensorFlow's "SAME" padding, worked out from each input's size in its forward).
_OTHER, _NORM, _LINEAR, _CONV, _RANDOM, _CONV_SAME = range(6)


def _jacobian(
    raw: Any,
    params: list[Tensor],
    layers: dict[nn.Module, _Layer],
    observation: Observation,
    chunk_size: int | None,
    factorize: bool,
    samples: int | None = None,
    label: Tensor | None = None,
) -> tuple[Tensor, list[JacobianBlock]] | str | None:
    """The batched reverse pass from the model output ``raw``, and the Jacobian blocks; ``None`` to redo the call.

    ``samples``: ``None`` for one sample (``raw`` of shape ``(1, m)``); ``B`` for a batch (``(B, m)``), whose
    prediction is ``(B, m)`` and whose blocks get a leading batch dimension. A batch goes through the reverse pass
    with ``m - 1`` cotangents shared by all samples (the frozen network in eval mode does not couple samples, so
    sample ``b``'s slice of a cotangent is sample ``b``'s row), which gives every fast-path layer its per-sample
    factors. Returns the string ``"loop"`` (the caller then takes the samples one at a time) when that cannot give
    every sample's rows: a parameter reached another way (its gradient is summed over the samples), or a fast-path
    layer that saw no batch dimension first.

    An observation whose rows come from the label (:meth:`~loko_lightning.observation.Observation.cotangents`) gets
    ``label`` (one per sample): the reverse pass then runs from the raw outputs with its cotangents, and the blocks
    have its :meth:`~loko_lightning.observation.Observation.rows` rows.
    """
    batched = samples is not None
    if not isinstance(raw, Tensor) or raw.shape[0] != (samples if batched else 1):
        got = tuple(raw.shape) if isinstance(raw, Tensor) else type(raw).__name__
        expected = f"({samples}, m)" if batched else "(1, m)"
        raise ValueError(f"Invalid model output: expected a tensor of shape {expected}, got {got}")
    if any(call.inputs._version != call.version for layer in layers.values() for call in layer.calls):
        return None
    calls = [call for layer in layers.values() for call in layer.calls]
    if batched and any(call.inputs.dim() < 2 or call.inputs.shape[0] != samples for call in calls):
        return "loop"  # type: ignore[return-value]
    logits = raw.reshape(samples, -1) if batched else raw.reshape(-1)
    with torch.enable_grad():
        prediction = observation.predict(logits)
    m = prediction.shape[-1]
    dtype, device = prediction.dtype, prediction.device

    # One batched reverse pass: cotangents at every fast-path layer output, and gradients of all parameters
    # (for fast-path weights these are only their uses outside the layer, usually none).
    targets: list[Tensor | GradientEdge] = [call.edge for call in calls] + params
    source, cotangents, rows = prediction, None, m
    if label is not None:
        detached = prediction.detach()
        target = observation.target(label, detached if batched else detached[None])
        cotangents = observation.cotangents(detached, target if batched else target[0])
    if cotangents is not None:  # rows chosen from the label, pulled back from the raw outputs
        source, rows = logits, cotangents.shape[0]
    if source.requires_grad:
        grads = _batched_grad(source, targets, m, observation.reverse_rows(m), chunk_size, cotangents)
    else:
        grads = [None] * len(targets)
    if not batched:
        blocks = _blocks(params, layers, dict(zip(map(id, calls), grads[: len(calls)], strict=True)),
                         grads[len(calls) :], rows, factorize, lambda call: call.inputs.detach())  # fmt: skip
        buffer = torch.empty(rows, _dense_size(blocks, params), dtype=dtype, device=device)
        return prediction.detach(), _fill(blocks, params, buffer)
    if any(g is not None for g in grads[len(calls) :]):
        return "loop"  # type: ignore[return-value]
    per_blocks = []
    for b in range(samples):
        call_grads = [None if g is None else g[:, b : b + 1] for g in grads[: len(calls)]]  # (m, B, ...): b's slice
        call_grads = dict(zip(map(id, calls), call_grads, strict=True))
        per_blocks.append(_blocks(params, layers, call_grads, [None] * len(params), rows, factorize,
                                  lambda call, b=b: call.inputs.detach()[b : b + 1]))  # fmt: skip
    kinds = [[kind for kind, _ in blocks] for blocks in per_blocks]
    if any(k != kinds[0] for k in kinds):
        return "loop"  # type: ignore[return-value]
    buffer = torch.empty(samples, rows, _dense_size(per_blocks[0], params), dtype=dtype, device=device)
    per_sample_jacs = [_fill(blocks, params, buffer[b]) for b, blocks in enumerate(per_blocks)]
    return prediction.detach(), [_stack(jacs, buffer, samples) for jacs in zip(*per_sample_jacs, strict=True)]


def _blocks(
    params: list[Tensor],
    layers: dict[nn.Module, _Layer],
    call_grads: dict[int, Tensor | None],
    param_grads: list[Tensor | None],
    m: int,
    factorize: bool,
    inputs_of: Callable[[_Call], Tensor],
) -> list[tuple[str, Any]]:
    """Each parameter's Jacobian for one sample: a factored block, factors to multiply out, or a gradient."""
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
                    rights.append(_right_factor(layer.module, inputs_of(call), left.shape[2]))
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
    return blocks


def _dense_size(blocks: list[tuple[str, Any]], params: list[Tensor]) -> int:
    return sum(param.numel() for (kind, _), param in zip(blocks, params, strict=True) if kind != "block")


def _fill(blocks: list[tuple[str, Any]], params: list[Tensor], buffer: Tensor) -> list[JacobianBlock]:
    """The blocks of one sample; dense ones written into ``buffer`` (``(m, n)``) and returned as views of it."""
    # Dense blocks are column slices of one (m, n) buffer, i.e. H itself: the Kalman update then needs no copy.
    m = buffer.shape[0]
    jacobians: list[JacobianBlock] = []
    start = 0
    for (kind, value), param in zip(blocks, params, strict=True):
        if kind == "block":
            jacobians.append(value)
            continue
        size = param.numel()
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
    return jacobians


def _stack(jacs: tuple[JacobianBlock, ...], buffer: Tensor, samples: int) -> JacobianBlock:
    """One parameter's per-sample blocks as a batched block (dense: a view of the ``(B, m, n)`` buffer)."""
    first = jacs[0]
    if not isinstance(first, Tensor):
        return block_kind(first).stack(jacs)
    column = (first.data_ptr() - buffer[0].data_ptr()) // buffer.element_size()
    return buffer[:, :, column : column + first[0].numel()].view(samples, *first.shape)


def _stack_samples(results: list[tuple[Tensor, list[JacobianBlock]]]) -> tuple[Tensor, list[JacobianBlock]]:
    """Single-sample results as one batch: predictions ``(B, m)``, blocks with a leading batch dimension."""
    per_parameter = zip(*(jacobians for _, jacobians in results), strict=True)
    blocks = [block_kind(jacs[0]).stack(jacs) for jacs in per_parameter]
    return torch.stack([prediction for prediction, _ in results]), blocks


def _pre_hook(layer: _Layer, hooks: _Hooks) -> Callable:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        # Outside engine calls, and for any other call signature, the layer runs untouched: its use of the weight
        # reaches the real parameter and is covered by the generic reverse pass.
        if not hooks.fast or len(args) != 1 or kwargs or not isinstance(args[0], Tensor) or layer.saved:
            return None
        if layer.batch_only and not hooks.batched:
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
        out = frozen.pointwise_hook(module, args[0], out)
        layer.calls.append(_Call(args[0], args[0]._version, get_gradient_edge(out)))
        return out

    return hook


def _norm_hook(hooks: _Hooks) -> Callable:
    def hook(module: nn.Module, args: tuple, out: Any) -> Tensor | None:
        return frozen.norm_hook(module, args, out, scales=hooks.norm_scales) if hooks.fast else None

    return hook


def _conv_hook(hooks: _Hooks) -> Callable:
    def hook(module: nn.Module, args: tuple, out: Any) -> Tensor | None:
        return frozen.conv_hook(module, args, out, matrices=hooks.conv_matrices) if hooks.fast else None

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
    computed: int,
    chunk_size: int | None,
    cotangents: Tensor | None = None,
) -> list[Tensor | None]:
    """``∂ŷ_a/∂target`` for every row ``a``, stacked along a new leading dimension (``None`` if unused).

    Given ``cotangents`` (``(rows, m)``, or ``(rows, B, m)`` for a batch), the rows are their pullbacks instead,
    all computed.

    Only the first ``computed`` rows go through the reverse pass. ``computed = m - 1`` for an observation that sums
    to one (softmax: ``Σ_a ŷ_a = 1``, so ``Σ_a ∂ŷ_a/∂θ = 0`` exactly): the last row is minus the sum of the others,
    one reverse row fewer, the same Jacobian up to rounding.

    A batch of predictions ``(B, m)``: row ``a``'s cotangent is ``a`` in every sample (``m`` rows, each ``B``
    per-sample rows, so a chunk holds ``chunk_size // B`` of them).
    """
    if cotangents is not None:
        computed = m = cotangents.shape[0]
    else:
        cotangents = torch.eye(m, dtype=prediction.dtype, device=prediction.device)[:computed]
        if prediction.dim() > 1:
            cotangents = cotangents[:, None, :].expand(computed, prediction.shape[0], m)
    if prediction.dim() == 1:
        step = computed if chunk_size is None else chunk_size
    else:
        step = computed if chunk_size is None else max(1, chunk_size // prediction.shape[0])
    used: list[int] = []  # indices of the targets the prediction depends on (the same for every row)

    def vjp(cotangent: Tensor) -> tuple[Tensor, ...]:
        grads = torch.autograd.grad(prediction, targets, cotangent, retain_graph=True, allow_unused=True)
        used[:] = [i for i, g in enumerate(grads) if g is not None]
        return tuple(grads[i] for i in used)

    chunks: list[tuple[Tensor, ...]] = []
    for start in range(0, cotangents.shape[0], step):
        rows = cotangents[start : start + step]
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
    if _is_conv_same(type(module)):  # its forward pads the input, then convolves without padding
        x = sys.modules["timm.layers.padding"].pad_same(x, module.kernel_size, module.stride, module.dilation)
    elif isinstance(padding, str) or module.padding_mode != "zeros":
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


def _is_conv_same(cls: type) -> bool:
    """Whether ``cls`` convolves like timm's ``Conv2dSame`` (its ``forward``), if timm is in use."""
    same = sys.modules.get("timm.layers.conv2d_same")
    return same is not None and getattr(cls, "forward", None) is same.Conv2dSame.forward


def _uses_batch_statistics(module: nn.Module) -> bool:
    """A batch norm that normalises with the statistics of its input in eval mode too (no running statistics)."""
    return isinstance(module, nn.modules.batchnorm._BatchNorm) and (
        not module.track_running_stats or module._buffers.get("running_mean") is None
    )


def _check_inputs(inputs: Any, batch: bool) -> Tensor:
    """The first tensor of ``inputs`` (a tensor or a dict of tensors), after checking their batch dimension.

    One sample: each tensor has batch dimension 1; ``batch``: the same number ``B >= 1`` of samples along the first
    dimension of every tensor.
    """
    tensors = list(inputs.values()) if isinstance(inputs, Mapping) else [inputs]
    if not tensors:
        raise ValueError("Invalid inputs: an empty dict")
    expected = "a batch of samples along the first dimension" if batch else "one sample with batch dimension 1"
    for tensor in tensors:
        size = tensors[0].shape[0] if batch and isinstance(tensors[0], Tensor) and tensors[0].dim() else 1
        if not isinstance(tensor, Tensor) or tensor.dim() == 0 or tensor.shape[0] != size or size < 1:
            got = tuple(tensor.shape) if isinstance(tensor, Tensor) else type(tensor).__name__
            raise ValueError(f"Invalid inputs: expected {expected}, got shape {got}")
    return tensors[0]


def _sample(inputs: Tensor | Mapping[str, Tensor], index: int) -> Tensor | dict[str, Tensor]:
    """Sample ``index`` of a batch (a tensor or a dict of tensors), keeping its batch dimension of 1."""
    if isinstance(inputs, Mapping):
        return {key: value[index : index + 1] for key, value in inputs.items()}
    return inputs[index : index + 1]
