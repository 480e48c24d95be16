"""Who is served here: client id -> connection and live session, the owner leases' local
deadlines, and the views derived from each session's subscriptions."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moorline.broker.queries import session_of
from moorline.broker.session_state import Session, SubscriptionState
from moorline.broker.topic_state import same_incarnation
from moorline.node.sessions.delivery import LiveSession
from moorline.node.sessions.subscriptions import reg_key_for

if TYPE_CHECKING:
    from moorline.node.node import Node

log = logging.getLogger("moorline.node")


@dataclass(slots=True)
class _SessionViews:
    incarnation: int
    sub_version: int
    by_shard: list[tuple[int, list[tuple[str, SubscriptionState]]]]
    by_reg: dict[str, SubscriptionState]
    shares: list[tuple[int, str]]  # (shard, $share registration): where freed window room may dispatch


class SessionRegistry:
    """The node's sessions being served: connections, live sessions, leases, derived views."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.live: dict[str, LiveSession] = {}
        self.connections: dict[str, Any] = {}  # client id -> Connection (for takeover)
        self.views: dict[str, _SessionViews] = {}  # client id -> derived views; dropped when it disconnects
        # (client id, epoch) -> monotonic time before which this node must stop serving it, unless
        # a renewal commits (session.owner_lease_s, shortened by the drift bound).
        self.lease_deadline: dict[tuple[str, int], float] = {}

    def session_views(self, sess: Session) -> _SessionViews:
        """Derived from the session's subscriptions; recomputed when they change (sub_version)."""
        cached = self.views.get(sess.client_id)
        if cached is not None and cached.incarnation == sess.incarnation and cached.sub_version == sess.sub_version:
            return cached
        by_shard: dict[int, list[tuple[str, SubscriptionState]]] = {}
        by_reg: dict[str, SubscriptionState] = {}
        for flt, sub in sess.subs.items():
            reg_key, inner, _ = reg_key_for(sess.client_id, flt)
            by_reg[reg_key] = sub
            for shard in self.node.shards_for_filter(inner):
                by_shard.setdefault(shard, []).append((reg_key, sub))
        ordered = sorted(by_shard.items())
        shares = [(shard, rk) for shard, regs in ordered for rk, _ in regs if self.node.is_share_key(rk)]
        views = _SessionViews(sess.incarnation, sess.sub_version, ordered, by_reg, shares)
        self.views[sess.client_id] = views
        return views

    def session_regs(self, client_id: str, sess: Session) -> list[tuple[int, list[tuple[str, SubscriptionState]]]]:
        """Per topic shard, the registrations (and subscriptions) this session reads."""
        return self.session_views(sess).by_shard

    def reg_subs(self, client_id: str, sess: Session) -> dict[str, SubscriptionState]:
        """Registration key -> the session's subscription behind it."""
        return self.session_views(sess).by_reg

    def epoch_is_current(self, client_id: str, epoch: int) -> bool:
        sess = session_of(self.node.hosts[self.node.session_shard(client_id)].state.sessions, client_id)
        return sess is not None and sess.epoch == epoch

    def delivered_cursors(self, client_id: str) -> dict[int, int]:
        """Per topic shard, the highest offset already sent to the session (live or committed)."""
        live = self.node.live.get(client_id)
        if live is not None:
            return live.cursor
        sess = session_of(self.node.hosts[self.node.session_shard(client_id)].state.sessions, client_id)
        return sess.last_delivered if sess is not None else {}

    def member_connected(self, client_id: str, inc: int) -> bool:
        """Whether ``client_id``'s session incarnation ``inc`` is connected: here, or on some node as
        its session shard records it (LEGACY_INC: any incarnation)."""
        live = self.node.live.get(client_id)
        if live is not None and same_incarnation(live.incarnation, inc):
            return True
        if self.node.link is None:
            return False
        shost = self.node.hosts[self.node.session_shard(client_id)]
        if not shost.knows_session(client_id):
            return False  # not followed here yet (reader.py): offered nothing until it is
        sess = session_of(shost.state.sessions, client_id)
        return sess is not None and sess.connected and same_incarnation(sess.incarnation, inc)
