"""Throughput of joint LoKO updates: samples per second for B samples per step, and DDP with W processes.

Usage:
    python benchmarks/scale.py                              # resnet18, m = 10, B in 1 4 16, W = 2
    python benchmarks/scale.py --batches 1 4 --steps 10 --world 2 --threads 1
    python benchmarks/scale.py --backbone tf_efficientnet_lite0 --world 1  # the accuracy study's model, no DDP

Model: timm ``resnet18`` (``--backbone``; random init: weights do not change the cost) with LoRA rank 4 on every conv
with ``groups == 1`` and a new ``m``-class head, 32 x 32 inputs, float32 on the CPU, as ``benchmarks/step_time.py``.
One step is ``JacobianEngine.batch`` (``engine(x)`` for B = 1, the paper's path) on B random inputs plus one joint
``LoKO.step``. Each configuration runs in a fresh process (so its peak resident memory is its own): a warm-up,
then the median step time over ``--steps`` steps (and, separately, the median time of its Jacobian pass); samples per
second = samples per step / median step time.

DDP (``--world`` > 1): that many processes on this machine (gloo over loopback, one thread each, as Lightning's CPU
DDP gives every process its share of the cores), each with B = 1 and the same model, exchanging their observations with
:func:`loko_lightning.kalman.distributed.all_gather_observations` every step; compared with one process at the same
thread count. Bytes per step: what one process contributes to the all-gather (prediction, target and Jacobian
factors of its B samples); every process receives that from each of the others.

Peak memory: the process's peak resident set (``ru_maxrss``), model and all; and the same read after the warm-up,
before the timed steps, so their difference is what the timed steps added at most.

Replicated against sharded (``--shard``; ``LoKO(shard=True)``, :mod:`loko_lightning.kalman.sharded`):

    python benchmarks/scale.py --shard --worlds 1 2 4 --m 10 --steps 10
    python benchmarks/scale.py --estimate --worlds 4 64 --m 10 100   # an estimate, no processes started
    python benchmarks/scale.py --estimate --worlds 4 64 --m 10 100 --batches 4   # B = 4 per process

For each W of ``--worlds``, W processes (gloo over loopback, one thread each, B = 1 each) run the replicated update
(every process gathers every observation and updates everything) and then the sharded one. Per process and step:
bytes sent and received by LoKO's collectives (:func:`loko_lightning.kalman.distributed.traffic`: the sizes of the
collectives as ring algorithms move them), the peak memory of the update (the process hands freed heap memory back
to the kernel and resets its resident-set high-water mark after the Jacobian pass, then reads ``VmHWM - VmRSS``
after ``LoKO.step``, which gathers or exchanges the observations and updates: the largest over 3 steps) and the
median step time (Jacobian pass and update) as samples per second of the W processes. The table gives the largest
value over the processes. W processes on a machine with fewer cores share them: samples per second then measure the
contention, not the algorithm. ``--estimate`` takes one observation of the model (the bytes each parameter's blocks
send per sample) and evaluates the same byte counts for W processes without starting them.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import resource
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from step_time import _status_kib  # benchmarks/ is on sys.path when a script runs

from loko_lightning import JacobianEngine, LoKO
from loko_lightning.jacobians.blocks import kind
from loko_lightning.kalman.distributed import all_gather_observations, observation_nbytes, reset_traffic, traffic
from loko_lightning.kalman.sharded import STATISTICS, ShardPlan
from loko_lightning.models import TimmClassifier


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run(
    batch: int, m: int, steps: int, warmup: int, threads: int, rank: int = 0, world: int = 1, backbone: str = "resnet18"
) -> dict:
    """Time ``steps`` joint steps of ``batch`` samples per process; under ``world > 1`` the group is initialised."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = TimmClassifier(backbone, m, pretrained=False, target="convs", r=4, head_init="timm")().eval()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = LoKO(params, p0=0.2, seed=0)
    engine = JacobianEngine(model, params, factorize=True)
    gen = torch.Generator().manual_seed(rank)
    times, jacobian_times, nbytes = [], [], 0
    for i in range(warmup + steps):
        if i == warmup:
            warm_peak = peak_mib()
        x = torch.randn(batch, 3, 32, 32, generator=gen)
        y = torch.nn.functional.one_hot(torch.randint(m, (batch,), generator=gen), m).float()
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        if batch == 1 and world == 1:
            prediction, jacobians = engine(x)
            jacobian_times.append(time.perf_counter() - start)
            opt.step(lambda prediction=prediction, jacobians=jacobians, y=y: (prediction, y[0], jacobians))
        else:
            prediction, jacobians = engine.batch(x)
            jacobian_times.append(time.perf_counter() - start)
            nbytes = observation_nbytes(prediction, y, jacobians)
            observation = (prediction, y, jacobians)
            if world > 1:
                observation = all_gather_observations(*observation)
            opt.step(lambda observation=observation: observation)
        times.append(time.perf_counter() - start)
    step = statistics.median(times[warmup:])
    return {
        "batch": batch,
        "world": world,
        "threads": threads,
        "step_s": step,
        "jacobian_s": statistics.median(jacobian_times[warmup:]),
        "samples_per_s": batch * world / step,
        "bytes_per_step_per_process": nbytes,
        "peak_mib": peak_mib(),
        "added_after_warmup_mib": peak_mib() - warm_peak,
    }


