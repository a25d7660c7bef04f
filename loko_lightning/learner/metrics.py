"""Online-learning metrics on top of torchmetrics."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn
from torchmetrics import MeanMetric, Metric
from torchmetrics.classification import (
    BinaryF1Score,
    MulticlassAccuracy,
    MulticlassF1Score,
    MulticlassMatthewsCorrCoef,
)

from loko_lightning.errors import ConfigError


class ExactStates(Metric):
    """A metric whose states keep the dtype they were made with when the module is converted to another precision.

    torchmetrics guards its states against ``.half()`` and ``.float()`` but not against ``.to(dtype)``, which is how
    Lightning's ``bf16-true`` and ``16-true`` precisions convert a module: a float counter in bfloat16 stops at 256
    (8 bits of mantissa). These states stay float64 (sums, exact to 2^53) or integer whatever the module's precision;
    a move to another device still moves them.
    """

    def _apply(self, fn: Callable, exclude_state: Sequence[str] = "") -> Metric:
        if self._dtype_convert:  # set_dtype: a conversion asked of the metric itself
            return super()._apply(fn, exclude_state)
        dtypes = {key: getattr(self, key).dtype for key in self._defaults}
        this = super()._apply(fn, exclude_state)
        for key, dtype in dtypes.items():
            if getattr(this, key).dtype != dtype:
                setattr(this, key, getattr(this, key).to(dtype))
                this._defaults[key] = this._defaults[key].to(dtype)
        return this


class OnlineMean(ExactStates, MeanMetric):
    """Weighted mean of per-sample values, for prequential (test-then-train) accuracies; no host sync per update.

    torchmetrics' ``MeanMetric`` scans every update for NaN, which reads ``.any()`` on the host (a device sync); the
    online accuracies average finite 0/1 values and a prediction that is not scored comes with weight 0, its value
    (NaN, for a NaN input's NLL) left out rather than multiplied by 0, which is NaN. (``nan_strategy="disable"``
    would skip the scan too, but it also drops the weights.) Its state is persistent: it is saved in checkpoints, so
    a resumed run continues the average exactly.

    Example:
        >>> metric = OnlineMean()
        >>> metric.update(torch.tensor(1.0), torch.tensor(1.0)); metric.update(torch.tensor(0.0), torch.tensor(1.0))
        >>> metric.compute()
        tensor(0.5000, dtype=torch.float64)
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.set_dtype(torch.float64)  # a sum and a count of samples: exact in float64 whatever the module's dtype
        self.persistent(True)

    def update(self, value: Tensor, weight: Tensor) -> None:
        """Add ``value`` with ``weight``, both 0-d tensors (with weight 0 nothing, whatever ``value`` is)."""
        self.mean_value += torch.where(weight != 0, value * weight, 0.0).to(self.mean_value.dtype)
        self.weight += weight.to(self.weight.dtype)


class OnlineAccuracy(OnlineMean):
    """Prequential ("test-then-train") top-k accuracy: each prediction scored before the model updates on its sample.

    Feed it the prediction made *before* the update on a sample, then update the model: the running value is the
    paper's average online accuracy ``acc(k) = (1/k) Σ_i 1[y_i in top-k of the prediction made on x_i]``. A sample
    with ``weight`` 0 (a prediction that is not finite, from NaN in the input) is left out of the average. The state
    (a weighted sum and the total weight, as in :class:`~torchmetrics.MeanMetric`) is saved with the module, so a
    resumed run continues the average exactly; ``dist_reduce_fx="sum"`` sums it over processes.

    Args:
        top_k: a prediction counts as correct when the label is among its ``top_k`` largest entries (capped at the
            number of classes).

    Example:
        >>> metric = OnlineAccuracy(top_k=1)
        >>> metric.update(torch.tensor([0.1, 0.7, 0.2]), torch.tensor(1))
        >>> metric.update(torch.tensor([0.5, 0.3, 0.2]), torch.tensor(2))
        >>> metric.compute()
        tensor(0.5000, dtype=torch.float64)
    """

    def __init__(self, top_k: int = 1, **kwargs) -> None:
        super().__init__(**kwargs)
        if not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"Invalid top_k: {top_k} (must be a positive integer)")
        self.top_k = top_k

    def update(self, prediction: Tensor, label: Tensor, weight: Tensor | float = 1.0) -> None:
        """Score one prediction against its label, or a batch of them, with ``weight`` (a number, or one per sample).

        One prediction: ``(m,)`` scores or probabilities and a 0-d label; a batch: ``(B, m)`` and ``(B,)`` labels.

        Raises:
            ValueError: the shapes are neither of those.
        """
        label = torch.as_tensor(label, device=prediction.device)
        single = prediction.dim() == 1 and label.dim() == 0
        batch = prediction.dim() == 2 and label.dim() == 1 and label.shape[0] == prediction.shape[0]
        if not (single or batch):
            raise ValueError(
                f"Invalid prediction and label: expected (m,) scores with a 0-d label, or (B, m) with (B,) labels; "
                f"got {tuple(prediction.shape)} and {tuple(label.shape)}"
            )
        scores, labels = prediction.reshape(-1, prediction.shape[-1]), label.reshape(-1)
        top = scores.topk(min(self.top_k, scores.shape[-1]), dim=-1).indices
        correct = (top == labels[:, None]).any(-1) if self.top_k > 1 else scores.argmax(-1) == labels
        weight = torch.as_tensor(weight, dtype=torch.float32, device=prediction.device).expand(correct.shape)
        # The sums of one update per sample.
        self.mean_value += (correct.float() * weight).sum().to(self.mean_value.dtype)
        self.weight += weight.sum().to(self.weight.dtype)


