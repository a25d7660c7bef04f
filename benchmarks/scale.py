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
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from loko_lightning import JacobianEngine, LoKO
from loko_lightning.kalman.distributed import all_gather_observations, observation_nbytes
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
    parser.add_argument("--m", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1: stable timings)")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # run one batch size here and print JSON
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # a DDP process
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
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
