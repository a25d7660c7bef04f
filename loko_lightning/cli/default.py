"""The LoKO that ``loko fit`` runs when its configuration pins none: decided from the model and the run.

The configuration's top-level key ``loko`` says which: ``default`` (``loko fit``'s default) runs the LoKO measured best
for the kind of model and run configured; ``as_configured`` runs exactly what the configuration says (the paper's
configs and every preset pin it). What the default decides from is known before anything is built:

- an image backbone (:class:`~loko_lightning.models.TimmClassifier`) with at most 10 classes: the image default,
  ``presets/loko_images`` (the averaged mean, a shared head covariance, the head's prior 10x smaller) predicting with
  its mixture with streaming LDA on the frozen features, their log-linear pools (``presets/loko_mixture_lda``) and
  nearest class mean on LDA's statistics (``NEAREST_MEAN``);
- an image backbone with more classes: the natural filter with the averaged mean and ``p0`` 0.03 (measured with 100),
  predicting with the same mixture and nearest class mean's vote as one more expert (``NEAREST_VOTE``);
- a text backbone (:class:`~loko_lightning.models.TransformersClassifier`): the text default, ``presets/loko_text``
  (``p0`` 10 with the prior's scale set online by its predictive likelihood, one covariance shared by the head's rows,
  the noise estimate debiased; measured with 5 and 25 classes)
  predicting with the same mixture on the frozen sentence embedding, the learner's prediction also tempered both ways
  (``TEXT_MIXTURE``);
- anything else runs as configured, and the line printed says why: another network family, or a LoKO setting or
  learner option the configuration changed (the default does not override a choice). ``shard: true`` is how the
  update is computed: an image backbone keeps its default, the 10-class one with a covariance per head row (the
  sharded update does not split a shared one; measured without the mixture as ``presets/loko_average_head``), a text
  backbone runs as configured (its default was not measured with a covariance per head row).

The defaults were measured in one process; under DDP they run the same settings, each step one joint update of every
process's samples, and the line says so.

The default's parts are the preset files themselves (one owner): the default applies the presets as more
``--config`` after the configuration (the many-class image default: three flags), which only touch settings the
check found at their defaults.
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import yaml
from jsonargparse import Namespace
from torch import nn

from loko_lightning.cli.configs import PACKAGED_CONFIGS
from loko_lightning.kalman.optimizer import LoKO
from loko_lightning.kalman.time_update import TimeUpdate
from loko_lightning.learner.mixture import FrozenHeadMixture
from loko_lightning.learner.selection import AUTO_P0, Candidates
from loko_lightning.models import TimmClassifier, TransformersClassifier

# The configuration's top-level key and its values.
CHOICES = ("default", "as_configured")
# The most classes the image default was measured with (10); beyond, the many-class image default (100 measured).
MAX_CLASSES = 10
# The learner's options the default's presets set, with the values that leave them to the default.
LEARNER_DEFAULTS = {
    "step_scales": None,
    "head_covariance": "diagonal",
    "select": None,
    "predictive": "mean",
    "mixture": None,
}
# LoKO's arguments the default leaves alone (they say how, not what, it computes).
NOT_SETTINGS = {"seed", "dtype", "collective_timeout"}


# The many-class image default: no preset holds it (four presets at most); these flags pin it.
MANY_CLASS_IMAGES = (
    "--model.optimizer.init_args.filter=natural",
    "--model.optimizer.init_args.p0=0.03",
    "--model.optimizer.init_args.average=0.99",
)
# The text default's mixture: the learner's prediction tempered on both sides, sharpened as on images and softened
# (its ECE on WordNet 8.9% alone: overconfident), Bayes' weights choosing (docs/results/default_study.md).
TEXT_MIXTURE = ("--model.mixture.init_args.learner_temperatures=[0.5, 0.7, 0.85, 1.25, 1.5, 2]",)
# Nearest class mean on LDA's statistics as more experts, on every image backbone: measured to lead LDA early with 100
# classes, a few samples each, and to lift the 10-class mixture from the first hundred samples (docs/results/
# default_study.md). Not measured on text.
NEAREST_MEAN = "--model.mixture.init_args.nearest_mean=true"
# Nearest class mean's argmax as one more expert, on the many-class image backbone: with the defaults' shares it gained
# on every glyphs100 seed (results/mixture/nearest/replay_vote_share_past.md, then the default study's runs); neutral
# on 10 classes, where it stays off.
NEAREST_VOTE = "--model.mixture.init_args.nearest_vote=true"


# With ``shard: true`` the image default's head keeps a covariance per row (the sharded update refuses a shared one):
# presets/loko_images with this flag after it, measured as ``presets/loko_average_head`` (late-stream study).
SHARDED_HEAD = "--model.head_covariance=diagonal"


@dataclass(frozen=True)
class Decision:
    """Which LoKO runs: ``name`` (``None``: the configuration as it is), the arguments that apply it, and why."""

    name: str | None
    reason: str
    args: tuple[str, ...] = ()

    @property
    def line(self) -> str:
        """The one line ``loko fit`` prints."""
        if self.name is None:
            return f"LoKO as configured: {self.reason}"
        return (
            f"LoKO: the default for this run, {self.name} ({self.reason}); `--loko as_configured` runs the config as is"
        )


def preset(name: str) -> tuple[str, ...]:
    """The ``--config`` arguments of a packaged preset."""
    return ("--config", str(PACKAGED_CONFIGS / f"{name}.yaml"))


def decide(config: Any) -> Decision | None:
    """The decision for a parsed ``fit`` configuration, or ``None`` (not a LoKO).

    With ``loko: as_configured`` (the paper's configs, every preset, a saved ``config.yaml``) nothing is decided, and
    the line names what the configuration sets away from LoKO's defaults, so a run never says nothing of its LoKO.
    """
    optimizer = config.get("model.optimizer")
    if _class_path(optimizer).rsplit(".", 1)[-1] != "LoKO":
        return None
    changed = _changed_settings(optimizer, config)
    if config.get("loko", "default") != "default":
        return Decision(None, f"the configuration pins it (loko: as_configured); {_summary(changed)}")
    network_class = class_of(config.get("model.network"))
    text = network_class is not None and issubclass(network_class, TransformersClassifier)
    sharded = _as_dict(getattr(optimizer, "init_args", None) or {}).get("shard") is True
    if sharded and not text:  # how the update is computed, which the image defaults keep (see below)
        changed = [flag for flag in changed if not flag.startswith("--model.optimizer.shard ")]
    if changed:
        return Decision(None, f"{changed[0]} is set, and the default does not override a choice")
    num_classes = getattr(getattr(config.get("model.network"), "init_args", None), "num_classes", None)
    if network_class is None or not issubclass(network_class, (TimmClassifier, TransformersClassifier)):
        return Decision(None, "the default is measured on timm and transformers classifiers only")
    processes = distributed(config.get("trainer"))
    # Measured in one process; under DDP each step is one joint update of every process's samples.
    where = ", several processes (measured in one)" if processes else ""
    if text:
        return Decision(
            "presets/loko_text + presets/loko_mixture_lda",
            f"a text backbone, {num_classes} classes{where}: p0 10 with the prior's scale set by its predictive "
            "likelihood on the first 500 updates, the head's covariance shared by its rows, the noise estimate "
            "corrected for its start at 0, "
            "predicting with its mixture with streaming LDA on the frozen sentence embedding, the learner's prediction "
            "also tempered both ways (its confidence too high on WordNet) and pooled with LDA's, the mixture's "
            "confidence recalibrated by its bins; --config "
            "presets/loko_text runs it alone, without the mixture's extra forward pass",
            preset("presets/loko_text") + preset("presets/loko_mixture_lda") + TEXT_MIXTURE,
        )
    vote: tuple[str, ...] = ()  # nearest class mean's vote: on for more classes than MAX_CLASSES only
    if isinstance(num_classes, int) and num_classes <= MAX_CLASSES and sharded:
        name = "presets/loko_images with a covariance per head row"
        args = (*preset("presets/loko_images"), SHARDED_HEAD)
        settings = "averaged mean, a covariance per head row (the sharded update does not split a shared one)"
        alone = f"--config presets/loko_images {SHARDED_HEAD} runs the filter alone"
    elif isinstance(num_classes, int) and num_classes <= MAX_CLASSES:
        name, args = "presets/loko_images", preset("presets/loko_images")
        settings = "averaged mean, shared head covariance"
        alone = "--config presets/loko_images runs the filter alone"
    else:
        name, args = "the many-class image default", MANY_CLASS_IMAGES
        settings = "the natural filter's one row, averaged mean, p0 0.03"
        alone = f"the filter's three flags given ({' '.join(MANY_CLASS_IMAGES)}) run it alone"
        vote = (NEAREST_VOTE,)
    return Decision(
        f"{name} + presets/loko_mixture_lda",
        f"an image backbone, {num_classes} classes{where}: {settings}, predicting with its mixture with streaming LDA "
        f"and nearest class mean{' (and its vote)' if vote else ''} on the frozen features, its prediction also "
        f"pooled with LDA's, the mixture's confidence recalibrated by its bins; {alone}, without the mixture's extra "
        "forward pass and LDA solve a sample",
        (*args, *preset("presets/loko_mixture_lda"), NEAREST_MEAN, *vote),
    )


def measured_to_lose(config: Any) -> list[str]:
    """A line per combination in a parsed ``fit`` configuration that the studies measured to lose (warned, not refused).

    - a text backbone with the head's prior below the adapters' (``step_scales: {head: < 1}``): lost at every
      checkpoint of BBC News (seed 0) against the same LoKO without it;
    - a text backbone with ``p0: auto`` over its default grid (0.01-0.3): its top, 0.3, was chosen (by LoFi) on every
      BBC News seed; a grid of 0.3-30 led the tuned AdamW there, and the text default sets the prior's scale online;
    - the covariance filter's ``softmax_noise`` on any backbone: behind the default on WordNet, MNIST-5k and
      Fashion-MNIST (seed 0), level on BBC News, ahead in NLL on the toy only (docs/filters.md).
    """
    if _class_path(config.get("model.optimizer")).rsplit(".", 1)[-1] != "LoKO":
        return []
    lines = []
    init_args = _as_dict(getattr(config.get("model.optimizer"), "init_args", None)) or {}
    if isinstance(init_args.get("filter"), Mapping) and init_args["filter"].get("softmax_noise") is True:
        lines.append(
            "filter {softmax_noise: true}: measured to lose against the default on WordNet, MNIST-5k and Fashion-MNIST "
            "(seed 0; level on BBC News, docs/filters.md); drop it, or run without a filter to get the default"
        )
    network_class = class_of(config.get("model.network"))
    if network_class is None or not issubclass(network_class, TransformersClassifier):
        return lines
    scales = _as_dict(config.get("model.step_scales")) or {}
    if isinstance(scales.get("head"), (int, float)) and scales["head"] < 1:
        lines.append(
            "step_scales {head: < 1} on a text backbone: measured to lose at every checkpoint of BBC News against the "
            "same LoKO without it (docs/filters.md, 'Which to use'); drop it for text"
        )
    select = _as_dict(config.get("model.select"))
    if init_args.get("p0") == "auto" and (select is None or tuple(select.get("values", ())) == AUTO_P0):
        lines.append(
            "p0: auto over its default grid (0.01-0.3) on a text backbone: its top was chosen on every BBC News seed "
            "(docs/p0.md), the grid is too small for text; presets/loko_text sets the prior's scale online from p0 10"
        )
    return lines


def distributed(trainer: Any) -> bool:
    """Whether a parsed trainer configuration runs several processes (devices, nodes, a DDP strategy, a launcher)."""
    get = (lambda name: getattr(trainer, name, None)) if trainer is not None else (lambda name: None)
    strategy = get("strategy")
    strategy = _class_path(strategy) or (strategy if isinstance(strategy, str) else "")
    if "ddp" in strategy.lower() or "fsdp" in strategy.lower():
        return True
    nodes = get("num_nodes")
    if isinstance(nodes, int) and nodes > 1:
        return True
    devices = get("devices")
    if isinstance(devices, (list, tuple)):
        return len(devices) > 1
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    if isinstance(devices, int):
        return devices > 1 or (devices == -1 and _accelerators(get("accelerator")) > 1)
    if devices in (None, "auto") and _accelerators(get("accelerator")) > 1:  # Lightning takes every GPU there is
        return True
    return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def _accelerators(accelerator: Any) -> int:
    name = accelerator if isinstance(accelerator, str) else "auto"
    if name in ("auto", "gpu", "cuda") and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 1


def _changed_settings(optimizer: Any, config: Any) -> list[str]:
    """The LoKO arguments and learner options the configuration sets away from their defaults, as flags."""
    changed = []
    init_args = _as_dict(getattr(optimizer, "init_args", None))
    for name, value in init_args.items():
        if name not in NOT_SETTINGS and not _is_default(name, value):
            changed.append(f"--model.optimizer.{name} {_shown(value)}")
    for name, default in LEARNER_DEFAULTS.items():
        value = config.get(f"model.{name}")
        if _as_dict(value) != (default if default is None or isinstance(default, str) else _as_dict(default)):
            changed.append(f"--model.{name} {_shown(value)}")
    return changed


def _summary(changed: list[str]) -> str:
    """What ``changed`` (``_changed_settings``) sets, a scalar with its value and a mapping by its name only."""
    if not changed:
        return "the paper's filter, every LoKO setting at its default"
    shown = []
    for flag in changed:
        name, _, value = flag.removeprefix("--model.").removeprefix("optimizer.").partition(" ")
        shown.append(name if value.startswith(("{", "[")) else f"{name} {value}")
    return "it sets " + ", ".join(shown)


def _is_default(name: str, value: Any) -> bool:
    if name == "filter":
        return _filter_arguments(value) == _filter_arguments("covariance")
    if name == "time_update":
        settings = TimeUpdate.group_defaults(None if value is None else _as_dict(value))
        return settings == TimeUpdate.group_defaults(None)
    default = DEFAULTS.get(name, object())
    if isinstance(default, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
        return math.isclose(value, default, rel_tol=0.0, abs_tol=0.0)
    return value == default


def _filter_arguments(value: Any) -> Any:
    """The filter's saved arguments, as a LoKO built with it on a stand-in parameter records them."""
    spec = _as_dict(value) if not isinstance(value, str) else value
    try:
        with torch.random.fork_rng(devices=[]):
            optimizer = LoKO([nn.Parameter(torch.zeros(1))], filter=spec)
    except Exception:  # noqa: BLE001 (an invalid filter is refused by LoKO itself when the learner builds it)
        return None
    return LoKO.arguments(optimizer.state_dict()).get("filter")


def _as_dict(value: Any) -> Any:
    if hasattr(value, "as_dict"):
        return value.as_dict()
    if isinstance(value, Mapping):
        return {key: _as_dict(item) for key, item in value.items()}
    return value


def _class_path(value: Any) -> str:
    path = getattr(value, "class_path", None)
    if path is None and isinstance(value, Mapping):
        path = value.get("class_path")
    return path if isinstance(path, str) else ""


def class_of(config: Any) -> type | None:
    """The class a parsed ``class_path`` names, or ``None`` (no class path, or nothing importable there)."""
    module, _, name = _class_path(config).rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name, None) if module else None
    except ImportError:
        return None
    return found if isinstance(found, type) else None