class MovingAverage(ExactStates):
    """Mean of the last ``window`` values (the paper's moving-average loss, window 1000).

    torchmetrics' ``RunningMean`` keeps ``window`` copies of its base metric's state (2,000 state tensors for a
    window of 1,000, all summed at every ``compute``) and does not checkpoint its position in the window. This
    ring buffer costs O(1) per update, O(window) numbers in total, and round-trips through ``state_dict()``, so a
    resumed run continues the average exactly.

    Args:
        window: number of most recent values averaged.

    Example:
        >>> metric = MovingAverage(window=2)
        >>> for value in (1.0, 2.0, 4.0):
        ...     metric.update(torch.tensor(value))
        >>> metric.compute()
        tensor(3.)
    """

    full_state_update = False

    def __init__(self, window: int = 1000, **kwargs) -> None:
        super().__init__(**kwargs)
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"Invalid window: {window} (must be a positive integer)")
        self.window = window
        self.add_state("buffer", torch.zeros(window, dtype=torch.float64), dist_reduce_fx=None, persistent=True)
        self.add_state("count", torch.zeros((), dtype=torch.long), dist_reduce_fx=None, persistent=True)

    def update(self, value: Tensor, keep: Tensor | bool = True) -> None:
        """Add one scalar value, unless ``keep`` is false (a 0-d bool tensor is honoured without a host sync)."""
        keep = torch.as_tensor(keep, device=self.buffer.device)
        slot = (self.count % self.window).reshape(1)
        value = torch.where(keep, value.detach().reshape(1).to(self.buffer), self.buffer[slot])
        self.buffer.index_copy_(0, slot, value)
        self.count += keep.to(self.count.dtype)

    def compute(self) -> Tensor:
        """Mean of the last ``min(count, window)`` values (NaN before the first update)."""
        seen = self.count.clamp(max=self.window)
        return (self.buffer.sum() / seen).to(torch.float32)


