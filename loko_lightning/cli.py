"""The ``loko`` command: LightningCLI over :class:`OnlineClassifier` and :class:`StreamDataModule`.

``loko fit --config configs/cifar10_resnet18.yaml`` runs one online pass; ``validate``/``test`` evaluate on the
held-out split; ``--print_config`` shows the full resolved configuration. ``--ckpt_path last`` continues from the
newest checkpoint (written atomically, :mod:`loko_lightning.learner.checkpoint_io`), or starts from scratch when there
is none yet, so one command serves for the first start and restarts.

Exit status: 0 on success; 2 for a configuration or input error (one line ``loko: error: --<key>: <what to change>``
on stderr); 3 when the run diverged (the message names the ``p0`` to try and where the last good state is saved).

Library code raises :class:`~loko_lightning.errors.ConfigError` naming the argument and the class that took it; this
module alone knows where that class sits in the configuration (``model.network``, ``model.optimizer``, ``data``) and
writes the flag.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import inspect
import os
import re
import sys
from argparse import ArgumentError
from collections.abc import Iterator
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.io import TorchCheckpointIO

from loko_lightning.data import SOURCES, StreamDataModule
from loko_lightning.errors import ConfigError, DivergenceError
from loko_lightning.learner.checkpoint_io import AtomicCheckpointIO, check_readable
from loko_lightning.learner.module import OnlineClassifier, ignore_intended_warnings

# Errors whose message says what to change; anything else (a RuntimeError from torch, ...) is a bug and keeps its
# traceback.
USER_ERRORS = (ValueError, FileNotFoundError, ArgumentError, DivergenceError)
# The data module's preprocessing and label check follow the network: (source, target) links; an error about a
# target names the source's flag, which is the one a user sets.
LINKS = (
    ("model.network.init_args.backbone", "data.backbone"),
    ("model.network.init_args.num_classes", "data.num_classes"),
)
EXIT_USER_ERROR = 2
EXIT_DIVERGED = 3


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
        """The stream is preprocessed for the network's backbone and its labels are checked against the head size."""
        for source, target in LINKS:
            parser.link_arguments(source, target)

    def parse_arguments(self, parser: Any, args: Any) -> None:
        """Parse; an unknown or ill-typed option becomes one ``ValueError`` line naming the close valid keys."""
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as err:
            raise ValueError(_argument_message(str(err), self._known_keys(parser))) from None
        # LightningCLI reads the hyperparameters of a ckpt_path file next, with a bare torch error for a torn file.
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path:
            check_readable(ckpt_path)

    def before_instantiate_classes(self) -> None:
        """Remember which configuration key each configured class sits at, to name a bad argument's flag."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        self._owner_keys: dict[type, str] = {}
        for key, class_path in _class_paths(config):
            with contextlib.suppress(ImportError, AttributeError, ValueError):
                module, _, name = class_path.rpartition(".")
                self._owner_keys.setdefault(getattr(importlib.import_module(module), name), key)
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
                f"(loko_lightning.models.networks.{fits}).",
                field="dataset",
                owner=StreamDataModule,
            )

    def _run_subcommand(self, subcommand: str) -> None:
        with self._naming_errors(), ignore_intended_warnings():
            super()._run_subcommand(subcommand)

    @contextlib.contextmanager
    def _naming_errors(self) -> Iterator[None]:
        try:
            yield
        except (ConfigError, DivergenceError) as err:
            owner_key = getattr(self, "_owner_keys", {}).get(err.owner) if err.owner is not None else None
            key = ".".join(part for part in (owner_key, err.field) if part) or None
            err.key = next((s.replace(".init_args", "") for s, t in LINKS if t == key), key)
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


def _argument_message(message: str, keys: list[str]) -> str:
    """The parser's error on one line, with the valid keys closest to an unknown one."""
    text = " ".join(message.split())
    nested = _nested_argument_message(text)
    if nested:
        return nested
    unknown = re.findall(r"--([\w.]+)", text) if "unrecognized arguments" in text else []
    unknown += re.findall(r"does not accept option '([\w.]+)'", text)
    hints = []
    for key in dict.fromkeys(unknown):
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
    body = "; ".join([text.rstrip("."), *hints])
    help_hint = "See `loko fit --help`" + ("" if unknown else " (or --print_config for the resolved values)")
    return f"{body}{'' if body.endswith('?') else '.'} {help_hint}."


