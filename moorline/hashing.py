"""Placement and identity hashes.

Placement uses CRC32C of the UTF-8 bytes (fixed, recorded at cluster creation); identities
derived by hashing use BLAKE2b (64/128 bit). Python's ``hash()`` is salted per process and is
never used for anything persisted or placed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import crc32c as _crc32c

# crc32c(data, value=0): CRC32C of ``data``, continued from ``value`` (the CRC of what came before
# it). The C function itself, not a wrapper: it runs several times per message.
crc32c: Callable[..., int] = _crc32c.crc32c


def shard_of(key: str, shard_count: int) -> int:
    """The shard that owns a topic or a client id."""
    return crc32c(key.encode("utf-8")) % shard_count


def guid128(*parts: str | bytes | int) -> bytes:
    """A 16-byte identity derived from ``parts`` (e.g. a will's GUID)."""
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        if isinstance(p, int):
            b = str(p).encode()
        elif isinstance(p, str):
            b = p.encode("utf-8")
        else:
            b = p
        h.update(len(b).to_bytes(4, "big"))
        h.update(b)
    return h.digest()


def producer_id64(*parts: str | bytes | int) -> bytes:
    """An 8-byte producer id (e.g. for a Spark sink partition)."""
    return guid128(*parts)[:8]
