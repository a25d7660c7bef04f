r"""A Bayesian mixture of the fine-tuner and streaming LDA on the frozen backbone, scored prequentially.

Experts :math:`k = 1..K`: the learner's own prediction (LoKO's, made before its update); a head fitted in closed form
on the backbone's features with the adapters disabled (:class:`~loko_lightning.peers.frozen_heads.StreamingLDA`,
injected: the learner layer does not import the peers), its logits tempered by each temperature :math:`T_j` of a grid
(one expert per temperature: LDA's raw probabilities are overconfident); and LDA's argmax alone, its confidence
Laplace's rule on LDA's past hits (:func:`vote_log_probabilities`). The learner predicts with the mixture

.. math::

    p(y \mid x_t) = \sum_k w_{k,t}\, p_k(y \mid x_t), \qquad
    w_{k,t+1} \propto w_{k,t}\, p_k(y_t \mid x_t) \quad\text{(Bayes)}, \qquad
    w \leftarrow (1 - \alpha)\, w + \alpha / K \quad\text{(fixed share, } \alpha = \texttt{share}\text{)},

the weights updated after the sample is scored (prequential). With :math:`\alpha = 0` and a uniform prior the
mixture's cumulative log loss is at most the best expert's plus :math:`\log K`; fixed share (Herbster & Warmuth 1998)
lets the weight move from LDA to the fine-tuner later, at a cost of about :math:`\log(K/\alpha)` nats a switch and
:math:`\alpha` nats a sample. Derivation and measurements: ``docs/results/mixture.md``.

:class:`FrozenHeadMixture` is a Lightning callback that wraps the learner's step in :class:`MixtureStep` when fitting
starts (``configs/presets/loko_mixture_lda.yaml`` adds it). The network's weights, LoKO's trajectory and a checkpoint's
``state_dict`` are those of the plain learner; the mixture's state (the weights and LDA's statistics) rides in the
checkpoint as ``"loko_mixture"`` but is not read back: a fit resumed with the mixture is refused, saying so.
``loko predict`` and serving use the network alone. Not with ``step_scales`` or a shared head
covariance (refused), nor under DDP.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from peft import PeftModel
from torch import Tensor, nn

from loko_lightning.errors import ConfigError
from loko_lightning.learner.frozen_heads import evaluating
from loko_lightning.learner.steps import OnlineStep, StepResult

#: LDA's temperatures by default: a geometric grid from its own (1) to 4096x softer (its early misses cost hundreds
#: of nats at T = 1; docs/results/mixture.md).
TEMPERATURES = tuple(float(2**k) for k in range(13))
#: Fixed share's α by default: the weight can move from LDA to the fine-tuner within a few dozen samples.
SHARE = 0.01


# ------------------------------------------------------------------ the arithmetic (pure functions)
def tempered_log_probabilities(logits: Tensor, temperatures: Sequence[float]) -> Tensor:
    """``log softmax(logits / T)`` for each ``T``: ``(len(temperatures), B, m)`` from logits ``(B, m)``."""
    scale = torch.tensor(temperatures, dtype=logits.dtype, device=logits.device)
    return torch.log_softmax(logits[None] / scale[:, None, None], -1)


def vote_log_probabilities(predicted: Tensor, hits: Tensor, seen: Tensor, num_classes: int) -> Tensor:
    """A classifier's argmax as a calibrated forecast: ``c`` on ``predicted`` ``(B,)``, ``(1 − c)/(m − 1)`` elsewhere.

    ``c = (hits + 1) / (seen + 2)``, Laplace's rule on the classifier's past top-1 hits (prequential: from the samples
    before). Returns ``(B, m)`` log probabilities in ``hits``' dtype.
    """
    confidence = (hits + 1) / (seen + 2)
    rest = torch.log((1 - confidence) / (num_classes - 1))
    out = rest.expand(predicted.shape[0], num_classes).clone()
    return out.scatter_(1, predicted[:, None], torch.log(confidence).expand(predicted.shape[0], 1))


def mixture_log_predictive(log_weights: Tensor, log_probabilities: Tensor) -> Tensor:
    """``log Σ_k w_k p_k(y|x)`` ``(B, m)`` from normalised log weights ``(K,)`` and experts' ``(K, B, m)``."""
    return torch.logsumexp(log_weights[:, None, None] + log_probabilities, 0)


