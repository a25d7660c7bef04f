"""Cheaper reverse passes through layers without differentiated parameters, for the Jacobian engine.

The batched reverse pass of :class:`~loko_lightning.JacobianEngine` (``vmap`` over ``m - 1`` cotangents) spends most
of its time in frozen layers, where it only needs ``∂L/∂x``. For some layers that is much cheaper to compute directly
than through the generic batched backward, which on small maps and few channels is dominated by overhead:

- an eval-mode batch norm is a per-channel scale (times the pass-through mask of a ReLU/ReLU6 that timm fuses in);
- a 1 x 1 convolution (stride 1, no padding) is one matrix product over all pixels (also used for differentiated
  ones, e.g. the ``B`` factors of LoRA convolutions, whose cotangents are still collected at their outputs);
- a convolution on a small map (the last stages of a CNN at CIFAR resolution) is one dense matrix, built exactly
  from the weight once and kept while the weight does not change.

Every substitution keeps the layer's forward values (the output is the layer's own) and replaces its backward by a
mathematically identical one, equal up to rounding. The hooks take the caches they fill as arguments: each engine owns
its own, and nothing here keeps state between calls.
"""

from __future__ import annotations

import functools
import itertools
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

GradInput = Callable[[Tensor], Tensor]

# Largest ``out.numel() x x.numel()`` of a convolution whose backward is one dense matrix product (4 MiB in float32).
DENSE_CONV_LIMIT = 1 << 20


class _Substitute(torch.autograd.Function):
    """Identity on a layer's output ``out``, whose backward to the layer's input ``x`` is ``grad_input``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, out: Tensor, grad_input: GradInput) -> Tensor:
        ctx.grad_input = grad_input
        return out.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return ctx.grad_input(grad), None, None


def substitute(x: Tensor, out: Tensor, grad_input: GradInput) -> Tensor:
    """``out`` (the output a layer computed from ``x``), with ``grad_input`` as the layer's backward."""
    return _Substitute.apply(x, out.detach(), grad_input)


def is_frozen_norm(module: nn.Module, wanted: set[int] | frozenset[int]) -> bool:
    """A batch norm that is a fixed per-channel affine map in eval mode (possibly followed by a ReLU, see below).

    Running statistics, the plain ``forward``, and neither its weight nor its bias among the parameters
    differentiated (``wanted``: their ids). timm's fused ``BatchNormAct2d`` (batch norm, dropout, activation)
    qualifies when its dropout is the identity and its activation ``ReLU``, ``ReLU6`` or the identity. The mode is
    not part of it: a layer can be switched between calls, so :func:`norm_hook` checks it on every call.
    """
    return (
        isinstance(module, nn.modules.batchnorm._BatchNorm)
        and (type(module).forward is nn.modules.batchnorm._BatchNorm.forward or _is_norm_act(module))
        and module._buffers.get("running_mean") is not None
        and module._buffers.get("running_var") is not None
        and not any(p is not None and id(p) in wanted for p in module._parameters.values())
    )


def is_frozen_conv(module: nn.Module, wanted: set[int] | frozenset[int]) -> bool:
    """A plain ``nn.Conv2d`` (zero padding, ``groups == 1``) none of whose parameters is differentiated."""
    return (
        type(module).forward is nn.Conv2d.forward
        and module.groups == 1
        and module.padding_mode == "zeros"
        and not isinstance(module.padding, str)
        and not any(p is not None and id(p) in wanted for p in module._parameters.values())
    )


def _is_norm_act(module: nn.Module) -> bool:
    norm_act = sys.modules.get("timm.layers.norm_act")
    return (
        norm_act is not None
        and type(module).forward is norm_act.BatchNormAct2d.forward
        and type(getattr(module, "drop", None)) is nn.Identity
        and type(getattr(module, "act", None)) in (nn.Identity, nn.ReLU, nn.ReLU6)
    )


def _is_pointwise(conv: nn.Conv2d) -> bool:
    return conv.kernel_size == (1, 1) and conv.stride == (1, 1) and conv.padding == (0, 0)


def norm_hook(module: nn.Module, args: tuple, out: Any, *, scales: dict) -> Tensor | None:
    """Forward hook: a frozen batch norm's backward as the per-channel scale ``γ / sqrt(σ² + ε)`` it is.

    ``scales`` caches the scale per module while its running variance and weight are the same tensors, unmodified.
    """
    if module.training:  # it normalises with batch statistics: not a fixed map
        return None
    x = args[0] if len(args) == 1 else None
    if not isinstance(x, Tensor) or not isinstance(out, Tensor) or not x.requires_grad or x.dim() < 2:
        return None
    var, weight = module._buffers["running_var"], module._parameters.get("weight")
    key = (_state(var), None if weight is None else _state(weight), module.eps, out.dtype, x.dim())
    cached = scales.get(module)
    if cached is None or cached[0] is not var or cached[1] is not weight or cached[2] != key:
        scale = torch.rsqrt(var.detach() + module.eps)
        if weight is not None:
            scale = scale * weight.detach()
        scale = scale.to(out.dtype).reshape(-1, *([1] * (x.dim() - 2)))
        cached = scales[module] = (var, weight, key, scale)
    scale = cached[3]
    act = type(getattr(module, "act", None))
    if act is nn.ReLU or act is nn.ReLU6:
        # The activation passes the cotangent where its input z lay strictly inside (0, 6) (ReLU: above 0); for these
        # clamps that is where the output does, so the mask comes from the output itself.
        scale = scale * (out > 0 if act is nn.ReLU else (out > 0) & (out < 6))
    return substitute(x, out, functools.partial(_scale_grad, scale=scale))


def _scale_grad(grad: Tensor, *, scale: Tensor) -> Tensor:
    return grad * scale


