r"""What the filter observes of a sample: the observation model :math:`y_k = h(x_k, \tilde\theta) + v_k`.

An :class:`Observation` owns everything that depends on what is observed:

- how the prediction :math:`\hat y` is formed from the network's raw outputs (:meth:`Observation.predict`, inside the
  graph the Jacobian is taken through),
- how the target :math:`y` is formed from a label (:meth:`Observation.target`),
- which rows of :math:`H` the reverse pass must compute (:attr:`Observation.sums_to_one`: when every prediction sums
  to one, the rows of :math:`H` sum to zero and the last row is minus the sum of the others),
- the check that a prediction and a target fit it (:meth:`Observation.check`),
- which observation-noise estimators make sense for it (:attr:`Observation.r_estimators`),
- which rows of ``H`` it observes when they are chosen from the label (:meth:`Observation.cotangents`).

How the belief is updated from it is the filter's (:mod:`loko_lightning.kalman.filters`); a filter may ask for other
rows of the same observation (the information-form filters read the Fisher's).

The Jacobian engine (:class:`~loko_lightning.JacobianEngine`), the optimizer (:class:`~loko_lightning.LoKO`) and the
learner all take it from here; the learner passes the one it builds to both. A new observation is one subclass
registered in :data:`OBSERVATIONS` (or passed as an instance).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from functools import partial
from typing import ClassVar

import torch
from torch import Tensor

from loko_lightning.errors import ConfigError

__all__ = [
    "OBSERVATIONS",
    "Observation",
    "Regression",
    "Softmax",
    "TopK",
    "check_probabilities",
    "get_observation",
]


class Observation:
    """What is observed of one sample: the prediction from the network's outputs, the target from a label.

    Attributes:
        name: the name the registry and the configs use.
        sums_to_one: every prediction sums to one, whatever the parameters (so the rows of ``H`` sum to zero, and
            ``S`` is singular along the all-ones vector of each sample).
        r_estimators: the observation-noise estimators (:data:`loko_lightning.kalman.noise.R_ESTIMATORS`) that apply;
            the first is the default.
        needs_label: the rows of ``H`` depend on the label (:meth:`cotangents`), so the Jacobian engine takes it
            (:meth:`loko_lightning.JacobianEngine.observe`).
    """

    name: ClassVar[str]
    sums_to_one: ClassVar[bool] = False
    r_estimators: ClassVar[tuple[str, ...]] = ("taylor", "residual", "identity", "decay")
    needs_label: ClassVar[bool] = False

    def predict(self, outputs: Tensor) -> Tensor:
        """The prediction ``ŷ`` from the network's outputs ``(..., m)`` (differentiable: the Jacobian is of this)."""
        raise NotImplementedError

    def target(self, label: Tensor, prediction: Tensor) -> Tensor:
        """The target ``y`` for ``label`` (one label per prediction), like ``prediction`` in shape and dtype."""
        raise NotImplementedError

    def check(self, prediction: Tensor, target: Tensor) -> None:
        """Refuse a prediction ``(B, m)`` and target ``(B, m)`` that do not fit this observation (may read the host).

        :class:`~loko_lightning.LoKO` runs it on every step.
        """

    def violation(self, prediction: Tensor, target: Tensor) -> Tensor | None:
        """Whether :meth:`check` would refuse this step, as a 0-d bool on the device (no host read).

        ``None``: no check. :class:`~loko_lightning.LoKO` skips such a step and reads the count now and then.
        """
        return None

    def check_outputs(self, outputs: Tensor) -> None:
        """Refuse network outputs ``(..., m)`` this observation cannot learn from (may read the host).

        The Jacobian engine runs it on its first forward pass for a model and an output shape.
        """

    @property
    def spec(self) -> str:
        """The name that :func:`get_observation` turns back into this observation (with its arguments)."""
        return self.name

    def reverse_rows(self, m: int) -> int:
        """How many rows of ``H`` the reverse pass computes for ``m`` outputs (the rest follow from them)."""
        return m - 1 if self.sums_to_one and m > 1 else m

    def rows(self, m: int) -> int:
        """How many rows of ``H`` the optimizer receives per sample for ``m`` outputs (``m``: all of ``∂ŷ/∂θ̃``)."""
        return m

    def aggregate(self, prediction: Tensor, target: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
        """The coordinates the filter observes, when they are not all ``m`` outputs; ``None``: all of them.

        Args:
            prediction: ``ŷ``, ``(B, m)``.
            target: ``y``, ``(B, m)``.

        Returns:
            ``None``, or ``(A, G, prediction, target)``: each sample's aggregation ``A`` (``(B, rows, m)``, the
            observed coordinates are ``A ŷ``, in the order of ``H``'s rows), a lift ``G`` of the same shape with
            ``A Gᵀ = I`` (an estimate ``R̂`` in the observed coordinates is ``Gᵀ R̂ G`` in the outputs'), and the
            observed prediction and target ``(B, rows)``.
        """
        return None

    def cotangents(self, prediction: Tensor, target: Tensor) -> Tensor | None:
        """The cotangents on the network's outputs whose pullbacks are the rows of ``H``; ``None``: ``∂ŷ/∂θ̃``.

        Args:
            prediction: ``ŷ``, ``(m,)`` or ``(B, m)`` (detached).
            target: ``y``, the same shape.

        Returns:
            ``None``, or ``(rows, m)`` (``(rows, B, m)`` for a batch): row ``j`` of ``H`` is then
            ``c_jᵀ ∂z/∂θ̃`` for the outputs ``z`` the network returns (before :meth:`predict`).
        """
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(vars(self).items()))))


