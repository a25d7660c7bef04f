"""The ``loko`` command: LightningCLI over :class:`OnlineClassifier` and :class:`StreamDataModule`.

``loko fit --config cifar10_resnet18`` runs one online pass (a bare name is a config shipped in the package,
``loko_lightning/configs``; a path is a file); ``validate``/``test`` evaluate on the held-out split; ``predict``
writes class probabilities (``--predictions FILE.csv|.json``) for the held-out split or for ``--data.predict_inputs``;
``loko export --ckpt_path CKPT --out DIR [--merge]`` writes a peft adapter or a merged model
(:mod:`loko_lightning.learner.export`); ``--print_config`` shows the full resolved configuration. ``--ckpt_path
last`` continues from the newest checkpoint (written atomically, :mod:`loko_lightning.learner.checkpoint_io`), or
starts from scratch when there is none yet, so one command serves for the first start and restarts. A checkpoint
holds the network's configuration, which ``predict``/``validate``/``test`` take from it.

Exit status: 0 on success; 2 for a configuration or input error (one line ``loko: error: --<key>: <what to change>``
on stderr); 3 when the run diverged (the message names the ``p0`` to try and where the last good state is saved).

Library code raises :class:`~loko_lightning.errors.ConfigError` naming the argument and the class that took it; this
module alone knows where that class sits in the configuration (``model.network``, ``model.optimizer``, ``data``) and
writes the flag. A parse error of jsonargparse is read from its exceptions (:func:`read_parse_error`).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import inspect
import os
import pickle
import re
import signal
import sys
import types
import typing
from argparse import ArgumentError
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import version
from importlib.resources import files
from pathlib import Path
from typing import Any, Literal

import torch
from jsonargparse import DefaultHelpFormatter
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_info

from loko_lightning.data import SOURCES, StreamDataModule
from loko_lightning.errors import ConfigError, DivergenceError, LostProcessError
from loko_lightning.learner.checkpoint_io import AtomicCheckpointIO, check_readable, unreadable_checkpoint
from loko_lightning.learner.export import export
from loko_lightning.learner.module import OnlineClassifier, ignore_intended_warnings
from loko_lightning.learner.predictions import PredictionWriter

# Errors whose message says what to change; anything else (a RuntimeError from torch, ...) is a bug and keeps its
# traceback.
USER_ERRORS = (ValueError, FileNotFoundError, ArgumentError, DivergenceError)
# The data module's preprocessing and label check follow the network: (source, target) links; an error about a
# target names the source's flag, which is the one a user sets. The preprocessing is what the instantiated network
# factory answers (NetworkFactory.preprocessing), so any factory's preprocessing reaches the data module.
LINKS = (
    ("model.network", "data.preprocessing"),
    ("model.network.init_args.num_classes", "data.num_classes"),
)
EXIT_USER_ERROR = 2
EXIT_DIVERGED = 3
EXIT_LOST_PROCESS = 4
# How the collective backends say that another process is gone (gloo's socket errors, a wait past its timeout, NCCL's
# abort); an error of torch.distributed's own types counts too.
LOST_PROCESS_WORDING = re.compile(
    r"connection reset by peer|connection closed by peer|broken pipe|timed out|timeout|nccl communicator was aborted|"
    r"connection refused",
    re.IGNORECASE,
)
# What jsonargparse says only in words, one pattern each; the rest comes from the exceptions' types and chain of
# causes, the parser's keys and the configured classes' signatures. tests/test_cli_errors.py reads real jsonargparse
# errors with each pattern, so a change of wording fails there instead of turning a user's error into a worse one.
JSONARGPARSE_WORDING = {
    # Each level of the chain that names the key whose value failed: 'Parser key "model.optimizer": ...'.
    "key": re.compile(r'^Parser key "(?P<key>[^"]+)"'),
    # The configured class whose argument failed: "class_path='loko_lightning.LoKO'" or "class_path 'loko_...'".
    "class_path": re.compile(r"class_path[=\s]'(?P<class_path>[\w.]+)'"),
    # An option that no parser or class takes (a KeyError): "Option 'p00' is not accepted".
    "option": re.compile(r"[Oo]ption '(?P<option>[^']+)'"),
    # The value given, at the end of the innermost message: "Expected a <class 'float'>. Got value: big".
    "value": re.compile(r"(?:Got|Given) value: (?P<value>.*)\Z", re.DOTALL),
    # Command-line arguments that no parser took (argparse's own wording).
    "unrecognized": re.compile(r"^unrecognized arguments: (?P<arguments>.*)", re.DOTALL),
}


# Sphinx markup in the docstrings that --help shows: a role (``:class:`~a.b.C` `` reads ``C``, ``:mod:`a.b` `` reads
# ``a.b``) and double backquotes (``"auto"`` reads "auto").
_ROLE = re.compile(r":[a-z]+:`(~?)([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")


def plain_text(text: str) -> str:
    """A docstring's text with its Sphinx roles and double backquotes as plain words (for ``--help``)."""
    text = _ROLE.sub(lambda m: m[2].rpartition(".")[2] if m[1] else m[2], text)
    return _LITERAL.sub(r"\1", text)


