"""The reading side of a reader feed (``reader_feed.py``): how a node serves sessions from a shard
it holds no replica of.

``ShardReader`` (``ShardHost.reader``) is active while this node is no member of the shard's group
(``shard.learners = "none"``). It asks the shard's leader for a feed (``Follow``, with every client
this node serves), applies the feed's items in order to a partial ``ShardState`` that replaces
the host's (so every reader of ``host.state`` — delivery, subscriptions, lifecycle — works on it
unchanged), keeps the bodies of the messages its clients are owed in memory (nothing of the shard
is written to this node's disk), and resolves its own proposals' waiters with the results the
leader sent. Proposals go to the leader that feeds it (``ShardHost.proposal_lead``).

A leader that stops answering (``silence_s``), a ``NotLeader``, or an item this node cannot apply
makes it follow again: the hinted leader, else the next node in turn; the new feed starts from a
partial snapshot at or past the index this node had (never an older view).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from moorline import coverage
from moorline.broker.effects import Effects
from moorline.broker.follower_filter import (
    FollowerDiverged,
    SetSession,
    apply_reduced,
    merge_partial,
    restore_partial,
)
from moorline.broker.messages import StoredMessage
from moorline.broker.shard import ShardState
from moorline.broker.topic_state import TopicLimits
from moorline.node.replication import reader_feed as rf
from moorline.node.replication.proposer import IN_GROUP, GroupEnd, resolve_waiter
from moorline.raft.types import ConfState

if TYPE_CHECKING:
    from moorline.node.replication.shard_host import ShardHost

log = logging.getLogger("moorline.reader")

# An ask of the feed (a client's part, a barrier) unanswered for this many silence periods makes
# the reader follow anew (the leader answers them in the feed's order, well within one).
ADD_TIMEOUT_FACTOR = 2


class ShardReader:
    def __init__(self, host: ShardHost, me: int, nodes: Callable[[], list[int]], send: Callable[[int, bytes], None],
                 clock: Callable[[], float], limits: TopicLimits, max_session_expiry_s: int,
                 on_reload: Callable[[ShardHost], None], on_session: Callable[[ShardHost, str, Any], None],
                 silence_s: float = 3.0, follow_retry_s: float = 1.0) -> None:
        self.host = host
        self.me = me
        self.nodes = nodes  # the cluster's node ids (who may lead)
        self.send = send
        self.clock = clock
        self.limits = limits
        self.max_session_expiry_s = max_session_expiry_s
        self.on_reload = on_reload  # the partial state was replaced: sessions reload what they deliver
        self.on_session = on_session  # (host, client id, session record or None) set by the leader
        self.silence_s = silence_s
        self.follow_retry_s = follow_retry_s
        self.clients: dict[str, None] = {}  # what the feed carries: served and wanted
        self.served: dict[str, None] = {}  # clients connected (or connecting) here
        self.interest: dict[str, None] = {}  # clients whose sessions leader-side work here reads
        self.known: set[str] = set()  # clients whose part is applied here
        self._waiters: list[tuple[set[str], asyncio.Future[None]]] = []
        self.messages: dict[int, StoredMessage] = {}
        self.lead = 0  # the node feeding us (0: none yet)
        self.feed_id: int | None = None
        self.expected = 0  # the next item's number
        self.started = False  # a start applied (host.state is the partial state)
        self.followed_at = -1e18
        self.heard_at = 0.0
        self._try = 0
        self._asked_at = 0.0
        self._hinted = False  # ``lead`` is a NotLeader's hint: asked next, not skipped
        self._next_req = 0
        # Requests of the feed not answered yet: req -> (clients, the barrier's future or None).
        self._adds: dict[int, tuple[list[str], asyncio.Future[None] | None]] = {}
        self.member = False  # this node joined the group: the log itself replaces the feed
        self.items_applied = 0
        self.restarts = 0
        # The group's configuration and members' lags as its leader last told (GroupInfo); None
        # until it has. This node's own core never learns them: it is no member.
        self.conf: ConfState | None = None
        self.lag: dict[tuple[int, str], int] = {}
        self.info_at = -1e18

    @property
    def active(self) -> bool:
        return not self.member

    # -- the node's asks --
    def add(self, clients: list[str]) -> asyncio.Future[None]:
        """Serve ``clients`` from this shard too: done when their part is applied here."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.served.update(dict.fromkeys(clients))
        self._ask(clients)
        self._waiters.append((set(clients), fut))
        self._wake()
        return fut

    def want(self, clients: set[str]) -> None:
        """The clients whose sessions this node's leader-side work reads (their session records, for
        the shards it leads: $share dispatch, ended members' claims, follow-ups): followed too,
        and only they beside the served ones."""
        gone = [x for x in self.interest if x not in clients and x not in self.served]
        self.interest = dict.fromkeys(sorted(clients))
        self._ask(list(self.interest))
        self._drop(gone)

    def knows(self, client_id: str) -> bool:
        """Whether this partial state holds ``client_id``'s part (its session record, if any)."""
        return self.started and client_id in self.known

    def _ask(self, clients: list[str]) -> None:
        new = [x for x in clients if x not in self.clients]
        if not new:
            return
        self.clients.update(dict.fromkeys(new))
        req = self._req()
        self._adds[req] = (new, None)
        if self.feed_id is not None and self.started:
            self.send(self.lead, rf.encode(rf.Add(self.host.shard, self.feed_id, req, new)))

    def _wake(self) -> None:
        if not self.started or not self._waiters:
            return
        still = []
        for want, fut in self._waiters:
            if fut.done():
                continue
            if want <= self.known:
                fut.set_result(None)
            else:
                still.append((want, fut))
        self._waiters = still

    def barrier(self) -> asyncio.Future[None]:
        """A read barrier through the feed: done once this node applied what the leader had applied
        after its own read barrier (an empty part asked for, answered in the feed's order)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        req = self._req()
        self._adds[req] = ([], fut)
        if self.feed_id is not None and self.started:
            self.send(self.lead, rf.encode(rf.Add(self.host.shard, self.feed_id, req, [])))
        return fut  # (not started: asked of the feed once it starts)

    def remove(self, clients: list[str]) -> None:
        """This node serves ``clients`` no more."""
        for x in clients:
            self.served.pop(x, None)
        self._drop([x for x in clients if x not in self.interest])

    def _drop(self, clients: list[str]) -> None:
        gone = [x for x in clients if x in self.clients]
        for x in gone:
            del self.clients[x]
            self.known.discard(x)
        if gone and self.feed_id is not None:
            self.send(self.lead, rf.encode(rf.Remove(self.host.shard, self.feed_id, gone)))

    def _req(self) -> int:
        if not self._adds:
            self._asked_at = self.clock()  # the oldest unanswered ask's time (reset as asks are answered)
        self._next_req += 1
        return self._next_req

    # -- time --
    def tick(self) -> None:
        if self.member:
            return
        if self.host.node_member():
            self.become_member()
            return
        now = self.clock()
        if self.feed_id is None:
            if now - self.followed_at >= self.follow_retry_s:
                if not self._hinted:
                    self.lead = 0  # no start from the node asked: the next one in turn
                self._hinted = False
                self._follow(now)
        elif self._waiters and now - self._asked_at >= ADD_TIMEOUT_FACTOR * self.silence_s:
            self._waiters = [(want, fut) for want, fut in self._waiters if not fut.done()]
            if any(not want <= self.known for want, _ in self._waiters):
                # Clients waited for and not held, with nothing asked of the feed that would bring
                # them (sim --cluster seed 123): a new feed starts with every client this node has.
                log.info("shard %d: clients waited for are not held: following anew", self.host.shard)
                coverage.hit("reader_followed_anew")
                self._follow(now)
        elif self._adds and now - self._asked_at >= ADD_TIMEOUT_FACTOR * self.silence_s:
            # A part asked for and never answered (lost with a leader that then lost a barrier):
            # a new feed answers every ask again.
            log.info("shard %d: node %d's feed answered no ask for %.1f s: following anew", self.host.shard,
                     self.lead, now - self._asked_at)
            coverage.hit("reader_followed_anew")
            self._follow(now)
        elif now - self.heard_at >= self.silence_s:
            log.info("shard %d: no word from node %d's feed for %.1f s: following anew", self.host.shard, self.lead,
                     now - self.heard_at)
            self.lead = 0
            coverage.hit("reader_followed_anew")
            self._follow(now)

    def _follow(self, now: float) -> None:
        self._asked_at = now
        nodes = [n for n in self.nodes() if n != self.me]
        if not nodes:
            return
        if self.lead == 0 or self.lead == self.me:
            self.lead = nodes[self._try % len(nodes)]
            self._try += 1
        self.feed_id = None
        self.followed_at = now
        self.send(self.lead, rf.encode(rf.Follow(self.host.shard, list(self.clients), self.host.state.applied_index)))
        self.host.proposer_lead_changed()

    def become_member(self) -> None:
        """This node is in the group now (its leader sends it the log): the partial state goes
        before anything of the log is applied (an empty state at index 0, as the empty log is; the
        leader's entries or snapshot rebuild the whole shard here)."""
        if self.member:
            return
        self.member = True
        self.feed_id = None
        coverage.hit("reader_became_member")
        host = self.host
        if self.started:
            self.started = False
            host.state = ShardState(host.shard, host.state.topics.incarnation, self.limits, self.max_session_expiry_s)
            self.messages = {}
            self.on_reload(host)
        for _, fut in self._adds.values():
            if fut is not None and not fut.done():
                fut.set_result(None)  # the log serves them from now on
        self._adds.clear()
        for _, fut in self._waiters:
            if not fut.done():
                fut.set_result(None)
        self._waiters = []

    def leave(self, served: list[str]) -> None:
        """This node left the group (its host dropped its copy: boot.Startup.leave_group): read it
        through a feed again, from an empty state, for ``served`` (every client connected here:
        while a member it followed nobody)."""
        self.served.update(dict.fromkeys(served))
        self.clients.update(dict.fromkeys(served))
        self.member = False
        self.started = False
        self.feed_id = None
        self.lead = 0
        self.messages = {}
        self.known = set()
        self.followed_at = -1e18
        coverage.hit("reader_left_group")
        self.on_reload(self.host)

    # -- messages from leaders --
    def on_message(self, peer: int, msg: rf.Msg) -> None:
        if self.member:
            return
        if type(msg) is rf.NotLeader:
            if peer != self.lead:
                return
            if msg.lead == -1:
                return  # it sees us as a member: our core hears from it next (tick notices)
            if msg.feed_id not in (-1, self.feed_id) and self.feed_id is not None:
                return  # about a feed we no longer read
            self.feed_id = None
            self.lead = msg.lead if msg.lead > 0 else 0
            self._hinted = msg.lead > 0
            self.followed_at = -1e18 if msg.lead > 0 else self.clock()  # a hint: at once
            self.host.proposer_lead_changed()
        elif type(msg) is rf.Items:
            self._on_items(peer, msg)
        elif type(msg) is rf.GroupInfo and peer == self.lead:
            self.conf = ConfState.of(msg.voters, msg.learners)
            self.lag = {tuple(m): n for m, n in msg.lag}  # type: ignore[misc]
            self.info_at = self.clock()

    def _on_items(self, peer: int, msg: rf.Items) -> None:
        if peer != self.lead:
            return
        if self.feed_id is None or msg.feed_id != self.feed_id:
            if msg.first_seq != 0 or not msg.items or (self.feed_id is not None and msg.feed_id < self.feed_id):
                return  # not the start of the feed we asked for
            self.feed_id = msg.feed_id
            self.expected = 0
        self.heard_at = self.clock()
        applied_any = False
        seq = msg.first_seq
        for data in msg.items:
            if seq == self.expected:
                try:
                    self._apply(rf.decode_item(data))
                except (FollowerDiverged, ValueError, TypeError, KeyError) as exc:
                    log.warning("shard %d: item %d of node %d's feed does not apply here (%s): following anew",
                                self.host.shard, seq, peer, exc)
                    self.restarts += 1
                    self._follow(self.clock())
                    return
                self.expected += 1
                applied_any = True
            seq += 1
        if applied_any or msg.first_seq > self.expected or (msg.items and msg.first_seq < self.expected):
            # applied (or a gap, or a repeat): say where we are; the leader sends after it
            self.send(self.lead, rf.encode(rf.Ack(self.host.shard, msg.feed_id, self.expected - 1)))

    # -- apply --
    def _apply(self, item: rf.Item) -> None:
        host = self.host
        fx = Effects()
        if isinstance(item, rf.StartItem):
            snap = item.snap
            if self.started and snap.applied_index < host.state.applied_index:
                raise FollowerDiverged(f"a start at {snap.applied_index} for a reader at {host.state.applied_index}")
            state = restore_partial(snap, self.limits, self.max_session_expiry_s, fx)
            if item.proposals is not None:
                state.proposals[self.me] = item.proposals
            host.state = state
            self.messages = {o: m for o, _, m in fx.appends}
            coverage.hit("reader_feed_started")
            self.started = True
            self.items_applied += 1
            asked = set(snap.clients)
            self.known = set(asked)
            for req, (clients, _) in list(self._adds.items()):
                if clients and all(x in asked for x in clients):
                    del self._adds[req]
                else:  # asked for after the Follow went (or a barrier): asked of this feed, in turn
                    self.send(self.lead, rf.encode(rf.Add(host.shard, self.feed_id or 0, req, clients)))
            missing = [x for x in self.clients if x not in asked and not any(x in a for a, _ in self._adds.values())]
            if missing:  # (asked of the feed before, and lost with it)
                req = self._req()
                self._adds[req] = (missing, None)
                self.send(self.lead, rf.encode(rf.Add(host.shard, self.feed_id or 0, req, missing)))
            self._wake()
            for boot, seq, res in item.results:  # answered by the shard before this feed: answered now
                own = host.proposer.take_own_seq(boot, seq)
                if own is not None:
                    _resolve(own.futures, [rf.result_in(r, cmd) for r, cmd in zip(res, own.commands, strict=False)])
            host.proposer.settle_after_install()
            self.on_reload(host)
            return
        if not self.started:
            raise FollowerDiverged("an item before the feed's start")
        state = host.state
        if isinstance(item, rf.MergeItem):
            part = item.part
            if part.applied_index < state.applied_index:
                raise FollowerDiverged(f"a part at {part.applied_index} for a reader at {state.applied_index}")
            state.applied_index = part.applied_index  # entries between had nothing for us
            merge_partial(state, part, fx)
            coverage.hit("reader_part_merged")
            self._keep(fx)
            self.items_applied += 1
            self.known.update(x for x in part.clients if x in self.clients)
            added = self._adds.pop(item.req, None)
            self._asked_at = self.clock()  # (an ask answered: the feed is alive; the rest wait from now)
            if added is not None and added[1] is not None and not added[1].done():
                added[1].set_result(None)
            self._wake()
            self.on_reload(host)
            return
        entry = item.entry
        if entry.index < state.applied_index:
            raise FollowerDiverged(f"entry {entry.index} for a reader at {state.applied_index}")
        results = apply_reduced(state, entry, fx)
        del results  # ours come from the leader: S's apply replays only what touches its clients
        self._keep(fx)
        self.items_applied += 1
        if item.own_seq >= 0:
            own = host.proposer.take_own_seq(item.own_boot, item.own_seq)
            if own is not None:
                res = [rf.result_in(r, cmd) for r, cmd in zip(item.own_results, own.commands, strict=False)]
                _resolve(own.futures, res)
        for op in entry.ops:
            if type(op) is SetSession:
                self.on_session(host, op.client_id, op.session)
        host.hooks.on_effects(host, fx)

    def _keep(self, fx: Effects) -> None:
        for o, _, m in fx.appends:
            self.messages[o] = m
        for o in fx.releases:
            self.messages.pop(o, None)


def _resolve(futs: list[Any], results: list[Any]) -> None:
    if len(futs) != len(results):
        err = ValueError(f"{len(futs)} waiters for {len(results)} results")
        for fut in futs:
            resolve_waiter(fut, None, err)
        return
    for k, fut in enumerate(futs):
        if fut is None or fut is IN_GROUP:
            continue
        if type(fut) is GroupEnd:
            resolve_waiter(fut, results[k + 1 - fut.size:k + 1], None)
        else:
            resolve_waiter(fut, results[k], None)

