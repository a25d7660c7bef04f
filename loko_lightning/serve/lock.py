"""A state folder's files, its one owner, and the base checkpoint it was started from.

One owner per state folder: an exclusive ``flock`` on ``STATE_DIR/lock``, held for the owner's life. Two servers
appending to one feedback log would hand out the same ``seq`` twice and damage the log for both. The lock is taken
before the folder is read and released when the owner closes it or its process ends (the kernel drops an ``flock``
with the last descriptor, so a SIGKILLed server leaves no lock behind, only the file with its old pid).
:func:`check_base` records the checkpoint a folder was started from and refuses another one.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path

from loko_lightning.errors import ConfigError

LOCK_NAME = "lock"
CHECKPOINT_NAME = "learner.ckpt"
LOG_NAME = "feedback.log"
# The base checkpoint a state folder was started from, by hash: another one is refused.
BASE_NAME = "base.json"


class StateLock:
    """The exclusive lock of a state folder, with the holder's pid written in the lock file.

    Args:
        folder: the state folder (created when missing).

    Raises:
        ConfigError: (field ``state_dir``) another process (or another service in this one) holds the folder; the
            message names its pid.
    """

    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder) / LOCK_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(self._fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._fd)
            self._fd = -1
            raise ConfigError(
                f"the state folder {str(self.path.parent)!r} is in use by pid {holder} (another loko serve owns its "
                "feedback log): stop that server, or give this one another --state_dir",
                field="state_dir",
            ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    @property
    def held(self) -> bool:
        """Whether this object still holds the lock."""
        return self._fd >= 0

    def release(self) -> None:
        """Give the folder up (the lock file stays; its pid is stale once released)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def check_base(ckpt_path: str | Path, state_dir: str | Path) -> None:
    """Record the base checkpoint's SHA-256 in a new state folder; refuse another base for an existing one.

    Raises:
        ConfigError: (field ``ckpt_path``) the folder was started from a checkpoint with another hash.
    """
    digest = hashlib.sha256()
    with open(ckpt_path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    sha256 = digest.hexdigest()
    path = Path(state_dir) / BASE_NAME
    if path.is_file():
        recorded = json.loads(path.read_text(encoding="utf-8"))
        if recorded.get("ckpt_sha256") != sha256:
            raise ConfigError(
                f"the state folder {str(state_dir)!r} was started from another checkpoint ({recorded.get('ckpt_path')}"
                f", sha256 {str(recorded.get('ckpt_sha256'))[:12]}...), not {str(ckpt_path)!r} (sha256 "
                f"{sha256[:12]}...): serve that checkpoint, or give another --state_dir for this one",
                field="ckpt_path",
            )
        return
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps({"ckpt_sha256": sha256, "ckpt_path": str(ckpt_path)}) + "\n", encoding="utf-8")
    with open(temporary, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(temporary, path)
