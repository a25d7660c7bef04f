r"""Record the mixture's experts on a stream once, then replay the mixture arithmetic for many settings.

Usage:
    python benchmarks/mixture_replay.py record --config configs/debug.yaml --samples 300 --seeds 0 1 2 --threads 1 \
        --out results/mixture/experts_debug
    python benchmarks/mixture_replay.py replay results/mixture/experts_debug --shares 0 0.01 0.03 --at 100 200 300

The experts of :mod:`loko_lightning.learner.mixture` do not depend on the mixture: LoKO's path is its own (the
learner-level test checks it bit for bit) and streaming LDA learns from the frozen features and the labels alone. So
one run per seed with a wide temperature grid (``record``: each step's ``(K, m)`` log probabilities of the experts,
LoKO, LDA at each temperature and LDA's vote, and the label, in ``experts_seed<s>.pt``) gives, by replaying
:func:`~loko_lightning.learner.mixing.update_mixture_weights` and
:func:`~loko_lightning.learner.mixing.mixture_log_predictive`, the prequential score the learner would make for any
share ``α`` and subset of the experts (uniform prior; ``replay``). A setting chosen this way is chosen on the stream
it is scored on: a screen; confirm the chosen one with ``compare.py``.

``replay`` prints one row per setting: online accuracy after each ``--at``, prequential NLL and ECE (15 bins, the
learner's definition) over the whole stream, mean over the recorded seeds; the experts alone first. With
``--learner-temperatures``, each setting again with LoKO's recorded prediction tempered at those temperatures as more
experts (a screen of calibrating the learner's expert inside the mixture); with ``--pools``, each setting again with
the log-linear pools of LoKO's recorded prediction and LDA's (:func:`~loko_lightning.learner.mixing.\
pooled_log_probabilities` at those powers and each kept temperature; LDA's logits read from its recorded ``T = 1`` log
probabilities, equal up to a constant a pool does not see: the learner's arithmetic to float64 rounding); with
``--calibrate``, each setting's
prediction tempered at those temperatures and mixed again by Bayes' weights (fixed share ``--calibrate-share``): a
calibration of the whole mixture that keeps its argmax where one temperature dominates. With ``--shares-past``,
each setting again with that share going to the mean of the past posteriors (mixing past posteriors) beside fixed
share's. With ``--bootstrap B``, one more column: the standard deviation of each row's ECE over ``B`` resamples of its
predictions (:func:`scores`), the resolution of an ECE from one run. With ``--confidence-gap``, one more column: the
mean top-1 confidence minus the accuracy over the whole stream (points; below 0: underconfident), the sign the ECE
does not show. With ``--ece-floor B``, one more: the mean ECE of the same predictions over ``B`` streams of labels drawn
from them (each label from its prediction's own distribution: perfectly calibrated by construction), the ECE that
sampling alone gives a calibrated learner with these confidences on a stream this long. Where LoKO's filter forms
``H P Hᵀ`` (the covariance filter), ``record`` keeps it too, the belief before each sample (``prediction_cov``); with
``--posterior`` the replay scores LoKO's posterior predictive at those ``κ`` alone and chosen online (``predictive:
posterior``'s arithmetic, :func:`posterior_experts`), and each setting again with them as more experts. With
``--late L``, two more columns: each row's NLL over its last ``L`` predictions and at the one temperature best for them
in hindsight (:func:`scores`). With ``--learned-pool``, LoKO's and LDA's log-linear pool with its powers learned online
(:func:`learned_pool`) at those ``γ``, alone and as more experts of each setting.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import common
import lightning.pytorch as pl
import torch
from torch import Tensor

from loko_lightning.kalman.predictive import mean_field_predictive, sample_blocks
from loko_lightning.learner.mixing import (
    mixture_log_predictive,
    pooled_log_probabilities,
    update_mixture_weights,
    vote_log_probabilities,
)
from loko_lightning.learner.mixture_step import MixtureStep

PRESET = common.ROOT / "configs" / "presets" / "loko_mixture_lda.yaml"

#: The recorded temperature grid: LDA's own (1) to 4096x softer, by factors of 2.
WIDE = [float(2**k) for k in range(13)]
#: ``--late``'s temperatures tried in hindsight on the window (0.5-2 by steps of 0.05, 1 among them).
HINDSIGHT = [round(0.5 + 0.05 * k, 2) for k in range(31)]


class ExpertRecorder(pl.Callback):
    """Keep each step's experts' log probabilities ``(K, m)`` (float64) and label, from the learner's mixture step."""

    def __init__(self) -> None:
        self.experts: list[Tensor] = []
        self.labels: list[Tensor] = []
        self.covs: list[Tensor | None] = []  # each step's H P Hᵀ blocks (B, m, m), LoKO's covariance filter only
        self.nearest_mean = False  # whether the step's experts end with nearest class mean's at each temperature

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Wrap the mixture step's :meth:`~loko_lightning.learner.mixture_step.MixtureStep.experts` to record it."""
        step = pl_module.online_step
        assert isinstance(step, MixtureStep)
        experts, self.nearest_mean = step.experts, step.nearest_mean

        def recording(learner: Tensor, lda_logits: Tensor, nearest_logits: Tensor | None = None) -> Tensor:
            out = experts(learner, lda_logits, nearest_logits)
            self.experts.append(out.detach().cpu().transpose(0, 1))  # (B, K, m)
            return out

        step.experts = recording  # type: ignore[method-assign]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        """The step's labels, and the covariance of LoKO's prediction where its filter forms one."""
        self.labels.append(batch["label"].detach().cpu())
        cov = getattr(trainer.optimizers[0], "prediction_cov", None)
        blocks = None if cov is None else sample_blocks(cov.detach().to(torch.float64).cpu(), len(self.labels[-1]))
        self.covs.append(blocks)


