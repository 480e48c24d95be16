"""Per-seed node configuration for the cluster simulator (swarm testing, as TigerBeetle's VOPR
draws its own parameters per seed).

With production defaults a 45-second seed never snapshots (every 20,000 entries), never rolls a WAL
segment (64 MiB), never drops by retention (an hour) and never fills a queue cap: whole subsystems
ran in no seed, and a slip in them passed any number of seeds. Each seed therefore draws its
configuration from ranges that include tiny values; about half of the knobs keep the default in any
one seed, so the common path stays covered too. The draw depends on the seed alone (its own random
stream), so a seed's replay runs the same configuration; ``--verbose`` prints it and the trace
header records it. The draw is the default (``RunConfig.draw_config``); ``--no-draw-config`` keeps
the production defaults (``runner.plain_mix()``).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, fields

from moorline.config import NodeConfig


@dataclass(frozen=True)
class NodeTuning:
    shards: int = 4
    snapshot_every_entries: int = 20_000
    wal_segment_bytes: int = 64 << 20
    store_segment_bytes: int = 16 << 20
    retention_min_age_s: float = 3600.0
    max_queued_messages: int = 100_000
    owner_lease_s: float = 10.0
    max_pending_proposals: int = 256
    max_entry_bytes: int = 1 << 20
    housekeeping_interval_s: float = 1.0
    follower_log_margin_entries: int = 50_000

    def apply(self, cfg: NodeConfig) -> None:
        cfg.shard.count = self.shards
        cfg.shard.snapshot_every_entries = self.snapshot_every_entries
        cfg.storage.wal_segment_bytes = self.wal_segment_bytes
        cfg.storage.store_segment_bytes = self.store_segment_bytes
        cfg.retention.min_age_s = self.retention_min_age_s
        cfg.session.max_queued_messages = self.max_queued_messages
        cfg.session.owner_lease_s = self.owner_lease_s
        cfg.raft.max_pending_proposals = self.max_pending_proposals
        cfg.raft.max_entry_bytes = self.max_entry_bytes
        cfg.mqtt.max_packet_size = min(cfg.mqtt.max_packet_size, self.max_entry_bytes)
        cfg.shard.housekeeping_interval_s = self.housekeeping_interval_s
        cfg.raft.follower_log_margin_entries = self.follower_log_margin_entries

    def differences(self) -> dict[str, object]:
        """The knobs this seed drew away from the defaults (what ``--verbose`` prints)."""
        base = DEFAULT_TUNING
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != getattr(base, f.name)}

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


DEFAULT_TUNING = NodeTuning()

# Below this queue cap a seed's publishers all send GUIDs: a cap drop names the broker's GUID of the
# message, which for a message sent without one the history cannot map back to the message (its
# identity there is the payload), so the drop could not excuse it.
GUIDLESS_MIN_QUEUE_CAP = 1000

# Each knob: the default, or one of these (tiny values first-class). Every value must keep the
# promises; what a tiny value costs legitimately (a counted queue-cap or retention drop, a publish
# refused at the pending-proposal bound) the checkers excuse by the records the broker writes.
_CHOICES: dict[str, tuple[object, ...]] = {
    "shards": (1, 2, 8),
    "snapshot_every_entries": (40, 100, 400),
    # A leader keeps this many entries below its snapshot for lagging followers; past it they get a
    # snapshot transfer (install), which production-sized margins never reach in a short seed.
    "follower_log_margin_entries": (10, 100),
    "wal_segment_bytes": (8 << 10, 64 << 10, 1 << 20),
    "store_segment_bytes": (4 << 10, 64 << 10),
    "retention_min_age_s": (2.0, 10.0),
    "max_queued_messages": (20, 200),
    "owner_lease_s": (3.0, 5.0),
    "max_pending_proposals": (8, 32),
    "max_entry_bytes": (64 << 10, 256 << 10),
    "housekeeping_interval_s": (0.2,),
}


def draw_tuning(seed: int, keep_default_p: float = 0.5) -> NodeTuning:
    """The seed's configuration: each knob the default with probability ``keep_default_p``, else
    one of its choices."""
    rng = random.Random(f"{seed}/config")
    drawn: dict[str, object] = {}
    for name, choices in _CHOICES.items():
        if rng.random() >= keep_default_p:
            drawn[name] = rng.choice(choices)
    return NodeTuning(**drawn)  # type: ignore[arg-type]
