r"""The average of the filter's mean that predicts (not the paper's), in the spirit of ``torch.optim.swa_utils``.

After every *applied* step :math:`\bar\theta \leftarrow \bar\theta + (1 - \delta_k)(\theta - \bar\theta)` with the
warm-up :math:`\delta_k = \min(\delta, (1 + k)/(10 + k))` after ``k`` applied steps (TensorFlow's
``ExponentialMovingAverage``): early in the stream :math:`\bar\theta` is not held back by :math:`\theta_0`
(:math:`\delta = 0.99` from ``k = 890`` on). A skipped step moves nothing: :math:`\theta` did not move, so neither
does its average. The filter's own recursion never reads :math:`\bar\theta`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from loko_lightning.errors import ConfigError
from loko_lightning.kalman.time_update import real_number

__all__ = ["MeanAverage"]


class MeanAverage:
    """The exponential average ``θ̄`` of the parameters, one tensor per parameter kept by the caller (its state).

    Args:
        decay: ``δ`` in ``(0, 1)``.
    """

    #: The per-parameter state key of ``θ̄``.
    key = "average"

    def __init__(self, decay: float) -> None:
        self.decay = float(decay)
        self._saved: list[Tensor] = []  # the parameters' values while the averages are swapped in
        self._swapped = False  # inside swapped_in

    @staticmethod
    def check(decay: object, owner: type | None = None) -> float:
        """``decay`` as a float, or a :class:`~loko_lightning.errors.ConfigError` naming ``average``."""
        if real_number(decay) and 0.0 <= decay < 1.0:
            return float(decay)
        message = (
            f"Invalid average: {decay!r} (the decay of the average of the filter's mean that predicts, in [0, 1); 0 "
            "predicts with the mean itself, the paper; e.g. 0.999)"
        )
        raise ConfigError(message, field="average", owner=owner)

    @staticmethod
    def start(param: Tensor) -> Tensor:
        """``θ̄₀ = θ₀``."""
        return param.detach().clone()

    @torch.no_grad()
    def update(self, averages: Sequence[Tensor], params: Sequence[Tensor], step: Tensor, applied: Tensor) -> None:
        """One step of the average, in place; ``step`` counts the applied steps *after* this one (``k``).

        The weight is 0 where the step was not applied (decided on the device: no host read).
        """
        k = step.to(torch.float64)
        weight = 1.0 - torch.clamp((1.0 + k) / (10.0 + k), max=self.decay)
        weight = torch.where(applied, weight, 0.0)
        cast = {dtype: weight.to(dtype) for dtype in {a.dtype for a in averages}}  # one cast a dtype, not a parameter
        torch._foreach_lerp_(list(averages), list(params), [cast[a.dtype] for a in averages])

    @contextlib.contextmanager
    def swapped_in(self, params: Sequence[Tensor], averages: Sequence[Tensor]) -> Iterator[None]:
        """Inside, ``params`` hold ``averages``; after, their own values again, exactly (copied back).

        Their values wait in tensors this keeps from one call to the next (one copy each, no new tensor a call; new
        ones inside another swap).
        """
        saved = self._saved
        if self._swapped or not _alike(saved, params):
            saved = [torch.empty_like(p, memory_format=torch.contiguous_format) for p in params]
            if not self._swapped:
                self._saved = saved
        outer, self._swapped = self._swapped, True
        with torch.no_grad():
            torch._foreach_copy_(saved, list(params))
            torch._foreach_copy_(list(params), list(averages))
        try:
            yield
        finally:
            self._swapped = outer
            with torch.no_grad():
                torch._foreach_copy_(list(params), saved)


def _alike(tensors: Sequence[Tensor], others: Sequence[Tensor]) -> bool:
    """As many tensors, each of the other's shape, dtype and device."""
    return len(tensors) == len(others) and all(
        a.shape == b.shape and a.dtype == b.dtype and a.device == b.device for a, b in zip(tensors, others, strict=True)
    )
