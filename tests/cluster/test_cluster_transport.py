"""ClusterTransport over real asyncio sockets on loopback aliases 127.0.0.11-14."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
from dataclasses import replace
from functools import partial

import pytest

from moorline.cluster import ClusterConfigError, ClusterTransport, FrameTooLarge, handshake
from moorline.cluster.net import AsyncioNetwork, ByteStream
from moorline.cluster.wire import FrameDecoder, Payload, Pong, Refused, encode_frame, preamble
from moorline.raft.coalesce import GroupId, HeartbeatBatch, HeartbeatItem
from moorline.raft.types import Entry, Message, MessageType, Snapshot, SnapshotMeta, Stream
from tests.cluster.helpers import (
    CLUSTER_ID,
    FAST,
    HOSTS,
    SECRET,
    FakePeer,
    Inbox,
    close_all,
    mesh,
    requires_loopback_aliases,
    start_transport,
    wait_until,
)

pytestmark = [pytest.mark.timeout(60), requires_loopback_aliases]


def run(coro_fn, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    async def bounded() -> None:
        async with asyncio.timeout(timeout_s):
            await coro_fn()

    asyncio.run(bounded())


def msg(kind: MessageType, src: int, dst: int, data: bytes = b"") -> Message:
    m = Message(type=kind, from_=(src, f"s{src}"), to=(dst, f"s{dst}"), term=3)
    if kind == MessageType.APP:
        m.entries = [Entry(3, 7, data=data)]
    if kind == MessageType.SNAP:
        m.snapshot = Snapshot(SnapshotMeta(index=9, term=3), data=data)
    return m


def heartbeats(src: int, dst: int, n: int, commit: int = 0) -> HeartbeatBatch:
    return HeartbeatBatch(src, dst, [HeartbeatItem(g, False, (src, "s"), (dst, "s"), 3, commit) for g in range(n)])


# --- delivery on every stream -------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3])
def test_transports_exchange_raft_messages_and_heartbeats_on_every_stream(n: int) -> None:
    async def body() -> None:
        nodes = await mesh(n)
        try:
            for i, (t, _) in enumerate(nodes):
                for j, (u, _) in enumerate(nodes):
                    if i == j:
                        continue
                    items: list[tuple[GroupId, Message]] = [(0, msg(MessageType.VOTE, i + 1, j + 1)), ("meta", msg(MessageType.APP, i + 1, j + 1, b"e")),
                             (5, msg(MessageType.SNAP, i + 1, j + 1, b"snapshot")),
                             (1, msg(MessageType.APP_RESP, i + 1, j + 1))]
                    assert t.send_raft(u.node_name, items) == 4
                    assert t.send_heartbeats(u.node_name, heartbeats(i + 1, j + 1, 16))
                    assert t.send(u.node_name, Stream.CONTROL, Payload("fwd", f"{t.node_name}->{u.node_name}".encode()))
            def heard_all(inbox: Inbox, others: list[str]) -> bool:
                return all(len(inbox.raft(p)) == 3 and inbox.heartbeats(p) and inbox.payloads(p)
                           for p in others)

            for u, inbox in nodes:
                others = [t.node_name for t, _ in nodes if t is not u]
                await wait_until(partial(heard_all, inbox, others), 10, f"{u.node_name} hears every frame of {others}")
                for p in others:
                    got = [gm for f in inbox.raft(p) for gm in f.messages]
                    assert sorted((str(g), m.type) for g, m in got) == sorted(
                        [("0", MessageType.VOTE), ("meta", MessageType.APP), ("5", MessageType.SNAP),
                         ("1", MessageType.APP_RESP)])
                    snap = next(m for _, m in got if m.type == MessageType.SNAP)
                    assert snap.snapshot is not None and snap.snapshot.data == b"snapshot"
                    hb = inbox.heartbeats(p)[0]
                    assert len(hb.batch.items) == 16
                    assert inbox.payloads(p)[0].data == f"{p}->{u.node_name}".encode()
                    # each message travelled on its own stream, and every connection came from the
                    # sender's own cluster host (outgoing connections are bound to it)
                    st = u.stats().peers[p]
                    assert st.streams["control"].frames_received == 3  # vote, heartbeats, payload
                    assert st.streams["append"].frames_received == 1
                    assert st.streams["snapshot"].frames_received == 1
                    sender_host = HOSTS[int(p[1:]) - 1]
                    for s in ("control", "append", "snapshot"):
                        src = st.streams[s].incoming_from
                        assert src is not None and src.rsplit(":", 1)[0] == sender_host, (s, src)
                    assert st.last_contact_age_s is not None and st.last_error is None
        finally:
            await close_all(nodes)

    run(body)


def test_send_raft_splits_below_the_frame_limit_and_keeps_order() -> None:
    async def body() -> None:
        limits = replace(FAST, max_frame_bytes=64 << 10)
        nodes = await mesh(2, limits=[limits, limits])
        (a, _), (b, inbox) = nodes
        try:
            items = [(g, msg(MessageType.APP, 1, 2, bytes([g]) * (20 << 10))) for g in range(10)]
            assert a.send_raft("n2", items) == 10
            await wait_until(lambda: sum(len(f.messages) for f in inbox.raft()) == 10, 10,
                             "all ten appends")
            frames = inbox.raft()
            assert len(frames) > 1
            assert [g for f in frames for g, _ in f.messages] == list(range(10))
            with pytest.raises(FrameTooLarge):
                a.send_raft("n2", [(0, msg(MessageType.APP, 1, 2, b"x" * (65 << 10)))])
            with pytest.raises(FrameTooLarge):
                a.send("n2", Stream.APPEND, Payload("big", b"x" * (65 << 10)))
            assert not a.send("nobody", Stream.CONTROL, Payload("k", b"")) and a.stats().dropped_unknown_peer == 1
        finally:
            await close_all(nodes)

    run(body)


# --- authentication ------------------------------------------------------------------------------


def test_wrong_secret_delivers_nothing_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="moorline.cluster")

    async def body() -> None:
        nodes = await mesh(2, secrets=[SECRET, b"not the same secret at all"])
        (a, inbox_a), (b, inbox_b) = nodes
        try:
            for _ in range(20):
                a.send("n2", Stream.CONTROL, Payload("k", b"hello"))
                b.send("n1", Stream.CONTROL, Payload("k", b"hello"))
                await asyncio.sleep(0.05)
            await wait_until(lambda: b.stats().peers["n1"].auth_failures > 0 and a.stats().peers["n2"].auth_failures > 0,
                             10, "both sides count the failed proofs")
            assert inbox_a.frames == [] and inbox_b.frames == []
            for t, other in ((a, "n2"), (b, "n1")):
                st = t.stats()
                assert st.refused_connections > 0 and "authentication failed" in (st.last_refusal or "")
                assert st.peers[other].connected_streams == [] and st.peers[other].incoming_streams == []
                assert "authentication failed" in (st.peers[other].last_error or "")
        finally:
            await close_all(nodes)

    run(body)
    assert any("authentication failed" in r.getMessage() and "cluster secret" in r.getMessage()
               for r in caplog.records)


def test_listening_off_loopback_without_a_secret_is_refused() -> None:
    async def body() -> None:
        t = ClusterTransport("n1", ("0.0.0.0", 0), {}, None, Inbox(), random.Random(0))
        with pytest.raises(ClusterConfigError, match="without a cluster secret"):
            await t.start()
        await t.close()

    run(body)


# --- failures and bounds ------------------------------------------------------------------------


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def test_a_peer_that_comes_up_late_is_reached_within_the_backoff_cap() -> None:
    async def body() -> None:
        a, _ = await start_transport(0)
        port = _free_port(HOSTS[1])
        a.add_peer("n2", (HOSTS[1], port))
        b = None
        try:
            # Let the backoff grow to its cap (0.05 * 2^6 = 3.2 s uncapped; FAST caps it at 0.3 s).
            await wait_until(lambda: a.stats().peers["n2"].streams["control"].connect_failures >= 7, 10,
                             "seven failed attempts")
            assert "Connection refused" in (a.stats().peers["n2"].last_error or "")
            inbox = Inbox()
            b = ClusterTransport("n2", (HOSTS[1], port), {"n1": a.listen_address}, SECRET, inbox, random.Random(1),
                                 cluster_id=CLUSTER_ID, limits=FAST)
            await b.start()
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            while not inbox.payloads():
                a.send("n2", Stream.CONTROL, Payload("ping", b""))
                await asyncio.sleep(0.01)
                assert loop.time() - t0 < 5, "never reached"
            elapsed = loop.time() - t0
            # bound: the longest backoff (cap) plus connect and handshake on loopback
            assert elapsed <= FAST.backoff_cap_s + 0.5, f"reached after {elapsed:.2f} s"
        finally:
            await a.close()
            if b is not None:
                await b.close()

    run(body)


def test_a_stalled_peer_fills_only_its_own_queue() -> None:
    async def body() -> None:
        limits = replace(FAST, max_queue_bytes=1 << 20, idle_timeout_s=30.0, write_stall_timeout_s=30.0)
        undelivered: list[tuple[str, Stream]] = []
        a, _ = await start_transport(0, limits=limits,
                                     on_undelivered=lambda p, s, f: undelivered.append((p, s)))
        b, inbox_b = await start_transport(1, limits=limits)
        stuck = FakePeer(HOSTS[2], "n3", {"n1"})
        a.add_peer("n2", b.listen_address)
        b.add_peer("n1", a.listen_address)
        a.add_peer("n3", await stuck.start())
        try:
            await wait_until(lambda: "append" in a.stats().peers["n3"].connected_streams
                             and "control" in a.stats().peers["n2"].connected_streams, 10, "links up")
            chunk = Payload("bulk", b"x" * (64 << 10))
            sent_hb = 0
            for i in range(400):  # 25 MiB for n3: more than its socket buffers and our queue together
                a.send("n3", Stream.APPEND, chunk)
                assert a.send_heartbeats("n2", heartbeats(1, 2, 4, commit=i))
                sent_hb += 1
                await asyncio.sleep(0.002)
            await wait_until(lambda: len(inbox_b.heartbeats()) == sent_hb, 10, "every heartbeat reaches n2")
            assert [f.batch.items[0].commit for f in inbox_b.heartbeats()] == list(range(400))
            st = a.stats().peers
            bulk = st["n3"].streams["append"]
            assert bulk.dropped_queue_full > 0, "the stalled link never filled"
            assert bulk.queued_bytes <= limits.max_queue_bytes
            assert st["n3"].streams["control"].dropped_queue_full == 0
            assert st["n2"].dropped == 0, "a stalled peer cost another peer frames"
            assert undelivered.count(("n3", Stream.APPEND)) == bulk.dropped_queue_full
            assert all(p == "n3" for p, _ in undelivered)
        finally:
            await asyncio.gather(a.close(), b.close(), stuck.close())

    run(body)


def test_a_large_append_does_not_delay_a_control_frame_sent_after_it() -> None:
    async def body() -> None:
        roomy = replace(FAST, max_queue_bytes=64 << 20)  # so a shared queue would not just drop the vote
        nodes = await mesh(2, limits=[roomy, roomy])
        (a, _), (b, inbox) = nodes
        try:
            await wait_until(lambda: len(a.stats().peers["n2"].connected_streams) == 3, 10, "links up")
            big = Payload("append", b"a" * (24 << 20))
            assert a.send("n2", Stream.APPEND, big)
            assert a.send("n2", Stream.CONTROL, Payload("vote", b"v"))
            await wait_until(lambda: len(inbox.frames) == 2, 20, "both frames")
            kinds = [f.kind for f in inbox.payloads()]
            assert kinds == ["vote", "append"], f"the control frame waited behind the append: {kinds}"
            assert len(inbox.payloads()[1].data) == 24 << 20
        finally:
            await close_all(nodes)

    run(body)


def test_a_frame_above_the_receivers_limit_closes_the_connection_and_is_named() -> None:
    async def body() -> None:
        nodes = await mesh(2, limits=[replace(FAST, max_frame_bytes=8 << 20), replace(FAST, max_frame_bytes=1 << 20)])
        (a, _), (b, inbox) = nodes
        try:
            await wait_until(lambda: "append" in a.stats().peers["n2"].connected_streams, 10, "links up")
            assert a.send("n2", Stream.APPEND, Payload("big", b"x" * (2 << 20)))
            await wait_until(lambda: "above the maximum of 1048576 bytes" in (b.stats().peers["n1"].last_error or ""),
                             10, "the receiver names the size")
            await wait_until(lambda: "above the maximum" in (a.stats().peers["n2"].last_error or ""), 10,
                             "the sender hears why")
            assert inbox.frames == []
            assert a.stats().peers["n2"].streams["append"].connects == 1
            # the link is redialed and keeps working for frames within the limit
            await wait_until(lambda: a.stats().peers["n2"].streams["append"].connects == 2, 10, "redialed")
            assert a.send("n2", Stream.APPEND, Payload("small", b"y"))
            await wait_until(lambda: len(inbox.frames) == 1, 10, "a small frame after the refusal")
        finally:
            await close_all(nodes)

    run(body)


async def _dial_raw(listener: tuple[str, int], name: str = "n1") -> tuple[ByteStream, handshake.FrameReader]:
    net = AsyncioNetwork()
    stream = await net.connect(listener[0], listener[1], HOSTS[0])
    reader = handshake.FrameReader(stream, FrameDecoder(1 << 16), 65536)
    await handshake.dial(stream, reader, handshake.Identity(name, CLUSTER_ID, SECRET, os.urandom), "n2",
                         Stream.APPEND)
    return stream, reader


def test_an_oversized_length_is_refused_before_its_body_arrives() -> None:
    async def body() -> None:
        b, inbox = await start_transport(1, limits=replace(FAST, max_frame_bytes=1 << 20))
        b.add_peer("n1", (HOSTS[0], 1))
        try:
            stream, reader = await _dial_raw(b.listen_address)
            stream.write((1 << 30).to_bytes(4, "big"))  # announces 1 GiB; sends none of it
            frames: list[object] = []
            while True:
                got = await reader.read_frames()
                if not got:
                    break
                frames += got
            assert any(isinstance(f, Refused) and "1073741824 bytes" in f.reason for f in frames), frames
            assert inbox.frames == []
        finally:
            await b.close()

    run(body)


def test_idle_connections_are_closed_on_both_sides() -> None:
    async def body() -> None:
        limits = replace(FAST, keepalive_interval_s=0.1, idle_timeout_s=0.5)
        # listener side: a dialer that authenticates, then sends nothing (not even a ping)
        b, _ = await start_transport(1, limits=limits)
        b.add_peer("n1", (HOSTS[0], 1))
        stream, reader = await _dial_raw(b.listen_address)
        got: list[object] = []
        while True:
            frames = await reader.read_frames()
            if not frames:
                break
            got += frames
        assert got and all(isinstance(f, Pong) for f in got)  # it kept saying it was alive, then gave up
        await wait_until(lambda: "no byte from n1" in (b.stats().peers["n1"].last_error or ""), 5, "idle reason")
        await b.close()
        # dialer side: a listener that authenticates and then never answers
        a, _ = await start_transport(0, limits=limits)
        mute = FakePeer(HOSTS[2], "n3", {"n1"})
        a.add_peer("n3", await mute.start())
        try:
            await wait_until(lambda: "no sign of life from n3" in (a.stats().peers["n3"].last_error or ""), 5,
                             "dialer notices the silence")
            await wait_until(lambda: a.stats().peers["n3"].streams["control"].connects >= 2, 5, "and redials")
        finally:
            await asyncio.gather(a.close(), mute.close())

    run(body)


def test_close_returns_promptly_whatever_the_peers_do() -> None:
    async def body() -> None:
        limits = replace(FAST, close_timeout_s=1.0, max_queue_bytes=4 << 20, idle_timeout_s=30.0,
                         write_stall_timeout_s=30.0, handshake_timeout_s=30.0, connect_timeout_s=30.0)
        a, _ = await start_transport(0, limits=limits)
        stuck = FakePeer(HOSTS[2], "n3", {"n1"})
        a.add_peer("n3", await stuck.start())
        a.add_peer("n4", (HOSTS[3], _free_port(HOSTS[3])))  # nobody there: dialing and backing off
        await wait_until(lambda: "append" in a.stats().peers["n3"].connected_streams, 10, "link to the stuck peer")
        for _ in range(200):
            a.send("n3", Stream.APPEND, Payload("bulk", b"x" * (64 << 10)))
            a.send("n4", Stream.CONTROL, Payload("k", b""))
            await asyncio.sleep(0)
        # a socket that connects to our listener and never says a word (a pending handshake)
        silent_r, silent_w = await asyncio.open_connection(*a.listen_address)
        await asyncio.sleep(0.2)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await a.close()
        elapsed = loop.time() - t0
        assert elapsed <= limits.close_timeout_s + 0.5, f"close took {elapsed:.2f} s"
        left = [t for t in asyncio.all_tasks() if t.get_name().startswith("cluster-link") and not t.done()]
        assert left == []
        assert await asyncio.wait_for(silent_r.readexactly(len(preamble())), 2) == preamble()  # then closed
        assert await asyncio.wait_for(silent_r.read(100), 2) == b""
        silent_w.close()
        await stuck.close()

    run(body)


def test_peers_can_be_added_and_removed() -> None:
    async def body() -> None:
        nodes = await mesh(2)
        (a, _), (b, inbox_b) = nodes
        try:
            await wait_until(lambda: len(b.stats().peers["n1"].incoming_streams) == 3, 10, "incoming streams")
            b.remove_peer("n1")
            assert "n1" not in b.stats().peers
            a.send("n2", Stream.CONTROL, Payload("k", b"after removal"))
            await wait_until(lambda: "not a peer of n2" in (a.stats().peers["n2"].last_error or ""), 10,
                             "a is told it is no longer a peer")
            assert inbox_b.frames == []
        finally:
            await close_all(nodes)

    run(body)


def _all_streams_up(t: ClusterTransport, peer: str) -> bool:
    return len(t.stats().peers[peer].connected_streams) == 3


def test_closing_while_links_break_leaves_no_task_behind() -> None:
    """A transport closed while its links are noticing that the peer went away (the other end just
    closed) must still end every task within the bound: the cancellation must not be swallowed."""

    async def body() -> None:
        loop = asyncio.get_running_loop()
        for delay_s in (0.0, 0.0005, 0.001, 0.002, 0.004, 0.008):
            nodes = await mesh(2)
            (a, _), (b, _) = nodes
            await wait_until(partial(_all_streams_up, b, "n1"), 10, "links up")
            await a.close()
            await asyncio.sleep(delay_s)
            t0 = loop.time()
            await b.close()
            assert loop.time() - t0 <= FAST.close_timeout_s + 0.5
            left = [t for t in asyncio.all_tasks() if t.get_name().startswith("cluster-link") and not t.done()]
            assert left == [], f"tasks still running after close (delay {delay_s}): {left}"

    run(body)


def test_a_slow_large_frame_is_not_mistaken_for_an_idle_connection() -> None:
    """Idle means no byte at all: a frame whose bytes keep coming, however slowly, is received."""

    async def body() -> None:
        limits = replace(FAST, keepalive_interval_s=0.1, idle_timeout_s=0.5)
        b, inbox = await start_transport(1, limits=limits)
        b.add_peer("n1", (HOSTS[0], 1))
        try:
            stream, _ = await _dial_raw(b.listen_address)
            frame = encode_frame(Payload("slow", b"s" * (64 << 10)))
            pieces = 16
            step = len(frame) // pieces + 1
            for i in range(pieces):  # 16 x 0.1 s: three times the idle timeout in all
                stream.write(frame[i * step:(i + 1) * step])
                await asyncio.sleep(0.1)
            await wait_until(lambda: len(inbox.payloads()) == 1, 5, "the slow frame")
            st = b.stats().peers["n1"]
            assert "no byte" not in (st.last_error or "") and st.incoming_streams == ["append"]
            stream.close()
        finally:
            await b.close()

    run(body)


def test_a_large_frame_on_a_slow_link_is_not_mistaken_for_a_stall() -> None:
    """The write-stall timeout bounds the time for one write slice to leave, not a whole frame."""

    async def body() -> None:
        limits = replace(FAST, write_stall_timeout_s=1.0, idle_timeout_s=30.0)
        a, _ = await start_transport(0, limits=limits)
        slow = FakePeer(HOSTS[2], "n3", {"n1"}, stall=False, slow_read_bytes_per_100ms=1 << 20)
        a.add_peer("n3", await slow.start())
        try:
            await wait_until(lambda: "snapshot" in a.stats().peers["n3"].connected_streams, 10, "link up")
            # ~2.5 s at 10 MB/s. Sliced, one drain waits for the kernel's buffer to half empty (a few
            # hundred ms); in one piece it would wait for most of the frame to leave (~2 s).
            assert a.send("n3", Stream.SNAPSHOT, Payload("chunk", b"c" * (24 << 20)))
            await wait_until(lambda: any(isinstance(f, Payload) for f in slow.frames_read)
                             or a.stats().peers["n3"].streams["snapshot"].connects > 1, 20, "the whole frame")
            assert a.stats().peers["n3"].last_error is None
            st = a.stats().peers["n3"].streams["snapshot"]
            assert st.connects == 1 and st.dropped_disconnected == 0
        finally:
            await asyncio.gather(a.close(), slow.close())

    run(body)