def conv_hook(module: nn.Conv2d, args: tuple, out: Any, *, matrices: dict) -> Tensor | None:
    """Forward hook: a frozen convolution's backward as one matrix product where that is cheaper.

    Pointwise convolutions and convolutions on maps not much larger than their kernel (with at most
    :data:`DENSE_CONV_LIMIT` matrix entries); others keep the generic backward. ``matrices`` caches the dense
    matrix per module while its weight is the same tensor, unmodified.
    """
    x = args[0] if len(args) == 1 else None
    if not isinstance(x, Tensor) or not isinstance(out, Tensor) or not x.requires_grad:
        return None
    if x.dim() != 4 or x.shape[0] != 1 or out.dtype != module.weight.dtype:
        return None
    if _is_pointwise(module):
        matrix = module.weight.detach().reshape(module.out_channels, -1)
        return substitute(x, out, functools.partial(_pointwise_grad, matrix=matrix, shape=x.shape))
    (kh, kw), area = module.kernel_size, x.shape[2] * x.shape[3]
    # The dense product costs out.numel() x x.numel(), the convolution out.numel() x C_in·kh·kw: dense only where the
    # map is hardly larger than the kernel (and the matrix small).
    if out.numel() * x.numel() <= DENSE_CONV_LIMIT and area <= 4 * kh * kw:
        dense = _cached_conv_matrix(module, x.shape, out.shape, matrices)
        return substitute(x, out, functools.partial(_dense_grad, matrix=dense, shape=x.shape))
    return None


def _dense_grad(grad: Tensor, *, matrix: Tensor, shape: torch.Size) -> Tensor:
    """``∂L/∂x`` of a layer that is the linear map ``vec(z) = M vec(x)``: ``∂L/∂z · M``."""
    return (grad.reshape(1, -1) @ matrix).reshape(shape)


def pointwise_hook(module: nn.Module, x: Tensor, out: Tensor) -> Tensor:
    """For a fast-path (differentiated) pointwise convolution: its backward to ``x`` as one matrix product."""
    if not (
        isinstance(module, nn.Conv2d)
        and _is_pointwise(module)
        and x.dim() == 4
        and x.shape[0] == 1
        and x.requires_grad
        and out.dtype == module.weight.dtype
    ):
        return out
    matrix = module.weight.detach().reshape(module.out_channels, -1)
    return substitute(x, out, functools.partial(_pointwise_grad, matrix=matrix, shape=x.shape))


def _pointwise_grad(grad: Tensor, *, matrix: Tensor, shape: torch.Size) -> Tensor:
    """``∂L/∂x`` of a pointwise convolution with the ``(out, in)`` weight ``matrix``, for ``grad`` ``(1, out, H, W)``.

    Written as ``(pixels x out) @ (out x in)`` so that, batched over cotangents by ``vmap``, it is one matrix
    product with the weight (the other way round it becomes a batched product that reads the weight per row).
    """
    return (grad.reshape(matrix.shape[0], -1).T @ matrix).T.reshape(shape)


def _state(tensor: Tensor) -> tuple:
    """What tells a tensor's values apart besides its identity.

    In-place changes bump the version; ``tensor.data = ...`` (which ``module.to(...)`` and ``module.double()`` use)
    keeps the version but moves the data.
    """
    return tensor._version, tensor.data_ptr(), tensor.dtype, tensor.device


def _cached_conv_matrix(module: nn.Conv2d, in_shape: torch.Size, out_shape: torch.Size, matrices: dict) -> Tensor:
    weight = module.weight
    key = (_state(weight), in_shape, out_shape)
    cached = matrices.get(module)
    if cached is None or cached[0] is not weight or cached[1] != key:  # holding the weight keeps `is` reliable
        dense = _conv_matrix(weight.detach(), _conv_links(module, in_shape, out_shape), in_shape, out_shape)
        cached = matrices[module] = (weight, key, dense)
    return cached[2]


def _conv_links(module: nn.Conv2d, in_shape: torch.Size, out_shape: torch.Size) -> list[tuple[int, int, int]]:
    """``(q, r, t)`` for each output pixel ``q`` and input pixel ``r`` that kernel tap ``t`` links.

    Output pixel ``(u, v)`` reads input pixel ``(u·s - p + i·d, v·s - p + j·d)`` through tap ``(i, j)``; two pixels
    are linked by at most one tap.
    """
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = module.kernel_size, module.stride, module.padding, module.dilation
    height, width, rows, cols = *in_shape[-2:], *out_shape[-2:]
    links = []
    for u, v, i, j in itertools.product(range(rows), range(cols), range(kh), range(kw)):
        y, x = u * sh - ph + i * dh, v * sw - pw + j * dw
        if 0 <= y < height and 0 <= x < width:
            links.append((u * cols + v, y * width + x, i * kw + j))
    return links


def _conv_matrix(
    weight: Tensor, links: list[tuple[int, int, int]], in_shape: torch.Size, out_shape: torch.Size
) -> Tensor:
    """The convolution with ``weight`` as the ``(out·P, in·H·W)`` matrix ``M`` with ``vec(z) = M vec(x)``.

    ``M[(o, q), (c, r)] = weight[o, c, t]`` for every link ``(q, r, t)`` (:func:`_conv_links`), zero elsewhere.
    """
    out, channels = weight.shape[:2]
    pixels, area = out_shape[-2] * out_shape[-1], in_shape[-2] * in_shape[-1]
    dense = weight.new_zeros(out, pixels, channels, area)
    taps = weight.flatten(2)
    for q, r, t in links:  # one (out, in) block per link: only the nonzeros are written
        dense[:, q, :, r] = taps[:, :, t]
    return dense.view(out * pixels, channels * area)
