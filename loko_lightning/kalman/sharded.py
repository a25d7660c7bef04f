r"""Sharded joint LoKO updates: each process owns a shard of the parameters and computes only its part of the update.

Under data parallelism the replicated update (:mod:`loko_lightning.kalman.distributed`) gathers every process's
Jacobian factors on every process, ``(W - 1)·B·m·ñ`` numbers per step and process for dense blocks, and repeats the
whole update ``W`` times. Because ``P`` is diagonal, the update separates over the parameters except through ``S``.
With the columns of ``H`` split into shards ``H_r`` (the parameters process ``r`` owns, whole tensors) and ``P_r``,
``θ̃_r``, ``p̂_r`` the matching parts:

.. math::

    S &= \sum_r H_r P_r H_r^\top + R, \qquad
    (K e)_r = P_r H_r^\top S^{+} e, \qquad
    \operatorname{diag}(K H)_r = \hat p_r \odot \operatorname{diag}(H_r^\top S^{+} H_r)

so process ``r`` needs ``H_r`` for all ``W·B`` samples, not ``H``. A step (:func:`exchange_shards`, then the filter's
proposal with an all-reduce, then :func:`agree_and_apply`; :class:`~loko_lightning.kalman.exchange.Sharded` runs them
in :class:`~loko_lightning.LoKO`'s one step pipeline) runs four collectives:

1. an all-gather of the samples per process and of each factored block's positions (a few integers);
2. an all-gather of the predictions and targets, and all-to-alls in which process ``r`` sends process ``d`` the
   blocks of ``d``'s parameters for its own ``B`` samples, so each process receives ``H_r`` for all ``W·B`` samples
   (``1/W`` of the replicated all-gather's bytes when the shards are balanced);
3. an all-reduce (sum) of the shards' ``H_r P_r H_r^\top``, a symmetric ``W·B·m`` square matrix sent as its lower
   triangle (:func:`sum_symmetric`): every process then forms the same ``R_k``, ``S`` and ``S⁺`` and computes its
   shard's gain and ``p̂_r``;
4. an all-gather of each shard's new parameter values, with its finiteness check and the statistics of ``p̂``: a step
   that is not finite on one shard is skipped on all, and every process's copy of the adapters is current for the
   next forward pass (``ñ`` numbers in all).

Parameters and ``R`` stay identical on every process (the new parameter values are copied from their owner; the
all-reduce gives every process the same sum). Only the order of the summation in ``H P Hᵀ`` differs from the
replicated update (shard by shard instead of kind by kind, the upper triangle mirrored from the lower), so the two
agree to rounding: a relative perturbation
``δ`` of ``S`` (at most about ``ñ·eps`` of ``|H| P |H|ᵀ``) changes the update by at most about ``cond(S)·δ`` relative.
The diagonal information-form update (``filter: natural``) has no ``S``: each parameter's update depends on its
own columns only, and the sharded update is the replicated one bit for bit.

The owner of each parameter (:class:`ShardPlan`) is chosen at the first sharded step from the bytes each parameter's
blocks send per sample, largest first to the least-loaded process, and kept for the run; ``p̂`` of the others'
parameters is dropped then. :meth:`loko_lightning.LoKO.consolidate_state_dict` gathers it back for a checkpoint
(Lightning calls it on every process before it saves), so a checkpoint holds the whole filter state and resumes with
any number of processes, sharded or not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from loko_lightning.errors import ConfigError
from loko_lightning.jacobians.blocks import JacobianBlock, kind
from loko_lightning.kalman.distributed import Counts, all_gather, all_reduce, all_to_all, gather_counts, pad_positions
from loko_lightning.kalman.plan import UpdatePlan

__all__ = [
    "STATISTICS",
    "InvalidElsewhere",
    "ShardPlan",
    "agree_and_apply",
    "exchange_shards",
    "gather_shards",
    "sum_symmetric",
]

#: The statistics each shard sends with its new parameters (see agree_and_apply), one number each.
STATISTICS = ("finite", "check", "post_sum", "post_min", "post_max", "cov_sum", "cov_min", "cov_max", "gain_sq")


@dataclass(frozen=True)
class ShardPlan:
    """Which process owns each parameter (whole tensors), in parameter order.

    Attributes:
        owners: the rank owning each parameter.
        world: the number of processes.
    """

    owners: tuple[int, ...]
    world: int

    @classmethod
    def balance(cls, costs: Sequence[int], world: int) -> ShardPlan:
        """Largest cost first, each to the least-loaded process (ties: the lower rank): within 4/3 of the best split.

        Raises:
            ConfigError: fewer parameters than processes (a process would own nothing).
        """
        if len(costs) < world:
            raise ConfigError(
                f"shard=True splits the parameters between the processes, whole tensors each, but there are "
                f"{len(costs)} parameter tensors for {world} processes: use shard=False (the replicated update), or "
                "fewer processes",
                field="shard",
            )
        loads, owners = [0] * world, [0] * len(costs)
        for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
            rank = min(range(world), key=lambda r: (loads[r], r))
            owners[index] = rank
            loads[rank] += costs[index]
        return cls(tuple(owners), world)

    def mine(self, rank: int) -> list[int]:
        """The indices of the parameters ``rank`` owns, in parameter order."""
        return [index for index, owner in enumerate(self.owners) if owner == rank]


class InvalidElsewhere(ValueError):
    """Another process's observation failed its checks: every process stops at the same exchange.

    Attributes:
        ranks: the processes whose observation was invalid.
    """

    def __init__(self, ranks: list[int]) -> None:
        super().__init__(
            f"Invalid observation on process {', '.join(map(str, ranks))}: its closure's result failed the checks "
            "(that process's error says which); every process stops at this step"
        )
        self.ranks = ranks


def exchange_shards(
    prediction: Tensor | None,
    target: Tensor | None,
    jacobians: Sequence[JacobianBlock],
    shards: ShardPlan | None = None,
    group: dist.ProcessGroup | None = None,
    timeout: float | None = None,
    slots: int | None = None,
    device: torch.device | None = None,
) -> tuple[Tensor, Tensor, list[JacobianBlock], ShardPlan, Counts]:
    """Every process's predictions and targets, and the blocks of this process's parameters for every sample.

    Args:
        prediction: this process's ``(B_r, m)`` predictions; ``None`` when its observation failed its own checks:
            it still takes part in the first all-gather, after which every process raises
            (:class:`InvalidElsewhere` on the others), instead of the others waiting for it.
        target: its ``(B_r, m)`` targets.
        jacobians: its batched blocks, one per parameter (as for
            :func:`~loko_lightning.kalman.distributed.all_gather_observations`; factored blocks with fewer positions
            than another process's are padded with zero positions; ``B_r`` may differ at the stream's short last step).
        shards: the owners of the parameters; ``None``: balanced now (:meth:`ShardPlan.balance`) on the bytes each
            parameter's blocks send per sample.
        group: the process group (default: the world).
        timeout: seconds each collective may wait for the other processes; ``None``: the group's own timeout.
        slots: the number of parameters (needed when ``prediction`` is ``None``).
        device: where the counts live when ``prediction`` is ``None``.

    Returns:
        ``(prediction, target, blocks, shards, counts)``: ``Σ_r B_r`` samples in rank order, ``blocks`` one batched
        block for each parameter this process owns (in parameter order), the shard plan used and what the processes
        told each other (:class:`~loko_lightning.kalman.distributed.Counts`: the same on every process).

    Raises:
        InvalidElsewhere: another process's observation failed its checks (this one's too, if ``prediction`` is
            ``None``: its caller raises its own error then).

    The predictions and targets are all-gathered. The blocks go by all-to-all, in which each process receives, from
    every process in rank order, exactly the samples it has: the received buffer of a part is then the joined part
    itself, with no copy after the exchange. The dense blocks of a process's shard travel as one ``(B·rows, n_r)``
    matrix per process (``n_r`` the shard's dense entries), so they arrive as the stacked ``(N·rows, n_r)`` matrix of
    which the blocks are column views, as the update reads them; the factored blocks' parts travel in rounds, the
    ``j``-th part of every process's shard in the ``j``-th all-to-all.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    counts = gather_counts(prediction, jacobians, group, timeout, slots, device)
    if counts.invalid:
        raise InvalidElsewhere(counts.invalid)
    device, dtype = prediction.device, prediction.dtype
    sizes, jacobians = counts.sizes, pad_positions(jacobians, counts.positions)
    top, m, own = max(sizes), prediction.shape[1], prediction.shape[0]
    parts = [kind(jac).parts(jac) for jac in jacobians]
    per_sample = [[part.shape[1:].numel() for part in block] for block in parts]
    if shards is None:
        shards = ShardPlan.balance([sum(numels) for numels in per_sample], world)
    mine = shards.mine(rank)
    # Predictions and targets, padded to the largest count.
    local = torch.zeros(2, top, m, dtype=dtype, device=device)
    local[0, :own], local[1, :own] = prediction, target
    gathered = [torch.empty_like(local) for _ in range(world)]
    all_gather(gathered, local, group, timeout)
    joined = torch.cat([buffer[:, :size] for buffer, size in zip(gathered, sizes, strict=True)], dim=1)
    # Dense blocks: process d's columns of this process's rows, one matrix per destination.
    dense = [[i for i in shards.mine(d) if kind(jacobians[i]).group_key(jacobians[i]) is None] for d in range(world)]
    blocks: dict[int, JacobianBlock] = {}
    if any(dense):
        rows = next(parts[i][0].shape[1] for column in dense for i in column)
        widths = [sum(per_sample[i][0] // rows for i in column) for column in dense]
        send = torch.empty(own * rows * sum(widths), dtype=dtype, device=device)
        offset = 0
        for column, width in zip(dense, widths, strict=True):
            chunk, start = send[offset : offset + own * rows * width].view(own * rows, width), 0
            for i in column:
                numel = per_sample[i][0] // rows
                chunk[:, start : start + numel] = parts[i][0].reshape(own * rows, numel)
                start += numel
            offset += own * rows * width
        matrix = torch.empty(sum(sizes) * rows, widths[rank], dtype=dtype, device=device)
        all_to_all(matrix.view(-1), send, [size * rows * widths[rank] for size in sizes],
                    [own * rows * width for width in widths], group, timeout)  # fmt: skip
        del send
        column = 0
        for i in dense[rank]:
            shape = parts[i][0].shape[1:]  # (rows, *param.shape)
            view = matrix[:, column : column + shape[1:].numel()].view(sum(sizes), *shape)
            blocks[i] = kind(jacobians[i]).with_parts(jacobians[i], [view])
            column += shape[1:].numel()
    # Factored blocks: the j-th part of each process's shard in round j.
    factored = [
        [(i, p) for i in shards.mine(d) if i not in dense[d] for p in range(len(parts[i]))] for d in range(world)
    ]
    received: dict[int, list[Tensor]] = {i: [] for i, p in factored[rank] if p == 0}
    for round_ in range(max(len(slots) for slots in factored)):
        slots = [slots[round_] if round_ < len(slots) else None for slots in factored]
        chunks = [torch.empty(0, dtype=dtype, device=device) if slot is None else
                  parts[slot[0]][slot[1]].reshape(-1).to(dtype) for slot in slots]  # fmt: skip
        send = torch.cat(chunks)
        slot = slots[rank]
        numel = 0 if slot is None else per_sample[slot[0]][slot[1]]
        out = torch.empty(sum(sizes) * numel, dtype=dtype, device=device)
        all_to_all(out, send, [size * numel for size in sizes], [chunk.numel() for chunk in chunks], group, timeout)
        if slot is not None:
            received[slot[0]].append(out.view(sum(sizes), *parts[slot[0]][slot[1]].shape[1:]))
    for i, pieces in received.items():
        blocks[i] = kind(jacobians[i]).with_parts(jacobians[i], pieces)
    return joined[0], joined[1], [blocks[i] for i in mine], shards, counts


def sum_symmetric(matrix: Tensor, group: dist.ProcessGroup | None = None, timeout: float | None = None) -> Tensor:
    """The sum over the processes of a symmetric matrix (each shard's ``H_r P_r H_rᵀ``), by its lower triangle.

    One all-reduce of the ``d (d + 1) / 2`` entries on and below the diagonal (half the bytes of the whole ``d x d``);
    the result is exactly symmetric, its upper triangle the mirror of the summed lower one. ``H P Hᵀ`` is symmetric in
    exact arithmetic; the update's eigendecomposition reads its lower triangle only.
    """
    lower = torch.ones(matrix.shape, dtype=torch.bool, device=matrix.device).tril_()
    packed = all_reduce(matrix.masked_select(lower), group, timeout)
    summed = torch.zeros_like(matrix).masked_scatter_(lower, packed)
    return summed + summed.tril(-1).T


def agree_and_apply(
    plan: UpdatePlan,
    params: Sequence[Tensor],
    shards: ShardPlan,
    cov: Tensor,
    posterior: Tensor,
    finite: Tensor,
    group: dist.ProcessGroup | None = None,
    timeout: float | None = None,
) -> dict[str, Tensor]:
    """Apply a proposed sharded step everywhere, or nowhere: one all-gather of every shard's new parameters.

    Each process sends the new values of its parameters (what :meth:`UpdatePlan.apply` would write on an applied step:
    the shrinkage factor, then the update ``K e`` of :attr:`UpdatePlan.update`), whether its shard's update and
    ``p̂_k`` are finite, and the sums, minima and maxima of its ``p̂`` before and after. The step is applied when the
    innovation and ``S`` (``finite``, the same on every process) and every shard are finite; then every process copies
    every parameter's new value from its owner's buffer, and each writes ``posterior`` into its own ``cov``.

    Args:
        plan: the update plan of this process's shard, after the filter's proposal.
        params: all the optimizer's parameters, in order (this process's shard is ``shards.mine(rank)``).
        shards: the owners.
        cov: this shard's ``p̂`` (flat, the plan's order), written in place if the step is applied.
        posterior: its proposed ``p̂_k``.
        finite: whether the innovation and ``S`` are finite (the same on every process; gathered all the same).
        group: the process group.
        timeout: seconds the all-gather may wait.

    Returns:
        ``applied`` and the statistics of the whole ``p̂`` after the step (``p_mean``, ``p_min``, ``p_max``) and
        ``gain_norm`` (``‖K e‖`` over all shards, 0 on a skipped step), as :meth:`UpdatePlan.statistics` gives them.
    """
    world, rank = shards.world, dist.get_rank(group)
    mine = shards.mine(rank)
    update = plan.update
    check = update.sum() + posterior.sum()
    keep = plan.time.keep
    if keep is not None:
        update.mul_(keep)
    wide = torch.float64 if any(t.dtype == torch.float64 for t in (*params, update)) else torch.float32
    numels = [p.numel() for p in params]
    width = max(sum(numels[i] for i in shards.mine(r)) for r in range(world))
    local = torch.empty(width + len(STATISTICS), dtype=wide, device=update.device)
    keeps = plan.views(keep) if keep is not None and keep.dim() else [keep] * len(mine)
    offset = 0
    for index, delta, keep in zip(mine, plan.views(update), keeps, strict=True):
        param = params[index].detach()
        new = param if keep is None else param * keep.to(param.dtype)
        local[offset : offset + numels[index]] = (new + delta.to(param.dtype)).reshape(-1)
        offset += numels[index]
    post_min, post_max = torch.aminmax(posterior)
    cov_min, cov_max = torch.aminmax(cov)
    stats = [finite.to(check.dtype), check, posterior.sum(), post_min, post_max, cov.sum(), cov_min, cov_max,
             update.square().sum()]  # fmt: skip
    local[width:] = torch.stack(stats).to(wide)
    gathered = [torch.empty_like(local) for _ in range(world)]
    all_gather(gathered, local, group, timeout)
    table = torch.stack([buffer[width:] for buffer in gathered])
    # Decided from the gathered values only, so that every process decides alike.
    applied = (table[:, 0] == 1).all() & torch.isfinite(table[:, 1]).all()
    torch.where(applied, posterior, cov, out=cov)
    with torch.no_grad():
        for source, buffer in enumerate(gathered):
            offset = 0
            for index in shards.mine(source):
                param, numel = params[index], numels[index]
                new = buffer[offset : offset + numel].view(param.shape).to(param.dtype)
                param.copy_(torch.where(applied, new, param))
                offset += numel
    n = sum(numels)
    column = {name: table[:, i].to(plan.dtype) for i, name in enumerate(STATISTICS)}
    return {
        "applied": applied,
        "p_mean": torch.where(applied, column["post_sum"].sum(), column["cov_sum"].sum()) / n,
        "p_min": torch.where(applied, column["post_min"].amin(), column["cov_min"].amin()),
        "p_max": torch.where(applied, column["post_max"].amax(), column["cov_max"].amax()),
        "gain_norm": torch.where(applied, column["gain_sq"].sum().sqrt(), 0.0),
    }


def gather_shards(
    tensors: Sequence[Tensor | None],
    shapes: Sequence[torch.Size],
    dtypes: Sequence[torch.dtype],
    shards: ShardPlan,
    group: dist.ProcessGroup | None = None,
    timeout: float | None = None,
) -> list[Tensor]:
    """Every parameter's tensor (``p̂``) on every process, from the owners' (``None`` where this process owns none).

    One all-gather of each process's tensors, flat in float64 (exact for every floating dtype ``p̂`` may have, so that
    every process sends the same dtype whichever parameters it owns) and padded to the largest shard; each result in
    its own dtype (``dtypes``, in parameter order).
    """
    world, rank = shards.world, dist.get_rank(group)
    mine = shards.mine(rank)
    numels = [torch.Size(s).numel() for s in shapes]
    width = max(sum(numels[i] for i in shards.mine(r)) for r in range(world))
    local = torch.zeros(width, dtype=torch.float64, device=tensors[mine[0]].device)
    offset = 0
    for i in mine:
        local[offset : offset + numels[i]] = tensors[i].reshape(-1)
        offset += numels[i]
    gathered = [torch.empty_like(local) for _ in range(world)]
    all_gather(gathered, local, group, timeout)
    result: list[Tensor] = [torch.empty(0)] * len(shapes)
    for source, buffer in enumerate(gathered):
        offset = 0
        for i in shards.mine(source):
            result[i] = buffer[offset : offset + numels[i]].view(shapes[i]).to(dtypes[i], copy=True)
            offset += numels[i]
    return result
