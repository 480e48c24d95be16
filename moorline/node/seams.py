"""Where a node meets the world (DESIGN: simulation seams), in one object a simulator replaces.

Production uses ``PRODUCTION``: the system clock, TCP between nodes, the OS's entropy, and threads
for fdatasync. The cluster simulator passes virtual time, an in-memory network, seeded bytes and
``inline_io`` (every sync runs on the event loop, in the loop's order), so a seed decides
everything a node does.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass

from moorline.cluster.net import Network
from moorline.node.clock import SYSTEM_CLOCK, Clock
from moorline.storage.ledger import SyncLedger


@dataclass(frozen=True)
class Seams:
    clock: Clock = SYSTEM_CLOCK
    cluster_network: Network | None = None  # None: asyncio TCP (moorline.cluster.net.AsyncioNetwork)
    # Storage ids, GUID prefixes, incarnations, handshake nonces; and the seed of ``rng()``.
    random_bytes: Callable[[int], bytes] = os.urandom
    inline_io: bool = False  # no threads: WAL syncs run on the event loop
    # The disk's record of synced lengths (test instrument, see storage/ledger.py): the simulator
    # keeps it in memory to cut a crashed node's files back to what was synced.
    sync_ledger: SyncLedger | None = None

    def rng(self) -> random.Random:
        """A generator for jitter (reconnect backoff), seeded from ``random_bytes``."""
        return random.Random(self.random_bytes(16))


PRODUCTION = Seams()
