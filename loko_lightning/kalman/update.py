r"""One LoKO step on plain tensors: the functional entry, for a training loop that keeps its own state.

:class:`~loko_lightning.LoKO` is the same step with the state kept for you (and a plan reused across steps);
:func:`loko_update` builds the layout's plan on every call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from loko_lightning.jacobians.blocks import JacobianBlock
from loko_lightning.kalman.filters import Belief, Evidence, Filter, get_filter
from loko_lightning.kalman.plan import UpdatePlan
from loko_lightning.kalman.time_update import TimeUpdate

__all__ = ["loko_update"]


@torch.inference_mode()
def loko_update(
    params: Sequence[Tensor],
    jacobians: Sequence[JacobianBlock],
    state: dict[str, Tensor | Sequence[Tensor]],
    prediction: Tensor,
    target: Tensor,
    *,
    filter: Filter | str = "covariance",  # noqa: A002 (the paper's word)
    time_update: TimeUpdate | None = None,
    samples: int = 1,
) -> dict[str, Tensor]:
    r"""One step of a filter (default: the paper's Algorithm 1, :mod:`~loko_lightning.kalman.filters.covariance`).

    :func:`loko_lightning.kalman.reference.loko_step_reference` is the same step with dense matrices. The arithmetic
    runs in the dtype of ``state["cov"]``; parameters are updated in their own dtype. If anything is non-finite
    (prediction, target, a Jacobian, the innovation or the resulting update), nothing is written: parameters and
    state keep their values and ``diagnostics["applied"]`` is ``False``. The decision is made on the device with
    :func:`torch.where`, so no host sync is needed.

    It runs under :func:`torch.inference_mode`, so the returned diagnostics are inference tensors: read or log them,
    do not use them in a computation that autograd records.

    Args:
        params: trainable parameters ``θ̃``, updated in place.
        jacobians: per-parameter Jacobians of ``ŷ``: dense ``(m, *shape)``, :class:`OuterJacobian` or
            :class:`FactoredJacobian` (the rows :attr:`LoKO.observation <loko_lightning.LoKO>` asks for).
        state: the filter state, updated in place: ``"cov"``, the per-parameter ``p̂`` (their dtype is the
            arithmetic's); ``"R"``, the ``m x m`` observation noise (the covariance filter); ``"step"``, the 0-d
            integer count of applied updates; and the filter's own per-entry states
            (:meth:`~loko_lightning.kalman.filters.Filter.entries`, e.g. LoFi's ``"W"``, the per-parameter
            ``(numel, L)`` low-rank factors).
        prediction: ``ŷ``, shape ``(m,)`` (``B·m`` stacked for a joint step).
        target: ``y``, like ``prediction``.
        filter: a :class:`~loko_lightning.kalman.filters.Filter` or its name (the covariance filter by name has the
            paper's ``beta`` 0.95 and Taylor ``R``; pass ``Covariance(beta=..., r_estimator=...)`` for others).
        time_update: the process model, one for every parameter (default: the paper's identity model).
        samples: ``B`` when ``prediction``, ``target`` and the blocks stack ``B`` samples' observations
            (:func:`loko_lightning.kalman.multistream.stack_observations`): one joint update.

    Returns:
        Diagnostics as 0-d tensors: ``applied``, ``innovation_norm``, ``cond`` (of ``S``'s kept spectrum; NaN without
        ``S``), ``p_mean``, ``p_min``, ``p_max`` and ``gain_norm``.
    """
    filter = get_filter(filter)  # noqa: A001
    covs = list(state["cov"])
    updates = [time_update or TimeUpdate()] * len(params)
    plan = UpdatePlan(jacobians, [p.shape for p in params], covs[0].dtype, covs[0].device, samples, updates)
    flat = plan.flatten(covs)
    missing = [key for key in filter.entries() if key not in state]
    if missing:
        raise ValueError(
            f"Invalid state: filter {filter.spec!r} keeps {', '.join(missing)} per parameter (Filter.entries): give "
            f"state[{missing[0]!r}], zeros at first"
        )
    entries = {key: _flatten(plan, state[key], columns) for key, columns in filter.entries().items()}
    belief = Belief(flat, state.get("R"), state["step"], entries=entries)
    proposal = filter.propose(plan, Evidence(prediction, target, jacobians), belief)
    applied = plan.apply(params, flat, proposal.posterior, proposal.finite)
    filter.commit(proposal, applied, belief)
    state["step"].add_(applied.to(state["step"].dtype))
    torch._foreach_copy_(covs, plan.views(flat))
    for key, columns in filter.entries().items():
        _scatter(plan, entries[key], state[key], columns)
    cond = proposal.cond
    if cond is None:  # no system solved (the information forms)
        cond = torch.full((), float("nan"), dtype=plan.dtype, device=plan.device)
    diagnostics = {"applied": applied, "innovation_norm": torch.linalg.vector_norm(proposal.innovation), "cond": cond}
    return {**diagnostics, **plan.statistics(flat)}


def _flatten(plan: UpdatePlan, blocks: Sequence[Tensor], columns: int) -> Tensor:
    """A filter's per-entry state, per parameter, as one flat tensor in the plan's order."""
    return plan.flatten_rows(blocks) if columns else plan.flatten(blocks)


def _scatter(plan: UpdatePlan, flat: Tensor, blocks: Sequence[Tensor], columns: int) -> None:
    """Copy a flat per-entry state back into its per-parameter tensors."""
    if columns:
        plan.scatter_rows(flat, blocks)
    else:
        torch._foreach_copy_(list(blocks), plan.views(flat))