def update_log_weights(log_weights: Tensor, log_likelihoods: Tensor, share: float = 0.0) -> Tensor:
    """The normalised log weights after one scored sample: Bayes' ``w_k ∝ w_k p_k(y)``, then fixed share.

    Args:
        log_weights: ``(K,)`` normalised log weights before the sample.
        log_likelihoods: ``(K,)`` each expert's ``log p_k(y_t | x_t)``, from its prediction before the update.
        share: fixed share's ``α`` in ``[0, 1)``: ``w ← (1 − α) w + α / K`` (0: the plain Bayesian mixture).
    """
    posterior = log_weights + log_likelihoods
    posterior = posterior - torch.logsumexp(posterior, 0)
    if share:
        floor = torch.full_like(posterior, math.log(share / posterior.shape[0]))
        posterior = torch.logaddexp(posterior + math.log1p(-share), floor)
    return posterior


# ------------------------------------------------------------------ the frozen expert
#: What builds the frozen head from the parameters of its layer, e.g. ``StreamingLDA`` or ``partial(StreamingLDA,
#: shrinkage=0.1)`` (the peers are configured by the caller: the learner layer does not import them). The head is a
#: closed-form head's optimizer: ``bind(weight, bias)`` to its layer, then ``step(closure)`` with a closure returning
#: ``(features, labels)`` updates its statistics and writes the head into the layer.
HeadCallable = Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer]


def peft_model(network: nn.Module) -> PeftModel:
    """The peft model in ``network`` (the network itself for timm; inside the wrapper for text)."""
    for module in network.modules():
        if isinstance(module, PeftModel):
            return module
    raise ConfigError(
        "the mixture with a frozen head needs a peft network (its adapters are disabled for the frozen features); "
        "this one has none. To fix it: use TimmClassifier or TransformersClassifier",
        field="network",
        owner=FrozenHeadMixture,
    )


def frozen_features(network: nn.Module, inputs: Any, num_classes: int) -> Tensor:
    """The pretrained backbone's features ``(B, d)``: the input of the output layer, adapters disabled, eval mode.

    With the adapters disabled peft runs the original head (``modules_to_save``' frozen copy): the features are the
    input of the last ``nn.Linear`` with ``num_classes`` outputs that runs.
    """
    captured: list[Tensor] = []
    layers = [m for m in network.modules() if isinstance(m, nn.Linear) and m.out_features == num_classes]
    hooks = [layer.register_forward_hook(lambda _, args, __: captured.append(args[0].detach())) for layer in layers]
    try:
        with torch.no_grad(), evaluating(network), peft_model(network).disable_adapter():
            network(inputs)
    finally:
        for hook in hooks:
            hook.remove()
    if not captured:
        raise ConfigError(
            f"the mixture found no nn.Linear with {num_classes} outputs in the network's forward pass",
            field="network",
            owner=FrozenHeadMixture,
        )
    return captured[-1].reshape(captured[-1].shape[0], -1)


