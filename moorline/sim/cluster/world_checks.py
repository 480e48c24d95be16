"""World-state checks of the cluster simulator that watch a promise from outside the code keeping it.

Each check takes its facts from the world (bytes on the virtual network, a node's state read at a
moment the simulator picks), never from the condition the node code uses to keep the promise: a
check that reused that condition could not fail when the condition is wrong.

- ``PromiseLedger`` (durable promises): every Raft message a node sent over the virtual network
  is a promise about its durable state. After a restart its recovered term is not below any term
  it sent in (pre-votes excepted: they carry a future term), the vote it granted (or cast for
  itself) in the recovered term is the recovered vote, and every entry it acknowledged in the
  recovered term is in the recovered log with the term it had when acknowledged (or under the
  recovered snapshot).
- ``ReadBarrierCheck`` (read barriers): when a read barrier's future resolves, the replica has
  applied at least the read index the group's read (``ReadState``) returned for it; a barrier that
  resolves with no read index answered is a violation too.
- ``DurableAtSend`` (durable before sent): Raft's rule that a node puts a message on the wire only
  once what it promises is durable, checked as each message leaves, with no crash needed: an
  append response acknowledging entry ``i`` goes out only after a WAL sync covered the append that
  wrote ``i``, and a vote (granted, or a candidate's own) only after a sync covered the hard state
  that recorded it. Its facts come from the node's WAL as the simulator watches it (each append's
  and hard state's sequence number, each sync's), not from group commit's bookkeeping.
- ``RecoveredLogCheck`` (recovered logs): a restarted replica's log, up to its commit index, holds
  the terms the group committed, and its terms never decrease after its snapshot.
- ``canonical_state_findings`` (snapshots): a replica's state encoded, restored with
  ``ShardState.restore`` and encoded again gives the same bytes, the restored state's derived
  indexes (``derived_state``: owed counts and bytes, retention candidates, ...) are those the
  replica kept as it applied, and replicas at the same applied index encode the same bytes.
- ``PinCheck`` (retention pins): no message at or above a live pin's offset on a shard is released
  by retention while that pin is live on that replica (``pinned_released``). Judged between two
  samples of the replica's state: a message present (in its message index) at the first and gone at
  the second, at or above the offset of a pin held at both with that same offset, whose TTL (at
  both) had not run out by the replica's latest entry time at the second, and whose reader no unpin
  was asked for (``unpinning``; the workload's readers never reuse a name), went while the pin held.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from moorline.broker.shard import ShardState
from moorline.broker.topic_state import OFFSET_MASK
from moorline.raft import Message, MessageType

_MT = MessageType
_PRE_VOTE = frozenset({_MT.PRE_VOTE, _MT.PRE_VOTE_RESP})
Finding = tuple[str, str]  # (kind, detail), as the runner's findings


@dataclass
class _Ack:
    term: int
    index: int
    entry_term: int | None  # the term of entry ``index`` in the sender's log when it was sent


@dataclass
class PromiseLedger:
    """Votes granted and appends acknowledged, as seen leaving each node; checked at each restart."""

    term_sent: dict[tuple[str, int], int] = field(default_factory=dict)  # (node, group) -> term
    votes: dict[tuple[str, int, int], Any] = field(default_factory=dict)  # (node, group, term) -> candidate
    acked: dict[tuple[str, int], _Ack] = field(default_factory=dict)  # (node, group) -> highest ack
    findings: list[Finding] = field(default_factory=list)
    messages_seen: int = 0
    recoveries_checked: int = 0

    def on_send(self, node: str, group: int, m: Message, term_of: Callable[[int], int | None]) -> None:
        """``node`` put ``m`` (of ``group``) on the wire. ``term_of(i)``: the term of entry ``i`` in
        its log now (None when unknown)."""
        t = m.type
        if t in _PRE_VOTE:
            return
        self.messages_seen += 1
        key = (node, group)
        if m.term > self.term_sent.get(key, 0):
            self.term_sent[key] = m.term
        if t == _MT.VOTE:
            self._vote(node, group, m.term, m.from_)
        elif t == _MT.VOTE_RESP and not m.reject:
            self._vote(node, group, m.term, m.to)
        elif t == _MT.APP_RESP and not m.reject:
            prev = self.acked.get(key)
            if prev is None or m.term > prev.term or (m.term == prev.term and m.index > prev.index):
                self.acked[key] = _Ack(m.term, m.index, term_of(m.index) if m.index > 0 else None)

    def _vote(self, node: str, group: int, term: int, candidate: Any) -> None:
        prev = self.votes.setdefault((node, group, term), candidate)
        if prev != candidate:
            self.findings.append(("promise_broken", f"{node} group {group}: voted for {prev} and then "
                                  f"for {candidate} in term {term}"))

    def on_left(self, node: str, group: int) -> None:
        """``node`` dropped its copy of ``group``, removed from it (node/boot.py leave_group): the
        entries it acknowledged are no longer promised (its term and vote still are)."""
        self.acked.pop((node, group), None)

    def on_recovered(self, node: str, group: int, term: int, vote: Any, snapshot_index: int, last_index: int,
                     term_at: Callable[[int], int | None]) -> None:
        """``node`` restarted: its replica of ``group`` recovered this hard state and log."""
        self.recoveries_checked += 1
        key = (node, group)
        where = f"{node} group {group}"
        sent = self.term_sent.get(key, 0)
        if term < sent:
            self.findings.append(("promise_broken", f"{where}: sent messages in term {sent} and restarted "
                                  f"in term {term}"))
            return
        granted = self.votes.get((node, group, term))
        if granted is not None and vote != granted:
            self.findings.append(("promise_broken", f"{where}: voted for {granted} in term {term} and "
                                  f"restarted with vote {vote} (free to vote again)"))
        ack = self.acked.get(key)
        if ack is None or ack.term != term or ack.index <= snapshot_index:
            return
        if last_index < ack.index:
            self.findings.append(("promise_broken", f"{where}: acknowledged entries up to {ack.index} in term "
                                  f"{term} and restarted with its log ending at {last_index}"))
            return
        have = term_at(ack.index)
        if ack.entry_term is not None and have != ack.entry_term:
            self.findings.append(("promise_broken", f"{where}: acknowledged entry {ack.index} of term "
                                  f"{ack.entry_term} in term {term}; restarted holding term {have} there"))


class _WalWatch:
    """One WAL as a node's boot opened it: per group, the sequence number of the append that wrote
    each entry still in it (since the boot; recovered entries were durable already), and of the
    hard state that set the current (term, vote); the highest sequence a sync covered."""

    def __init__(self, wal: Any) -> None:
        self.entry_seq: dict[int, dict[int, int]] = {}
        self.vote_seq: dict[int, tuple[int, bytes, int]] = {}
        self.synced = 0
        append, truncate, hard, mark, sync = (wal.append_entries, wal.truncate, wal.set_hard_state,
                                              wal.mark_snapshot, wal.sync)

        def appended(group: int, entries: Any) -> None:
            append(group, entries)
            if entries:
                d = self.entry_seq.setdefault(group, {})
                self._drop_from(d, entries[0][1])
                seq = wal._appended_seq
                for e in entries:
                    d[e[1]] = seq

        def truncated(group: int, from_index: int) -> None:
            truncate(group, from_index)
            self._drop_from(self.entry_seq.get(group, {}), from_index)

        def hard_state(group: int, term: int, vote: bytes, commit: int) -> None:
            hard(group, term, vote, commit)
            prev = self.vote_seq.get(group)
            if prev is None or prev[:2] != (term, bytes(vote)):
                self.vote_seq[group] = (term, bytes(vote), wal._appended_seq)

        def marked(group: int, index: int, term: int) -> None:
            mark(group, index, term)
            d = self.entry_seq.get(group, {})
            for i in [i for i in d if i <= index]:
                del d[i]  # under a snapshot: durable with it

        def synced() -> int:
            seq = int(sync())
            self.synced = max(self.synced, seq)
            return seq

        wal.append_entries, wal.truncate, wal.set_hard_state = appended, truncated, hard_state
        wal.mark_snapshot, wal.sync = marked, synced
        wal._sim_watch = self

    @staticmethod
    def _drop_from(d: dict[int, int], first: int) -> None:
        # A group's watched indexes are one contiguous run (appends continue it or rewrite its
        # tail, truncations cut its tail, snapshot marks its head): drop from ``first`` to its end,
        # not a scan of every index on every append.
        while first in d:
            del d[first]
            first += 1


@dataclass
class DurableAtSend:
    """Messages that promise what the sender's disk does not hold yet (see the module docstring)."""

    watches: dict[str, _WalWatch] = field(default_factory=dict)  # node -> its current boot's WAL
    findings: list[Finding] = field(default_factory=list)
    judged: int = 0

    def watch(self, node: str, wal: Any) -> None:
        """``node``'s boot opened ``wal``: watch it (once)."""
        w = getattr(wal, "_sim_watch", None)
        self.watches[node] = w if isinstance(w, _WalWatch) else _WalWatch(wal)

    def on_send(self, node: str, group: int, m: Message) -> None:
        w = self.watches.get(node)
        if w is None or m.reject:
            return
        t = m.type
        if t == _MT.APP_RESP:
            seq = w.entry_seq.get(group, {}).get(m.index)
            what = f"acknowledged entry {m.index} in term {m.term}"
        elif t in (_MT.VOTE_RESP, _MT.VOTE):
            v = w.vote_seq.get(group)
            seq = v[2] if v is not None and v[0] == m.term else None
            what = f"{'granted' if t == _MT.VOTE_RESP else 'asked for'} a vote in term {m.term}"
        else:
            return
        if seq is None:
            return
        self.judged += 1
        if seq > w.synced:
            self.findings.append(("sent_before_durable", f"{node} group {group}: {what} before a WAL sync "
                                  f"covered it (written at WAL sequence {seq}, synced to {w.synced})"))


