r"""Heads on the backbone's frozen features: streaming LDA, nearest class mean, and a linear head trained by AdamW.

The baselines a fine-tuner has to beat: the backbone (its adapters untouched, so its pretrained features) produces
the features ``z`` that its classification head reads, and only a head on them is learned, one sample at a time. Each
is a torch optimizer that :class:`~loko_lightning.learner.module.OnlineClassifier` takes like AdamW; its step
(:class:`~loko_lightning.learner.frozen_heads.FrozenHeadStep`) runs the network once per sample, scores the
prediction of the head as it stands, and then updates the head on the sample's features (prequential). The head the
network predicts with is the network's own output layer: :class:`StreamingLDA` and :class:`NearestClassMean` write
their closed-form head into it after every update, so checkpoints, ``loko predict``, export and serving use it
unchanged.

Streaming LDA (Hayes & Kanan, "Lifelong machine learning with deep streaming linear discriminant analysis", CVPR-W
2020) keeps the class means :math:`\mu_k`, the class counts :math:`n_k` and one covariance shared by the classes,
updated one sample at a time; it predicts with a Gaussian class model of that covariance:

.. math::

    \delta = z - \mu_y, \quad \mu_y \leftarrow \mu_y + \frac{\delta}{n_y + 1}, \quad
    S \leftarrow S + \frac{n_y}{n_y + 1}\,\delta\delta^\top, \quad n_y \leftarrow n_y + 1, \quad
    \Sigma = S / N,

    \Lambda = \big[(1-\rho)\,\Sigma + \rho\,\nu I\big]^{-1}, \qquad
    \text{logit}_k(z) = (\Lambda\mu_k)^\top z - \tfrac12\,\mu_k^\top\Lambda\mu_k.

``S`` is the within-class scatter, updated exactly (Welford's update per class), so after ``N`` samples the means and
:math:`\Sigma` equal the batch computation; the paper writes the update with the total count in place of the class
count, which is the same only for one class. The shrinkage :math:`\rho` is OAS's (Chen et al. 2010, the closed form
scikit-learn's ``oas`` uses, with :math:`\nu = \mathrm{tr}\,\Sigma / d`) by default, no setting; or a fixed value
with :math:`\nu = 1`, the paper's :math:`(1-\varepsilon)\Sigma + \varepsilon I` (its default :math:`\varepsilon` is
1e-4). The logits are the log-posterior of the classes under equal priors up to a constant, so their softmax is the
model's class probabilities. A class not seen yet has the paper's zero mean (logit 0).

Nearest class mean is the same class model with the covariance :math:`\sigma^2 I`, :math:`\sigma^2 = \mathrm{tr}\,
\Sigma / d` (the pooled within-class variance per feature): its argmax is the nearest mean in Euclidean distance, and
:math:`\sigma^2` only sets how sure its probabilities are.

The head is solved without factorising the ``d x d`` shrunk covariance each sample: the scatter is kept as the
eigendecomposition of its last refresh, every :data:`REFRESH` samples, and a Woodbury correction of the rows since
(:mod:`loko_lightning.peers.lda_basis`): ``m d²`` a sample plus one eigendecomposition per refresh, the same head up to
float64 rounding; nearest class mean costs ``m d``. The statistics are float64. An owner that scores the features
itself (the mixture's LDA) keeps the head in that basis (:meth:`FrozenHead.defer`): ``d²`` a sample. Deferred, the
means and rows in the basis are kept in the state and moved by the sample's rotation (the one product with the basis a
sample); a checkpoint resumed where the basis is computed again bit for bit continues exactly, elsewhere they are
rotated afresh.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from loko_lightning.errors import ConfigError
from loko_lightning.peers.lda_basis import ROTATED, Eigenbasis, HeadFactors, basis_check, lda_factors, lda_head

#: The dtype of the running statistics: sums over thousands of samples lose digits in float32.
STATISTICS_DTYPE = torch.float64


#: Samples between two eigendecompositions of streaming LDA's scatter (see the module): the rows since are a
#: Woodbury correction of at most this rank.
REFRESH = 64


def welford(count: Tensor, delta: Tensor) -> tuple[Tensor, Tensor]:
    """Welford's terms of one sample for its class: the mean's step ``δ / (n + 1)`` and the scatter's weight ``w``.

    The sample adds ``w δδᵀ``, ``w = n / (n + 1)``, to the within-class scatter; ``n`` is the class's count and
    ``δ = z − μ`` its mean's distance before the sample. The same terms for the raw features and for their rotation
    ``Vᵀ z`` (a rotation commutes with both).
    """
    return delta / (count + 1), count / (count + 1)


def scatter_row(delta: Tensor, weight: Tensor) -> Tensor:
    """The row ``√w δ`` ``(1, d)`` whose outer product is the sample's ``w δδᵀ`` in the scatter."""
    return (delta * weight.sqrt())[None]


