"""WAL segments zero-filled ahead of time, by a thread, so group commits overwrite instead of append.

Why: an ``fdatasync`` after an append that grows the file must also write the file's inode (its
new size), a second device write in every sync. Overwriting blocks that are already on disk
changes no size, so the sync writes the data alone. Measured on this project's 2-core VM (ext4,
2 KB writes, one fdatasync each): 42 instead of 65 µs of CPU and 93 instead of 144 µs of wall time
per sync. ``fallocate`` does not help: its unwritten extents must be converted, which is a
metadata write again. So the zeros are really written, and synced, once per segment, off the
commit path.

The file is made under a temporary name and becomes a segment only by a rename (followed by a
directory fsync) when the WAL switches to it, so an unfinished preparation never looks like a
segment. A failure (a full disk, say) is logged and preparation stops for this preparer: the WAL
then grows its segments by appending, as without preallocation.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from moorline.invariant import invariant

log = logging.getLogger("moorline.wal")

PREPARED_NAME = "wal-prepared.tmp"
_ZERO_CHUNK = bytes(1 << 20)  # written over and over: one 1 MiB buffer, never copied
_pwrite = os.pwrite  # module-level so a test can make the disk "full" for the preparer alone


class SegmentPreparer:
    """Makes one zero-filled, synced file of ``size`` bytes at a time in ``directory``.

    ``start()`` begins a preparation in a thread unless one is running or ready; ``take()`` hands
    the finished file's path over (the caller renames it) or returns None at once; ``close()``
    stops the thread and deletes an untaken file. Bounded: at most one file and one thread."""

    def __init__(self, directory: Path, size: int) -> None:
        invariant(size > 0, "a prepared segment has a size")
        self.directory = Path(directory)
        self.size = size
        self.path = self.directory / PREPARED_NAME
        self.prepared = 0  # files finished (handed over or not)
        self.failed: OSError | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop = threading.Event()

    def discard_leftover(self) -> None:
        """A file from an earlier run may be unfinished: never reuse it."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    def start(self) -> None:
        if self.failed is not None or self._ready.is_set() or self._stop.is_set():
            return
        if self._thread is not None and self._thread.is_alive():
            return
        self._thread = threading.Thread(target=self._run, name="wal-prepare", daemon=True)
        self._thread.start()

    def wait(self, timeout_s: float) -> bool:
        """Tests: block until a running preparation has finished (or ``timeout_s`` passed)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        return self._ready.is_set()

    def ready(self) -> bool:
        return self._ready.is_set()

    def take(self) -> Path | None:
        """The prepared file, now the caller's, or None when none is finished."""
        if not self._ready.is_set():
            return None
        self._ready.clear()
        return self.path

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._ready.clear()
        self.discard_leftover()

    def _run(self) -> None:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                zeros = memoryview(_ZERO_CHUNK)
                pos = 0
                while pos < self.size:
                    if self._stop.is_set():
                        return
                    pos += _pwrite(fd, zeros[: min(len(zeros), self.size - pos)], pos)
                if self._stop.is_set():
                    return
                # Its size and zeros durable now: the WAL's later syncs then write data blocks only.
                os.fdatasync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            self.failed = exc
            log.warning("WAL segments are no longer preallocated (appending instead): %s", exc)
            try:
                self.path.unlink()
            except OSError:
                pass
            return
        if self._stop.is_set():
            return
        self.prepared += 1
        self._ready.set()