class MixtureStep(OnlineStep):
    """The learner's step (``inner``, e.g. LoKO's) and streaming LDA on frozen features, predicting as their mixture.

    Per step: the frozen features and LDA's tempered log probabilities (its head before this sample); the inner step
    (its prediction made before its update); the mixture of both scored; then the weights (float64) updated by each
    expert's likelihood of the label, and LDA's statistics by the sample. Logged: ``mixture/weight_learner`` (the
    fine-tuner's weight) and ``mixture/temperature`` (LDA's heaviest temperature).

    Args:
        inner: the learner's own step.
        temperatures: LDA's temperatures, one expert each.
        share: fixed share's ``α`` (0: Bayes).
        head: builds the frozen head over its layer's parameters (``loko_lightning.peers.StreamingLDA``).
        prior_learner: the prior weight of the learner's expert; the rest shared equally by LDA's experts.
        vote: add LDA's argmax as an expert of its own, with its past accuracy as its confidence
            (:func:`vote_log_probabilities`).
    """

    single_process = True

    def __init__(
        self,
        inner: OnlineStep,
        head: HeadCallable,
        temperatures: Sequence[float] = TEMPERATURES,
        share: float = SHARE,
        prior_learner: float | None = None,
        vote: bool = True,
    ) -> None:
        self.inner = inner
        self.temperatures = [float(t) for t in temperatures]
        self.share, self.vote, self.build_head = float(share), vote, head
        lda = len(self.temperatures) + int(vote)
        learner = 1.0 / (1 + lda) if prior_learner is None else float(prior_learner)
        self.log_weights = torch.tensor([learner] + [(1.0 - learner) / lda] * lda, dtype=torch.float64).log()
        self.hits = torch.zeros((), dtype=torch.float64)  # LDA's past top-1 hits and samples (the vote's confidence)
        self.seen = torch.zeros((), dtype=torch.float64)
        self.head: nn.Linear | None = None  # LDA's, float64, built at the first step (its width is the features')
        self.lda: Any = None  # the head's optimizer (bind, step), built with the head

    def check_trainer(self, trainer: pl.Trainer, owner: Any) -> None:
        """The inner step's checks; one process."""
        self.inner.check_trainer(trainer, owner)
        super().check_trainer(trainer, owner)

    def start(self, module: pl.LightningModule) -> None:
        """Let the inner step prepare."""
        self.inner.start(module)

    def _build(self, dim: int, classes: int, device: torch.device) -> None:
        self.head = nn.Linear(dim, classes, dtype=torch.float64, device=device)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        self.lda = self.build_head(self.head.parameters())
        self.lda.bind(self.head.weight, self.head.bias)
        self.log_weights = self.log_weights.to(device)
        self.hits, self.seen = self.hits.to(device), self.seen.to(device)

    def experts(self, learner: Tensor, features: Tensor) -> Tensor:
        """The experts' log probabilities ``(K, B, m)``, float64: the learner's, LDA's at each temperature, the vote."""
        assert self.head is not None
        lda_logits = self.head(features.to(torch.float64))
        parts = [learner.to(torch.float64).clamp_min(torch.finfo(torch.float64).tiny).log()[None]]
        parts.append(tempered_log_probabilities(lda_logits, self.temperatures))
        if self.vote:
            votes = vote_log_probabilities(lda_logits.argmax(-1), self.hits, self.seen, lda_logits.shape[-1])
            parts.append(votes[None])
        return torch.cat(parts)

    def step(self, module: pl.LightningModule, optimizer: Any, inputs: Any, label: Tensor) -> StepResult:
        """Both experts predict, the mixture is scored, then every part updates on the samples (see the class)."""
        features = frozen_features(module.network, inputs, module.num_classes)
        if self.head is None:
            self._build(features.shape[1], module.num_classes, features.device)
        assert self.lda is not None
        learner, label, applied = self.inner.step(module, optimizer, inputs, label)
        lda_argmax = self.head(features.to(torch.float64)).argmax(-1)  # LDA's head before this sample
        log_probabilities = self.experts(learner, features)
        prediction = mixture_log_predictive(self.log_weights, log_probabilities).exp()
        finite = torch.isfinite(log_probabilities).all() & torch.isfinite(features).all()
        if finite:  # one host read: a non-finite sample changes neither the weights nor LDA
            observed = log_probabilities[:, torch.arange(label.shape[0]), label]  # (K, B): log p_k(y_b | x_b)
            for likelihoods in observed.T:  # one sample after the other
                self.log_weights = update_log_weights(self.log_weights, likelihoods, self.share)
            self.hits += (lda_argmax == label).sum()
            self.seen += label.shape[0]
            self.lda.step(closure=lambda: (features, label))
        return prediction.to(learner.dtype), label, applied & finite

    def logged(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The inner step's values, the learner's weight and LDA's heaviest temperature."""
        weights = self.log_weights.exp()
        heaviest = self.temperatures[int(weights[1 : 1 + len(self.temperatures)].argmax())]
        return {
            **self.inner.logged(optimizer),
            "mixture/weight_learner": weights[0].float(),
            "mixture/temperature": heaviest,
        }

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The inner step's state; the mixture's weights and LDA's head and statistics as ``"loko_mixture"``."""
        self.inner.on_save_checkpoint(checkpoint)
        if self.head is not None and self.lda is not None:
            checkpoint["loko_mixture"] = {
                "log_weights": self.log_weights.clone(),
                "hits": self.hits.clone(),
                "seen": self.seen.clone(),
                "head": self.head.state_dict(),
                "lda": self.lda.state_dict(),
            }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refused: the mixture is installed for fitting only, and a fit does not resume with it yet.

        Raises:
            ConfigError: always (``field="ckpt_path"``), saying what to do instead.
        """
        raise ConfigError(
            "resuming a fit with the frozen-head mixture is not built yet: its weights and the frozen head's "
            "statistics are saved in the checkpoint but not read back, so the resumed mixture would start again. To "
            "fix it: fit from the start with the mixture, or resume without it (the learner alone)",
            field="ckpt_path",
            owner=FrozenHeadMixture,
        )

    def evaluate(self, module: pl.LightningModule, entering: bool) -> None:
        """The inner step's evaluation parameters (evaluation uses the network alone)."""
        self.inner.evaluate(module, entering)

    def close(self) -> None:
        """Close the inner step."""
        self.inner.close()


class FrozenHeadMixture(pl.Callback):
    """Make the learner predict with the mixture of itself and streaming LDA on frozen features (see the module).

    Add it to the trainer's callbacks (``--trainer.callbacks+=loko_lightning.learner.mixture.FrozenHeadMixture``);
    when fitting starts it wraps the learner's step in :class:`MixtureStep` with these arguments.

    Args:
        temperatures: LDA's temperatures, one expert each (each > 0); default :data:`TEMPERATURES`.
        share: fixed share's ``α`` in ``[0, 1)`` (0: the Bayesian mixture).
        head: builds the frozen head over its layer's parameters: ``loko_lightning.peers.StreamingLDA`` (in a config,
            ``class_path: loko_lightning.peers.StreamingLDA`` with its ``init_args``).
        prior_learner: the learner's prior weight in ``(0, 1)``; ``None``: uniform over the experts.
        vote: add LDA's argmax with its past accuracy as its confidence as an expert (:func:`vote_log_probabilities`).
    """

    def __init__(
        self,
        head: HeadCallable,
        temperatures: list[float] | None = None,
        share: float = SHARE,
        prior_learner: float | None = None,
        vote: bool = True,
    ) -> None:
        temperatures = list(TEMPERATURES) if temperatures is None else [float(t) for t in temperatures]
        if not temperatures or not all(math.isfinite(t) and t > 0 for t in temperatures):
            raise ConfigError(f"Invalid temperatures: {temperatures}", field="temperatures", owner=FrozenHeadMixture)
        if not 0.0 <= share < 1.0:
            raise ConfigError(f"Invalid share: {share} (in [0, 1))", field="share", owner=FrozenHeadMixture)
        if prior_learner is not None and not 0.0 < prior_learner < 1.0:
            raise ConfigError(
                f"Invalid prior_learner: {prior_learner} (in (0, 1))", field="prior_learner", owner=FrozenHeadMixture
            )
        self.head, self.temperatures, self.share = head, temperatures, share
        self.prior_learner, self.vote = prior_learner, vote

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Wrap the learner's step (once) when fitting.

        Raises:
            ConfigError: ``step_scales`` or a shared head covariance.
        """
        if stage != "fit" or isinstance(pl_module.online_step, MixtureStep):
            return
        if (
            getattr(pl_module, "step_scales", None) is not None
            or getattr(pl_module, "head_covariance", "") != "diagonal"
        ):
            raise ConfigError(
                "the mixture with a frozen head runs with one step size and the diagonal covariance (the learner's "
                "optimizer groups need to see LoKO through the wrapped step). To fix it: no step_scales, "
                "head_covariance: diagonal",
                field="step_scales",
                owner=FrozenHeadMixture,
            )
        pl_module.online_step = MixtureStep(
            pl_module.online_step, self.head, self.temperatures, self.share, self.prior_learner, self.vote
        )
