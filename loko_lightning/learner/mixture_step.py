"""The mixture's step: :class:`MixtureStep` wraps the learner's step and predicts with the mixture of its experts.

What the mixture is, its equations and its option (:class:`~loko_lightning.learner.mixture.FrozenHeadMixture`, which
builds this step): :mod:`loko_lightning.learner.mixture`; its arithmetic, pure functions:
:mod:`loko_lightning.learner.mixing`. Here: the experts built from the learner's prediction and the frozen head's,
the prequential score and update one sample after the other, the frozen head's statistics, the checkpoint's
``"loko_mixture"`` and the copies that serve; with ``calibration``, the prediction recalibrated by its bin's past
gap.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from loko_lightning.errors import ConfigError
from loko_lightning.kalman.distributed import all_gather_observations
from loko_lightning.learner.frozen_features import FrozenFeatures
from loko_lightning.learner.mixing import (
    mixture_log_predictive,
    pooled_log_probabilities,
    recalibrated,
    tempered_log_probabilities,
    update_bins,
    update_mixture_weights,
    vote_log_probabilities,
)
from loko_lightning.learner.steps import OnlineStep, StepResult, collective_timeout, world_size

#: LDA's temperatures by default: a geometric grid from its own (1) to 4096x softer (its early misses cost hundreds
#: of nats at T = 1; docs/results/mixture.md).
TEMPERATURES = tuple(float(2**k) for k in range(13))
#: Fixed share's α by default: the weight can move from LDA to the fine-tuner within a few dozen samples.
SHARE = 0.01
#: The recalibration's bins of the top-1 confidence (``calibration``): the ECE's 15 equal ones (confidence 1 its own).
CALIBRATION_BINS = 15


# ------------------------------------------------------------------ the frozen expert
#: What builds the frozen head from the parameters of its layer, e.g. ``StreamingLDA`` or ``partial(StreamingLDA,
#: shrinkage=0.1)`` (the peers are configured by the caller: the learner layer does not import them). The head is a
#: closed-form head's optimizer: ``bind(weight, bias)`` to its layer, then ``step(closure)`` with a closure returning
#: ``(features, labels)`` updates its statistics and writes the head into the layer.
HeadCallable = Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer]


class MixtureStep(OnlineStep):
    """The learner's step (``inner``, e.g. LoKO's) and streaming LDA on frozen features, predicting as their mixture.

    Per step: the frozen features and LDA's tempered log probabilities (its head before this sample); the inner step
    (its prediction made before its update); the mixture of both scored; then the weights (float64) updated by each
    expert's likelihood of the label, and LDA's statistics by the sample. Logged: ``mixture/weight_learner`` (the
    fine-tuner's weight) and ``mixture/temperature`` (LDA's heaviest temperature).

    Under DDP the inner step returns every process's predictions and labels in rank order (one joint update); the
    frozen features are gathered in the same order, and every process mixes, scores and updates on all of them, one
    sample after the other: the weights and LDA's statistics are the same on every process, as one process's with
    the joint step's samples in one batch.

    Args:
        inner: the learner's own step.
        temperatures: LDA's temperatures, one expert each.
        share: fixed share's ``α`` (0: Bayes).
        head: builds the frozen head over its layer's parameters (``loko_lightning.peers.StreamingLDA``).
        prior_learner: the prior weight of the learner's experts (shared equally by them); the rest shared equally by
            LDA's experts.
        vote: add LDA's argmax as an expert of its own, with its past accuracy as its confidence
            (:func:`vote_log_probabilities`).
        learner_temperatures: the learner's prediction also tempered at each of these ``T`` (``log p / T``,
            renormalised; ``T < 1`` sharpens it), one expert each, after the vote.
        pools: the learner's log probabilities times each of these powers ``a`` pooled with LDA's logits at each of
            ``temperatures`` (:func:`pooled_log_probabilities`), one expert each, after the tempered learner.
        nearest_mean: add nearest class mean on the same statistics (the head's ``nearest_mean()``: the class means
            and the pooled variance) at each of ``temperatures``, one expert each, after the pools.
        nearest_vote: add nearest class mean's argmax as an expert of its own, its past accuracy its confidence (as
            LDA's vote), last (with ``nearest_mean``).
        share_past: ``β``, the share to the mean of the past posteriors
            (:func:`~loko_lightning.learner.mixing.mix_past_posteriors`; 0: none).
        calibration: ``κ``, the prior's strength in samples of the recalibration of the mixture's top-1 confidence by
            its bin's past gap (:func:`~loko_lightning.learner.mixing.recalibrated`, :data:`CALIBRATION_BINS` bins,
            updated after each sample by the mixture's own confidence); 0: none.
        owner: the class whose settings these are, named by the errors (``FrozenHeadMixture``, which builds this).
    """

    def __init__(
        self,
        inner: OnlineStep,
        head: HeadCallable,
        temperatures: Sequence[float] = TEMPERATURES,
        share: float = SHARE,
        prior_learner: float | None = None,
        vote: bool = True,
        learner_temperatures: Sequence[float] = (),
        pools: Sequence[float] = (),
        nearest_mean: bool = False,
        share_past: float = 0.0,
        owner: type | None = None,
        nearest_vote: bool = False,
        calibration: float = 0.0,
    ) -> None:
        self.inner, self.owner = inner, owner
        self.temperatures = [float(t) for t in temperatures]
        self.learner_temperatures = [float(t) for t in learner_temperatures]
        self.pools = [float(a) for a in pools]
        self.share, self.vote, self.build_head = float(share), vote, head
        self.nearest_mean = bool(nearest_mean)
        self.nearest_vote = self.nearest_mean and bool(nearest_vote)
        # The experts' order (see experts()): the learner, LDA at each temperature, the vote, the tempered learner,
        # the pools, nearest class mean (and its vote). With prior_learner, the learner's experts share it and the
        # others the rest.
        lda = len(self.temperatures) + int(vote)
        self.learner_experts = [0, *range(1 + lda, 1 + lda + len(self.learner_temperatures))]
        self.lda_temperature_experts = slice(1, 1 + len(self.temperatures))
        learners = len(self.learner_experts)
        self.pooled_experts = slice(learners + lda, learners + lda + len(self.pools) * len(self.temperatures))
        nearest = len(self.temperatures) + int(self.nearest_vote) if self.nearest_mean else 0
        self.nearest_experts = slice(self.pooled_experts.stop, self.pooled_experts.stop + nearest)
        others = lda + len(self.pools) * len(self.temperatures) + nearest
        learner = learners / (learners + others) if prior_learner is None else float(prior_learner)
        prior = torch.full((learners + others,), (1.0 - learner) / others, dtype=torch.float64)
        prior[self.learner_experts] = learner / learners
        self.log_weights = prior.log()
        self.share_past = float(share_past)
        # with share_past: the log mean of the posteriors v_0 (the prior) ... v_t, of seen + 1 of them
        self.past = self.log_weights.clone() if self.share_past else None
        self.hits = torch.zeros((), dtype=torch.float64)  # LDA's past top-1 hits and samples (the vote's confidence)
        self.seen = torch.zeros((), dtype=torch.float64)
        self.nearest_hits = torch.zeros((), dtype=torch.float64)  # nearest class mean's (with nearest_vote)
        # with calibration: each bin's sum of hit minus confidence and its count, over the mixture's past predictions
        self.calibration = float(calibration)
        bins = torch.zeros(CALIBRATION_BINS + 1, dtype=torch.float64) if self.calibration else None
        self.bin_gaps, self.bin_counts = bins, None if bins is None else bins.clone()
        self.head: nn.Linear | None = None  # LDA's, float64, built at the first step (its width is the features')
        self.lda: Any = None  # the head's optimizer (bind, step), built with the head
        self.nearest: tuple[Tensor, Tensor] | None = None  # nearest class mean's (W, b), float64 (with nearest_mean)
        self._frozen: FrozenFeatures | None = None  # the network's frozen features, its modules found once

    def check_trainer(self, trainer: pl.Trainer, owner: Any) -> None:
        """The inner step's checks (under DDP the inner step must run there: LoKO's and AdamW's do)."""
        self.inner.check_trainer(trainer, owner)

    def start(self, module: pl.LightningModule) -> None:
        """Let the inner step prepare."""
        self.inner.start(module)

    def _build(self, dim: int, classes: int, device: torch.device) -> None:
        self.head = nn.Linear(dim, classes, dtype=torch.float64, device=device)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        self.head.requires_grad_(False)  # written by LDA in closed form: no autograd graph through the weights
        self.lda = self.build_head(self.head.parameters())
        self.lda.bind(self.head.weight, self.head.bias)
        self.lda.defer()  # scored here (lda_logits), its head written only into a checkpoint
        self.log_weights = self.log_weights.to(device)
        self.past = None if self.past is None else self.past.to(device)
        self.hits, self.seen = self.hits.to(device), self.seen.to(device)
        self.nearest_hits = self.nearest_hits.to(device)
        if self.bin_gaps is not None and self.bin_counts is not None:
            self.bin_gaps, self.bin_counts = self.bin_gaps.to(device), self.bin_counts.to(device)

    def _features(self, module: pl.LightningModule, inputs: Any, adapted: bool = False) -> tuple[Tensor | None, Tensor]:
        """The frozen features of ``inputs`` (LDA's head built at the first call: its width is theirs).

        With ``adapted``, the network's outputs with its adapters too, from the same forward pass
        (:meth:`FrozenFeatures.with_adapted`); else ``None`` for them.
        """
        if self._frozen is None or self._frozen.network is not module.network:
            self._frozen = FrozenFeatures(module.network, module.num_classes, owner=self.owner)
        outputs, features = self._frozen.with_adapted(inputs) if adapted else (None, self._frozen(inputs))
        if self.head is None:
            self._build(features.shape[1], module.num_classes, features.device)
        return outputs, features

    def lda_logits(self, features: Tensor) -> Tensor:
        """LDA's logits ``(B, m)`` of the frozen features, float64, with its head as it stands."""
        assert self.lda is not None
        return self.lda.logits(features.to(torch.float64))

    def nearest_logits(self, features: Tensor) -> Tensor | None:
        """Nearest class mean's logits ``(B, m)``, float64, on LDA's statistics as they stand; else ``None``.

        All 0 before the first sample; ``None`` without ``nearest_mean``.
        """
        if not self.nearest_mean:
            return None
        assert self.head is not None
        if self.nearest is None:
            return features.new_zeros(features.shape[0], self.head.out_features, dtype=torch.float64)
        weight, bias = self.nearest
        return torch.addmm(bias, features.to(torch.float64), weight.T)

    def _refresh_nearest(self) -> None:
        if self.nearest_mean:
            self.nearest = self.lda.nearest_mean()

    def experts(self, learner: Tensor, lda_logits: Tensor, nearest_logits: Tensor | None = None) -> Tensor:
        """The experts' log probabilities ``(K, B, m)``, float64.

        In order: the learner's, LDA's at each temperature, the vote, the learner's at each of its temperatures, the
        pools (each power, then each of LDA's temperatures), nearest class mean's at each of LDA's temperatures
        (``nearest_logits``, :meth:`nearest_logits`: needed with ``nearest_mean``), its vote.
        """
        parts = [learner.detach().to(torch.float64).clamp_min(torch.finfo(torch.float64).tiny).log()[None]]
        parts.append(tempered_log_probabilities(lda_logits, self.temperatures))
        if self.vote:
            votes = vote_log_probabilities(lda_logits.argmax(-1), self.hits, self.seen, lda_logits.shape[-1])
            parts.append(votes[None])
        if self.learner_temperatures:
            parts.append(tempered_log_probabilities(parts[0][0], self.learner_temperatures))
        if self.pools:
            parts.append(pooled_log_probabilities(parts[0][0], lda_logits, self.pools, self.temperatures))
        if self.nearest_mean:
            if nearest_logits is None:
                raise ValueError("nearest_logits: needed with nearest_mean (MixtureStep.nearest_logits(features))")
            parts.append(tempered_log_probabilities(nearest_logits, self.temperatures))
            if self.nearest_vote:
                votes = vote_log_probabilities(
                    nearest_logits.argmax(-1), self.nearest_hits, self.seen, nearest_logits.shape[-1]
                )
                parts.append(votes[None])
        return torch.cat(parts)

    def step(self, module: pl.LightningModule, optimizer: Any, inputs: Any, label: Tensor) -> StepResult:
        """Both experts predict, the mixture is scored, then every part updates on the samples (see the class)."""
        own = label
        apart = self.inner.predicts_apart(optimizer)
        if apart is None:
            _, features = self._features(module, inputs)
            learner, label, applied = self.inner.step(module, optimizer, inputs, label)
        else:  # the inner step's prediction and the frozen features from one forward pass
            with apart:
                outputs, features = self._features(module, inputs, adapted=True)
            learner, label, applied = self.inner.step(module, optimizer, inputs, label, outputs=outputs)
        assert self.lda is not None
        if world_size(module) > 1:  # every process's samples, in the inner step's (rank) order
            target = F.one_hot(own, module.num_classes).to(features.dtype)
            features, _, _ = all_gather_observations(features, target, [], timeout=collective_timeout(module))
        lda_logits = self.lda_logits(features)  # LDA's head before this sample
        nearest_logits = self.nearest_logits(features)
        log_probabilities = self.experts(learner, lda_logits, nearest_logits)
        mixed = mixture_log_predictive(self.log_weights, log_probabilities).exp()
        prediction = self.recalibrated(mixed)
        finite = torch.isfinite(log_probabilities).all() & torch.isfinite(features).all()
        if finite:  # one host read: a non-finite sample changes neither the weights nor LDA
            observed = log_probabilities[:, torch.arange(label.shape[0]), label]  # (K, B): log p_k(y_b | x_b)
            for index, likelihoods in enumerate(observed.T):  # one sample after the other
                self._update_weights(likelihoods, index)
            self.hits += (lda_logits.argmax(-1) == label).sum()
            if self.nearest_vote:
                self.nearest_hits += (nearest_logits.argmax(-1) == label).sum()
            self.seen += label.shape[0]
            if self.bin_gaps is not None and self.bin_counts is not None:
                self.bin_gaps, self.bin_counts = update_bins(self.bin_gaps, self.bin_counts, mixed, label)
            self.lda.step(closure=lambda: (features, label))
            self._refresh_nearest()
        return prediction.to(learner.dtype), label, applied & finite

    def recalibrated(self, mixed: Tensor) -> Tensor:
        """The mixture's probabilities ``(B, m)``, recalibrated by the bins as they stand with ``calibration``."""
        if self.bin_gaps is None or self.bin_counts is None:
            return mixed
        return recalibrated(mixed, self.bin_gaps, self.bin_counts, self.calibration)

    def _update_weights(self, likelihoods: Tensor, index: int) -> None:
        """Bayes' update of the weights by one sample's ``(K,)`` log-likelihoods, then the share (see the module).

        ``index``: the sample's place in this step's samples (the past's mean holds the prior and ``seen + index``
        posteriors before this one).
        """
        count = None if self.past is None else self.seen + (index + 1)
        self.log_weights, self.past = update_mixture_weights(
            self.log_weights, likelihoods, self.share, self.share_past, self.past, count
        )

    def logged(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The inner step's values, the weights of the learner (all its temperatures) and the pools, LDA's top T."""
        weights = self.log_weights.exp()
        heaviest = self.temperatures[int(weights[self.lda_temperature_experts].argmax())]
        learner = weights[self.learner_experts].sum()
        logged = {
            **self.inner.logged(optimizer),
            "mixture/weight_learner": learner.float(),
            "mixture/temperature": heaviest,
        }
        if self.pools:
            logged["mixture/weight_pooled"] = weights[self.pooled_experts].sum().float()
        if self.nearest_mean:
            logged["mixture/weight_nearest"] = weights[self.nearest_experts].sum().float()
        return logged

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The inner step's state; the mixture's weights and LDA's head and statistics as ``"loko_mixture"``."""
        self.inner.on_save_checkpoint(checkpoint)
        if self.head is not None and self.lda is not None:
            self.lda.write()
            checkpoint["loko_mixture"] = {
                "log_weights": self.log_weights.clone(),
                "hits": self.hits.clone(),
                "seen": self.seen.clone(),
                "head": self.head.state_dict(),
                "lda": self.lda.state_dict(),
            }
            if self.past is not None:
                checkpoint["loko_mixture"]["past"] = self.past.clone()
            if self.nearest_vote:
                checkpoint["loko_mixture"]["nearest_hits"] = self.nearest_hits.clone()
            if self.bin_gaps is not None and self.bin_counts is not None:
                checkpoint["loko_mixture"]["bin_gaps"] = self.bin_gaps.clone()
                checkpoint["loko_mixture"]["bin_counts"] = self.bin_counts.clone()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The inner step's state; the mixture's as it was saved (none in a checkpoint from before the first step).

        Raises:
            ConfigError: a checkpoint fitted without the mixture (``field="mixture"``): its weights and LDA's
                statistics would start again mid-stream; or without ``share_past``, into a mixture with it
                (``field="share_past"``): the past's posteriors are not in it; or without ``calibration``, into a
                mixture with it (``field="calibration"``).
        """
        self.inner.on_load_checkpoint(checkpoint)
        saved = checkpoint.get("loko_mixture")
        if saved is None:
            if checkpoint.get("global_step", 0) or checkpoint.get("serve"):
                raise ConfigError(
                    "this checkpoint was fitted without the mixture with a frozen head, so its weights and LDA's "
                    "statistics would start again mid-stream. To fix it: resume the learner as it was fitted (e.g. "
                    "--config presets/loko_images pins the image default's filter without the mixture), or fit from "
                    "the start with the mixture",
                    field="mixture",
                    owner=self.owner,
                )
            return
        # The options whose state a checkpoint fitted without them lacks: (option, on, key, what is missing, off).
        needed = (
            ("share_past", self.past is not None, "past",
             "the mean of its past posteriors that share_past mixes in is", "0"),
            ("nearest_vote", self.nearest_vote, "nearest_hits",
             "the nearest class mean's past hits its vote is confident by are", "false"),
            ("calibration", self.bin_gaps is not None, "bin_gaps",
             "the past gaps its recalibration moves the confidence by are", "0"),
        )  # fmt: skip
        for option, on, key, missing, off in needed:
            if on and key not in saved:
                raise ConfigError(
                    f"this checkpoint's mixture was fitted without {option}, so {missing} not in it. To fix it: resume "
                    f"with {option}: {off}, or fit from the start with {option}",
                    field=option,
                    owner=self.owner,
                )
        head = saved["head"]
        classes, dim = head["weight"].shape
        self._build(dim, classes, head["weight"].device)
        assert self.head is not None and self.lda is not None
        self.head.load_state_dict(head)
        self.lda.load_state_dict(saved["lda"])
        self._refresh_nearest()
        self.log_weights = saved["log_weights"].to(torch.float64).clone()
        if self.past is not None:
            self.past = saved["past"].to(torch.float64).clone()
        self.hits = saved["hits"].to(torch.float64).clone()
        self.seen = saved["seen"].to(torch.float64).clone()
        if self.nearest_vote:
            self.nearest_hits = saved["nearest_hits"].to(torch.float64).clone()
        if self.bin_gaps is not None:
            self.bin_gaps = saved["bin_gaps"].to(torch.float64).clone()
            self.bin_counts = saved["bin_counts"].to(torch.float64).clone()

    @torch.no_grad()
    def predict(self, module: pl.LightningModule, inputs: Any) -> Tensor:
        """The mixture's class probabilities ``(B, m)``, float32, with its weights and LDA as they stand (no update)."""
        outputs, features = self._features(module, inputs, adapted=True)
        assert outputs is not None
        learner = outputs.float().softmax(-1)
        experts = self.experts(learner, self.lda_logits(features), self.nearest_logits(features))
        return self.recalibrated(mixture_log_predictive(self.log_weights, experts).exp()).float()

    def follow(self, other: OnlineStep) -> None:
        """Predict as ``other`` (the learning copy's mixture) now does: its weights, hits, LDA's head as it stands."""
        assert isinstance(other, MixtureStep)
        if other.head is None:
            return
        if self.head is None:
            self._build(other.head.in_features, other.head.out_features, other.head.weight.device)
        assert self.lda is not None
        self.lda.follow(other.lda)
        self.log_weights, self.hits, self.seen = other.log_weights.clone(), other.hits.clone(), other.seen.clone()
        self.nearest_hits = other.nearest_hits.clone()
        self.past = None if other.past is None else other.past.clone()
        self.nearest = None if other.nearest is None else (other.nearest[0].clone(), other.nearest[1].clone())
        if self.bin_gaps is not None and other.bin_gaps is not None and other.bin_counts is not None:
            self.bin_gaps, self.bin_counts = other.bin_gaps.clone(), other.bin_counts.clone()

    def serving(self, optimizer: torch.optim.Optimizer) -> Any:
        """The inner step's parameters that predict (with an average: ``θ̄``), or ``None``."""
        serving = getattr(self.inner, "serving", None)
        return serving(optimizer) if serving is not None else None

    def evaluate(self, module: pl.LightningModule, entering: bool) -> None:
        """The inner step's evaluation parameters (with an average: ``θ̄``), which :meth:`predict` mixes with LDA."""
        self.inner.evaluate(module, entering)

    def close(self) -> None:
        """Close the inner step."""
        self.inner.close()
