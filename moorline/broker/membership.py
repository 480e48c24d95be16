"""The metadata group's member table and shard configurations: who is in the cluster, in what
state, each shard's voter target, and the configuration changes in progress.

Pure and deterministic (applied by every replica of the metadata group, snapshotted with it).
The table starts from the cluster's bootstrap record (``ClusterBootstrap``); afterwards only
commands of this group change it:

- ``MemberAnnounce``: a node's addresses and zone (a new node id is admitted as ``active``; a
  known node with another storage id is refused: its old storage must be forgotten first). A node
  is admitted before it starts (``moorline cluster join``) with an empty storage id, which the
  node's join binds to its own; a forgotten member's name can be admitted again as a new member
  (a new node id: a wiped node replaced), the old record kept as ``NAME@OLD_ID``;
- ``MemberSetState``: ``active``/``draining``/``leaving``/``left``/``forgotten`` (a forgotten
  member never comes back under that storage id);
- ``MoveStart``/``MoveEnd``: at most one configuration change per shard in progress, which is
  what lets an operator's manual change race the reconciler safely: the second is refused here,
  deterministically, before any shard leader proposes it (and a shard leader refuses a second
  pending change too).
"""

from __future__ import annotations

from collections import deque

import msgspec

from moorline.broker import commands as c

MEMBERSHIP_VERSION = 1  # of MembershipSnapshot; a snapshot without one (before it existed) decodes as None

STATES = ("active", "draining", "leaving", "left", "forgotten")
GONE = ("left", "forgotten")  # the reconciler removes these nodes' memberships (shrink before grow)
MOVE_KINDS = ("add_learner", "promote", "remove")
# Which state may follow which: forgotten is final; left only becomes forgotten.
TRANSITIONS: dict[str, tuple[str, ...]] = {
    "active": ("draining", "leaving", "left", "forgotten"),
    "draining": ("active", "leaving", "left", "forgotten"),
    "leaving": ("active", "left", "forgotten"),
    "left": ("forgotten",),
    "forgotten": (),
}
MOVE_HISTORY = 128  # ended moves kept (status shows them; the planner reads each shard's last)


class Member(msgspec.Struct, array_like=True):
    name: str
    node_id: int
    storage_id: str
    cluster: str = ""
    client: str = ""
    zone: str = ""
    state: str = "active"
    since_ms: int = 0

    @property
    def member_id(self) -> tuple[int, str]:
        return (self.node_id, self.storage_id)


class Move(msgspec.Struct, array_like=True):
    id: int
    shard: int
    kind: str
    node: str
    node_id: int
    storage_id: str
    origin: str
    started_ms: int
    ended_ms: int = 0
    outcome: str = ""


class MembershipSnapshot(msgspec.Struct, array_like=True):
    version: int
    members: list[Member]
    targets: list[int]  # per shard: voters wanted (shard.replicas, or every node when fewer)
    moves: list[Move]  # in progress, by shard
    history: list[Move]
    next_move_id: int