def _shown(value: Any) -> str:
    value = _as_dict(value)
    return str(value)


# LoKO's keyword defaults (its signature), the values the default counts as "not set".
DEFAULTS = {
    name: parameter.default
    for name, parameter in inspect.signature(LoKO.__init__).parameters.items()
    if parameter.default is not parameter.empty
}


def default_arguments(network: Any, *, processes: int = 1) -> tuple[Decision, dict[str, Any]]:
    """The decision for a network factory in code, and the learner's keyword arguments that run it.

    The arguments (of :class:`~loko_lightning.learner.module.OnlineClassifier`) are read from the same preset files
    ``loko fit`` applies, so code and the command line run the same LoKO.

    Example:
        >>> from loko_lightning.models import TimmClassifier
        >>> decision, arguments = default_arguments(TimmClassifier("test_resnet", num_classes=10, pretrained=False))
        >>> decision.name, arguments["head_covariance"], arguments["optimizer"].keywords
        ('presets/loko_images + presets/loko_mixture_lda', 'shared', {'average': 0.99})
    """
    cls = type(network)
    config = Namespace(
        loko="default",
        model=Namespace(
            network=Namespace(
                class_path=f"{cls.__module__}.{cls.__name__}",
                init_args=Namespace(num_classes=getattr(network, "num_classes", None)),
            ),
            optimizer=Namespace(class_path=f"{LoKO.__module__}.LoKO", init_args=Namespace()),
            **LEARNER_DEFAULTS,
        ),
        trainer=Namespace(devices=processes),
    )
    decision = decide(config)
    model: dict[str, Any] = {}
    for flag, value in zip(decision.args, decision.args[1:], strict=False):
        if flag == "--config":
            model.update(yaml.safe_load(Path(value).read_text())["model"])
    init_args = dict((model.get("optimizer") or {}).get("init_args") or {})
    mixture_args = dict((model.get("mixture") or {}).get("init_args") or {})
    flagged = (("--model.optimizer.init_args.", init_args), ("--model.mixture.init_args.", mixture_args))
    for flag in decision.args:  # the decision's flags, over its presets
        for prefix, values in flagged:
            if flag.startswith(prefix):
                name, _, value = flag.removeprefix(prefix).partition("=")
                values[name] = yaml.safe_load(value)
    if model.get("mixture"):
        model["mixture"] = {**model["mixture"], "init_args": mixture_args}
    arguments: dict[str, Any] = {"optimizer": partial(LoKO, **init_args)}
    for name in ("head_covariance", "step_scales"):
        if name in model:
            arguments[name] = model[name]
    if model.get("mixture"):
        arguments["mixture"] = FrozenHeadMixture.from_spec(model["mixture"])
    if model.get("select"):
        arguments["select"] = Candidates(**model["select"])
    return decision, arguments
