"""What LoFi's step sees, step by step, on the debug stream: the Woodbury system's inputs and the rank cut.

For each step of ``loko fit --config debug --model.optimizer.init_args.filter lofi10`` (with ``--p0``, Kalman
``--dtype``): the largest entry of ``W``, the largest and smallest eigenvalues of ``WᵀW``, the prior's range, the
largest entry of the proposed update, the precision the step added to the diagonal and the innovation's norm. One
JSON object per step::

    python benchmarks/lofi_probe.py --p0 0.3 --dtype float32 --samples 120 --out lofi_float32.json
"""

import argparse
import json

import torch

from loko_lightning.cli import main as loko
from loko_lightning.kalman.filters.low_rank import LowRankPrecision


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p0", type=float, default=0.3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--samples", type=int, default=120)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    records = []
    propose = LowRankPrecision.propose

    def probed(self, plan, evidence, belief, reduce=None):
        prior, W = plan.time.prior(belief.cov), belief.entries["W"]
        proposal = propose(self, plan, evidence, belief, reduce)
        gram = torch.linalg.eigvalsh(W.T.double() @ W.double()) if W.abs().sum() > 0 else torch.zeros(1)
        gain = (1 / proposal.posterior.double()).sum() - (1 / prior.double()).sum()
        innovation = (evidence.target.double() - evidence.prediction.double()).norm()
        records.append({
            "W_max": float(W.abs().max()), "gram_top": float(gram[-1]), "gram_min": float(gram[0]),
            "prior_max": float(prior.max()), "prior_min": float(prior.min()),
            "update_max": float(plan.update.abs().max()), "precision_gain": float(gain),
            "innovation": float(innovation),
        })  # fmt: skip
        return proposal

    LowRankPrecision.propose = probed
    try:
        loko([
            "fit", "--config", "debug", "--model.optimizer.init_args.filter", "lofi10",
            "--model.optimizer.init_args.p0", str(args.p0), "--model.optimizer.init_args.dtype", f"torch.{args.dtype}",
            "--data.max_samples", str(args.samples), "--trainer.logger", "false",
            "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false",
            "--trainer.callbacks", "[]",
        ])  # fmt: skip
    except SystemExit:  # the run may stop by itself (a divergence)
        pass
    finally:
        LowRankPrecision.propose = propose
    with open(args.out, "w") as file:
        json.dump(records, file)
    print(f"{len(records)} steps written to {args.out}")


if __name__ == "__main__":
    main()
