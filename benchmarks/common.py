"""What the benchmark scripts share: building a run from ``loko`` configs, fitting it while recording every step.

A run is the training of ``loko fit`` with the same configs and overrides, built by the package's own CLI
(:class:`BenchmarkCLI`, a :class:`~loko_lightning.cli.LoKOCLI` with ``run=False``) and set for measuring:

- trainer: no logger, no checkpoints, no progress bar, no model summary, no validation, one epoch on one device,
  scratch ``default_root_dir`` (where the divergence guard saves its last good state);
- callbacks: only the config's :class:`~loko_lightning.learner.DivergenceGuard` is kept (checkpoints and the
  end-of-run report have no use here), with a frozen-head mixture or an LDA head (they change what the learner
  predicts), and :class:`StepRecorder` is added;
- a learning-rate scheduler with a ``total_iters`` argument (the AdamW baseline's ``LinearLR``) runs over the
  stream's length in steps (samples / ``data.batch_size``), so the paper's linear decay ends with the stream; an
  optimizer with an effective sample size ``ess`` (IVON) gets the stream's samples;
- :class:`~loko_lightning.LoKO` draws ``p̂₀`` from its own generator seeded with the run's seed (unless the config
  sets ``seed``). The learner checks its optimizer on a stand-in parameter before it builds the network; from the
  global RNG, LoKO's draw in that check would shift the network's initialisation. With its own generator nothing
  draws from the global RNG before the network is built, so every optimizer's adapters and head are initialised
  from the same ``seed_everything`` state.

The scripts live in ``benchmarks/``, which Python puts on ``sys.path`` when one of them runs: they import this
module as ``common``.
"""

from __future__ import annotations

import contextlib
import csv
import importlib
import inspect
import logging
import math
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from jsonargparse import Namespace
from lightning.pytorch.cli import instantiate_class

from loko_lightning import LoKO
from loko_lightning.cli import LoKOCLI
from loko_lightning.data import StreamDataModule
from loko_lightning.errors import DivergenceError
from loko_lightning.learner.callbacks import DivergenceGuard
from loko_lightning.learner.lda_head import LDAHead
from loko_lightning.learner.module import OnlineClassifier
from loko_lightning.learner.steps import nested_steps

ROOT = Path(__file__).resolve().parents[1]
BASELINES = ROOT / "configs" / "baselines"
# Shown in the results' setting line even at their default values (the rest only where they differ from it).
MAIN_HYPERPARAMETERS = ("p0", "p0_init", "filter", "time_update", "lr", "weight_decay", "betas", "total_iters")
# What a benchmark run changes in the trainer: nothing written, nothing shown, no evaluation, one pass, one device.
TRAINER_OVERRIDES = (
    "--trainer.logger=false",
    "--trainer.enable_checkpointing=false",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.limit_val_batches=0",
    "--trainer.num_sanity_val_steps=0",
    "--trainer.max_epochs=1",
    "--trainer.devices=1",
)


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """A script's own arguments and the ``loko`` overrides after ``--``."""
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


def option_groups(overrides: Sequence[str]) -> list[list[str]]:
    """``loko`` overrides grouped per option: ``["--a", "1", "--b=2"]`` -> ``[["--a", "1"], ["--b=2"]]``."""
    groups: list[list[str]] = []
    for token in overrides:
        if token.startswith("--") or not groups:
            groups.append([token])
        else:
            groups[-1].append(token)
    return groups


def config_args(configs: Iterable[Path | str]) -> list[str]:
    """``--config`` arguments for each file, in order (a later file overrides an earlier one).

    Paths inside the working directory are written relative to it, as a user would type them.
    """
    args = []
    for path in configs:
        path = Path(path)
        if path.is_absolute() and path.is_relative_to(Path.cwd()):
            path = Path(os.path.relpath(path))
        args += ["--config", str(path)]
    return args


