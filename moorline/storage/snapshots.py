"""Snapshot files per Raft group: ``<dir>/group-<g>/snap-<index:020d>-<term:020d>.snap``.

A snapshot is written as tmp + fsync + rename + fsync(dir), so a reader sees a whole file or none.
The latest two are kept (the older one is a spare for an operator; recovery never falls back to it
silently: a corrupt latest snapshot raises ``SnapshotCorruption``).

File layout (little endian), version 2 (``MLSNAP02``)::

    magic 8s | group i64 | index u64 | term u64 | meta_len u32 | length u64 | data_crc u32 |
    header_crc u32 | meta | data

``header_crc`` covers the 48 bytes before it and the ``meta`` bytes: ``meta`` is the snapshot's
Raft metadata the caller encodes (the shard host: the membership configuration as of ``index``),
``data`` the state machine's canonical snapshot, covered by ``data_crc``. Version 1 files
(``MLSNAP01``: ``magic | group | index | term | length | data_crc | header_crc | data``, a 44-byte
header, no meta) are still read; their meta is empty.

Besides ``save`` (encode, write, rename in one call), a file may be written elsewhere first
(``write_snapshot_file``: by a forked child that encodes off the event loop, or by a replica
receiving a leader's snapshot) and then moved into place with ``adopt``.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from moorline.hashing import crc32c
from moorline.invariant import invariant
from moorline.storage.fsutil import ensure_dir, fsync_dir, write_all
from moorline.storage.ledger import SyncLedger

MAGIC = b"MLSNAP02"
MAGIC_V1 = b"MLSNAP01"
_HDR_PRE = struct.Struct("<8sqQQIQI")
_HDR_PRE_V1 = struct.Struct("<8sqQQQI")
_U32 = struct.Struct("<I")
HEADER_BYTES = _HDR_PRE.size + 4  # version 2, before the meta bytes
V1_HEADER_BYTES = _HDR_PRE_V1.size + 4
MAX_META_BYTES = 1 << 20  # a configuration of a few members; anything larger is damage
_SNAP_RE = re.compile(r"^snap-(\d+)-(\d+)\.snap$")
_GROUP_RE = re.compile(r"^group-(-?\d+)$")
KEEP = 2
PENDING_SUFFIX = ".snap.pending"


class SnapshotCorruption(Exception):
    def __init__(self, path: Path, message: str) -> None:
        super().__init__(f"snapshot corruption in {path}: {message}")
        self.path = path
        self.message = message


@dataclass(frozen=True, slots=True)
class SavedSnapshot:
    """One verified snapshot file: ``meta`` is empty for a version-1 file."""

    group: int
    index: int
    term: int
    meta: bytes
    data: bytes
    path: Path


def snapshot_file_name(index: int, term: int) -> str:
    return f"snap-{index:020d}-{term:020d}.snap"


def file_header(group: int, index: int, term: int, meta: bytes, data_length: int, data_crc: int) -> bytes:
    """Everything of a version-2 file before its data: fixed header, header CRC, meta."""
    invariant(index >= 0 and term >= 0, "negative snapshot index or term")
    invariant(len(meta) <= MAX_META_BYTES, "snapshot meta too large")
    pre = _HDR_PRE.pack(MAGIC, group, index, term, len(meta), data_length, data_crc)
    return pre + _U32.pack(crc32c(pre + meta)) + meta


def write_snapshot_file(path: Path, group: int, index: int, term: int, data: bytes, meta: bytes = b"") -> int:
    """Write a whole snapshot file at ``path`` and fsync it (no rename, no directory fsync: the
    caller moves it into place). Returns the file's size. Safe in a forked child: plain system
    calls, no locks."""
    head = file_header(group, index, term, meta, len(data), crc32c(data))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, head)
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    return len(head) + len(data)


def read_snapshot_file(path: Path, expect: tuple[int, int, int] | None = None) -> SavedSnapshot:
    """Read and verify one snapshot file (either version). ``expect`` = (group, index, term) the
    file must carry (its name says so); ``SnapshotCorruption`` when anything fails its check."""
    with open(path, "rb") as f:
        magic = f.read(8)
        if magic == MAGIC_V1:
            head = magic + f.read(V1_HEADER_BYTES - 8)
            if len(head) < V1_HEADER_BYTES:
                raise SnapshotCorruption(path, f"file is {len(head)} bytes, shorter than the header")
            _, g, i, t, length, data_crc = _HDR_PRE_V1.unpack_from(head, 0)
            if _U32.unpack_from(head, _HDR_PRE_V1.size)[0] != crc32c(head[: _HDR_PRE_V1.size]):
                raise SnapshotCorruption(path, "header fails its checksum")
            meta = b""
        elif magic == MAGIC:
            head = magic + f.read(HEADER_BYTES - 8)
            if len(head) < HEADER_BYTES:
                raise SnapshotCorruption(path, f"file is {len(head)} bytes, shorter than the header")
            _, g, i, t, meta_len, length, data_crc = _HDR_PRE.unpack_from(head, 0)
            if meta_len > MAX_META_BYTES:
                raise SnapshotCorruption(path, f"meta length {meta_len} is implausible")
            meta = f.read(meta_len)
            if len(meta) != meta_len or _U32.unpack_from(head, _HDR_PRE.size)[0] != crc32c(
                head[: _HDR_PRE.size] + meta
            ):
                raise SnapshotCorruption(path, "header fails its checksum")
        else:
            raise SnapshotCorruption(path, "bad magic")
        if expect is not None and (g, i, t) != expect:
            raise SnapshotCorruption(path, f"header says group {g} index {i} term {t}, expected "
                                           f"group {expect[0]} index {expect[1]} term {expect[2]}")
        data = f.read(length)
        extra = len(f.read(1))
    if len(data) != length or extra:
        raise SnapshotCorruption(path, f"data length differs from the header's {length}")
    if crc32c(data) != data_crc:
        raise SnapshotCorruption(path, "data fails its checksum")
    return SavedSnapshot(g, i, t, meta, data, Path(path))


class SnapshotStore:
    def __init__(
        self, directory: Path, ledger: SyncLedger | Path | str | None = None, keep: int = KEEP
    ) -> None:
        invariant(keep >= 1, "keep at least one snapshot")
        self.directory = Path(directory)
        self._ledger = SyncLedger(Path(ledger)) if isinstance(ledger, Path | str) else ledger
        self.keep = keep
        self._loaded_meta: dict[int, bytes] = {}

    def group_dir(self, group: int) -> Path:
        return self.directory / f"group-{group}"

    _group_dir = group_dir

    def save(self, group: int, index: int, term: int, data: bytes, meta: bytes = b"") -> Path:
        """Durably store a snapshot of ``group`` at ``index``/``term``; prune to the latest ``keep``."""
        gdir = self.group_dir(group)
        ensure_dir(gdir)
        path = gdir / snapshot_file_name(index, term)
        tmp = gdir / (path.name + ".tmp")
        size = write_snapshot_file(tmp, group, index, term, data, meta)
        os.replace(tmp, path)
        fsync_dir(gdir)
        if self._ledger is not None:
            self._ledger.record(path, size)
        self._prune(group)
        return path

    def temp_path(self, group: int, tag: str) -> Path:
        """Where a snapshot of ``group`` may be written before ``adopt`` (in the group's directory,
        so the rename stays on one file system). An unfinished one is removed when the group is
        next loaded (at startup), never while the node runs: its writer may still be at it."""
        gdir = self.group_dir(group)
        ensure_dir(gdir)
        return gdir / f"{tag}{PENDING_SUFFIX}"

    def adopt(self, group: int, index: int, term: int, written: Path, size: int | None = None) -> Path:
        """Move a snapshot file written (and fsynced) elsewhere on this file system into place as
        the snapshot of ``group`` at ``index``/``term``, durably; prune to the latest ``keep``.
        The caller has verified it (``read_snapshot_file``) or wrote it itself."""
        gdir = self.group_dir(group)
        ensure_dir(gdir)
        path = gdir / snapshot_file_name(index, term)
        if size is None:
            size = os.stat(written).st_size
        os.replace(written, path)
        fsync_dir(gdir)
        if Path(written).parent != gdir:
            fsync_dir(Path(written).parent)
        if self._ledger is not None:
            self._ledger.record(path, size)
        self._prune(group)
        return path

    def _list(self, group: int, startup: bool = False) -> list[tuple[int, int, Path]]:
        gdir = self.group_dir(group)
        if not gdir.exists():
            return []
        found = []
        for entry in os.scandir(gdir):
            m = _SNAP_RE.match(entry.name)
            if m:
                found.append((int(m.group(1)), int(m.group(2)), Path(entry.path)))
            elif entry.name.endswith(".tmp") or (startup and entry.name.endswith(PENDING_SUFFIX)):
                try:
                    os.unlink(entry.path)  # an unfinished save (or, at startup, background write)
                except FileNotFoundError:
                    pass
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
        fsync_dir(self.group_dir(group))

    def list_snapshots(self, group: int) -> list[tuple[int, int, Path]]:
        """(index, term, path) of the stored snapshots of ``group``, oldest first."""
        return self._list(group)

    def latest(self, group: int) -> tuple[int, int, Path] | None:
        """(index, term, path) of the newest snapshot of ``group``, unverified; None without one."""
        snaps = self._list(group)
        return snaps[-1] if snaps else None

    def load_latest(self, group: int) -> tuple[int, int, bytes] | None:
        """(index, term, data) of the newest snapshot; ``SnapshotCorruption`` if it is damaged."""
        saved = self.load_latest_full(group)
        return None if saved is None else (saved.index, saved.term, saved.data)

    def load_latest_full(self, group: int) -> SavedSnapshot | None:
        """The newest snapshot with its meta; ``SnapshotCorruption`` if it is damaged. For recovery:
        unfinished writes of the group are removed."""
        snaps = self._list(group, startup=True)
        if not snaps:
            return None
        index, term, path = snaps[-1]
        saved = read_snapshot_file(path, (group, index, term))
        self._loaded_meta[group] = saved.meta
        return saved

    def loaded_meta(self, group: int) -> bytes:
        """The meta of the snapshot ``load_latest`` last returned for ``group`` (empty if none, or
        a version-1 file): recovery reads the configuration from it without reading the file again."""
        return self._loaded_meta.get(group, b"")

    def load(self, group: int, path: Path, index: int, term: int) -> tuple[int, int, bytes]:
        """Read and verify one snapshot file."""
        saved = read_snapshot_file(path, (group, index, term))
        return (saved.index, saved.term, saved.data)

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
