"""One process per data directory: an exclusive ``flock`` on ``DIR/LOCK``, held for the process's life.

Two nodes writing one WAL would each believe its own view is durable; the second must stop before
it opens anything. ``flock`` locks go away with the process (also after SIGKILL), so a stale lock
file never blocks a restart. ``check_private``: no other user of the machine reads the directory.
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


def check_private(data_dir: Path, allow_group: bool) -> str | None:
    """The data directory holds every message: no other user of the machine may read it. A directory
    that exists with access for others (or for its group, unless ``allow_group``) is made private
    (0700, 0750 with ``allow_group``) when it is empty, and refused (DataDirUnusable) when it holds
    anything. Returns a line to log when it changed the mode."""
    try:
        st = data_dir.stat()
    except FileNotFoundError:
        return None  # created later, under the process's umask (moorline run sets 077 or 027)
    except OSError as exc:
        raise DataDirUnusable(f"cannot read data directory {data_dir}: {exc.strerror}") from exc
    if not data_dir.is_dir():
        raise DataDirUnusable(f"data directory {data_dir} is a file, not a directory")
    forbidden = 0o007 if allow_group else 0o077
    if not st.st_mode & forbidden:
        return None
    mode = st.st_mode & 0o777
    try:
        empty = not any(data_dir.iterdir())
    except OSError as exc:
        raise DataDirUnusable(f"cannot list data directory {data_dir}: {exc.strerror}") from exc
    if not empty:
        hint = "chmod 750" if allow_group else "chmod 700"
        raise DataDirUnusable(
            f"data directory {data_dir} is open to {'other users' if mode & 0o007 else 'its group'} "
            f"(mode {mode:04o}) and holds data: message payloads could be read from it. Run "
            f"'{hint} {data_dir}'" + ("" if allow_group else " (or set storage.allow_group_read = true "
                                                             "to let its group read it)"))
    private = mode & ~forbidden
    try:
        os.chmod(data_dir, private)
    except OSError as exc:
        raise DataDirUnusable(f"cannot make data directory {data_dir} private: {exc.strerror}") from exc
    return f"data directory {data_dir} was mode {mode:04o}, empty: made {private:04o}"


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode().strip()
        return int(text) if text.isdigit() else None
    except (OSError, UnicodeDecodeError):
        return None