class CalibrationError(ExactStates):
    r"""Expected calibration error of the top-1 predictions, streamed: over every sample so far, or the last ``window``.

    The quantity of torchmetrics' ``MulticlassCalibrationError(n_bins, norm="l1")``, with its bins: the confidence
    ``c = max_j ŷ_j`` of each prediction falls in one of ``n_bins`` equal-width bins of ``[0, 1]`` (a confidence of
    exactly 1 in a bin of its own, as there), and

    .. math::

        \mathrm{ECE} = \sum_b \frac{|B_b|}{N} \Big| \overline{\mathrm{acc}}_b - \bar c_b \Big|
        = \frac{1}{N} \sum_b \Big| \sum_{i \in B_b} (\mathbb 1[\arg\max \hat y_i = y_i] - c_i) \Big|.

    Over the whole stream it keeps three sums per bin (O(n_bins) numbers, O(1) per sample: torchmetrics' metric keeps
    every confidence and sorts them into bins at each ``compute``); over a window, the last ``window`` confidences
    and hits. Float64 sums, exact in any module precision; saved in checkpoints.

    Args:
        n_bins: the number of bins (torchmetrics' default, 15).
        window: ``None``: every sample; else the last ``window`` samples.

    Example:
        >>> metric = CalibrationError(n_bins=10)
        >>> metric.update(torch.tensor([0.9, 0.1]), torch.tensor(0))  # confident and right
        >>> metric.update(torch.tensor([0.35, 0.65]), torch.tensor(0))  # 65% sure, wrong
        >>> round(float(metric.compute()), 4)  # (|1 - 0.9| + |0 - 0.65|) / 2
        0.375
    """

    full_state_update = False

    def __init__(self, n_bins: int = 15, window: int | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        if not isinstance(n_bins, int) or n_bins < 1:
            raise ValueError(f"Invalid n_bins: {n_bins} (must be a positive integer)")
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"Invalid window: {window} (must be a positive integer or None)")
        self.n_bins, self.window = n_bins, window
        if window is None:
            for name in ("count", "confidence", "correct"):
                self.add_state(name, torch.zeros(n_bins + 1, dtype=torch.float64), "sum", persistent=True)
        else:
            self.add_state("confidences", torch.zeros(window, dtype=torch.float64), None, persistent=True)
            self.add_state("hits", torch.zeros(window, dtype=torch.float64), None, persistent=True)
            self.add_state("seen", torch.zeros((), dtype=torch.long), None, persistent=True)

    def update(self, prediction: Tensor, label: Tensor, keep: Tensor | bool = True) -> None:
        """Add one prediction ``(m,)`` (probabilities) and its 0-d label, unless ``keep`` is false (no host sync)."""
        prediction = prediction.detach()
        confidence, predicted = prediction.max(-1)
        hit = (predicted == torch.as_tensor(label, device=prediction.device)).to(torch.float64)
        keep = torch.as_tensor(keep, device=prediction.device)
        if self.window is None:
            confidence = torch.where(keep, confidence, 0.0)  # a prediction left out (NaN) must not reach the sums
            slot = self.bin_of(confidence.reshape(1))
            weight = keep.to(torch.float64).reshape(1)
            self.count.index_add_(0, slot, weight)
            self.confidence.index_add_(0, slot, weight * confidence.to(torch.float64).reshape(1))
            self.correct.index_add_(0, slot, weight * hit.reshape(1))
            return
        slot = (self.seen % self.window).reshape(1)
        for buffer, value in ((self.confidences, confidence.to(torch.float64)), (self.hits, hit)):
            buffer.index_copy_(0, slot, torch.where(keep, value.reshape(1), buffer[slot]))
        self.seen += keep.to(self.seen.dtype)

    def bin_of(self, confidence: Tensor) -> Tensor:
        """The bin of each confidence: torchmetrics' ``bucketize(c, linspace(0, 1, n_bins + 1), right=True) - 1``."""
        confidence = confidence.float()
        boundaries = torch.linspace(0, 1, self.n_bins + 1, dtype=confidence.dtype, device=confidence.device)
        return torch.bucketize(confidence, boundaries, right=True) - 1

    def bins(self) -> tuple[Tensor, Tensor, Tensor]:
        """Per bin: the number of predictions, their summed confidence and their summed hits (float64)."""
        if self.window is None:
            return self.count, self.confidence, self.correct
        # The filled slots by a mask, not a slice: no host read of the count (the learner computes this every step).
        filled = (torch.arange(self.window, device=self.seen.device) < self.seen).to(torch.float64)
        slots = self.bin_of(self.confidences)
        zeros = torch.zeros(self.n_bins + 1, dtype=torch.float64, device=self.confidences.device)
        return (
            zeros.index_add(0, slots, filled),
            zeros.index_add(0, slots, filled * self.confidences),
            zeros.index_add(0, slots, filled * self.hits),
        )

    def compute(self) -> Tensor:
        """The expected calibration error (NaN before the first prediction), float32."""
        count, confidence, correct = self.bins()
        return ((correct - confidence).abs().sum() / count.sum()).to(torch.float32)


#: The held-out metrics besides top-1 accuracy: Matthews correlation (CoLA's) and F1 (MRPC's).
HeldOutMetric = Literal["mcc", "f1"]


def make_held_out_metrics(names: list[str], num_classes: int, owner: Any) -> tuple[nn.ModuleDict, nn.ModuleDict]:
    """Validation and test metrics, logged as ``val/<name>``, ``test/<name>``: top-1 accuracy (``acc``) and GLUE's.

    ``"mcc"``: Matthews correlation (CoLA's metric); ``"f1"``: F1 of class 1 for two classes (MRPC's), macro F1
    otherwise.
    """
    pair = []
    for _ in range(2):
        metrics = nn.ModuleDict({"acc": MulticlassAccuracy(num_classes, average="micro")})
        for name in names:
            if name == "mcc":
                metrics[name] = MulticlassMatthewsCorrCoef(num_classes)
            elif name == "f1":
                metrics[name] = BinaryF1Score() if num_classes == 2 else MulticlassF1Score(num_classes, average="macro")
            else:
                known = ", ".join(get_args(HeldOutMetric))
                message = f"unknown held-out metric {name!r}; known: {known}"
                raise ConfigError(message, field="held_out_metrics", owner=owner)
        pair.append(metrics)
    return pair[0], pair[1]