def _import(class_path: str) -> Any:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _is_subclass(value: Any, base: type) -> bool:
    """Whether a configured class (a ``class_path`` namespace or a class) is ``base`` or derives from it."""
    cls = value
    if isinstance(value, Namespace):
        try:
            cls = _import(value.class_path)
        except (ImportError, AttributeError, ValueError):
            return False
    return isinstance(cls, type) and issubclass(cls, base)


class BenchmarkCLI(LoKOCLI):
    """The ``loko`` CLI set for a benchmark run (see the module docstring): built, not run.

    Args:
        *args: passed to :class:`~loko_lightning.cli.LoKOCLI`.
        guard_every: if given, the divergence guard checks every this many samples (a guard with its defaults is
            added if the config has none; 0 disables it).
        **kwargs: passed to :class:`~loko_lightning.cli.LoKOCLI`.

    Attributes:
        resolved: the values this class set in the configuration, by ``loko`` flag (``model.optimizer.seed``,
            ``model.lr_scheduler.total_iters``): with the run's arguments they make its ``loko fit`` command.
    """

    def __init__(self, *args: Any, guard_every: int | None = None, **kwargs: Any) -> None:
        self.guard_every = guard_every
        self.resolved: dict[str, Any] = {}
        self._set_up: StreamDataModule | None = None
        super().__init__(*args, **kwargs)

    def before_instantiate_classes(self) -> None:
        """Keep the divergence guard (an LDA head), seed LoKO's ``p̂₀``, fit a scheduler, IVON's ``ess``."""
        config = self.config
        callbacks = config.trainer.callbacks or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        guards = [c for c in callbacks if _is_subclass(c, DivergenceGuard)]
        if self.guard_every is not None:
            if not guards:
                guards = [Namespace(class_path=f"{DivergenceGuard.__module__}.DivergenceGuard", init_args=Namespace())]
            guards[0].init_args.check_every = self.guard_every
        # The LDA head changes what the learner predicts: a run keeps it (the mixture is the learner's own option).
        kept = [c for c in callbacks if _is_subclass(c, LDAHead)]
        config.trainer.callbacks = guards + kept
        optimizer = config.model.optimizer
        if _is_subclass(optimizer, LoKO):
            if not isinstance(optimizer, Namespace):  # the class itself: LoKO with its defaults
                optimizer = config.model.optimizer = Namespace(
                    class_path=f"{optimizer.__module__}.{optimizer.__name__}", init_args=Namespace()
                )
            if optimizer.init_args.get("seed") is None:
                optimizer.init_args.seed = config.seed_everything
                self.resolved["model.optimizer.seed"] = config.seed_everything
        scheduler = config.model.lr_scheduler
        if isinstance(scheduler, Namespace) and "total_iters" in scheduler.get("init_args", Namespace()):
            # One scheduler step per training step: B samples (data.batch_size) make one step.
            stream = self._stream()
            scheduler.init_args.total_iters = math.ceil(stream.stream_length / stream.batch_size)
            self.resolved["model.lr_scheduler.total_iters"] = scheduler.init_args.total_iters
        if isinstance(optimizer, Namespace) and "ess" in optimizer.get("init_args", Namespace()):
            # IVON's effective sample size: the samples its posterior is for, the stream's (as its authors set it to
            # the training set's size).
            optimizer.init_args.ess = self._stream().stream_length
            self.resolved["model.optimizer.init_args.ess"] = optimizer.init_args.ess
        super().before_instantiate_classes()

    def _stream(self) -> StreamDataModule:
        """The run's data module, set up once (the stream's length is known once its data is loaded)."""
        if self._set_up is None:
            config = self.config
            network = instantiate_class((), config.model.network.as_dict())  # cheap: builds nothing
            data = config.data.as_dict()
            for name in ("source", "perturbation"):  # configured classes: {"class_path": ..., "init_args": ...}
                if isinstance(data.get(name), dict):
                    data[name] = instantiate_class((), data[name])
            self._set_up = StreamDataModule(**{**data, "preprocessing": network.preprocessing()})
            self._set_up.prepare_data()
            self._set_up.setup("fit")
        return self._set_up

    def instantiate_classes(self) -> None:
        """Instantiate; a data module already set up above (same configuration) replaces the new one: one load."""
        super().instantiate_classes()
        if self._set_up is not None:
            self.datamodule = self._set_up


