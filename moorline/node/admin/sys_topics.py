"""``$SYS`` topics: the node's own statistics, published to subscribed clients every ``sys.interval_s``.

They are this node's view, not replicated data, so they never enter a shard log: a small registry of
the connections subscribed to a ``$SYS`` filter delivers them directly at QoS 0. A filter that does not
begin with ``$SYS`` never matches them (``#`` and ``+/...`` skip ``$``-topics, MQTT-4.7.2-1), and such a
subscription lives with its connection (it is not part of a persistent session).

Names follow Mosquitto's where it has one (``$SYS/broker/...``); moorline's own are under
``$SYS/moorline/shards/<n>/...``. A new subscriber gets the values of the last round at once (with
the retain flag, as Mosquitto's retained ``$SYS`` messages arrive); each round then sends the values
that changed. A subscriber whose socket is above its write high-water mark misses a round (QoS 0),
counted in ``dropped``.

Who may subscribe: a client whose ACL grants the filter through a rule whose pattern begins with
``$SYS`` (a leading wildcard never grants it), a user in ``auth.admin_users``, or anyone on a node with
no ACL rule that lets anonymous clients in and listens on loopback only: the same rule that gives the
HTTP API's anonymous caller the admin role there (``GET /v1/shards`` shows what the shard topics show).
Anywhere else ``$SYS`` is closed by default: client counts, rates and offsets tell an outsider more
than a broker should, and moorline's defaults are the closed ones.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import TYPE_CHECKING

from moorline import __version__
from moorline.broker.queries import all_sessions, session_count
from moorline.mqtt.topics import matches

if TYPE_CHECKING:
    from moorline.node.edge.auth import Authorizer, Principal
    from moorline.node.edge.connection import Connection
    from moorline.node.node import Node

log = logging.getLogger("moorline.sys")

LOAD_WINDOWS_S = {"1min": 60.0, "5min": 300.0, "15min": 900.0}


def is_sys_filter(topic_filter: str) -> bool:
    return topic_filter == "$SYS" or topic_filter.startswith("$SYS/")


class SysTopics:
    def __init__(self, node: Node, authorizer: Authorizer, interval_s: float, open_to_all: bool,
                 max_filters_per_connection: int) -> None:
        self.node = node
        self.authorizer = authorizer
        self.interval_s = interval_s
        self.open_to_all = open_to_all
        self.max_filters = max_filters_per_connection
        self.subscribers: dict[Connection, set[str]] = {}
        self.started = self.node.clock.monotonic()
        self.values: dict[str, bytes] = {}  # the last round, topic -> payload
        self.sent = 0  # $SYS messages written to clients
        self.dropped = 0  # ... and skipped for a subscriber that was not reading
        self._load: dict[str, float] = {}
        self._last_counts: tuple[float, int, int] | None = None  # (monotonic, received, sent)

    # --- subscriptions (called by Connection) ----------------------------------------------------
    def may_subscribe(self, who: Principal, topic_filter: str) -> bool:
        authorizer = self.authorizer
        if authorizer.is_admin(who):
            return True
        if authorizer.rules:
            return authorizer.can_subscribe(who, topic_filter)
        return self.open_to_all

    def subscribe(self, conn: Connection, topic_filter: str) -> bool:
        """Add ``conn``'s filter (already granted); sends the last round's matching values. False when
        the connection has ``session.max_subscriptions`` $SYS filters already."""
        filters = self.subscribers.setdefault(conn, set())
        if topic_filter not in filters and len(filters) >= self.max_filters:
            return False
        filters.add(topic_filter)
        return True

    def send_current(self, conn: Connection, topic_filter: str) -> None:
        """The last round's values matching ``topic_filter``, flagged retained (after the SUBACK)."""
        if not self.values and self.interval_s > 0:
            self.values = self.collect()  # no round ran while nobody was subscribed
        self._send(conn, [(t, v) for t, v in sorted(self.values.items()) if matches(topic_filter, t)], True)

    def unsubscribe(self, conn: Connection, topic_filter: str) -> bool:
        filters = self.subscribers.get(conn)
        if filters is None or topic_filter not in filters:
            return False
        filters.discard(topic_filter)
        if not filters:
            del self.subscribers[conn]
        return True

    def drop(self, conn: Connection) -> None:
        self.subscribers.pop(conn, None)

    # --- rounds ----------------------------------------------------------------------------------
    async def run(self) -> None:
        if self.interval_s <= 0:
            return
        while True:
            try:
                self.publish_round()
            except Exception:  # a statistic that cannot be read must not end $SYS for good
                log.exception("$SYS round failed")
            await asyncio.sleep(self.interval_s)

    def publish_round(self) -> None:
        if not self.subscribers:
            self.values = {}  # nobody to tell: the statistics are not even read (a busy node has many sessions)
            return
        values = self.collect()
        changed = [(t, v) for t, v in sorted(values.items()) if self.values.get(t) != v]
        self.values = values
        for conn, filters in list(self.subscribers.items()):
            if conn.closing:
                del self.subscribers[conn]
                continue
            wanted = [(t, v) for t, v in changed if any(matches(f, t) for f in filters)]
            if wanted:
                self._send(conn, wanted, False)

    def _send(self, conn: Connection, items: list[tuple[str, bytes]], retain: bool) -> None:
        if not items or conn.closing:
            return
        live = conn.live
        if live is None or not live.writable:
            self.dropped += len(items)  # QoS 0: a client not reading its socket misses this round
            return
        authorizer, who = self.authorizer, conn.principal
        check = bool(authorizer.rules) and not authorizer.is_admin(who)
        out: list[bytes] = []
        for topic, payload in items:
            if check and not authorizer.can_read(who, topic):
                continue
            data = conn.state.encode_publish(topic, topic.encode(), payload, 0, retain, False, None)
            if isinstance(data, bytes):  # None: above the client's maximum packet size (MQTT-3.1.2-25)
                out.append(data)
        if out:
            conn.write(b"".join(out))
            self.sent += len(out)

    def collect(self) -> dict[str, bytes]:
        """Every value, as the payloads Mosquitto uses (decimal text)."""
        node = self.node
        now = self.node.clock.monotonic()
        received = sum(node.published.values())  # by source (mqtt, http, spark)
        sent = int(node.stats["delivered"])
        sessions = subscriptions = retained = dropped_total = 0
        shards: dict[str, bytes] = {}
        for host in node.hosts:
            state = host.state
            sessions += session_count(state.sessions)
            subscriptions += sum(len(s.subs) for s in all_sessions(state.sessions))
            topics = state.topics
            retained += len(topics.retained)
            dropped = sum(topics.drop_counts.values())
            dropped_total += dropped
            base = f"$SYS/moorline/shards/{host.shard}/"
            shards[base + "next_offset"] = b"%d" % topics.next_offset
            shards[base + "low_water"] = b"%d" % topics.low_water
            shards[base + "owed_messages"] = b"%d" % len(topics.owed_count)
            shards[base + "dropped"] = b"%d" % dropped
            shards[base + "bytes"] = b"%d" % topics.bytes_used
            shards[base + "available"] = b"0" if getattr(host, "failed", None) else b"1"
        connected = len(node.live)
        self._update_load(now, received, sent)
        out = {
            "$SYS/broker/version": f"moorline {__version__}".encode(),
            "$SYS/broker/uptime": b"%d seconds" % int(now - self.started),
            "$SYS/broker/clients/connected": b"%d" % connected,
            "$SYS/broker/clients/total": b"%d" % sessions,
            "$SYS/broker/clients/disconnected": b"%d" % max(0, sessions - connected),
            "$SYS/broker/messages/received": b"%d" % received,
            "$SYS/broker/messages/sent": b"%d" % sent,
            "$SYS/broker/publish/messages/received": b"%d" % received,
            "$SYS/broker/publish/messages/sent": b"%d" % sent,
            "$SYS/broker/publish/messages/dropped": b"%d" % dropped_total,
            "$SYS/broker/subscriptions/count": b"%d" % subscriptions,
            "$SYS/broker/retained messages/count": b"%d" % retained,
            "$SYS/moorline/shards/count": b"%d" % len(node.hosts),
        }
        for key, value in self._load.items():
            out[f"$SYS/broker/load/{key}"] = b"%.2f" % value
        out.update(shards)
        return out

    def _update_load(self, now: float, received: int, sent: int) -> None:
        """Mosquitto's load figures: messages per minute, as moving averages over 1, 5 and 15 minutes."""
        last = self._last_counts
        self._last_counts = (now, received, sent)
        if last is None or now <= last[0]:
            for name in LOAD_WINDOWS_S:
                for what in ("messages/received", "messages/sent", "publish/received", "publish/sent"):
                    self._load.setdefault(f"{what}/{name}", 0.0)
            return
        dt = now - last[0]
        rates = {"messages/received": (received - last[1]) * 60.0 / dt, "messages/sent": (sent - last[2]) * 60.0 / dt}
        rates["publish/received"], rates["publish/sent"] = rates["messages/received"], rates["messages/sent"]
        for name, window in LOAD_WINDOWS_S.items():
            weight = 1.0 - math.exp(-dt / window)
            for what, rate in rates.items():
                key = f"{what}/{name}"
                prev = self._load.get(key, 0.0)
                self._load[key] = prev + (rate - prev) * weight