#: The prequential metrics' attribute names on a learner, in the order they are made.
ONLINE_METRICS = (
    "online_acc",
    "online_acc_top5",
    "online_acc_recent",
    "loss_avg",
    "ce_avg",
    "nll",
    "nll_recent",
    "ece",
    "ece_recent",
)


def make_online_metrics(window: int, recent_window: int) -> dict[str, Metric]:
    """A learner's prequential metrics by attribute name (:func:`update_online` scores them, :func:`online_values`).

    Accuracy (top-1, top-5, over the last ``recent_window``), the paper's moving averages of the loss and the cross
    entropy over ``window``, and the calibration of the same predictions: the negative log-likelihood and the expected
    calibration error, over the stream and the recent window. Every process scores every process's predictions of a
    step (they are gathered for the joint update), so they are already over all processes: no reduction at compute.
    """
    return {
        "online_acc": OnlineAccuracy(top_k=1, sync_on_compute=False),
        "online_acc_top5": OnlineAccuracy(top_k=5, sync_on_compute=False),
        "online_acc_recent": MovingAverage(recent_window, sync_on_compute=False),
        "loss_avg": MovingAverage(window, sync_on_compute=False),
        "ce_avg": MovingAverage(window, sync_on_compute=False),
        "nll": OnlineMean(sync_on_compute=False),
        "nll_recent": MovingAverage(recent_window, sync_on_compute=False),
        "ece": CalibrationError(sync_on_compute=False),
        "ece_recent": CalibrationError(window=recent_window, sync_on_compute=False),
    }


def is_scored(prediction: Tensor) -> Tensor:
    """Whether each prediction of ``(N, m)`` is scored (``(N,)`` bools, no host sync): it is finite.

    It was made before its update, so whether that update was then applied does not matter; one that is not finite
    (NaN in the input) cannot be scored.
    """
    return torch.isfinite(prediction).all(-1)


def update_online(metrics: Mapping[str, Metric], prediction: Tensor, label: Tensor) -> None:
    """Score a step's predictions ``(N, m)`` against their labels ``(N,)``, one sample after the other.

    Every finite prediction is scored (:func:`is_scored`), whether or not the update after it was applied (a skipped
    update is counted by the learner, ``train/skipped``). A prediction that is not finite counts in the stream's
    accuracy and NLL with weight 0, and not in the windows.
    """
    prediction = prediction.float()
    for scores, target, scored in zip(prediction, label, is_scored(prediction), strict=True):
        weight = scored.to(scores.dtype)
        metrics["online_acc"].update(scores, target, weight)
        metrics["online_acc_top5"].update(scores, target, weight)
        metrics["online_acc_recent"].update((scores.argmax() == target).to(scores.dtype), scored)
        one_hot = torch.nn.functional.one_hot(target, scores.shape[0]).to(scores.dtype)
        metrics["loss_avg"].update((one_hot - scores).abs().sum(), scored)
        nll = -scores[target].clamp_min(torch.finfo(scores.dtype).tiny).log()
        metrics["ce_avg"].update(nll, scored)
        metrics["nll"].update(nll, weight)
        metrics["nll_recent"].update(nll, scored)
        metrics["ece"].update(scores, target, scored)
        metrics["ece_recent"].update(scores, target, scored)


def online_values(metrics: Mapping[str, Metric], window: int, recent_window: int) -> dict[str, Tensor]:
    """The prequential metrics as logged: ``train/online_acc``, ``train/nll_recent{recent_window}``, ..."""
    keys = {
        "online_acc": "train/online_acc",
        "online_acc_top5": "train/online_acc_top5",
        "online_acc_recent": f"train/online_acc_recent{recent_window}",
        "loss_avg": f"train/loss_avg{window}",
        "ce_avg": f"train/ce_avg{window}",
        "nll": "train/nll",
        "nll_recent": f"train/nll_recent{recent_window}",
        "ece": "train/ece",
        "ece_recent": f"train/ece_recent{recent_window}",
    }
    return {key: metrics[name].compute() for name, key in keys.items()}
