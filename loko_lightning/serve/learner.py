"""``ServingLearner``: a trained learner that predicts and keeps learning from labelled samples, without HTTP.

It wraps a ``loko fit`` checkpoint's :class:`~loko_lightning.learner.module.OnlineClassifier` and its
:class:`~loko_lightning.LoKO` filter state. :meth:`ServingLearner.learn` makes the learner's own Kalman step
(:class:`~loko_lightning.learner.steps.KalmanStep`, the one ``loko fit`` makes) on each sample; predictions are made
by two more copies of the adapters and head, used in turn: after each step the new parameters are written whole into
the copy no prediction reads, which then becomes the one new predictions read. A prediction never sees a half-applied
update, and a step does not wait for a prediction in progress (only, rarely, for one that started two versions ago).
The frozen backbone's weights are shared by all copies.

With ``LoKO(average=δ)`` (the averaging presets) the filter learns on from its own mean ``θ`` (a fit checkpoint's
``"loko_train_point"``) and the predictions are the average ``θ̄``'s, as in ``loko fit``: the serving copy receives
``θ̄``, and a serving checkpoint holds ``θ̄`` as its weights with ``θ`` beside them.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import copy
import dataclasses
import functools
import math
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning
import torch
from torch import Tensor

from loko_lightning.data.transforms import build_transform
from loko_lightning.errors import ConfigError
from loko_lightning.kalman.optimizer import LoKO
from loko_lightning.learner.checkpoint_io import AtomicCheckpointIO, load_learner
from loko_lightning.learner.metrics import is_scored
from loko_lightning.learner.module import OnlineClassifier
from loko_lightning.learner.steps import save_served_weights
from loko_lightning.preprocessing import ImagePreprocessing, TextPreprocessing
from loko_lightning.serve.images import decode_image
from loko_lightning.serve.limits import MAX_PIXELS

# The LoKO arguments a checkpoint's param group holds (the others, dtype and seed, are read from the state).
# A checkpoint's own keys that describe a training run's loops, not the learner: left out of a serving checkpoint.
RUN_KEYS = ("loops", "callbacks", "lr_schedulers")
# The keys a serving checkpoint writes afresh (not kept from the checkpoint it was read from).
FRESH_KEYS = ("state_dict", "optimizer_states", "serve", "loko_train_point")
# LoKO's states held once for the whole optimizer (on its first parameter), not one per parameter.
SHARED_STATE = ("R", "step", "skipped")


@dataclasses.dataclass
class LearnResult:
    """What one step of :meth:`ServingLearner.learn` did.

    Args:
        prediction: the class probabilities ``(m,)`` made before the update (prequential).
        applied: whether the update was applied (``False``: its prediction or update was not finite, so it changed
            nothing and was counted in ``skipped``).
        seconds: the step's wall time.
    """

    prediction: Tensor
    applied: bool
    seconds: float


class ServingLearner:
    """A learner that predicts and learns one labelled sample at a time: LoKO steps from a trained checkpoint.

    Build it with :meth:`from_checkpoint` (a ``loko fit`` checkpoint, or one :meth:`save` wrote), or around an
    :class:`~loko_lightning.learner.module.OnlineClassifier` and its :class:`~loko_lightning.LoKO` (e.g. from a config).
    Inputs are raw samples (PIL images, texts, text pairs) or already preprocessed tensors; :meth:`decode` reads a
    JSON value (a base64 PNG/JPEG, a text) into one. :meth:`predict` may be called from any thread at any time;
    :meth:`learn` from one thread at a time.

    Args:
        module: the learner (its network, its online metrics); switched to training mode, as ``loko fit`` runs it.
        optimizer: LoKO over ``module.trainable_parameters`` (its state: the filter's ``p̂`` and ``R``).
        checkpoint: the checkpoint it was read from (its other entries are written again by :meth:`save`).

    Example:
        >>> learner = ServingLearner.from_checkpoint("last.ckpt")  # doctest: +SKIP
        >>> learner.predict([image]).shape  # doctest: +SKIP
        torch.Size([1, 10])
        >>> learner.learn([image], ["7"])[0].applied  # doctest: +SKIP
        True
    """

    def __init__(self, module: OnlineClassifier, optimizer: LoKO, checkpoint: dict[str, Any] | None = None) -> None:
        if not isinstance(optimizer, LoKO) or not module.is_kalman:
            raise ConfigError(
                f"a serving learner learns with LoKO, got {type(optimizer).__name__}: serve a checkpoint of a LoKO run "
                "(the gradient baselines are not served)",
                field="optimizer",
            )
        self.module = module.train()
        self.optimizer = optimizer
        self.classes = module.label_names()
        self.modality = module.network_factory.modality
        self.transform = _transform(module)
        saved = dict((checkpoint or {}).get("serve") or {})
        self._base = {k: v for k, v in (checkpoint or {}).items() if k not in (*RUN_KEYS, *FRESH_KEYS)}
        # Every step's counters, saved and restored with the parameters: a restart continues them exactly.
        self.learned = int(saved.get("learned", 0))
        self.served_total = int(saved.get("served_total", 0))
        self.served_correct = int(saved.get("served_correct", 0))
        counters = ("learned", "served_total", "served_correct")
        self.extra: dict[str, Any] = {k: v for k, v in saved.items() if k not in counters}
        # Two serving copies: predictions read the current one, the next version is written into the other.
        self._lock = threading.Condition()
        # A mixture disables the serving copy's adapters for its frozen features: its predictions run one at a time.
        self._frozen_forward: contextlib.AbstractContextManager[Any] = (
            threading.Lock() if module.mixture is not None else contextlib.nullcontext()
        )
        self._copies = [_serving_copy(module), _serving_copy(module)]
        self._readers = [0, 0]
        self._current = 0
        self._version = self.learned
        self._publish()  # with an average the serving copy predicts with θ̄, not the filter's mean

    # ------------------------------------------------------------------ building
    @classmethod
    def from_checkpoint(
        cls, path: str | Path, optimizer: Callable[[list[torch.nn.Parameter]], LoKO] | None = None
    ) -> ServingLearner:
        """The learner of a checkpoint, with the LoKO filter state it saved.

        Args:
            path: a ``loko fit`` checkpoint (any of its LoKO runs), or one :meth:`save` wrote.
            optimizer: builds LoKO over the trainable parameters; ``None``: the checkpoint's own LoKO hyperparameters
                (its param group; its ``p̂`` and ``R`` dtype), or the paper's defaults when it saved no optimizer.

        Raises:
            ConfigError: (field ``ckpt_path``) not a readable loko checkpoint; (``optimizer``) the checkpoint's
                optimizer is not LoKO.
        """
        module = load_learner(str(path))  # checks that the file is a readable loko checkpoint first
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        states = checkpoint.get("optimizer_states") or []
        state = states[0] if states else None
        per_parameter = list((state or {}).get("state", {}).values())
        if per_parameter and not all("cov" in values for values in per_parameter):
            raise ConfigError(
                f"{path} holds a gradient optimizer's state ({', '.join(sorted(per_parameter[0]))}); a serving learner "
                "learns with LoKO: serve a checkpoint of a LoKO run",
                field="optimizer",
            )
        train_point = checkpoint.get("loko_train_point")
        if optimizer is None:
            optimizer = _saved_loko(state, checkpoint.get("optimizer_config"), averaged=train_point is not None)
        if train_point is not None:  # its weights are the average θ̄: the filter learns on from its mean θ
            _load_train_point(module, train_point, path)
        built = module.build_optimizer(optimizer)
        if state is not None and per_parameter:
            built.load_state_dict(state)
        return cls(module, built, checkpoint)

    # ------------------------------------------------------------------ inputs
    def decode(self, value: Any, field: str = "input", max_pixels: int | None = MAX_PIXELS) -> Any:
        """The raw sample a JSON value holds: an image as base64 PNG/JPEG (a ``data:`` URL too), a text, a text pair.

        Args:
            value: the JSON value.
            field: the request field it came in, for the messages.
            max_pixels: an image's width x height, at most, checked before it is decoded (``None``: PIL's limit).

        Raises:
            ConfigError: (field ``field``) not a sample of this model's kind, or an image that does not decode;
                :class:`~loko_lightning.serve.images.ImageTooLarge` an image over ``max_pixels``.
        """
        if self.modality == "image":
            if not isinstance(value, str) or not value.strip():
                raise ConfigError(f"{field} must be an image as a base64 PNG or JPEG string", field=field)
            text = value.split(",", 1)[1] if value.startswith("data:") else value
            try:
                data = base64.b64decode(text, validate=True)
            except (binascii.Error, ValueError):
                raise ConfigError(
                    f"{field} is not base64 (an image as a base64 PNG or JPEG string)", field=field
                ) from None
            return decode_image(data, field=field, max_pixels=max_pixels)
        if isinstance(value, str) and value.strip():
            return value
        if isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) and v.strip() for v in value):
            return (value[0], value[1])
        raise ConfigError(f"{field} must be a non-empty text (or a pair of texts)", field=field)

    def label_index(self, label: Any, field: str = "label") -> int:
        """The class id of ``label``: a class name, or an integer id ``0 <= label < m``.

        Raises:
            ConfigError: (field ``field``) not one of the classes.
        """
        if isinstance(label, str) and label in self.classes:
            return self.classes.index(label)
        if isinstance(label, int) and not isinstance(label, bool) and 0 <= label < len(self.classes):
            return label
        shown = ", ".join(self.classes[:20]) + (", ..." if len(self.classes) > 20 else "")
        raise ConfigError(f"{field} {label!r} is not among the classes ({shown})", field=field)

    def batch(self, inputs: Sequence[Any]) -> Any:
        """The network's input batch of raw samples (or preprocessed tensors)."""
        items = [x if isinstance(x, (Tensor, dict)) else self.transform(x) for x in inputs]
        collate = getattr(self.transform, "collate", None)
        if collate is not None:
            return collate([{"inputs": item} for item in items])["inputs"]
        return torch.stack(items)

    # ------------------------------------------------------------------ predict and learn
    @property
    def version(self) -> int:
        """The parameter version predictions read: the number of samples learned (applied or skipped)."""
        return self._version

    def predict(self, inputs: Sequence[Any]) -> Tensor:
        """Class probabilities ``(B, m)`` (float32) of raw samples, from one complete parameter version."""
        return self.predict_with_version(inputs)[0]

    @torch.no_grad()
    def predict_with_version(self, inputs: Sequence[Any]) -> tuple[Tensor, int]:
        """Class probabilities ``(B, m)`` and the :attr:`version` of the parameters that made them."""
        batch = self.batch(inputs)
        with self._lock:
            index, version = self._current, self._version
            self._readers[index] += 1
        try:
            with self._frozen_forward:
                probabilities = self._copies[index].predict_step({"inputs": batch}, 0)["probabilities"]
        finally:
            with self._lock:
                self._readers[index] -= 1
                self._lock.notify_all()
        return probabilities, version

    def learn(self, inputs: Sequence[Any], labels: Sequence[Any], joint: bool = False) -> list[LearnResult]:
        """Learn labelled samples: one LoKO step per sample, in order, or one joint step over all (``joint``).

        Each step scores its prediction before updating (the prequential online accuracy) and publishes the new
        parameters to :meth:`predict` whole. A step whose prediction or update is not finite changes nothing and is
        counted in ``module.skipped``.

        Args:
            inputs: raw samples or preprocessed tensors.
            labels: class names or ids, one per sample.
            joint: one joint update over the samples (:mod:`loko_lightning.kalman.multistream`) instead of one each.
        """
        targets = torch.tensor([self.label_index(label) for label in labels], dtype=torch.int64)
        if len(targets) != len(inputs):
            raise ConfigError(f"{len(inputs)} inputs but {len(targets)} labels", field="labels")
        groups = [(list(inputs), targets)] if joint else [([x], targets[i : i + 1]) for i, x in enumerate(inputs)]
        results = []
        for samples, label in groups:
            start = time.perf_counter()
            prediction, _, applied = self.module.online_step.step(
                self.module, self.optimizer, self.batch(samples), label
            )
            self._score(prediction, label, applied)
            self.learned += len(samples)
            self._publish()
            seconds = time.perf_counter() - start
            ok = bool(applied)
            results += [LearnResult(p.detach().float(), ok, seconds) for p in prediction]
        return results

    def skip(self, count: int = 1) -> None:
        """Count samples that could not be learned at all (their input no longer decodes) as learned and skipped."""
        self.module.skipped += count
        self.learned += count
        self._publish()

    def record_served(self, predicted: int, label: int) -> None:
        """Score a served prediction (class ``predicted``) that received its ``label`` (the served accuracy)."""
        self.served_total += 1
        self.served_correct += int(predicted == label)

    def _score(self, prediction: Tensor, label: Tensor, applied: Tensor) -> None:
        """The learner's own online metrics, as ``loko fit`` keeps them; skipped updates counted.

        A finite prediction is scored whether or not its update was applied
        (:func:`~loko_lightning.learner.metrics.is_scored`).
        """
        module = self.module
        module.skipped += (~applied).to(module.skipped.dtype) * label.shape[0]
        prediction = prediction.float()
        for scores, target, scored in zip(prediction, label, is_scored(prediction), strict=True):
            weight = scored.to(scores.dtype)
            module.online_acc.update(scores, target, weight)
            module.online_acc_top5.update(scores, target, weight)

    def _publish(self) -> None:
        """Copy the parameters that predict into the serving copy, whole, while no prediction reads it.

        They are the filter's mean, or with ``LoKO(average=...)`` its average ``θ̄``.
        """
        state = self.optimizer.state
        average = bool(self.optimizer.average)
        with self._lock:
            spare = 1 - self._current
            # Only a prediction that started before the last swap can still read the spare copy: wait for it.
            self._lock.wait_for(lambda: self._readers[spare] == 0)
        # No prediction takes the spare copy until it is swapped in below: it is written without the lock.
        with torch.no_grad():
            for served, learned in zip(_trainable(self._copies[spare]), self.module.trainable_parameters, strict=True):
                served.copy_(state[learned]["average"] if average and "average" in state[learned] else learned)
        self._copies[spare].online_step.follow(self.module.online_step)  # a mixture's weights and frozen head
        with self._lock:
            self._current, self._version = spare, self.learned

    @property
    def _serving(self) -> OnlineClassifier:
        """The copy new predictions read."""
        return self._copies[self._current]

    @property
    def _serving_params(self) -> list[torch.nn.Parameter]:
        return _trainable(self._serving)

    # ------------------------------------------------------------------ metrics and checkpoints
    @property
    def online_accuracy(self) -> float:
        """The prequential accuracy of the learner: each learned sample's prediction made just before its update."""
        metric = self.module.online_acc  # its sums, read directly (compute() warns on a state only loaded)
        weight = float(metric.weight)
        return float(metric.mean_value) / weight if weight else math.nan

    @property
    def served_accuracy(self) -> float:
        """The accuracy of the served predictions that received feedback."""
        return self.served_correct / self.served_total if self.served_total else math.nan

    @property
    def skipped(self) -> int:
        """Samples whose update was not applied (not finite, or an input that no longer decodes)."""
        return int(self.module.skipped)

    def state(self) -> dict[str, Tensor]:
        """The filter state as copies, for comparisons.

        The trainable parameters (``param/<i>``), their own states (``p̂`` as ``cov/<i>``, the average as
        ``average/<i>``, ...) and the states held once (``R``, ``step``, ``skipped``).
        """
        out = {f"param/{i}": p.detach().clone() for i, p in enumerate(self.module.trainable_parameters)}
        for i, p in enumerate(self.module.trainable_parameters):
            for key, value in self.optimizer.state[p].items():
                if isinstance(value, Tensor):
                    out[key if key in SHARED_STATE else f"{key}/{i}"] = value.detach().clone()
        return out

    def checkpoint(self, **extra: Any) -> dict[str, Any]:
        """A checkpoint ``loko predict``, ``loko export`` and :meth:`from_checkpoint` read: weights, filter, counters.

        Args:
            **extra: plain values kept beside the counters (``loko serve`` keeps its feedback log position there).
        """
        checkpoint = dict(self._base)
        # What Lightning's load_from_checkpoint reads, for a learner that was not loaded from a checkpoint.
        checkpoint.setdefault("pytorch-lightning_version", lightning.__version__)
        checkpoint.setdefault(self.module.CHECKPOINT_HYPER_PARAMS_KEY, dict(self.module.hparams))
        checkpoint["state_dict"] = self.module.state_dict()
        checkpoint["optimizer_states"] = [self.optimizer.state_dict()]
        self.module.on_save_checkpoint(checkpoint)
        serving = self.module.online_step.serving(self.optimizer)  # with an average: θ̄ (the step's own rule)
        if serving is not None:  # as a fit saves it: the weights θ̄ that predict, the filter's mean θ beside them
            save_served_weights(self.module, checkpoint, serving)
        checkpoint["serve"] = {
            **self.extra,
            **extra,
            "learned": self.learned,
            "served_total": self.served_total,
            "served_correct": self.served_correct,
        }
        return checkpoint

    def save(self, path: str | Path, **extra: Any) -> None:
        """Write :meth:`checkpoint` to ``path`` atomically (a temporary file, flushed, renamed over it)."""
        AtomicCheckpointIO().save_checkpoint(self.checkpoint(**extra), path)