def ncm_head(means: Tensor, variance: Tensor) -> tuple[Tensor, Tensor]:
    """Nearest class mean's head: ``W_k = μ_k / σ²``, ``b_k = −½ ‖μ_k‖² / σ²`` (σ² = 1 where it is 0)."""
    scale = torch.where(variance > 0, variance, torch.ones_like(variance))
    return means / scale, -0.5 * means.square().sum(-1) / scale


class FrozenHead(torch.optim.Optimizer):
    """The base of the closed-form heads: the class statistics of the features, the head written after each update.

    The optimizer takes the learner's trainable parameters; its step
    (:class:`~loko_lightning.learner.frozen_heads.FrozenHeadStep`) :meth:`bind` s the network's output layer to it
    and changes nothing else (the adapters keep their initial, identity, value). Its state, in ``state[weight]`` of
    the output layer's weight: ``count`` ``(m,)``, ``mean`` ``(m, d)``, ``samples`` (0-d), and the head's own
    (float64). :meth:`step` takes a closure returning ``(features, labels)``, ``(B, d)`` and ``(B,)``, updates the
    statistics one sample after the other, writes the head into the output layer and returns whether it did (a 0-d
    bool tensor: non-finite features change nothing).
    """

    def __init__(self, params: Any, defaults: dict[str, Any]) -> None:
        super().__init__(params, defaults)
        self._head: tuple[Tensor, Tensor] | None = None
        self._deferred = False  # see defer()
        self._factors: HeadFactors | None = None  # deferred: the head of the statistics as they stand

    def defer(self) -> None:
        """Stop writing the head into the bound layer after each update: keep it as :class:`HeadFactors`.

        For an owner that scores the features itself (the mixture's LDA): :meth:`logits` scores them with the head as
        it stands, :meth:`write` writes it into the layer (before a checkpoint is saved). Streaming LDA's head is then
        never multiplied out in a step (see :class:`HeadFactors`).
        """
        self._deferred = True

    def factors(self, state: dict[str, Tensor]) -> HeadFactors:
        """The head of the statistics as :class:`HeadFactors` (here :meth:`head`, with no basis)."""
        return HeadFactors(*self.head(state))

    def current(self) -> HeadFactors | None:
        """Deferred: the head of the statistics as they stand (``None`` before any sample); else ``None``.

        After a checkpoint is loaded, computed once from the statistics alone (the same head, bit for bit: see
        :class:`Eigenbasis`).
        """
        if self._deferred and self._factors is None and self._head is not None:
            state = self.state.get(self._head[0])
            if state:
                self._factors = self.factors(state)
        return self._factors

    def logits(self, features: Tensor) -> Tensor:
        """The head's logits ``(B, m)`` of features ``(B, d)`` (float64).

        The bound layer's; deferred, the head of the statistics as they stand (:meth:`current`; before any sample the
        layer's, all 0).
        """
        factors = self.current()
        if factors is not None:
            return factors.logits(features)
        assert self._head is not None
        return torch.nn.functional.linear(features, *self._head)

    @torch.no_grad()
    def write(self) -> None:
        """Deferred: write the head of the statistics as they stand into the bound layer (nothing before a sample)."""
        factors = self.current()
        if factors is not None and self._head is not None:
            weight, bias = factors.dense()
            self._head[0].copy_(weight.to(self._head[0].dtype))
            self._head[1].copy_(bias.to(self._head[1].dtype))

    def follow(self, other: FrozenHead) -> None:
        """Score as ``other`` (deferred, the learning copy's) does now: its head as it stands.

        The basis is shared (a refresh replaces it, nothing changes it in place).
        """
        factors = other.current()
        self._deferred = True
        self._factors = None if factors is None else HeadFactors(factors.weight.clone(), factors.bias.clone(),
                                                                 factors.basis)  # fmt: skip

    def bind(self, weight: Tensor, bias: Tensor | None) -> None:
        """Make ``weight`` ``(m, d)`` and ``bias`` ``(m,)`` (the network's output layer) the head this optimizer fits.

        Raises:
            ConfigError: no bias, or a tensor this optimizer was not given.
        """
        owned = {id(p) for group in self.param_groups for p in group["params"]}
        if bias is None or weight.dim() != 2 or bias.shape != weight.shape[:1]:
            raise ConfigError(
                f"{type(self).__name__} writes a linear head with a bias into the network's output layer; this "
                f"network's has weight {tuple(weight.shape)} and {'no bias' if bias is None else 'a bias'}. To fix it: "
                "use a network factory whose head is an nn.Linear with a bias (TimmClassifier, TransformersClassifier)",
                field="network",
                owner=type(self),
            )
        if id(weight) not in owned or id(bias) not in owned:
            raise ConfigError(
                f"{type(self).__name__} was not given the network's output layer among its parameters. To fix it: "
                "build it over the learner's trainable parameters (the head trainable), as OnlineClassifier does",
                field="optimizer",
                owner=type(self),
            )
        self._head = (weight, bias)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as torch does, but keep the statistics in their own dtype (torch casts state to the parameter's)."""
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        for saved_id, param in zip(saved_ids, params, strict=True):
            saved = state_dict["state"].get(saved_id)
            if saved:
                self.state[param] = {key: value.to(param.device, copy=True) for key, value in saved.items()}
        self._factors = None  # computed again from the loaded statistics (current)

    @torch.no_grad()
    def step(self, closure: Callable[[], tuple[Tensor, Tensor]]) -> Tensor:  # type: ignore[override]
        """Update the statistics on the closure's ``(features, labels)`` and write the head (see the class)."""
        if closure is None or self._head is None:
            raise ConfigError(
                f"{type(self).__name__}.step needs bind(weight, bias) first and a closure returning (features, "
                "labels); OnlineClassifier's step does both",
                field="optimizer",
                owner=type(self),
            )
        features, labels = closure()
        weight, bias = self._head
        features = features.detach().reshape(labels.shape[0], -1)
        if features.shape[1] != weight.shape[1]:
            raise ValueError(f"Invalid features: {features.shape[1]} per sample, the head reads {weight.shape[1]}")
        finite = torch.isfinite(features).all()
        if not finite:  # one host read per step: nothing non-finite reaches the statistics
            return finite
        state = self.state[weight]
        if not state:
            state.update(self.initial_state(*weight.shape, device=weight.device))
        for z, label in zip(features.to(STATISTICS_DTYPE), labels.tolist(), strict=True):
            self.observe(state, z, label)
        if self._deferred:
            self._factors = self.factors(state)
            return finite
        head_weight, head_bias = self.head(state)
        weight.copy_(head_weight.to(weight.dtype))
        bias.copy_(head_bias.to(bias.dtype))
        return finite

    def observe(self, state: dict[str, Tensor], z: Tensor, label: int) -> None:
        """One sample's update: its class's mean and count (Welford's), the sample count, the spread."""
        count = state["count"][label]
        delta = z - state["mean"][label]
        step, weight = welford(count, delta)
        state["mean"][label] += step
        self.accumulate(state, delta, weight)
        state["count"][label] += 1
        state["samples"] += 1

    def initial_state(self, classes: int, dim: int, device: torch.device) -> dict[str, Tensor]:
        """The statistics before any sample: no count, the paper's zero means."""
        zeros = {"dtype": STATISTICS_DTYPE, "device": device}
        return {"count": torch.zeros(classes, **zeros), "mean": torch.zeros(classes, dim, **zeros),
                "samples": torch.zeros((), **zeros)}  # fmt: skip

    def accumulate(self, state: dict[str, Tensor], delta: Tensor, weight: Tensor) -> None:
        """Add one sample's ``weight · δδᵀ`` (``δ`` from its class's mean before the update) to the spread."""
        raise NotImplementedError

    def head(self, state: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """The head ``(W, b)`` of the statistics, float64."""
        raise NotImplementedError

    def spread(self, state: dict[str, Tensor]) -> Tensor:
        """``tr S``, the trace of the within-class scatter (0-d, float64)."""
        raise NotImplementedError

    def nearest_head(self, state: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """Nearest class mean's head of the statistics: :func:`ncm_head` with ``σ² = tr S / (N d)``."""
        dim = state["mean"].shape[1]
        return ncm_head(state["mean"], self.spread(state) / (state["samples"].clamp_min(1) * dim))

    def nearest_mean(self) -> tuple[Tensor, Tensor] | None:
        """:meth:`nearest_head` of this head's statistics as they stand; None before any sample.

        What :class:`NearestClassMean` would predict after the same samples, whichever head this is.
        """
        state = self.state.get(self._head[0]) if self._head is not None else None
        return self.nearest_head(state) if state else None


class StreamingLDA(FrozenHead):
    """Streaming linear discriminant analysis (Hayes & Kanan 2020) on the frozen features (see the module).

    Args:
        params: the learner's trainable parameters (the output layer among them; the others are left alone).
        shrinkage: ``"oas"`` (default: OAS's closed form, no setting) or a fixed ``ε`` in ``(0, 1]``: the covariance
            ``(1 − ε) Σ + ε I`` (the paper's default is 1e-4).

    Example:
        >>> layer = torch.nn.Linear(3, 2)
        >>> lda = StreamingLDA(layer.parameters())
        >>> lda.bind(layer.weight, layer.bias)
        >>> applied = lda.step(lambda: (torch.randn(4, 3), torch.tensor([0, 1, 0, 1])))
        >>> lda.state[layer.weight]["count"].tolist()
        [2.0, 2.0]
    """

    def __init__(self, params: Any, shrinkage: float | str = "oas") -> None:
        number = isinstance(shrinkage, (int, float)) and not isinstance(shrinkage, bool)
        if not (shrinkage == "oas" or (number and math.isfinite(shrinkage) and 0 < shrinkage <= 1)):
            raise ConfigError(
                f"Invalid shrinkage: {shrinkage!r}. To fix it: 'oas' (OAS's closed form, no setting) or a number in "
                "(0, 1] (the paper's 1e-4; 1e-2 shrinks more)",
                field="shrinkage",
                owner=StreamingLDA,
            )
        super().__init__(params, {"shrinkage": shrinkage if shrinkage == "oas" else float(shrinkage)})
        self._basis: Eigenbasis | None = None  # of the scatter's last refresh: built at the next head
        self._scored: tuple[Tensor, Tensor, Tensor] | None = None  # deferred: (z, V, Vᵀ z) of the last sample scored

    def initial_state(self, classes: int, dim: int, device: torch.device) -> dict[str, Tensor]:
        """The common statistics, the scatter folded at the last refresh ``S₀`` ``(d, d)`` and the rows since."""
        state = super().initial_state(classes, dim, device)
        state["scatter"] = torch.zeros(dim, dim, dtype=STATISTICS_DTYPE, device=device)
        state["recent"] = torch.zeros(0, dim, dtype=STATISTICS_DTYPE, device=device)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as :class:`FrozenHead` does; the eigenbasis is rebuilt from the loaded scatter at the next head."""
        super().load_state_dict(state_dict)
        for state in self.state.values():  # saved before the rows were kept: its scatter is all of S, no rows
            if "scatter" in state and "recent" not in state:
                state["recent"] = state["scatter"].new_zeros(0, state["scatter"].shape[0])
        self._basis = None

    def accumulate(self, state: dict[str, Tensor], delta: Tensor, weight: Tensor) -> None:
        """``S += w δδᵀ``: the row ``√w δ`` joins ``U``; every :data:`REFRESH` rows ``S₀ += Uᵀ U`` (see the module)."""
        if not float(weight):  # a class's first sample: no spread yet
            return
        rows = torch.cat([state["recent"], scatter_row(delta, weight)])
        if rows.shape[0] == REFRESH:
            state["scatter"].addmm_(rows.T, rows)
            rows, self._basis = rows[:0], None
        state["recent"] = rows

    def spread(self, state: dict[str, Tensor]) -> Tensor:
        """``tr S = tr S₀ + ‖U‖²_F``."""
        return state["scatter"].diagonal().sum() + state["recent"].square().sum()

    def covariance(self, state: dict[str, Tensor]) -> Tensor:
        """The shared covariance ``Σ = (S₀ + Uᵀ U) / N`` (float64)."""
        rows = state["recent"]
        return (state["scatter"] + rows.T @ rows) / state["samples"].clamp_min(1)

    def eigenbasis(self, state: dict[str, Tensor]) -> Eigenbasis:
        """The eigenbasis of the last refresh (computed here when missing), up to date with the statistics.

        Deferred, the rotated means and rows are kept in the state (:data:`ROTATED`) and updated by :meth:`observe`
        from ``Vᵀ z``; a new basis takes them from the state when they are of it (the same ``V``, bit for bit, as
        :func:`basis_check` says: a checkpoint resumed on the machine that saved it), else rotates them afresh.
        """
        if self._basis is None:
            self._basis = Eigenbasis(state["scatter"], state["mean"].shape[0])
            if self._deferred:
                self._adopt(state)
        if not self._deferred:
            for key in ROTATED:  # kept only while deferred: stale once the statistics move without them
                state.pop(key, None)
            self._basis.update(state)
        return self._basis

    def _adopt(self, state: dict[str, Tensor]) -> None:
        """Give the new basis the state's rotated vectors when they are of it; else rotate afresh, into the state."""
        basis = self._basis
        assert basis is not None
        check = basis_check(basis.vectors)
        saved = state.get("basis_check")
        if saved is not None and torch.equal(saved, check) and state["rotated_recent"].shape == state["recent"].shape:
            basis.means, basis.recent = state["rotated_mean"], state["rotated_recent"]
            return
        basis.update(state)
        state["rotated_mean"], state["rotated_recent"], state["basis_check"] = basis.means, basis.recent, check

    def observe(self, state: dict[str, Tensor], z: Tensor, label: int) -> None:
        """The sample's update; deferred, with a basis, also its rotated mean and row, from ``Vᵀ z``.

        No product with ``V`` when the sample was just scored (:meth:`logits` kept its ``Vᵀ z``, let go here).
        """
        scored, self._scored = self._scored, None
        basis = self._basis if self._deferred else None
        if basis is None or "rotated_mean" not in state:
            super().observe(state, z, label)
            return
        count, rows = state["count"][label].clone(), state["recent"].shape[0]
        if scored is not None and scored[1] is basis.vectors and torch.equal(scored[0], z):
            rotated = scored[2]
        else:
            rotated = basis.rotate(z)
        delta = rotated - state["rotated_mean"][label]  # Vᵀ (z − μ_y)
        super().observe(state, z, label)
        if self._basis is not basis:  # the rows were folded into a new S₀: its basis rotates everything afresh
            for key in ROTATED:
                state.pop(key)
            return
        step, weight = welford(count, delta)  # the same terms as the update's, rotated
        state["rotated_mean"][label] += step
        if state["recent"].shape[0] > rows:  # accumulate added the sample's row: the same row, rotated
            state["rotated_recent"] = torch.cat([state["rotated_recent"], scatter_row(delta, weight)])
            basis.recent = state["rotated_recent"]

    def logits(self, features: Tensor) -> Tensor:
        """:meth:`FrozenHead.logits`; deferred, one sample's ``Vᵀ z`` is kept for :meth:`observe`."""
        factors = self.current()
        if factors is None or factors.basis is None or features.shape[0] != 1:
            return super().logits(features)
        rotated = factors.rotate(features)
        self._scored = (features[0], factors.basis, rotated[0])
        return factors.score(rotated)

    def head(self, state: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """:func:`lda_head` of the statistics, in the eigenbasis of the last refresh."""
        return lda_head(state, self.eigenbasis(state), self.param_groups[0]["shrinkage"])

    def factors(self, state: dict[str, Tensor]) -> HeadFactors:
        """:func:`lda_factors` of the statistics: the head in the eigenbasis of the last refresh, not multiplied out."""
        return lda_factors(state, self.eigenbasis(state), self.param_groups[0]["shrinkage"])


class NearestClassMean(FrozenHead):
    """Nearest class mean on the frozen features: the class means, one pooled variance ``σ²`` (see the module).

    Args:
        params: the learner's trainable parameters (the output layer among them; the others are left alone).
    """

    def __init__(self, params: Any) -> None:
        super().__init__(params, {})

    def initial_state(self, classes: int, dim: int, device: torch.device) -> dict[str, Tensor]:
        """The common statistics and the trace of the within-class scatter."""
        state = super().initial_state(classes, dim, device)
        state["scatter_trace"] = torch.zeros((), dtype=STATISTICS_DTYPE, device=device)
        return state

    def accumulate(self, state: dict[str, Tensor], delta: Tensor, weight: Tensor) -> None:
        """``tr S += w ‖δ‖²``."""
        state["scatter_trace"] += weight * delta.square().sum()

    def spread(self, state: dict[str, Tensor]) -> Tensor:
        """``tr S``, kept as it goes."""
        return state["scatter_trace"]

    def head(self, state: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """:meth:`nearest_head`: :func:`ncm_head` with ``σ² = tr S / (N d)``."""
        return self.nearest_head(state)


class FrozenLinearHead(torch.optim.AdamW):
    """A linear head on the frozen features, trained by AdamW (torch's, with its arguments: ``lr``, ...).

    Its step (:class:`~loko_lightning.learner.frozen_heads.FrozenHeadStep`) takes the gradient of the cross-entropy
    with respect to the output layer alone, from the features of the same forward pass that made the prediction (no
    backward pass through the backbone); the adapters get no gradient, so AdamW leaves them alone. Choose ``lr``
    online with ``select`` as for AdamW (``configs/baselines/frozen_linear_head.yaml``).
    """
