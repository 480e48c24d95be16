"""One process per data directory: an exclusive ``flock`` on ``DIR/LOCK``, held for the process's life.

Two nodes writing one WAL would each believe its own view is durable; the second must stop before
it opens anything. ``flock`` locks go away with the process (also after SIGKILL), so a stale lock
file never blocks a restart.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

LOCK_NAME = "LOCK"


class DataDirInUse(Exception):
    """Another live process holds the data directory."""


class DataDirUnusable(Exception):
    """The data directory cannot be created or written (a file, no permission, read-only)."""


class DataDirLock:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self._fd: int | None = None

    def acquire(self) -> None:
        d = self.data_dir
        if d.exists() and not d.is_dir():
            raise DataDirUnusable(f"data directory {d} is a file, not a directory")
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DataDirUnusable(f"cannot create data directory {d}: {exc.strerror}") from exc
        if not os.access(d, os.W_OK | os.X_OK):
            raise DataDirUnusable(f"data directory {d} is not writable by this user")
        path = d / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise DataDirUnusable(f"cannot open {path}: {exc.strerror}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_pid(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                who = f"pid {holder}" if holder else "another process"
                raise DataDirInUse(f"data directory {d} is in use by {who}") from exc
            raise DataDirUnusable(f"cannot lock {path}: {exc.strerror}") from exc
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode().strip()
        return int(text) if text.isdigit() else None
    except (OSError, UnicodeDecodeError):
        return None