@dataclass
class RecoveredLogCheck:
    """A restarted replica's recovered Raft log against the group's committed entries.

    While the run goes, each live replica's newly committed entries are recorded by index with
    their term (``sample``); two replicas committing different terms at one index is
    ``committed_entries_differ``. When a node restarts (``on_recovered``), every entry of its
    recovered log up to its recovered commit index has the committed term where one is known, and
    the recovered log's terms never decrease from its snapshot's term to its last entry (every Raft
    log is a prefix of some leader's log plus nothing else: a deposed leader's entries left after a
    newer snapshot break that). Either is ``recovered_log_differs``."""

    committed: dict[tuple[int, int], int] = field(default_factory=dict)  # (group, index) -> term
    cursor: dict[tuple[str, int], int] = field(default_factory=dict)  # (node, group) -> last recorded
    findings: list[Finding] = field(default_factory=list)
    entries_recorded: int = 0
    logs_checked: int = 0

    def sample(self, node: str, group: int, commit: int, first_index: int, term_of: Callable[[int], int]) -> None:
        """``node``'s replica of ``group`` has committed up to ``commit``; its log holds entries from
        ``first_index``; ``term_of(i)``: the term of entry ``i`` (0 when compacted away)."""
        key = (node, group)
        start = max(self.cursor.get(key, 0) + 1, first_index)
        for i in range(start, commit + 1):
            term = term_of(i)
            if term == 0:
                continue
            prev = self.committed.setdefault((group, i), term)
            if prev == term:
                self.entries_recorded += 1
            elif len(self.findings) < 20:
                self.findings.append(("committed_entries_differ", f"group {group} entry {i}: committed with "
                                      f"term {prev} by one replica, term {term} by {node}"))
        if commit > self.cursor.get(key, 0):
            self.cursor[key] = commit

    def on_recovered(self, node: str, group: int, snapshot_index: int, snapshot_term: int, commit: int,
                     last_index: int, term_of: Callable[[int], int]) -> None:
        self.logs_checked += 1
        where = f"{node} group {group}"
        self.cursor[(node, group)] = min(commit, last_index)
        prev_term, prev_index = snapshot_term, snapshot_index
        for i in range(snapshot_index + 1, last_index + 1):
            term = term_of(i)
            if term < prev_term:
                self.findings.append(("recovered_log_differs", f"{where}: recovered entry {i} of term {term} "
                                      f"after entry {prev_index} of term {prev_term} (snapshot at "
                                      f"{snapshot_index}, log to {last_index}): terms of a log never decrease"))
                return
            if i <= commit:
                known = self.committed.get((group, i))
                if known is not None and known != term:
                    self.findings.append(("recovered_log_differs", f"{where}: recovered entry {i} of term "
                                          f"{term} at or below its commit index {commit}; the group "
                                          f"committed term {known} there"))
                    return
            prev_term, prev_index = term, i


