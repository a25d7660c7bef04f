"""One owner per state folder: an exclusive ``flock`` on ``STATE_DIR/lock``, held for the owner's life.

Two servers appending to one feedback log would hand out the same ``seq`` twice and damage the log for both. The lock
is taken before the folder is read and released when the owner closes it or its process ends (the kernel drops an
``flock`` with the last descriptor, so a SIGKILLed server leaves no lock behind, only the file with its old pid).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from loko_lightning.errors import ConfigError

LOCK_NAME = "lock"


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