def _reset_peak() -> int | None:
    """Hand freed heap memory back, reset the resident-set high-water mark; the resident KiB now (None: not Linux)."""
    try:
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # resident but free heap memory would hide the step's peak
        baseline = _status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # VmHWM = VmRSS
    except OSError:
        return None
    return baseline


def shard_run(m: int, steps: int, warmup: int, shard: bool, rank: int = 0, world: int = 1, backbone: str = "resnet18"):
    """One process's measurement of the replicated (``shard=False``) or the sharded update, B = 1 (see the module)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TimmClassifier(backbone, m, pretrained=False, target="convs", r=4, head_init="timm")().eval()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = LoKO(params, p0=0.2, seed=0, shard=shard)
    engine = JacobianEngine(model, params, factorize=True)
    gen = torch.Generator().manual_seed(rank)
    gather = world > 1 and not shard

    def observe() -> tuple:
        x = torch.randn(1, 3, 32, 32, generator=gen)
        prediction, jacobians = engine.batch(x)
        target = torch.nn.functional.one_hot(torch.randint(m, (1,), generator=gen), m).float()
        return prediction, target, jacobians

    def step(observation: tuple) -> None:
        opt.step((lambda: all_gather_observations(*observation)) if gather else (lambda: observation))

    times = []
    for i in range(warmup + steps):
        if world > 1:
            dist.barrier()
        if i == warmup:
            reset_traffic()
        start = time.perf_counter()
        step(observe())
        times.append(time.perf_counter() - start)
    moved = traffic()
    peaks = []
    for _ in range(3):
        observation = observe()
        if world > 1:
            dist.barrier()
        baseline = _reset_peak()
        step(observation)
        peaks.append(math.nan if baseline is None else (_status_kib("VmHWM") - baseline) / 1024)
    return {
        "world": world,
        "shard": shard,
        "rank": rank,
        "step_s": statistics.median(times[warmup:]),
        "sent": moved["sent"] / steps,
        "received": moved["received"] / steps,
        "update_peak_mib": max(peaks),
        "parameters": sum(p.numel() for p in params),
    }


def shard_worker(rank: int, world: int, port: int, m: int, steps: int, warmup: int, backbone: str) -> list[dict]:
    """Both updates in one process group: the replicated one, then the sharded one (separate models)."""
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        return [shard_run(m, steps, warmup, shard, rank, world, backbone) for shard in (False, True)]
    finally:
        if world > 1:
            dist.barrier()
            dist.destroy_process_group()


def shard_rows(worlds: list[int], m: int, steps: int, warmup: int, backbone: str) -> list[dict]:
    """Every process's rows for each W (fresh processes per W)."""
    rows = []
    for world in worlds:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        common = ["--m", str(m), "--steps", str(steps), "--warmup", str(warmup), "--backbone", backbone]
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--shard-rank", str(r), "--world", str(world), "--port", str(port), *common],
                stdout=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            for r in range(world)
        ]
        for proc in procs:
            rows += [json.loads(line) for line in proc.communicate()[0].splitlines() if line.startswith("{")]
            if proc.returncode:
                raise SystemExit(f"a W = {world} process failed (exit status {proc.returncode})")
    return rows


