"""What every filter offers: propose the change of the belief from one stacked observation, then commit it.

A filter is how the belief over the trainable parameters is updated (the paper's covariance form, the information
form, a low-rank plus diagonal precision); the observation (:mod:`loko_lightning.observation`) is what is observed.
The optimizer runs one pipeline for every filter: it stacks the step's observations, builds the layout's
:class:`~loko_lightning.kalman.plan.UpdatePlan`, asks the filter for a :class:`Proposal`, applies the proposed mean
and ``p̂`` (:meth:`UpdatePlan.apply`, or the sharded exchange's all-gather) and lets the filter :meth:`Filter.commit`
its own state (``R``, ``W``, ``Σ``) under the same decision.

A filter owns its state besides ``p̂``: it declares the per-entry tensors it keeps (:meth:`Filter.entries`, e.g.
LoFi's ``W``: the optimizer keeps them flat in the plan's order, zeros at first, and hands them over in
:attr:`Belief.entries`), creates its per-parameter state when a parameter joins (:meth:`Filter.init_param`, e.g. the
shared rows' ``Σ``), names every key it keeps (:meth:`Filter.state_keys`) and checks a saved one
(:meth:`Filter.check_param`). Its settings are its dataclass fields (:meth:`Filter.config`), so a checkpoint rebuilds
the very filter that was fitted (:func:`~loko_lightning.kalman.filters.get_filter` takes that config back).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from loko_lightning.jacobians.blocks import JacobianBlock
from loko_lightning.kalman.plan import UpdatePlan
from loko_lightning.kalman.shared_rows import Downdate
from loko_lightning.kalman.state import check_block
from loko_lightning.observation import Observation

__all__ = ["Belief", "Evidence", "Filter", "Proposal", "Reduce"]


#: A sum over the parameters made whole: the sharded update's all-reduce of its shard's part.
Reduce = Callable[[Tensor], Tensor]


@dataclass
class Evidence:
    """What a step saw, stacked over its ``B`` samples: what the exchange gathers and the filter reads.

    Attributes:
        prediction: ``ŷ``, ``(B·m,)`` (``B`` times the observed coordinates; one sample: its own ``(m,)``).
        target: ``y``, like ``prediction``.
        blocks: one Jacobian block per parameter this process updates, with the stacked rows of ``H``.
        aggregation: ``(A, G)`` when the observation is an aggregation of the outputs (top-k).
        samples: ``B``, the samples stacked.
        owned: the indices of the parameters this process updates, in parameter order.
        layout: what else the update plan depends on (the processes' counts for a sharded step).
        shards: the owners of the parameters (sharded steps only: a
            :class:`~loko_lightning.kalman.sharded.ShardPlan`).
        returned: what :meth:`~loko_lightning.LoKO.step` returns (``None``: what the closure returned).
    """

    prediction: Tensor
    target: Tensor
    blocks: Sequence[JacobianBlock]
    aggregation: tuple[Tensor, Tensor] | None = None
    samples: int = 1
    owned: Sequence[int] = ()
    layout: tuple = ()
    shards: Any = None
    returned: Any = None


@dataclass
class Belief:
    """The filter state a step reads, flat in the plan's order where it is per entry.

    Attributes:
        cov: ``p̂`` (the diagonal of the covariance, or of the inverse of the diagonal precision), ``(n,)``.
        R: the observation noise ``R_{k-1}`` (``m x m``), for filters that estimate it.
        step: the number of updates applied so far (0-d integer tensor).
        shared_rows: the full covariance ``Σ`` shared by the rows of each parameter of :attr:`UpdatePlan.rows`
            (in its order), for the filters that keep them.
        entries: the filter's own per-entry state (:meth:`Filter.entries`) by key, flat in the plan's order:
            ``(n,)`` or ``(n, columns)`` (LoFi's low-rank factor ``W``, ``(n, L)``).
    """

    cov: Tensor
    R: Tensor | None
    step: Tensor
    shared_rows: Sequence[Tensor] = ()
    entries: Mapping[str, Tensor] = field(default_factory=dict)
    hpht: Tensor | None = None


@dataclass
class Proposal:
    """What a filter proposes for a step; nothing is written until it is applied.

    The proposed change of the parameters is in the plan's work vector :attr:`UpdatePlan.update`.

    Attributes:
        posterior: ``p̂`` of the next step's prior (after the time update and the floor), flat.
        finite: whether the step's inputs are finite (0-d bool on the device).
        innovation: ``e = y − ŷ`` (stacked).
        R: the new observation noise ``R_k``, for filters that estimate it.
        cond: the condition number of the solved system's kept spectrum (``None`` where none is solved).
        shared_rows: the new ``Σ`` of each parameter of :attr:`UpdatePlan.rows` (or its
            :class:`~loko_lightning.kalman.shared_rows.Downdate`, committed in place).
        entries: the new values of the filter's own per-entry state, by key (written by :meth:`Filter.commit`).
        hpht: ``H P Hᵀ`` at the step's prior, the covariance of the prediction under the belief (stacked), where the
            filter forms it (the covariance filter); what :mod:`~loko_lightning.kalman.predictive` averages over. It
            is the belief before the sample: a prior scale set from the sample's innovation is not in it.
    """

    posterior: Tensor
    finite: Tensor
    innovation: Tensor
    R: Tensor | None = None
    cond: Tensor | None = None
    shared_rows: Sequence[Tensor | Downdate] = ()
    entries: Mapping[str, Tensor] = field(default_factory=dict)
    hpht: Tensor | None = None


class Filter:
    """A filter family: the belief it keeps and how one observation updates it.

    The families are frozen dataclasses (their settings are their fields: equal settings, equal filters).

    Attributes:
        name: the family's name in :data:`~loko_lightning.kalman.filters.FILTERS`.
        shardable: the update separates over the parameters but for sums the processes can all-reduce
            (``LoKO(shard=True)``).
        estimates_noise: ``R`` is part of the filter state (an EMA), so the optimizer keeps it.
        shares_rows: the filter updates a full covariance shared by a weight's rows (the param group key
            ``shared_rows``, :class:`~loko_lightning.kalman.algebra.SharedRowBlocks`).
    """

    name: ClassVar[str]
    shardable: ClassVar[bool] = True
    estimates_noise: ClassVar[bool] = False
    shares_rows: ClassVar[bool] = False

    @property
    def spec(self) -> str:
        """The name :func:`~loko_lightning.kalman.filters.get_filter` turns back into this filter."""
        return self.name

    def observation_for(self, observation: Observation) -> Observation:
        """The observation whose rows of ``H`` the Jacobian engine computes for this filter (default: as given).

        Raises:
            ConfigError: an observation this filter cannot update on (``field="observation"``).
        """
        return observation

    def r_estimators(self, observation: Observation) -> tuple[str, ...]:
        """The observation-noise estimators that apply with ``observation``; the first is the default."""
        return observation.r_estimators

    def config(self) -> dict[str, Any]:
        """The filter as :func:`~loko_lightning.kalman.filters.get_filter` rebuilds it.

        ``{"name": spec}`` and, for a registered family, its settings (its dataclass fields, e.g. the covariance
        filter's ``beta``).
        """
        settings = {f.name: getattr(self, f.name) for f in fields(self)} if is_dataclass(self) else {}
        return {"name": self.spec, **settings}

    def entries(self) -> dict[str, int]:
        """The filter's own per-entry state besides ``p̂``: key → columns.

        0 columns: one value per entry, shaped like the parameter; ``L``: a ``(numel, L)`` block. The optimizer
        creates them as zeros in ``p̂``'s dtype, keeps them flat in the plan's order (:attr:`Belief.entries`) and
        saves them; :meth:`commit` writes them.
        """
        return {}

    def init_param(self, param: Tensor, cov: Tensor, group: Mapping[str, Any]) -> dict[str, Tensor]:
        """The filter's own per-parameter state (besides its :meth:`entries`) when ``param`` joins.

        ``cov`` is its ``p̂₀`` (which the filter may adjust in place), ``group`` its param group.
        """
        return {}

    def state_keys(self) -> frozenset[str]:
        """Every per-parameter key of the filter's own state (its :meth:`entries` and what :meth:`init_param` makes)."""
        return frozenset(self.entries())

    def check_param(self, index: int, param: Tensor, state: Mapping[str, Any]) -> None:
        """Refuse a saved per-parameter state of the wrong shape (``ValueError`` naming the parameter's index)."""
        for key, columns in self.entries().items():
            if key in state:
                shape = (param.numel(), columns) if columns else tuple(param.shape)
                check_block(index, f"{key!r} ({self.spec})", state[key], shape)

    def propose(self, plan: UpdatePlan, evidence: Evidence, belief: Belief, reduce: Reduce | None = None) -> Proposal:
        """The change of the belief for the step's stacked observation.

        Args:
            plan: the layout's plan; the proposed change of the parameters goes into :attr:`UpdatePlan.update`.
            evidence: the observation, stacked over the step's samples.
            belief: the state before the step (read, never written).
            reduce: applied to sums over the parameters before they are used (the sharded update's all-reduce).
        """
        raise NotImplementedError

    def commit(self, proposal: Proposal, applied: Tensor, belief: Belief) -> None:
        """Write the filter's own state where the step was applied (the optimizer writes θ̃, p̂).

        By default: every one of its :meth:`entries` that the proposal holds.
        """
        for key, value in proposal.entries.items():
            old = belief.entries[key]
            torch.where(applied, value, old, out=old)