def _nested_argument_message(text: str) -> str | None:
    """Jsonargparse's error about an argument of a configured class (``--model.optimizer.p00``), made short.

    Returns ``None`` if ``text`` is not about such an argument.
    """
    outer = re.match(r'Parser key "([\w.]+)": ', text)
    class_path = re.search(r"class_path[=\s]'([\w.]+)'", text)
    if outer is None or class_path is None:
        return None
    key, class_path = outer.group(1), class_path.group(1)
    unknown = re.search(r"Option '(\w+)' is not accepted", text)
    if unknown:
        name = unknown.group(1)
        try:
            module, _, attr = class_path.rpartition(".")
            options = list(inspect.signature(getattr(importlib.import_module(module), attr)).parameters)
        except (ImportError, AttributeError, ValueError, TypeError):
            options = []
        options = [o for o in options if o not in ("self", "params", "optimizer", "args", "kwargs")]
        close = difflib.get_close_matches(name, options, n=3, cutoff=0.6)
        hint = f"did you mean {' or '.join(repr(c) for c in close)}?" if close else f"its options: {', '.join(options)}"
        return f"--{key}.{name} is not an option of {class_path}; {hint} See `loko fit --help`."
    typed = re.search(r'Parser key "(\w+)": (Expected .*?)\. Got value: (.*?)\. Got value: ', text)
    if typed:
        name, expected, value = typed.groups()
        expected = re.sub(r"<class '(\w+)'>", r"\1", expected)
        return f"--{key}.{name}: {expected[0].lower()}{expected[1:]}, got {value!r}. See `loko fit --help`."
    union = re.search(
        r'Parser key "(\w+)": Does not validate .*?Subtypes: \[(.*?)\] Errors:.*?Given value: (.*?)\. Got', text
    )
    if union:  # e.g. LoKO's p0: a float or 'auto'
        name, subtypes, value = union.groups()
        kinds = [re.sub(r"<class '(\w+)'>", r"a \1", kind) for kind in re.split(r",\s*(?![^\[]*\])", subtypes)]
        kinds = [re.sub(r"typing\.Literal\[(.*)\]", r"\1", kind) for kind in kinds]
        return f"--{key}.{name}: expected {' or '.join(kinds)}, got {value!r}. See `loko fit --help`."
    return None


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``loko`` console script.

    Configuration errors (unknown option or backbone, missing data, bad hyperparameters, ...) end with a one-line
    message and exit status 2, a diverged run with a one-line message and exit status 3; set ``LOKO_TRACEBACK=1`` to
    see the full traceback.
    """
    try:
        LoKOCLI(
            OnlineClassifier,
            StreamDataModule,
            args=args,
            subclass_mode_model=False,
            subclass_mode_data=False,
            save_config_kwargs={"overwrite": True},
            trainer_defaults={"max_epochs": 1, "num_sanity_val_steps": 0},
            # Parse errors raise (and become one line below) instead of printing the whole usage.
            parser_kwargs={"exit_on_error": False},
        )
    except USER_ERRORS as err:
        if os.environ.get("LOKO_TRACEBACK"):
            raise
        key = getattr(err, "key", None) or getattr(err, "field", None)
        where = f"--{key}: " if key else ""
        print(f"loko: error: {where}{' '.join(str(err).split())}", file=sys.stderr)
        raise SystemExit(EXIT_DIVERGED if isinstance(err, DivergenceError) else EXIT_USER_ERROR) from None


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