class Softmax(Observation):
    r"""The paper's classification setting: class probabilities :math:`\hat y = \mathrm{softmax}(z)`, one-hot targets.

    The check refuses a prediction that is not a probability vector (a negative entry, or a sum off 1 by more than
    rounding: logits passed where probabilities belong) when the target is one.
    """

    name = "softmax"
    sums_to_one = True
    r_estimators = ("taylor", "residual", "identity", "decay", "softmax")

    def predict(self, outputs: Tensor) -> Tensor:
        """``softmax(outputs)`` over the last dimension."""
        return torch.softmax(outputs, dim=-1)

    def target(self, label: Tensor, prediction: Tensor) -> Tensor:
        """The one-hot vector of each class index in ``label``."""
        return torch.nn.functional.one_hot(label, prediction.shape[-1]).to(prediction.dtype)

    def check(self, prediction: Tensor, target: Tensor) -> None:
        """See :func:`check_probabilities`."""
        check_probabilities(prediction, target)

    def violation(self, prediction: Tensor, target: Tensor) -> Tensor:
        """:func:`check_probabilities`'s test on the device."""
        return probability_violation(prediction, target)

    def check_outputs(self, outputs: Tensor) -> None:
        """Refuse outputs a classifier does not give: one per sample, already probabilities, or not ``(batch, m)``.

        The softmax of one output is always 1; outputs of more than two dimensions would be read as their product.
        """
        if outputs.dim() > 2:
            raise ValueError(
                f"Invalid model output: shape {tuple(outputs.shape)}, but class scores are (batch, m), one row of m "
                f"logits per sample; this output would be read as {outputs[0].numel()} classes. To fix it: end the "
                "network in a classification head (e.g. global pooling and a Linear to m outputs)"
            )
        m = outputs.shape[-1] if outputs.dim() else 0
        if m == 1:
            raise ValueError(
                "Invalid model output: one output per sample, and the softmax of one output is always 1 (a zero "
                "Jacobian: nothing would be learned). To fix it: give the network m >= 2 outputs (2 for a binary "
                'task, one logit per class), or observe the output as it is with observation="regression"'
            )
        if m < 2 or not outputs.is_floating_point():
            return
        flat = outputs.detach().reshape(-1, m)
        low, off = torch.stack([flat.min(), (flat.sum(-1) - 1).abs().max()]).double().tolist()
        if low >= 0.0 and off <= 10 * m * torch.finfo(outputs.dtype).eps:
            raise ValueError(
                "Invalid model output: the network's outputs are already probabilities (non-negative, each sample's "
                "summing to 1), and LoKO applies the softmax itself: a network that ends in Softmax is softmaxed twice "
                "and learns badly. To fix it: remove the final Softmax so that the network returns logits"
            )


class Regression(Observation):
    r"""Real outputs observed as they are (:math:`\hat y = z`); the label is the target vector itself."""

    name = "regression"

    def predict(self, outputs: Tensor) -> Tensor:
        """The outputs themselves."""
        return outputs

    def target(self, label: Tensor, prediction: Tensor) -> Tensor:
        """``label`` (the target values, shaped like the prediction) in the prediction's dtype."""
        if tuple(label.shape) != tuple(prediction.shape):
            raise ValueError(
                f"Invalid label: a regression target must have the prediction's shape {tuple(prediction.shape)}, "
                f"got {tuple(label.shape)}"
            )
        return label.to(prediction.dtype)


