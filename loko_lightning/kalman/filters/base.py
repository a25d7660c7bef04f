"""What every filter offers: propose the change of the belief from one stacked observation, then commit it.

A filter is how the belief over the trainable parameters is updated (the paper's covariance form, the information
form, a low-rank plus diagonal precision); the observation (:mod:`loko_lightning.observation`) is what is observed.
The optimizer runs one pipeline for every filter: it stacks the step's observations, builds the layout's
:class:`~loko_lightning.kalman.plan.UpdatePlan`, asks the filter for a :class:`Proposal`, applies the proposed mean
and ``p̂`` (:meth:`UpdatePlan.apply`, or the sharded exchange's all-gather) and lets the filter :meth:`Filter.commit`
its own state (``R``, ``W``) under the same decision.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from loko_lightning.jacobians.blocks import JacobianBlock
from loko_lightning.kalman.plan import UpdatePlan
from loko_lightning.observation import Observation

__all__ = ["Belief", "Evidence", "Filter", "Proposal", "Reduce"]


#: A sum over the parameters made whole: the sharded update's all-reduce of its shard's part.
Reduce = Callable[[Tensor], Tensor]


@dataclass
class Evidence:
    """A step's observation as a filter reads it, stacked over the step's ``B`` samples.

    Attributes:
        prediction: ``ŷ``, ``(B·m,)`` (``B`` times the observed coordinates).
        target: ``y``, like ``prediction``.
        blocks: one Jacobian block per parameter of the plan, with the stacked rows of ``H``.
        aggregation: ``(A, G)`` when the observation is an aggregation of the outputs (top-k).
    """

    prediction: Tensor
    target: Tensor
    blocks: Sequence[JacobianBlock]
    aggregation: tuple[Tensor, Tensor] | None = None


@dataclass
class Belief:
    """The filter state a step reads, flat in the plan's order where it is per entry.

    Attributes:
        cov: ``p̂`` (the diagonal of the covariance, or of the inverse of the diagonal precision), ``(n,)``.
        R: the observation noise ``R_{k-1}`` (``m x m``), for filters that estimate it.
        step: the number of updates applied so far (0-d integer tensor).
        low_rank: the low-rank factor ``W`` of the precision, ``(n, L)``, for the filters that keep one.
        shared_rows: the full covariance ``Σ`` shared by the rows of each parameter of :attr:`UpdatePlan.rows`
            (in its order), for the filters that keep them.
    """

    cov: Tensor
    R: Tensor | None
    step: Tensor
    low_rank: Tensor | None = None
    shared_rows: Sequence[Tensor] = ()


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
        low_rank: the new ``W``, for filters that keep one.
        shared_rows: the new ``Σ`` of each parameter of :attr:`UpdatePlan.rows`.
    """

    posterior: Tensor
    finite: Tensor
    innovation: Tensor
    R: Tensor | None = None
    cond: Tensor | None = None
    low_rank: Tensor | None = None
    shared_rows: Sequence[Tensor] = ()


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

    def observe(self, observation: Observation) -> Observation:
        """The observation whose rows of ``H`` the Jacobian engine computes for this filter (default: as given).

        Raises:
            ConfigError: an observation this filter cannot update on (``field="observation"``).
        """
        return observation

    def r_estimators(self, observation: Observation) -> tuple[str, ...]:
        """The observation-noise estimators that apply with ``observation``; the first is the default."""
        return observation.r_estimators

    def low_rank(self) -> int:
        """The columns of the low-rank factor ``W`` the filter keeps per parameter (0: none)."""
        return 0

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
        """Write the filter's own state (``R``, ``W``) where the step was applied (the optimizer writes θ̃, p̂)."""
