"""Joint LoKO updates across processes: every process gathers every process's observations and applies the same update.

Under data parallelism each of ``W`` processes predicts on its own ``B`` samples and computes their Jacobians; then
:func:`all_gather_observations` gives every process the ``W·B`` predictions, targets and Jacobian blocks (factored
blocks as their factors, never materialised), in rank order, and every process applies the same joint update
(:mod:`loko_lightning.kalman.multistream`). All-gather delivers bit-identical copies, and the update is a deterministic
function
of its inputs and of the filter state, so the parameters, ``p̂`` and ``R`` stay identical on every process without a
broadcast, as long as the processes run the same kernels (same device type and library versions; on GPUs with
``torch.use_deterministic_algorithms(True)`` where a kernel would otherwise be non-deterministic).

Communication per step: one all-gather of the count of samples per process (and of each factored block's positions),
and one of a flat buffer holding each
process's predictions, targets and Jacobian factors (:func:`observation_nbytes`): it grows with ``W·B·m`` times the
size of the Jacobian factors, not with the number of parameters for factored blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from loko_lightning.jacobians.blocks import JacobianBlock, kind

__all__ = [
    "Counts",
    "all_gather",
    "all_gather_observations",
    "all_reduce",
    "all_to_all",
    "gather_counts",
    "observation_nbytes",
    "pad_positions",
    "reset_traffic",
    "traffic",
]

# Bytes this process sent and received in LoKO's collectives since the last reset_traffic(), counted as a ring
# algorithm moves them (gloo's and NCCL's): an all-gather of c bytes per process sends and receives (W - 1)·c, an
# all-reduce of s bytes 2·(W - 1)/W·s each way, an all-to-all the segments addressed to and from the other processes.
_TRAFFIC = {"sent": 0, "received": 0, "collectives": 0}


def traffic() -> dict[str, int]:
    """Bytes sent and received and collectives run by LoKO's exchanges in this process since :func:`reset_traffic`.

    Counted from the sizes of the collectives, as ring algorithms move them (all-gather of ``c`` bytes: ``(W - 1)·c``
    each way; all-reduce of ``s`` bytes: ``2·(W - 1)/W·s`` each way; all-to-all: the segments for and from the other
    processes), not measured on the wire.
    """
    return dict(_TRAFFIC)


def reset_traffic() -> None:
    """Start counting :func:`traffic` from zero."""
    for key in _TRAFFIC:
        _TRAFFIC[key] = 0


def _count(sent: float, received: float) -> None:
    _TRAFFIC["sent"] += int(sent)
    _TRAFFIC["received"] += int(received)
    _TRAFFIC["collectives"] += 1


def _parts(prediction: Tensor, target: Tensor, jacobians: Sequence[JacobianBlock]) -> list[Tensor]:
    """The tensors of one process's observation, each with the batch as its first dimension."""
    parts = [prediction, target]
    for jac in jacobians:
        parts += kind(jac).parts(jac)
    return parts


def _rebuild(parts: list[Tensor], jacobians: Sequence[JacobianBlock]) -> tuple[Tensor, Tensor, list[JacobianBlock]]:
    prediction, target, rest = parts[0], parts[1], iter(parts[2:])
    blocks: list[JacobianBlock] = []
    for jac in jacobians:
        block = kind(jac)
        blocks.append(block.with_parts(jac, [next(rest) for _ in block.parts(jac)]))
    return prediction, target, blocks


def observation_nbytes(prediction: Tensor, target: Tensor, jacobians: Sequence[JacobianBlock]) -> int:
    """Bytes one process contributes to the gather of a step (the same ``B`` on every process)."""
    return sum(part.numel() for part in _parts(prediction, target, jacobians)) * prediction.element_size()


def all_gather_observations(
    prediction: Tensor,
    target: Tensor,
    jacobians: Sequence[JacobianBlock],
    group: dist.ProcessGroup | None = None,
    timeout: float | None = None,
) -> tuple[Tensor, Tensor, list[JacobianBlock]]:
    """Every process's batch of observations, concatenated in rank order, on every process.

    Args:
        prediction: this process's ``(B_r, m)`` predictions.
        target: its ``(B_r, m)`` targets.
        jacobians: its batched blocks (leading dimension ``B_r``; see :meth:`loko_lightning.JacobianEngine.batch`).
            Every process must pass blocks of the same kinds and per-sample shapes, except the number ``k`` of
            positions of a factored block (texts padded to different lengths on different processes): a block with
            fewer positions is padded with zero positions, which add nothing to its Jacobian. ``B_r`` may differ too
            (the stream's short last step), the gather pads and trims.
        group: the process group (default: the world).
        timeout: seconds each of the two collectives may wait for the other processes before it raises (a process
            that died or hangs); ``None``: the process group's own timeout (torch's default is 30 minutes).

    Returns:
        ``(prediction, target, jacobians)`` with ``Σ_r B_r`` samples, in the dtype of ``prediction``.
    """
    world = dist.get_world_size(group)
    device, dtype = prediction.device, prediction.dtype
    counts = gather_counts(prediction, jacobians, group, timeout)
    sizes, jacobians = counts.sizes, pad_positions(jacobians, counts.positions)
    top = max(sizes)
    parts = _parts(prediction, target, jacobians)
    # One flat buffer per process (each part padded to `top` samples), one collective for all of them.
    per_sample = [part[0].numel() if part.shape[0] else part.shape[1:].numel() for part in parts]
    local = torch.zeros(top * sum(per_sample), dtype=dtype, device=device)
    offset = 0
    for part, numel in zip(parts, per_sample, strict=True):
        local[offset : offset + part.numel()] = part.reshape(-1).to(dtype)
        offset += top * numel
    gathered = [torch.empty_like(local) for _ in range(world)]
    all_gather(gathered, local, group, timeout)
    joined, offset = [], 0
    for part, numel in zip(parts, per_sample, strict=True):
        pieces = [buffer[offset : offset + size * numel] for buffer, size in zip(gathered, sizes, strict=True)]
        joined.append(torch.cat(pieces).view(sum(sizes), *part.shape[1:]))
        offset += top * numel
    return _rebuild(joined, jacobians)


