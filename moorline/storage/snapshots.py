"""Snapshot files per Raft group: ``<dir>/group-<g>/snap-<index:020d>-<term:020d>.snap``.

A snapshot is written as tmp + fsync + rename + fsync(dir), so a reader sees a whole file or none.
The latest two are kept (the older one is a spare for an operator; recovery never falls back to it
silently: a corrupt latest snapshot raises ``SnapshotCorruption``).

File layout (little endian): ``magic 8s | group i64 | index u64 | term u64 | length u64 |
data_crc u32 | header_crc u32 | data``; ``header_crc`` covers the 44 bytes before it.
"""

from __future__ import annotations

import os
import re
import struct
from pathlib import Path

from moorline.hashing import crc32c
from moorline.invariant import invariant
from moorline.storage.fsutil import ensure_dir, fsync_dir, write_all
from moorline.storage.ledger import SyncLedger

MAGIC = b"MLSNAP01"
_HDR_PRE = struct.Struct("<8sqQQQI")
_U32 = struct.Struct("<I")
HEADER_BYTES = _HDR_PRE.size + 4
_SNAP_RE = re.compile(r"^snap-(\d+)-(\d+)\.snap$")
_GROUP_RE = re.compile(r"^group-(-?\d+)$")
KEEP = 2


class SnapshotCorruption(Exception):
    def __init__(self, path: Path, message: str) -> None:
        super().__init__(f"snapshot corruption in {path}: {message}")
        self.path = path
        self.message = message


class SnapshotStore:
    def __init__(
        self, directory: Path, ledger: SyncLedger | Path | str | None = None, keep: int = KEEP
    ) -> None:
        invariant(keep >= 1, "keep at least one snapshot")
        self.directory = Path(directory)
        self._ledger = SyncLedger(Path(ledger)) if isinstance(ledger, Path | str) else ledger
        self.keep = keep

    def _group_dir(self, group: int) -> Path:
        return self.directory / f"group-{group}"

    def save(self, group: int, index: int, term: int, data: bytes) -> Path:
        """Durably store a snapshot of ``group`` at ``index``/``term``; prune to the latest ``keep``."""
        invariant(index >= 0 and term >= 0, "negative snapshot index or term")
        gdir = self._group_dir(group)
        ensure_dir(gdir)
        pre = _HDR_PRE.pack(MAGIC, group, index, term, len(data), crc32c(data))
        path = gdir / f"snap-{index:020d}-{term:020d}.snap"
        tmp = gdir / (path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            write_all(fd, pre + _U32.pack(crc32c(pre)))
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_dir(gdir)
        if self._ledger is not None:
            self._ledger.record(path, HEADER_BYTES + len(data))
        self._prune(group)
        return path

    def _list(self, group: int) -> list[tuple[int, int, Path]]:
        gdir = self._group_dir(group)
        if not gdir.exists():
            return []
        found = []
        for entry in os.scandir(gdir):
            m = _SNAP_RE.match(entry.name)
            if m:
                found.append((int(m.group(1)), int(m.group(2)), Path(entry.path)))
            elif entry.name.endswith(".tmp"):
                os.unlink(entry.path)  # an unfinished save
        found.sort()
        return found

    def _prune(self, group: int) -> None:
        snaps = self._list(group)
        if len(snaps) <= self.keep:
            return
        for _index, _term, path in snaps[: -self.keep]:
            path.unlink()
            if self._ledger is not None:
                self._ledger.forget(path)
        fsync_dir(self._group_dir(group))

    def list_snapshots(self, group: int) -> list[tuple[int, int, Path]]:
        """(index, term, path) of the stored snapshots of ``group``, oldest first."""
        return self._list(group)

    def load_latest(self, group: int) -> tuple[int, int, bytes] | None:
        """(index, term, data) of the newest snapshot; ``SnapshotCorruption`` if it is damaged."""
        snaps = self._list(group)
        if not snaps:
            return None
        index, term, path = snaps[-1]
        return self.load(group, path, index, term)

    def load(self, group: int, path: Path, index: int, term: int) -> tuple[int, int, bytes]:
        """Read and verify one snapshot file (header and data read separately: no double copy)."""
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
            if len(head) < HEADER_BYTES:
                raise SnapshotCorruption(path, f"file is {len(head)} bytes, shorter than the header")
            magic, g, i, t, length, data_crc = _HDR_PRE.unpack_from(head, 0)
            if magic != MAGIC:
                raise SnapshotCorruption(path, "bad magic")
            if _U32.unpack_from(head, _HDR_PRE.size)[0] != crc32c(head[: _HDR_PRE.size]):
                raise SnapshotCorruption(path, "header fails its checksum")
            if (g, i, t) != (group, index, term):
                raise SnapshotCorruption(path, f"header says group {g} index {i} term {t}, name disagrees")
            data = f.read(length)
            extra = len(f.read(1))
        if len(data) != length or extra:
            raise SnapshotCorruption(path, f"data length differs from the header's {length}")
        if crc32c(data) != data_crc:
            raise SnapshotCorruption(path, "data fails its checksum")
        return (index, term, data)

    def list_groups(self) -> list[int]:
        if not self.directory.exists():
            return []
        groups = []
        for entry in os.scandir(self.directory):
            m = _GROUP_RE.match(entry.name)
            if m and entry.is_dir():
                groups.append(int(m.group(1)))
        groups.sort()
        return groups
