"""``main``: the entry point of the ``loko`` console script (and of ``python -m loko_lightning.cli``)."""

from __future__ import annotations

import os
import sys
import tomllib
from argparse import ArgumentError
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from loko_lightning.errors import DivergenceError, LostProcessError

# Errors whose message says what to change; anything else (a RuntimeError from torch, ...) is a bug and keeps its
# traceback.
USER_ERRORS = (ValueError, FileNotFoundError, ArgumentError, DivergenceError)
EXIT_USER_ERROR = 2
EXIT_DIVERGED = 3
EXIT_LOST_PROCESS = 4

DESCRIPTION = (
    "loko: online fine-tuning of pretrained timm and transformers models with LoRA adapters, one sample at a time, "
    "by LoKO (the Low-Rank Kalman Optimizer) or the LoRA/AdamW and LoRA/AdaGrad baselines. "
    "Start with: loko fit --config quickstart (a config shipped in the package, by name; a path works too). "
    "Then: loko predict --config quickstart --ckpt_path CKPT --predictions out.csv; "
    "loko export --ckpt_path CKPT --out DIR [--merge] (see loko export --help); "
    "loko serve --ckpt_path CKPT (predicts, and learns from the labels it is sent; see loko serve --help)."
)


def _version() -> str:
    """The version ``loko --version`` prints.

    The installed distribution's, else the source tree's ``pyproject.toml`` one (a checkout run from PYTHONPATH has no
    distribution metadata), else ``"unknown"``.
    """
    try:
        return version("loko-lightning")
    except PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        try:
            return str(tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["version"])
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "unknown"


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
        # Each command imports what it needs: `loko serve --help` and its refusals answer before torch is imported.
        if args[:1] == ["export"]:
            from loko_lightning.cli.export import export_main

            export_main(args[1:])
            return
        if args[:1] == ["serve"]:
            from loko_lightning.cli.serve import serve_main

            serve_main(args[1:])
            return
        from loko_lightning.cli.command import HelpFormatter, LoKOCLI
        from loko_lightning.cli.configs import resolve_config_names
        from loko_lightning.data import StreamDataModule
        from loko_lightning.learner.module import OnlineClassifier

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
                "version": _version(),
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
