"""The Python overhead of one ``LoKO.step`` on a tiny network: median microseconds per step, one thread.

A network this small makes the arithmetic negligible, so the time is what the step pipeline itself costs per sample
(planning, checks, the exchange, the filter's dispatch). Compare two trees of the package by running this script in
each, alternately, on an otherwise idle machine::

    PYTHONPATH=path/to/tree python benchmarks/step_overhead.py --filter covariance
"""

import argparse
import statistics
import time

import torch
from torch import nn

from loko_lightning import JacobianEngine, LoKO


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--filter", default="covariance", help="covariance, natural, lofi10, ...")
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 16, 4))
    opt = LoKO(model.parameters(), p0=0.1, seed=0, filter=args.filter)
    engine = JacobianEngine(model, observation=opt.observation, factorize=True)
    observations = [engine.observe(torch.randn(1, 2, 4, 4), torch.randint(4, (1,))) for _ in range(50)]
    times = []
    for i in range(args.steps):
        observation = observations[i % len(observations)]
        start = time.perf_counter()
        opt.step(lambda observation=observation: observation)
        times.append(time.perf_counter() - start)
    print(f"{args.filter}: median {statistics.median(times[50:]) * 1e6:.0f} us per step over {args.steps - 50} steps")


if __name__ == "__main__":
    main()