def build(
    args: Sequence[str], *, callbacks: Sequence[pl.Callback] = (), guard_every: int | None = None
) -> BenchmarkCLI:
    """The learner, data module and trainer of one run, from ``loko`` arguments (``--config ...`` and overrides).

    Args:
        args: ``loko fit`` arguments, without the subcommand.
        callbacks: added to the trainer (after the config's divergence guard).
        guard_every: see :class:`BenchmarkCLI`.

    Raises:
        SystemExit: a configuration error, as one line naming the flag.
    """
    try:
        with warnings.catch_warnings():
            # The CLI is given its arguments while a script has its own on sys.argv: intended here.
            warnings.filterwarnings("ignore", message=r".*LightningCLI's args parameter is intended.*")
            return BenchmarkCLI(
                OnlineClassifier,
                StreamDataModule,
                args=[*args, *TRAINER_OVERRIDES],
                run=False,
                guard_every=guard_every,
                subclass_mode_model=False,
                subclass_mode_data=False,
                save_config_callback=None,
                trainer_defaults={"callbacks": list(callbacks)},
                parser_kwargs={"exit_on_error": False},
            )
    except (ValueError, FileNotFoundError) as err:
        key = getattr(err, "key", None) or getattr(err, "field", None)
        where = f"--{key}: " if key else ""
        raise SystemExit(f"{Path(sys.argv[0]).name}: error: {where}{' '.join(str(err).split())}") from None


class StepRecorder(pl.Callback):
    """Copy the prequential metrics that :class:`OnlineClassifier` logs into Python lists, every step.

    A few Python float conversions of ``trainer.callback_metrics`` per step, no extra forward pass.

    Args:
        print_every: print a progress line every this many steps (0: never).
        label: prefix of the progress lines.
    """

    FIELDS = ("online_acc", "recent_acc", "loss_avg", "ce_avg", "step_time", "nll", "nll_recent", "ece", "ece_recent")

    def __init__(self, print_every: int = 0, label: str = "") -> None:
        self.print_every = print_every
        self.label = label
        self.window = 0
        self.keys: dict[str, str] = {}
        self.rows: dict[str, list[float]] = {name: [] for name in self.FIELDS}
        self.samples: list[int] = []
        self.selection: str | None = None
        self.reliability: list[list[float]] = []
        self.started = time.perf_counter()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Name the logged keys after the learner's moving-average window."""
        self.window = pl_module.hparams.window
        self.keys = {
            "online_acc": "train/online_acc",
            "recent_acc": f"train/online_acc_recent{pl_module.hparams.recent_window}",
            "loss_avg": f"train/loss_avg{self.window}",
            "ce_avg": f"train/ce_avg{self.window}",
            "step_time": "train/step_time",
            "nll": "train/nll",
            "nll_recent": f"train/nll_recent{pl_module.hparams.recent_window}",
            "ece": "train/ece",
            "ece_recent": f"train/ece_recent{pl_module.hparams.recent_window}",
        }
        self.started = time.perf_counter()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Keep what an online selection (``select``, ``p0: auto``) chose."""
        # A SelectionStep's candidates, inside a mixture if there is one.
        steps = nested_steps(getattr(pl_module, "online_step", None))
        states = next((step.states for step in steps if getattr(step, "states", None) is not None), None)
        if states is not None:
            self.selection = states.summary()
        ece = getattr(pl_module, "ece", None)
        if ece is not None:  # the reliability diagram's bins: predictions, summed confidence, summed hits
            self.reliability = [[float(v) for v in values] for values in ece.bins()]

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Append this step's values (NaN where the learner logged none)."""
        metrics = trainer.callback_metrics
        for name, key in self.keys.items():
            value = metrics.get(key)
            self.rows[name].append(float(value) if value is not None else math.nan)
        self.samples.append((self.samples[-1] if self.samples else 0) + len(batch["label"]) * trainer.world_size)
        step = len(self.rows["online_acc"])
        if self.print_every and step % self.print_every == 0:
            print(
                f"{self.label} step {step}: online acc {100 * self.rows['online_acc'][-1]:.2f}%, "
                f"L1 avg {self.rows['loss_avg'][-1]:.3f}, {time.perf_counter() - self.started:.0f} s",
                flush=True,
            )