def record(args: argparse.Namespace) -> None:
    """One LoKO + LDA run per seed with the wide grid; ``experts_seed<s>.pt`` in ``--out``."""
    common.set_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    mixture = common.config_args([PRESET])  # the preset's mixture (its head, LDA), with the recorded grid and vote
    mixture += [f"--model.mixture.init_args.temperatures=[{', '.join(str(t) for t in args.temperatures)}]"]
    mixture += ["--model.mixture.init_args.vote=true", "--model.mixture.init_args.learner_temperatures=[]"]
    mixture += ["--model.mixture.init_args.pools=[]"]  # the replay pools the recorded experts itself (--pools)
    for seed in args.seeds:
        recorder = ExpertRecorder()
        run_args = [*common.config_args(args.config), f"--seed_everything={seed}", f"--data.seed={seed}"]
        run_args += [f"--data.max_samples={args.samples}", *mixture, *args.overrides]
        with common.quiet(False):
            result = common.fit(run_args, callbacks=[recorder])
        experts, labels = torch.cat(recorder.experts), torch.cat(recorder.labels)
        covs = recorder.covs
        prediction_cov = torch.cat(covs) if covs and all(c is not None for c in covs) else None  # type: ignore[arg-type]
        torch.save(
            {
                "experts": experts,
                "labels": labels,
                "temperatures": args.temperatures,
                "vote": True,
                "nearest_mean": recorder.nearest_mean,
                "prediction_cov": prediction_cov,
                "command": result.command,
                "online_acc": result.online_acc,
            },
            args.out / f"experts_seed{seed}.pt",
        )
        print(f"[record] seed {seed}: {len(labels)} samples, LoKO + mixture online acc {result.online_acc[-1]:.4f}")


