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
        torch._foreach_lerp_(list(averages), list(params), [weight.to(a.dtype) for a in averages])

    @staticmethod
    @contextlib.contextmanager
    def swapped_in(params: Sequence[Tensor], averages: Sequence[Tensor]) -> Iterator[None]:
        """Inside, ``params`` hold ``averages``; after, their own values again, exactly (copied back)."""
        saved = [p.detach().clone() for p in params]
        with torch.no_grad():
            torch._foreach_copy_(list(params), list(averages))
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(list(params), saved)