class HelpFormatter(DefaultHelpFormatter):
    """jsonargparse's help, with the docstrings' Sphinx markup read as plain text."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return super()._split_lines(plain_text(text), width)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return super()._fill_text(plain_text(text), width, indent)

    def start_section(self, heading: str | None) -> None:
        """A section (a class's arguments) headed by its docstring's first line, read as plain text."""
        super().start_section(plain_text(heading) if heading else heading)


class LoKOCLI(LightningCLI):
    """LightningCLI with the data preprocessing and label range tied to the network, one-line errors, atomic saves."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # The learner takes its optimizer and scheduler as arguments (model.optimizer, model.lr_scheduler), so the
        # top-level --optimizer/--lr_scheduler of LightningCLI would only be a second, ignored way to set them.
        kwargs.setdefault("auto_configure_optimizers", False)
        # Under DDP the stream shards itself (every step's positions split across the processes in stream order);
        # Lightning's DistributedSampler would reshuffle it.
        kwargs["trainer_defaults"] = {"use_distributed_sampler": False, **kwargs.get("trainer_defaults", {})}
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser: Any) -> None:
        """The stream is preprocessed as the network needs and its labels are checked against the head size."""
        preprocessing, num_classes = LINKS
        parser.link_arguments(*preprocessing, compute_fn=_preprocessing, apply_on="instantiate")
        parser.link_arguments(*num_classes)
        for action in parser._actions:  # the registered names (a registry, so not a Literal: sources can be added)
            if action.dest == "data.dataset":
                action.help = f"{action.help} Registered: {', '.join(sorted(SOURCES))}."

    def _prepare_subcommand_parser(self, klass: type, subcommand: str, **kwargs: Any) -> Any:
        """Lightning's subcommand parser; ``predict`` also takes ``--predictions`` (where the rows are written)."""
        kwargs.setdefault("formatter_class", HelpFormatter)
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        if subcommand == "predict":
            parser.add_argument(
                "--predictions",
                type=str,
                default="predictions.csv",
                help="file the predictions are written to: .csv (one p:<class> column per class) or .json",
            )
        return parser

    def before_fit(self) -> None:
        """``--ckpt_path last`` with checkpoints in the logger's version folders: the newest ``last*.ckpt`` of them.

        Lightning looks for ``last`` only in this run's checkpoint folder, which under the default layout
        (``save_dir/name/version_N/checkpoints``) is a new, empty version; a resumed run then writes the next version
        (its checkpoints, its logs) and continues the stream where the newest checkpoint left it. With no checkpoint
        yet, the run starts from the first sample. A checkpoint callback with its own ``dirpath`` keeps Lightning's
        lookup.
        """
        config = self.config_init["fit"]
        logger = self.trainer.logger
        callbacks = self.trainer.checkpoint_callbacks
        if config.get("ckpt_path") != "last" or logger is None or not callbacks or callbacks[0].dirpath is not None:
            return
        root = Path(logger.save_dir or self.trainer.default_root_dir) / (logger.name or "")
        found = sorted(root.glob("*/checkpoints/last*.ckpt"), key=lambda path: path.stat().st_mtime)
        if found:
            config["ckpt_path"] = str(found[-1])
            rank_zero_info(f"Resuming from the newest last checkpoint: {found[-1]}")
        else:
            config["ckpt_path"] = None
            rank_zero_info(f"No checkpoint under {root} yet: starting from the first sample")

    def before_predict(self) -> None:
        """Write the predictions (:class:`~loko_lightning.learner.predictions.PredictionWriter`) when they end."""
        self.trainer.callbacks.append(PredictionWriter(self.config["predict"]["predictions"]))

    def parse_arguments(self, parser: Any, args: Any) -> None:
        """Parse; an unknown or ill-typed option becomes one ``ValueError`` line naming the close valid keys."""
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as err:
            message = self._parse_error_message(read_parse_error(err), self._known_keys(parser))
            raise ValueError(message) from None
        # LightningCLI reads the hyperparameters of a ckpt_path file next, with a bare torch error for a torn file.
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path:
            check_readable(ckpt_path)

    def _parse_ckpt_path(self) -> None:
        """Lightning reads a ``ckpt_path`` file's hyperparameters (``weights_only``); a refused file is one line."""
        try:
            super()._parse_ckpt_path()
        except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
            subcommand = self.config.get("subcommand")
            raise unreadable_checkpoint(self.config[subcommand].get("ckpt_path"), err) from None

    def before_instantiate_classes(self) -> None:
        """Remember which configuration key each configured class sits at, to name a bad argument's flag."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        self._owner_keys: dict[type, str] = {}
        for key, class_path in _class_paths(config):
            owner = _class_at(class_path)
            if owner is not None:
                self._owner_keys.setdefault(owner, key)
        self._owner_keys.setdefault(self.model_class, "model")
        self._owner_keys.setdefault(self.datamodule_class, "data")

    def instantiate_classes(self) -> None:
        """Instantiate; a bad argument's error learns its configuration key."""
        with self._naming_errors():
            self._check_modalities()
            super().instantiate_classes()

    def _check_modalities(self) -> None:
        """The network takes the kind of sample the dataset holds (images or text), checked before building either."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        network, dataset = config.get("model.network"), config.get("data.dataset")
        class_path = getattr(network, "class_path", None)
        if not isinstance(class_path, str) or dataset not in SOURCES:
            return  # unknown names are refused by the classes themselves
        module, _, name = class_path.rpartition(".")
        network_modality = getattr(getattr(importlib.import_module(module), name, None), "modality", None)
        data_modality = SOURCES[dataset].modality
        if network_modality is not None and network_modality != data_modality:
            fits = "TransformersClassifier" if data_modality == "text" else "TimmClassifier"
            raise ConfigError(
                f"dataset={dataset!r} holds {data_modality} samples but model.network is {name}, a {network_modality} "
                f"model. To fix it: choose a {network_modality} dataset, or a network for {data_modality} "
                f"(loko_lightning.models.{fits}).",
                field="dataset",
                owner=StreamDataModule,
            )

    def _run_subcommand(self, subcommand: str) -> None:
        """Run it; under DDP, a collective failing because another process is gone becomes a :class:`LostProcessError`.

        Lightning has already stopped this process's part of the run when the error reaches here; the processes it
        started on this node are killed (one that hangs would otherwise outlive this one).
        """
        with self._naming_errors(), ignore_intended_warnings():
            try:
                super()._run_subcommand(subcommand)
            except Exception as err:
                lost = lost_process_error(err, self.trainer)
                if lost is None:
                    raise
                # The processes Lightning started on this node (a hung one would outlive this one).
                launcher = getattr(self.trainer.strategy, "launcher", None)
                if callable(getattr(launcher, "kill", None)):
                    launcher.kill(signal.SIGKILL)
                raise lost from err

    @contextlib.contextmanager
    def _naming_errors(self) -> Iterator[None]:
        try:
            yield
        except (ConfigError, DivergenceError, ValueError) as caught:
            # jsonargparse wraps what a link's compute_fn raises (the factory's preprocessing) in a ValueError.
            err = caught if isinstance(caught, (ConfigError, DivergenceError)) else caught.__cause__
            if not isinstance(err, (ConfigError, DivergenceError)):
                raise
            owner_key = getattr(self, "_owner_keys", {}).get(err.owner) if err.owner is not None else None
            key = ".".join(part for part in (owner_key, err.field) if part) or None
            err.key = next((s.replace(".init_args", "") for s, t in LINKS if t == key), key)
            if err is not caught:
                raise err from None
            raise

    def _known_keys(self, parser: Any) -> list[str]:
        parsers = [parser, *getattr(self, "_subcommand_parsers", {}).values()]
        return sorted({a.dest for p in parsers for a in p._actions if a.dest and a.dest != "help"})

    def _parse_error_message(self, error: ParseError, keys: list[str]) -> str:
        """One line for a parse error: what is wrong with which flag, and the valid keys closest to an unknown one."""
        if error.unknown and error.keys and error.class_path:
            return _unknown_argument_message(".".join(error.keys), error.unknown[0], error.class_path)
        owner, name = None, None
        if error.class_path and len(error.keys) > 1:  # an argument of a configured class: its signature says its type
            owner, name = _class_at(error.class_path), error.keys[-1]
        elif len(error.keys) == 1:  # an argument of the model, the data module or the trainer
            root, _, name = error.keys[0].partition(".")
            owner = {"model": self.model_class, "data": self.datamodule_class, "trainer": self.trainer_class}.get(root)
        expected = _expected_type(owner, name) if owner is not None and error.value is not None else None
        if expected and not error.unknown:
            flag = ".".join(error.keys)
            return f"--{flag}: expected {expected}, got {error.value!r}. See `loko fit --help`."
        return _generic_message(error, keys)

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """The trainer, with checkpoints written atomically unless another checkpoint IO was configured."""
        trainer = super().instantiate_trainer(**kwargs)
        strategy = trainer.strategy
        if type(strategy.checkpoint_io) is TorchCheckpointIO:
            strategy.checkpoint_io = AtomicCheckpointIO()
        return trainer


@dataclass(frozen=True)
class ParseError:
    """What a jsonargparse parse error says, read from its chain of exceptions.

    Attributes:
        keys: the keys whose value failed, outermost first: ``("model.optimizer", "beta")`` for ``beta`` of the class
            configured at ``model.optimizer``; empty for an option no parser took.
        class_path: the configured class whose argument failed (the innermost one named), if any.
        unknown: options nobody takes: the command-line flags no parser took (``"model.netwrk.r"``), or the one
            option a class or section does not accept (``"p00"``, ``"model.windoww"``).
        value: the value given, as jsonargparse shows it, if it says.
        message: the outermost message on one line.
    """

    keys: tuple[str, ...] = ()
    class_path: str | None = None
    unknown: tuple[str, ...] = ()
    value: str | None = None
    message: str = ""


def read_parse_error(error: BaseException) -> ParseError:
    """Read a jsonargparse parse error: its chain of causes, the exceptions' types, and :data:`JSONARGPARSE_WORDING`."""
    chain = []
    cause: BaseException | None = error
    while cause is not None and cause not in chain:
        chain.append(cause)
        cause = cause.__cause__ or (None if cause.__suppress_context__ else cause.__context__)
    texts = [_text(e) for e in chain]
    keys: list[str] = []
    for text in texts:
        match = JSONARGPARSE_WORDING["key"].match(text)
        if match and (not keys or keys[-1] != match["key"]):  # a wrapper repeats its cause's key
            keys.append(match["key"])
    class_path = next(
        (m["class_path"] for t in reversed(texts) if (m := JSONARGPARSE_WORDING["class_path"].search(t))), None
    )
    unknown: tuple[str, ...] = ()
    unrecognized = JSONARGPARSE_WORDING["unrecognized"].match(texts[0])
    rejected = next((text for e, text in zip(chain, texts, strict=True) if isinstance(e, KeyError)), None)
    if unrecognized:
        flags = (a for a in unrecognized["arguments"].split() if a.startswith("--"))
        unknown = tuple(dict.fromkeys(flag[2:].partition("=")[0] for flag in flags))
    elif rejected is not None and (option := JSONARGPARSE_WORDING["option"].search(rejected)):
        unknown = (option["option"],)
    values = (list(JSONARGPARSE_WORDING["value"].finditer(t)) for t in reversed(texts))
    value = next((found[-1]["value"] for found in values if found), None)
    return ParseError(tuple(keys), class_path, unknown, value, " ".join(texts[0].split()))


