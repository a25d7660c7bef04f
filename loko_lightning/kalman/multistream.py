"""Several observations in one LoKO update: the multistream extended Kalman filter.

``B`` samples observed at the same linearisation point ``θ̃_{k|k-1}`` are treated as one observation of ``B·m``
outputs (Puskorius and Feldkamp, *Kalman Filtering and Neural Networks*, 2001, §2.5): the predictions, targets and
innovations stacked (``B·m``), ``H`` stacked (``B·m x ñ``), ``R`` block-diagonal (the samples are independent given
``θ̃``), ``S = H P Hᵀ + R`` of size ``B·m x B·m`` and one gain ``K = P Hᵀ S⁺``. Averaging ``B`` separate updates is
not the same thing, and with a diagonal ``P`` neither are ``B`` sequential updates (they would be with a full ``P``
and a fixed linearisation point); ``B = 1`` is the paper's step exactly.

With softmax outputs every block of ``S`` has the all-ones vector of its sample in its null space, so ``S`` has
``B`` null directions; the pseudo-inverse (:func:`loko_lightning.kalman.filters.covariance.psd_pinv`) drops them all.

The observation-noise EMA takes one step per joint update with the mean of the ``B`` per-sample estimates
(:func:`loko_lightning.kalman.noise.observation_noise`), so ``R`` keeps its meaning (the noise of one sample's ``m``
outputs) and its size ``m x m`` whatever ``B``.

This module checks what a closure returns (one sample or a batch) and stacks a batch of Jacobian blocks into the
blocks of the stacked ``H``, which the single-observation update then consumes unchanged
(:class:`~loko_lightning.kalman.plan.UpdatePlan` with ``samples=B``): each block kind says how
(:meth:`~loko_lightning.jacobians.blocks.Dense.stack_rows`; a dense block ``(B, m, *shape)`` is a view
``(B·m, *shape)``, a factored one gets the block-diagonal left factor of
:func:`~loko_lightning.jacobians.blocks.stack_factors`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from loko_lightning.jacobians.blocks import JacobianBlock, kind

__all__ = ["check_observation", "layout_key", "stack_observations"]


def check_observation(
    prediction: Any, target: Any, jacobians: Any, params: Sequence[Tensor], batched: bool, rows: int | None = None
) -> None:
    """Refuse a closure result whose shapes do not fit the parameters; the message names the expected and given shape.

    Args:
        prediction: ``ŷ``, shape ``(m,)`` for one sample, ``(B, m)`` for a batch (``batched``).
        target: ``y``, the prediction's shape.
        jacobians: one block per parameter, ``(m, *param.shape)`` or factored (:mod:`loko_lightning.jacobians.blocks`);
            for a batch with a leading batch dimension (dense ``(B, m, *shape)``, factors ``(B, ...)``).
        params: the parameters, in the order of ``jacobians``.
        batched: whether the result is a batch.
        rows: the rows of ``H`` per sample (:meth:`~loko_lightning.observation.Observation.rows`); default ``m``.

    Raises:
        ValueError: ``Invalid <what>: expected shape ..., got ...``.
    """
    want = "(B, m) for a batch" if batched else "(m,)"
    if not isinstance(prediction, Tensor) or prediction.dim() != (2 if batched else 1):
        got = tuple(prediction.shape) if isinstance(prediction, Tensor) else type(prediction).__name__
        raise ValueError(f"Invalid prediction: expected shape {want}, got {got}")
    if batched and min(prediction.shape) < 1:
        got = tuple(prediction.shape)
        raise ValueError(f"Invalid prediction: expected shape (B, m) with B >= 1 and m >= 1, got {got}")
    shape = tuple(prediction.shape)
    if not isinstance(target, Tensor) or tuple(target.shape) != shape:
        got = tuple(target.shape) if isinstance(target, Tensor) else type(target).__name__
        raise ValueError(f"Invalid target: expected shape {shape} like the prediction, got {got}")
    if not target.is_floating_point():
        raise ValueError(
            f"Invalid target: dtype {target.dtype}; the target is a float vector like the prediction, e.g. "
            "F.one_hot(label, m).float() for a class label"
        )
    if not isinstance(jacobians, (list, tuple)) or len(jacobians) != len(params):
        got = len(jacobians) if isinstance(jacobians, (list, tuple)) else type(jacobians).__name__
        message = f"Invalid jacobians: expected {len(params)} (one per parameter), got {got}"
        frozen = sum(not p.requires_grad for p in params)
        if frozen and isinstance(jacobians, (list, tuple)):
            message += (
                f"; {frozen} of the optimizer's parameters have requires_grad=False, and jacobian() "
                "differentiates only parameters with requires_grad unless it is given params: give LoKO only the "
                "trainable ones ([p for p in model.parameters() if p.requires_grad]), or give jacobian() the "
                "optimizer's parameters"
            )
        raise ValueError(message)
    batch = shape[0] if batched else None
    m = shape[-1] if rows is None else rows
    for index, (jac, param) in enumerate(zip(jacobians, params, strict=True)):
        try:
            block = kind(jac)
        except TypeError:
            block = None
        if block is None or not block.fits(jac, m, param.shape, batch):
            expected = (*shape[:-1], m, *param.shape)
            got = block.describe(jac) if block is not None and batched else tuple(getattr(jac, "shape", ()))
            if block is None:
                got = type(jac).__name__
            of_batch = f" (a batch of {batch})" if batched else ""
            raise ValueError(f"Invalid jacobians[{index}]: expected shape {expected}{of_batch}, got {got}")


def layout_key(prediction: Any, target: Any, jacobians: Any, extra: tuple) -> tuple | None:
    """What a cached update plan depends on (``extra``: process noise, ...); ``None``: run the full checks."""
    if not isinstance(prediction, Tensor) or not isinstance(target, Tensor):
        return None
    try:
        blocks = tuple(kind(jac).layout_key(jac) for jac in jacobians)
    except TypeError:
        return None
    return prediction.shape, target.shape, blocks, extra


def stack_observations(
    prediction: Tensor, target: Tensor, jacobians: Sequence[JacobianBlock], rows: int | None = None
) -> tuple[Tensor, Tensor, list[JacobianBlock]]:
    """The stacked observation of a batch: ``ŷ`` and ``y`` of ``B·m`` entries and the blocks of ``H`` (``B·m`` rows).

    Sample ``b``'s outputs are rows ``b·m … b·m + m - 1``. For ``B = 1`` the result is the sample's own prediction,
    target and blocks (views, no arithmetic), so a batch of one is the single-sample step bit for bit.

    Args:
        prediction: ``(B, m)``.
        target: ``(B, m)``.
        jacobians: batched blocks (see :func:`check_observation`).
        rows: the rows of each sample's blocks; default ``m``.

    Returns:
        ``(prediction, target, jacobians)`` as the single-observation update takes them, with ``B·m`` outputs.
    """
    batch, m = prediction.shape
    if batch == 1:
        return prediction[0], target[0], [kind(jac).sample(jac, 0) for jac in jacobians]
    blocks = [kind(jac).stack_rows(jac, batch, m if rows is None else rows) for jac in jacobians]
    return prediction.reshape(-1), target.reshape(-1), blocks
