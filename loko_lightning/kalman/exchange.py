"""Where a step's observations come from and where its update goes: the one strategy that differs between processes.

:class:`~loko_lightning.LoKO` runs one step pipeline (stack, check, plan, the filter's proposal, apply, commit); the
exchange is the part that depends on how the processes share the work:

- :class:`Replicated`: this process holds every observation of the step (one process, or the learner's all-gather
  under DDP) and every parameter; it updates everything itself.
- :class:`Sharded`: each process holds its own samples and owns a shard of the parameters
  (:mod:`loko_lightning.kalman.sharded`): the blocks are exchanged by all-to-all, ``H P Hᵀ`` is summed by an
  all-reduce and the new parameters are all-gathered.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

import torch.distributed as dist
from torch import Tensor

from loko_lightning.jacobians.blocks import kind
from loko_lightning.kalman.distributed import all_gather_observations
from loko_lightning.kalman.filters.base import Evidence, Proposal
from loko_lightning.kalman.multistream import check_observation, stack_observations
from loko_lightning.kalman.plan import UpdatePlan
from loko_lightning.kalman.sharded import (
    InvalidElsewhere,
    ShardPlan,
    agree_and_apply,
    exchange_shards,
    gather_shards,
    sum_symmetric,
)

__all__ = ["Exchange", "Replicated", "Sharded"]


class Replicated:
    """Every parameter is here, and every observation of the step once gathered: each process applies the same update.

    Args:
        processes: gather every process's observations first (under ``torch.distributed``; each process then holds
            the step's ``Σ_r B_r`` samples in rank order); ``False``: the closure's are the step's.
        timeout: seconds the gather may wait for the other processes (``None``: the group's own).
    """

    #: Sums over the parameters need no reduction.
    reduce: Callable[[Tensor], Tensor] | None = None

    def __init__(self, processes: bool = False, timeout: float | None = None) -> None:
        self.processes, self.timeout = processes, timeout

    def gather(
        self, prediction: Any, target: Any, jacobians: Any, params: Sequence[Tensor], rows: int | None
    ) -> Evidence:
        """The closure's result (every process's, gathered), a batch stacked into one observation.

        The gather comes before any check, so that every process checks the same observations and an invalid one
        stops every process at the same point (:mod:`~loko_lightning.kalman.multistream`).
        """
        returned = None
        if self.processes:
            if isinstance(prediction, Tensor) and prediction.dim() == 1:  # one sample: a batch of one
                prediction, target = prediction[None], target[None]
                jacobians = [kind(jac).stack([jac]) for jac in jacobians]
            prediction, target, jacobians = all_gather_observations(prediction, target, jacobians, timeout=self.timeout)
            returned = (prediction, target, jacobians)
        samples = 1
        if isinstance(prediction, Tensor) and prediction.dim() == 2:  # a batch: one stacked observation
            check_observation(prediction, target, jacobians, params, batched=True, rows=rows)
            samples = prediction.shape[0]
            prediction, target, jacobians = stack_observations(prediction, target, jacobians, rows)
        owned = list(range(len(params)))
        return Evidence(prediction, target, jacobians, samples=samples, owned=owned, returned=returned)

    def apply(self, plan: UpdatePlan, params: Sequence[Tensor], cov: Tensor, proposal: Proposal) -> dict[str, Tensor]:
        """:meth:`UpdatePlan.apply`: ``applied`` (the statistics of ``p̂`` are read later, from the plan)."""
        return {"applied": plan.apply(params, cov, proposal.posterior, proposal.finite)}


class Sharded:
    """Each process its own samples and its shard of the parameters (:mod:`loko_lightning.kalman.sharded`).

    Args:
        shards: the owners of the parameters, once a sharded step has chosen them (``None`` before).
        timeout: seconds each collective may wait for the other processes (``None``: the group's own).
    """

    def __init__(self, shards: ShardPlan | None, timeout: float | None) -> None:
        self.shards, self.timeout = shards, timeout
        self.rank = dist.get_rank()

    @staticmethod
    def adopt(state: MutableMapping[Tensor, dict], params: Sequence[Tensor], shards: ShardPlan) -> list[Any]:
        """The first sharded step: drop ``p̂`` of the others' parameters from ``state``; the dtypes of every ``p̂``.

        One arithmetic dtype on every process, the replicated update's (that of the first parameter's ``p̂``).
        """
        rank = dist.get_rank()
        dtypes = [state[p]["cov"].dtype for p in params]
        for index, param in enumerate(params):
            if shards.owners[index] != rank:
                state[param].pop("cov", None)
                if not state[param]:
                    del state[param]
        return dtypes

    def reduce(self, hpht: Tensor) -> Tensor:
        """The sum of every shard's ``H_r P_r H_rᵀ`` (one all-reduce of the lower triangle)."""
        return sum_symmetric(hpht, None, self.timeout)

    def gather(
        self, prediction: Any, target: Any, jacobians: Any, params: Sequence[Tensor], rows: int | None
    ) -> Evidence:
        """Every process's predictions and targets, and this process's shard of the blocks for all of them.

        This process's own observation is checked first; every process learns at the first exchange whether all
        were valid, so that an invalid one stops every process at the same point.
        """
        error = None
        try:
            if isinstance(prediction, Tensor) and prediction.dim() == 1:  # one sample: a batch of one
                check_observation(prediction, target, jacobians, params, batched=False, rows=rows)
                prediction, target = prediction[None], target[None]
                jacobians = [kind(jac).stack([jac]) for jac in jacobians]
            check_observation(prediction, target, jacobians, params, batched=True, rows=rows)
        except ValueError as err:
            error = err
        try:
            prediction, target, blocks, shards, counts = exchange_shards(
                None if error else prediction.detach(), None if error else target.detach(), jacobians, self.shards,
                timeout=self.timeout, slots=len(params), device=params[0].device,
            )  # fmt: skip
        except InvalidElsewhere:
            if error is not None:
                raise error from None
            raise
        self.shards = shards
        full = (prediction, target)
        stacked, goal, blocks = stack_observations(prediction, target, blocks, rows)
        layout = (tuple(counts.sizes), counts.positions)  # what every process learnt: all take the same branch
        return Evidence(stacked, goal, blocks, samples=prediction.shape[0], owned=shards.mine(self.rank),
                        layout=layout, shards=shards, returned=(*full, blocks))  # fmt: skip

    def apply(self, plan: UpdatePlan, params: Sequence[Tensor], cov: Tensor, proposal: Proposal) -> dict[str, Tensor]:
        """:func:`~loko_lightning.kalman.sharded.agree_and_apply`: applied everywhere or nowhere, with statistics."""
        return agree_and_apply(plan, params, self.shards, cov, proposal.posterior, proposal.finite,
                               timeout=self.timeout)  # fmt: skip


