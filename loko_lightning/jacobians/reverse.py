"""The reverse pass of :class:`~loko_lightning.JacobianEngine`: from a model's outputs to its Jacobian blocks.

After the forward pass (in which :class:`~loko_lightning.jacobians.hooks.ModelHooks` swapped the fast-path layers'
weights for detached aliases and recorded their inputs), :func:`reverse_pass` runs one ``vmap``-batched reverse pass
for the cotangents at the fast-path layers' outputs (and the gradients of every other parameter), then forms each
weight's Jacobian as the product of its factors, or keeps it in that exact factored form. It returns the
:class:`Jacobians`, or the :class:`Fallback` the engine takes where this pass cannot give them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from enum import Enum
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge
from torch.nn import functional as F

from loko_lightning.jacobians.blocks import FactoredJacobian, JacobianBlock, OuterJacobian, factored_is_cheaper
from loko_lightning.jacobians.blocks import kind as block_kind
from loko_lightning.jacobians.hooks import FastLayer, LayerCall, is_conv_same
from loko_lightning.observation import Observation


class Jacobians(NamedTuple):
    """The prediction ``ŷ`` (detached) and one Jacobian block per parameter, in the order of the parameters."""

    prediction: Tensor
    blocks: list[JacobianBlock]


class Fallback(Enum):
    """Why :func:`reverse_pass` gave no Jacobians, and what the engine does instead."""

    #: A fast-path layer's input was modified in place after the layer read it: redo the call without the fast path.
    GENERIC = "generic"
    #: The pass of a batch cannot give every sample's own rows: take the samples one at a time.
    PER_SAMPLE = "per_sample"


def reverse_pass(
    raw: Any,
    params: list[Tensor],
    layers: dict[nn.Module, FastLayer],
    observation: Observation,
    chunk_size: int | None,
    factorize: bool,
    samples: int | None = None,
    label: Tensor | None = None,
) -> Jacobians | Fallback:
    """The batched reverse pass from the model output ``raw``, and the Jacobian blocks of ``params``.

    ``layers``: the fast-path layers of this call, with the calls their hooks recorded (empty without the fast path).
    A fast-path layer's input modified in place after the layer read it gives :attr:`Fallback.GENERIC`.

    ``samples``: ``None`` for one sample (``raw`` of shape ``(1, m)``); ``B`` for a batch (``(B, m)``), whose
    prediction is ``(B, m)`` and whose blocks get a leading batch dimension. A batch goes through the reverse pass
    with ``m - 1`` cotangents shared by all samples (the frozen network in eval mode does not couple samples, so
    sample ``b``'s slice of a cotangent is sample ``b``'s row), which gives every fast-path layer its per-sample
    factors. Where that cannot give every sample's rows it gives :attr:`Fallback.PER_SAMPLE`: a parameter reached
    another way (its gradient is summed over the samples), or a fast-path layer that saw no batch dimension first.

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
        return Fallback.GENERIC
    calls = [call for layer in layers.values() for call in layer.calls]
    if batched and any(call.inputs.dim() < 2 or call.inputs.shape[0] != samples for call in calls):
        return Fallback.PER_SAMPLE
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
        return Jacobians(prediction.detach(), _fill(blocks, params, buffer))
    if any(g is not None for g in grads[len(calls) :]):
        return Fallback.PER_SAMPLE
    per_blocks = []
    for b in range(samples):
        call_grads = [None if g is None else g[:, b : b + 1] for g in grads[: len(calls)]]  # (m, B, ...): b's slice
        call_grads = dict(zip(map(id, calls), call_grads, strict=True))
        per_blocks.append(_blocks(params, layers, call_grads, [None] * len(params), rows, factorize,
                                  lambda call, b=b: call.inputs.detach()[b : b + 1]))  # fmt: skip
    kinds = [[kind for kind, _ in blocks] for blocks in per_blocks]
    if any(k != kinds[0] for k in kinds):
        return Fallback.PER_SAMPLE
    buffer = torch.empty(samples, rows, _dense_size(per_blocks[0], params), dtype=dtype, device=device)
    per_sample_jacs = [_fill(blocks, params, buffer[b]) for b, blocks in enumerate(per_blocks)]
    stacked = [_stack(jacs, buffer, samples) for jacs in zip(*per_sample_jacs, strict=True)]
    return Jacobians(prediction.detach(), stacked)


def _blocks(
    params: list[Tensor],
    layers: dict[nn.Module, FastLayer],
    call_grads: dict[int, Tensor | None],
    param_grads: list[Tensor | None],
    m: int,
    factorize: bool,
    inputs_of: Callable[[LayerCall], Tensor],
) -> list[tuple[str, Any]]:
    """Each parameter's Jacobian for one sample: a factored block, factors to multiply out, or a gradient."""
    # Factors per parameter: left (m, rows, k) cotangents, right (cols, k) inputs, summed over calls.
    weight_of: dict[int, list[FastLayer]] = {}
    bias_of: dict[int, list[FastLayer]] = {}
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
    if is_conv_same(type(module)):  # its forward pads the input, then convolves without padding
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