def _text(error: BaseException) -> str:
    """An exception's own message (``str`` of a ``KeyError`` adds quotes; an ``ArgumentError`` keeps it apart)."""
    if isinstance(error, ArgumentError):
        return error.message
    return error.args[0] if error.args and isinstance(error.args[0], str) else str(error)


def _class_at(class_path: str) -> Any:
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


def _parameters(owner: Any) -> list[str]:
    """The arguments a configured class or function takes (without the ones the learner passes itself)."""
    try:
        names = list(inspect.signature(owner).parameters)
    except (ValueError, TypeError):
        return []
    return [n for n in names if n not in ("self", "params", "optimizer", "args", "kwargs")]


# How an expected type reads in an error; a type outside these (a class, a callable) keeps jsonargparse's words.
_TYPE_WORDS = {int: "an int", float: "a float", str: "a string", bool: "a bool", type(None): "null"}


def _expected_type(owner: Any, name: str) -> str | None:
    """The type of argument ``name`` of ``owner`` in words (``"a float or 'auto'"``), from its signature."""
    try:
        hint = typing.get_type_hints(owner.__init__ if isinstance(owner, type) else owner).get(name)
    except Exception:  # an annotation that does not evaluate here: say nothing rather than something wrong
        return None
    words = _type_words(hint) if hint is not None else None
    return " or ".join(dict.fromkeys(words)) if words else None