def ece(predictions: Tensor, labels: Tensor, bins: int = 15) -> float:
    """Expected calibration error of the top-1 predictions ``(N, m)`` (the learner's 15 equal bins, 1.0 its own)."""
    confidence, predicted = predictions.max(-1)
    hits = (predicted == labels).to(predictions.dtype)
    index = torch.clamp((confidence * bins).floor().long(), max=bins)  # confidence 1: a bin of its own, as there
    gaps = torch.zeros(bins + 1, dtype=predictions.dtype).index_add_(0, index, hits - confidence)
    return float(gaps.abs().sum() / len(labels))


def replay_one(
    experts: Tensor,
    labels: Tensor,
    share: float,
    learners: Sequence[int] = (),
    prior_learner: float | None = None,
    share_past: float = 0.0,
) -> Tensor:
    """The mixture's prequential predictions ``(N, m)`` of experts ``(N, K, m)``, fixed share ``α``, ``share_past``.

    The prior is uniform, or with ``prior_learner`` the learner's experts (indices ``learners``) share that weight
    equally and the others the rest, as :class:`~loko_lightning.learner.mixture_step.MixtureStep` builds it. With
    ``share_past`` ``β > 0`` a share ``β`` goes to the mean of the past posteriors too (mixing past posteriors).
    """
    count = experts.shape[1]
    prior = torch.full((count,), 1.0 / count, dtype=torch.float64)
    if prior_learner is not None:
        prior.fill_((1.0 - prior_learner) / (count - len(learners)))
        prior[list(learners)] = prior_learner / len(learners)
    log_weights = prior.log()
    past = log_weights.clone() if share_past else None
    predictions = []
    for count, (step, label) in enumerate(zip(experts, labels, strict=True), start=1):
        predictions.append(mixture_log_predictive(log_weights, step[:, None])[0].exp())
        log_weights, past = update_mixture_weights(log_weights, step[:, label], share, share_past, past, count)
    return torch.stack(predictions)


def nll_of(predictions: Tensor, labels: Tensor) -> Tensor:
    """Each prediction's ``−log p(y)`` ``(N,)`` (``p`` floored at float64's smallest normal: no infinity)."""
    return -predictions[torch.arange(len(labels)), labels].clamp_min(torch.finfo(torch.float64).tiny).log()


def scores(
    predictions: Tensor,
    labels: Tensor,
    at: Sequence[int],
    bootstrap: int = 0,
    gap: bool = False,
    floor: int = 0,
    late: int = 0,
) -> dict[str, float]:
    """Online accuracy after each of ``at``, prequential NLL and ECE of the whole stream.

    With ``bootstrap`` ``B > 0`` also ``ece sd``: the standard deviation of the ECE over ``B`` resamples of the
    predictions with replacement (a fixed generator: the same resamples for every setting), how far one run's ECE moves
    with the samples it happened to score. With ``gap`` also ``conf - acc``: the mean top-1 confidence minus the
    accuracy (below 0: the predictions are underconfident on the whole). With ``floor`` ``F > 0`` also ``ece floor``:
    the mean ECE of the predictions over ``F`` label streams drawn from them (a fixed generator), the calibrated
    learner's ECE from sampling alone. With ``late`` ``L > 0`` also ``nll last L``, the NLL of the last ``L``
    predictions, and ``… at best T``: the same predictions tempered at the one ``T`` of :data:`HINDSIGHT` that fits
    those ``L`` labels best, chosen after seeing them. Not a learner: how much of the window's NLL one calibration
    could recover at most (the rest is the predictions' ranking of the classes).
    """
    hits = (predictions.argmax(-1) == labels).double().cumsum(0)
    nll = nll_of(predictions, labels)
    out = {
        **{f"acc@{n}": float(hits[n - 1] / n) for n in at if n <= len(labels)},
        "nll": float(nll.mean()),
        "ece": ece(predictions, labels),
    }
    if bootstrap:
        generator = torch.Generator().manual_seed(0)
        draws = [torch.randint(len(labels), (len(labels),), generator=generator) for _ in range(bootstrap)]
        out["ece sd"] = statistics.stdev(ece(predictions[i], labels[i]) for i in draws)
    if gap:
        out["conf - acc"] = float(predictions.max(-1).values.mean() - hits[-1] / len(labels))
    if floor:
        generator = torch.Generator().manual_seed(0)
        draws = [torch.multinomial(predictions, 1, generator=generator)[:, 0] for _ in range(floor)]
        out["ece floor"] = statistics.fmean(ece(predictions, drawn) for drawn in draws)
    if late:
        window, window_labels = predictions[-late:], labels[-late:]
        out[f"nll last {late}"] = float(nll_of(window, window_labels).mean())
        log_p = window.clamp_min(torch.finfo(torch.float64).tiny).log()
        tempered = (torch.softmax(log_p / t, -1) for t in HINDSIGHT)
        out[f"nll last {late} at best T"] = min(float(nll_of(p, window_labels).mean()) for p in tempered)
    return out