@dataclass
class RunResult:
    """Per-step metrics and outcome of one run.

    Attributes:
        online_acc: average online top-1 accuracy after each step.
        loss_avg: moving-average L1 loss after each step.
        ce_avg: moving-average cross-entropy after each step.
        step_time: the learner's time for each step, in seconds.
        window: the moving-average window.
        wall_s: wall time of the fit.
        diverged: why the run stopped early (divergence guard, non-finite metrics), else ``None``.
        num_classes: the network's number of classes.
        command: the ``loko fit`` arguments whose training this run is (the trainer settings aside).
        setting: what was run, in words.
        recent_acc: online accuracy of the last ``recent_window`` predictions (the learner's) after each step.
        samples: samples seen after each step (a step takes ``data.batch_size`` samples per process).
        selection: what an online selection (``select``, ``p0: auto``) chose and the candidates' scores, else None.
        nll, nll_recent: the prequential negative log-likelihood over the stream and the recent window, each step.
        ece, ece_recent: the expected calibration error (15 bins) over the stream and the recent window, each step.
        reliability: at the end, per confidence bin: the predictions, their summed confidence, their summed hits.
    """

    online_acc: list[float]
    loss_avg: list[float]
    ce_avg: list[float]
    step_time: list[float]
    window: int
    wall_s: float
    diverged: str | None = None
    num_classes: int = 0
    command: list[str] = field(default_factory=list)
    setting: dict[str, str] = field(default_factory=dict)
    recent_acc: list[float] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    selection: str | None = None
    nll: list[float] = field(default_factory=list)
    nll_recent: list[float] = field(default_factory=list)
    ece: list[float] = field(default_factory=list)
    ece_recent: list[float] = field(default_factory=list)
    reliability: list[list[float]] = field(default_factory=list)

    @property
    def steps(self) -> int:
        """Number of recorded steps."""
        return len(self.online_acc)


def fit(
    args: Sequence[str],
    *,
    print_every: int = 0,
    label: str = "",
    guard_every: int | None = None,
    callbacks: Sequence[pl.Callback] = (),
) -> RunResult:
    """Build one run with :func:`build` and train it for one online pass, recording every step.

    Args:
        args: ``loko fit`` arguments, without the subcommand.
        print_every: progress line every this many steps (0: none).
        label: prefix of the progress lines.
        guard_every: see :class:`BenchmarkCLI`.
        callbacks: more callbacks for the trainer (after the recorder), e.g. to measure something else per step.

    Returns:
        The recorded metrics; ``diverged`` says why the run stopped if the divergence guard stopped it or a metric
        became non-finite (a divergence is a result here, not an error).
    """
    recorder = StepRecorder(print_every, label)
    scratch = tempfile.mkdtemp(prefix="loko-benchmark-")
    try:
        cli = build(
            [*args, f"--trainer.default_root_dir={scratch}"], callbacks=[recorder, *callbacks], guard_every=guard_every
        )
        model, trainer = cli.model, cli.trainer
        command = [*args, *(f"--{key}={value}" for key, value in cli.resolved.items())]
        start = time.perf_counter()
        diverged = None
        try:
            trainer.fit(model, datamodule=cli.datamodule)
        except DivergenceError as err:
            diverged = _divergence_reason(str(err))
        wall = time.perf_counter() - start
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows = recorder.rows
    if diverged is None and not all(math.isfinite(v) for v in rows["online_acc"] + rows["loss_avg"]):
        diverged = "non-finite online accuracy or loss"
    return RunResult(
        rows["online_acc"],
        rows["loss_avg"],
        rows["ce_avg"],
        rows["step_time"],
        window=model.hparams.window,
        wall_s=wall,
        diverged=diverged,
        num_classes=model.num_classes,
        command=command,
        setting=describe(cli),
        recent_acc=rows["recent_acc"],
        samples=recorder.samples,
        selection=recorder.selection,
        nll=rows["nll"],
        nll_recent=rows["nll_recent"],
        ece=rows["ece"],
        ece_recent=rows["ece_recent"],
        reliability=recorder.reliability,
    )


