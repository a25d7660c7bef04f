"""``LoKOCLI``: LightningCLI over the learner and the stream, with the data tied to the network and one-line errors.

The data module's preprocessing and label range follow the network (:data:`LINKS`); ``--help`` reads the docstrings'
Sphinx markup as plain text (:class:`HelpFormatter`); ``predict`` takes ``--predictions``; ``--ckpt_path last`` finds
the newest checkpoint of the logger's version folders; a :class:`~loko_lightning.errors.ConfigError` learns the flag of
the argument it names; checkpoints are written atomically.
"""

from __future__ import annotations

import contextlib
import inspect
import pickle
import re
import signal
import sys
import warnings
from argparse import ArgumentError
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from jsonargparse import DefaultHelpFormatter
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from loko_lightning.cli.default import class_of, decide, measured_to_lose
from loko_lightning.cli.errors import class_at, lost_process_error, parse_error_message, read_parse_error
from loko_lightning.data import FAMILIES, Source, StreamDataModule
from loko_lightning.errors import ConfigError, DivergenceError
from loko_lightning.learner.checkpoint_io import AtomicCheckpointIO, check_readable, unreadable_checkpoint
from loko_lightning.learner.module import ignore_intended_warnings
from loko_lightning.learner.predictions import PredictionWriter

