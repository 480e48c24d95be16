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
    # Instrument: the ack reports that follow a session's committed acknowledgements
    # (sessions/delivery.py) are never proposed, as if each proposing node crashed right after the
    # SessionAcks committed. Nothing is lost: the topic shard's leader reports them again from the
    # replicated state (sessions/followups.py); without that the messages stay owed for good.
    drop_ack_reports: bool = False
    # Broken: acknowledge publishes before their entry is fsynced.
    unsafe_ack_before_sync: bool = False
    # Broken: lose each shard's newest message at restart.
    drop_on_restart: bool = False
    # Broken (benchmark comparison only): send a delivery batch before it is committed, so packet ids
    # are not guaranteed on resend.
    loose_packet_ids: bool = False
    # The cluster simulator's switches (docs/simulation.md, "Bug switches"): each a bug that loses or
    # duplicates messages only across nodes, which `moorline sim --cluster` must catch.
    # Broken: de-duplication decided at propose time only. The node a PUBLISH reaches looks its
    # GUID up in its own replica and proposes it if not found there; the shard applies it without
    # a GUID check (a resend through another node, or before the first copy applied, is stored twice).
    dedup_at_propose_only: bool = False
    # Broken: a resumed session resends its unacknowledged deliveries (and PUBRELs) with fresh
    # packet ids instead of their original ones.
    renumber_packet_ids_on_takeover: bool = False
    # Broken: no owner lease. A new owner serves at once, without waiting for the previous owner's
    # release or lease end, and an owner that cannot renew its lease keeps serving.
    no_owner_lease: bool = False
    # Broken: PUBACK/PUBREC once the proposing node has the entry in its own synced log, not once
    # a majority committed it (a leader that proposes acknowledges at its local append).
    ack_before_quorum: bool = False
    # Broken: on a leader change the forwarder forgets the proposals not yet applied instead of
    # handing them to the new leader; their waiters are never answered (publish_timeout closes the
    # client with 0x89), and the shard, which applies a node's proposals in order, skips that
    # node's later ones until it restarts.
    forwarder_drops_on_leader_change: bool = False
    # Broken: a reader feed resumed starts one past where it should (node/replication/reader_feed.py):
    # sent again after a gap, it starts one past the acknowledged item (numbered as if it were the
    # next); started anew for a reader (after a leader change, a lost feed), it loses the first entry
    # after its partial snapshot. The reader never applies that item.
    stream_resume_skips_one: bool = False
    # Broken: SUBACK once the session's shard and the first topic shard registered the
    # subscription, not every shard the filter can match (the others register later).
    suback_before_all_shards: bool = False
    # Broken: clocks past the bound. The simulator sets the nodes' wall clocks 3.5 s apart (past
    # cluster.max_clock_offset_ms and the owner leases' margin, docs/design.md "Leases and clocks")
    # and the nodes do not check the bound: leases, lapses and expiry are judged on leaders'
    # clocks that disagree by more than the margin they were built for.
    no_clock_bound: bool = False
    # Broken: a $share message's delivery attempts are counted by the shard leader's dispatcher in
    # its own memory, not in the shard's replicated state (testing/volatile_dlq.py): a new leader
    # counts from zero, so a poison message is handed out past queue.max_deliveries.
    dlq_count_not_replicated: bool = False
    # Broken: a shard's leader promotes a learner to voter without waiting for it to be within
    # cluster.promote_lag_entries of its log (replication/membership.py, reconcile.py): a voter that
    # cannot vote for anything recent yet counts towards the quorum.
    promote_before_caught_up: bool = False
    # Broken: after a forget the reconciler grows a shard with a voter on the forgotten node before
    # removing that voter (reconcile.py): a shard of 3 with one dead voter becomes 4 with 3 live,
    # whose majority a second failure takes away (RabbitMQ #7209's lesson, the wrong way round).
    grow_before_shrink_on_forget: bool = False

    @property
    def any_broken(self) -> bool:
        return any(getattr(self, name) for name in BROKEN_SWITCHES)

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
# The switches that make a deliberately broken build (the others are instruments).
BROKEN_SWITCHES = (
    "unsafe_ack_before_sync", "drop_on_restart", "loose_packet_ids",
    "dedup_at_propose_only", "renumber_packet_ids_on_takeover", "no_owner_lease", "ack_before_quorum",
    "forwarder_drops_on_leader_change", "suback_before_all_shards", "no_clock_bound", "dlq_count_not_replicated",
    "promote_before_caught_up", "grow_before_shrink_on_forget",
)
# The cluster simulator's: each must be caught by `moorline sim --cluster` with the default fault mix.
CLUSTER_SWITCHES = BROKEN_SWITCHES[3:]
