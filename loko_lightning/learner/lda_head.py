r"""The learner's logits plus a streaming-LDA head on the same features, scored prequentially (not the paper).

The network's output layer reads the features :math:`z = z(x; a)` (``a``: the LoRA adapters); its logits are
:math:`f = W z + b`. Beside it a closed-form head (:class:`~loko_lightning.peers.frozen_heads.StreamingLDA`, injected:
the learner layer does not import the peers) keeps the running class means and one shrunk shared covariance of the
features of the samples before, :math:`W_L = \Lambda \mu`, :math:`b_L = -\tfrac12 \mu^\top \Lambda \mu`. While the
learner trains, the network outputs

.. math::

    \ell(x) = W z + b + \beta\, g(z), \qquad g(z) = (W_L z + b_L) / s(z),

:math:`s(z)` the standard deviation of :math:`W_L z + b_L` over the classes (LDA's logit scale falls by two orders of
magnitude over the first hundred samples; a single :math:`\beta` cannot weigh it otherwise), a class LDA has not seen
given the mean of the seen classes' rows. A forward hook on the output layer adds :math:`\beta g`. The learner's filter
(LoKO) observes :math:`\mathrm{softmax}(\ell)`: with ``features="adapted"`` (default; no extra forward pass) its
Jacobian is that of :math:`\ell` with respect to the adapters and the head, through :math:`z` into both terms
(:math:`W_L`, :math:`b_L`, :math:`s`, :math:`\beta` are known inputs of the step, functions of the samples before);
with ``features="pretrained"`` LDA reads the backbone with the adapters disabled (one more forward pass) and
:math:`\beta g` is a constant of the step. Equivalently the filter's head mean is moved before every step by the
change in :math:`\beta W_L / s`: a deterministic control input in the predict step, with no change to the covariance.

:math:`\beta` (LDA's raw logits are hundreds to tens of thousands of nats apart early) is the maximum a
posteriori weight of the past samples' combined logits, a prior :math:`\beta \sim N(0, \sigma^2)` and
:math:`\beta \in [0, \beta_{\max}]`:

.. math::

    \beta_t = \arg\min_\beta \sum_{s<t} -\log \mathrm{softmax}(f_s + \beta g_s)_{y_s} + \frac{\beta^2}{2\sigma^2},

:math:`f_s`, :math:`g_s` the network's and LDA's logits of sample ``s`` as scored (convex in :math:`\beta`:
:func:`fit_weight`). Each sample is scored before :math:`\beta`, LDA's statistics or the filter update on it.
Derivation and measurements: ``docs/results/lda_head.md``.

:class:`LDAHead` is a Lightning callback that wraps the learner's step in :class:`LDAHeadStep` when fitting starts
(``benchmarks/overlays/loko_lda_head.yaml``). The hook adds LDA's logits only inside training steps: evaluation,
``loko predict`` and serving use the network alone, and a fit resumed with the head is refused. One process; not with
``step_scales`` or a shared head covariance.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from loko_lightning.errors import ConfigError
from loko_lightning.learner.frozen_features import frozen_features
from loko_lightning.learner.frozen_heads import output_layer
from loko_lightning.learner.mixture_step import HeadCallable
from loko_lightning.learner.steps import OnlineStep, StepResult

#: The prior's scale σ of LDA's weight β by default: β = 1 puts LDA's standardised logits (spread 1 over the classes)
#: into the sum as they are, about 3 nats between a clear winner and the rest.
PRIOR_SCALE = 1.0
#: β's upper bound by default.
UPPER = 10.0


def weight_objective(network: Tensor, lda: Tensor, labels: Tensor, beta: float, prior_scale: float) -> Tensor:
    """``Σ_s −log softmax(f_s + β g_s)[y_s] + β²/(2σ²)`` from ``(S, m)`` logits ``f``, ``g`` and ``(S,)`` labels."""
    logits = network + beta * lda
    nll = torch.logsumexp(logits, -1) - logits.gather(-1, labels[:, None])[:, 0]
    return nll.sum() + beta**2 / (2 * prior_scale**2)


def fit_weight(
    network: Tensor,
    lda: Tensor,
    labels: Tensor,
    start: float = 0.0,
    prior_scale: float = PRIOR_SCALE,
    upper: float = UPPER,
    tol: float = 1e-10,
    iterations: int = 60,
) -> float:
    """The minimiser of :func:`weight_objective` over ``β ∈ [0, upper]``: safeguarded Newton from ``start``.

    The objective is strictly convex in ``β`` (a sum of log-sum-exps of affine functions plus ``β²/(2σ²)``), so its
    derivative ``L'(β) = Σ_s (E_{p_s}[g_s] − g_{s,y_s}) + β/σ²`` is increasing: the minimiser is 0 where ``L'(0) ≥ 0``,
    ``upper`` where ``L'(upper) ≤ 0``, and otherwise the root of ``L'``, bracketed and found by Newton's steps with
    ``L''(β) = Σ_s Var_{p_s}[g_s] + 1/σ²``, a bisection wherever a step leaves the bracket. Float64 inside.
    """
    f, g = network.to(torch.float64), lda.to(torch.float64)
    y = labels.reshape(-1, 1)
    observed = g.gather(-1, y)[:, 0].sum()
    precision = 1.0 / prior_scale**2

    def slopes(beta: float) -> tuple[float, float]:
        p = torch.softmax(f + beta * g, -1)
        mean = (p * g).sum(-1)
        first = float(mean.sum() - observed) + beta * precision
        second = float(((p * g.square()).sum(-1) - mean.square()).clamp_min(0).sum()) + precision
        return first, second

    lo, hi = 0.0, float(upper)
    if hi <= 0.0 or f.shape[0] == 0:
        return 0.0
    if slopes(lo)[0] >= 0.0:
        return lo
    if slopes(hi)[0] <= 0.0:
        return hi
    beta = min(max(float(start), lo), hi)
    for _ in range(iterations):
        first, second = slopes(beta)
        if first > 0.0:
            hi = beta
        else:
            lo = beta
        step = beta - first / second
        beta = step if lo < step < hi else 0.5 * (lo + hi)
        if hi - lo <= tol * max(1.0, hi) or abs(first) <= tol * second:
            break
    return beta


class LDAHeadStep(OnlineStep):
    """The learner's step (``inner``, e.g. LoKO's) on the network's logits plus ``β`` times LDA's (see the module).

    Per step: the hook on the output layer adds ``β_t (W_L z + b_L)`` (LDA's head and ``β`` from the samples before)
    to the network's logits and records ``z`` and both logits; the inner step predicts with and updates on the sum;
    then ``β`` is refitted on the scored samples and LDA's statistics are updated by the sample's ``z``. Logged:
    ``lda_head/beta``.

    Args:
        inner: the learner's own step.
        head: builds the closed-form head over its layer's parameters (``loko_lightning.peers.StreamingLDA``).
        prior_scale: ``σ`` of ``β``'s prior ``N(0, σ²)``.
        upper: ``β``'s upper bound.
        features: ``"adapted"``: LDA reads the output layer's input in the learner's own forward pass (no extra pass;
            the filter's Jacobian goes through ``z`` into both heads); ``"pretrained"``: the backbone's features with
            the adapters disabled, one more forward pass (LDA's logits a constant of the step for the filter).
    """

    single_process = True

    def __init__(self, inner: OnlineStep, head: HeadCallable, prior_scale: float = PRIOR_SCALE,
                 upper: float = UPPER, features: str = "adapted") -> None:  # fmt: skip
        self.inner, self.build_head, self.features = inner, head, features
        self.pretrained: Tensor | None = None  # this step's pretrained features (features="pretrained")
        self.prior_scale, self.upper = float(prior_scale), float(upper)
        self.beta = 0.0
        self.layer: nn.Linear | None = None
        self.head: nn.Linear | None = None  # LDA's, float64, built at the first step (its width is the features')
        self.lda: Any = None
        self.weight: tuple[Tensor, Tensor] | None = None  # LDA's head for this step (lda_weight)
        self.active = False
        self.calls: list[tuple[Tensor, Tensor, Tensor]] = []  # (z, f, g) of this step's forward passes
        self.scored: list[tuple[Tensor, Tensor, Tensor]] = []  # (f, g, y) of every scored sample, float64
        self._hook: Any = None

    def check_trainer(self, trainer: pl.Trainer, owner: Any) -> None:
        """The inner step's checks; one process."""
        self.inner.check_trainer(trainer, owner)
        super().check_trainer(trainer, owner)

    def start(self, module: pl.LightningModule) -> None:
        """Let the inner step prepare."""
        self.inner.start(module)

    def _build(self, module: pl.LightningModule) -> nn.Linear:
        layer = output_layer(module.network, module.num_classes)
        dim, device = layer.in_features, layer.weight.device
        self.head = nn.Linear(dim, module.num_classes, dtype=torch.float64, device=device)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        self.head.requires_grad_(False)
        self.lda = self.build_head(self.head.parameters())
        self.lda.bind(self.head.weight, self.head.bias)
        self._hook = layer.register_forward_hook(self._add_lda)
        self.layer = layer
        return layer

    def _add_lda(self, layer: nn.Module, args: tuple[Any, ...], output: Tensor) -> Tensor | None:
        """Inside a training step: record ``z``, ``f`` and ``g``; return ``f + β g`` (``f`` itself where ``β = 0``).

        ``g = (W_L z + b_L) / s``, ``s`` the standard deviation over the classes of ``W_L z + b_L`` (1 where it is 0),
        taken as a known constant of the step. With adapted features the hook adds ``(β / s)(W_L z + b_L)``, ``z`` the
        output layer's input (in the graph); with pretrained ones a constant, ``β g`` of the step's frozen features.
        """
        if not self.active or self.weight is None:
            return None
        z = args[0] if self.pretrained is None else self.pretrained
        flat = z.detach().reshape(-1, z.shape[-1]).to(torch.float64)
        network = output.detach().to(torch.float64).reshape(flat.shape[0], -1)
        raw = nn.functional.linear(flat, *self.weight)
        spread = raw.std(-1, keepdim=True)
        spread = torch.where(spread > 0, spread, torch.ones_like(spread))
        self.calls.append((flat, network, raw / spread))
        if self.beta == 0.0:
            return None
        if self.pretrained is not None:
            return output + (self.beta * raw / spread).to(output.dtype).reshape(output.shape)
        weight, bias = (part.to(z.dtype) for part in self.weight)
        scale = (self.beta / spread).to(z.dtype).reshape(*output.shape[:-1], 1)
        return output + scale * nn.functional.linear(z, weight, bias)

    def lda_weight(self) -> tuple[Tensor, Tensor]:
        """LDA's head ``(W_L, b_L)``, float64, a class not seen yet given the mean of the seen classes' rows.

        The baseline's unseen class has a zero mean: the origin of (post-ReLU) features, hundreds of nats behind the
        seen classes on every sample, so that every first sample of a class would cost ``β`` times that. The mean row
        gives it the seen classes' mean logit ``(1/|seen|) Σ_{k seen} g_k(z)`` instead: LDA says nothing for or against
        it. Fewer than two classes seen: zeros (every class's logit is then the same: standardising their rounding
        differences, ``s`` a few ulps, would give LDA's logits spread 1 of noise).
        """
        assert self.head is not None
        weight, bias = self.head.weight.detach().clone(), self.head.bias.detach().clone()
        state = self.lda.state.get(self.head.weight) if self.lda is not None else None
        if not state:
            return weight.zero_(), bias.zero_()
        seen = state["count"] > 0
        classes = int(seen.sum())  # one host read a step
        if classes == seen.numel():
            return weight, bias
        if classes < 2:
            return weight.zero_(), bias.zero_()
        weight[~seen] = weight[seen].mean(0)
        bias[~seen] = bias[seen].mean(0)
        return weight, bias

    def step(self, module: pl.LightningModule, optimizer: Any, inputs: Any, label: Tensor) -> StepResult:
        """The inner step on the combined logits; then ``β`` and LDA's statistics on the scored samples."""
        if self.layer is None:
            self._build(module)
        self.weight = self.lda_weight()
        if self.features == "pretrained":
            self.pretrained = frozen_features(module.network, inputs, module.num_classes)
        self.calls, self.active = [], True
        try:
            prediction, label, applied = self.inner.step(module, optimizer, inputs, label)
        finally:
            self.active, self.pretrained = False, None
        if not self.calls:
            raise RuntimeError("the LDA head's hook saw no forward pass of the output layer in the learner's step")
        z, f, g = self.calls[0]  # the pass that made the prediction (the filter's observation)
        if z.shape[0] != label.shape[0]:
            raise RuntimeError(f"the LDA head recorded {z.shape[0]} samples for a step of {label.shape[0]}")
        self.calls = []
        finite = bool(torch.isfinite(z).all() & torch.isfinite(f).all() & torch.isfinite(g).all())
        if finite:  # one host read: a non-finite sample changes neither β nor LDA
            self.scored.append((f, g, label.detach().reshape(-1)))
            network, lda, labels = (torch.cat(parts) for parts in zip(*self.scored, strict=True))
            self.beta = fit_weight(network, lda, labels, self.beta, self.prior_scale, self.upper)
            self.lda.step(closure=lambda: (z, label))
        return prediction, label, applied

    def logged(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The inner step's values and ``β``."""
        return {**self.inner.logged(optimizer), "lda_head/beta": self.beta}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The inner step's state; ``β`` and LDA's head and statistics as ``"loko_lda_head"``."""
        self.inner.on_save_checkpoint(checkpoint)
        if self.head is not None and self.lda is not None:
            checkpoint["loko_lda_head"] = {"beta": self.beta, "head": self.head.state_dict(),
                                           "lda": self.lda.state_dict()}  # fmt: skip

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refused: the head is installed for fitting only, and a fit does not resume with it yet.

        Raises:
            ConfigError: always (``field="ckpt_path"``), saying what to do instead.
        """
        raise ConfigError(
            "resuming a fit with the LDA head is not built yet: its weight, LDA's statistics and the scored logits are "
            "not read back from the checkpoint, so the resumed head would start again. To fix it: fit from the start "
            "with the LDA head, or resume without it (the learner alone)",
            field="ckpt_path",
            owner=LDAHead,
        )

    def evaluate(self, module: pl.LightningModule, entering: bool) -> None:
        """The inner step's evaluation parameters (evaluation uses the network alone: the hook is off)."""
        self.inner.evaluate(module, entering)

    def close(self) -> None:
        """Close the inner step and remove the hook."""
        self.inner.close()
        if self._hook is not None:
            self._hook.remove()
            self._hook, self.layer = None, None


class LDAHead(pl.Callback):
    """Make the learner train and predict on its logits plus ``β`` times streaming LDA's (see the module).

    Add it to the trainer's callbacks (``--trainer.callbacks+=loko_lightning.learner.lda_head.LDAHead``); when fitting
    starts it wraps the learner's step in :class:`LDAHeadStep`.

    Args:
        head: builds the closed-form head over its layer's parameters: ``loko_lightning.peers.StreamingLDA`` (in a
            config, ``class_path: loko_lightning.peers.StreamingLDA`` with its ``init_args``).
        prior_scale: ``σ > 0`` of ``β``'s prior ``N(0, σ²)``.
        upper: ``β``'s upper bound (``≥ 0``; 0: the learner alone, LDA only recorded).
        features: ``"adapted"`` or ``"pretrained"`` (see :class:`LDAHeadStep`).
    """

    def __init__(
        self, head: HeadCallable, prior_scale: float = PRIOR_SCALE, upper: float = UPPER, features: str = "adapted"
    ) -> None:
        if not (math.isfinite(prior_scale) and prior_scale > 0):
            raise ConfigError(f"Invalid prior_scale: {prior_scale} (> 0)", field="prior_scale", owner=LDAHead)
        if not (math.isfinite(upper) and upper >= 0):
            raise ConfigError(f"Invalid upper: {upper} (>= 0)", field="upper", owner=LDAHead)
        if features not in ("adapted", "pretrained"):
            raise ConfigError(f"Invalid features: {features!r} ('adapted' or 'pretrained')", field="features",
                              owner=LDAHead)  # fmt: skip
        self.head, self.prior_scale, self.upper, self.features = head, float(prior_scale), float(upper), features

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Wrap the learner's step (once) when fitting.

        Raises:
            ConfigError: ``step_scales`` or a shared head covariance.
        """
        if stage != "fit" or isinstance(pl_module.online_step, LDAHeadStep):
            return
        if (
            getattr(pl_module, "step_scales", None) is not None
            or getattr(pl_module, "head_covariance", "") != "diagonal"
        ):
            raise ConfigError(
                "the LDA head runs with one step size and the diagonal covariance (the learner's optimizer groups "
                "need to see LoKO through the wrapped step). To fix it: no step_scales, head_covariance: diagonal",
                field="step_scales",
                owner=LDAHead,
            )
        pl_module.online_step = LDAHeadStep(
            pl_module.online_step, self.head, self.prior_scale, self.upper, self.features
        )
