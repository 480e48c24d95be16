"""Durability across broker crashes (moorline's promise: an acknowledged message is never lost).

Each scenario runs with a SIGKILL restart (moorline only) and with a clean SIGTERM restart (both brokers,
which also checks the test logic against the mosquitto reference). The seed of every random choice is
MOORLINE_E2E_SEED (default 20261123), printed on failure.
"""

from __future__ import annotations

import os
import random
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from e2e_broker import BROKER_KIND, BrokerFactory, BrokerProc, running_broker
from e2e_support import mosquitto_presubscribe, mosquitto_pub, mosquitto_sub, sub_lines
from qos2_receiver import MethodBSubscriber
from rawclient import (
    DISCONNECT,
    P_RECEIVE_MAXIMUM,
    P_SESSION_EXPIRY,
    PUBACK,
    PUBCOMP,
    PUBLISH,
    PUBREC,
    PUBREL,
    ConnectionClosed,
    Packet,
    RawClient,
    encode_ack,
    encode_publish,
)

pytestmark = pytest.mark.e2e
HOST = "127.0.0.1"
SEED = int(os.environ.get("MOORLINE_E2E_SEED", "20261123"))

RESTARTS = [
    pytest.param("sigkill", marks=pytest.mark.moorline_only, id="sigkill"),
    pytest.param("powerloss", marks=pytest.mark.moorline_only, id="powerloss"),
    pytest.param("sigterm", id="sigterm"),
]


@pytest.fixture(scope="module")
def shared_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProc]:
    """This module's broker; on moorline it records fsynced lengths so a power loss can be simulated."""
    base = tmp_path_factory.mktemp("durable")
    faults = {"sync_ledger": str(base / "sync-ledger.jsonl")} if BROKER_KIND == "moorline" else None
    with running_broker(base, faults=faults) as b:
        yield b


def crash(b: BrokerProc, mode: str, seed: int = SEED) -> None:
    """Restart the broker: SIGKILL, SIGKILL + loss of unsynced writes, or a clean SIGTERM."""
    if mode == "powerloss":
        b.power_loss(seed)
    else:
        b.restart(kill=mode == "sigkill")


