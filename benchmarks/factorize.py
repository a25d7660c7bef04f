"""When does ``factorize=True`` pay off? A LoKO step (Jacobian + update) with and without it, side by side.

Usage:
    python benchmarks/factorize.py                          # mlp:10, resnet18:10, resnet50:100
    python benchmarks/factorize.py --cases mlp:10 resnet18:10 --steps 20

For each case two copies of one model (same weights, same stream) are trained by LoKO, one with a
``JacobianEngine(..., factorize=True)``, one with ``factorize=False``; their steps alternate after a warm-up and the
script prints the median step-time ratio factorized / dense (below 1: factorising pays off) and the largest
parameter difference after the run (the two forms give the same update to float32 rounding). Cases: ``mlp`` is a
small MLP (64 → 32 → m, the size of scikit-learn's digits task), any other name a timm backbone with LoRA rank 4 on
every ``groups == 1`` conv and a new ``m``-class head at 32x32 (as ``step_time.py``).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F

from loko_lightning import JacobianEngine, LoKO
from loko_lightning.models import TimmClassifier


def build(name: str, m: int) -> tuple[nn.Module, tuple[int, ...]]:
    """The model (trainable part requires grad) and its input shape."""
    if name == "mlp":
        return nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, m)), (1, 64)
    model = TimmClassifier(name, m, pretrained=False, target="convs", r=4, head_init="timm")().eval()
    return model, (1, 3, 32, 32)


def time_case(name: str, m: int, steps: int, warmup: int) -> dict:
    torch.manual_seed(0)
    model, shape = build(name, m)
    copies = {"factorized": model, "dense": copy.deepcopy(model)}
    runs = {}
    for kind, net in copies.items():
        params = [p for p in net.parameters() if p.requires_grad]
        runs[kind] = (JacobianEngine(net, params, factorize=kind == "factorized"), LoKO(params, p0=0.2, seed=0), [])
    for i in range(warmup + steps):
        x = torch.randn(shape)
        target = F.one_hot(torch.randint(m, ()), m).float()
        for engine, opt, times in runs.values():
            start = time.perf_counter()
            prediction, jacobians = engine(x)
            opt.step(lambda p=prediction, t=target, j=jacobians: (p, t, j))
            if i >= warmup:
                times.append(time.perf_counter() - start)
    medians = {kind: statistics.median(times) for kind, (_, _, times) in runs.items()}
    diff = max(
        (a - b).abs().max().item()
        for a, b in zip(copies["factorized"].parameters(), copies["dense"].parameters(), strict=True)
    )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {
        "case": name,
        "m": m,
        "trainable": trainable,
        "ratio": medians["factorized"] / medians["dense"],
        "dense_seconds": medians["dense"],
        "max_param_diff": diff,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=["mlp:10", "resnet18:10", "resnet50:100"], help="name:m pairs")
    parser.add_argument("--steps", type=int, default=30, help="timed steps of each kind per case")
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args(argv)
    rows = [time_case(name, int(m), args.steps, args.warmup) for name, m in (c.split(":") for c in args.cases)]
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.steps} alternating steps\n")
    print("| case | m | trainable | factorized / dense step time | max parameter difference after the run |")
    print("|---|---|---|---|---|")
    for r in rows:  # ratios only: absolute times on a shared machine are noise
        print(f"| {r['case']} | {r['m']} | {r['trainable']:,} | {r['ratio']:.2f} | {r['max_param_diff']:.1e} |")


if __name__ == "__main__":
    main()
