"""Queue caps are what the README says (issue 19 item 7): session.max_queued_messages holds per
subscription across every shard a wildcard reads, session.max_queued_bytes is enforced, the oldest
are dropped first, and every drop is recorded (GET /v1/drops) and counted."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from e2e_broker import BrokerFactory, BrokerProc
from rawclient import P_SESSION_EXPIRY, RawClient

from moorline.hashing import shard_of

pytestmark = [pytest.mark.e2e, pytest.mark.moorline_only]
HOST = "127.0.0.1"


def _topics_on_distinct_shards(prefix: str, n: int, shards: int = 16) -> list[str]:
    out: dict[int, str] = {}
    i = 0
    while len(out) < n:
        t = f"{prefix}/t{i}"
        out.setdefault(shard_of(t, shards), t)
        i += 1
    return list(out.values())


def _drain(c: RawClient, quiet_s: float = 1.0) -> list[bytes]:
    got = []
    while (pkt := c.recv_or_none(quiet_s)) is not None:
        got.append(pkt.payload)
        if pkt.qos:
            c.ack(pkt)
    return got


def _queue_cap_drops(b: BrokerProc, session: str) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{b.http_port}/v1/drops", timeout=10) as r:
        drops = json.loads(r.read())["drops"]
    return sum(1 for d in drops if d["reason"] == "queue_cap" and d["session"] == session)


def _fill_offline_queue(b: BrokerProc, uniq: str, payload: bytes, per_topic: int) -> tuple[RawClient, list[bytes]]:
    sid = f"{uniq}-sub"
    sub = RawClient(HOST, b.mqtt_port, 5)
    assert sub.connect(sid, clean=False, props=[(P_SESSION_EXPIRY, 600)]).reason == 0
    assert sub.subscribe([(f"{uniq}/#", 1)]).reasons == [1]
    sub.close()
    pub = RawClient(HOST, b.mqtt_port, 5)
    assert pub.connect(f"{uniq}-pub").reason == 0
    sent = []
    for r in range(per_topic):  # round-robin over 8 shards: each message newer than the one before
        for t in _topics_on_distinct_shards(uniq, 8):
            body = b"%s|%d|" % (t.encode(), r) + payload
            pub.publish_and_wait(t, body, qos=1)
            sent.append(body)
            # Caps drop by entry time (milliseconds) across shards, ties in shard order: two
            # messages in one millisecond would make "newer" ambiguous (a CI failure once).
            time.sleep(0.003)
    pub.close()
    time.sleep(0.5)  # drops are proposed after the applies that overfill the queue
    sub = RawClient(HOST, b.mqtt_port, 5)
    assert sub.connect(sid, clean=False, props=[(P_SESSION_EXPIRY, 600)]).session_present
    return sub, sent


def test_message_cap_is_per_subscription_across_shards(broker_factory: BrokerFactory, uniq: str) -> None:
    b = broker_factory(config_text="[session]\nmax_queued_messages = 10\n")
    sub, sent = _fill_offline_queue(b, uniq, b"", per_topic=5)  # 40 messages over 8 shards
    got = _drain(sub)
    assert sorted(got) == sorted(sent[-10:]), f"kept {len(got)} of {len(sent)}, expected the newest 10"
    assert _queue_cap_drops(b, f"{uniq}-sub") == 30
    sub.close()


def test_byte_cap_is_enforced(broker_factory: BrokerFactory, uniq: str) -> None:
    b = broker_factory(config_text="[session]\nmax_queued_bytes = 10000\n")
    sub, sent = _fill_offline_queue(b, uniq, b"x" * 1000, per_topic=2)  # 16 messages of ~1 KB
    got = _drain(sub)
    assert 5 <= len(got) <= 10, f"{len(got)} messages kept under a 10,000-byte cap"
    assert sorted(got) == sorted(sent[-len(got):]), "not the newest that were kept"
    assert _queue_cap_drops(b, f"{uniq}-sub") == len(sent) - len(got)
    sub.close()