def _divergence_reason(message: str) -> str:
    """The divergence guard's message without where it saved the last good state (a scratch folder here)."""
    for tail in (" The parameters and filter state", " No good state was recorded"):
        message = message.split(tail)[0]
    return " ".join(message.split())


def describe(cli: LoKOCLI) -> dict[str, str]:
    """The network, data and optimizer of a built run, in words (for the results files)."""
    source = cli.datamodule.source
    config = cli.config.model
    factory = cli.model.network_factory
    return {
        "backbone": getattr(factory, "backbone", type(factory).__name__),
        "dataset": source.name,
        "modality": source.modality,
        # What a sample is cut to: the image size, or a text's token budget.
        "image_size": f"max {source.max_length} tokens"
        if source.modality == "text"
        else f"{getattr(source, 'image_size', None) or 'native'} px",
        "network": repr(factory),
        "adapters": _arguments(config.network, ("r", "alpha", "use_dora", "head_init", "dropout")),
        "optimizer": _configured(config.optimizer)
        + (
            f", {cli.model.select.name} chosen online among {list(cli.model.select.values)} on the first "
            f"{cli.model.select.samples} samples"
            if cli.model.select is not None
            else ""
        ),
        "lr_scheduler": _configured(config.lr_scheduler) if config.lr_scheduler is not None else "none",
        "window": str(cli.model.hparams.window),
    }


def _configured(value: Any) -> str:
    """``Name(arg=value, ...)`` of a configured class: main hyperparameters, arguments not at default (no seed)."""
    if not isinstance(value, Namespace):
        return getattr(value, "__name__", repr(value))
    try:
        parameters = inspect.signature(_import(value.class_path)).parameters
    except (ImportError, AttributeError, ValueError, TypeError):
        parameters = {}
    init_args = (value.get("init_args") or Namespace()).as_dict()
    shown = [
        f"{name}={arg}"
        for name, arg in init_args.items()
        if name != "seed"
        and (name in MAIN_HYPERPARAMETERS or name not in parameters or parameters[name].default != arg)
    ]
    return f"{value.class_path.rpartition('.')[2]}({', '.join(shown)})"


def _arguments(value: Any, names: Iterable[str]) -> str:
    init_args = value.get("init_args") if isinstance(value, Namespace) else None
    if init_args is None:
        return ""
    return ", ".join(f"{k}={v}" for k, v in init_args.as_dict().items() if k in names and v is not None)


def set_threads(threads: int | None) -> None:
    """``torch.set_num_threads`` (``None``: torch's default)."""
    if threads:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def quiet(verbose: bool) -> Iterator[None]:
    """Silence Lightning's per-run chatter (unless ``verbose``) and two harmless warnings, restoring both after.

    Restored because the scripts' ``main`` is also called in-process (tests, notebooks): logger levels and warning
    filters are process-wide, and leaving Lightning at WARNING would hide the ``loko`` CLI's own report afterwards.
    """
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric", "lightning")]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
        # The CLI is given its arguments while the script has its own on sys.argv: intended here.
        warnings.filterwarnings("ignore", message=r".*LightningCLI's args parameter is intended.*")
        if not verbose:
            for logger in loggers:
                logger.setLevel(logging.WARNING)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels, strict=True):
                logger.setLevel(level)


def write_csv(path: Path, fields: Sequence[str], rows: Iterable[Sequence[Any] | dict[str, Any]]) -> None:
    """A CSV file with a header; rows are sequences in ``fields`` order or dicts keyed by them."""
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(fields)
        for row in rows:
            writer.writerow([row[name] for name in fields] if isinstance(row, dict) else row)