def shard_table(rows: list[dict]) -> str:
    """Markdown: per W and update, the largest bytes and peak over the processes, samples/s of all of them."""
    lines = [
        "| W | update | bytes sent per process and step | bytes received | peak update memory (MiB) | samples/s |",
        "|---|---|---|---|---|---|",
    ]
    for world in sorted({r["world"] for r in rows}):
        for shard in (False, True):
            group = [r for r in rows if r["world"] == world and r["shard"] == shard]
            if not group or (world == 1 and shard):
                continue
            name = "one process" if world == 1 else ("sharded" if shard else "replicated")
            step = max(r["step_s"] for r in group)
            lines.append(
                f"| {world} | {name} | {max(r['sent'] for r in group):,.0f} | {max(r['received'] for r in group):,.0f} "
                f"| {max(r['update_peak_mib'] for r in group):.1f} | {world / step:.1f} |"
            )
    return "\n".join(lines)


def estimate(backbone: str, m: int, world: int, batch: int = 1) -> dict:
    """Bytes per process and step for ``world`` processes, from one observation of the model (no processes started).

    Replicated: one all-gather of every process's predictions, targets and blocks. Sharded: the all-to-all of each
    shard's blocks (the largest shard's receiver), the all-reduce of the ``W·B·m`` square ``H P Hᵀ``'s lower triangle
    (float32) and the all-gather of the largest shard's parameters with its statistics
    (:data:`~loko_lightning.kalman.sharded.STATISTICS`). The counts all-gather (a few integers) is left out.
    With fewer parameter tensors than processes ``LoKO(shard=True)`` refuses (it splits whole tensors); the estimate
    then assumes an even split of the bytes and parameters (``split: even``), what a split within tensors would give.
    """
    torch.manual_seed(0)
    model = TimmClassifier(backbone, m, pretrained=False, target="convs", r=4, head_init="timm")().eval()
    params = [p for p in model.parameters() if p.requires_grad]
    with JacobianEngine(model, params, factorize=True) as engine:
        prediction, jacobians = engine.batch(torch.randn(1, 3, 32, 32))
    size = prediction.element_size()
    costs = [sum(part.shape[1:].numel() for part in kind(jac).parts(jac)) for jac in jacobians]
    if len(costs) >= world:  # whole tensors, as LoKO(shard=True) splits them
        shards = ShardPlan.balance(costs, world)
        largest = max(sum(costs[i] for i in shards.mine(r)) for r in range(world))
        numel = max(sum(params[i].numel() for i in shards.mine(r)) for r in range(world))
        split = "tensors"
    else:  # fewer tensors than processes: what an even split below whole tensors would give (not implemented)
        largest = math.ceil(sum(costs) / world)
        numel = math.ceil(sum(p.numel() for p in params) / world)
        split = "even"
    per_sample = 2 * m + sum(costs)
    rows = world * batch * m
    replicated = (world - 1) * batch * per_sample * size
    exchange = (world - 1) * batch * (2 * m + largest) * size
    reduce = 2 * (world - 1) / world * rows * (rows + 1) // 2 * size  # the lower triangle
    parameters = (world - 1) * (numel + len(STATISTICS)) * size
    return {
        "m": m,
        "world": world,
        "replicated": replicated,
        "exchange": exchange,
        "reduce": reduce,
        "parameters": parameters,
        "sharded": exchange + reduce + parameters,
        "per_sample": per_sample * size,
        "S_mib": rows * rows * size / 2**20,
        "split": split,
        "tensors": len(costs),
    }


def ddp_worker(rank: int, world: int, port: int, args: argparse.Namespace) -> dict:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        return run(1, args.m, args.steps, args.warmup, 1, rank, world, args.backbone)
    finally:
        dist.destroy_process_group()


