r"""Where a peer beats the mixture, per stretch of the stream, and whether any weighting of its experts could close it.

Usage:
    python benchmarks/expert_bound.py record --config configs/wordnet_minilm.yaml --samples 2000 --seeds 0 1 2 \
        --threads 1 --optimizers adamw_tuned frozen_linear_head --out <peers folder>
    python benchmarks/expert_bound.py bound <experts folder> <peers folder> \
        --optimizers adamw_tuned frozen_linear_head --learner-temperatures 0.5 0.7 0.85 1.25 1.5 2 --pools 0.5 1 \
        --stretches 0 100 500 1000 2000
    python benchmarks/expert_bound.py scores <peers folder> --optimizers adamw_tuned --at 500 1000 2000 \
        --bootstrap 200 --confidence-gap --ece-floor 200

``record`` runs ``compare.py``'s learners (the same arguments, ``--optimizers`` its names) and keeps each step's
prequential prediction ``(N, m)`` (float64) and labels in ``<optimizer>_seed<s>.pt``. ``bound`` reads those and a
folder of the mixture's recorded experts (``mixture_replay.py record``, the same stream and seeds) and prints, per
stretch of the stream, the mean prequential NLL (mean over the seeds) of:

- the mixture, replayed with the given setting (:func:`mixture_replay.replay_one`; the default's is its shares, the
  learner's temperatures and the pools given here), and its learner alone (the recorded first expert);
- the best constant linear mixture of the same experts chosen in hindsight on that stretch (EM on the weights): the
  lowest NLL any fixed weighting of these experts reaches there (weights that move within the stretch can do better);
- each peer alone;
- the mixture with the peer's prediction as one more expert (what a better expert would give).

Then, on the last stretch, the accuracy and the mean NLL of the right and of the wrong predictions of each. A screen of
the streams it is scored on, from the recordings, not a run of the learner. ``scores`` prints each recorded peer's
row per seed and their mean with the columns of ``mixture_replay.py replay`` (:func:`mixture_replay.scores`: its
ECE's resolution, its confidence gap, its ECE floor), so a peer's calibration reads as the mixture's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import common
import compare
import lightning.pytorch as pl
import mixture_replay
import torch
from torch import Tensor

TINY = torch.finfo(torch.float64).tiny


class PredictionRecorder(pl.Callback):
    """Keep each step's prediction ``(B, m)`` (float64) and labels, as the learner's online step returns them."""

    def __init__(self) -> None:
        self.predictions: list[Tensor] = []
        self.labels: list[Tensor] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Wrap the learner's online step to record what it scores."""
        online_step = pl_module.online_step
        step = online_step.step

        def recording(module: Any, optimizer: Any, inputs: Any, label: Tensor, **kwargs: Any) -> Any:
            prediction, label, applied = step(module, optimizer, inputs, label, **kwargs)
            self.predictions.append(prediction.detach().to(torch.float64).cpu())
            self.labels.append(label.detach().cpu())
            return prediction, label, applied

        online_step.step = recording  # type: ignore[method-assign]


def record(args: argparse.Namespace) -> None:
    """One run per learner and seed; ``<optimizer>_seed<s>.pt`` in ``--out``."""
    common.set_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    options = ["--samples", str(args.samples), "--optimizers", *args.optimizers, "--seeds", *map(str, args.seeds)]
    parsed = compare.parse_args([*(token for path in args.config for token in ("--config", str(path))), *options,
                                 "--", *args.overrides])  # fmt: skip
    for optimizer in args.optimizers:
        for seed in args.seeds:
            recorder = PredictionRecorder()
            with common.quiet(False):
                result = common.fit(compare.run_args(parsed, optimizer, seed), callbacks=[recorder])
            predictions, labels = torch.cat(recorder.predictions), torch.cat(recorder.labels)
            saved = {"predictions": predictions, "labels": labels, "command": result.command}
            saved["online_acc"] = result.online_acc[-1]
            torch.save(saved, args.out / f"{optimizer}_seed{seed}.pt")
            print(f"[record] {optimizer} seed {seed}: {len(labels)} samples, online acc {result.online_acc[-1]:.4f}")


def hindsight_mixture(likelihoods: Tensor, iterations: int = 1000) -> Tensor:
    """The weights ``(K,)`` of the linear mixture of maximum likelihood of the experts' ``p_k(y_t)`` ``(T, K)``.

    EM from uniform weights: no iteration lowers the likelihood, which is concave in the weights.
    """
    weights = torch.full((likelihoods.shape[1],), 1.0 / likelihoods.shape[1], dtype=torch.float64)
    for _ in range(iterations):
        responsibilities = likelihoods * weights
        weights = (responsibilities / responsibilities.sum(1, keepdim=True).clamp_min(TINY)).mean(0)
    return weights


