"""The feedback log: every accepted labelled sample, appended and flushed to disk before it is acknowledged.

One JSON object a line, numbered from 1 (``seq``), ending with the CRC-32 of the rest of the line (``"crc"``, 8 hex
digits), so that a line changed after it was written (a disk error, a hand edit that is still valid JSON) is refused
naming its line instead of being learned. A process killed in the middle of an append leaves at most one partial last
line, which was never acknowledged: it is cut off when the log is opened again. A log written before records had a
checksum is read as it is (its records have none).
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from loko_lightning.errors import ConfigError

# A record's line ends with this, then 8 hex digits of the CRC-32 of the record without it, then '"}' and a newline.
CRC_KEY = b',"crc":"'
CRC_TAIL = len(CRC_KEY) + 8 + 3


class FeedbackLog:
    """An append-only log of JSON records, each on disk (``fsync``) when :meth:`append` returns.

    Args:
        path: the log file; created (with its folder) when missing, its torn last line (if any) cut off.

    Example:
        >>> log = FeedbackLog(folder / "feedback.log")  # doctest: +SKIP
        >>> log.append({"input": "a text", "label": 1})  # doctest: +SKIP
        1
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        created = not self.path.exists()
        self.count = self._recover()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._size = os.fstat(self._fd).st_size
        if created:  # the new file's name is on disk too
            _fsync_folder(self.path.parent)

    def _recover(self) -> int:
        """Cut a partial last line off (a write the process did not finish); the number of whole records."""
        if not self.path.exists():
            return 0
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            with open(self.path, "r+b") as handle:
                handle.truncate(end)
                handle.flush()
                os.fsync(handle.fileno())
        return sum(1 for _ in self.records())

    def records(self, after: int = 0) -> Iterator[dict[str, Any]]:
        """The records with ``seq > after``, in order.

        Raises:
            ConfigError: (field ``state_dir``) a line that is not a record, or records out of order.
        """
        checksummed = None  # whether the log's records carry a checksum: as its first one does
        with open(self.path, "rb") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.endswith(b"\n"):
                    return  # an append in progress (another thread): not acknowledged yet
                payload, crc = _split_crc(line)
                if checksummed is None:
                    checksummed = crc is not None
                if checksummed and (crc is None or zlib.crc32(payload) != crc):
                    raise ConfigError(
                        f"the feedback log {self.path} is damaged at line {number} (its checksum does not match: the "
                        "line changed after it was written): restore the log from a copy, or serve with another "
                        "state_dir",
                        field="state_dir",
                    )
                try:
                    record = json.loads(payload)
                    ok = isinstance(record, dict) and record.get("seq") == number
                except ValueError:
                    ok = False
                if not ok:
                    raise ConfigError(
                        f"the feedback log {self.path} is damaged at line {number} (not record {number}): restore it "
                        "from a copy, or serve with another state_dir",
                        field="state_dir",
                    )
                if number > after:
                    yield record

    def append(self, record: dict[str, Any]) -> int:
        """Append ``record`` (JSON values) as the next one, on disk when this returns; its ``seq``."""
        seq = self.count + 1
        payload = json.dumps({"seq": seq, **record}, separators=(",", ":"), ensure_ascii=False).encode()
        line = payload[:-1] + CRC_KEY + b"%08x" % zlib.crc32(payload) + b'"}\n'
        view = memoryview(line)
        try:
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
            os.fsync(self._fd)
        except OSError:  # disk full, ...: the record is not accepted, and the next one starts a whole line
            os.ftruncate(self._fd, self._size)
            raise
        self._size += len(line)
        self.count = seq
        return seq

    def close(self) -> None:
        """Close the file (appending afterwards is an error)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _split_crc(line: bytes) -> tuple[bytes, int | None]:
    """A line's record as it was checksummed and its checksum; ``(line, None)`` for a line without one."""
    start = len(line) - CRC_TAIL
    if start < 1 or line[start : start + len(CRC_KEY)] != CRC_KEY or not line.endswith(b'"}\n'):
        return line, None
    try:
        crc = int(line[start + len(CRC_KEY) : -3], 16)
    except ValueError:
        return line, None
    return line[:start] + b"}", crc


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
