"""The storage id: half of a Raft member's identity ``(node id, storage id)``.

A node whose storage is new or wiped gets a new storage id and so rejoins only as a new learner
(docs/design.md, "Raft"). The id is created once, when the data directory is empty, and
stored in ``<data_dir>/storage.id`` (32 hex characters and a CRC32C, written atomically). A data
directory that holds other files but no id is refused: a new id on top of old state would let a
replica vote with a log it does not really have.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from moorline.hashing import crc32c
from moorline.storage.fsutil import ensure_dir, write_file_atomically

ID_FILE = "storage.id"


class StorageIdError(Exception):
    """The storage id file is damaged, or missing from a data directory that is not empty."""


def load_or_create_storage_id(data_dir: Path, random_bytes: Callable[[int], bytes] = os.urandom,
                              adopt_existing: bool = False) -> str:
    """This data directory's storage id; a new one if the directory is new or empty, or (with
    ``adopt_existing``, for data a single node wrote before storage ids existed: it never voted
    in any other group) if it holds data but no id yet."""
    data_dir = Path(data_dir)
    path = data_dir / ID_FILE
    if path.exists():
        return _read(path)
    ensure_dir(data_dir)
    others = [e.name for e in os.scandir(data_dir) if not e.name.startswith(ID_FILE) and e.name != "LOCK"]
    if others and not adopt_existing:
        raise StorageIdError(
            f"{data_dir} holds data ({', '.join(sorted(others)[:5])}) but no {ID_FILE}: refusing to give "
            "old state a new identity; wipe the directory to rejoin as a new member"
        )
    sid = random_bytes(16).hex()
    write_file_atomically(path, f"{sid} {crc32c(sid.encode()):08x}\n".encode())
    return sid


def _read(path: Path) -> str:
    text = path.read_text(encoding="ascii", errors="replace").strip()
    parts = text.split(" ")
    if len(parts) != 2 or len(parts[0]) != 32:
        raise StorageIdError(f"{path} is malformed")
    sid, crc = parts
    if f"{crc32c(sid.encode()):08x}" != crc:
        raise StorageIdError(f"{path} fails its checksum")
    return sid


BOOT_FILE = "boot"


def next_boot_number(data_dir: Path) -> int:
    """This start's boot number: one more than the last start's, durable before it is used.

    Proposals carry (node, boot, seq) and a shard applies one proposal once; seq restarts at 1
    with every boot, so a boot number must never repeat (a torn or missing file is an error, not
    a restart from 1)."""
    path = Path(data_dir) / BOOT_FILE
    last = 0
    if path.exists():
        text = path.read_text(encoding="ascii", errors="replace").strip()
        parts = text.split(" ")
        if len(parts) != 2 or not parts[0].isdigit() or f"{crc32c(parts[0].encode()):08x}" != parts[1]:
            raise StorageIdError(f"{path} is malformed: refusing to reuse boot numbers")
        last = int(parts[0])
    boot = last + 1
    write_file_atomically(path, f"{boot} {crc32c(str(boot).encode()):08x}\n".encode())
    return boot
