"""The ``loko`` command: LightningCLI over :class:`OnlineClassifier` and :class:`StreamDataModule`.

``loko fit --config configs/cifar10_resnet18.yaml`` runs one online pass; ``validate``/``test`` evaluate on the
held-out split; ``--print_config`` shows the full resolved configuration.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from lightning.pytorch.cli import LightningCLI

from loko_lightning.data import StreamDataModule
from loko_lightning.module import OnlineClassifier

# Errors whose message already says what to change; anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, FileNotFoundError, RuntimeError)


class LoKOCLI(LightningCLI):
    """LightningCLI with the data preprocessing and label range tied to the model."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        """The stream is preprocessed for the backbone and its labels are checked against the head size."""
        parser.link_arguments("model.backbone", "data.backbone")
        parser.link_arguments("model.num_classes", "data.num_classes")


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``loko`` console script.

    Configuration errors (unknown backbone, missing data, bad hyperparameters, ...) end with a one-line message
    and exit status 2; set ``LOKO_TRACEBACK=1`` to see the full traceback.
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
        )
    except USER_ERRORS as err:
        if os.environ.get("LOKO_TRACEBACK") or not _is_user_error(err):
            raise
        print(f"loko: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def _is_user_error(err: BaseException) -> bool:
    """Our own messages name the field or the fix; torch's internal RuntimeErrors do not and keep a traceback."""
    if isinstance(err, RuntimeError):
        return str(err).startswith(("model.", "data."))
    return True


if __name__ == "__main__":
    main()