class Exchange:
    """A LoKO's exchange: which one each step uses, and what sharded steps leave behind.

    Sharded (:class:`Sharded`) with ``shard`` and several processes, else replicated (:class:`Replicated`). After the
    first sharded step each process keeps ``p̂`` of its own parameters only (:attr:`shards`); :meth:`consolidate`
    gathers every ``p̂`` back for a state dict (:meth:`saved`).

    Args:
        shard: split the update between the processes when there are several.
        timeout: seconds each collective may wait for the other processes (``None``: the group's own).
    """

    def __init__(self, shard: bool, timeout: float | None) -> None:
        self.shard, self.timeout = shard, timeout
        #: Under ``torch.distributed`` without ``shard``: the replicated step gathers every process's observations
        #: (:class:`Replicated`). Off by default, for a closure that gathers them itself
        #: (:func:`~loko_lightning.kalman.distributed.all_gather_observations`); the learner
        #: (:class:`~loko_lightning.OnlineClassifier`) turns it on under DDP.
        self.gather = False
        self.shards: ShardPlan | None = None  # the owners of the parameters once a sharded step has run
        self.dtypes: list[Any] = []  # p̂'s dtype per parameter when the shards were made
        self._consolidated: dict[int, Tensor] | None = None  # every p̂, gathered by consolidate

    def current(self) -> Replicated | Sharded:
        """The step's exchange (a sharded step makes an earlier :meth:`consolidate` stale)."""
        several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if self.shard and several:
            self._consolidated = None
            return Sharded(self.shards, self.timeout)
        return Replicated(self.gather and several, self.timeout)

    def adopt(self, state: MutableMapping[Tensor, dict], params: Sequence[Tensor], shards: ShardPlan) -> None:
        """The first sharded step (:meth:`Sharded.adopt`): keep ``p̂`` of this process's parameters only."""
        self.dtypes = Sharded.adopt(state, params, shards)
        self.shards = shards

    def consolidate(self, state: MutableMapping[Tensor, dict], params: Sequence[Tensor]) -> None:
        """Gather every process's shard of ``p̂`` (a collective; nothing to do before a sharded step)."""
        if self.shards is None:
            return
        covs = [state[p].get("cov") for p in params]
        shapes = [p.shape for p in params]
        gathered = gather_shards(covs, shapes, self.dtypes, self.shards, timeout=self.timeout)
        self._consolidated = dict(enumerate(gathered))

    def saved(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (torch's state dict) with every parameter's ``p̂``: the consolidated ones after sharded steps."""
        if self.shards is None:
            return state
        if self._consolidated is None:
            raise RuntimeError(
                "LoKO(shard=True) keeps p-hat of its own shard of the parameters only: call consolidate_state_dict() "
                "on every process first (Lightning's checkpointing does), then state_dict()"
            )
        # Torch's state dict holds the live per-parameter dicts: new ones, so that the optimizer's own are untouched.
        state["state"] = {index: dict(values) for index, values in state["state"].items()}
        for index, cov in self._consolidated.items():
            state["state"].setdefault(index, {})["cov"] = cov
        self._consolidated = None
        return state

    def reset(self) -> bool:
        """A whole state was loaded (every ``p̂`` is back): the next sharded step splits it again; was it split?"""
        split, self.shards, self._consolidated = self.shards is not None, None, None
        return split