@dataclass
class _Barrier:
    node: str
    group: int
    ctx: bytes
    applied: Callable[[], int]  # the replica's applied index now


@dataclass
class ReadBarrierCheck:
    """Each read barrier against the read index its group answered, judged when it resolves."""

    # (node, group, ctx) -> the index the read returned (a context is unique within a replica only)
    read_index: dict[tuple[str, int, bytes], int] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    resolved: int = 0
    judged: set[tuple[str, int, bytes]] = field(default_factory=set)  # each barrier once

    def on_read_states(self, node: str, group: int, states: Iterable[Any]) -> None:
        """The ``ReadState``s of a Ready, as the core handed them to ``node``'s replica of ``group``."""
        for rs in states:
            self.read_index.setdefault((node, group, bytes(rs.ctx)), rs.index)

    def watch(self, node: str, group: int, ctx: bytes, fut: asyncio.Future[None],
              applied: Callable[[], int]) -> None:
        """A barrier asked with context ``ctx``: judged when its future's callbacks run."""
        b = _Barrier(node, group, ctx, applied)
        fut.add_done_callback(lambda f: self._judge(b, f))

    def judge_now(self, node: str, group: int, ctx: bytes, fut: asyncio.Future[None],
                  applied: Callable[[], int]) -> None:
        """Called right after the host's code ran: a future it resolved is judged with the applied
        index of that moment (the done callback runs a loop pass later, when more may be applied)."""
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            self._check(_Barrier(node, group, ctx, applied))

    def _judge(self, b: _Barrier, fut: asyncio.Future[None]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        self._check(b)

    def _check(self, b: _Barrier) -> None:
        key = (b.node, b.group, b.ctx)
        if key in self.judged:
            return
        self.judged.add(key)
        self.resolved += 1
        index = self.read_index.get(key)
        applied = b.applied()
        if index is None:
            self.findings.append(("read_barrier_early", f"{b.node} group {b.group}: a read barrier passed with "
                                  f"no read index answered for it (applied {applied})"))
        elif applied < index:
            self.findings.append(("read_barrier_early", f"{b.node} group {b.group}: a read barrier passed at "
                                  f"applied index {applied}, below the read index {index} it returned"))


def watch_barriers(check: ReadBarrierCheck, node: str, host: Any) -> None:
    """Instrument one replica (a ``ShardHost``) for ``check``: its ``read_barrier`` futures are
    watched with the context each was asked under, and the ``ReadState``s its Readies carry are
    recorded before the host's own code serves them (``_serve_reads``). The host's comparison of
    applied index and read index is not used: the check makes its own."""
    read_barrier, serve_reads = host.read_barrier, host._serve_reads
    asked: list[tuple[bytes, asyncio.Future[None]]] = []

    def applied() -> int:
        return int(host.state.applied_index)  # the replica's state now (an install replaces it)

    def barrier() -> asyncio.Future[None]:
        fut: asyncio.Future[None] = read_barrier()
        ctx = next(reversed(host.reads.asked), None)
        if ctx is not None and host.reads.asked[ctx] is fut:
            asked.append((ctx, fut))
            check.watch(node, host.shard, ctx, fut, applied)
            check.judge_now(node, host.shard, ctx, fut, applied)
        return fut

    def serve(rd: Any) -> None:
        check.on_read_states(node, host.shard, rd.read_states)
        serve_reads(rd)
        for ctx, fut in asked:
            check.judge_now(node, host.shard, ctx, fut, applied)
        asked[:] = [(c, f) for c, f in asked if not f.done()]

    host.read_barrier = barrier
    host._serve_reads = serve


PIN_WINDOW = 4096  # offsets below a shard's next offset that PinCheck follows, at most


@dataclass
class _PinSample:
    state: ShardState  # the replica's state object (a restart or a new state starts over)
    applied: int
    pins: dict[str, tuple[int, int]]  # reader -> (offset, until_ms)
    present: set[int]  # offsets at or above the lowest pin that were in the message index


@dataclass
class PinCheck:
    """Retention holds back from every live pin (``pinned_released``): see the module docstring.
    ``sample`` every replica often (the runner: each 0.1 virtual s); ``unpinning(reader)`` before
    an unpin of ``reader`` is proposed."""

    samples: dict[tuple[str, int], _PinSample] = field(default_factory=dict)  # (node, shard) -> last
    ending: set[str] = field(default_factory=set)
    findings: list[Finding] = field(default_factory=list)
    judged: int = 0  # (replica, pin, interval) judged with the pin live throughout
    watched: int = 0  # of those, offsets held at or above the pin when the interval began
    _flagged: set[tuple[str, int, str]] = field(default_factory=set)

    def unpinning(self, reader: str) -> None:
        self.ending.add(reader)

    def sample(self, node: str, shard: int, state: ShardState) -> None:
        key = (node, shard)
        raw = state.pins
        if not raw and key not in self.samples:
            return
        topics = state.topics
        meta = topics.meta
        pins = {r: (o, until) for r, (o, until, _owner) in raw.items()}
        prev = self.samples.get(key)
        if prev is not None and prev.state is state and state.applied_index >= prev.applied:
            now = topics.last_ts_ms  # no entry applied since prev had a later time
            for reader, (offset, until) in sorted(prev.pins.items()):
                cur = pins.get(reader)
                if reader in self.ending or cur is None or cur[0] != offset or now > min(until, cur[1]):
                    continue
                self.judged += 1
                held = sorted(x for x in prev.present if x >= offset)
                self.watched += len(held)
                gone = [x for x in held if x not in meta]
                if gone and (node, shard, reader) not in self._flagged:
                    self._flagged.add((node, shard, reader))
                    self.findings.append((
                        "pinned_released",
                        f"{node} shard {shard}: retention released offset(s) {gone[:8]} at or above "
                        f"{reader}'s pin at offset {offset} while it was live (until {min(until, cur[1])} ms; "
                        f"replica time {now} ms, applied index {prev.applied}..{state.applied_index})"))
        if not pins:
            self.samples.pop(key, None)
            return
        floor = max(min(o for o, _ in pins.values()), topics.next_offset - PIN_WINDOW, 0)
        present = {x for x in range(floor, topics.next_offset) if x in meta}
        self.samples[key] = _PinSample(state, state.applied_index, pins, present)


def canonical_state_findings(replicas: Iterable[tuple[str, int, ShardState]]) -> list[Finding]:
    """Each replica's state restored from its own canonical bytes encodes to the same bytes, and
    replicas of one group at the same applied index encode equal. ``replicas``: (node, group, state)."""
    findings: list[Finding] = []
    by_point: dict[tuple[int, int], tuple[str, bytes]] = {}
    for node, group, state in replicas:
        raw = state.snapshot()
        try:
            restored = ShardState.restore(raw, state.topics.limits, state.sessions.max_expiry_s)
            again = restored.snapshot()
        except Exception as exc:  # noqa: BLE001 - a snapshot its own code cannot restore is the finding
            findings.append(("snapshot_not_canonical", f"{node} group {group}: its snapshot at index "
                             f"{state.applied_index} does not restore: {exc!r}"))
            continue
        if again != raw:
            findings.append(("snapshot_not_canonical", f"{node} group {group}: state restored from its snapshot "
                             f"at index {state.applied_index} encodes differently ({len(raw)} vs {len(again)} "
                             f"bytes, first difference at byte {_first_difference(raw, again)})"))
        else:
            live, rebuilt = derived_state(state), derived_state(restored)
            for name in live:
                if live[name] != rebuilt[name]:
                    findings.append(("snapshot_rebuild_differs", f"{node} group {group}: at index "
                                     f"{state.applied_index} the {name} rebuilt by a restore differ from those "
                                     f"kept as it applied: {_some_difference(live[name], rebuilt[name])}"))
        point = (group, state.applied_index)
        ref = by_point.setdefault(point, (node, raw))
        if ref[0] != node and ref[1] != raw:
            findings.append(("snapshot_not_canonical", f"group {group}: {node} and {ref[0]} at applied index "
                             f"{state.applied_index} encode different states"))
    return findings


def derived_state(state: ShardState) -> dict[str, Any]:
    """What a replica keeps beside its canonical state and a restore rebuilds (never snapshotted):
    how many registrations owe each message, their owed bytes, the messages owed to nobody (the
    retention candidates), the $share groups, each principal's persistent sessions. A restore that
    rebuilds them differently from what the replica kept as it applied (a message owed twice counted
    once: released while still owed) shows only much later, after retention."""
    t = state.topics
    owed = t.owed_count
    unowed = {key & OFFSET_MASK for key in t._unowed_heap}  # stale entries (owed again, gone) aside
    return {
        "owed counts": dict(sorted(owed.items())),
        "owed bytes": dict(sorted(t.owed_bytes.items())),
        "unowed messages": sorted(o for o in unowed if o in t.meta and not owed.get(o)),
        "unowed messages missing from the retention heap": sorted(
            o for o, _, _ in t.meta.times() if not owed.get(o) and o not in unowed),
        "$share groups": sorted(t.share_keys),
        "persistent sessions per principal": dict(sorted(state.sessions.persistent.items())),
    }


def _some_difference(a: Any, b: Any) -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted({k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}, key=repr)[:3]
        return ", ".join(f"{k!r}: kept {a.get(k)!r}, rebuilt {b.get(k)!r}" for k in keys)
    if isinstance(a, list) and isinstance(b, list):
        sa, sb = set(a), set(b)
        return f"only kept {sorted(sa - sb)[:5]}, only rebuilt {sorted(sb - sa)[:5]}"
    return f"kept {a!r}, rebuilt {b!r}"


def _first_difference(a: bytes, b: bytes) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))
