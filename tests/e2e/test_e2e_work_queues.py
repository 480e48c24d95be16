"""Issue 33: $share groups as work queues, against a real broker process (docs/queues.md).

- single-active: only the active member receives; when its session ends the standby continues from
  the first unacknowledged message, in order, nothing skipped;
- a poison message (its consumer never acknowledges and reconnects) lands once on the dead-letter
  topic after queue.max_deliveries, counted as a drop ``delivery_limit``, and the group moves on.
(Ack timeouts: test_e2e_queue_ack_timeout.py.)
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_broker import BrokerProc, running_broker
from rawclient import PUBREC, PUBREL, RawClient, encode_ack
from test_e2e_openapi import conforms

from moorline.node.admin.openapi import ROUTES

pytestmark = [pytest.mark.e2e, pytest.mark.moorline_only]
HOST = "127.0.0.1"
USER_PROPERTY = 0x26

CONFIG = """
[queue]
single_active = ["sa-*"]
limited_groups = ["dl-*", "to-*"]
max_deliveries = 2
ack_timeout_s = 1.0
"""


@pytest.fixture(scope="module")
def wq_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProc]:
    with running_broker(Path(tmp_path_factory.mktemp("wq")), config_text=CONFIG) as b:
        yield b


def member(port: int, cid: str, flt: str, props: list[tuple[int, object]] | None = None) -> RawClient:
    c = RawClient(HOST, port, 5)
    assert c.connect(cid, clean=True).reason == 0
    assert c.subscribe([(flt, 1)], props=props).reasons == [1]  # type: ignore[attr-defined]
    return c


def publish(port: int, cid: str, topic: str, payloads: list[bytes]) -> None:
    pub = RawClient(HOST, port, 5)
    assert pub.connect(cid).reason == 0
    for p in payloads:
        assert pub.publish_and_wait(topic, p, 1).reason < 0x80
    pub.disconnect()


def metric(b: BrokerProc, pattern: str) -> int:
    with urllib.request.urlopen(b.http_url + "/metrics", timeout=10) as r:
        m = re.search(pattern + r" (\d+)$", r.read().decode(), re.M)
    return int(m.group(1)) if m else 0


@pytest.mark.parametrize("how", ["config", "user_property"])
def test_single_active_standby_takes_over_in_order(wq_broker: BrokerProc, uniq: str, how: str) -> None:
    port, topic = wq_broker.mqtt_port, f"{uniq}/jobs"
    if how == "config":
        flt, props = f"$share/sa-{uniq}/{topic}", None
    else:
        flt, props = f"$share/g{uniq}/{topic}", [(USER_PROPERTY, ("moorline-share-mode", "single-active"))]
    a = member(port, f"{uniq}-a", flt, props)
    b = member(port, f"{uniq}-b", flt, props)
    n = 30
    sent = [f"m{i:03}".encode() for i in range(n)]
    publish(port, f"{uniq}-p", topic, sent)
    got_a = [a.next_message(10) for _ in range(n)]
    assert [m.payload for m in got_a] == sent, "the active member receives everything, in order"
    assert b.recv_or_none(1.0) is None, "the standby member receives nothing"
    for m in got_a[:12]:
        a.ack(m)
    a.ping()  # the acks are read before the connection goes
    time.sleep(0.3)  # ... and committed
    a.abort()  # its session ends: the standby becomes active, from the first unacknowledged
    got_b = [b.next_message(10).payload for _ in range(n - 12)]
    assert got_b == sent[12:], "from the first unacknowledged, in order, nothing skipped"
    more = [f"n{i}".encode() for i in range(5)]
    publish(port, f"{uniq}-p2", topic, more)
    assert [b.next_message(10).payload for _ in more] == more
    with urllib.request.urlopen(wq_broker.http_url + f"/v1/groups?q={uniq}", timeout=10) as r:
        rows = json.loads(r.read())
    row = rows["items"][0]
    assert row["single_active"] and row["active"] == [f"{uniq}-b"]
    route = next(r for r in ROUTES if r.method == "get" and r.path == "/v1/groups")
    assert conforms(rows, route.responses[200][1]) == [], "GET /v1/groups answers what its OpenAPI entry says"
    b.disconnect()


def test_poison_message_lands_once_on_the_dead_letter_topic(wq_broker: BrokerProc, uniq: str) -> None:
    port, topic, group = wq_broker.mqtt_port, f"{uniq}/jobs", f"dl-{uniq}"
    admin = RawClient(HOST, port, 5)
    assert admin.connect(f"{uniq}-admin").reason == 0
    admin.subscribe([(f"$dlq/{group}/#", 1)])
    dlq_before = metric(wq_broker, "moorline_share_dlq_total")
    flt = f"$share/{group}/{topic}"
    c = member(port, f"{uniq}-c", flt)
    publish(port, f"{uniq}-p", topic, [b"poison"])
    for attempt in range(2):  # max_deliveries = 2: handed out twice, never acknowledged
        assert c.next_message(10).payload == b"poison", attempt
        c.abort()  # the consumer "crashes": its session ends, the claim comes back
        c = member(port, f"{uniq}-c", flt)
    dead = admin.next_message(10)
    assert dead.payload == b"poison" and dead.topic == f"$dlq/{group}/{topic}"  # type: ignore[attr-defined]
    props = dict(dead.user_properties)  # type: ignore[attr-defined]
    assert props["moorline-original-topic"] == topic and props["moorline-deliveries"] == "2"
    assert props["moorline-last-consumer"] == f"{uniq}-c"
    admin.ack(dead)
    assert admin.recv_or_none(1.5) is None, "dead-lettered exactly once"
    assert c.recv_or_none(0.5) is None, "the poison message is not handed out again"
    publish(port, f"{uniq}-p2", topic, [b"next"])  # the group moves on
    nxt = c.next_message(10)
    assert nxt.payload == b"next"
    c.ack(nxt)
    assert metric(wq_broker, "moorline_share_dlq_total") == dlq_before + 1
    assert metric(wq_broker, r'moorline_dropped_total\{reason="delivery_limit"\}') >= 1
    c.disconnect()
    admin.disconnect()


def test_single_active_qos2_pubrecd_stays_with_its_member(wq_broker: BrokerProc, uniq: str) -> None:
    """MQTT-4.8.2-5 in a single-active group: a QoS 2 message the active member PUBREC'd is its
    receipt and never goes to the next member; one it never PUBREC'd is dropped and counted; QoS 1
    it did not acknowledge goes to the next member, in order."""
    port, topic = wq_broker.mqtt_port, f"{uniq}/jobs"
    flt = f"$share/sa-{uniq}/{topic}"
    a = RawClient(HOST, port, 5)
    assert a.connect(f"{uniq}-a", clean=True).reason == 0
    a.subscribe([(flt, 2)])
    b = RawClient(HOST, port, 5)
    assert b.connect(f"{uniq}-b", clean=True).reason == 0
    b.subscribe([(flt, 2)])
    pub = RawClient(HOST, port, 5)
    assert pub.connect(f"{uniq}-p").reason == 0
    sent = [(b"q2-pubrecd", 2), (b"q1-a", 1), (b"q2-unreceived", 2), (b"q1-b", 1)]
    for payload, qos in sent:
        assert pub.publish_and_wait(topic, payload, qos).reason < 0x80
    got = [a.next_message(10) for _ in sent]
    assert [m.payload for m in got] == [p for p, _ in sent]
    assert b.recv_or_none(1.0) is None
    a.send(encode_ack(PUBREC, got[0].pid, 5))  # type: ignore[arg-type]
    assert a.expect(PUBREL, 10).pid == got[0].pid  # and never PUBCOMP'd
    time.sleep(0.3)
    a.abort()
    assert [b.next_message(10).payload for _ in range(2)] == [b"q1-a", b"q1-b"]
    assert b.recv_or_none(1.5) is None, "neither QoS 2 message goes to the next member"
    b.disconnect()
    pub.disconnect()


def test_single_active_with_sticky_topic_dispatch(tmp_path: Path, uniq: str) -> None:
    """share.dispatch = "sticky_topic" picks a member per topic; a single-active group still gives
    every topic to its active member (or it would give some topics to nobody)."""
    cfg = '[share]\ndispatch = "sticky_topic"\n[queue]\nsingle_active = ["*"]\n'
    with running_broker(tmp_path, config_text=cfg) as b:
        flt = f"$share/g/{uniq}/#"
        a = member(b.mqtt_port, f"{uniq}-a", flt)
        s = member(b.mqtt_port, f"{uniq}-s", flt)
        pub = RawClient(HOST, b.mqtt_port, 5)
        assert pub.connect(f"{uniq}-p").reason == 0
        sent = [(f"{uniq}/t{i % 5}", f"m{i}".encode()) for i in range(20)]
        for topic, payload in sent:
            assert pub.publish_and_wait(topic, payload, 1).reason < 0x80
        got = [a.next_message(10) for _ in sent]
        assert [m.payload for m in got] == [p for _, p in sent]
        for m in got:
            a.ack(m)
        assert s.recv_or_none(1.0) is None
        for c in (a, s, pub):
            c.disconnect()