def reconnect(b: BrokerProc, cid: str, version: int = 5, timeout: float = 30.0,
              receive_maximum: int | None = None) -> RawClient:
    """Connect a persistent session (retrying while the broker comes back); asserts session present."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            c = RawClient(HOST, b.mqtt_port, version)
            props = [(P_SESSION_EXPIRY, 3600)] if version == 5 else None
            if receive_maximum is not None and props is not None:
                props.append((P_RECEIVE_MAXIMUM, receive_maximum))
            ack = c.connect(cid, clean=False, props=props)
            assert ack.reason == 0, ack
            assert ack.session_present, f"session {cid} lost"
            return c
        except (ConnectionRefusedError, ConnectionClosed, TimeoutError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def new_session(b: BrokerProc, cid: str, filters: list[tuple[str, int]], version: int = 5) -> RawClient:
    c = RawClient(HOST, b.mqtt_port, version)
    props = [(P_SESSION_EXPIRY, 3600)] if version == 5 else None
    # clean=False on a fresh id: mosquitto 2.0.11 does not persist a clean-start session across restarts
    ack = c.connect(cid, clean=False, props=props)
    assert ack.reason == 0 and not ack.session_present, ack
    sub = c.subscribe(filters)
    assert sub.reasons == [q for _, q in filters], sub
    return c


def drain_acking(c: RawClient, quiet: float = 1.5, limit: int = 100_000) -> list[Packet]:
    """Read and acknowledge (QoS 1) every message until `quiet` seconds pass without one."""
    out: list[Packet] = []
    while len(out) < limit:
        m = c.recv_or_none(quiet)
        if m is None:
            break
        assert m.type == PUBLISH, m
        out.append(m)
        if m.qos == 1:
            c.send(encode_ack(PUBACK, m.pid, c.version))  # type: ignore[arg-type]
    return out


# --------------------------------------------------------------------------- offline subscriber, crash


@pytest.mark.parametrize("mode", RESTARTS)
def test_persistent_mosquitto_sub_gets_everything_after_crash(shared_broker: BrokerProc, uniq: str, mode: str) -> None:
    port, topic, cid, n = shared_broker.mqtt_port, f"{uniq}/d", f"{uniq}-sub", 300
    mosquitto_presubscribe(port, topic, cid, qos=1)
    r = mosquitto_pub(port, topic, None, qos=1, stdin_lines=[f"msg-{i:04d}" for i in range(n)])
    assert r.returncode == 0, r.stderr  # every line was PUBACKed
    crash(shared_broker, mode)
    # -C n+1 with a short -W: one extra message would show up as a duplicate
    lines = sub_lines(mosquitto_sub(port, topic, n + 1, qos=1, client_id=cid, persistent=True, timeout_s=5))
    expected = [f"{topic} msg-{i:04d}" for i in range(n)]
    assert len(lines) == n, f"got {len(lines)} of {n} (missing {sorted(set(expected) - set(lines))[:5]})"
    assert lines == expected, "order or content differs"
    # acknowledged deliveries are not delivered again after a clean restart (in-flight acks finish first)
    shared_broker.restart(kill=False)
    assert sub_lines(mosquitto_sub(port, topic, 1, qos=1, client_id=cid, persistent=True, timeout_s=2)) == []


@pytest.mark.moorline_only
def test_canary_drop_on_restart_is_detected(broker_factory: BrokerFactory, uniq: str) -> None:
    """With the deliberately broken drop_on_restart build the same check must see a loss:
    proof that the durability check above can fail."""
    b = broker_factory(faults={"drop_on_restart": True})
    port, topic, cid, n = b.mqtt_port, f"{uniq}/d", f"{uniq}-sub", 50
    mosquitto_presubscribe(port, topic, cid, qos=1)
    assert mosquitto_pub(port, topic, None, qos=1, stdin_lines=[f"m{i}" for i in range(n)]).returncode == 0
    b.restart(kill=True)
    lines = sub_lines(mosquitto_sub(port, topic, n, qos=1, client_id=cid, persistent=True, timeout_s=5))
    assert len(lines) < n, "the broken build lost nothing: the durability check cannot detect a loss"


# --------------------------------------------------------------------------- QoS 1 stream, crash mid-stream


@dataclass
class StreamPublisher:
    """Pipelined QoS 1 publisher (window of in-flight PUBLISHes) recording what was PUBACKed."""

    client: RawClient
    topics: list[str]
    total: int
    window: int = 64
    sent: list[int] = field(default_factory=list)
    acked: set[int] = field(default_factory=set)
    error: BaseException | None = None
    ended_by_close: bool = False

    def run(self) -> None:
        pid_to_seq: dict[int, int] = {}
        seq = 0
        try:
            while len(self.acked) < self.total:
                while seq < self.total and len(pid_to_seq) < self.window:
                    pid = seq % 65535 + 1
                    self.client.send(encode_publish(self.topics[seq % len(self.topics)], f"{seq}".encode(), 1,
                                                    pid=pid, version=self.client.version))
                    pid_to_seq[pid] = seq
                    self.sent.append(seq)
                    seq += 1
                ack = self.client.recv(30)
                if ack.type == DISCONNECT:  # e.g. 0x8B server shutting down on SIGTERM
                    self.ended_by_close = True
                    return
                assert ack.type == PUBACK and ack.pid in pid_to_seq, ack
                assert ack.reason < 0x80, ack
                self.acked.add(pid_to_seq.pop(ack.pid))  # type: ignore[arg-type]
        except (ConnectionClosed, ConnectionResetError, BrokenPipeError):
            self.ended_by_close = True
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e


@dataclass
class StreamOutcome:
    acked: set[int]
    sent: list[int]
    delivered: list[Packet]

    @property
    def missing(self) -> list[int]:
        return sorted(self.acked - {int(m.payload) for m in self.delivered})


def run_qos1_stream_with_crash(b: BrokerProc, uniq: str, mode: str, seed: int, total: int = 4000) -> StreamOutcome:
    """A persistent subscriber (offline) on 8 topics; a pipelined QoS 1 publisher streams `total` messages;
    the broker crashes (`mode`) after a seeded number of PUBACKs; then the subscriber drains its queue."""
    rng = random.Random(seed)
    topics = [f"{uniq}/s/{i}" for i in range(8)]  # several shards
    kill_after_acks = rng.randint(300, 1500)
    sub = new_session(b, f"{uniq}-sub", [(f"{uniq}/s/+", 1)])
    sub.disconnect()  # offline: everything is queued for the session

    pub_client = RawClient(HOST, b.mqtt_port, 5)
    assert pub_client.connect(f"{uniq}-pub").reason == 0
    pub = StreamPublisher(pub_client, topics, total)
    t = threading.Thread(target=pub.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 120
    while len(pub.acked) < kill_after_acks and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.002)
    assert len(pub.acked) >= kill_after_acks, f"seed {seed}: only {len(pub.acked)} acks in time ({pub.error})"
    crash(b, mode, seed)
    t.join(30)
    assert not t.is_alive()
    assert pub.error is None, f"seed {seed}: publisher failed: {pub.error!r}"
    acked = set(pub.acked)
    assert len(acked) < total, "the stream finished before the crash; the test proved nothing"
    sub = reconnect(b, f"{uniq}-sub")
    got = drain_acking(sub, quiet=2.0)
    sub.disconnect()
    print(f"seed {seed} mode {mode}: sent {len(pub.sent)}, acked {len(acked)}, delivered {len(got)}")
    return StreamOutcome(acked, list(pub.sent), got)


@pytest.mark.parametrize("mode", RESTARTS)
def test_qos1_stream_crash_loses_no_acked_message(shared_broker: BrokerProc, uniq: str, mode: str) -> None:
    out = run_qos1_stream_with_crash(shared_broker, uniq, mode, SEED)
    seqs = [int(m.payload) for m in out.delivered]
    assert not out.missing, f"seed {SEED}: {len(out.missing)} of {len(out.acked)} acknowledged messages lost: " \
        f"{out.missing[:10]}"
    assert len(out.acked & set(seqs)) == len(out.acked)
    assert set(seqs) <= set(out.sent), "delivered a message that was never published"
    dups = [s for s, c in Counter(seqs).items() if c > 1]
    assert not dups, f"seed {SEED}: offline session got duplicates {dups[:10]}"
    for i in range(8):
        per_topic = [int(m.payload) for m in out.delivered if m.topic == f"{uniq}/s/{i}"]
        assert per_topic == sorted(per_topic), f"seed {SEED}: order broken on topic {i}"
        assert all(s % 8 == i for s in per_topic)


@pytest.mark.moorline_only
def test_canary_ack_before_sync_is_detected_by_power_loss(broker_factory: BrokerFactory, uniq: str,
                                                          tmp_path: Path) -> None:
    """The deliberately broken unsafe_ack_before_sync build acknowledges before fsync: a
    simulated power loss must then cost acknowledged messages, and the stream check must see it."""
    b = broker_factory(faults={"unsafe_ack_before_sync": True, "sync_ledger": str(tmp_path / "ledger.jsonl")})
    lost = 0
    for attempt in range(8):  # the crash must land while acked data is unsynced; usually the first time
        out = run_qos1_stream_with_crash(b, f"{uniq}-{attempt}", "powerloss", SEED + attempt)
        lost = len(out.missing)
        if lost:
            break
    assert lost > 0, "the unsafe build lost nothing on power loss: the durability check cannot see it"


@pytest.mark.moorline_only
@pytest.mark.parametrize("inline_sync_max_us", [0, 10_000_000], ids=["sync-thread", "sync-inline"])
def test_qos1_stream_power_loss_in_each_sync_mode(broker_factory: BrokerFactory, uniq: str, tmp_path: Path,
                                                   inline_sync_max_us: int) -> None:
    """Group commits run on the event loop or on the sync thread, chosen by how fast the disk syncs
    (storage.inline_sync_max_us). Both paths get the power-loss stream, each pinned by config."""
    b = broker_factory(faults={"sync_ledger": str(tmp_path / "ledger.jsonl")},
                       config_text=f"[storage]\ninline_sync_max_us = {inline_sync_max_us}\n")
    out = run_qos1_stream_with_crash(b, uniq, "powerloss", SEED)
    assert not out.missing, f"seed {SEED}: {len(out.missing)} of {len(out.acked)} acknowledged messages lost"
    with urllib.request.urlopen(b.http_url + "/metrics", timeout=30) as r:
        metrics = dict(line.split(" ", 1) for line in r.read().decode().splitlines() if not line.startswith("#"))
    inline, total = int(metrics["moorline_wal_syncs_inline_total"]), int(metrics["moorline_wal_syncs_total"])
    assert total > 0
    assert inline == (total if inline_sync_max_us else 0), f"{inline} of {total} syncs ran on the event loop"


# --------------------------------------------------------------------------- QoS 2 Method B subscriber, crash


@pytest.mark.parametrize("mode", RESTARTS)
def test_qos2_method_b_subscriber_exactly_once_across_crash(shared_broker: BrokerProc, uniq: str, mode: str) -> None:
    rng = random.Random(SEED + 1)
    n = 400
    topics = [f"{uniq}/q2/{i}" for i in range(4)]
    cid = f"{uniq}-sub"
    sub_client = new_session(shared_broker, cid, [(f"{uniq}/q2/+", 2)])
    sub_client.disconnect()

    pub = RawClient(HOST, shared_broker.mqtt_port, 5)
    assert pub.connect(f"{uniq}-pub").reason == 0
    for i in range(n):
        done = pub.publish_and_wait(topics[i % len(topics)], f"{i}".encode(), 2)
        assert done.type == PUBCOMP, done
    pub.disconnect()

    subscriber = MethodBSubscriber(cid, withhold_every=15)
    c = reconnect(shared_broker, cid, receive_maximum=64)
    kill_at = rng.randint(n // 4, 3 * n // 4)
    t = threading.Thread(target=subscriber.consume, args=(c,), kwargs={"quiet": 30.0, "delay": 0.004},
                         daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while len(subscriber.delivered) < kill_at and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert len(subscriber.delivered) >= kill_at, f"seed {SEED}: stalled at {len(subscriber.delivered)}"
    crash(shared_broker, mode)
    t.join(30)
    assert not t.is_alive()
    c.close()
    subscriber.withhold_every = 0
    before = len(subscriber.delivered)
    assert subscriber.withheld, "no message was left without PUBREC at the crash"
    assert before < n, "all delivered before the crash; the test proved nothing"

    c = reconnect(shared_broker, cid)
    subscriber.consume(c, quiet=2.0)
    c.disconnect()
    print(f"seed {SEED} mode {mode}: {before} of {n} delivered before the crash, {subscriber.resends} resends, "
          f"{subscriber.withheld_total} PUBRECs withheld")
    assert subscriber.violations == [], f"seed {SEED}: {subscriber.violations[:5]}"
    assert subscriber.withheld == set(), f"never resent although not PUBREC'd: pids {sorted(subscriber.withheld)}"
    assert subscriber.resends >= subscriber.withheld_total
    counts = Counter(subscriber.delivered)
    assert [p for p, k in counts.items() if k > 1] == [], f"seed {SEED}: delivered more than once"
    assert len(subscriber.delivered) == n, f"seed {SEED}: {len(subscriber.delivered)} of {n} delivered"
    for i, topic in enumerate(topics):
        per = [int(p) for p in subscriber.delivered if int(p) % len(topics) == i]
        assert per == sorted(per), f"order broken on {topic}"


# --------------------------------------------------------------------------- QoS 2 publisher resend, crash


@pytest.mark.parametrize("mode", RESTARTS)
def test_qos2_publisher_resend_after_crash_delivers_once(shared_broker: BrokerProc, uniq: str, mode: str) -> None:
    topic, pub_id, sub_id = f"{uniq}/once", f"{uniq}-pub", f"{uniq}-sub"
    sub = new_session(shared_broker, sub_id, [(topic, 2)])
    sub.disconnect()
    pub = RawClient(HOST, shared_broker.mqtt_port, 5)
    assert pub.connect(pub_id, clean=False, props=[(P_SESSION_EXPIRY, 3600)]).reason == 0
    pub.send(encode_publish(topic, b"only-once", 2, pid=9, version=5))
    time.sleep(0.5)  # the broker has it; we never read its PUBREC
    pub.abort()
    crash(shared_broker, mode)

    pub = reconnect(shared_broker, pub_id)
    pub.send(encode_publish(topic, b"only-once", 2, pid=9, dup=True, version=5))
    rec = pub.expect(PUBREC, 10)
    assert rec.pid == 9 and rec.reason < 0x80, rec
    pub.send(encode_ack(PUBREL, 9, 5))
    comp = pub.expect(PUBCOMP, 10)
    assert comp.pid == 9 and comp.reason == 0, comp
    pub.disconnect()

    subscriber = MethodBSubscriber(sub_id)
    c = reconnect(shared_broker, sub_id)
    subscriber.consume(c, quiet=1.5)
    c.disconnect()
    assert subscriber.violations == []
    assert subscriber.delivered == [b"only-once"]


# --------------------------------------------------------------------------- QoS 1 in flight, crash


@pytest.mark.parametrize("mode", RESTARTS)
def test_unacked_qos1_resent_first_in_order_with_original_ids_after_crash(shared_broker: BrokerProc, uniq: str,
                                                                          mode: str) -> None:
    """A subscriber acknowledges only some deliveries; the broker crashes; more messages are published
    after the restart. On reconnect the session first re-sends its unacknowledged messages, in their
    original order, with DUP=1 and their original packet ids, then continues with the new ones."""
    cid, topic = f"{uniq}-sub", f"{uniq}/inflight"
    c = new_session(shared_broker, cid, [(topic, 1)])
    pub = RawClient(HOST, shared_broker.mqtt_port, 5)
    assert pub.connect(f"{uniq}-pub").reason == 0
    for i in range(10):
        pub.publish_and_wait(topic, f"{i}".encode(), 1)
    pub.disconnect()
    first = [c.next_message(10) for _ in range(10)]
    assert [int(m.payload) for m in first] == list(range(10))
    acked = {0, 1, 4, 7}
    for m in first:
        if int(m.payload) in acked:
            c.send(encode_ack(PUBACK, m.pid, 5))  # type: ignore[arg-type]
    c.ping()
    time.sleep(0.3)  # let the broker commit the acknowledgements it received
    c.abort()
    crash(shared_broker, mode)
    pub = RawClient(HOST, shared_broker.mqtt_port, 5)
    assert pub.connect(f"{uniq}-pub").reason == 0
    for i in range(10, 15):
        pub.publish_and_wait(topic, f"{i}".encode(), 1)
    pub.disconnect()

    c = reconnect(shared_broker, cid)
    got = drain_acking(c, quiet=1.5)
    c.disconnect()
    resent = [m for m in got if int(m.payload) < 10]
    fresh = [m for m in got if int(m.payload) >= 10]
    pid_of = {int(m.payload): m.pid for m in first}
    unacked = [i for i in range(10) if i not in acked]
    # acknowledged ones may come back only after a crash, since QoS 1 acks are committed in batches
    allowed = set(range(10)) if mode != "sigterm" else set(unacked)
    assert {int(m.payload) for m in resent} <= allowed, [int(m.payload) for m in resent]
    assert set(unacked) <= {int(m.payload) for m in resent}, "an unacknowledged message was not resent"
    assert [int(m.payload) for m in resent] == sorted(int(m.payload) for m in resent), "resend order"
    assert all(m.dup and m.pid == pid_of[int(m.payload)] for m in resent), resent
    assert got[: len(resent)] == resent, "resends must come before new messages"
    assert [int(m.payload) for m in fresh] == list(range(10, 15))
    assert all(not m.dup for m in fresh)