def in_subprocess(argv: list[str]) -> list[dict]:
    out = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--backbone", default="resnet18", help="timm model name")
    parser.add_argument("--world", type=int, default=2, help="DDP processes (1: no DDP run)")
    parser.add_argument("--m", type=int, nargs="+", default=[10], help="classes (several for --estimate)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1: stable timings)")
    parser.add_argument("--shard", action="store_true", help="replicated against sharded updates for --worlds")
    parser.add_argument("--estimate", action="store_true", help="bytes for --worlds processes, without running them")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4], help="W for --shard and --estimate")
    parser.add_argument("--shard-rank", type=int, help=argparse.SUPPRESS)  # a process of --shard
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # run one batch size here and print JSON
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # a DDP process
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.shard_rank is not None:
        for row in shard_worker(args.shard_rank, args.world, args.port, args.m[0], args.steps, args.warmup,
                                args.backbone):  # fmt: skip
            print(json.dumps(row))
        return
    if args.estimate:
        batch = args.batches[0]
        print(f"{args.backbone}, LoRA r = 4 on convs, 32 x 32, B = {batch} per process, float32: bytes received per "
              "process and step (sent: the same)")  # fmt: skip
        print("| m | W | split | replicated | sharded | of which all-to-all | all-reduce of S | parameters | S (MiB) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for m in args.m:
            for world in args.worlds:
                e = estimate(args.backbone, m, world, batch)
                split = f"{e['split']} ({e['tensors']} tensors)"
                print(
                    f"| {m} | {world} | {split} | {e['replicated'] / 1e6:,.1f} MB | {e['sharded'] / 1e6:,.1f} MB | "
                    f"{e['exchange'] / 1e6:,.1f} MB | {e['reduce'] / 1e6:,.1f} MB | {e['parameters'] / 1e6:,.2f} MB | "
                    f"{e['S_mib']:,.1f} |"
                )
        return
    if args.shard:
        print(f"{args.backbone}, m = {args.m[0]}, LoRA r = 4 on convs, 32 x 32, B = 1 per process, one thread each, "
              f"{args.steps} timed steps, {os.cpu_count()} CPUs")  # fmt: skip
        rows = shard_rows(args.worlds, args.m[0], args.steps, args.warmup, args.backbone)
        print(shard_table(rows))
        print(json.dumps(rows))
        return
    args.m = args.m[0]
    if args.one is not None:
        print(json.dumps(run(args.one, args.m, args.steps, args.warmup, args.threads, backbone=args.backbone)))
        return
    if args.rank is not None:
        result = ddp_worker(args.rank, args.world, args.port, args)
        if args.rank == 0:
            print(json.dumps(result))
        return

    common = ["--m", str(args.m), "--steps", str(args.steps), "--warmup", str(args.warmup), "--backbone", args.backbone]
    load = os.getloadavg()
    print(f"{args.backbone}, m = {args.m}, LoRA r = 4 on convs, 32 x 32, CPU, {args.steps} timed steps; load {load}")
    print(
        "| B | W | threads | step (s) | of which Jacobian (s) | samples/s | bytes per step and process "
        "| peak RSS (MiB) | added (MiB) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for batch in args.batches:
        rows += in_subprocess(["--one", str(batch), "--threads", str(args.threads), *common])
    if args.world > 1 and (1 not in args.batches or args.threads != 1):  # DDP against one process, same threads
        rows += in_subprocess(["--one", "1", "--threads", "1", *common])
    if args.world > 1:
        rows += ddp_rows(args, common)
    for r in rows:
        print(
            f"| {r['batch']} | {r['world']} | {r['threads']} | {r['step_s']:.3f} | {r['jacobian_s']:.3f} | "
            f"{r['samples_per_s']:.1f} | {r['bytes_per_step_per_process']:,} | {r['peak_mib']:.0f} | "
            f"{r['added_after_warmup_mib']:.0f} |"
        )
    print(f"load after: {os.getloadavg()}")


def ddp_rows(args: argparse.Namespace, common: list[str]) -> list[dict]:
    """Rank 0's row of a DDP run with ``args.world`` processes, each with B = 1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--rank", str(r), "--world", str(args.world), "--port", str(port), *common],
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for r in range(args.world)
    ]
    outputs = [p.communicate()[0] for p in procs]
    return [json.loads(line) for line in outputs[0].splitlines() if line.startswith("{")]


if __name__ == "__main__":
    main()