def _type_words(hint: Any) -> list[str] | None:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return [repr(value) for value in typing.get_args(hint)]
    if origin in (typing.Union, types.UnionType):
        parts = [_type_words(arg) for arg in typing.get_args(hint)]
        return None if any(part is None for part in parts) else [w for part in parts for w in part]
    if origin in (list, tuple, dict, set):
        return [f"a {origin.__name__}"]
    return [_TYPE_WORDS[hint]] if hint in _TYPE_WORDS else None


def _unknown_argument_message(key: str, name: str, class_path: str) -> str:
    """``--model.optimizer.p00 is not an option of loko_lightning.LoKO; did you mean 'p0'?``."""
    options = _parameters(_class_at(class_path))
    close = difflib.get_close_matches(name, options, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}?" if close else f"its options: {', '.join(options)}"
    return f"--{key}.{name} is not an option of {class_path}; {hint} See `loko fit --help`."


def _generic_message(error: ParseError, keys: list[str]) -> str:
    """The parser's error on one line, with the valid keys closest to an unknown one."""
    hints = []
    for key in error.unknown:
        section, _, leaf = key.rpartition(".")
        siblings = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == section]
        close = difflib.get_close_matches(leaf, siblings, n=3, cutoff=0.6)
        where = f"{section}." if section else ""
        if close:
            hints.append(f"did you mean {' or '.join(repr(where + c) for c in close)} instead of {key!r}?")
        elif siblings:
            scope = f" of {section}" if section else ""
            hints.append(f"{key!r} is not an option; those{scope} are {', '.join(siblings)}")
        else:
            sections = sorted({k.rpartition(".")[0] for k in keys if "." in k})
            close = difflib.get_close_matches(section, sections, n=1, cutoff=0.6)
            if close:
                hints.append(f"did you mean {close[0] + '.' + leaf!r} instead of {key!r}?")
    body = "; ".join([error.message.rstrip("."), *hints])
    help_hint = "See `loko fit --help`" + ("" if error.unknown else " (or --print_config for the resolved values)")
    return f"{body}{'' if body.endswith('?') else '.'} {help_hint}."