class MembershipState:
    def __init__(self, targets: list[int]) -> None:
        self.members: dict[str, Member] = {}
        self.targets = list(targets)
        self.moves: dict[int, Move] = {}  # shard -> the change in progress
        self.history: deque[Move] = deque(maxlen=MOVE_HISTORY)
        self.next_move_id = 1

    @classmethod
    def from_record(cls, record: c.ClusterRecord) -> MembershipState:
        """The table as the bootstrap record describes it: every initial member active, every
        shard's target its initial voter count (addresses and zones come with MemberAnnounce)."""
        st = cls([len(voters) for voters, _ in record.placement])
        for name, node_id, storage_id in record.members:
            st.members[name] = Member(name, node_id, storage_id)
        return st

    # --- queries ---------------------------------------------------------------------------
    def by_node_id(self, node_id: int) -> Member | None:
        for m in self.members.values():
            if m.node_id == node_id:
                return m
        return None

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(STATES, 0)
        for m in self.members.values():
            out[m.state] += 1
        return out

    # --- commands --------------------------------------------------------------------------
    def apply(self, cmd: c.Command) -> object:
        match cmd:
            case c.MemberAnnounce():
                return self.apply_announce(cmd)
            case c.MemberSetState():
                return self.apply_set_state(cmd)
            case c.MoveStart():
                return self.apply_move_start(cmd)
            case c.MoveEnd():
                return self.apply_move_end(cmd)
        raise ValueError(f"not a membership command: {type(cmd).__name__}")

    def apply_announce(self, cmd: c.MemberAnnounce) -> str | None:
        """None when applied; else why not."""
        info = cmd.member
        if not info.name or info.node_id <= 0:
            return "a member needs a name and a positive node id"
        m = self.members.get(info.name)
        if m is not None and m.state == "forgotten" and info.node_id != m.node_id:
            # A new member under a forgotten one's name (a wiped node replaced): the old record
            # stays, renamed, so its node id is never reused and its replicas are still removed.
            if self.by_node_id(info.node_id) is not None:
                return f"node id {info.node_id} is taken"
            old = f"{m.name}@{m.node_id}"
            del self.members[info.name]
            m.name = old
            self.members[old] = m
            m = None
        if m is None:
            if "@" in info.name:
                return "a member's name has no '@'"
            other = self.by_node_id(info.node_id)
            if other is not None:
                return f"node id {info.node_id} is {other.name}'s"
            self.members[info.name] = Member(info.name, info.node_id, info.storage_id, info.cluster, info.client,
                                             info.zone, "active", cmd.ts_ms)
            return None
        if m.node_id != info.node_id:
            return f"{info.name} is node id {m.node_id}, not {info.node_id}"
        if m.state == "forgotten":
            return f"{info.name} was forgotten"
        if m.storage_id != info.storage_id:
            if m.storage_id or not info.storage_id:
                return (f"{info.name} is a member with storage id {m.storage_id}; this one's is {info.storage_id} "
                        f"(a wiped node: forget the old one first)")
            m.storage_id = info.storage_id  # admitted before it started: its join binds its storage
        m.cluster, m.client, m.zone = info.cluster, info.client, info.zone
        return None

    def next_node_id(self) -> int:
        """The node id a new member gets: above every id the table ever gave (forgotten ones too)."""
        return max((m.node_id for m in self.members.values()), default=0) + 1

    def apply_set_state(self, cmd: c.MemberSetState) -> str | None:
        m = self.members.get(cmd.name)
        if m is None:
            return f"no member named {cmd.name}"
        if cmd.state not in STATES:
            return f"unknown member state {cmd.state!r}"
        if cmd.state == m.state:
            return None
        if cmd.state not in TRANSITIONS[m.state]:
            return f"{cmd.name} is {m.state}: it cannot become {cmd.state}"
        m.state = cmd.state
        m.since_ms = cmd.ts_ms
        return None

    def apply_move_start(self, cmd: c.MoveStart) -> Move | str:
        """The move started, or why it was refused."""
        if not 0 <= cmd.shard < len(self.targets) + 1:  # the last group id is the metadata group
            return f"no shard {cmd.shard}"
        if cmd.kind not in MOVE_KINDS:
            return f"unknown change {cmd.kind!r}"
        busy = self.moves.get(cmd.shard)
        if busy is not None:
            return (f"shard {cmd.shard} has a change in progress: {busy.kind} {busy.node} "
                    f"(move {busy.id}, {busy.origin})")
        m = self.members.get(cmd.node)
        if cmd.kind != "remove":
            if m is None or m.member_id != (cmd.node_id, cmd.storage_id):
                return f"{cmd.node} is not a member with storage id {cmd.storage_id}"
            if m.state != "active":
                return f"{cmd.node} is {m.state}: only an active member gets a replica"
        move = Move(self.next_move_id, cmd.shard, cmd.kind, cmd.node, cmd.node_id, cmd.storage_id, cmd.origin,
                    cmd.ts_ms)
        self.next_move_id += 1
        self.moves[cmd.shard] = move
        return move

    def apply_move_end(self, cmd: c.MoveEnd) -> bool:
        move = self.moves.get(cmd.shard)
        if move is None or move.id != cmd.move_id:
            return False  # ended already (two nodes reported it)
        del self.moves[cmd.shard]
        move.ended_ms = cmd.ts_ms
        move.outcome = cmd.outcome
        self.history.append(move)
        return True

    # --- snapshots -------------------------------------------------------------------------
    def to_snapshot(self) -> MembershipSnapshot:
        return MembershipSnapshot(
            version=MEMBERSHIP_VERSION,
            members=[self.members[n] for n in sorted(self.members)],
            targets=list(self.targets),
            moves=[self.moves[s] for s in sorted(self.moves)],
            history=list(self.history),
            next_move_id=self.next_move_id,
        )

    @classmethod
    def from_snapshot(cls, snap: MembershipSnapshot) -> MembershipState:
        if snap.version != MEMBERSHIP_VERSION:
            raise ValueError(f"unsupported membership snapshot version {snap.version}")
        st = cls(snap.targets)
        st.members = {m.name: m for m in snap.members}
        st.moves = {m.shard: m for m in snap.moves}
        st.history.extend(snap.history)
        st.next_move_id = snap.next_move_id
        return st
