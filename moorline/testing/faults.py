"""The switches a test harness may inject into a node: instruments and deliberately broken builds."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class Faults:
    """Every field's default is production behaviour. Checkers are proven able to fail by running
    them against a node built with one of the broken switches on."""

    # Instrument: record each data file's synced length (storage/ledger.py), so a harness can cut
    # files back to it after SIGKILL, as a power loss would.
    sync_ledger: str | None = None
    # Instrument: delay and reorder commands one shard causes in another (seeded), to shake out
    # cross-shard races on a single node.
    cross_shard_chaos_seed: int | None = None
    # Instrument: every group commit waits this long before its sync (a slow disk), without
    # blocking the event loop, so tests can hold commands between proposal and commit.
    slow_sync_s: float = 0.0
    # Broken: acknowledge publishes before their entry is fsynced.
    unsafe_ack_before_sync: bool = False
    # Broken: lose each shard's newest message at restart.
    drop_on_restart: bool = False
    # Broken (benchmark comparison only): send a delivery batch before it is committed, so packet ids
    # are not guaranteed on resend.
    loose_packet_ids: bool = False

    @property
    def any_broken(self) -> bool:
        return self.unsafe_ack_before_sync or self.drop_on_restart or self.loose_packet_ids

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if v != getattr(NO_FAULTS, k)})

    @classmethod
    def from_json(cls, text: str) -> Faults:
        data = json.loads(text) if text else {}
        if not isinstance(data, dict):
            raise ValueError("faults must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown fault switch(es): {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        return cls(**data)


NO_FAULTS = Faults()
