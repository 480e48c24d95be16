"""Where a node meets the world (DESIGN: simulation seams), in one object a simulator replaces.

Production uses ``PRODUCTION``: the system clock, TCP between nodes, the OS's entropy, and threads
for fdatasync. The cluster simulator passes virtual time, an in-memory network, seeded bytes and
``inline_io`` (every sync runs on the event loop, in the loop's order), so a seed decides
everything a node does. With ``sync_runner`` the simulator instead hands each WAL sync to an object
of its own that completes it after a drawn stretch of virtual time while the loop goes on, as the
sync thread does in production (and a crash may fall inside it).
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from moorline.cluster.net import Network
from moorline.node.clock import SYSTEM_CLOCK, Clock
from moorline.storage.ledger import SyncLedger

if TYPE_CHECKING:
    from moorline.storage.wal import WriteAheadLog


class SyncRunner(Protocol):
    """Where group commit's syncs run when not on the loop: ``group_commit.SyncThread`` in
    production. ``sync()`` starts one and returns its outcome (the WAL's sync sequence) as a future
    of the running loop; ``stop()`` ends the runner with the node."""

    def sync(self) -> asyncio.Future[int]: ...

    def stop(self) -> None: ...


@dataclass(frozen=True)
class Seams:
    clock: Clock = SYSTEM_CLOCK
    cluster_network: Network | None = None  # None: asyncio TCP (moorline.cluster.net.AsyncioNetwork)
    # Storage ids, GUID prefixes, incarnations, handshake nonces; and the seed of ``rng()``.
    random_bytes: Callable[[int], bytes] = os.urandom
    inline_io: bool = False  # no threads: WAL syncs run on the event loop
    # Group commit's sync runner, made from the node's WAL (None: a SyncThread, or the loop with
    # ``inline_io``). The simulator's completes each sync after virtual time (sim/cluster/world.py).
    sync_runner: Callable[[WriteAheadLog], SyncRunner] | None = None
    # The disk's record of synced lengths (test instrument, see storage/ledger.py): the simulator
    # keeps it in memory to cut a crashed node's files back to what was synced.
    sync_ledger: SyncLedger | None = None

    def rng(self) -> random.Random:
        """A generator for jitter (reconnect backoff), seeded from ``random_bytes``."""
        return random.Random(self.random_bytes(16))


PRODUCTION = Seams()
