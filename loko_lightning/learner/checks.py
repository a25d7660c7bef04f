"""The learner's checks of its configuration: optimizer, scheduler, selection and trainer, before anything is built."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.cli import OptimizerCallable
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from loko_lightning.errors import ConfigError
from loko_lightning.kalman.arguments import upgrade_arguments
from loko_lightning.kalman.optimizer import LoKO
from loko_lightning.kalman.predictive import PREDICTIVES
from loko_lightning.learner.selection import Candidates
from loko_lightning.models.adapters import count_parameters


def refuse_learning_rate_tools(owner: Any, lr_scheduler: Any = None, callbacks: Sequence[pl.Callback] = ()) -> None:
    """LoKO has no learning rate: a scheduler or a ``LearningRateMonitor`` with it is a configuration error."""
    role = "each parameter's step size is its covariance p-hat, which starts at p0 and shrinks as the filter learns"
    if lr_scheduler is not None:
        raise ConfigError(
            f"LoKO has no learning rate to schedule: {role}; remove lr_scheduler, or use a gradient optimizer "
            "(configs/baselines/) for a schedule",
            field="lr_scheduler",
            owner=owner,
        )
    for callback in callbacks:
        if isinstance(callback, LearningRateMonitor):
            raise ConfigError(
                f"LearningRateMonitor has nothing to log with LoKO, which has no learning rate: {role} (logged every "
                "step as loko/p_mean); remove LearningRateMonitor from the callbacks",
                field=None,
                owner=callback,
            )


def resolve_selection(
    optimizer: OptimizerCallable, select: Candidates | None, owner: Any
) -> tuple[Any, Candidates | None]:
    """``p0: auto`` becomes ``select``; with a selection the optimizer is built with the first candidate's value."""
    keywords = getattr(optimizer, "keywords", None) or {}
    if keywords.get("p0") == "auto":
        select = select or Candidates()
        if select.name != "p0":
            raise ConfigError(
                f"p0: auto chooses p0 among candidates, and select chooses {select.name}: one selection at a time; "
                "give p0 a number, or select p0",
                field="select.name",
                owner=owner,
            )
    if select is None:
        return optimizer, None
    for value in select.values:
        try:
            probe(functools.partial(optimizer, **{select.name: value}))
        except TypeError as err:
            raise ConfigError(
                f"select.name={select.name!r} is not an argument of the optimizer ({err}); choose one it takes, "
                "e.g. 'p0' for LoKO or 'lr' for AdamW",
                field="select.name",
                owner=owner,
            ) from None
    return functools.partial(optimizer, **{select.name: select.values[0]}), select


def check_selection_trainer(trainer: pl.Trainer, owner: Any) -> None:
    """The candidates run one after another in one process, each stepped by the torch optimizer itself."""
    if trainer.world_size > 1:
        raise ConfigError(
            "select (or p0: auto) runs its candidates in one process; it does not support several processes (DDP) "
            "yet: choose the value in a single-process run, then set it",
            field="select",
            owner=owner,
        )
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is not None:
        raise ConfigError(
            f"select (or p0: auto) steps its candidates with the torch optimizer, which skips the gradient scaler of "
            f"precision {trainer.precision!r}; use precision bf16-mixed or 32",
            field="select",
            owner=owner,
        )


def check_schedule_length(scheduler: Any, stream: float) -> None:
    """Warn when a scheduler with a fixed length (``LinearLR``'s ``total_iters``) does not end with the stream."""
    total = getattr(scheduler, "total_iters", None)
    if total is not None and stream != float("inf") and total != stream:
        rank_zero_warn(
            f"lr_scheduler: {type(scheduler).__name__} runs over total_iters={total} steps but this stream has "
            f"{int(stream)} samples; set total_iters to {int(stream)} for a schedule that ends with the stream"
        )


def probe(optimizer: OptimizerCallable) -> torch.optim.Optimizer:
    """The optimizer built over a stand-in parameter: checks its hyperparameters without building the network.

    Raises:
        ConfigError: the optimizer refused a hyperparameter (its own message, with the argument when it names one).
    """
    try:
        # LoKO draws p̂0 for the stand-in from the global RNG: the probe must leave it as it was, so that the network
        # and the real optimizer get the random numbers of a seeded run.
        with torch.random.fork_rng(devices=[]):
            return optimizer([nn.Parameter(torch.zeros(1))])
    except ConfigError as err:
        err.owner = err.owner or optimizer_class(optimizer)
        raise
    except ValueError as err:  # torch's optimizers: "Invalid learning rate: -1"
        raise ConfigError(str(err), field=None, owner=optimizer_class(optimizer)) from None


def optimizer_class(optimizer: OptimizerCallable) -> type | None:
    """The class an optimizer callable builds (a class, or a ``functools.partial`` of one, as the CLI makes)."""
    target = optimizer
    while hasattr(target, "func"):  # functools.partial, possibly nested
        target = target.args[-1] if target.args and isinstance(target.args[-1], type) else target.func
        if isinstance(target, type):
            break
    return target if isinstance(target, type) else None


def optimizer_config(optimizer: OptimizerCallable) -> dict[str, Any] | None:
    """An optimizer callable as plain values, ``{"class_path", "init_args"}``; ``None`` when it is not that simple.

    A class, or ``functools.partial`` of one (nested partials merged, the outer keywords last) with keyword
    arguments that are numbers, strings, booleans, ``None``, lists of them or mappings of names to them (a filter's
    config): what a checkpoint can keep and :func:`optimizer_from_config` rebuild.
    """
    keywords: dict[str, Any] = {}
    target = optimizer
    while isinstance(target, functools.partial):
        if target.args:
            return None
        keywords = {**target.keywords, **keywords}
        target = target.func
    if not isinstance(target, type) or not all(_plain(value) for value in keywords.values()):
        return None
    return {"class_path": f"{target.__module__}.{target.__qualname__}", "init_args": dict(keywords)}


