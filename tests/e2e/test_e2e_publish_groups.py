"""Many QoS 1 PUBLISHes in one write: the broker reads them together and proposes them as groups
(one per run of publishes to one shard). Acknowledgements must still leave in arrival order, one
per PUBLISH, each after its message is durable; a refusal inside a run answers that message alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e_broker import BrokerFactory
from rawclient import PUBACK, RawClient, encode_publish

from moorline.hashing import shard_of

HOST = "127.0.0.1"
PAYLOAD = b"p" * 100


def topics_on_distinct_shards(n: int, shards: int = 16) -> list[str]:
    found: dict[int, str] = {}
    i = 0
    while len(found) < n:
        found.setdefault(shard_of(f"grp/t{i}", shards), f"grp/t{i}")
        i += 1
    return list(found.values())


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_one_write_of_publishes_to_three_shards_acks_in_order(broker_factory: BrokerFactory, version: int) -> None:
    b = broker_factory()
    topics = topics_on_distinct_shards(3)
    with RawClient(HOST, b.mqtt_port, version) as sub, RawClient(HOST, b.mqtt_port, version) as pub:
        sub.connect(f"grp-sub-{version}")
        sub.subscribe([("grp/#", 1)])
        connack = pub.connect(f"grp-pub-{version}")
        # As many as the broker lets us have unacknowledged (its v5 Receive Maximum), in runs of 1..4
        # per topic, so groups start and end at every position of a read.
        window = connack.prop(0x21, 150) if version == 5 else 150
        topic_of = [topics[k % 3] for k in range(60) for _ in range(1 + k % 4)][: min(window, 150)]
        sent = [(topic, PAYLOAD + pid.to_bytes(4, "big")) for pid, topic in enumerate(topic_of, 1)]
        pid = len(sent)
        pub.send(b"".join(encode_publish(t, body, 1, pid=i, version=version) for i, (t, body) in enumerate(sent, 1)))
        acks = [pub.expect(PUBACK, 20) for _ in range(pid)]
        assert [a.pid for a in acks] == list(range(1, pid + 1)), "PUBACKs leave in arrival order"
        assert all(a.reason == 0 for a in acks)
        got = []
        for _ in range(pid):
            m = sub.next_message(20)
            sub.ack(m)
            got.append((m.topic, m.payload))
        for topic in topics:  # per-topic order survives the grouping
            assert [p for t, p in got if t == topic] == [p for t, p in sent if t == topic]
        assert sorted(got) == sorted(sent)
        assert sub.recv_or_none(0.5) is None, "a message was delivered twice"


SMALL_SHARD = """
[shard]
max_bytes = {max_bytes}
reserved_headroom_bytes = 0
"""


@pytest.mark.moorline_only
@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_shard_filling_up_inside_one_write(broker_factory: BrokerFactory, tmp_path: Path, version: int) -> None:
    # A message takes payload + topic + 64 bytes of the shard's budget: room for exactly 10.
    topic = "full/t"
    fits = 10
    b = broker_factory(config_text=SMALL_SHARD.format(max_bytes=fits * (len(PAYLOAD) + len(topic) + 64)))
    with RawClient(HOST, b.mqtt_port, version) as pub:
        pub.connect(f"full-pub-{version}")
        pub.send(b"".join(encode_publish(topic, PAYLOAD, 1, pid=i, version=version) for i in range(1, 16)))
        if version == 5:
            acks = [pub.expect(PUBACK, 20) for _ in range(15)]
            assert [(a.pid, a.reason) for a in acks] == [(i, 0 if i <= fits else 0x97) for i in range(1, 16)]
        else:
            # 3.1.1 cannot refuse a PUBLISH: the broker acknowledges what it stored, then closes.
            got = pub.wait_closed(20)
            assert [(p.type, p.pid) for p in got] == [(PUBACK, i) for i in range(1, fits + 1)]