DESCRIPTION = (
    "loko: online fine-tuning of pretrained timm and transformers models with LoRA adapters, one sample at a time, "
    "by LoKO (the Low-Rank Kalman Optimizer) or the LoRA/AdamW and LoRA/AdaGrad baselines. "
    "Start with: loko fit --config quickstart (a config shipped in the package, by name; a path works too). "
    "Then: loko predict --config quickstart --ckpt_path CKPT --predictions out.csv; "
    "loko export --ckpt_path CKPT --out DIR [--merge] (see loko export --help)."
)
# The configs that ship in the package: `--config NAME` (or NAME.yaml, presets/NAME) resolves to these.
PACKAGED_CONFIGS = files("loko_lightning") / "configs"


def packaged_configs() -> list[str]:
    """The names ``--config`` takes for the configs shipped in the package (``quickstart``, ``presets/loko_topk``)."""
    root = Path(str(PACKAGED_CONFIGS))
    return sorted(str(path.relative_to(root).with_suffix("")) for path in root.rglob("*.yaml"))


def resolve_config_names(args: list[str]) -> list[str]:
    """``--config NAME`` as the path of the packaged config of that name, where ``NAME`` is not an existing file.

    Raises:
        ValueError: ``--config`` names neither a file nor a packaged config (the message lists the packaged ones).
    """
    resolved = list(args)
    for index, arg in enumerate(resolved):
        if arg == "--config" and index + 1 < len(resolved):
            position, value = index + 1, resolved[index + 1]
        elif arg.startswith("--config="):
            position, value = index, arg.partition("=")[2]
        else:
            continue
        if Path(value).expanduser().exists() or value.lstrip().startswith(("{", "[")) or "\n" in value:
            continue  # a file, or a config given inline
        name = value.removesuffix(".yaml")
        candidate = Path(str(PACKAGED_CONFIGS)) / f"{name}.yaml"
        if not candidate.is_file():
            close = difflib.get_close_matches(name, packaged_configs(), n=3, cutoff=0.5)
            hint = f"did you mean {' or '.join(close)}? " if close else ""
            raise ValueError(
                f"--config: no file {value!r} and no config of that name in the package; {hint}packaged configs: "
                f"{', '.join(packaged_configs())}"
            )
        resolved[position] = str(candidate) if arg == "--config" else f"--config={candidate}"
    return resolved


