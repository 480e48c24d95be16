"""Micro-benchmark of the MQTT codec hot paths: µs per PUBLISH decoded / encoded.

Run: ``python -m bench.codec_bench`` (or ``python bench/codec_bench.py``). Prints one line per
case: the best of several repeats, so a busy shared machine inflates numbers less.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moorline.mqtt.codec import (  # noqa: E402
    Decoder,
    encode,
    encode_properties,
    encode_puback,
    encode_publish_fast,
)
from moorline.mqtt.packets import NO_PROPERTIES, Connect, Properties, Puback, Publish  # noqa: E402
from moorline.mqtt.protocol import ProtocolState  # noqa: E402
from moorline.mqtt.topics import SubscriptionTrie  # noqa: E402

BATCH = 100  # PUBLISHes per feed, like a busy socket read
PAYLOAD = b"x" * 64
TOPIC = "bench/sensor/0042/temperature"


def best_us_per_item(fn: Callable[[], object], items_per_call: int, calls: int = 300, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        for _ in range(calls):
            fn()
        best = min(best, time.process_time() - t0)
    return best / (calls * items_per_call) * 1e6


def report(name: str, us: float) -> None:
    print(f"{name:<58} {us:7.3f} µs")


def bench_publish(version: int, qos: int, props: Properties) -> None:
    pid = 1 if qos else None
    pub = Publish(TOPIC, PAYLOAD, qos, False, False, pid, props)
    batch = encode(pub, version) * BATCH
    label = f"v{version} qos{qos}{' +guid' if props.user_properties else ''}"

    dec = Decoder(version=version)
    report(f"decode PUBLISH ({label}, {BATCH}/feed)", best_us_per_item(lambda: dec.feed(batch), BATCH))

    state = ProtocolState(receive_maximum_in=65535)
    state.receive(encode(Connect("MQTT", version, "bench"), version))

    def receive() -> None:
        state.receive(batch)
        state.note_inbound_acked(1)  # QoS 1 ids repeat; keep the in-flight counter from filling up

    report(f"ProtocolState.receive PUBLISH ({label})", best_us_per_item(receive, BATCH))

    tb = TOPIC.encode()
    body = encode_properties(props) if version == 5 else b""
    report(f"encode_publish_fast ({label})", best_us_per_item(
        lambda: encode_publish_fast(tb, PAYLOAD, qos, False, False, pid, version, body), 1, calls=20000))
    report(f"encode(Publish) ({label})", best_us_per_item(lambda: encode(pub, version), 1, calls=20000))
    report(f"ProtocolState.encode_publish ({label})", best_us_per_item(
        lambda: state.encode_publish(TOPIC, tb, PAYLOAD, qos, False, False, pid, body), 1, calls=20000))


def main() -> None:
    guid_props = Properties(user_properties=(("guid", "0123456789abcdef0123456789abcdef"),))
    for version in (4, 5):
        for qos in (0, 1):
            bench_publish(version, qos, NO_PROPERTIES)
            if version == 5:
                bench_publish(version, qos, guid_props)

    report("encode_puback", best_us_per_item(lambda: encode_puback(1234), 1, calls=50000))
    acks = encode(Puback(7), 5) * BATCH
    dec = Decoder(version=5, role="client")
    report(f"decode PUBACK ({BATCH}/feed)", best_us_per_item(lambda: dec.feed(acks), BATCH))

    trie: SubscriptionTrie[int, int] = SubscriptionTrie()
    for i in range(10_000):
        trie.insert(f"bench/sensor/{i:04d}/temperature", i, 1)
    for i in range(100):
        trie.insert(f"bench/sensor/{i:04d}/#", 20_000 + i, 1)
        trie.insert("bench/+/0042/+", 30_000 + i, 1)
    trie.insert("#", 99_999, 1)
    report("SubscriptionTrie.match (10.2k filters, 102 matches)", best_us_per_item(lambda: trie.match(TOPIC), 1, calls=2000))


if __name__ == "__main__":
    main()
