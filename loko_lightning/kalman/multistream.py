"""Several observations in one LoKO update: the multistream extended Kalman filter.

``B`` samples observed at the same linearisation point ``θ̃_{k|k-1}`` are treated as one observation of ``B·m``
outputs (Puskorius and Feldkamp, *Kalman Filtering and Neural Networks*, 2001, §2.5): the predictions, targets and
innovations stacked (``B·m``), ``H`` stacked (``B·m x ñ``), ``R`` block-diagonal (the samples are independent given
``θ̃``), ``S = H P Hᵀ + R`` of size ``B·m x B·m`` and one gain ``K = P Hᵀ S⁺``. Averaging ``B`` separate updates is
not the same thing, and with a diagonal ``P`` neither are ``B`` sequential updates (they would be with a full ``P``
and a fixed linearisation point); ``B = 1`` is the paper's step exactly.

With softmax outputs every block of ``S`` has the all-ones vector of its sample in its null space, so ``S`` has
``B`` null directions; the pseudo-inverse (:func:`loko_lightning.kalman.update.psd_pinv`) drops them all.

The observation-noise EMA takes one step per joint update with the mean of the ``B`` per-sample estimates
(:func:`stacked_observation_noise`), so ``R`` keeps its meaning (the noise of one sample's ``m`` outputs) and its
size ``m x m`` whatever ``B``.

This module stacks a batch of Jacobian blocks into the blocks of the stacked ``H``, which the single-observation
update then consumes unchanged (:class:`~loko_lightning.kalman.update.UpdatePlan` with ``samples=B``): a dense block
``(B, m, *shape)`` is a view ``(B·m, *shape)``; a factored block whose sample ``b`` has cotangents ``L_b`` and inputs
``R_b`` is the factored block with the ``B·k`` positions of all samples and the block-diagonal left factor
``diag(L_1, …, L_B)`` (exact; dense instead where that is cheaper, by
:func:`~loko_lightning.jacobians.blocks.factored_is_cheaper`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from loko_lightning.jacobians.blocks import FactoredJacobian, JacobianBlock, OuterJacobian, factored_is_cheaper

__all__ = ["check_batch", "stack_observations", "stacked_observation_noise"]


def check_batch(prediction: Any, target: Any, jacobians: Any, params: Sequence[Tensor]) -> None:
    """Refuse a batch whose shapes do not fit the parameters; the message names the expected and the given shape.

    Args:
        prediction: ``ŷ`` of ``B`` samples, shape ``(B, m)``.
        target: ``y``, shape ``(B, m)``.
        jacobians: one block per parameter with a leading batch dimension: dense ``(B, m, *shape)``,
            :class:`OuterJacobian` with ``left (B, m, out)`` and ``right (B, in)``, :class:`FactoredJacobian` with
            ``left (B, m, rows, k)`` and ``right (B, cols, k)``.
        params: the parameters, in the order of ``jacobians``.

    Raises:
        ValueError: ``Invalid <what>: expected shape ..., got ...``.
    """
    if not isinstance(prediction, Tensor) or prediction.dim() != 2:
        got = tuple(prediction.shape) if isinstance(prediction, Tensor) else type(prediction).__name__
        raise ValueError(f"Invalid prediction: expected shape (B, m) for a batch, got {got}")
    batch, m = prediction.shape
    if batch < 1 or m < 1:
        raise ValueError(f"Invalid prediction: expected shape (B, m) with B >= 1 and m >= 1, got {(batch, m)}")
    if not isinstance(target, Tensor) or tuple(target.shape) != (batch, m):
        got = tuple(target.shape) if isinstance(target, Tensor) else type(target).__name__
        raise ValueError(f"Invalid target: expected shape {(batch, m)} like the prediction, got {got}")
    if not isinstance(jacobians, (list, tuple)) or len(jacobians) != len(params):
        got = len(jacobians) if isinstance(jacobians, (list, tuple)) else type(jacobians).__name__
        raise ValueError(f"Invalid jacobians: expected {len(params)} (one per parameter), got {got}")
    for index, (jac, param) in enumerate(zip(jacobians, params, strict=True)):
        expected = (batch, m, *param.shape)
        if isinstance(jac, OuterJacobian):
            ok = jac.left.dim() == 3 and jac.right.dim() == 2 and jac.right.shape[0] == batch
        elif isinstance(jac, FactoredJacobian):
            ok = (
                param.dim() >= 1
                and jac.left.dim() == 4
                and jac.right.dim() == 3
                and jac.left.shape[:3] == (batch, m, param.shape[0])
                and jac.right.shape == (batch, param[0].numel(), jac.left.shape[3])
            )
        else:
            ok = isinstance(jac, Tensor)
        if not ok or tuple(jac.shape) != expected:
            got = tuple(jac.shape) if hasattr(jac, "shape") else type(jac).__name__
            if isinstance(jac, (OuterJacobian, FactoredJacobian)):
                got = f"{type(jac).__name__} with left {tuple(jac.left.shape)} and right {tuple(jac.right.shape)}"
            raise ValueError(f"Invalid jacobians[{index}]: expected shape {expected} (a batch of {batch}), got {got}")


def stack_observations(
    prediction: Tensor, target: Tensor, jacobians: Sequence[JacobianBlock]
) -> tuple[Tensor, Tensor, list[JacobianBlock]]:
    """The stacked observation of a batch: ``ŷ`` and ``y`` of ``B·m`` entries and the blocks of ``H`` (``B·m`` rows).

    Sample ``b``'s outputs are rows ``b·m … b·m + m - 1``. For ``B = 1`` the result is the sample's own prediction,
    target and blocks (views, no arithmetic), so a batch of one is the single-sample step bit for bit.

    Args:
        prediction: ``(B, m)``.
        target: ``(B, m)``.
        jacobians: batched blocks (see :func:`check_batch`).

    Returns:
        ``(prediction, target, jacobians)`` as the single-observation update takes them, with ``B·m`` outputs.
    """
    batch, m = prediction.shape
    if batch == 1:
        return prediction[0], target[0], [_first(jac) for jac in jacobians]
    blocks: list[JacobianBlock] = []
    for jac in jacobians:
        if isinstance(jac, Tensor):
            blocks.append(jac.reshape(batch * m, *jac.shape[2:]))
            continue
        if isinstance(jac, OuterJacobian):
            left, right = jac.left[..., None], jac.right[..., None]  # k = 1
            param_shape = torch.Size((jac.left.shape[2], jac.right.shape[1]))
        else:
            left, right, param_shape = jac.left, jac.right, jac.param_shape
        rows, cols, k = left.shape[2], right.shape[1], left.shape[3]
        if factored_is_cheaper(batch * m, rows, cols, batch * k):
            blocks.append(_block_diagonal_factors(left, right, param_shape))
        else:
            dense = FactoredJacobian(left, right, param_shape).to_dense()
            blocks.append(dense.reshape(batch * m, *param_shape))
    return prediction.reshape(-1), target.reshape(-1), blocks


def _first(jac: JacobianBlock) -> JacobianBlock:
    """Sample 0 of a batched block, as a single-sample block."""
    if isinstance(jac, Tensor):
        return jac[0]
    if isinstance(jac, OuterJacobian):
        return OuterJacobian(jac.left[0], jac.right[0])
    return FactoredJacobian(jac.left[0], jac.right[0], jac.param_shape)


def _block_diagonal_factors(left: Tensor, right: Tensor, param_shape: torch.Size) -> FactoredJacobian:
    """Sample ``b``'s rows see only sample ``b``'s ``k`` positions: ``left`` block-diagonal over all ``B·k``."""
    batch, m, rows, k = left.shape
    stacked = left.new_zeros(batch, m, rows, batch, k)
    index = torch.arange(batch, device=left.device)
    stacked[index, :, :, index, :] = left
    positions = right.permute(1, 0, 2).reshape(right.shape[1], batch * k)  # position b·k + p: sample b's p
    return FactoredJacobian(stacked.view(batch * m, rows, batch * k), positions, param_shape)


def stacked_observation_noise(
    r_estimator: str,
    previous: Tensor,
    innovation: Tensor,
    hpht: Tensor,
    prediction: Tensor,
    step: Tensor,
    beta: float,
    samples: int,
) -> tuple[Tensor, Tensor]:
    """``R_k`` (``m x m``, the filter's state) and the block-diagonal ``B·m x B·m`` noise that enters ``S``.

    The EMA estimators take one step per joint update with the mean of the per-sample estimates:
    ``R_k = β R_{k-1} + (1-β) (1/B) Σ_b R̂_b`` with ``R̂_b = e_b e_bᵀ + (H P Hᵀ)_bb`` (``"taylor"``, ``(H P Hᵀ)_bb``
    the diagonal block of sample ``b``) or ``e_b e_bᵀ`` (``"residual"``), and every sample's block of ``S`` gets
    ``R_k``. ``"identity"`` and ``"decay"`` (``k`` = index of the joint update) put the same ``I`` or ``I e^{-k/50}``
    on every block. ``"softmax"`` gives every sample its own block ``diag(ŷ_b) - ŷ_b ŷ_bᵀ``; the state keeps their
    mean (it is not read back: this estimator has no memory).

    Args:
        r_estimator: see :func:`loko_lightning.kalman.update.observation_noise`.
        previous: ``R_{k-1}``, ``m x m``.
        innovation: stacked ``e``, ``(B·m,)``.
        hpht: ``H P Hᵀ`` of the stacked ``H``, ``B·m x B·m``.
        prediction: stacked ``ŷ``, ``(B·m,)``.
        step: ``k``, the 1-based index of this update (0-d tensor).
        beta: forgetting factor of the EMA.
        samples: ``B``.

    Returns:
        ``(R_k, blockdiag)``.
    """
    m = innovation.shape[0] // samples
    eye = torch.eye(m, dtype=hpht.dtype, device=hpht.device)
    if r_estimator in ("taylor", "residual"):
        e = innovation.view(samples, m)
        estimate = e[:, :, None] * e[:, None, :]
        if r_estimator == "taylor":
            estimate = estimate + hpht.view(samples, m, samples, m).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
        R_k = beta * previous + (1.0 - beta) * estimate.mean(0)
        blocks = R_k.expand(samples, m, m)
    elif r_estimator == "identity":
        R_k = eye
        blocks = eye.expand(samples, m, m)
    elif r_estimator == "decay":
        R_k = eye * torch.exp(-step.to(hpht.dtype) / 50.0)
        blocks = R_k.expand(samples, m, m)
    elif r_estimator == "softmax":
        y = prediction.view(samples, m)
        blocks = torch.diag_embed(y) - y[:, :, None] * y[:, None, :]
        R_k = blocks.mean(0)
    else:
        raise ValueError(f"Invalid r_estimator: {r_estimator!r}")
    return R_k, torch.block_diag(*blocks.unbind(0))
