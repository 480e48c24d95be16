"""Reader feeds (issue 32): a shard's leader feeds the nodes that hold no replica of it.

A node S that is no member of shard X's group (``shard.learners = "none"``: X lives on its voters
only) still serves sessions whose session record or registrations live in X. X's leader keeps one
*feed* per such node: a ``FollowerFilter`` (moorline/broker/follower_filter.py) that reduces every
entry the leader applies to what touches the clients S serves, and a queue of numbered items S
has not acknowledged yet. S applies them, in order, to a partial state (``reader.py``).

Items, numbered from 0 per feed (a feed is one (leader, S) pairing, named by ``feed_id``):

- ``StartItem`` (always item 0): the partial snapshot of S's clients at the leader's applied index;
- ``EntryItem``: an entry reduced for S, with the results of S's own proposals in it (S resolves
  its waiters from them: its partial apply does not replay everything that answers them);
- ``MergeItem``: the part of clients S starts serving (asked by ``Add``), at the index the
  leader was at when it took it: every reduced entry before it in the queue is older, every one
  after it newer (the filter includes them from then on).

Delivery is at-least-once in order: the leader sends while fewer than ``max_items`` items (and
``max_bytes``) are unacknowledged, S acknowledges the highest item it applied, a gap or silence
makes the leader send again from the one after the acknowledged (``resend_s``), and S drops
duplicates by number. A feed ends when the leader stops leading, when S asks for a new one
(``Follow``: after its own restart, a gap it cannot close, or a move to a new leader), or when S
joins the group (a learner or voter gets the log itself). Monotonic views: a new feed starts, and
an ``Add`` is answered, only after a read barrier on the leader (its state holds everything the
group had committed when asked), and S takes a feed's start only at or past the index it had.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from moorline import coverage
from moorline.broker import commands as c
from moorline.broker.effects import Effects
from moorline.broker.follower_filter import FollowerFilter, PartialSnapshot, ReducedEntry
from moorline.broker.messages import StoredMessage

if TYPE_CHECKING:
    from moorline.node.replication.shard_host import ShardHost

log = logging.getLogger("moorline.reader")

PAYLOAD_KIND = "rd"


# --- items (leader -> reader, inside Items) -------------------------------------------------------


class StartItem(msgspec.Struct, tag="st", array_like=True):
    snap: PartialSnapshot
    proposals: tuple[int, int] | None  # the shard's admission record of the reader's node
    # The results of the reader's latest proposals the shard applied (boot, seq, each result
    # encoded): a feed that starts after a leader change still answers the ones the old one did not.
    results: list[tuple[int, int, list[bytes]]] = []


class EntryItem(msgspec.Struct, tag="en", array_like=True):
    entry: ReducedEntry
    own_boot: int = -1  # the reader's proposal this entry is (head boot, seq), with its results
    own_seq: int = -1
    own_results: list[bytes] = []  # each msgpack-encoded (result_out)


class MergeItem(msgspec.Struct, tag="mg", array_like=True):
    req: int
    part: PartialSnapshot


Item = StartItem | EntryItem | MergeItem


# --- messages (Payload "rd") ---------------------------------------------------------------------


class Follow(msgspec.Struct, tag="f", array_like=True):
    """Reader -> a node it takes for the leader: start a feed for ``clients`` (a new one, always)."""

    shard: int
    clients: list[str]
    have_index: int  # the reader's applied index: the start comes at or past it


class Add(msgspec.Struct, tag="a", array_like=True):
    shard: int
    feed_id: int
    req: int
    clients: list[str]


class Remove(msgspec.Struct, tag="r", array_like=True):
    shard: int
    feed_id: int
    clients: list[str]


class Ack(msgspec.Struct, tag="k", array_like=True):
    """Reader -> leader: every item up to ``seq`` is applied (also: "send again after it")."""

    shard: int
    feed_id: int
    seq: int


class Items(msgspec.Struct, tag="i", array_like=True):
    shard: int
    feed_id: int
    first_seq: int
    items: list[bytes]  # encoded Item, numbered first_seq, first_seq + 1, ...


class NotLeader(msgspec.Struct, tag="n", array_like=True):
    """Leader-to-be -> reader: not (or no longer) feeding this shard; ``lead`` is the node it
    takes for the leader (0: none known)."""

    shard: int
    feed_id: int
    lead: int


class GroupInfo(msgspec.Struct, tag="g", array_like=True):
    """Leader -> reader, once per ``idle_s``: the group's configuration and each member's lag
    behind the leader's log, which a node that is no member cannot learn from its own core (its
    membership driver plans from them: membership_views.py)."""

    shard: int
    voters: list[tuple[int, str]]
    learners: list[tuple[int, str]]
    lag: list[tuple[tuple[int, str], int]]


Msg = Follow | Add | Remove | Ack | Items | NotLeader | GroupInfo
_enc = msgspec.msgpack.Encoder()
_msg_dec = msgspec.msgpack.Decoder(Msg)  # type: ignore[arg-type]
_item_dec = msgspec.msgpack.Decoder(Item)  # type: ignore[arg-type]


def encode(x: Msg | Item) -> bytes:
    return _enc.encode(x)


def decode_msg(data: bytes) -> Msg:
    return _msg_dec.decode(data)


def decode_item(data: bytes) -> Item:
    return _item_dec.decode(data)


# --- results of a reader's proposals, encoded and decoded by their command's result type ---------


def result_out(res: Any) -> bytes:
    return _enc.encode(res)


def result_in(raw: bytes, cmd: c.Command) -> Any:
    """The result of ``cmd`` as its apply returned it on the leader (its declared type: a reader's
    waiters read attributes and unpack tuples of it)."""
    return msgspec.msgpack.decode(raw, type=_RESULT_TYPES.get(type(cmd), Any))


def _result_types() -> dict[type, Any]:
    from moorline.broker.session_state import DeliveryItem, OpenResult, OwedWill, Session
    from moorline.broker.topic_state import PublishResult, RegisterResult

    return {
        c.Publish: PublishResult, c.SessionOpen: OpenResult, c.Register: RegisterResult,
        c.WillPublished: bool, c.LeaseRelease: bool, c.SessionRenew: tuple[tuple[str, int], ...],
        c.SessionSubscribe: tuple[bool, int] | None, c.SessionUnsubscribe: int | None, c.Deliver: bool,
        c.SessionAcks: list[DeliveryItem], c.InboundRelease: bool, c.SessionClose: Session | None,
        c.SessionHousekeeping: tuple[list[tuple[OwedWill, c.WillSpec]], list[Session]],
        c.Unregister: bool, c.ShareClaim: tuple[int, ...], c.ShareDecline: tuple[int, ...],
        c.ShareActivate: bool, c.ShareTimeout: tuple[int, ...], c.ShareDeadLettered: tuple[int, ...],
    }


_RESULT_TYPES = _result_types()


# --- the leader's side ----------------------------------------------------------------------------


@dataclass(frozen=True)
class FeedLimits:
    max_items: int = 256  # unacknowledged items in flight per feed
    max_bytes: int = 8 << 20  # and their bytes
    resend_s: float = 1.0  # no acknowledgement for this long: sent again from after the acknowledged
    idle_s: float = 1.0  # nothing to send for this long: an empty Items (the reader's sign of life)
    # Items queued and not acknowledged (a reader that stopped acknowledging: dead, cut off): past
    # this many bytes the feed ends; the reader, if alive, follows anew from a partial snapshot.
    max_queued_bytes: int = 64 << 20


@dataclass
class Feed:
    node: int
    feed_id: int
    filter: FollowerFilter
    items: deque[tuple[int, bytes]]  # (seq, encoded item), not acknowledged yet, in order
    next_seq: int = 0
    sent_to: int = -1  # highest seq sent
    acked: int = -1
    last_send: float = 0.0
    last_ack: float = 0.0
    behind: bool = False  # entries were skipped since the last item: the next tick sends the figures
    skip_next: bool = False  # Faults.stream_resume_skips_one: the first entry after the start is lost
    queued_bytes: int = 0  # of ``items``
    last_info: float = -1e18  # when the group's configuration was last sent (GroupInfo)


class ReaderFeeds:
    """The feeds of one shard's leader (``ShardHost.feeds``): started on ``Follow``, fed at every
    apply while this replica leads, dropped when it stops leading."""

    def __init__(self, host: ShardHost, send: Callable[[int, bytes], None], clock: Callable[[], float],
                 limits: FeedLimits, next_feed_id: Callable[[], int]) -> None:
        self.host = host
        self.send = send  # (node id, encoded message)
        self.clock = clock
        self.limits = limits
        self.next_feed_id = next_feed_id
        self.feeds: dict[int, Feed] = {}
        self.skip_on_resend = False  # Faults.stream_resume_skips_one: a deliberately broken build
        # Kept on every replica (any may lead next): per node that is no member of the group, the
        # encoded results of its latest proposals, at most ``keep_results_of`` of them.
        self.results: dict[int, dict[tuple[int, int], list[bytes]]] = {}
        self.keep_results_of = 256

    def keep_results(self, head: c.EntryHead, results: list[Any]) -> None:
        kept = self.results.setdefault(head.origin, {})
        kept[(head.boot, head.seq)] = [result_out(r) for r in results]
        while len(kept) > self.keep_results_of:
            del kept[next(iter(kept))]

    # -- requests from readers --
    def on_message(self, node: int, msg: Msg) -> None:
        """A reader's request (the router's and tests' one entry point)."""
        if type(msg) is Follow:
            self.on_follow(node, msg)
        elif type(msg) is Add:
            self.on_add(node, msg)
        elif type(msg) is Remove:
            self.on_remove(node, msg)
        elif type(msg) is Ack:
            self.on_ack(node, msg)

    def _feed_of(self, node: int, feed_id: int) -> Feed | None:
        """``node``'s feed if it is the one named (a request about an ended feed finds none)."""
        feed = self.feeds.get(node)
        return feed if feed is not None and feed.feed_id == feed_id else None

    def on_follow(self, node: int, msg: Follow) -> None:
        host = self.host
        if not host.raft.is_leader or host.failed is not None:
            self._not_leader(node, msg.shard, 0)
            return
        self.feeds.pop(node, None)
        barrier = host.read_barrier()
        barrier.add_done_callback(lambda f: self._start(node, msg, f))

    def _start(self, node: int, msg: Follow, done: Any) -> None:
        host = self.host
        if done.cancelled() or done.exception() is not None or not host.raft.is_leader or host.failed is not None:
            self._not_leader(node, msg.shard, 0)
            return
        if host.state.applied_index < msg.have_index or host.installing:
            self._not_leader(node, msg.shard, 0)  # (behind the reader: it asks again, maybe elsewhere)
            return
        if self._is_member(node):
            self._not_leader(node, msg.shard, -1)  # it has the log itself now
            return
        flt = FollowerFilter(msg.clients)
        snap = flt.snapshot(host.state, host.message)
        feed = Feed(node, self.next_feed_id(), flt, deque())
        feed.last_ack = self.clock()
        feed.skip_next = self.skip_on_resend  # the broken build: the resumed feed starts one past
        self.feeds[node] = feed
        kept = self.results.get(node, {})
        self._queue(feed, StartItem(snap, host.state.proposals.get(node),
                                    [(boot, seq, res) for (boot, seq), res in kept.items()]))
        self.pump(feed)

    def on_add(self, node: int, msg: Add) -> None:
        feed = self._feed_of(node, msg.feed_id)
        if feed is None:
            self._not_leader(node, msg.shard, 0, msg.feed_id)
            return
        barrier = self.host.read_barrier()

        def added(done: Any) -> None:
            if self.feeds.get(node) is not feed:
                return  # the feed ended: the reader follows anew, with these clients
            if done.cancelled() or done.exception() is not None:
                self.end(node)  # no barrier here (leadership lost?): the reader follows anew and asks again
                return
            part = feed.filter.add_clients(self.host.state, msg.clients, self.host.message)
            self._queue(feed, MergeItem(msg.req, part))
            self.pump(feed)

        barrier.add_done_callback(added)

    def on_remove(self, node: int, msg: Remove) -> None:
        feed = self._feed_of(node, msg.feed_id)
        if feed is None:
            return
        self._queue(feed, EntryItem(feed.filter.remove_clients(self.host.state, msg.clients)))
        self.pump(feed)

    def on_ack(self, node: int, msg: Ack) -> None:
        feed = self._feed_of(node, msg.feed_id)
        if feed is None:
            self._not_leader(node, msg.shard, 0, msg.feed_id)
            return
        now = self.clock()
        if msg.seq > feed.acked:
            feed.acked = msg.seq
            feed.last_ack = now
            items = feed.items
            while items and items[0][0] <= msg.seq:
                feed.queued_bytes -= len(items.popleft()[1])
        elif feed.sent_to > feed.acked and now - feed.last_send >= self.limits.resend_s:
            self._resend(feed)  # the reader asks again after the same item: lost on the way
        self.pump(feed)

    # -- the leader's apply --
    def on_applied(self, index: int, head: c.EntryHead | None, cmds: list[c.Command], results: list[Any],
                   fx: Effects) -> None:
        """Entry ``index`` applied here (``cmds`` with ``results``; none for one that was skipped)."""
        if not self.host.raft.is_leader:
            self.drop_all()
            return
        fresh: dict[int, StoredMessage] = {o: m for o, _, m in fx.appends}
        host_message = self.host.message

        def message_of(o: int) -> StoredMessage | None:
            return fresh.get(o) or host_message(o)

        for feed in list(self.feeds.values()):
            if self._is_member(feed.node):
                self.end(feed.node)
                continue
            entry = feed.filter.reduce(self.host.state, index, cmds, results, fx, message_of)
            own = head is not None and head.origin == feed.node
            if not entry.ops and not own:
                feed.behind = True  # nothing for the reader: the next item, or the tick, moves it on
                continue
            if feed.skip_next:  # the broken build (tests only): this entry never reaches the reader
                feed.skip_next = False
                continue
            item = EntryItem(entry)
            if own:
                assert head is not None
                res = self.results.get(head.origin, {}).get((head.boot, head.seq))
                item = EntryItem(entry, head.boot, head.seq,
                                 res if res is not None else [result_out(r) for r in results])
            self._queue(feed, item)
            self.pump(feed)

    def tick(self) -> None:
        """Resends and signs of life (the host's tick)."""
        if not self.feeds:
            return
        if not self.host.raft.is_leader or self.host.failed is not None:
            self.drop_all()
            return
        now = self.clock()
        for feed in self.feeds.values():
            if feed.behind:
                # The shard moved on with nothing for the reader: its index and running figures
                # (next offset, times, epochs) follow once a tick, not with every entry.
                self._queue(feed, EntryItem(feed.filter.remove_clients(self.host.state, [])))
            if feed.sent_to > feed.acked and now - max(feed.last_send, feed.last_ack) >= self.limits.resend_s:
                self._resend(feed)
            elif now - feed.last_send >= self.limits.idle_s:
                feed.last_send = now
                self.send(feed.node, encode(Items(self.host.shard, feed.feed_id, feed.next_seq, [])))
            if now - feed.last_info >= self.limits.idle_s:
                feed.last_info = now
                self.send(feed.node, encode(self._info()))
            self.pump(feed)

    def _info(self) -> GroupInfo:
        raft = self.host.raft
        conf = raft.active_conf_state
        last = raft.log.last_index()
        return GroupInfo(self.host.shard, list(conf.voters), list(conf.learners),
                         [(m, last - pr.match) for m, pr in sorted(raft.progress.items())])

    def drop_all(self) -> None:
        for node in list(self.feeds):
            self.end(node)

    def end(self, node: int) -> None:
        feed = self.feeds.pop(node, None)
        if feed is not None:
            self._not_leader(node, self.host.shard, 0, feed.feed_id)

    # -- sending --
    def _queue(self, feed: Feed, item: Item) -> None:
        feed.behind = False
        data = encode(item)
        feed.items.append((feed.next_seq, data))
        feed.next_seq += 1
        feed.queued_bytes += len(data)
        if feed.queued_bytes > self.limits.max_queued_bytes:
            log.warning("shard %d: node %d acknowledged nothing of %d bytes queued for its feed: the feed ends",
                        self.host.shard, feed.node, feed.queued_bytes)
            self.end(feed.node)

    def pump(self, feed: Feed) -> None:
        """Sends what the feed's credit allows, from after the highest sent."""
        if self.feeds.get(feed.node) is not feed:
            return  # ended
        limits = self.limits
        batch: list[bytes] = []
        first = feed.sent_to + 1
        in_flight = feed.sent_to - feed.acked
        size = 0
        for seq, data in feed.items:
            if seq < first:
                continue
            if in_flight >= limits.max_items or (size + len(data) > limits.max_bytes and batch):
                break
            batch.append(data)
            size += len(data)
            in_flight += 1
        if batch:
            feed.sent_to = first + len(batch) - 1
            feed.last_send = self.clock()
            self.send(feed.node, encode(Items(self.host.shard, feed.feed_id, first, batch)))

    def _resend(self, feed: Feed) -> None:
        coverage.hit("reader_items_resent")
        feed.sent_to = feed.acked
        if self.skip_on_resend:  # the broken build: the first unacknowledged item is never sent again
            items = feed.items
            if items and items[0][0] == feed.acked + 1 and len(items) > 1:
                feed.queued_bytes -= len(items.popleft()[1])
                feed.items = deque((seq - 1, data) for seq, data in items)
                feed.next_seq -= 1
        self.pump(feed)

    def _not_leader(self, node: int, shard: int, lead: int, feed_id: int = -1) -> None:
        if lead == 0:
            led = self.host.raft.lead
            lead = led[0] if led is not None and not self.host.raft.is_leader else 0
        self.send(node, encode(NotLeader(shard, feed_id, lead)))

    def _is_member(self, node: int) -> bool:
        return any(m[0] == node for m in self.host.raft.active_conf_state.members())