def optimizer_from_config(config: Any) -> OptimizerCallable | None:
    """The optimizer callable an :func:`optimizer_config` describes, if its class is an already imported optimizer.

    Nothing is imported because a file names it (a checkpoint is data, never code to run).
    """
    import sys

    class_path = config.get("class_path") if isinstance(config, dict) else None
    if not isinstance(class_path, str):
        return None
    module_name, _, name = class_path.rpartition(".")
    cls = getattr(sys.modules.get(module_name), name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        return None
    init_args = dict(config.get("init_args") or {})
    if issubclass(cls, LoKO):  # a checkpoint of before each setting had one owner: today's arguments
        init_args = upgrade_arguments(init_args)
    return functools.partial(cls, **init_args)


def _plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(item) for item in value)
    if isinstance(value, dict):  # a filter's config, a time update
        return all(isinstance(key, str) and _plain(item) for key, item in value.items())
    return value is None or isinstance(value, (bool, int, float, str))


def check_head_size(checkpoint: dict[str, Any], num_classes: int, owner: Any = None) -> None:
    """A resumed run keeps the checkpoint's head: another class count is refused, with the way to a new head."""
    spec = (checkpoint.get("hyper_parameters") or {}).get("network") or {}
    saved = (spec.get("init_args") or {}).get("num_classes")
    if saved is None or saved == num_classes:
        return
    raise ConfigError(
        f"resuming a checkpoint with a {saved}-class head into a {num_classes}-class one: a resumed run (ckpt_path) "
        f"continues the same head and classes. To fix it: resume with num_classes {saved}, or train a new "
        f"{num_classes}-class head on the checkpoint's adapters with model.adapters_from=CKPT and no ckpt_path",
        field="network.num_classes",
        owner=owner,
    )


def check_optimizer_kind(checkpoint: dict[str, Any], kalman: bool, owner: Any = None) -> None:
    """A checkpoint's optimizer state must be the kind this learner resumes with (LoKO's ``cov`` or not)."""
    states = checkpoint.get("optimizer_states") or []
    # Per-parameter states are dicts (IVON also keeps a few counters beside them).
    per_parameter = [
        state for saved in states for state in (saved.get("state") or {}).values() if isinstance(state, dict)
    ]
    if not per_parameter:
        return  # nothing saved (weights only), or not training yet: any optimizer starts fresh
    saved_kalman = any("cov" in state for state in per_parameter)
    if saved_kalman == kalman:
        return
    saved, current = ("LoKO", "a gradient optimizer") if saved_kalman else ("a gradient optimizer", "LoKO")
    keys = sorted({key for state in per_parameter for key in state})
    raise ConfigError(
        f"the checkpoint's optimizer state is {saved}'s ({', '.join(keys)}), but this run resumes with {current}: "
        "the state cannot carry over. To fix it: resume with the checkpoint's optimizer, or start from its weights "
        "without its optimizer state (OnlineClassifier.load_from_checkpoint(path, optimizer=...), then fit without "
        "ckpt_path)",
        field="optimizer",
        owner=owner,
    )


def check_predictive(value: Any, probed: torch.optim.Optimizer, selecting: bool, owner: Any) -> str:
    """``predictive`` checked: a known value, and ``"posterior"`` only where the filter forms ``H P Hᵀ``.

    ``probed`` is the optimizer built on a stand-in parameter. The posterior predictive needs LoKO's covariance
    filter on the softmax observation, predicting with its mean (``average`` 0), one optimizer (not ``selecting``).
    """
    if value not in PREDICTIVES:
        raise ConfigError(
            f"predictive must be one of {', '.join(PREDICTIVES)}, got {value!r}", field="predictive", owner=owner
        )
    if value == "mean":
        return value
    problem = None
    if not isinstance(probed, LoKO):
        problem = "a gradient optimizer keeps no posterior; use LoKO"
    elif probed.filter.name != "covariance" or probed.observation.name != "softmax":
        problem = (
            f"it averages over the covariance filter's H P Hᵀ of class probabilities, which filter "
            f"{probed.filter.spec!r} with observation {probed.observation.spec!r} does not form; use filter: "
            "covariance and observation: softmax"
        )
    elif probed.average:
        problem = "the averaged mean predicts (average > 0), not the mean whose covariance the filter keeps"
    elif selecting:
        problem = "a selection (p0: auto, select) scores its candidates at their means; choose p0 first"
    if problem is not None:
        raise ConfigError(f"predictive: posterior is refused: {problem}", field="predictive", owner=owner)
    return value


def describe(factory: Any, network: nn.Module, optimizer: OptimizerCallable) -> str:
    """``backbone: N trainable parameters of M (x%), optimizer Name`` of a network factory's network."""
    trainable, total = count_parameters(network)
    cls = optimizer_class(optimizer)
    name = cls.__name__ if cls is not None else repr(optimizer)
    return (
        f"{getattr(factory, 'backbone', type(network).__name__)}: {trainable:,} trainable parameters of {total:,} "
        f"({100 * trainable / total:.3f}%), optimizer {name}"
    )