def _saved_loko(
    state: dict[str, Any] | None, config: Any = None, averaged: bool = False
) -> Callable[[list[torch.nn.Parameter]], LoKO]:
    """LoKO with the hyperparameters of a saved LoKO state (the paper's defaults when there is none).

    The decay of the average (``average``) is the state's (saved beside ``p̂``), else that of the checkpoint's
    ``"optimizer_config"`` (``config``); ``averaged``: the checkpoint's weights are an average, so a decay is required.
    """
    init_args = (config.get("init_args") if isinstance(config, dict) else None) or {}
    average = (state or {}).get("average", init_args.get("average", 0.0))
    if averaged and not (isinstance(average, (int, float)) and 0 < average < 1):
        raise ConfigError(
            "the checkpoint's weights are the average of LoKO's mean (it holds the training point beside them) but "
            f"not the average's decay (its LoKO saved average={average!r}): pass the optimizer, e.g. "
            "ServingLearner.from_checkpoint(path, optimizer=functools.partial(LoKO, p0=..., average=0.99))",
            field="optimizer",
        )
    if state is None or not state.get("param_groups"):
        return functools.partial(LoKO, average=average) if average else LoKO
    kwargs = LoKO.arguments(state)  # the filter with its settings, the prior, the time update and the dtype
    if average:
        kwargs["average"] = average
    if not isinstance(kwargs.get("p0"), (int, float)):
        raise ConfigError(
            f"the checkpoint's LoKO has p0={kwargs.get('p0')!r}, not a number; pass the optimizer to use",
            field="optimizer",
        )

    def build(params: list[torch.nn.Parameter]) -> LoKO:
        return LoKO(params, **kwargs)

    return build