# The data module's preprocessing and label check follow the network: (source, target) links; an error about a
# target names the source's flag, which is the one a user sets. The preprocessing is what the instantiated network
# factory answers (NetworkFactory.preprocessing), so any factory's preprocessing reaches the data module.
LINKS = (
    ("model.network", "data.preprocessing"),
    ("model.network.init_args.num_classes", "data.num_classes"),
)


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

    def _format_usage(self, usage: Any, actions: Any, groups: Any, prefix: str | None) -> str:
        """The usage line, with ``export`` among the subcommands (``loko export`` is read before LightningCLI)."""
        text = super()._format_usage(usage, actions, groups, prefix)
        return text.replace("{fit,validate,test,predict}", "{fit,validate,test,predict,export}")

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
        for action in parser._actions:  # the built-in families by their short names (any Source subclass is taken)
            if action.dest == "data.source":
                action.help = f"{action.help} Built in: {', '.join(family.__name__ for family in FAMILIES)}."
        # Every subcommand reads it (a config file has it); fit (and a CLI without subcommands) decides with it.
        parser.add_argument(
            "--loko",
            type=Literal["default", "as_configured"],
            default="default",
            help=(
                "which LoKO loko fit runs: 'default' decides from the model and the run, printing one line (one "
                "process: presets/loko_images for an image backbone with <= 10 classes, the natural filter with the "
                "averaged mean beyond, both predicting with presets/loko_mixture_lda, presets/loko_text with the "
                "same mixture for a text backbone; a LoKO setting you changed, a text backbone under DDP or "
                "another network: as configured), 'as_configured' runs the configuration exactly (the paper's configs "
                "and the presets pin it)"
            ),
        )

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
        if subcommand in ("validate", "test", "predict"):
            parser.add_argument(
                "--preprocessing_from",
                type=Literal["checkpoint", "config"],
                default="checkpoint",
                help=(
                    "with --ckpt_path: preprocess as the checkpoint's training data was (image size, mean/std, "
                    "max_length: what loko fit saved), or as this run's configuration and flags say ('config')"
                ),
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
        self._check_preprocessing_flags("predict")
        writer = PredictionWriter(self.config["predict"]["predictions"])
        writer.check_writable()
        # Prediction logs nothing and saves no checkpoint: no new version folder of the config's logger, no
        # checkpoint callback whose folder "has changed" since the checkpoint was written, and no config.yaml (it
        # would land in the working directory, without a logger folder).
        self.trainer.loggers = []
        unused = (Checkpoint, SaveConfigCallback)
        self.trainer.callbacks = [c for c in self.trainer.callbacks if not isinstance(c, unused)] + [writer]

    def before_validate(self) -> None:
        """Evaluate with the checkpoint's preprocessing (:meth:`_check_preprocessing_flags`)."""
        self._check_preprocessing_flags("validate")

    def before_test(self) -> None:
        """Evaluate with the checkpoint's preprocessing (:meth:`_check_preprocessing_flags`)."""
        self._check_preprocessing_flags("test")

    def _check_preprocessing_flags(self, subcommand: str) -> None:
        """A checkpoint's preprocessing is used; a command-line flag that disagrees with it is refused.

        The learner applies the checkpoint's preprocessing to the data module (a configuration file's image size or
        ``max_length`` gives way to it); a flag typed on this command line that says otherwise is an error naming both
        values, unless ``--preprocessing_from config`` asks for the configuration's.
        """
        config = self.config[subcommand]
        ckpt_path = config.get("ckpt_path")
        if config.get("preprocessing_from") == "config":
            self.model.use_checkpoint_preprocessing = False
            return
        if not ckpt_path or not Path(ckpt_path).is_file():
            return
        saved = torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True).get("preprocessing")
        if not saved:
            return
        source = config.get("data.source")
        init_args = getattr(source, "init_args", None)
        for name in _flags_given(self._given_args, "data.source", PREPROCESSING_OPTIONS):
            value = getattr(init_args, name, None)
            trained = _saved_value(saved, name)
            if value is None or trained is None or _same(value, trained):
                continue
            raise ConfigError(
                f"this flag asks for {name} {_shown(value)}, but the checkpoint was trained with {name} "
                f"{_shown(trained)}, which {subcommand} uses by default. To fix it: drop the flag (the checkpoint's "
                f"{_shown(trained)} is used), or pass --preprocessing_from config to {subcommand} with "
                f"{_shown(value)} on purpose",
                field=f"source.{name}",
                owner=StreamDataModule,
            )

    def parse_arguments(self, parser: Any, args: Any) -> None:
        """Parse; an unknown or ill-typed option becomes one ``ValueError`` line naming the close valid keys.

        ``fit`` then decides which LoKO runs (:func:`~loko_lightning.cli.default.decide`, one line printed) and parses
        again with the decided preset after the configuration; ``--print_config`` prints what was decided.
        """
        given = [str(arg) for arg in (sys.argv[1:] if args is None else args)]
        self._given_args = given
        printing = [arg for arg in given if arg.split("=", 1)[0] == "--print_config"]
        first = [arg for arg in given if arg not in printing]
        # A flag of the mixture's options (--model.mixture.init_args.*) is for the mixture the default may add: parsed
        # after the decided presets, so it changes their mixture; without a decision it is parsed where it was given.
        first, mixture_flags = _split_mixture_flags(first)
        self._parse(parser, first if printing or mixture_flags else given, from_argv=args is None)
        subcommand = self.config.get("subcommand")
        fitting = self.config["fit"] if subcommand == "fit" else self.config if subcommand is None else None
        decision = decide(fitting) if fitting is not None else None
        if decision is not None:
            rank_zero_info(decision.line)
        if printing or mixture_flags or (decision is not None and decision.args):
            # The preset after the configuration: it sets only what the decision found left at its default.
            decided = [*first, *(decision.args if decision else ()), *mixture_flags, *printing]
            self._parse(parser, decided, from_argv=args is None)
        if fitting is not None:
            for line in measured_to_lose(self.config["fit"] if subcommand == "fit" else self.config):
                rank_zero_warn(line)
        # LightningCLI reads the hyperparameters of a ckpt_path file next, with a bare torch error for a torn file.
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path:
            check_readable(ckpt_path)

    def _parse(self, parser: Any, args: list[str], *, from_argv: bool) -> None:
        if from_argv:  # LightningCLI reads sys.argv itself (given both, it warns)
            sys.argv[1:] = args
        try:
            super().parse_arguments(parser, None if from_argv else args)
        except ArgumentError as err:
            sections = {"model": self.model_class, "data": self.datamodule_class, "trainer": self.trainer_class}
            message = parse_error_message(read_parse_error(err), self._known_keys(parser), sections)
            raise ValueError(message) from None

    def _parse_ckpt_path(self) -> None:
        """Lightning reads a ``ckpt_path`` file's hyperparameters (``weights_only``); a refused file is one line.

        Those replace the configured network's, so a ``--model.network.num_classes`` flag that the checkpoint's head
        contradicts would be dropped without a word: it is refused in one line naming ``--model.adapters_from``.
        """
        subcommand = self.config.get("subcommand")
        wanted = _num_classes(self.config[subcommand]) if subcommand else None
        try:
            super()._parse_ckpt_path()
        except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
            raise unreadable_checkpoint(self.config[subcommand].get("ckpt_path"), err) from None
        if subcommand == "fit" and _flags_given(self._given_args, "model.network", ("num_classes",)):
            saved = _num_classes(self.config[subcommand])
            if wanted is not None and saved is not None and wanted != saved:
                raise ValueError(
                    f"--model.network.num_classes: the checkpoint (--ckpt_path) has a {saved}-class head and a resumed "
                    f"run continues it, so {wanted} cannot apply. To fix it: drop the flag to resume, or train a new "
                    f"{wanted}-class head on the checkpoint's adapters: --model.adapters_from "
                    f"{self.config[subcommand].get('ckpt_path')} without --ckpt_path"
                )

    def before_instantiate_classes(self) -> None:
        """Remember which configuration key each configured class sits at, to name a bad argument's flag."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        self._owner_keys: dict[type, str] = {}
        for key, class_path in _class_paths(config):
            owner = class_at(class_path)
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
        """The network takes the kind of sample the source holds (images or text), checked before building either."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        network, source = config.get("model.network"), config.get("data.source")
        network_class, source_class = class_of(network), class_of(source)
        if network_class is None or source_class is None or not issubclass(source_class, Source):
            return  # unknown classes are refused by the parser or the classes themselves
        if source_class.follows_network:
            return
        network_modality, data_modality = getattr(network_class, "modality", None), source_class.modality
        if network_modality is not None and network_modality != data_modality:
            fits = "TransformersClassifier" if data_modality == "text" else "TimmClassifier"
            raise ConfigError(
                f"{source_class.__name__} holds {data_modality} samples but model.network is {network_class.__name__}, "
                f"a {network_modality} model. To fix it: choose a {network_modality} source, or a network for "
                f"{data_modality} (loko_lightning.models.{fits}).",
                field="source",
                owner=StreamDataModule,
            )

    def _run_subcommand(self, subcommand: str) -> None:
        """Run it; under DDP, a collective failing because another process is gone becomes a :class:`LostProcessError`.

        Lightning has already stopped this process's part of the run when the error reaches here; the processes it
        started on this node are killed (one that hangs would otherwise outlive this one).
        """
        with self._naming_errors(), ignore_intended_warnings(), warnings.catch_warnings():
            if subcommand != "fit":  # the callbacks' saved states only matter to a resumed fit
                warnings.filterwarnings("ignore", message=r"Be aware that when using `ckpt_path`, callbacks used")
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
            if err.owner is None and err.field in inspect.signature(StreamDataModule.__init__).parameters:
                # Raised while the stream is read (a label, the data ending before max_samples): the data module's.
                err.owner = StreamDataModule
            owner_key = getattr(self, "_owner_keys", {}).get(err.owner) if err.owner is not None else None
            # A setting inside an argument (the time update's p_floor): the argument's flag.
            field = getattr(err.owner, "moved_arguments", {}).get(err.field, err.field)
            key = ".".join(part for part in (owner_key, field) if part) or None
            err.key = next((s.replace(".init_args", "") for s, t in LINKS if t == key), key)
            if err is not caught:
                raise err from None
            raise

    def _known_keys(self, parser: Any) -> list[str]:
        parsers = [parser, *getattr(self, "_subcommand_parsers", {}).values()]
        return sorted({a.dest for p in parsers for a in p._actions if a.dest and a.dest != "help"})

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """The trainer, with checkpoints written atomically unless another checkpoint IO was configured."""
        trainer = super().instantiate_trainer(**kwargs)
        strategy = trainer.strategy
        if type(strategy.checkpoint_io) is TorchCheckpointIO:
            strategy.checkpoint_io = AtomicCheckpointIO()
        return trainer


