r"""Each scale κ of the posterior predictive on one stream, side by side: accuracy, prequential NLL and ECE.

One ``loko fit`` run with ``--model.predictive posterior`` (the learner the user gets) records, at every step, the
mean's prediction, its ``H P Hᵀ`` block and the label; every κ of :data:`~loko_lightning.kalman.predictive.KAPPAS`
is then scored on the same records (κ = 0 is the mean's prediction), beside the learner's own choice (each step the κ
with the least log-loss so far). The training is the same for every κ: only the prediction scored differs.

    python benchmarks/predictive_scales.py --config configs/debug.yaml --samples 300 --seed 0 \
        --out results/posterior_predictive/scales_debug_seed0.md [-- loko overrides, e.g. --data.drift_every 100]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import common
import torch

import loko_lightning.learner.steps as steps
from loko_lightning.kalman.predictive import KAPPAS, PredictiveScale, mean_field_predictive


def calibration_error(probabilities: torch.Tensor, labels: torch.Tensor, bins: int = 15) -> float:
    """Expected calibration error of the top-1 predictions (equal-width bins, as the learner's ECE)."""
    confidence, predicted = probabilities.max(-1)
    correct = (predicted == labels).double()
    edges = torch.linspace(0, 1, bins + 1, dtype=torch.float64)
    error = 0.0
    for low, high in zip(edges[:-1], edges[1:], strict=True):
        inside = (confidence > low) & (confidence <= high)
        if inside.any():
            error += float(inside.double().mean() * (correct[inside].mean() - confidence[inside].mean()).abs())
    return error


def main(argv: list[str] | None = None) -> None:
    own, overrides = common.split_overrides(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, action="append", required=True, help="a `loko` config (repeatable)")
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="write the table here (markdown) as well")
    args = parser.parse_args(own)
    torch.set_num_threads(args.threads)
    records: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    scale_call = PredictiveScale.__call__

    def recording(self, probabilities, cov, label):  # the inputs of every step's predictive
        records.append((probabilities.detach().double().clone(), cov.detach().double().clone(), label.clone()))
        return scale_call(self, probabilities, cov, label)

    steps.PredictiveScale.__call__ = recording
    fit_args = [
        *common.config_args(args.config),
        f"--seed_everything={args.seed}",
        f"--data.seed={args.seed}",
        f"--data.max_samples={args.samples}",
        "--model.predictive=posterior",
        *overrides,
    ]
    common.fit(fit_args)
    labels = torch.cat([label for _, _, label in records])
    rows = ["| κ | online accuracy (%) | prequential NLL | ECE (%) |", "|---|---|---|---|"]
    chosen, losses = [], torch.zeros(len(KAPPAS), dtype=torch.float64)
    scored = {kappa: [] for kappa in KAPPAS}
    for probabilities, cov, label in records:
        best = int(torch.argmin(losses))
        for i, kappa in enumerate(KAPPAS):
            predictive = mean_field_predictive(probabilities, kappa * cov, eps=torch.finfo(torch.float32).eps)
            scored[kappa].append(predictive)
            losses[i] -= predictive[torch.arange(len(label)), label].clamp_min(1e-300).log().sum()
            if i == best:
                chosen.append(predictive)
    for name, predictions in [*((f"{k:g}", v) for k, v in scored.items()), ("chosen online", chosen)]:
        probabilities = torch.cat(predictions)
        nll = -probabilities[torch.arange(len(labels)), labels].clamp_min(1e-300).log().mean()
        accuracy = (probabilities.argmax(-1) == labels).double().mean()
        ece = calibration_error(probabilities, labels)
        rows.append(f"| {name} | {100 * accuracy:.2f} | {nll:.3f} | {100 * ece:.1f} |")
    table = "\n".join(rows)
    print(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        command = " ".join(["python benchmarks/predictive_scales.py", *(sys.argv[1:] if argv is None else argv)])
        args.out.write_text(f"`{command}`\n\n{table}\n")


if __name__ == "__main__":
    main()
