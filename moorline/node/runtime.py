"""Process-wide tuning applied once the node has recovered: garbage collector and allocator.

Both defaults are wrong for a broker. Python's young-generation threshold (700 allocations)
runs a collection every few hundred messages, and every so often a full one that walks the
shard state's millions of long-lived objects. glibc's allocator returns freed heap to the
kernel as soon as 128 KiB sit free at its top, and serves large blocks (batched entries, 64 KiB
payloads) from fresh mmaps: each reuse then costs a page fault and a zeroed page per 4 KiB, so
with large payloads more CPU went to page faults than to the broker itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging

from moorline.config import RuntimeConfig

log = logging.getLogger("moorline.runtime")

# mallopt parameters (glibc malloc.h)
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3


def tune_gc(cfg: RuntimeConfig) -> None:
    """Objects alive now (what recovery loaded) are moved out of every future collection."""
    gc.freeze()
    gc.set_threshold(cfg.gc_young_threshold, 20, 100)


def tune_allocator(cfg: RuntimeConfig) -> bool:
    """Keep freed memory in the process (bounded by the trim threshold). Returns False where the
    C library is not glibc (nothing is changed there)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = all((
        mallopt(_M_MMAP_THRESHOLD, cfg.malloc_mmap_threshold_bytes) == 1,
        mallopt(_M_TRIM_THRESHOLD, cfg.malloc_trim_threshold_bytes) == 1,
        mallopt(_M_TOP_PAD, cfg.malloc_top_pad_bytes) == 1,
    ))
    if not ok:
        log.warning("mallopt refused a setting; the allocator keeps its defaults")
    return ok
