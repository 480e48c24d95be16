"""The spool: an append-only file holding every message the client accepted and not yet saw
acknowledged, so a crash of the process loses none of them.

A record is ``u32 length, u32 CRC32C, body``; the body is either ``P`` (a message: its local
number, QoS, retain, producer, sequence, topic and payload) or ``A`` (the local number of an
acknowledged message). A message's record is written with one ``write`` before the client sends it
(a crashed process loses nothing written) and ``fsync``ed before it is sent (a lost machine loses
nothing sent). Acknowledgement records are not synced: one lost is a resend the broker de-duplicates
by producer and sequence. A torn last record (a crash in the middle of a ``write``) is cut at open.
The file is rewritten with only the live messages once it is several times their size. An
exclusive ``flock`` keeps a second process off the same spool.
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
from dataclasses import dataclass

from moorline.client.errors import SpoolError
from moorline.hashing import crc32c

log = logging.getLogger("moorline.client")

MAGIC = b"MLSPOOL1\n"
_HEAD = struct.Struct("!II")  # body length, CRC32C of the body
_P = struct.Struct("!cQBB8sQH")  # 'P', n, qos, retain, producer (zeros: none), seq, topic length
_A = struct.Struct("!cQ")  # 'A', n
_NO_PRODUCER = bytes(8)
COMPACT_MIN_BYTES = 1 << 20


@dataclass(slots=True)
class SpooledMessage:
    n: int
    topic: str
    payload: bytes
    qos: int
    retain: bool
    producer: bytes | None
    seq: int | None


def _encode_p(m: SpooledMessage) -> bytes:
    tb = m.topic.encode()
    body = _P.pack(b"P", m.n, m.qos, 1 if m.retain else 0, m.producer or _NO_PRODUCER, m.seq or 0, len(tb)) + tb + m.payload
    return _HEAD.pack(len(body), crc32c(body)) + body


def _encode_a(n: int) -> bytes:
    body = _A.pack(b"A", n)
    return _HEAD.pack(len(body), crc32c(body)) + body


class Spool:
    """One spool file, opened (and locked) by one client."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._fd = -1
        self._dirty = False
        self._size = 0
        self._live: dict[int, SpooledMessage] = {}
        self._live_bytes = 0

    # ------------------------------------------------------------------------------------------
    def open(self) -> list[SpooledMessage]:
        """Lock and read the spool; the messages not yet acknowledged, in their original order."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise SpoolError(f"cannot open spool {self.path}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise SpoolError(f"spool {self.path} is in use by another process") from None
        self._fd = fd
        with open(fd, "rb", closefd=False) as f:
            data = f.read()
        if not data:
            os.write(fd, MAGIC)
            os.fsync(fd)
            self._size = len(MAGIC)
            return []
        if not data.startswith(MAGIC):
            self.close()
            raise SpoolError(f"{self.path} is not a moorline client spool")
        pos = len(MAGIC)
        live: dict[int, SpooledMessage] = {}
        while pos + _HEAD.size <= len(data):
            length, crc = _HEAD.unpack_from(data, pos)
            body = data[pos + _HEAD.size:pos + _HEAD.size + length]
            if len(body) < length or crc32c(body) != crc:
                break
            if body[:1] == b"P" and length >= _P.size:
                _, n, qos, retain, producer, seq, tlen = _P.unpack_from(body)
                topic = body[_P.size:_P.size + tlen].decode()
                has = producer != _NO_PRODUCER
                live[n] = SpooledMessage(n, topic, body[_P.size + tlen:], qos, bool(retain),
                                         producer if has else None, seq if has else None)
            elif body[:1] == b"A" and length == _A.size:
                live.pop(_A.unpack(body)[1], None)
            else:
                break
            pos += _HEAD.size + length
        if pos != len(data):
            log.warning("spool %s: cut a torn or damaged tail of %d bytes at offset %d", self.path, len(data) - pos, pos)
            os.ftruncate(fd, pos)
            os.fsync(fd)
        self._size = pos
        os.lseek(fd, pos, os.SEEK_SET)
        self._live = live
        self._live_bytes = sum(len(m.payload) + len(m.topic) + 40 for m in live.values())
        return sorted(live.values(), key=lambda m: m.n)

    def append(self, m: SpooledMessage) -> None:
        """Write a message's record (no sync: ``sync`` before sending it)."""
        rec = _encode_p(m)
        self._write(rec)
        old = self._live.get(m.n)
        if old is not None:  # re-sequenced: the later record replaces it at open
            self._live_bytes -= len(old.payload) + len(old.topic) + 40
        self._live[m.n] = m
        self._live_bytes += len(m.payload) + len(m.topic) + 40
        self._dirty = True

    def sync(self) -> None:
        if self._dirty and self._fd >= 0:
            os.fsync(self._fd)
            self._dirty = False

    def acked(self, n: int) -> None:
        m = self._live.pop(n, None)
        if m is None or self._fd < 0:
            return
        self._live_bytes -= len(m.payload) + len(m.topic) + 40
        self._write(_encode_a(n))
        if self._size > COMPACT_MIN_BYTES and self._size > 4 * self._live_bytes:
            self._compact()

    def close(self) -> None:
        if self._fd >= 0:
            try:
                self.sync()
            finally:
                os.close(self._fd)  # releases the lock
                self._fd = -1

    # ------------------------------------------------------------------------------------------
    def _write(self, rec: bytes) -> None:
        view = memoryview(rec)
        while view:
            k = os.write(self._fd, view)
            view = view[k:]
        self._size += len(rec)

    def _compact(self) -> None:
        tmp = self.path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            parts = [MAGIC] + [_encode_p(m) for m in sorted(self._live.values(), key=lambda m: m.n)]
            data = b"".join(parts)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            os.close(fd)
            raise
        os.replace(tmp, self.path)
        dfd = os.open(os.path.dirname(os.path.abspath(self.path)), os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        os.close(self._fd)
        self._fd = fd
        self._size = len(data)
        self._dirty = False
