"""A scripted in-memory host for ``RaftNode`` groups: the engine behind tests/raft/testdata/*.txt.

Each command returns text (what happened), so scenario tests compare against golden files and
every interleaving is explicit. Messages go to per-node inboxes and move only when a script
says ``deliver-msgs``; Readies are handled only on ``process-ready`` / ``stabilize``. The host
here follows RaftNode's obligations exactly (persist, then send, apply, advance), except where a
command deliberately splits them (``ready-early`` / ``complete-ready`` for async storage).
"""

from __future__ import annotations

import random
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field

from moorline.raft.raft import RaftNode
from moorline.raft.storage import MemoryStorage
from moorline.raft.types import (
    ConfChange,
    ConfChangeType,
    Config,
    ConfState,
    Entry,
    EntryType,
    HardState,
    MemberId,
    Message,
    ProposalDropped,
    RaftBugs,
    Ready,
    Snapshot,
    SnapshotMeta,
    StateRole,
)


def member(node: int, storage: str | None = None) -> MemberId:
    return (node, storage if storage is not None else f"s{node}")


def fmt_member(m: MemberId | None) -> str:
    if m is None:
        return "none"
    return str(m[0]) if m[1] == f"s{m[0]}" else f"{m[0]}@{m[1]}"


def fmt_entry(e: Entry) -> str:
    if e.type == EntryType.CONF_CHANGE:
        cc = ConfChange.decode(e.data)
        return f"{e.term}/{e.index} CONF {cc.type.name.lower()} {fmt_member(cc.member)}"
    if not e.data:
        return f"{e.term}/{e.index} EMPTY"
    return f"{e.term}/{e.index} {e.data.decode('utf-8', 'replace')}"


def fmt_conf(cs: ConfState) -> str:
    v = ",".join(fmt_member(m) for m in cs.voters)
    s = f"voters=({v})"
    if cs.learners:
        s += " learners=(" + ",".join(fmt_member(m) for m in cs.learners) + ")"
    return s


def fmt_msg(m: Message) -> str:
    s = f"{fmt_member(m.from_)}->{fmt_member(m.to)} {m.type.name} term={m.term}"
    t = m.type.name
    if t in ("APP", "VOTE", "PRE_VOTE"):
        s += f" log={m.log_term}/{m.index}"
    if t == "APP":
        s += f" commit={m.commit}"
        if m.entries:
            s += " entries=[" + ", ".join(fmt_entry(e) for e in m.entries) + "]"
    if t == "APP_RESP":
        s += f" index={m.index}"
        if m.reject:
            s += f" reject hint={m.reject_hint}/{m.log_term}"
    if t in ("VOTE_RESP", "PRE_VOTE_RESP") and m.reject:
        s += " reject"
    if t == "HEARTBEAT":
        s += f" commit={m.commit}"
    if t == "READ_INDEX_RESP":
        s += f" index={m.index}"
    if m.snapshot is not None:
        meta = m.snapshot.meta
        s += f" snap={meta.term}/{meta.index} {fmt_conf(meta.conf_state)}"
    if m.context:
        s += f" ctx={m.context.decode('utf-8', 'replace')}"
    return s


def fmt_hs(hs: HardState) -> str:
    return f"term={hs.term} vote={fmt_member(hs.vote)} commit={hs.commit}"


@dataclass
class NodeSlot:
    id: int
    storage_id: str
    storage: MemoryStorage
    raft: RaftNode
    config: Config
    applied: list[Entry] = field(default_factory=list)
    pending: Ready | None = None  # taken by ready-early, not yet completed
    last_role: tuple[StateRole, MemberId | None] | None = None
    crashed: bool = False


