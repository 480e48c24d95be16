"""Small asyncio helpers shared by the node's parts."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any


async def cancel_all(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` and wait for each to end; what they raise while ending is theirs to log."""
    tasks = list(tasks)
    for t in tasks:
        t.cancel()
    for t in tasks:
        try:
            await t
        except (asyncio.CancelledError, Exception):
            pass
