r"""Compare LoKO, LoRA/AdamW and LoRA/AdaGrad online on the same seeded streams, as in the paper's Figure 1.

Usage:
    python benchmarks/compare.py --config configs/fashion_mnist_lite0.yaml --samples 5000 --seeds 0 1 2 \
        --out results/fashion_mnist_lite0 [-- loko overrides, e.g. --data.source.image_size 64 --model.optimizer.p0 0.1]

Every run is the training of ``loko fit`` on the given config(s), built by the package's CLI (``benchmarks/common.py``
says what a benchmark run changes: no logger, checkpoints or validation; only the config's divergence guard kept):

- ``loko``: the config's own optimizer (LoKO) exactly as configured (``--loko as_configured``: the paper's filter
  for the shipped configs), with the overrides after ``--``; ``loko_default``: what ``loko fit`` runs without a preset
  (the default decided from the model, ``loko_lightning.cli.default``); ``loko_auto``: the config's LoKO with
  ``p0: auto`` (:mod:`loko_lightning.learner.selection`); ``loko_avg``: the same predicting with the average of the
  filter's mean (``average: 0.99``, not the paper's; ``docs/filters.md``); ``loko_mixture``,
  ``loko_mixture_bayes``, ``loko_mixture_sharp``: the same predicting with its mixture with streaming LDA on the
  frozen features (``configs/presets/loko_mixture_lda.yaml`` without its pools, as they were measured; the same with
  share 0, the same with the learner's prediction also sharpened at T = 0.5, 0.7, 0.85 as three more experts;
  ``docs/results/mixture.md``);
  ``loko_lda_head``, ``loko_lda_head_frozen``: the same on its logits plus streaming LDA's on the same (adapted)
  features or on the pretrained ones (``benchmarks/overlays/loko_lda_head.yaml``; ``docs/results/lda_head.md``);
- ``adamw``, ``adamw_tuned``, ``adagrad`` (and every other peer: ``schedulefree``, ``ivon``, ``posteriors``, the
  learning-rate-free ``prodigy``, ``dadaptation``, ``dog``, ``mechanic``, the frozen heads): the same plus the
  overlay ``configs/baselines/<name>.yaml`` (``--baseline-dir``), the AdamW schedule's ``total_iters`` set to the
  stream's steps; ``adamw_tuned`` chooses its learning rate online from the same budget as ``p0: auto`` (four
  candidates on the first 500 samples, ``--select-samples`` for both). Overrides of ``model.optimizer``,
  ``model.lr_scheduler`` and ``model.head_covariance`` go to the ``loko`` runs only (a baseline's optimizer has other
  arguments); the other overrides go to every run.

Each run gets ``--seed_everything seed --data.seed seed --data.max_samples N``: the three optimizers read the identical
stream (the permutation is the data seed) and build their network from the same global RNG state, so they start from
identical adapters and head (LoKO draws ``p̂₀`` from its own generator, seeded with ``seed``, not from the global
RNG). A callback copies the learner's prequential values (``train/online_acc``, ``train/loss_avg{window}``,
``train/ce_avg{window}``, ``train/step_time``) from ``trainer.callback_metrics`` after every step.

Outputs in ``--out``:

- ``metrics.csv``: one row per recorded step: ``optimizer, seed, step, online_acc, loss_avg, ce_avg, step_time``
  (``step`` counts samples from 1; ``--csv-every N`` keeps every N-th step and the last one).
- ``compare.png``: the paper's Figure 1: moving-average loss (L1 for images, cross-entropy for text, as in the
  paper) and average online accuracy against samples, one curve per optimizer (mean over seeds) with a shaded
  min–max band over seeds.
- ``results.md``: the table below, with the setting it was measured in and the command.
- ``summary.json``: the same numbers, machine-readable.

Table columns:

- *final online accuracy*: average online top-1 accuracy after the last sample (test-then-train), mean ± sample
  standard deviation over seeds, in percent, and each seed's value. A run stopped by the divergence guard is
  recorded as diverged and left out of the mean.
- *steps to convergence*: for one run with moving-average loss ``L(t)`` (the learner's ``window``; L1 for images,
  cross-entropy for text) over ``T`` steps, the smallest step ``s`` such that ``|L(t) - L(T)| <= --conv-tol`` for
  every ``t >= s`` (absolute, in the loss's units; the L1 loss lies in [0, 2]); mean ± std over seeds. A run whose
  ``s`` falls in the last window (``s > T - window``) is marked ``*``: its average was still moving when the stream
  ended, so ``s`` is a lower bound rather than a plateau.
- *step-time ratio vs AdamW*: the median per-step time of the optimizer (the learner's ``train/step_time``: forward,
  Jacobian or backward, and the update; data loading excluded), pooled over seeds after ``--warmup`` steps per run,
  divided by the median AdamW step time. The runs are executed one after another in this one process (not
  interleaved step by step); the optimizer order is rotated from seed to seed so that drifts in machine load do not
  always favour the same optimizer. Absolute times are not reported in the table (they are in the CSV).

``--table-from DIR --at 500 1000 ...`` runs nothing and prints the accuracy after that many samples from
``DIR/metrics.csv``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import common
import yaml

OPTIMIZERS = (
    "loko",
    "loko_default",
    "loko_auto",
    "loko_avg",
    "loko_posterior",
    "loko_mixture",
    "loko_mixture_bayes",
    "loko_mixture_sharp",
    "loko_lda_head",
    "loko_lda_head_frozen",
    "adamw",
    "adamw_tuned",
    "adamw_const",
    "adagrad",
    "schedulefree",
    "ivon",
    "posteriors",
    "prodigy",
    "dadaptation",
    "dog",
    "mechanic",
    "streaming_lda",
    "ncm",
    "frozen_linear_head",
)
LABELS = {
    "loko": "LoKO",
    "loko_default": "LoKO, the default (loko fit decides)",
    "loko_auto": "LoKO (p0: auto)",
    "loko_avg": "LoKO (averaged mean, 0.99)",
    "loko_posterior": "LoKO (posterior predictive)",
    "loko_mixture": "LoKO + frozen LDA mixture (presets/loko_mixture_lda)",
    "loko_mixture_bayes": "LoKO + frozen LDA mixture, Bayes (share 0)",
    "loko_mixture_sharp": "LoKO + frozen LDA mixture, LoKO also at T 0.5, 0.7, 0.85",
    "loko_lda_head": "LoKO + LDA head (benchmarks/overlays/loko_lda_head.yaml)",
    "loko_lda_head_frozen": "LoKO + LDA head on pretrained features",
    "adamw": "LoRA/AdamW",
    "adamw_tuned": "LoRA/AdamW (lr tuned)",
    "adamw_const": "LoRA/AdamW (lr tuned, constant)",
    "adagrad": "LoRA/AdaGrad",
    "schedulefree": "Schedule-free AdamW (lr tuned)",
    "ivon": "IVON (lr tuned)",
    "posteriors": "posteriors EKF (p0 tuned)",
    "prodigy": "Prodigy (no lr)",
    "dadaptation": "D-Adaptation Adam (no lr)",
    "dog": "DoG (no lr)",
    "mechanic": "Mechanic AdamW (no lr)",
    "streaming_lda": "Streaming LDA, frozen (OAS)",
    "ncm": "Nearest class mean, frozen",
    "frozen_linear_head": "Linear head, frozen, AdamW (lr tuned)",
}
COLORS = {
    "loko": "tab:red",
    "loko_default": "crimson",
    "loko_auto": "tab:orange",
    "loko_avg": "tab:gray",
    "loko_posterior": "tab:olive",
    "loko_mixture": "gold",
    "loko_mixture_bayes": "darkgoldenrod",
    "loko_mixture_sharp": "yellowgreen",
    "loko_lda_head": "tab:brown",
    "loko_lda_head_frozen": "sienna",
    "adamw": "tab:blue",
    "adamw_tuned": "tab:purple",
    "adamw_const": "tab:pink",
    "adagrad": "tab:green",
    "schedulefree": "tab:cyan",
    "ivon": "tab:brown",
    "posteriors": "tab:olive",
    "prodigy": "teal",
    "dadaptation": "navy",
    "dog": "olive",
    "mechanic": "indigo",
    "streaming_lda": "black",
    "ncm": "dimgray",
    "frozen_linear_head": "tab:blue",
}
# The mixture of the learner and streaming LDA on frozen features (loko_lightning.learner.mixture).
MIXTURE = common.ROOT / "configs" / "presets" / "loko_mixture_lda.yaml"
NO_POOLS = "--model.mixture.init_args.pools=[]"
# The learner's logits plus streaming LDA's on the same features (loko_lightning.learner.lda_head).
LDA_HEAD = common.ROOT / "benchmarks" / "overlays" / "loko_lda_head.yaml"
# The optimizers that are the config's own LoKO (the others are baseline overlays), and what they add to it: each
# runs the config as it is (`loko: as_configured`, after the configs), the default only deciding in `loko_default`.
AS_CONFIGURED = "--loko=as_configured"
LOKO_RUNS = {
    "loko": [AS_CONFIGURED],
    "loko_default": ["--loko=default"],
    "loko_auto": [AS_CONFIGURED, "--model.optimizer.p0=auto"],
    "loko_avg": [AS_CONFIGURED, "--model.optimizer.init_args.average=0.99"],
    "loko_posterior": [AS_CONFIGURED, "--model.predictive=posterior"],
    # The mixture as these names were measured: without the pools the preset now adds.
    "loko_mixture": [*common.config_args([MIXTURE]), AS_CONFIGURED, NO_POOLS],
    "loko_mixture_bayes": [
        *common.config_args([MIXTURE]),
        AS_CONFIGURED,
        NO_POOLS,
        "--model.mixture.init_args.share=0",
    ],
    "loko_mixture_sharp": [
        *common.config_args([MIXTURE]),
        AS_CONFIGURED,
        NO_POOLS,
        "--model.mixture.init_args.learner_temperatures=[0.5, 0.7, 0.85]",
    ],
    "loko_lda_head": [*common.config_args([LDA_HEAD]), AS_CONFIGURED],
    "loko_lda_head_frozen": [*common.config_args([LDA_HEAD]), AS_CONFIGURED, "--trainer.callbacks.features=pretrained"],
}
# The runs that choose a hyperparameter online (their candidates' samples: --select-samples).
SELECTING = ("loko_auto", "adamw_tuned", "adamw_const", "schedulefree", "ivon", "posteriors", "frozen_linear_head")
CSV_FIELDS = (
    "optimizer",
    "seed",
    "step",
    "samples",
    "online_acc",
    "recent_acc",
    "loss_avg",
    "ce_avg",
    "step_time",
    "nll",
    "nll_recent",
    "ece",
    "ece_recent",
)
# Overrides of these keys configure one optimizer: they go to the config's own (the loko runs), not to the baselines
# (model.head_covariance is a covariance of LoKO's filter, which a gradient optimizer refuses).
OPTIMIZER_KEYS = ("--model.optimizer", "--model.lr_scheduler", "--model.head_covariance")


@dataclass
class Run:
    """One (optimizer, seed) run and its recorded metrics."""

    optimizer: str
    seed: int
    result: common.RunResult


def run_args(args: argparse.Namespace, optimizer: str, seed: int) -> list[str]:
    """The ``loko fit`` arguments of one run (see the module docstring)."""
    overrides = common.option_groups(args.overrides)
    if optimizer not in LOKO_RUNS:
        overrides = [group for group in overrides if not group[0].startswith(OPTIMIZER_KEYS)]
    configs = list(args.config)
    if optimizer not in LOKO_RUNS:  # a LoKO overlay (a preset) configures the loko runs only
        configs = [path for path in configs if not loko_overlay(path)] + [args.baseline_dir / f"{optimizer}.yaml"]
    added = LOKO_RUNS.get(optimizer, [])
    pin = [token for token in added if token.startswith("--loko=")]  # before the overrides: `-- --loko ...` wins
    return [
        *common.config_args(configs),
        *pin,
        f"--seed_everything={seed}",
        f"--data.seed={seed}",
        f"--data.max_samples={args.samples}",
        *(token for group in overrides for token in group),
        *(token for token in added if token not in pin),
        *([f"--model.select.samples={args.select_samples}"] if args.select_samples and optimizer in SELECTING else []),
    ]


def loko_overlay(path: Path | str) -> bool:
    """Whether a config configures LoKO only: a ``model`` section alone, with a LoKO optimizer (the presets).

    Its keys (``head_covariance``, ``step_scales``, LoKO's arguments) are the loko runs' settings; a baseline keeps
    the experiment config's model and its own optimizer overlay.
    """
    config = yaml.safe_load(Path(path).read_text()) or {}
    model = config.get("model") if isinstance(config, dict) else None
    if not isinstance(config, dict) or set(config) - {"loko"} != {"model"} or not isinstance(model, dict):
        return False
    optimizer = model.get("optimizer")
    class_path = optimizer.get("class_path", "") if isinstance(optimizer, dict) else ""
    return class_path.rsplit(".", 1)[-1] == "LoKO"


def steps_to_convergence(loss: list[float], tol: float) -> int | None:
    """Smallest 1-based step ``s`` with ``|loss[t] - loss[-1]| <= tol`` for every ``t >= s`` (``None``: no data)."""
    finite = [v for v in loss if math.isfinite(v)]
    if not finite or len(finite) != len(loss):
        return None
    final = loss[-1]
    s = len(loss)
    for t in range(len(loss) - 1, -1, -1):
        if abs(loss[t] - final) > tol:
            break
        s = t + 1
    return s


# The samples after which summary.json records the average online accuracy, the prequential NLL and the ECE (those a
# stream reaches).
CHECKPOINTS = (100, 250, 500, 750, 1000, 2000, 3000, 4000, 4500, 5000)


def checkpoint_values(result: common.RunResult, name: str = "online_acc") -> dict[int, float]:
    """A run's per-step value after each of :data:`CHECKPOINTS` samples that it reached.

    ``name``: the :class:`~common.RunResult` field, the average online accuracy unless given (``"nll"``, ``"ece"``).
    """
    found = {}
    for samples, value in zip(result.samples, getattr(result, name), strict=False):
        if samples in CHECKPOINTS:
            found[samples] = value
    return found


def _mean_std(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return mean, std


# The calibration a comparison reports beside accuracy (RunResult/CSV fields): the prequential negative log-likelihood
# and expected calibration error (15 bins), over the stream and over the recent window.
CALIBRATION = ("nll", "nll_recent", "ece", "ece_recent")

# The moving-average loss a comparison reports: (the RunResult/CSV field, its name in words).
LOSSES = {"l1": ("loss_avg", "L1 loss"), "ce": ("ce_avg", "cross-entropy")}


def summarize(
    runs: list[Run], optimizers: Sequence[str], *, warmup: int, conv_tol: float, loss: str = "l1"
) -> dict[str, dict[str, Any]]:
    """Per-optimizer final accuracy, steps to convergence and step-time ratio against AdamW."""
    medians: dict[str, float] = {}
    summary: dict[str, dict[str, Any]] = {}
    for optimizer in optimizers:
        mine = [run for run in runs if run.optimizer == optimizer]
        times = [t for run in mine for t in run.result.step_time[warmup:] if math.isfinite(t)]
        medians[optimizer] = statistics.median(times) if times else math.nan
        finals = [run.result.online_acc[-1] for run in mine if run.result.steps and run.result.diverged is None]
        conv = {
            run.seed: steps_to_convergence(getattr(run.result, LOSSES[loss][0]), conv_tol)
            for run in mine
            if run.result.diverged is None
        }
        late = {
            run.seed: conv[run.seed] is not None and conv[run.seed] > run.result.steps - run.result.window
            for run in mine
            if run.seed in conv
        }
        mean, std = _mean_std(finals) if finals else (math.nan, math.nan)
        summary[optimizer] = {
            "final_online_acc": {run.seed: run.result.online_acc[-1] if run.result.steps else math.nan for run in mine},
            "final_online_acc_mean": mean,
            "final_online_acc_std": std,
            "steps_to_convergence": conv,
            "converged_in_last_window": late,
            "diverged": {run.seed: run.result.diverged for run in mine if run.result.diverged},
            "median_step_time_s": medians[optimizer],
            "steps": {run.seed: run.result.steps for run in mine},
            "wall_s": {run.seed: run.result.wall_s for run in mine},
            "selection": {run.seed: run.result.selection for run in mine if run.result.selection},
            # The average online accuracy after the checkpoints a results table quotes, and the recent accuracy at
            # the end: kept in summary.json (in git) where metrics.csv (not in git) has the whole curve.
            "online_acc_at": {run.seed: checkpoint_values(run.result) for run in mine},
            # The stream's NLL and ECE so far at the same checkpoints: a longer run's value at 2,000 is a learner's
            # that does not know the stream ends there (AdamW's schedule decays to 0 at the stream's last sample).
            **{
                f"{name}_at": {
                    run.seed: checkpoint_values(run.result, name) for run in mine if run.result.diverged is None
                }
                for name in ("nll", "ece")
            },
            "final_recent_acc": {run.seed: run.result.recent_acc[-1] for run in mine if run.result.recent_acc},
            **{
                f"final_{name}": {
                    run.seed: getattr(run.result, name)[-1]
                    for run in mine
                    if getattr(run.result, name) and run.result.diverged is None
                }
                for name in CALIBRATION
            },
        }
    reference = medians.get("adamw", math.nan)
    for optimizer in optimizers:
        summary[optimizer]["step_time_ratio_vs_adamw"] = medians[optimizer] / reference
    return summary


def markdown_table(summary: dict[str, dict[str, Any]]) -> str:
    """The results table (ratios only, no absolute times), one row per optimizer in ``summary``'s order."""
    lines = [
        "| optimizer | final online accuracy (%) | per seed (%) | prequential NLL | ECE (%) | steps to convergence "
        "| step-time ratio vs AdamW |",
        "|---|---|---|---|---|---|---|",
    ]
    for optimizer, entry in summary.items():
        per_seed = ", ".join(f"{100 * v:.2f}" for v in entry["final_online_acc"].values())
        acc = f"{100 * entry['final_online_acc_mean']:.2f} ± {100 * entry['final_online_acc_std']:.2f}"
        if entry["diverged"]:
            acc += f" (diverged: seeds {', '.join(str(s) for s in entry['diverged'])})"
        conv = [s for s in entry["steps_to_convergence"].values() if s is not None]
        if conv:
            mean, std = _mean_std([float(s) for s in conv])
            marks = "*" if any(entry["converged_in_last_window"].values()) else ""
            conv_text = f"{mean:,.0f} ± {std:,.0f}{marks}"
        else:
            conv_text = "n/a"
        ratio = entry["step_time_ratio_vs_adamw"]
        ratio_text = f"{ratio:.2f}" if math.isfinite(ratio) else "n/a (no AdamW run)"
        nll, ece = (_spread(list(entry[f"final_{name}"].values()), scale) for name, scale in (("nll", 1), ("ece", 100)))
        lines.append(f"| {LABELS[optimizer]} | {acc} | {per_seed} | {nll} | {ece} | {conv_text} | {ratio_text} |")
    return "\n".join(lines)


def _spread(values: list[float], scale: float) -> str:
    """``mean ± std`` of the finite ``values`` times ``scale``, ``n/a`` without any."""
    finite = [scale * v for v in values if math.isfinite(v)]
    if not finite:
        return "n/a"
    mean, std = _mean_std(finite)
    return f"{mean:.3f} ± {std:.3f}" if scale == 1 else f"{mean:.1f} ± {std:.1f}"


def csv_rows(runs: list[Run], every: int) -> list[list[Any]]:
    """Per-step metrics rows, keeping every ``every``-th step and each run's last one."""
    rows = []
    for run in runs:
        r = run.result
        for i in range(r.steps):
            step = i + 1
            if step % every and step != r.steps:
                continue
            samples = r.samples[i] if r.samples else step
            recent = r.recent_acc[i] if r.recent_acc else math.nan
            calibration = [getattr(r, name)[i] if getattr(r, name) else math.nan for name in CALIBRATION]
            values = (r.online_acc[i], recent, r.loss_avg[i], r.ce_avg[i], r.step_time[i], *calibration)
            rows.append([run.optimizer, run.seed, step, samples, *(f"{v:.6g}" for v in values)])
    return rows


def curve_table(paths: Path | Sequence[Path], at: list[int], loss: str = "l1", pool: bool = False) -> str:
    """The accuracy-after-N-samples table of ``metrics.csv`` files written by this script (several: one table).

    Average online accuracy, the recent-window accuracy (the last ``recent_window`` predictions; a CSV without that
    column, from before it existed, gives none) and the moving-average loss (``loss``: ``"l1"`` or ``"ce"``) after
    each of ``at`` samples, mean ± sample std over seeds, one row per optimizer (and per file, named after its folder
    and that folder's parent, when there are several; with ``pool``, one row per optimizer over all the files: the
    same comparison run again for more seeds, a seed in two files is an error). A run's value after ``N`` samples
    is its first recorded step with at least ``N`` samples (``N`` itself with one sample a step; with ``B`` samples a
    step, the step that reaches ``N``); a run whose CSV has no such step within one ``--csv-every`` of ``N``
    (thinned) is an error, and so is an ``N`` no run reached; a run whose CSV ends before an ``N`` another run
    reached stopped there (diverged, or shorter): the cell pools the other seeds and says how many stopped.
    """
    field, loss_name = LOSSES[loss]
    paths = [paths] if isinstance(paths, Path) else list(paths)
    rows: dict[tuple[str, int], list[dict[str, str]]] = {}
    names: dict[str, str] = {}  # row key -> its label
    owners: dict[tuple[str, int], Path] = {}  # (row key, seed) -> the file it came from
    optimizers = []
    for path in paths:
        keys = {}
        with path.open(newline="") as handle:
            for row in csv.DictReader(handle):
                key = row["optimizer"] if len(paths) == 1 or pool else f"{row['optimizer']}@{_where(path)}"
                keys[key] = row["optimizer"]
                owner = owners.setdefault((key, int(row["seed"])), path)
                if owner != path:
                    raise SystemExit(
                        f"compare.py: --pool: {row['optimizer']} seed {row['seed']} is in both {owner} and {path} "
                        "(pool only runs of one setting over different seeds)"
                    )
                rows.setdefault((key, int(row["seed"])), []).append(row)
        for optimizer in [o for o in OPTIMIZERS if o in keys.values()] + sorted(set(keys.values()) - set(OPTIMIZERS)):
            for key, name in keys.items():
                if name == optimizer and key not in names:
                    optimizers.append(key)
                    label = LABELS.get(optimizer, optimizer)
                    names[key] = label if len(paths) == 1 or pool else f"{label} ({_where(path)})"
    path = paths[0] if len(paths) == 1 else ", ".join(map(str, paths))
    values: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    stopped: dict[tuple[str, int], int] = {}  # seeds whose run ended before N
    missing = []
    for (optimizer, _seed), run in rows.items():
        per_step = max(int(run[0].get("samples") or run[0]["step"]) // int(run[0]["step"]), 1)
        for n in at:
            row = next((r for r in run if int(r.get("samples") or r["step"]) >= n), None)
            reached = int(row.get("samples") or row["step"]) if row is not None else None
            if reached is None:
                stopped[optimizer, n] = stopped.get((optimizer, n), 0) + 1
                continue
            elif reached - n >= per_step:
                missing.append(f"{optimizer}@{n}")
                continue
            recent = float(row["recent_acc"]) if row.get("recent_acc") else math.nan
            nll = float(row["nll"]) if row.get("nll") else math.nan
            ece = 100 * float(row["ece"]) if row.get("ece") else math.nan
            values.setdefault((optimizer, n), []).append(
                (100 * float(row["online_acc"]), 100 * recent, float(row[field]), nll, ece)
            )
    reached_by_some = {n for _, n in values}
    missing += [f"{optimizer}@{n}" for optimizer, n in stopped if n not in reached_by_some]
    if not optimizers or missing:
        missing_text = ", ".join(dict.fromkeys(missing)) or "any optimizer"
        raise SystemExit(f"compare.py: {path} has no rows for {missing_text} (--csv-every?)")
    header = " | ".join(f"after {n:,}" for n in at)
    lines = [
        f"| optimizer | {header} |",
        "|---|" + "---|" * len(at),
    ]
    has_recent = has_calibration = False
    for optimizer in optimizers:
        cells = []
        for n in at:
            ended = stopped.get((optimizer, n), 0)
            ended_text = f"stopped before in {ended} of {ended + len(values.get((optimizer, n), []))} seeds"
            if (optimizer, n) not in values:
                cells.append(ended_text)
                continue
            accs, recents, losses, nlls, eces = zip(*values[optimizer, n], strict=True)
            acc_mean, acc_std = _mean_std(list(accs))
            loss_mean, _ = _mean_std(list(losses))
            cell = f"{acc_mean:.1f} ± {acc_std:.1f} %"
            if all(math.isfinite(r) for r in recents):
                has_recent = True
                recent_mean, recent_std = _mean_std(list(recents))
                cell += f", recent {recent_mean:.1f} ± {recent_std:.1f} %"
            cell += f" ({'L1' if loss == 'l1' else 'CE'} {loss_mean:.3f}"
            if all(math.isfinite(v) for v in nlls + eces):
                has_calibration = True
                cell += f"; NLL {statistics.fmean(nlls):.3f}, ECE {statistics.fmean(eces):.1f} %"
            cells.append(cell + (f"; {ended_text})" if ended else ")"))
        lines.append(f"| {names[optimizer]} | {' | '.join(cells)} |")
    counts = {len(values.get((o, n), [])) + stopped.get((o, n), 0) for o in optimizers for n in at}
    seeds = ", ".join(str(count) for count in sorted(counts))
    lines.append("")
    recent_text = (
        "; recent: the accuracy of the last predictions (the learner's recent_window) then, mean ± std"
        if has_recent
        else ""
    )
    calibration_text = (
        "; NLL and ECE: the prequential negative log-likelihood and expected calibration error (15 bins) of every "
        "prediction until then, mean over seeds"
        if has_calibration
        else ""
    )
    lines.append(
        f"Average online accuracy after that many samples, mean ± sample std over {seeds} seeds{recent_text}; and "
        f"the mean moving-average {loss_name} then{calibration_text}."
    )
    return "\n".join(lines)


def _where(path: Path) -> str:
    """A ``metrics.csv``'s folder and its parent (``fmnist32/p0_0.05``): the row name in a table of several."""
    return f"{path.parent.parent.name}/{path.parent.name}"


def plot(runs: list[Run], optimizers: Sequence[str], path: Path, title: str, loss: str = "l1") -> None:
    """Figure 1 of the paper: moving-average loss (L1, or cross-entropy for text) and online accuracy vs samples."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    recent = all(run.result.recent_acc for run in runs)
    fig, axes = plt.subplots(1, 3 if recent else 2, figsize=(16 if recent else 11, 4))
    ax_loss, ax_acc = axes[0], axes[1]
    seeds = sorted({run.seed for run in runs})
    window = next((run.result.window for run in runs), 0)
    for optimizer in optimizers:
        results = [run.result for run in runs if run.optimizer == optimizer and run.result.steps]
        if not results:
            continue
        length = min(r.steps for r in results)
        x = np.array(results[0].samples[:length]) if results[0].samples else np.arange(1, length + 1)
        panels = [(ax_loss, LOSSES[loss][0], 1.0), (ax_acc, "online_acc", 100.0)]
        if recent:
            panels.append((axes[2], "recent_acc", 100.0))
        for axis, name, scale in panels:
            curves = scale * np.array([getattr(r, name)[:length] for r in results], dtype=float)
            axis.plot(x, curves.mean(0), color=COLORS[optimizer], label=LABELS[optimizer], lw=1.4)
            if len(results) > 1:
                axis.fill_between(x, curves.min(0), curves.max(0), color=COLORS[optimizer], alpha=0.2, lw=0)
    ax_loss.set(xlabel="samples", ylabel=f"{LOSSES[loss][1]}, moving average ({window})", title="Loss")
    ax_acc.set(xlabel="samples", ylabel="average online accuracy (%)", title="Online accuracy")
    if recent:
        axes[2].set(xlabel="samples", ylabel="online accuracy of the last predictions (%)", title="Recent accuracy")
    for axis in axes:
        axis.grid(alpha=0.3)
        axis.legend()
    band = "min–max band over seeds" if len(seeds) > 1 else "one seed"
    fig.suptitle(f"{title} (mean of {len(seeds)} seed(s), {band})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_reliability(runs: list[Run], optimizers: Sequence[str], path: Path, title: str) -> bool:
    """The reliability diagram of every prediction of the stream: accuracy against confidence, per optimizer.

    Each optimizer's bins are pooled over its seeds (the predictions, their confidence and hits summed per bin); a
    bin's point sits at its mean confidence and accuracy, sized by its share of the predictions. Returns whether there
    was anything to plot (runs from before the learner recorded the bins have none).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    pooled = {}
    for optimizer in optimizers:
        mine = [run.result.reliability for run in runs if run.optimizer == optimizer and run.result.reliability]
        bins = [np.array(reliability) for reliability in mine]
        if bins:
            pooled[optimizer] = np.sum(bins, axis=0)
    if not pooled:
        return False
    fig, axis = plt.subplots(figsize=(5.5, 5))
    axis.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--", label="calibrated")
    for optimizer, (count, confidence, hits) in pooled.items():
        used = count > 0
        mean_conf, accuracy = confidence[used] / count[used], hits[used] / count[used]
        ece = float(np.abs(hits - confidence).sum() / count.sum())
        label = f"{LABELS[optimizer]} (ECE {100 * ece:.1f} %)"
        axis.plot(mean_conf, accuracy, color=COLORS[optimizer], lw=1.2, label=label)
        axis.scatter(mean_conf, accuracy, s=400 * count[used] / count.sum(), color=COLORS[optimizer], alpha=0.6)
    axis.set(xlabel="confidence (top-1 probability)", ylabel="accuracy", xlim=(0, 1), ylim=(0, 1))
    axis.set_title(f"{title}: reliability of every prediction", fontsize=9)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return True


def setting_text(runs: list[Run], args: argparse.Namespace) -> str:
    """What was measured: the network and data (the same for every run), each optimizer, the streams."""
    first: dict[str, common.RunResult] = {}
    for run in runs:
        first.setdefault(run.optimizer, run.result)
    any_run = next(iter(first.values())).setting
    optimizers = "; ".join(
        f"{LABELS[name]}: {first[name].setting['optimizer']}, scheduler {first[name].setting['lr_scheduler']}"
        for name in args.optimizers
        if name in first
    )
    return (
        f"{any_run['network']} ({any_run['adapters']}), {any_run['dataset']} at {any_run['image_size']}, "
        f"{args.samples} samples/run, "
        f"seeds {', '.join(map(str, args.seeds))}, moving-average window {any_run['window']}; {optimizers}"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line: this script's options, then ``--`` and ``loko`` overrides."""
    own, overrides = common.split_overrides(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        description="Run LoKO, LoRA/AdamW and LoRA/AdaGrad online on the same seeded streams from the same initial "
        "weights, each run built from `loko` configs; write per-step metrics (CSV), the paper's Figure 1 (PNG) and a "
        "results table (markdown). Arguments after `--` are `loko fit` overrides (e.g. -- --data.source.image_size 32);"
        " "
        "model.optimizer/model.lr_scheduler/model.head_covariance overrides and --config overlays that configure LoKO "
        "only (a model section with a LoKO optimizer: the presets) go to the loko runs only.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Steps to convergence: smallest step s with |L(t) - L(T)| <= --conv-tol for all t >= s, L the "
        "moving-average L1 loss, T the last step ('*': s within the last window, still moving). Step-time ratio: "
        "median per-step time (after --warmup steps, pooled over seeds) / AdamW's, the runs executed one after "
        "another in this process with the optimizer order rotated per seed.",
    )
    runs = parser.add_argument_group("runs")
    runs.add_argument(
        "--config",
        type=Path,
        action="append",
        default=None,
        help="a `loko` config (repeatable, a later one overrides an earlier one); required unless --table-from",
    )
    runs.add_argument("--samples", type=int, default=1000, help="samples per run (data.max_samples)")
    runs.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="stream and initialisation seeds")
    runs.add_argument(
        "--optimizers",
        nargs="+",
        default=["loko", "adamw", "adagrad"],
        choices=OPTIMIZERS,
        help="to compare: loko (the config's own), loko_auto (the same with p0: auto), loko_avg (predicting with the "
        "average of the filter's mean, average 0.99), loko_posterior (scoring the posterior predictive), "
        "loko_mixture(_bayes) (its mixture with frozen LDA), loko_lda_head (its logits plus streaming LDA's), and "
        "the baselines, each the overlay "
        "configs/baselines/<name>.yaml (adamw_tuned: AdamW with lr chosen online from p0: auto's budget)",
    )
    runs.add_argument(
        "--baseline-dir", type=Path, default=common.BASELINES, help="where the baselines' <name>.yaml overlays are"
    )
    runs.add_argument(
        "--select-samples",
        type=int,
        default=None,
        help="samples the candidates of loko_auto and adamw_tuned run side by side on (default: their configs', 500)",
    )
    runs.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    runs.add_argument("--verbose", action="store_true", help="Lightning's info messages")
    output = parser.add_argument_group("output")
    output.add_argument("--out", type=Path, default=Path("results/compare"), help="output directory")
    output.add_argument("--csv-every", type=int, default=1, help="keep every N-th step in metrics.csv")
    output.add_argument("--conv-tol", type=float, default=0.05, help="steps-to-convergence tolerance (loss units)")
    output.add_argument(
        "--loss",
        choices=("auto", "l1", "ce"),
        default="auto",
        help="the moving-average loss of the plot, the convergence column and --at tables; auto: cross-entropy for "
        "text (the paper's text loss), L1 for images",
    )
    output.add_argument("--warmup", type=int, default=10, help="steps per run left out of the step-time medians")
    output.add_argument("--title", default=None, help="figure title (default: dataset and backbone)")
    output.add_argument("--print-every", type=int, default=0, help="progress line every N steps (0: none)")
    output.add_argument(
        "--table-from",
        type=Path,
        nargs="+",
        default=None,
        metavar="DIR",
        help="run nothing: print the accuracy/loss-after-N-samples table of DIR/metrics.csv (see --at); several DIRs "
        "make one table, each row named after its DIR too (see --pool)",
    )
    output.add_argument(
        "--pool",
        action="store_true",
        help="with several --table-from DIRs: one row per optimizer over all of them (the same setting run again for "
        "other seeds)",
    )
    output.add_argument("--at", type=int, nargs="+", default=[500, 1000, 2000, 5000], help="samples for --table-from")
    args = parser.parse_args(own)
    args.overrides = overrides
    if args.table_from is None and not args.config:
        parser.error("--config is required (unless --table-from)")
    if args.samples < 1 or args.csv_every < 1:
        parser.error("--samples and --csv-every must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    """Run the comparison and write the outputs; returns the summary."""
    args = parse_args(argv)
    if args.table_from is not None:
        loss = args.loss
        if loss == "auto":  # the loss the (first) comparison itself reported (summary.json), else L1
            summary_file = args.table_from[0] / "summary.json"
            loss = json.loads(summary_file.read_text()).get("loss", "l1") if summary_file.is_file() else "l1"
        print(curve_table([directory / "metrics.csv" for directory in args.table_from], args.at, loss, args.pool))
        return {}
    command = " ".join(sys.argv[1:] if argv is None else argv)
    with common.quiet(args.verbose):
        return _main(args, command)


def _main(args: argparse.Namespace, command: str) -> dict[str, dict[str, Any]]:
    common.set_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    runs: list[Run] = []
    started = time.perf_counter()
    for index, seed in enumerate(args.seeds):
        shift = index % len(args.optimizers)
        for optimizer in args.optimizers[shift:] + args.optimizers[:shift]:
            label = f"[compare] {optimizer} seed {seed}"
            result = common.fit(run_args(args, optimizer, seed), print_every=args.print_every, label=label)
            runs.append(Run(optimizer, seed, result))
            status = f" DIVERGED: {result.diverged}" if result.diverged else ""
            if result.selection:
                status += f"; {result.selection}"
            acc = result.online_acc[-1] if result.steps else math.nan
            print(
                f"[compare] {optimizer:8s} seed {seed}: {result.steps} steps, online acc {100 * acc:.2f}%, "
                f"wall {result.wall_s:.0f} s{status}",
                flush=True,
            )
    runs.sort(key=lambda run: (args.optimizers.index(run.optimizer), run.seed))
    loss = args.loss if args.loss != "auto" else ("ce" if runs[0].result.setting.get("modality") == "text" else "l1")
    summary = summarize(runs, args.optimizers, warmup=args.warmup, conv_tol=args.conv_tol, loss=loss)
    setting = setting_text(runs, args)
    first = runs[0].result.setting
    title = args.title or f"{first['dataset']} / {first['backbone']} @ {first['image_size']}"
    common.write_csv(args.out / "metrics.csv", CSV_FIELDS, csv_rows(runs, args.csv_every))
    plot(runs, args.optimizers, args.out / "compare.png", title, loss)
    plot_reliability(runs, args.optimizers, args.out / "reliability.png", title)
    table = markdown_table(summary)
    window = runs[0].result.window
    total = time.perf_counter() - started
    reproduce = "\n".join(
        f"- {LABELS[name]}: `loko fit {' '.join(run.result.command)}`"
        for name in args.optimizers
        for run in runs
        if run.optimizer == name and run.seed == args.seeds[0]
    )
    text = (
        f"# {title}\n\nSetting: {setting}.\n\n{table}\n\n"
        f"Final online accuracy: mean ± sample std over seeds. Steps to convergence: smallest step s with "
        f"|L(t) − L(T)| ≤ {args.conv_tol:g} for all t ≥ s, L = moving-average {LOSSES[loss][1]} (window {window}), "
        f"T = last step; '*' = at least one seed converged only within the last window (still moving). "
        f"Step-time ratio: median per-step time (the learner's train/step_time, after {args.warmup} warm-up steps, "
        f"pooled over seeds) / AdamW's median; the runs ran one after another in one process on the same streams, "
        f"optimizer order rotated per seed. Prequential NLL and ECE: the negative log-likelihood and expected "
        f"calibration error (15 bins) of every prediction of the stream, each made before its update, mean ± std over "
        f"seeds (reliability.png: the reliability diagram).\n\nCommand: `python benchmarks/compare.py {command}` "
        f"({total / 60:.1f} min wall). The runs of seed {args.seeds[0]} train as:\n\n{reproduce}\n"
    )
    (args.out / "results.md").write_text(text)
    (args.out / "summary.json").write_text(json.dumps({"setting": setting, "loss": loss, "results": summary}, indent=2))
    print(table)
    written = "metrics.csv, compare.png, reliability.png, results.md, summary.json"
    print(f"[compare] wrote {args.out}/{written} ({total / 60:.1f} min)")
    return summary


if __name__ == "__main__":
    main()