class InteractionEnv:
    """Nodes by integer id; inboxes by node id; output lines collected per command."""

    def __init__(self) -> None:
        self.nodes: dict[int, NodeSlot] = {}
        self.inbox: dict[int, list[Message]] = {}
        self.out: list[str] = []
        self.defaults: dict[str, object] = {}
        self.commands: dict[str, Callable[[list[str], dict[str, str]], None]] = {
            "add-nodes": self.cmd_add_nodes,
            "campaign": self.cmd_campaign,
            "propose": self.cmd_propose,
            "propose-conf-change": self.cmd_propose_conf_change,
            "process-ready": self.cmd_process_ready,
            "ready-early": self.cmd_ready_early,
            "complete-ready": self.cmd_complete_ready,
            "deliver-msgs": self.cmd_deliver_msgs,
            "stabilize": self.cmd_stabilize,
            "tick-election": self.cmd_tick_election,
            "tick-heartbeat": self.cmd_tick_heartbeat,
            "status": self.cmd_status,
            "raft-log": self.cmd_raft_log,
            "raft-state": self.cmd_raft_state,
            "read-index": self.cmd_read_index,
            "transfer-leader": self.cmd_transfer_leader,
            "compact": self.cmd_compact,
            "crash": self.cmd_crash,
            "restart": self.cmd_restart,
            "mark-corrupted": self.cmd_mark_corrupted,
            "report-unreachable": self.cmd_report_unreachable,
            "log-level": lambda a, kw: None,
        }

    # -- driver ---------------------------------------------------------------------------
    def run(self, line: str) -> str:
        self.out = []
        toks = shlex.split(line)
        cmd, rest = toks[0], toks[1:]
        args = [t for t in rest if "=" not in t]
        kw = dict(t.split("=", 1) for t in rest if "=" in t)
        fn = self.commands.get(cmd)
        if fn is None:
            raise ValueError(f"unknown command {cmd!r}")
        fn(args, kw)
        return "\n".join(self.out) if self.out else "ok"

    def emit(self, s: str) -> None:
        self.out.append(s)

    def _ids(self, args: list[str]) -> list[int]:
        return [int(a) for a in args] if args else sorted(self.nodes)

    # -- commands ---------------------------------------------------------------------------
    def cmd_add_nodes(self, args: list[str], kw: dict[str, str]) -> None:
        """add-nodes N [voters=(1,2,3)] [learners=(4)] [index=2] [config options]"""
        n = int(args[0])
        start = max(self.nodes, default=0) + 1
        new_ids = list(range(start, start + n))
        voters = _parse_ids(kw.get("voters")) if "voters" in kw else new_ids
        learners = _parse_ids(kw.get("learners")) if "learners" in kw else []
        index = int(kw.get("index", "0"))
        for i in new_ids:
            storage = MemoryStorage()
            if index > 0:
                cs = ConfState.of([member(v) for v in voters], [member(x) for x in learners])
                storage.apply_snapshot(Snapshot(meta=SnapshotMeta(index=index, term=1, conf_state=cs)))
                storage.set_hard_state(HardState(term=1, vote=None, commit=index))
            cfg = self._config(i, f"s{i}", kw)
            self._install(i, f"s{i}", storage, cfg)
            self.emit(
                f"INFO node {i} starts: term={storage.hard_state().term} {fmt_conf(storage.initial_state()[1])}"
            )

    def _config(self, i: int, sid: str, kw: dict[str, str]) -> Config:
        bugs = RaftBugs(**{b: True for b in _parse_names(kw.get("bugs"))})
        return Config(
            id=member(i, sid),
            election_tick=int(kw.get("election_tick", "10")),
            heartbeat_tick=int(kw.get("heartbeat_tick", "1")),
            max_entries_per_append=int(kw.get("max_entries", "4096")),
            max_bytes_per_append=int(kw.get("max_bytes", str(1 << 20))),
            max_inflight_appends=int(kw.get("max_inflight", "256")),
            max_uncommitted_bytes=int(kw.get("max_uncommitted", str(64 << 20))),
            pre_vote=kw.get("prevote", "true") == "true",
            check_quorum=kw.get("checkquorum", "true") == "true",
            rng=random.Random(i),
            bugs=bugs,
        )

    def _install(self, i: int, sid: str, storage: MemoryStorage, cfg: Config) -> None:
        node = RaftNode(cfg, storage)
        self.nodes[i] = NodeSlot(i, sid, storage, node, cfg)
        self.inbox.setdefault(i, [])
        self.nodes[i].last_role = (node.role, node.lead)

    def cmd_campaign(self, args: list[str], kw: dict[str, str]) -> None:
        self.nodes[int(args[0])].raft.campaign()
        self._note_role(self.nodes[int(args[0])])

    def cmd_propose(self, args: list[str], kw: dict[str, str]) -> None:
        slot = self.nodes[int(args[0])]
        count = int(kw.get("count", "1"))
        for k in range(count):
            data = args[1] if count == 1 else f"{args[1]}{k}"
            try:
                idx = slot.raft.propose(data.encode())
            except ProposalDropped as exc:
                self.emit(f"dropped: {exc}")
                return
        if count == 1:
            self.emit(f"index {idx}")

    def cmd_propose_conf_change(self, args: list[str], kw: dict[str, str]) -> None:
        slot = self.nodes[int(args[0])]
        kinds = {
            "add-voter": ConfChangeType.ADD_VOTER,
            "add-learner": ConfChangeType.ADD_LEARNER,
            "remove": ConfChangeType.REMOVE,
            "promote": ConfChangeType.PROMOTE,
        }
        node_id = int(args[2])
        sid = kw.get("storage", f"s{node_id}")
        try:
            idx = slot.raft.propose_conf_change(ConfChange(kinds[args[1]], member(node_id, sid)))
        except ProposalDropped as exc:
            self.emit(f"dropped: {exc}")
            return
        self.emit(f"index {idx}")

    def _note_role(self, slot: NodeSlot) -> None:
        r = slot.raft
        now = (r.role, r.lead)
        if now != slot.last_role:
            slot.last_role = now
            self.emit(f"{slot.id} is {r.role.name} term={r.term} leader={fmt_member(r.lead)}")

    def _send_all(self, msgs: list[Message]) -> None:
        for m in msgs:
            slot = self.nodes.get(m.to[0])
            if slot is not None and slot.crashed:
                continue  # lost with the crashed node
            self.inbox.setdefault(m.to[0], []).append(m)

    def _persist(self, slot: NodeSlot, rd: Ready) -> None:
        st = slot.storage
        if rd.snapshot is not None:
            st.apply_snapshot(rd.snapshot)
        if rd.entries:
            st.append(rd.entries)
        if rd.hard_state is not None:
            st.set_hard_state(rd.hard_state)

    def _print_ready(self, slot: NodeSlot, rd: Ready, early_only: bool = False) -> None:
        self.emit(f"> {slot.id} handling Ready" + (" (early)" if early_only else ""))
        if rd.hard_state is not None:
            self.emit(f"  HardState {fmt_hs(rd.hard_state)}" + (" must_sync" if rd.must_sync else ""))
        if rd.snapshot is not None:
            meta = rd.snapshot.meta
            self.emit(f"  Snapshot {meta.term}/{meta.index} {fmt_conf(meta.conf_state)}")
        if rd.entries:
            self.emit("  Entries: " + ", ".join(fmt_entry(e) for e in rd.entries))
        if rd.early_messages:
            self.emit("  Early messages (sent before sync):")
            for m in rd.early_messages:
                self.emit("    " + fmt_msg(m))
        if early_only:
            return
        if rd.messages:
            self.emit("  Messages (sent after sync):")
            for m in rd.messages:
                self.emit("    " + fmt_msg(m))
        if rd.committed_entries:
            self.emit("  Committed: " + ", ".join(fmt_entry(e) for e in rd.committed_entries))
        for rs in rd.read_states:
            self.emit(f"  ReadState index={rs.index} ctx={rs.ctx.decode()}")

    def _finish(self, slot: NodeSlot, rd: Ready) -> None:
        self._persist(slot, rd)
        self._send_all(rd.messages)
        slot.applied.extend(rd.committed_entries)
        slot.raft.advance(rd)
        if any(e.type == EntryType.CONF_CHANGE for e in rd.committed_entries):
            slot.storage.set_conf_state(slot.raft.conf_state)
            self.emit(f"  {slot.id} applied conf: {fmt_conf(slot.raft.conf_state)}")
        self._note_role(slot)

    def process_ready(self, slot: NodeSlot) -> bool:
        if slot.crashed or slot.pending is not None or not slot.raft.has_ready():
            return False
        rd = slot.raft.ready()
        self._note_role(slot)
        self._print_ready(slot, rd)
        self._send_all(rd.early_messages)
        self._finish(slot, rd)
        return True

    def cmd_process_ready(self, args: list[str], kw: dict[str, str]) -> None:
        for i in self._ids(args):
            self.process_ready(self.nodes[i])

    def cmd_ready_early(self, args: list[str], kw: dict[str, str]) -> None:
        """Take a Ready and send only its early messages; the sync is still in flight."""
        for i in self._ids(args):
            slot = self.nodes[i]
            if slot.pending is not None or not slot.raft.has_ready():
                continue
            rd = slot.raft.ready()
            self._note_role(slot)
            self._print_ready(slot, rd, early_only=True)
            self._send_all(rd.early_messages)
            slot.pending = rd

    def cmd_complete_ready(self, args: list[str], kw: dict[str, str]) -> None:
        """The sync of a Ready taken by ready-early finished: send the rest, apply, advance."""
        for i in self._ids(args):
            slot = self.nodes[i]
            rd = slot.pending
            if rd is None:
                continue
            slot.pending = None
            self.emit(f"> {slot.id} sync done")
            if rd.messages:
                self.emit("  Messages (sent after sync):")
                for m in rd.messages:
                    self.emit("    " + fmt_msg(m))
            if rd.committed_entries:
                self.emit("  Committed: " + ", ".join(fmt_entry(e) for e in rd.committed_entries))
            self._finish(slot, rd)

    def deliver(self, i: int) -> int:
        msgs = self.inbox.get(i, [])
        self.inbox[i] = []
        slot = self.nodes.get(i)
        n = 0
        for m in msgs:
            if slot is None or slot.crashed:
                self.emit(f"  dropped (node down): {fmt_msg(m)}")
                continue
            self.emit(fmt_msg(m))
            slot.raft.step(m)
            n += 1
            self._note_role(slot)
        return n

    def cmd_deliver_msgs(self, args: list[str], kw: dict[str, str]) -> None:
        drop = _parse_ids(kw.get("drop")) if "drop" in kw else []
        for i in drop:
            for m in self.inbox.get(i, []):
                self.emit(f"dropped: {fmt_msg(m)}")
            self.inbox[i] = []
        targets = [int(a) for a in args] if args else ([] if drop else sorted(self.inbox))
        for i in targets:
            self.deliver(i)

    def cmd_stabilize(self, args: list[str], kw: dict[str, str]) -> None:
        ids = self._ids(args)
        for _ in range(10_000):
            progressed = False
            for i in ids:
                progressed |= self.process_ready(self.nodes[i])
            for i in ids:
                if self.inbox.get(i):
                    self.deliver(i)
                    progressed = True
            if not progressed:
                return
        raise RuntimeError("stabilize did not converge")

    def cmd_tick_election(self, args: list[str], kw: dict[str, str]) -> None:
        for i in self._ids(args):
            r = self.nodes[i].raft
            if r.role == StateRole.LEADER:
                n = r.cfg.election_tick
            else:
                n = max(1, r.randomized_election_timeout - r.election_elapsed)
            for _ in range(n):
                r.tick()
            self._note_role(self.nodes[i])

    def cmd_tick_heartbeat(self, args: list[str], kw: dict[str, str]) -> None:
        for i in self._ids(args):
            r = self.nodes[i].raft
            for _ in range(r.cfg.heartbeat_tick):
                r.tick()
            self._note_role(self.nodes[i])

    def cmd_status(self, args: list[str], kw: dict[str, str]) -> None:
        for i in self._ids(args):
            st = self.nodes[i].raft.status()
            self.emit(
                f"{i}: {st.role.name} term={st.term} vote={fmt_member(st.vote)} leader={fmt_member(st.leader)} "
                f"commit={st.commit} applied={st.applied} last={st.last_index}"
                + (" corrupted" if st.corrupted else "")
            )
            for mid, desc in st.progress.items():
                self.emit(f"  {fmt_member(mid)}: {desc}")

    def cmd_raft_log(self, args: list[str], kw: dict[str, str]) -> None:
        slot = self.nodes[int(args[0])]
        log = slot.raft.log
        lo, hi = log.first_index(), log.last_index()
        if lo > hi:
            self.emit(f"log is empty: first index={lo}, last index={hi}")
            return
        for e in log.slice(lo, hi + 1, 1 << 62):
            self.emit(fmt_entry(e))

    def cmd_raft_state(self, args: list[str], kw: dict[str, str]) -> None:
        for i in sorted(self.nodes):
            r = self.nodes[i].raft
            down = " (down)" if self.nodes[i].crashed else ""
            conf = fmt_conf(r.active_conf_state)
            self.emit(f"{i}: {r.role.name} term={r.term} leader={fmt_member(r.lead)} {conf}{down}")

    def cmd_read_index(self, args: list[str], kw: dict[str, str]) -> None:
        try:
            self.nodes[int(args[0])].raft.read_index(args[1].encode())
        except ProposalDropped as exc:
            self.emit(f"dropped: {exc}")

    def cmd_transfer_leader(self, args: list[str], kw: dict[str, str]) -> None:
        try:
            self.nodes[int(args[0])].raft.transfer_leader(member(int(args[1])))
        except ProposalDropped as exc:
            self.emit(f"dropped: {exc}")

    def cmd_compact(self, args: list[str], kw: dict[str, str]) -> None:
        """compact N INDEX: snapshot the applied state at INDEX and drop the log up to it."""
        slot = self.nodes[int(args[0])]
        index = int(args[1])
        snap = slot.storage.create_snapshot(index, slot.raft.conf_state, b"")
        slot.storage.compact(index)
        self.emit(
            f"{slot.id}: snapshot {snap.meta.term}/{snap.meta.index}, log from {slot.storage.first_index()}"
        )

    def cmd_crash(self, args: list[str], kw: dict[str, str]) -> None:
        for i in self._ids(args):
            slot = self.nodes[i]
            slot.crashed = True
            slot.pending = None  # an unfinished sync is lost
            self.inbox[i] = []

    def cmd_restart(self, args: list[str], kw: dict[str, str]) -> None:
        """restart N [wipe=NEWSTORAGEID]: start from stable storage (or from nothing, as a new member)."""
        i = int(args[0])
        old = self.nodes[i]
        if "wipe" in kw:
            sid = kw["wipe"]
            storage = MemoryStorage()
        else:
            sid = old.storage_id
            storage = old.storage
        cfg = self._config(i, sid, kw)
        self._install(i, sid, storage, cfg)
        self.inbox[i] = []
        hs, cs = storage.initial_state()
        self.emit(f"INFO node {i} restarts as {fmt_member((i, sid))}: {fmt_hs(hs)} {fmt_conf(cs)}")

    def cmd_mark_corrupted(self, args: list[str], kw: dict[str, str]) -> None:
        slot = self.nodes[int(args[0])]
        slot.raft.mark_corrupted()
        self._note_role(slot)

    def cmd_report_unreachable(self, args: list[str], kw: dict[str, str]) -> None:
        self.nodes[int(args[0])].raft.report_unreachable(member(int(args[1])))


def _parse_ids(s: str | None) -> list[int]:
    if not s:
        return []
    return [int(x) for x in s.strip("()").split(",") if x.strip()]


def _parse_names(s: str | None) -> list[str]:
    if not s:
        return []
    return [x.strip() for x in s.strip("()").split(",") if x.strip()]