def _load_train_point(module: OnlineClassifier, train_point: dict[str, Tensor], path: str | Path) -> None:
    """Put the filter's mean ``θ`` a checkpoint keeps beside its averaged weights into the trainable parameters."""
    named = {name: p for name, p in module.named_parameters() if p.requires_grad}
    if set(train_point) != set(named):
        missing = sorted(set(named) - set(train_point))[:3]
        raise ConfigError(
            f"{path}: its loko_train_point does not name this network's trainable parameters (missing e.g. {missing}): "
            "not a checkpoint a loko fit wrote",
            field="ckpt_path",
        )
    with torch.no_grad():
        for name, param in named.items():
            param.copy_(train_point[name])


def _transform(module: OnlineClassifier) -> Callable[[Any], Any]:
    """The preprocessing the training data went through (saved in the checkpoint), else the network's own."""
    factory = module.network_factory
    saved = dict(module.preprocessing or {})
    if factory.modality == "image":
        if saved:
            fields = {f.name for f in dataclasses.fields(ImagePreprocessing)}
            values = {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k in fields}
            return build_transform("image", ImagePreprocessing(**values))
        return build_transform("image", factory.preprocessing())
    tokenizer = saved.get("tokenizer") or factory.preprocessing().tokenizer
    return build_transform("text", TextPreprocessing(tokenizer), max_length=int(saved.get("max_length", 128)))


def _trainable(module: OnlineClassifier) -> list[torch.nn.Parameter]:
    return [p for p in module.network.parameters() if p.requires_grad]


def _serving_copy(module: OnlineClassifier) -> OnlineClassifier:
    """A copy of the learner for predictions, in eval mode, sharing the frozen weights (only the adapters differ)."""
    serving = copy.deepcopy(module).eval()
    for (_, served), (_, learned) in zip(
        serving.network.named_parameters(), module.network.named_parameters(), strict=True
    ):
        if not learned.requires_grad:
            served.data = learned.data
    return serving