@dataclass(frozen=True)
class Counts:
    """What the processes told each other before an exchange (:func:`gather_counts`).

    Attributes:
        sizes: each process's number of samples (equal except at the stream's short last step).
        positions: per parameter slot, the most positions of a factored block over the processes (0 for other blocks).
        invalid: the processes whose observation failed their own checks (nothing is exchanged then).
    """

    sizes: list[int]
    positions: tuple[int, ...]
    invalid: list[int]


def gather_counts(
    prediction: Tensor | None,
    jacobians: Sequence[JacobianBlock],
    group: dist.ProcessGroup | None,
    timeout: float | None,
    slots: int | None = None,
    device: torch.device | None = None,
) -> Counts:
    """One all-gather of every process's number of samples and its factored blocks' positions, and one host read.

    Args:
        prediction: this process's ``(B, m)`` predictions; ``None``: its observation is invalid (it says so, so that
            every process stops at the same point instead of the others waiting for it).
        jacobians: its blocks (ignored when ``prediction`` is ``None``).
        group: the process group.
        timeout: seconds the all-gather may wait.
        slots: the number of blocks every process has (default: ``len(jacobians)``).
        device: where the counts live when ``prediction`` is ``None``.
    """
    world = dist.get_world_size(group)
    slots = len(jacobians) if slots is None else slots
    row = [0] * (2 + slots)
    if prediction is not None:
        row[:2] = [1, prediction.shape[0]]
        for index, jac in enumerate(jacobians):
            row[2 + index] = kind(jac).positions(jac) or 0
        device = prediction.device
    count = torch.tensor(row, dtype=torch.int64, device=device)
    counts = [torch.empty_like(count) for _ in range(world)]
    all_gather(counts, count, group, timeout)
    table = torch.stack(counts).tolist()
    return Counts(
        sizes=[row[1] for row in table],
        positions=tuple(max(column) for column in zip(*(row[2:] for row in table), strict=True)),
        invalid=[rank for rank, row in enumerate(table) if not row[0]],
    )


def pad_positions(jacobians: Sequence[JacobianBlock], positions: Sequence[int]) -> list[JacobianBlock]:
    """Factored blocks padded with zero positions up to ``positions`` (one count per block; others as they are)."""
    padded = []
    for jac, wanted in zip(jacobians, positions, strict=True):
        block = kind(jac)
        padded.append(jac if block.positions(jac) is None else block.pad_positions(jac, wanted))
    return padded


def _wait(work: Any, timeout: float | None) -> None:
    """Wait for an asynchronous collective at most ``timeout`` seconds (``None``: the group's own timeout)."""
    if timeout is None:
        work.wait()
    else:
        work.wait(timedelta(seconds=timeout))


def all_gather(out: list[Tensor], tensor: Tensor, group: dist.ProcessGroup | None, timeout: float | None) -> None:
    """``dist.all_gather``, waiting at most ``timeout`` seconds (``None``: the group's timeout)."""
    nbytes = tensor.numel() * tensor.element_size() * (len(out) - 1)
    _count(nbytes, nbytes)
    _wait(dist.all_gather(out, tensor, group=group, async_op=True), timeout)


def all_reduce(tensor: Tensor, group: dist.ProcessGroup | None, timeout: float | None) -> Tensor:
    """``dist.all_reduce`` (sum) in place, waiting at most ``timeout`` seconds; returns ``tensor``."""
    world = dist.get_world_size(group)
    nbytes = 2 * (world - 1) / world * tensor.numel() * tensor.element_size()
    _count(nbytes, nbytes)
    _wait(dist.all_reduce(tensor, group=group, async_op=True), timeout)
    return tensor


def all_to_all(
    out: Tensor,
    tensor: Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: dist.ProcessGroup | None,
    timeout: float | None,
) -> None:
    """``dist.all_to_all_single``, waiting at most ``timeout`` seconds.

    ``in_splits[d]`` entries of ``tensor`` go to process ``d``; ``out`` receives ``out_splits[s]`` from process ``s``,
    in rank order.
    """
    rank = dist.get_rank(group)
    size = tensor.element_size()
    _count((sum(in_splits) - in_splits[rank]) * size, (sum(out_splits) - out_splits[rank]) * size)
    _wait(dist.all_to_all_single(out, tensor, out_splits, in_splits, group=group, async_op=True), timeout)