class TopK(Softmax):
    r"""Class probabilities, of which each step observes only the label, the most probable classes and the rest.

    Not the paper's observation (which is ``k = m - 1``). With ``I`` the label and the ``k`` most probable other
    classes (``k + 1`` classes, in class order; the label's own rank does not matter), the filter observes the
    aggregation :math:`u = A\hat y = (\hat y_I, \sum_{j \notin I} \hat y_j)` of ``k + 2`` coordinates (the last one,
    "the rest", keeps the observed vector a probability vector and is dropped when ``I`` holds every class), with
    target :math:`A y = (y_I, 0)`. A linear function of the outputs is an observation like any other, so the step
    is the exact EKF update for it: :math:`H_u = A H`, :math:`e_u = A e`, an ``(k + 2) x (k + 2)`` system. The
    reverse pass pulls back ``k + 2`` cotangents from the logits (:math:`J_s a` for each row :math:`a` of
    :math:`A`), not ``m - 1``.

    ``R`` stays one ``m x m`` matrix of class pairs, positive semi-definite: the estimate :math:`\hat R_u` of a step
    (Taylor or residual, in the observed coordinates) is lifted to the classes as :math:`G^\top \hat R_u G`, where
    :math:`G` has one-hot rows for ``I`` and spreads the rest over the other classes in proportion to :math:`\hat
    y` (so :math:`A G^\top = I`), and the EMA runs on ``R``: :math:`R_k = \beta R_{k-1} + (1-\beta) G^\top \hat R_u
    G` (the mean of the samples' lifts in a joint step). The observed block of ``S`` is :math:`A R_k A^\top =
    \beta A R_{k-1} A^\top + (1-\beta)\hat R_u`: the EMA in the observed coordinates, whatever classes earlier steps
    observed. With ``k = m - 1`` (``A = G = I``) this is the paper's observation and EMA.

    Args:
        k: how many classes besides the label, ``1 <= k <= m - 1`` (checked against ``m`` at the first step).
    """

    name = "topk"
    r_estimators = ("taylor", "residual")
    needs_label = True

    def __init__(self, k: int = 5) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"Invalid k: {k!r} (must be an integer >= 1)", field="k", owner=TopK)
        self.k = k

    def _fits(self, m: int) -> None:
        if self.k >= m:
            raise ConfigError(
                f"Invalid k: {self.k} for {m} classes (must be at most m - 1 = {m - 1}; k = m - 1 is the full "
                "observation, observation: softmax)",
                field="k",
                owner=TopK,
            )

    def rows(self, m: int) -> int:
        """``k + 2`` (``m`` when ``k = m - 1``: every class, no rest)."""
        self._fits(m)
        return m if self.k + 1 == m else self.k + 2

    def reverse_rows(self, m: int) -> int:
        """As :meth:`rows`."""
        return self.rows(m)

    def index(self, prediction: Tensor, target: Tensor) -> Tensor:
        """``I`` of each sample, ``(B, k + 1)`` in class order: the label and the ``k`` most probable others."""
        label = target.argmax(-1, keepdim=True)
        scores = prediction.detach().clone()
        scores.scatter_(-1, label, math.inf)  # the label first, whatever its probability
        return scores.topk(self.k + 1, dim=-1, sorted=False).indices.sort(-1).values

    def aggregation(self, index: Tensor, m: int, dtype: torch.dtype) -> Tensor:
        """``A`` of each sample, ``(B, rows, m)``: one-hot rows for ``I``, then the rest's indicator row."""
        one_hot = torch.nn.functional.one_hot(index, m).to(dtype)
        if index.shape[-1] == m:
            return one_hot
        return torch.cat([one_hot, 1 - one_hot.sum(-2, keepdim=True)], -2)

    def lift(self, A: Tensor, prediction: Tensor) -> Tensor:
        """``G``: ``A``'s one-hot rows, and the rest spread over its classes in proportion to ``ŷ``.

        Uniformly when they all have probability 0.
        """
        if A.shape[-2] == A.shape[-1]:
            return A
        rest = A[..., -1, :] * prediction
        total = rest.sum(-1, keepdim=True)
        uniform = A[..., -1, :] / A[..., -1, :].sum(-1, keepdim=True)
        spread = torch.where(total > 0, rest / total.clamp_min(torch.finfo(prediction.dtype).tiny), uniform)
        return torch.cat([A[..., :-1, :], spread[..., None, :]], -2)

    def aggregate(self, prediction: Tensor, target: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``A``, ``G`` and ``(A ŷ, A y)`` of each sample (see the class docstring)."""
        A = self.aggregation(self.index(prediction, target), prediction.shape[-1], prediction.dtype)
        G = self.lift(A, prediction)
        return A, G, (A @ prediction[..., None])[..., 0], (A @ target[..., None])[..., 0]

    def cotangents(self, prediction: Tensor, target: Tensor) -> Tensor:
        """``J_s a`` for each row ``a`` of ``A`` (``J_s = diag(ŷ) - ŷŷᵀ``, symmetric): ``(rows, [B,] m)``."""
        self._fits(prediction.shape[-1])
        batched = prediction.dim() == 2
        p, y = (prediction, target) if batched else (prediction[None], target[None])
        A = self.aggregation(self.index(p, y), p.shape[-1], p.dtype)  # (B, rows, m)
        rows = p[:, None, :] * A - p[:, None, :] * (A @ p[..., None])  # J_s a = ŷ ⊙ a - ŷ (ŷᵀ a)
        rows = rows.movedim(1, 0)
        return rows if batched else rows[:, 0]

    @property
    def spec(self) -> str:
        """``"topk<k>"``."""
        return f"topk{self.k}"

    def __repr__(self) -> str:
        return f"TopK(k={self.k})"


#: The observations by name, as ``observation: <name>`` selects them: ``topk`` observes the label, the 5 most probable
#: other classes and the rest (:class:`TopK` with another ``k`` as an instance, or ``topk<k>``, e.g. ``topk3``).
OBSERVATIONS: dict[str, Callable[[], Observation]] = {
    "softmax": Softmax,
    "regression": Regression,
    "topk": TopK,
}
# Names of filters (loko_lightning.kalman.filters), which say how the belief is updated, not what is observed.
_FILTER_NAMES = re.compile(r"natural(_exact|_sampled)?|lofi\d+(_empirical|_sampled)?")


def get_observation(observation: str | Observation, *, owner: type | None = None) -> Observation:
    """An :class:`Observation` from its name in :data:`OBSERVATIONS` (or the instance itself).

    Raises:
        ConfigError: an unknown name (``field="observation"``).
    """
    if isinstance(observation, Observation):
        return observation
    cls = OBSERVATIONS.get(observation) if isinstance(observation, str) else None
    if cls is None and isinstance(observation, str) and observation.startswith("topk") and observation[4:].isdigit():
        cls = partial(TopK, k=int(observation[4:]))
    if cls is None and isinstance(observation, str) and _FILTER_NAMES.fullmatch(observation):
        raise ConfigError(
            f"Invalid observation: {observation!r} is a filter (how the belief is updated), not an observation: set "
            f"filter: {observation} and keep observation: softmax",
            field="observation",
            owner=owner,
        )
    if cls is None:
        raise ConfigError(
            f"Invalid observation: {observation!r} (expected one of {tuple(OBSERVATIONS)}, topk<k> such as topk3, "
            "or an Observation)",
            field="observation",
            owner=owner,
        )
    return cls()


def probability_violation(prediction: Tensor, target: Tensor) -> Tensor:
    """``True`` (0-d, on the device) where a target ``(B, m)`` is a probability vector and its prediction is not."""
    m = prediction.shape[-1]
    target_tol = 10 * m * torch.finfo(target.dtype).eps
    tol = 10 * m * torch.finfo(prediction.dtype).eps
    is_probability = (target.amin(-1) >= 0) & ((target.sum(-1) - 1).abs() <= target_tol)
    not_probability = (prediction.amin(-1) < 0) | ((prediction.sum(-1) - 1).abs() > tol)
    return (is_probability & not_probability).any()


def check_probabilities(prediction: Tensor, target: Tensor) -> None:
    """Refuse predictions (``(B, m)``) that are not probability vectors when the targets are (one host read)."""
    m = prediction.shape[-1]
    if m == 0:
        return
    target_sums, prediction_sums = target.sum(-1), prediction.sum(-1)
    target_sum = target_sums[(target_sums - 1).abs().argmax()]
    prediction_sum = prediction_sums[(prediction_sums - 1).abs().argmax()]
    stats = torch.stack([v.double() for v in (target.min(), target_sum, prediction.min(), prediction_sum)])
    stats = stats.tolist()
    target_min, target_sum, prediction_min, prediction_sum = stats
    if not all(math.isfinite(v) for v in stats):
        return  # the step is skipped on the device
    # Softmax sums to 1 up to ~m roundings; 10 m eps of each dtype is far from the sum of any logits by chance.
    target_tol = 10 * m * torch.finfo(target.dtype).eps
    tol = 10 * m * torch.finfo(prediction.dtype).eps
    target_is_probability = target_min >= 0.0 and abs(target_sum - 1.0) <= target_tol
    if target_is_probability and (prediction_min < 0.0 or abs(prediction_sum - 1.0) > tol):
        raise ValueError(
            "Invalid prediction: the target is a probability vector (e.g. one-hot) but the prediction is not "
            f"(smallest entry {prediction_min:.4g}, sum {prediction_sum:.6g}): LoKO observes class probabilities, so "
            'compute the prediction with jacobian(..., observation="softmax") (the default), not logits; for a '
            'regression on such targets, create the optimizer with LoKO(..., observation="regression")'
        )
