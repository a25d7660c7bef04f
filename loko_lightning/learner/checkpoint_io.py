"""Checkpoints that survive a crash, written atomically; a torn file named in one line; a learner read back safely.

A run killed at any moment (even with SIGKILL during a checkpoint write) leaves the previous checkpoint intact, so
``loko fit --config ... --ckpt_path last`` continues from the newest one with the parameters, the filter state, the
online metrics, the RNG states and the stream position restored. :func:`load_learner` reads a checkpoint's learner
without running code from the file (``loko export``, ``loko serve``).
"""

from __future__ import annotations

import glob
import os
import pickle
import secrets
import zipfile
from pathlib import Path
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO

from loko_lightning.errors import ConfigError
from loko_lightning.learner.module import OnlineClassifier


class AtomicCheckpointIO(TorchCheckpointIO):
    """Torch checkpoints written to a temporary file beside the target, flushed to disk, then renamed over it.

    Lightning's own write goes through a temporary file in the system temp folder and ``shutil.move``, which copies
    (not atomically) when that folder is on another file system than the checkpoints. A rename within one folder is
    atomic, so a reader (or a restart after a crash) sees either the old checkpoint or the new one, never part of one.
    Remote paths (``s3://``, ...) keep Lightning's handling.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` to ``path`` atomically (local paths)."""
        if storage_options is not None or not isinstance(get_filesystem(path), LocalFileSystem):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        # Same folder (a rename across file systems would copy), a dot name (never taken for a checkpoint), and the
        # permissions of an ordinary new file.
        prefix = f".{target.name}."
        partial = target.parent / f"{prefix}{os.getpid()}-{secrets.token_hex(4)}.partial"
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, "wb") as handle:
                torch.save(checkpoint, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
        for stale in target.parent.glob(f"{glob.escape(prefix)}*.partial"):  # left by a run killed mid-write
            stale.unlink(missing_ok=True)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint; an unreadable (truncated) file is named in a one-line error."""
        kwargs = {} if map_location is None else {"map_location": map_location}
        try:
            return super().load_checkpoint(path, weights_only=weights_only, **kwargs)
        except (RuntimeError, EOFError) as err:
            if "zip archive" not in str(err) and not isinstance(err, EOFError):
                raise
            raise unreadable_checkpoint(path, err) from err


def check_readable(path: str | os.PathLike) -> None:
    """Refuse a local checkpoint file that torch cannot load, before anything reads its hyperparameters.

    Raises:
        ConfigError: ``path`` is a file but not a loadable checkpoint (``field="ckpt_path"``).
    """
    if not Path(path).is_file() or zipfile.is_zipfile(path):
        return
    try:  # torch.save writes zip archives; anything else loads only if it is an old-format checkpoint
        torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # not a zip archive: not a torch checkpoint, or a torn one (not refused content)
        raise unreadable_checkpoint(path, RuntimeError(str(err))) from None


def unreadable_checkpoint(path: Any, err: BaseException) -> ConfigError:
    """The one-line error for a checkpoint file that does not load (``err``: what torch said)."""
    if isinstance(err, pickle.UnpicklingError):
        return ConfigError(
            f"{path} holds objects that loading without running code (torch.load with weights_only=True) refuses "
            f"({' '.join(str(err).split())[-160:]}); loko never runs code from a checkpoint. To fix it: pass a "
            "checkpoint written by loko fit.",
            field="ckpt_path",
        )
    return ConfigError(
        f"{path} is not a readable checkpoint ({' '.join(str(err).split())[:200]}): it is not a torch "
        "checkpoint, or it was cut short while being written or copied. To fix it: pass an earlier checkpoint of "
        "that folder, or start "
        "without ckpt_path.",
        field="ckpt_path",
    )


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
