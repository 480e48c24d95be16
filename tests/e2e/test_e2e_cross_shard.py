"""Cross-shard cases: wildcard filters spanning every shard, and SUBSCRIBE racing PUBLISH.

On moorline each case runs twice: plainly and with the cross_shard_chaos_seed test switch, which delays
and reorders the node's cross-shard commands (register in all shards, ack reports, ...).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest
from e2e_broker import BROKER_KIND, BrokerProc, running_broker
from rawclient import P_SESSION_EXPIRY, PUBACK, PUBLISH, RawClient, encode_ack, encode_publish

pytestmark = pytest.mark.e2e
HOST = "127.0.0.1"
SEED = os.environ.get("MOORLINE_E2E_SEED", "20261123")
SHARDS = 16


def _topics_over_all_shards(prefix: str, count: int) -> list[str]:
    """`count` topics under `prefix` that together cover every one of the 16 shards (CRC32C placement)."""
    from moorline.hashing import shard_of

    topics: list[str] = []
    covered: set[int] = set()
    i = 0
    while len(topics) < count or len(covered) < SHARDS:
        t = f"{prefix}/{i}/data"
        s = shard_of(t, SHARDS)
        if len(topics) < count or s not in covered:
            topics.append(t)
            covered.add(s)
        i += 1
    return topics


@pytest.fixture(scope="module", params=[None, SEED], ids=["plain", "chaos"])
def xbroker(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProc]:
    seed = request.param
    if seed is not None and BROKER_KIND != "moorline":
        pytest.skip("cross-shard chaos is a moorline test switch")
    faults = {"cross_shard_chaos_seed": int(seed)} if seed is not None else None
    with running_broker(tmp_path_factory.mktemp("xshard"), faults=faults) as b:
        yield b


def test_wildcard_over_all_shards(xbroker: BrokerProc, uniq: str) -> None:
    topics = _topics_over_all_shards(uniq, 64)
    sub = RawClient(HOST, xbroker.mqtt_port, 5)
    assert sub.connect(f"{uniq}-sub", props=[(P_SESSION_EXPIRY, 600)]).reason == 0
    assert sub.subscribe([(f"{uniq}/+/data", 1), (f"{uniq}/#", 2)]).reasons == [1, 2]
    pub = RawClient(HOST, xbroker.mqtt_port, 5)
    assert pub.connect(f"{uniq}-pub").reason == 0
    rounds = 3
    for r in range(rounds):
        for t in topics:
            assert pub.publish_and_wait(t, f"{r}".encode(), 1).reason < 0x80
    got: dict[str, list[int]] = {}
    deliveries = 0
    while True:
        m = sub.recv_or_none(2.0)
        if m is None:
            break
        assert m.type == PUBLISH
        sub.ack(m)
        assert m.topic is not None
        got.setdefault(m.topic, []).append(int(m.payload))
        deliveries += 1
    missing = [t for t in topics if t not in got]
    assert not missing, f"{len(missing)} of {len(topics)} topics never delivered, e.g. {missing[:3]}"
    for t in topics:
        rounds_seen = got[t]
        # once per round, in order (mosquitto sends one copy per matching subscription: dedupe adjacent)
        firsts = [x for i, x in enumerate(rounds_seen) if i == 0 or rounds_seen[i - 1] != x]
        assert firsts == list(range(rounds)), (t, rounds_seen)
        if xbroker.is_moorline:
            assert rounds_seen == list(range(rounds)), f"{t}: {rounds_seen} (one copy per session)"
    sub.disconnect()
    pub.disconnect()


def test_wildcard_unsubscribe_over_all_shards(xbroker: BrokerProc, uniq: str) -> None:
    topics = _topics_over_all_shards(uniq, 32)
    sub = RawClient(HOST, xbroker.mqtt_port, 5)
    assert sub.connect(f"{uniq}-sub", props=[(P_SESSION_EXPIRY, 600)]).reason == 0
    assert sub.subscribe([(f"{uniq}/#", 1)]).reasons == [1]
    assert sub.unsubscribe([f"{uniq}/#"]).reasons == [0]
    pub = RawClient(HOST, xbroker.mqtt_port, 5)
    assert pub.connect(f"{uniq}-pub").reason == 0
    for t in topics:
        pub.publish_and_wait(t, b"after-unsubscribe", 1)
    assert sub.recv_or_none(1.5) is None, "delivered after UNSUBACK"
    sub.disconnect()
    pub.disconnect()


def test_subscribe_racing_publish(xbroker: BrokerProc, uniq: str) -> None:
    """A publisher streams QoS 1 over 32 topics on all shards while a subscriber subscribes with a
    wildcard. Every message whose PUBLISH was sent after the SUBACK arrived must be delivered, and per
    topic the delivered messages are a gap-free, ordered run of the published sequence."""
    topics = _topics_over_all_shards(uniq, 32)
    pub = RawClient(HOST, xbroker.mqtt_port, 5)
    assert pub.connect(f"{uniq}-pub").reason == 0
    stop = threading.Event()
    send_time: dict[tuple[str, int], float] = {}
    errors: list[BaseException] = []

    def publish_loop() -> None:
        try:
            seq = 0
            inflight: set[int] = set()
            while not stop.is_set() and seq < 20_000:
                for t in topics:
                    pid = seq % 65535 + 1
                    send_time[(t, seq)] = time.monotonic()
                    pub.send(encode_publish(t, f"{seq}".encode(), 1, pid=pid, version=5))
                    inflight.add(pid)
                    seq += 1
                while inflight:
                    ack = pub.recv(30)
                    assert ack.type == PUBACK and ack.reason < 0x80, ack
                    inflight.discard(ack.pid)  # type: ignore[arg-type]
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=publish_loop, daemon=True)
    t.start()
    time.sleep(0.5)
    sub = RawClient(HOST, xbroker.mqtt_port, 5)
    assert sub.connect(f"{uniq}-sub", props=[(P_SESSION_EXPIRY, 600)]).reason == 0
    suback = sub.subscribe([(f"{uniq}/+/data", 1)])
    suback_at = time.monotonic()
    assert suback.reasons == [1]
    time.sleep(1.5)
    stop.set()
    t.join(60)
    assert not errors, errors
    assert not t.is_alive()
    received: dict[str, list[int]] = {}
    while True:
        m = sub.recv_or_none(2.0)
        if m is None:
            break
        assert m.topic is not None
        sub.send(encode_ack(PUBACK, m.pid, 5))  # type: ignore[arg-type]
        received.setdefault(m.topic, []).append(int(m.payload))
    published: dict[str, list[int]] = {}
    for (topic, seq) in sorted(send_time, key=lambda k: k[1]):
        published.setdefault(topic, []).append(seq)
    after = {k for k, ts in send_time.items() if ts > suback_at}
    assert after, "nothing was published after the SUBACK; the race was not exercised"
    lost = sorted(k for k in after if k[1] not in set(received.get(k[0], [])))
    assert not lost, f"{len(lost)} messages sent after SUBACK were not delivered, e.g. {lost[:5]}"
    for topic, seqs in received.items():
        pub_seqs = published[topic]
        start = pub_seqs.index(seqs[0])
        assert seqs == pub_seqs[start : start + len(seqs)], f"{topic}: gap, duplicate or reorder"
        assert seqs[-1] == pub_seqs[-1], f"{topic}: the latest messages are missing"
    sub.disconnect()
    pub.disconnect()