# The source options that change what a sample becomes (and that a checkpoint's ``preprocessing`` records).
PREPROCESSING_OPTIONS = ("image_size", "mean", "std", "max_length")


def _split_mixture_flags(args: list[str]) -> tuple[list[str], list[str]]:
    """``args`` without the flags of the mixture's options, and those flags in their order.

    A flag is ``--model.mixture.init_args.<key>``, with ``=value`` or the next argument as its value.
    """
    rest: list[str] = []
    flags: list[str] = []
    position = 0
    while position < len(args):
        arg = args[position]
        taken = rest
        if arg.startswith("--model.mixture.init_args."):
            taken = flags
            if "=" not in arg and position + 1 < len(args):  # its value is the next argument
                flags.append(arg)
                position += 1
                arg = args[position]
        taken.append(arg)
        position += 1
    return rest, flags


def _flags_given(args: list[str], prefix: str, names: tuple[str, ...]) -> list[str]:
    """Which of ``names`` were set by a flag under ``prefix`` (``--data.source.image_size``, ``...init_args...``)."""
    given = []
    for arg in args:
        key = arg[2:].partition("=")[0].replace(".init_args.", ".") if arg.startswith("--") else ""
        section, _, name = key.rpartition(".")
        if section == prefix and name in names and name not in given:
            given.append(name)
    return given


def _num_classes(config: Any) -> int | None:
    """The configured network's ``num_classes``, if it has one."""
    network = config.get("model.network") if config is not None else None
    return getattr(getattr(network, "init_args", None), "num_classes", None)


def _saved_value(saved: dict[str, Any], name: str) -> Any:
    """The value of source option ``name`` that a checkpoint's ``preprocessing`` records, or ``None``."""
    if name == "image_size":
        size = saved.get("input_size")
        return size[-1] if size and size[-1] == size[-2] else size
    return saved.get(name)


def _same(value: Any, saved: Any) -> bool:
    if isinstance(value, (list, tuple)) and isinstance(saved, (list, tuple)):
        return [float(a) for a in value] == [float(b) for b in saved]
    return value == saved


def _shown(value: Any) -> str:
    return str(list(value)) if isinstance(value, (list, tuple)) else str(value)


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
