"""Small file-system helpers shared by the WAL, the message store and the snapshot store."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(directory: Path) -> None:
    """Make a create, rename or unlink inside ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fdatasync_path(path: Path) -> int:
    """Make the data of the file at ``path`` durable (opened read-only for it); returns its size."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def ensure_dir(directory: Path) -> None:
    """Create ``directory`` (and missing parents), making each creation durable in its parent."""
    directory = Path(directory)
    if directory.is_dir():
        return
    ensure_dir(directory.parent)
    try:
        directory.mkdir()
    except FileExistsError:
        return
    fsync_dir(directory.parent)


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """``os.write`` until every byte is written (short writes happen on large buffers)."""
    view = memoryview(data)
    try:
        while view:
            n = os.write(fd, view)
            view = view[n:]
    finally:
        view.release()


def pwrite_all(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    """``os.pwrite`` at ``offset`` until every byte is written (the file position is not used)."""
    view = memoryview(data)
    try:
        while view:
            n = os.pwrite(fd, view, offset)
            view = view[n:]
            offset += n
    finally:
        view.release()


def writev_all(fd: int, pieces: list[bytes | bytearray]) -> int:
    """``os.writev`` of ``pieces`` until every byte is written; returns the byte count. Large
    payloads go to the file straight from their own buffers, not copied into a joined one first."""
    total = sum(len(piece) for piece in pieces)
    done = os.writev(fd, pieces)
    if done < total:  # a short write: the rest, joined (rare; only on very large writes)
        write_all(fd, memoryview(b"".join(pieces))[done:])
    return total


def truncate_durably(path: Path, length: int) -> None:
    """Cut ``path`` to ``length`` bytes and make the new length durable."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.ftruncate(fd, length)
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomically(path: Path, data: bytes) -> None:
    """Write ``path`` as tmp + fsync + rename + fsync(dir): readers see old or new, never half."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)
