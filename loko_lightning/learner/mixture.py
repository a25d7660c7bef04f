r"""A Bayesian mixture of the fine-tuner and streaming LDA on the frozen backbone, scored prequentially.

Experts :math:`k = 1..K`: the learner's own prediction (LoKO's, made before its update); a head fitted in closed form
on the backbone's features with the adapters disabled (:class:`~loko_lightning.peers.frozen_heads.StreamingLDA`,
injected: the learner layer does not import the peers), its logits tempered by each temperature :math:`T_j` of a grid
(one expert per temperature: LDA's raw probabilities are overconfident); LDA's argmax alone, its confidence
Laplace's rule on LDA's past hits (:func:`vote_log_probabilities`); optionally the learner's prediction tempered
(``learner_temperatures``), log-linear pools of the learner and LDA (``pools``, :func:`pooled_log_probabilities`:
``p ∝ p_learner^a · exp(z_LDA / T)``, the two heads' evidence added, which neither expert alone predicts) and nearest
class mean on LDA's statistics at each temperature (``nearest_mean``: the class means and one pooled variance, ahead of
LDA while the classes have a few samples each). The learner predicts with the mixture

.. math::

    p(y \mid x_t) = \sum_k w_{k,t}\, p_k(y \mid x_t), \qquad
    w_{k,t+1} \propto w_{k,t}\, p_k(y_t \mid x_t) \quad\text{(Bayes)}, \qquad
    w \leftarrow (1 - \alpha)\, w + \alpha / K \quad\text{(fixed share, } \alpha = \texttt{share}\text{)},

the weights updated after the sample is scored (prequential; the arithmetic, pure functions:
:mod:`loko_lightning.learner.mixing`). With :math:`\alpha = 0` and a uniform prior the
mixture's cumulative log loss is at most the best expert's plus :math:`\log K`; fixed share (Herbster & Warmuth 1998)
lets the weight move from LDA to the fine-tuner later, at a cost of about :math:`\log(K/\alpha)` nats a switch and
:math:`\alpha` nats a sample. With ``share_past`` :math:`\beta > 0` a share goes to the mean of the past posteriors
too, :math:`w \leftarrow (1 - \alpha - \beta) w + \alpha / K + \beta \frac1t \sum_{s<t} v_s` (mixing past
posteriors, Bousquet & Warmuth 2002): an expert that led before comes back as fast, with a smaller uniform floor
under the experts that never led. Derivation and measurements: ``docs/results/mixture.md``.

The learner's option ``mixture`` (:class:`FrozenHeadMixture`, here; ``configs/presets/loko_mixture_lda.yaml`` sets it)
wraps its step in :class:`~loko_lightning.learner.mixture_step.MixtureStep`, so every prediction the learner makes is
the mixture's: the prequential score in ``loko fit``, held-out evaluation, ``loko predict`` and ``loko serve`` (which
learns on with it). The network's weights and LoKO's trajectory are those of the plain learner; the mixture's state
(the weights, LDA's head and statistics) rides in the checkpoint as ``"loko_mixture"`` and is read back (a fit resumes
exactly). Under DDP every process mixes and learns from every process's samples (``MixtureStep``).
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import Any

from loko_lightning.errors import ConfigError
from loko_lightning.learner.checks import optimizer_class, optimizer_config, optimizer_from_config
from loko_lightning.learner.mixture_step import SHARE, TEMPERATURES, HeadCallable, MixtureStep
from loko_lightning.learner.steps import OnlineStep

__all__ = ["SHARE", "TEMPERATURES", "FrozenHeadMixture", "HeadCallable", "MixtureStep", "head_config"]


def head_config(head: HeadCallable) -> dict[str, Any] | None:
    """A head callable as plain values ``{"class_path", "init_args"}`` (``None``: not a class with plain arguments).

    A class, a ``functools.partial`` of one, or the partial the command line's parser makes of a ``class_path``.
    """
    cls = optimizer_class(head)
    keywords: dict[str, Any] = {}
    target: Any = head
    while isinstance(target, functools.partial):
        keywords = {**target.keywords, **keywords}
        target = target.func
    return None if cls is None else optimizer_config(functools.partial(cls, **keywords))


def _positive(values: list[float] | None, field: str, rule: str) -> list[float]:
    """``values`` as floats (``None``: none), each finite and > 0; else refused naming ``field``."""
    values = [float(v) for v in values or ()]
    if not all(math.isfinite(v) and v > 0 for v in values):
        raise ConfigError(f"Invalid {field}: {values} ({rule})", field=field, owner=FrozenHeadMixture)
    return values


class FrozenHeadMixture:
    """The learner's option ``mixture``: predict with the mixture of the learner and a frozen head (see the module).

    ``OnlineClassifier(..., mixture=FrozenHeadMixture(StreamingLDA))`` wraps the learner's step in
    :class:`MixtureStep` with these arguments; in a config, ``model.mixture`` with this class path
    (``configs/presets/loko_mixture_lda.yaml``). A checkpoint keeps it as :meth:`spec` (plain values) and the learner
    it loads into rebuilds it (:meth:`from_spec`).

    Args:
        head: builds the frozen head over its layer's parameters: ``loko_lightning.peers.StreamingLDA`` or a
            ``functools.partial`` of it (in a config, ``class_path: loko_lightning.peers.StreamingLDA`` with its
            ``init_args``).
        temperatures: LDA's temperatures, one expert each (each > 0); default :data:`TEMPERATURES`.
        share: fixed share's ``α`` in ``[0, 1)`` (0: the Bayesian mixture).
        prior_learner: the learner's prior weight in ``(0, 1)``; ``None``: uniform over the experts.
        vote: add LDA's argmax with its past accuracy as its confidence as an expert (:func:`vote_log_probabilities`).
        learner_temperatures: the learner's prediction also tempered at each ``T > 0``, one expert each (``T < 1``
            sharpens it: the learner's calibration chosen by the same Bayes weights); default none.
        pools: powers ``a > 0`` of the learner's prediction, each pooled with LDA's at every one of ``temperatures``
            (``p ∝ p_learner^a exp(z_LDA / T)``, :func:`pooled_log_probabilities`), one expert each; default none.
        nearest_mean: add nearest class mean on the head's statistics at every one of ``temperatures``, one expert
            each (it leads LDA while the classes have a few samples each: one covariance is hard to estimate then).
        share_past: ``β ≥ 0``, the share to the mean of the past posteriors (mixing past posteriors; see the module),
            with ``share + share_past < 1``; 0: fixed share alone.
        nearest_vote: with ``nearest_mean``, add nearest class mean's argmax with its past accuracy as its confidence
            as an expert, as LDA's vote (screened on replays: ``results/mixture/nearest/replay_vote_share_past.md``).
        calibration: ``κ ≥ 0``, the prior's strength in samples per bin of the mixture's recalibration: its top-1
            confidence moved by the past gap between accuracy and confidence in its bin, shrunk by ``κ``
            (:func:`~loko_lightning.learner.mixing.recalibrated`; the argmax is kept); 0: none.
    """

    def __init__(
        self,
        head: HeadCallable,
        temperatures: list[float] | None = None,
        share: float = SHARE,
        prior_learner: float | None = None,
        vote: bool = True,
        learner_temperatures: list[float] | None = None,
        pools: list[float] | None = None,
        nearest_mean: bool = False,
        share_past: float = 0.0,
        nearest_vote: bool = False,
        calibration: float = 0.0,
    ) -> None:
        temperatures = list(TEMPERATURES) if temperatures is None else [float(t) for t in temperatures]
        learner_temperatures = _positive(learner_temperatures, "learner_temperatures", "each > 0")
        pools = _positive(pools, "pools", "each power > 0, e.g. [0.5, 1]; [] for none")
        if not temperatures or not all(math.isfinite(t) and t > 0 for t in temperatures):
            raise ConfigError(f"Invalid temperatures: {temperatures}", field="temperatures", owner=FrozenHeadMixture)
        if not 0.0 <= share < 1.0:
            raise ConfigError(f"Invalid share: {share} (in [0, 1))", field="share", owner=FrozenHeadMixture)
        if not (share_past >= 0.0 and share + share_past < 1.0):
            raise ConfigError(
                f"Invalid share_past: {share_past} (>= 0, with share + share_past < 1; share is {share})",
                field="share_past",
                owner=FrozenHeadMixture,
            )
        if prior_learner is not None and not 0.0 < prior_learner < 1.0:
            raise ConfigError(
                f"Invalid prior_learner: {prior_learner} (in (0, 1))", field="prior_learner", owner=FrozenHeadMixture
            )
        if head_config(head) is None:
            raise ConfigError(
                f"Invalid head: {head!r}; a checkpoint keeps the head as its class and plain keyword arguments. To "
                "fix it: loko_lightning.peers.StreamingLDA, or functools.partial(StreamingLDA, shrinkage=...)",
                field="head",
                owner=FrozenHeadMixture,
            )
        self.head, self.temperatures, self.share = head, temperatures, float(share)
        self.prior_learner, self.vote, self.learner_temperatures = prior_learner, bool(vote), learner_temperatures
        if nearest_mean and not callable(getattr(optimizer_class(head), "nearest_mean", None)):
            raise ConfigError(
                f"Invalid nearest_mean: True with the head {head!r}, which keeps no class means to read. To fix it: "
                "head loko_lightning.peers.StreamingLDA, or nearest_mean: false",
                field="nearest_mean",
                owner=FrozenHeadMixture,
            )
        if nearest_vote and not nearest_mean:
            raise ConfigError(
                "Invalid nearest_vote: True without nearest_mean (the vote is nearest class mean's argmax). To fix "
                "it: nearest_mean: true, or nearest_vote: false",
                field="nearest_vote",
                owner=FrozenHeadMixture,
            )
        if not (math.isfinite(calibration) and calibration >= 0.0):
            raise ConfigError(
                f"Invalid calibration: {calibration} (the prior's strength in samples per bin, >= 0, e.g. 300; 0 for "
                "none)",
                field="calibration",
                owner=FrozenHeadMixture,
            )
        self.pools, self.nearest_mean, self.share_past = pools, bool(nearest_mean), float(share_past)
        self.nearest_vote, self.calibration = bool(nearest_vote), float(calibration)

    def wrap(self, inner: OnlineStep) -> MixtureStep:
        """The learner's step ``inner`` predicting with this mixture."""
        return MixtureStep(
            inner, self.head, self.temperatures, self.share, self.prior_learner, self.vote, self.learner_temperatures,
            self.pools, self.nearest_mean, self.share_past, owner=type(self), nearest_vote=self.nearest_vote,
            calibration=self.calibration,
        )  # fmt: skip

    def spec(self) -> dict[str, Any]:
        """Plain values a checkpoint keeps (the learner's hyperparameter ``mixture``)."""
        return {
            "head": head_config(self.head),
            "temperatures": list(self.temperatures),
            "share": self.share,
            "prior_learner": self.prior_learner,
            "vote": self.vote,
            "learner_temperatures": list(self.learner_temperatures),
            "pools": list(self.pools),
            "nearest_mean": self.nearest_mean,
            "share_past": self.share_past,
            "nearest_vote": self.nearest_vote,
            "calibration": self.calibration,
        }

    @classmethod
    def from_spec(cls, spec: Any) -> FrozenHeadMixture:
        """The mixture a :meth:`spec` (or a config's ``{class_path, init_args}`` of this class) describes.

        A head of this package (``loko_lightning.peers``) is imported; any other must be imported already (a
        checkpoint is data, never code to run).

        Raises:
            ConfigError: a head that is not an imported frozen head (``field="mixture"``).
        """
        spec = dict(spec.get("init_args") or {}) if "class_path" in spec else dict(spec)
        head = spec.pop("head", None)
        path = head.get("class_path") if isinstance(head, dict) else None
        if isinstance(path, str) and path.startswith("loko_lightning."):  # this package's own heads only
            importlib.import_module(path.rpartition(".")[0])
        built = optimizer_from_config(head) if isinstance(head, dict) else head
        if built is None:
            raise ConfigError(
                f"the mixture's head {head!r} is not a frozen head this process has imported. To fix it: import "
                "loko_lightning.peers first, or configure head: {class_path: loko_lightning.peers.StreamingLDA}",
                field="mixture",
                owner=FrozenHeadMixture,
            )
        return cls(built, **spec)
