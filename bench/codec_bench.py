"""Micro-benchmark of the MQTT codec hot paths: µs per PUBLISH decoded / encoded; and of the
replicated entry codec: µs per forwarded entry restamped by a leader, decoded by a replica.

Run: ``python -m bench.codec_bench`` (or ``python bench/codec_bench.py``); ``python -m
bench.codec_bench restamp`` runs only the entry cases. Prints one line per case: the best of
several repeats, so a busy shared machine inflates numbers less.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moorline.broker import commands as c  # noqa: E402
from moorline.broker.messages import StoredMessage  # noqa: E402
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


# --- replicated entries: a leader's restamp of a forwarded entry ------------------------------

_v1_dec = msgspec.msgpack.Decoder(c.EntryBatch)
_v1_enc = msgspec.msgpack.Encoder()


def _old_decode(data: bytes) -> list[c.Command]:
    """d8cc58a's decode_entry (version 1, no head)."""
    batch = _v1_dec.decode(data)
    if batch.version != 1:
        raise ValueError(f"unsupported entry version {batch.version}")
    return batch.commands


def _old_restamp(data: bytes, now_ms: int) -> bytes:
    """d8cc58a's restamp_entry: the whole batch decoded, every time rewritten, encoded again."""
    batch = _v1_dec.decode(data)
    if batch.version != 1:
        raise ValueError(f"unsupported entry version {batch.version}")
    for cmd in batch.commands:
        if type(cmd) is c.Publish:
            if cmd.msg.ts_ms != now_ms:
                cmd.msg = msgspec.structs.replace(cmd.msg, ts_ms=now_ms)
        elif hasattr(cmd, "ts_ms"):
            cmd.ts_ms = now_ms  # type: ignore[union-attr]
    return _v1_enc.encode(c.EntryBatch(1, batch.commands, batch.origin, batch.boot, batch.seq))


def bench_restamp(count: int = 16, payload: int = 100) -> None:
    """A typical forwarded entry: ``count`` QoS 1 PUBLISHes of ``payload`` bytes (one client's read)."""
    now = 1_700_000_000_000
    cmds: list[c.Command] = [
        c.Publish(StoredMessage(f"bench/sensor/{i:04d}/temperature", bytes([i]) * payload, 1, False,
                                i.to_bytes(16, "big"), now + 3_600_000, origin="client-0042"), principal="user")
        for i in range(count)]
    old = _v1_enc.encode(c.EntryBatch(1, cmds, 2, 1, 7))  # d8cc58a's encode_entry
    new = c.encode_entry(cmds, 2, 1, 7)
    old_logged, new_logged = _old_restamp(old, now), c.restamp_entry(new, now)
    assert _old_decode(old_logged) == c.decode_entry(new_logged)
    label = f"{count} QoS1 x {payload} B"
    report(f"restamp, old: decode+rewrite+encode ({label})",
           best_us_per_item(lambda: _old_restamp(old, now), 1, calls=5000))
    report(f"restamp, new: head copy ({label})",
           best_us_per_item(lambda: c.restamp_entry(new, now), 1, calls=50000))
    # The leader's whole cost of a forwarded entry: old, restamp then its apply's decode; new,
    # restamp and one decode (checks the body; its apply takes those commands).
    report("leader per forwarded entry, old: restamp, apply decode",
           best_us_per_item(lambda: _old_decode(_old_restamp(old, now)), 1, calls=5000))
    report("leader per forwarded entry, new: restamp, one decode",
           best_us_per_item(lambda: c.decode_entry(c.restamp_entry(new, now)), 1, calls=5000))
    report("replica decode of a forwarded entry, old (version 1)",
           best_us_per_item(lambda: _old_decode(old_logged), 1, calls=5000))
    report("replica decode of a forwarded entry, new (stamped)",
           best_us_per_item(lambda: c.decode_entry(new_logged), 1, calls=5000))
    report("replica decode of a leader's own entry, new (unstamped)",
           best_us_per_item(lambda: c.decode_entry(new), 1, calls=5000))


def main() -> None:
    if sys.argv[1:] == ["restamp"]:
        bench_restamp()
        return
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
    bench_restamp()


if __name__ == "__main__":
    main()