def export_main(args: list[str]) -> None:
    """``loko export``: a trained checkpoint as a peft adapter directory, or a merged plain model (``--merge``)."""
    parser = argparse.ArgumentParser(
        prog="loko export",
        description=(
            "Write a checkpoint's network as a peft adapter for the stock timm/transformers backbone "
            "(PeftModel.from_pretrained), or with --merge as a plain model with the adapter merged "
            "(timm.create_model('local-dir:DIR', pretrained=True) / AutoModelForSequenceClassification.from_pretrained"
            "(DIR)). Weights are safetensors; class names and preprocessing go with them (loko_export.json)."
        ),
        exit_on_error=False,
    )
    parser.add_argument("--ckpt_path", required=True, help="a checkpoint written by loko fit")
    parser.add_argument("--out", required=True, help="the directory to write (new, or empty)")
    parser.add_argument("--merge", action="store_true", help="merge the adapter into the backbone")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing, non-empty --out")
    try:
        options = parser.parse_args(args)
    except ArgumentError as err:
        raise ValueError(f"{err.message}. See `loko export --help`.") from None
    learner = load_learner(options.ckpt_path)
    out = export(learner, options.out, merge=options.merge, overwrite=options.overwrite)
    print(f"loko: exported {'a merged model' if options.merge else 'a peft adapter'} to {out}")