def cell(key: str, value: float) -> str:
    """A table cell of :func:`scores`' ``key``: accuracies, ECEs and the confidence gap in points, the NLL as it is."""
    return f"{100 * value:.1f}" if key.startswith(("acc", "ece", "conf")) else f"{value:.3f}"


def recalibrate(predictions: Tensor, labels: Tensor, strength: float, bins: int = 15) -> Tensor:
    """The predictions ``(N, m)`` recalibrated one sample after the other, as the mixture's ``calibration`` ``κ``.

    Each top-1 confidence ``c`` moved by its bin's past sum of hit minus confidence over ``count + κ``, at most half
    way to a tie with the runner-up or to certainty, the other classes scaled to sum to 1; then the bin learns the
    sample's hit and ``c`` (before the move). A loop over plain floats, written apart from
    :func:`~loko_lightning.learner.mixing.recalibrated`, which the tests hold it equal to.
    """
    gaps, counts = [0.0] * (bins + 1), [0.0] * (bins + 1)
    out = predictions.clone()
    for row, (p, label) in enumerate(zip(predictions.tolist(), labels.tolist(), strict=True)):
        top = max(range(len(p)), key=p.__getitem__)
        c = p[top]
        runner = max(q for k, q in enumerate(p) if k != top)
        b = min(int(c * bins), bins)
        if c < 1:
            tie = runner / (1 - c + runner)  # the confidence at which the runner-up would tie
            moved = min(max(c + gaps[b] / (counts[b] + strength), (tie + c) / 2), (1 + c) / 2)
            out[row] = torch.tensor(
                [moved if k == top else q * (1 - moved) / (1 - c) for k, q in enumerate(p)], dtype=out.dtype
            )
        gaps[b] += float(top == label) - c
        counts[b] += 1
    return out


def setting_experts(
    experts: Tensor,
    keep: Sequence[int],
    kept: Sequence[float],
    learner_temperatures: Sequence[float] = (),
    powers: Sequence[float] = (),
    nearest: Sequence[Tensor] = (),
) -> tuple[Tensor, list[int]]:
    """A setting's experts ``(N, K, m)`` in the mixture's order, and the learner's indices among them.

    ``keep``: the recorded experts kept (LoKO first, the kept temperatures ``kept``, the vote); then LoKO tempered at
    ``learner_temperatures``; then the pools at ``powers`` and each kept temperature, from LoKO's and LDA's ``T = 1``
    recorded log probabilities (LDA's logits up to a constant: the pool is the same distribution); then ``nearest``
    (nearest class mean's experts, ``(N, K', m)`` each: its recorded ones at the kept temperatures, its vote).
    """
    tempered = [torch.log_softmax(experts[:, :1] / t, -1) for t in learner_temperatures]
    pooled = [pooled_log_probabilities(experts[:, 0], experts[:, 1], powers, kept).transpose(0, 1)] if powers else []
    learners = [0, *range(len(keep), len(keep) + len(tempered))]
    return torch.cat([experts[:, list(keep)], *tempered, *pooled, *nearest], 1), learners


