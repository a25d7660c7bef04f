"""What LoKO refuses before it updates.

A closure that returns the wrong thing, and predictions that do not fit the observation (logits where probabilities
belong), checked on the device between host reads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from loko_lightning.errors import ConfigError
from loko_lightning.kalman.multistream import check_observation
from loko_lightning.kalman.time_update import real_number
from loko_lightning.observation import Observation

__all__ = [
    "CHECK_EVERY",
    "ObservationCheck",
    "check_closure",
    "check_closure_result",
    "check_options",
]

# Steps between the host reads of the observation's check after a layout's first step (that one reads at once): the
# window starts at 1 and doubles after each clean read up to this many, so a prediction that goes wrong right after
# the first step (probabilities, then logits) is refused on its own step, and a long run reads once in CHECK_EVERY.
CHECK_EVERY = 100


def check_closure(closure: Any) -> None:
    """Refuse a step without a closure, saying what it must return (and how a LightningModule passes one)."""
    if closure is None:
        raise ValueError(
            "LoKO.step needs a closure returning (prediction, target, jacobians), e.g. def closure(): prediction, "
            "jacobians = loko_lightning.jacobian(model, x); return prediction, target, jacobians. In a "
            "LightningModule: set self.automatic_optimization = False and call self.optimizers().step(closure) in "
            "training_step"
        )


def check_closure_result(result: Any) -> tuple[Any, Any, Any]:
    """``(prediction, target, jacobians)`` from what a closure returned, or a ``ValueError`` saying what to return."""
    if result is None:
        raise ValueError(
            "Invalid closure result: None. LoKO.step needs a closure returning (prediction, target, jacobians) "
            "(see loko_lightning.jacobian); in a LightningModule, self.optimizers().step() without a closure "
            "passes an empty one: call self.optimizers().step(closure) in training_step"
        )
    if isinstance(result, Tensor):
        raise ValueError(
            "Invalid closure result: a tensor (a loss?), but LoKO's closure returns (prediction, target, "
            "jacobians) (see loko_lightning.jacobian), not a loss. In a LightningModule this is Lightning's "
            "automatic optimization calling step(): set self.automatic_optimization = False and call "
            "self.optimizers().step(closure) in training_step"
        )
    if not isinstance(result, (tuple, list)) or len(result) != 3:
        got = f"{len(result)} items" if isinstance(result, (tuple, list)) else type(result)
        raise ValueError(f"Invalid closure result: expected a tuple (prediction, target, jacobians), got {got}")
    return result[0], result[1], result[2]


class ObservationCheck:
    """The observation's check of a layout's later steps, without a host read on every step.

    A failing step is skipped (its prediction made non-finite) and counted on the device; every :data:`CHECK_EVERY`
    steps the count is read, and a failure raises then; right after a layout's first step (:meth:`restart`) the reads
    come sooner (after 1, 2, 4, ... steps). Probabilities on one step and logits on the next have the same layout, so
    the first-step check alone would miss them; this way the step stays free of host reads and nothing wrong is ever
    applied.
    """

    def __init__(self, observation: Observation) -> None:
        self.observation = observation
        self.restart()

    def restart(self) -> None:
        """A new layout (its first step was checked on the host): read after 1, 2, 4, ... steps again."""
        self._window, self._unchecked, self._violations = 1, 0, None

    def __call__(
        self,
        prediction: Tensor,
        target: Tensor,
        blocks: Sequence[Any],
        params: Sequence[Tensor],
        samples: int,
        rows: int | None,
        first: bool,
    ) -> Tensor:
        """``prediction``, made non-finite where the step fails the check (so that it is skipped).

        On a layout's ``first`` step the blocks' shapes and the observation are checked on the host (a failure raises
        at once, :func:`~loko_lightning.kalman.multistream.check_observation`); later, on the device.
        """
        if first:
            check_observation(prediction, target, blocks, params, batched=False, rows=rows and rows * samples)
            self.observation.check(prediction.detach().view(samples, -1), target.detach().view(samples, -1))
            self.restart()
            return prediction
        view = (prediction.detach().view(samples, -1), target.detach().view(samples, -1))
        bad = self.observation.violation(*view)
        if bad is None:
            return prediction
        self._violations = bad.long() if self._violations is None else self._violations + bad.long()
        self._unchecked += 1
        if self._unchecked >= self._window:
            window = self._unchecked
            count, self._unchecked, self._violations = int(self._violations), 0, None
            self._window = min(2 * window, CHECK_EVERY)
            if count:
                try:
                    self.observation.check(*view)  # the message of the check, if this step fails it too
                except ValueError as err:
                    message = f"{err} ({count} of the last {window} steps failed it and were skipped)"
                    raise ValueError(message) from None
                raise ValueError(
                    f"Invalid prediction on {count} of the last {window} steps (skipped): it did not fit the "
                    f"{self.observation.name!r} observation (for class probabilities: a probability vector where "
                    "the target is one; were logits passed where probabilities belong?)"
                )
        return torch.where(bad, torch.full_like(prediction, math.nan), prediction)


def check_options(
    dtype: Any,
    shard: Any,
    filter: Any,
    collective_timeout: Any,
    owner: type | None = None,  # noqa: A002
) -> None:
    """Refuse LoKO's options outside their range, naming the field.

    The arithmetic ``dtype``, ``shard`` (and a filter it cannot split) and ``collective_timeout``.
    """
    if dtype not in (None, torch.float32, torch.float64):
        raise ConfigError(
            f"Invalid dtype: {dtype} (expected torch.float32, torch.float64 or None)", field="dtype", owner=owner
        )
    if not isinstance(shard, bool):
        raise ConfigError(f"Invalid shard: {shard!r} (must be true or false)", field="shard", owner=owner)
    if shard and not filter.shardable:
        raise ConfigError(
            f"Invalid shard: filter {filter.spec!r} (a low-rank precision) couples every parameter "
            "through its factor W, which the sharded update does not split: use shard=False",
            field="shard",
            owner=owner,
        )
    timeout_ok = real_number(collective_timeout) and 0 < collective_timeout < math.inf
    if collective_timeout is not None and not timeout_ok:
        raise ConfigError(
            f"Invalid collective_timeout: {collective_timeout!r} (a finite number of seconds > 0, or None)",
            field="collective_timeout",
            owner=owner,
        )