def load_learner(path: str) -> OnlineClassifier:
    """The learner of a ``loko fit`` checkpoint, loaded without running any code from the file.

    Raises:
        ConfigError: no file, a file torch cannot read (truncated, not a checkpoint, or holding objects that
            ``weights_only`` loading refuses), or a checkpoint that is not an :class:`OnlineClassifier`'s.
    """
    if not Path(path).expanduser().is_file():
        raise ConfigError(f"no checkpoint file at {path!r}", field="ckpt_path")
    check_readable(path)
    try:
        return OnlineClassifier.load_from_checkpoint(path, map_location="cpu", weights_only=True)
    except ConfigError:
        raise
    except (pickle.UnpicklingError, EOFError) as err:
        raise unreadable_checkpoint(path, err) from None
    except Exception as err:
        reason = " ".join(str(err).split())[:300]
        raise ConfigError(
            f"{path} is not a checkpoint loko can load ({type(err).__name__}: {reason}); pass a checkpoint written "
            "by loko fit",
            field="ckpt_path",
        ) from None


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``loko`` console script.

    Configuration errors (unknown option or backbone, missing data, bad hyperparameters, ...) end with a one-line
    message and exit status 2, a diverged run with a one-line message and exit status 3, a distributed run that lost
    a process (killed, or hung past ``model.collective_timeout``) with a one-line message and exit status 4; set
    ``LOKO_TRACEBACK=1`` to see the full traceback.
    """
    from_command_line = args is None
    args = sys.argv[1:] if args is None else list(args)
    try:
        if args[:1] == ["export"]:
            export_main(args[1:])
            return
        args = resolve_config_names(args)
        if from_command_line:  # LightningCLI reads sys.argv itself (given both, it warns)
            sys.argv[1:] = args
        LoKOCLI(
            OnlineClassifier,
            StreamDataModule,
            args=None if from_command_line else args,
            subclass_mode_model=False,
            subclass_mode_data=False,
            save_config_kwargs={"overwrite": True},
            trainer_defaults={"max_epochs": 1, "num_sanity_val_steps": 0},
            # Parse errors raise (and become one line below) instead of printing the whole usage.
            parser_kwargs={
                "exit_on_error": False,
                "prog": "loko",
                "description": DESCRIPTION,
                "formatter_class": HelpFormatter,
                "version": version("loko-lightning"),
            },
        )
    except (*USER_ERRORS, LostProcessError) as err:
        if os.environ.get("LOKO_TRACEBACK"):
            raise
        key = getattr(err, "key", None) or getattr(err, "field", None)
        where = f"--{key}: " if key else ""
        print(f"loko: error: {where}{' '.join(str(err).split())}", file=sys.stderr)
        codes = {DivergenceError: EXIT_DIVERGED, LostProcessError: EXIT_LOST_PROCESS}
        raise SystemExit(codes.get(type(err), EXIT_USER_ERROR)) from None


def lost_process_error(err: BaseException, trainer: Trainer) -> LostProcessError | None:
    """The one-line account of a distributed run that lost a process, or ``None`` if ``err`` is something else.

    It names this process and the lost one (with 2 processes: the other rank), the step, the backend's reason, the
    newest checkpoint (only the steps after it are lost) and how to resume.
    """
    world, rank = trainer.world_size, trainer.global_rank
    chain, cause = [], err
    while cause is not None and len(chain) < 10:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    dist_error = getattr(torch.distributed, "DistError", ())
    if world < 2 or not any(isinstance(e, dist_error) or LOST_PROCESS_WORDING.search(str(e)) for e in chain):
        return None
    reason = next((line.strip() for e in chain for line in str(e).splitlines() if line.strip()), type(err).__name__)
    reason = re.sub(r"^\[[^\]]*\]\s*", "", reason).split(". ")[0]  # gloo's "[file.cc:545] Read error ...: reset..."
    lost = f"rank {1 - rank}" if world == 2 else "another process"
    found = []
    for callback in trainer.checkpoint_callbacks:
        if getattr(callback, "dirpath", None):
            found += Path(callback.dirpath).glob("*.ckpt")
    newest = max(found, key=lambda path: path.stat().st_mtime, default=None)
    saved = (
        f"The newest checkpoint is {newest}: only the steps after it are lost. To resume, start every process again "
        "with the same command and --ckpt_path last"
        if newest is not None
        else "No checkpoint was written yet: start every process again with the same command"
    )
    return LostProcessError(
        f"lost {lost} of the {world} processes at training step {trainer.global_step + 1} ({reason[:200]}); this "
        f"process (rank {rank}) stops too. {saved}"
    )


def _preprocessing(network: Any) -> Any:
    """What the network factory says its network needs its inputs to be (the data module's ``preprocessing``)."""
    return network.preprocessing()


def _class_paths(config: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    """``(key, class_path)`` of every class in a parsed configuration, keys as flags spell them (no ``init_args``)."""
    for name, value in vars(config).items():
        key = f"{prefix}{name}"
        items = list(enumerate(value)) if isinstance(value, list) else [(None, value)]
        for index, item in items:
            item_key = key if index is None else f"{key}[{index}]"
            if not hasattr(item, "__dict__") or isinstance(item, type):
                continue
            fields = vars(item)
            if isinstance(fields.get("class_path"), str):
                yield item_key, fields["class_path"]
                if fields.get("init_args") is not None and hasattr(fields["init_args"], "__dict__"):
                    yield from _class_paths(fields["init_args"], f"{item_key}.")
            elif index is None and type(item).__name__ == "Namespace":
                yield from _class_paths(item, f"{item_key}.")


if __name__ == "__main__":
    main()