def posterior_experts(learner: Tensor, cov: Tensor, kappas: Sequence[float]) -> Tensor:
    """LoKO's posterior predictive at each ``κ`` as experts ``(N, len(κ), m)`` (log probabilities).

    ``learner``: its recorded log probabilities at the mean ``(N, m)``; ``cov``: the recorded ``H P Hᵀ`` blocks
    ``(N, m, m)`` (the belief before each sample); :func:`~loko_lightning.kalman.predictive.mean_field_predictive` of
    ``κ · H P Hᵀ``, as ``predictive: posterior`` computes each of its scales.
    """
    probabilities = learner.exp()
    tiny = torch.finfo(torch.float64).tiny
    return torch.stack([mean_field_predictive(probabilities, k * cov).clamp_min(tiny).log() for k in kappas], 1)


def learned_pool(features: Tensor, labels: Tensor, gamma: float, eps: float = 1.0) -> Tensor:
    """The log-linear pool ``log softmax(Σ_j w_j f_j)`` with its powers ``w ≥ 0`` learned online ``(N, m)``.

    ``features`` ``(N, J, m)``: the pooled predictions' log probabilities (LoKO's first). ``w`` starts at LoKO alone
    (``(1, 0, …)``) and takes one online Newton step on each sample's log loss after its prediction (prequential):
    ``A ← A + g gᵀ`` (``A₀ = ε I``), ``w ← max(w − A⁻¹ g / γ, 0)``, ``g = Σ_c p_c f_c − f_y`` the loss's gradient.
    The mixture's pools fix ``w`` on a grid instead (powers ``a`` and LDA's temperatures, weighed by Bayes).
    """
    weights = torch.zeros(features.shape[1], dtype=torch.float64)
    weights[0] = 1.0
    curvature = eps * torch.eye(features.shape[1], dtype=torch.float64)
    out = []
    for feature, label in zip(features, labels, strict=True):
        log_p = torch.log_softmax(weights @ feature, -1)
        out.append(log_p)
        gradient = feature @ log_p.exp() - feature[:, label]
        curvature += torch.outer(gradient, gradient)
        weights = (weights - torch.linalg.solve(curvature, gradient) / gamma).clamp_min(0.0)
    return torch.stack(out)


def chosen_online(experts: Tensor, labels: Tensor) -> Tensor:
    """The prediction ``(N, m)`` of the expert with the least log-loss so far (ties: the first).

    As :class:`~loko_lightning.kalman.predictive.PredictiveScale` chooses its ``κ``.
    """
    losses = -experts[torch.arange(len(labels)), :, labels]  # (N, K)
    before = torch.cumsum(losses, 0) - losses
    return experts[torch.arange(len(labels)), before.argmin(-1)].exp()


def nearest_vote(nearest: Tensor, labels: Tensor) -> Tensor:
    """Nearest class mean's argmax as an expert ``(N, 1, m)``: Laplace's rule on its past hits, as LDA's vote.

    ``nearest``: its recorded log probabilities at ``T = 1`` ``(N, m)`` (the argmax of its logits); prequential: the
    confidence at sample ``t`` counts the hits before it (:func:`~loko_lightning.learner.mixture.\
vote_log_probabilities`).
    """
    predicted = nearest.argmax(-1)
    hits = (predicted == labels).to(torch.float64)
    before = hits.cumsum(0) - hits
    seen = torch.arange(len(labels), dtype=torch.float64)
    votes = zip(predicted, before, seen, strict=True)
    return torch.stack([vote_log_probabilities(p[None], h, n, nearest.shape[-1])[0] for p, h, n in votes])[:, None]


