"""Mutated MQTT streams against a real broker process (issue 19 item 9): at least 100,000 mutated
packets over thousands of connections — some of them resuming the same sessions, some closed with a
reset mid-stream — and afterwards not one ERROR or traceback in the broker's log, and the broker
still serves. The codec-level fuzz (tests/mqtt/test_mqtt_fuzz.py) proves the parser; this proves
everything around it: sessions, takeovers, QoS 2 state, subscriptions, closes."""

from __future__ import annotations

import random
import socket
import struct
import time

import pytest
from e2e_broker import BrokerFactory
from rawclient import (
    AUTH,
    P_RECEIVE_MAXIMUM,
    P_SESSION_EXPIRY,
    P_TOPIC_ALIAS,
    P_USER_PROPERTY,
    PINGREQ_BYTES,
    PUBACK,
    PUBCOMP,
    PUBREC,
    PUBREL,
    RawClient,
    encode_ack,
    encode_connect,
    encode_disconnect,
    encode_publish,
    encode_subscribe,
    encode_unsubscribe,
    packet,
)

pytestmark = [pytest.mark.e2e, pytest.mark.moorline_only]
HOST = "127.0.0.1"
SEED = 20261125
MUTATED_PACKETS_MIN = 100_000
TOPICS = ["f/a", "f/b/c", "f/+", "f/#", "$SYS/x", "", "f/\u00e9", "f//d", "$share/g/f/a"]
FILTERS = ["f/#", "f/+", "f/a", "$share/g/f/#", "$share//x", "#", "+/+", "f/#/x", "", "$SYS/#"]


def _valid_packet(rng: random.Random, version: int) -> bytes:
    kind = rng.randrange(10)
    pid = rng.randrange(1, 70)
    topic = rng.choice(TOPICS)
    if kind <= 3:
        props = None
        if version == 5 and rng.random() < 0.3:
            props = rng.choice([[(P_TOPIC_ALIAS, rng.randrange(0, 70))], [(P_USER_PROPERTY, ("guid", "ab" * 16))],
                                [(P_USER_PROPERTY, ("producer", "01" * 8)), (P_USER_PROPERTY, ("seq", "7"))]])
        qos = rng.randrange(3)
        return encode_publish(topic, rng.randbytes(rng.randrange(0, 40)), qos, rng.random() < 0.2,
                              pid if qos else None, rng.random() < 0.2, version, props)
    if kind == 4:
        return encode_ack(rng.choice([PUBACK, PUBREC, PUBREL, PUBCOMP]), pid, version, rng.choice([0, 0x80]))
    if kind == 5:
        subs = [(rng.choice(FILTERS), rng.randrange(3)) for _ in range(rng.randrange(1, 4))]
        return encode_subscribe(pid, subs, version)  # type: ignore[arg-type]
    if kind == 6:
        return encode_unsubscribe(pid, [rng.choice(FILTERS)], version)
    if kind == 7:
        return PINGREQ_BYTES
    if kind == 8:
        return packet(AUTH, 0, b"\x18\x00") if version == 5 else PINGREQ_BYTES
    return encode_connect("again", version)  # a second CONNECT: a protocol error


def _mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    how = rng.randrange(6)
    if how == 0 and b:  # flip bits of one byte
        i = rng.randrange(len(b))
        b[i] ^= 1 << rng.randrange(8)
    elif how == 1 and b:  # overwrite a byte
        b[rng.randrange(len(b))] = rng.randrange(256)
    elif how == 2:  # insert bytes
        i = rng.randrange(len(b) + 1)
        b[i:i] = rng.randbytes(rng.randrange(1, 4))
    elif how == 3 and len(b) > 1:  # drop bytes
        i = rng.randrange(len(b))
        del b[i:i + rng.randrange(1, 3)]
    elif how == 4 and len(b) > 1:  # a remaining length that lies
        b[1] = rng.choice([0, 1, 0x7F, 0xFF])
    else:  # truncate
        b = b[: rng.randrange(len(b) + 1)]
    return bytes(b)


def _connection_bytes(rng: random.Random, i: int) -> tuple[bytes, int]:
    """One connection's stream and how many mutated packets it holds."""
    version = rng.choice([4, 5])
    props = [(P_SESSION_EXPIRY, rng.choice([0, 60])), (P_RECEIVE_MAXIMUM, rng.choice([1, 5, 100]))] if version == 5 else None
    cid = f"fz-{rng.randrange(40)}"  # a small pool: sessions are resumed and taken over all the time
    connect = encode_connect(cid, version, rng.random() < 0.5, rng.choice([0, 5, 60]), props,
                             ("f/will", b"w", rng.randrange(3), False) if rng.random() < 0.2 else None)
    out, mutated = [], 0
    if rng.random() < 0.1:
        out.append(_mutate(rng, connect))
        mutated += 1
    else:
        out.append(connect)
    for _ in range(rng.randrange(4, 9)):
        pk = _valid_packet(rng, version)
        if rng.random() < 0.8:
            pk = _mutate(rng, pk)
            mutated += 1
        out.append(pk)
    if rng.random() < 0.3:
        out.append(encode_disconnect(version))
    return b"".join(out), mutated


def _send(port: int, data: bytes, rng: random.Random) -> None:
    s = socket.create_connection((HOST, port), timeout=5)
    try:
        s.sendall(data)
        mode = rng.randrange(3)
        if mode == 0:  # reset at once: the broker may be mid-commit for this connection
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        elif mode == 1:  # read what the broker answers, briefly
            s.settimeout(0.01)
            try:
                s.recv(65536)
            except OSError:
                pass
    except OSError:
        pass  # the broker closed first (it saw a protocol error): expected
    finally:
        s.close()


def test_mutated_streams_leave_no_error_in_the_log(broker_factory: BrokerFactory) -> None:
    b = broker_factory()
    rng = random.Random(SEED)
    mutated = connections = 0
    started = time.monotonic()
    while mutated < MUTATED_PACKETS_MIN:
        data, n = _connection_bytes(rng, connections)
        _send(b.mqtt_port, data, rng)
        mutated += n
        connections += 1
        assert time.monotonic() - started < 600, "fuzz run took too long"
        assert b.proc is not None and b.proc.poll() is None, f"broker died after {connections} connections"
    probe = RawClient(HOST, b.mqtt_port, 5)
    assert probe.connect("fz-probe").reason == 0
    assert probe.subscribe([("probe/t", 1)]).reasons == [1]
    probe.publish_and_wait("probe/t", b"alive", qos=1)
    assert probe.next_message().payload == b"alive"
    probe.close()
    time.sleep(0.5)
    text = b.log_path.read_text(errors="replace")
    errors = [ln for ln in text.splitlines() if " ERROR " in ln or " CRITICAL " in ln or "Traceback" in ln]
    assert errors == [], f"{len(errors)} error lines after {mutated} mutated packets on {connections} connections:\n" + "\n".join(errors[:20])
