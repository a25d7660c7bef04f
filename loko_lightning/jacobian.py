"""Prediction and Jacobian of a model's outputs w.r.t. its trainable parameters, for one sample.

The ``m`` rows of the Jacobian come from one forward pass and one *batched* reverse pass
(:func:`torch.autograd.grad` with ``is_grads_batched=True``, i.e. ``vmap`` over the ``m`` cotangents),
never from ``ñ`` forward passes or ``m`` separate backward passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor, nn

from loko_lightning.functional import JacobianBlock, OuterJacobian

Output = Literal["softmax", "identity"]
_BATCH_NORMS = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)


def jacobian(
    model: nn.Module,
    inputs: Tensor,
    params: Sequence[Tensor] | None = None,
    *,
    output: Output = "softmax",
    chunk_size: int | None = None,
    factorize_head: bool = False,
) -> tuple[Tensor, list[JacobianBlock]]:
    """Prediction ``ŷ`` and ``∂ŷ/∂θ`` for a single sample.

    Args:
        model: maps ``inputs`` (batch dimension 1) to ``(1, m)`` logits or regression outputs.
            Normalisation layers with running statistics must be in eval mode (at batch size 1 their batch
            statistics are meaningless and every call would overwrite the running ones).
        inputs: one sample with a leading batch dimension of 1.
        params: the parameters to differentiate, default all with ``requires_grad``. Frozen weights get
            no gradient and cost nothing beyond the backward pass through them.
        output: ``"softmax"`` (classification, ``ŷ`` = class probabilities) or ``"identity"``
            (regression, ``ŷ`` = the model output).
        chunk_size: at most this many Jacobian rows per batched backward pass, to bound memory for
            large ``m``; default all ``m`` at once.
        factorize_head: if the model's output is produced directly by an ``nn.Linear`` whose weight is in
            ``params``, return that weight's Jacobian as an exact
            :class:`~loko_lightning.functional.OuterJacobian` (``∂ŷ/∂z ⊗ f``) and its bias Jacobian in
            closed form, and leave the head out of the backward pass. :class:`~loko_lightning.LoKO`
            consumes either form; the saving grows with ``m`` and the head width.

    Returns:
        ``(prediction, jacobians)``: ``ŷ`` of shape ``(m,)`` (detached) and one Jacobian per parameter, each
        of shape ``(m, *param.shape)`` (or an ``OuterJacobian`` of that shape, see ``factorize_head``).

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        >>> prediction, jacobians = jacobian(model, torch.randn(1, 4))
        >>> prediction.shape, jacobians[0].shape
        (torch.Size([3]), torch.Size([3, 8, 4]))
    """
    if output not in ("softmax", "identity"):
        raise ValueError(f"Invalid output: {output!r} (expected 'softmax' or 'identity')")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"Invalid chunk_size: {chunk_size} (must be >= 1 or None)")
    if not isinstance(inputs, Tensor) or inputs.dim() == 0 or inputs.shape[0] != 1:
        got = tuple(inputs.shape) if isinstance(inputs, Tensor) else type(inputs).__name__
        raise ValueError(f"Invalid inputs: expected one sample with batch dimension 1, got shape {got}")
    params = [p for p in model.parameters() if p.requires_grad] if params is None else list(params)
    if not params:
        raise ValueError("Invalid params: no trainable parameters (none has requires_grad=True)")
    for name, module in model.named_modules():
        if isinstance(module, _BATCH_NORMS) and module.training and module.track_running_stats:
            raise ValueError(
                f"Invalid model: normalisation layer {name!r} ({type(module).__name__}) is in training mode; at "
                "batch size 1 put it in eval mode (model.eval() or loko_lightning.adapters.freeze_normalization)"
            )

    heads: list[tuple[nn.Linear, Tensor, Tensor]] = []
    hooks = []
    if factorize_head:
        param_ids = {id(p) for p in params}

        def record(module: nn.Module, args: tuple, out: Tensor) -> None:
            heads.append((module, args[0], out))

        hooks = [
            m.register_forward_hook(record)
            for m in model.modules()
            if isinstance(m, nn.Linear) and id(m.weight) in param_ids
        ]
    try:
        with torch.enable_grad():
            raw = model(inputs)
    finally:
        for hook in hooks:
            hook.remove()
    if not isinstance(raw, Tensor) or raw.shape[0] != 1:
        got = tuple(raw.shape) if isinstance(raw, Tensor) else type(raw).__name__
        raise ValueError(f"Invalid model output: expected a tensor of shape (1, m), got {got}")
    logits = raw.reshape(-1)
    with torch.enable_grad():
        prediction = torch.softmax(logits, dim=0) if output == "softmax" else logits
    m = prediction.shape[0]

    head = _find_head(heads, raw) if factorize_head else None
    closed_form: dict[int, JacobianBlock] = {}
    if head is not None:
        module, features = head
        # ∂ŷ/∂z: the softmax Jacobian diag(ŷ) - ŷŷᵀ, or the identity for regression.
        y = prediction.detach()
        d_out = torch.diag(y) - torch.outer(y, y) if output == "softmax" else torch.eye(m, dtype=y.dtype)
        d_out = d_out.to(device=y.device)
        closed_form[id(module.weight)] = OuterJacobian(d_out, features.detach().reshape(-1).to(d_out.dtype))
        if module.bias is not None:
            closed_form[id(module.bias)] = d_out
    autograd_params = [p for p in params if id(p) not in closed_form]

    rows: list[tuple[Tensor, ...]] = []
    if autograd_params:
        eye = torch.eye(m, dtype=prediction.dtype, device=prediction.device)
        step = m if chunk_size is None else chunk_size
        for start in range(0, m, step):
            cotangents = eye[start : start + step]
            rows.append(
                torch.autograd.grad(
                    prediction,
                    autograd_params,
                    grad_outputs=cotangents,
                    retain_graph=start + step < m,
                    is_grads_batched=True,
                    allow_unused=True,
                )
            )
    autograd_jacs = []
    for i, param in enumerate(autograd_params):
        if rows[0][i] is None:  # the output does not depend on this parameter
            autograd_jacs.append(torch.zeros(m, *param.shape, dtype=param.dtype, device=param.device))
        else:
            autograd_jacs.append(torch.cat([r[i] for r in rows]) if len(rows) > 1 else rows[0][i])
    remaining = iter(autograd_jacs)
    jacobians = [closed_form[id(p)] if id(p) in closed_form else next(remaining) for p in params]
    return prediction.detach(), jacobians


def _find_head(heads: list[tuple[nn.Linear, Tensor, Tensor]], raw: Tensor) -> tuple[nn.Linear, Tensor] | None:
    """The Linear layer whose output *is* the model output, seen once, with a single input vector."""
    for module, features, out in heads:
        if out is raw and features.numel() == module.in_features and sum(m is module for m, _, _ in heads) == 1:
            return module, features
    return None