def stretch_means(values: Tensor, edges: Sequence[int]) -> list[float]:
    """The mean of ``values`` over each stretch ``[edges[i], edges[i+1])``."""
    return [float(values[a:b].mean()) for a, b in zip(edges, edges[1:], strict=False)]


def split(predictions: Tensor, labels: Tensor) -> list[float]:
    """Accuracy, and the mean NLL of the right and of the wrong predictions (NaN where there are none)."""
    nll, right = mixture_replay.nll_of(predictions, labels), predictions.argmax(-1) == labels
    return [float(right.double().mean()), float(nll[right].mean()), float(nll[~right].mean())]


def setting(run: dict[str, Any], args: argparse.Namespace) -> tuple[Tensor, list[int]]:
    """The mixture's experts ``(N, K, m)`` of a recording with ``args``' setting, and the learner's indices."""
    experts, temperatures = run["experts"], run["temperatures"]
    nearest: list[Tensor] = []
    if run.get("nearest_mean"):  # recorded last: nearest class mean at each temperature
        experts, near = experts[:, : -len(temperatures)], experts[:, -len(temperatures) :]
        nearest = [near] + ([mixture_replay.nearest_vote(near[:, 0], run["labels"])] if args.nearest_vote else [])
    keep = list(range(experts.shape[1]))  # LoKO, LDA at each recorded temperature, its vote
    return mixture_replay.setting_experts(experts, keep, temperatures, args.learner_temperatures, args.pools, nearest)


def bound_rows(args: argparse.Namespace) -> tuple[dict[str, list[list[float]]], dict[str, list[list[float]]]]:
    """Per row, per seed: the stretches' mean NLL, and the last stretch's :func:`split`."""
    stretches: dict[str, list[list[float]]] = {}
    last: dict[str, list[list[float]]] = {}
    edges = args.stretches
    paths = sorted(args.experts.glob("experts_seed*.pt"))
    if not paths:
        raise SystemExit(f"No experts_seed*.pt in {args.experts}: record them with mixture_replay.py record")
    for path in paths:
        run = torch.load(path)
        seed, labels = path.stem.removeprefix("experts_seed"), run["labels"]
        if len(labels) < edges[-1]:
            raise SystemExit(f"{path} holds {len(labels)} samples, the last stretch ends at {edges[-1]}")
        experts, learners = setting(run, args)
        mixture = mixture_replay.replay_one(experts, labels, args.share, learners, None, args.share_past)
        likelihoods = experts[torch.arange(len(labels)), :, labels].exp()  # (N, K): p_k(y_t)
        hindsight = torch.cat([likelihoods[a:b] @ hindsight_mixture(likelihoods[a:b])
                               for a, b in zip(edges, edges[1:], strict=False)])  # fmt: skip
        window = slice(edges[-2], edges[-1])
        learner = run["experts"][:, 0].exp()  # the recorded learner's own prediction, the mixture's first expert
        rows = {
            "the mixture": (mixture_replay.nll_of(mixture, labels), mixture),
            "its learner alone": (mixture_replay.nll_of(learner, labels), learner),
            "its experts' best constant mixture, in hindsight per stretch": (-hindsight.log(), None),
        }
        for optimizer in args.optimizers:
            peer = torch.load(args.peers / f"{optimizer}_seed{seed}.pt")
            if not torch.equal(peer["labels"], labels):
                raise SystemExit(f"{optimizer} seed {seed}: another stream than {path}'s (the labels differ)")
            with_peer = torch.cat([experts, peer["predictions"].clamp_min(TINY).log()[:, None]], 1)
            mixed = mixture_replay.replay_one(with_peer, labels, args.share, learners, None, args.share_past)
            rows[f"{optimizer} alone"] = (mixture_replay.nll_of(peer["predictions"], labels), peer["predictions"])
            rows[f"the mixture + {optimizer} as an expert"] = (mixture_replay.nll_of(mixed, labels), mixed)
        for name, (nll, predictions) in rows.items():
            stretches.setdefault(name, []).append([*stretch_means(nll, edges), float(nll[: edges[-1]].mean())])
            if predictions is not None:
                last.setdefault(name, []).append(split(predictions[window], labels[window]))
    return stretches, last


