"""Little-endian bytes for ``array('q')`` columns in snapshots (the same bytes on every host)."""

from __future__ import annotations

import sys
from array import array


def column_bytes(col: array, start: int = 0, stop: int | None = None) -> bytes:
    part = col[start:stop]
    if sys.byteorder == "big":
        part.byteswap()
    return part.tobytes()


def column_from(raw: bytes) -> array:
    col = array("q")
    col.frombytes(raw)  # raises ValueError when raw is not a whole number of items
    if sys.byteorder == "big":
        col.byteswap()
    return col