def replay(args: argparse.Namespace) -> None:
    """Print the table of the experts and the mixture settings (see the module)."""
    runs = [torch.load(path) for path in sorted(args.folder.glob("experts_seed*.pt"))]
    temperatures = runs[0]["temperatures"]
    rows: dict[str, list[dict[str, float]]] = {}
    for run in runs:
        experts, labels = run["experts"], run["labels"]
        options = {"bootstrap": args.bootstrap, "gap": args.confidence_gap, "floor": args.ece_floor, "late": args.late}
        score = functools.partial(scores, labels=labels, at=args.at, **options)
        nearest = None
        if run.get("nearest_mean"):  # recorded last: nearest class mean at each temperature
            experts, nearest = experts[:, : -len(temperatures)], experts[:, -len(temperatures) :]
        rows.setdefault("LoKO alone", []).append(score(experts[:, 0].exp()))
        posterior = None
        if args.posterior:
            if run.get("prediction_cov") is None:
                raise SystemExit(f"--posterior: {args.folder} holds no H P Hᵀ (recorded before it was kept)")
            posterior = posterior_experts(experts[:, 0], run["prediction_cov"], args.posterior)
            for j, kappa in enumerate(args.posterior):
                rows.setdefault(f"LoKO's posterior alone, κ = {kappa:g}", []).append(score(posterior[:, j].exp()))
            grid = ", ".join(f"{k:g}" for k in args.posterior)
            rows.setdefault(f"LoKO's posterior, κ chosen online among {grid}", []).append(
                score(chosen_online(posterior, labels))
            )
        if nearest is not None:
            rows.setdefault("nearest class mean alone", []).append(score(nearest[:, 0].exp()))
            ncm_vote = nearest_vote(nearest[:, 0], labels)
            rows.setdefault("nearest class mean's vote alone", []).append(score(ncm_vote[:, 0].exp()))
        learned = None
        if args.learned_pool:  # LoKO's and LDA's T = 1 log probabilities (and nearest class mean's), pooled
            features = experts[:, :2] if nearest is None else torch.cat([experts[:, :2], nearest[:, :1]], 1)
            learned = torch.stack(
                [learned_pool(features, labels, g, args.learned_pool_eps) for g in args.learned_pool], 1
            )
            for j, gamma in enumerate(args.learned_pool):
                rows.setdefault(f"the pool learned online, γ = {gamma:g}", []).append(score(learned[:, j].exp()))
        for k, t in enumerate(temperatures, start=1):
            if t in args.show_temperatures:
                rows.setdefault(f"LDA alone, T={t:g}", []).append(score(experts[:, k].exp()))
        rows.setdefault("LDA's vote alone", []).append(score(experts[:, -1].exp()))
        for top in args.max_temperatures:
            for vote in args.votes:
                keep = [0] + [k for k, t in enumerate(temperatures, start=1) if t <= top]
                keep += [experts.shape[1] - 1] if vote else []
                if len(keep) == 1:
                    continue
                kept = [t for t in temperatures if t <= top]
                learner_sets = ([], args.learner_temperatures) if args.learner_temperatures else ([],)
                pool_sets = ([], args.pools) if args.pools and kept else ([],)
                # More experts after the pools: LoKO's posterior predictives, then nearest class mean's (with them).
                extra_sets: list[tuple[str, list[Tensor]]] = [("", [])]
                if posterior is not None:
                    kappas = ", ".join(f"{k:g}" for k in args.posterior)
                    extra_sets += [(f" + LoKO's posterior at κ = {kappas}", [posterior])]
                if learned is not None:
                    gammas = ", ".join(f"{g:g}" for g in args.learned_pool)
                    name, before = extra_sets[-1]
                    extra_sets += [(name + f" + the pool learned online at γ = {gammas}", [*before, learned])]
                if nearest is not None:
                    tempered = nearest[:, [k for k, t in enumerate(temperatures) if t <= top]]
                    name, before = extra_sets[-1]  # with the posterior's experts where asked for
                    extra_sets += [(name + " + nearest mean", [*before, tempered])]
                    if args.nearest_vote:
                        extra_sets += [(name + " + nearest mean + its vote", [*before, tempered, ncm_vote])]
                if args.all_experts_only:  # the setting with every expert asked for, not each subset
                    learner_sets, pool_sets, extra_sets = learner_sets[-1:], pool_sets[-1:], extra_sets[-1:]
                for learner_temperatures, powers, (near, extra) in itertools.product(
                    learner_sets, pool_sets, extra_sets
                ):
                    mixed, learners = setting_experts(experts, keep, kept, learner_temperatures, powers, extra)
                    settings = itertools.product(args.shares, args.shares_past, [None, *args.prior_learner])
                    for share, share_past, prior in settings:
                        predictions = replay_one(mixed, labels, share, learners, prior, share_past)
                        what = (f"T in 1..{top:g}" if top >= 1 else "no T") + (" + vote" if vote else "")
                        if learner_temperatures:
                            what += f" + LoKO at T = {', '.join(f'{t:g}' for t in learner_temperatures)}"
                        if powers:
                            what += f" + pools a = {', '.join(f'{a:g}' for a in powers)}"
                        what += near
                        if prior is not None:
                            what += f", LoKO's prior {prior:g}"
                        what += f", share {share:g}" + (f" + {share_past:g} to the past" if share_past else "")
                        rows.setdefault(f"mixture, {what}", []).append(score(predictions))
                        if args.calibrate:  # the mixture's prediction tempered at each T, mixed again (argmax kept)
                            log_p = predictions.clamp_min(torch.finfo(torch.float64).tiny).log()
                            again = torch.stack([torch.log_softmax(log_p / t, -1) for t in args.calibrate], 1)
                            calibrated = replay_one(again, labels, args.calibrate_share)
                            grid = ", ".join(f"{t:g}" for t in args.calibrate)
                            rows.setdefault(f"mixture, {what}, calibrated over T = {grid}", []).append(
                                score(calibrated)
                            )
                        for strength in args.recalibrate:  # the mixture's calibration option at this κ
                            bins = f"{args.recalibrate_bins} bins" if args.recalibrate_bins != 15 else "its bins"
                            rows.setdefault(f"mixture, {what}, recalibrated by {bins}, κ = {strength:g}", []).append(
                                score(recalibrate(predictions, labels, strength, args.recalibrate_bins))
                            )
    keys = list(next(iter(rows.values()))[0])
    seeds = [path.stem.removeprefix("experts_seed") for path in sorted(args.folder.glob("experts_seed*.pt"))]
    print(f"| setting ({len(runs)} seeds{'' if args.per_seed else ', mean'}) | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for name, values in rows.items():
        groups = [(f", seed {s}", [v]) for s, v in zip(seeds, values, strict=True)] if args.per_seed else [("", values)]
        for suffix, group in groups:
            means = [statistics.fmean(v[key] for v in group) for key in keys]
            cells = [cell(key, m) for key, m in zip(keys, means, strict=True)]
            print(f"| {name}{suffix} | " + " | ".join(cells) + " |")


def run_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """A ``record`` command's options for the runs it makes: their configs, length, seeds and torch threads."""
    parser.add_argument("--config", type=Path, nargs="+", required=True)
    parser.add_argument("--samples", type=int, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--threads", type=int, default=None)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """``record`` or ``replay`` (see the module)."""
    argv, overrides = common.split_overrides(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    rec = run_arguments(commands.add_parser("record"))
    rec.add_argument("--temperatures", type=float, nargs="+", default=WIDE)
    rec.add_argument("--out", type=Path, required=True)
    rep = commands.add_parser("replay")
    rep.add_argument("folder", type=Path)
    rep.add_argument("--shares", type=float, nargs="+", default=[0.0, 0.003, 0.01, 0.03, 0.1])
    rep.add_argument(
        "--shares-past", type=float, nargs="+", default=[0.0],
        help="shares to the mean of the past posteriors (mixing past posteriors), each with every --shares",
    )  # fmt: skip
    rep.add_argument("--max-temperatures", type=float, nargs="+", default=[0.0, 64.0, 4096.0], help="0: no T experts")
    rep.add_argument("--votes", type=int, nargs="+", default=[0, 1], help="with LDA's vote (1) or without (0)")
    rep.add_argument("--show-temperatures", type=float, nargs="*", default=[1.0, 16.0, 256.0])
    rep.add_argument("--at", type=int, nargs="+", default=[100, 200, 300])
    rep.add_argument("--per-seed", action="store_true", help="one row per seed instead of the mean")
    rep.add_argument(
        "--learner-temperatures", type=float, nargs="*", default=[],
        help="also each setting with LoKO's prediction tempered at these T as more experts (log p / T, renormalised)",
    )  # fmt: skip
    rep.add_argument(
        "--pools", type=float, nargs="*", default=[],
        help="also each setting with the pools of LoKO and LDA at these powers (the mixture's pools)",
    )  # fmt: skip
    rep.add_argument(
        "--calibrate", type=float, nargs="*", default=[],
        help="also each setting's prediction tempered at these T (log p / T, renormalised), mixed by Bayes again",
    )  # fmt: skip
    rep.add_argument(
        "--nearest-vote", action="store_true",
        help="with recorded nearest class mean experts: also each setting with its argmax as a vote (as LDA's)",
    )  # fmt: skip
    rep.add_argument("--calibrate-share", type=float, default=0.01, help="fixed share of the --calibrate mixture")
    rep.add_argument(
        "--recalibrate", type=float, nargs="*", default=[],
        help="also each setting's prediction recalibrated by its bin's past gap at these prior strengths κ (the "
        "mixture's calibration option)",
    )  # fmt: skip
    rep.add_argument(
        "--recalibrate-bins", type=int, default=15,
        help="the --recalibrate bins (the option's: 15, the ECE's; another number: a check that the ECE's fall is not "
        "fitted to its bins)",
    )  # fmt: skip
    rep.add_argument(
        "--bootstrap", type=int, default=0,
        help="also each row's ECE's standard deviation over this many resamples of its predictions (ece sd)",
    )  # fmt: skip
    rep.add_argument(
        "--confidence-gap", action="store_true",
        help="also each row's mean top-1 confidence minus its accuracy (points; below 0: underconfident)",
    )  # fmt: skip
    rep.add_argument(
        "--ece-floor", type=int, default=0,
        help="also each row's mean ECE over this many label streams drawn from its own predictions (calibrated by "
        "construction): the ECE sampling alone gives",
    )  # fmt: skip
    rep.add_argument(
        "--all-experts-only", action="store_true",
        help="only the settings with every expert asked for (--learner-temperatures, --pools, nearest mean), not also "
        "each without some of them",
    )  # fmt: skip
    rep.add_argument(
        "--posterior", type=float, nargs="*", default=[],
        help="with a recorded H P Hᵀ: LoKO's posterior predictive at these κ alone, chosen online, and as more experts",
    )  # fmt: skip
    rep.add_argument(
        "--late", type=int, default=0,
        help="also each row's NLL over its last this many predictions, and at the temperature best for them in "
        "hindsight (how much one calibration could recover there)",
    )  # fmt: skip
    rep.add_argument(
        "--learned-pool", type=float, nargs="*", default=[],
        help="LoKO's and LDA's (and nearest class mean's) log-linear pool with its powers learned online by an online "
        "Newton step at these γ, alone and as more experts",
    )  # fmt: skip
    rep.add_argument("--learned-pool-eps", type=float, default=1.0, help="the --learned-pool's A₀ = ε I")
    rep.add_argument(
        "--prior-learner", type=float, nargs="*", default=[],
        help="also each setting with LoKO's experts sharing this prior weight (the mixture's prior_learner)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    args.overrides = overrides
    record(args) if args.command == "record" else replay(args)


if __name__ == "__main__":
    main()
