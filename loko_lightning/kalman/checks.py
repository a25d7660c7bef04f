"""The checks ``LoKO.step`` runs on what its closure returns: shapes, probability vectors, the layout key."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from loko_lightning.jacobians.blocks import FactoredJacobian, OuterJacobian, block_key


def check_shapes(prediction: Any, target: Any, jacobians: Any, params: list[Tensor]) -> None:
    """Refuse a closure result whose shapes do not fit the parameters."""
    if not isinstance(prediction, Tensor) or prediction.dim() != 1:
        got = tuple(prediction.shape) if isinstance(prediction, Tensor) else type(prediction).__name__
        raise ValueError(f"Invalid prediction: expected shape (m,), got {got}")
    m = prediction.shape[0]
    if not isinstance(target, Tensor) or tuple(target.shape) != (m,):
        got = tuple(target.shape) if isinstance(target, Tensor) else type(target).__name__
        raise ValueError(f"Invalid target: expected shape ({m},) like the prediction, got {got}")
    if len(jacobians) != len(params):
        message = f"Invalid jacobians: expected {len(params)} (one per parameter), got {len(jacobians)}"
        frozen = sum(not p.requires_grad for p in params)
        if frozen:
            message += (
                f"; {frozen} of the optimizer's parameters have requires_grad=False, and jacobian() "
                "differentiates only parameters with requires_grad unless it is given params: give LoKO only the "
                "trainable ones ([p for p in model.parameters() if p.requires_grad]), or give jacobian() the "
                "optimizer's parameters"
            )
        raise ValueError(message)
    for index, (jac, param) in enumerate(zip(jacobians, params, strict=True)):
        expected = (m, *param.shape)
        if isinstance(jac, OuterJacobian):
            ok = jac.left.dim() == 2 and jac.right.dim() == 1 and tuple(jac.shape) == expected
        elif isinstance(jac, FactoredJacobian):
            ok = (
                tuple(jac.shape) == expected
                and param.dim() >= 1
                and jac.left.dim() == 3
                and jac.right.dim() == 2
                and jac.left.shape[:2] == (m, param.shape[0])
                and jac.right.shape == (param[0].numel(), jac.left.shape[2])
            )
        else:
            ok = isinstance(jac, Tensor) and tuple(jac.shape) == expected
        if not ok:
            got = tuple(jac.shape) if hasattr(jac, "shape") else type(jac).__name__
            raise ValueError(f"Invalid jacobians[{index}]: expected shape {expected}, got {got}")


def layout_key(prediction: Any, target: Any, jacobians: Any, extra: tuple) -> tuple | None:
    """What the cached plan depends on (``extra``: process noise, samples stacked); ``None``: run the full checks."""
    if not isinstance(prediction, Tensor) or not isinstance(target, Tensor):
        return None
    try:
        blocks = tuple(map(block_key, jacobians))
    except TypeError:
        return None
    return prediction.shape, target.shape, blocks, extra


def check_probabilities(prediction: Tensor, target: Tensor) -> None:
    """Refuse predictions (``(B, m)``) that are not probability vectors when the targets are (one host read)."""
    m = prediction.shape[-1]
    if m == 0:
        return
    target_sums, prediction_sums = target.sum(-1), prediction.sum(-1)
    target_sum = target_sums[(target_sums - 1).abs().argmax()]
    prediction_sum = prediction_sums[(prediction_sums - 1).abs().argmax()]
    stats = torch.stack([v.double() for v in (target.min(), target_sum, prediction.min(), prediction_sum)])
    stats = stats.tolist()
    target_min, target_sum, prediction_min, prediction_sum = stats
    if not all(math.isfinite(v) for v in stats):
        return  # the step is skipped on the device
    # Softmax sums to 1 up to ~m roundings; 10 m eps of each dtype is far from the sum of any logits by chance.
    target_tol = 10 * m * torch.finfo(target.dtype).eps
    tol = 10 * m * torch.finfo(prediction.dtype).eps
    target_is_probability = target_min >= 0.0 and abs(target_sum - 1.0) <= target_tol
    if target_is_probability and (prediction_min < 0.0 or abs(prediction_sum - 1.0) > tol):
        raise ValueError(
            "Invalid prediction: the target is a probability vector (e.g. one-hot) but the prediction is not "
            f"(smallest entry {prediction_min:.4g}, sum {prediction_sum:.6g}): LoKO observes class probabilities, so "
            'compute the prediction with jacobian(..., output="softmax") (the default), not logits; for a '
            'regression on such targets, create the optimizer with LoKO(..., observation="regression")'
        )