def bound(args: argparse.Namespace) -> None:
    """Print the two tables (see the module)."""
    stretches, last = bound_rows(args)
    edges = args.stretches
    spans = [f"{a:,}-{b:,}" for a, b in zip(edges, edges[1:], strict=False)]
    print(f"Mean prequential NLL per stretch, mean over {len(next(iter(stretches.values())))} seed(s)")
    print(f"| | {' | '.join(spans)} | 0-{edges[-1]:,} |\n|---|{'---|' * (len(spans) + 1)}")
    for name, values in stretches.items():
        print(f"| {name} | {' | '.join(f'{statistics.mean(c):.3f}' for c in zip(*values, strict=True))} |")
    print(f"\nSamples {spans[-1]}: accuracy, mean NLL of the right and of the wrong predictions")
    print("| | accuracy (%) | NLL, right | NLL, wrong |\n|---|---|---|---|")
    for name, values in last.items():
        accuracy, right, wrong = (statistics.mean(c) for c in zip(*values, strict=True))
        print(f"| {name} | {100 * accuracy:.1f} | {right:.3f} | {wrong:.3f} |")


def scores(args: argparse.Namespace) -> None:
    """Print each recorded peer's :func:`mixture_replay.scores` per seed, and their mean."""
    rows = []
    for optimizer in args.optimizers:
        paths = sorted(args.peers.glob(f"{optimizer}_seed*.pt"))
        if not paths:
            raise SystemExit(f"No {optimizer}_seed*.pt in {args.peers}: record them with expert_bound.py record")
        seeds = []
        for path in paths:
            run = torch.load(path)
            score = mixture_replay.scores(run["predictions"], run["labels"], args.at, args.bootstrap,
                                          args.confidence_gap, args.ece_floor)  # fmt: skip
            seeds.append((f"{optimizer}, seed {path.stem.rsplit('_seed', 1)[1]}", score))
        rows += seeds
        if len(seeds) > 1:  # the mean over the seeds, as mixture_replay.py replay prints it without --per-seed
            rows.append((f"{optimizer}, mean of {len(seeds)}", {k: statistics.fmean(s[k] for _, s in seeds)
                                                                for k in seeds[0][1]}))  # fmt: skip
    keys = list(rows[0][1])
    print(f"| peer | {' | '.join(keys)} |\n|---|{'---|' * len(keys)}")
    for name, score in rows:
        print(f"| {name} | {' | '.join(mixture_replay.cell(k, v) for k, v in score.items())} |")


def main(argv: Sequence[str] | None = None) -> None:
    """Parse ``record``, ``bound`` or ``scores`` (arguments after ``--`` go to every recorded run)."""
    own, overrides = common.split_overrides(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    rec = mixture_replay.run_arguments(commands.add_parser("record"))
    rec.add_argument("--optimizers", nargs="+", required=True, help="compare.py's learner names")
    rec.add_argument("--out", type=Path, required=True)
    bnd = commands.add_parser("bound")
    bnd.add_argument("experts", type=Path, help="mixture_replay.py record's folder")
    bnd.add_argument("peers", type=Path, help="this script's record folder")
    bnd.add_argument("--optimizers", nargs="*", default=[])
    bnd.add_argument("--stretches", type=int, nargs="+", required=True, help="the stretches' edges, from 0")
    bnd.add_argument("--share", type=float, default=0.001)
    bnd.add_argument("--share-past", type=float, default=0.01)
    bnd.add_argument("--learner-temperatures", type=float, nargs="*", default=[])
    bnd.add_argument("--pools", type=float, nargs="*", default=[])
    bnd.add_argument("--nearest-vote", action="store_true", help="with recorded nearest class mean: its vote too")
    scr = commands.add_parser("scores")
    scr.add_argument("peers", type=Path, help="this script's record folder")
    scr.add_argument("--optimizers", nargs="+", required=True)
    scr.add_argument("--at", type=int, nargs="+", default=[])
    scr.add_argument("--bootstrap", type=int, default=0, help="as mixture_replay.py replay's")
    scr.add_argument("--confidence-gap", action="store_true", help="as mixture_replay.py replay's")
    scr.add_argument("--ece-floor", type=int, default=0, help="as mixture_replay.py replay's")
    args = parser.parse_args(own)
    args.overrides = overrides
    if args.command == "bound" and (len(args.stretches) < 2 or args.stretches != sorted(set(args.stretches))):
        parser.error("--stretches: at least two edges, increasing")
    {"record": record, "bound": bound, "scores": scores}[args.command](args)


if __name__ == "__main__":
    main()
