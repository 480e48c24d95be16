"""Network fuzz of the cluster port (issue 30): a peer holding valid credentials (node n2's, in a
loopback cluster without a secret) does the real handshake with a running node, then sends mutated
frames: bit flips, truncations, wrong lengths, forged senders, and well-typed frames with absurd
fields. Afterwards no node has crashed or logged a traceback, every node still takes writes, and
nothing a frame of n2 could not legitimately cause happened: no message committed from a forged
origin, no other node's admission moved.

Bounded: FUZZ_FRAMES frames or FUZZ_SECONDS, whichever comes first; the seed is printed.
"""

from __future__ import annotations

import asyncio
import base64
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from moorline.broker import commands as c
from moorline.broker.messages import StoredMessage
from moorline.cluster import handshake
from moorline.cluster.net import AsyncioStream
from moorline.cluster.wire import LENGTH_BYTES, FrameDecoder, Heartbeats, Payload, RaftMessages, encode_frame
from moorline.raft.coalesce import HeartbeatBatch, HeartbeatItem
from moorline.raft.types import Entry, Message, MessageType, Stream

_E2E = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_E2E / "cluster_e2e"))
sys.path.insert(0, str(_E2E / "e2e"))

from cluster_clients import connect  # noqa: E402
from cluster_harness import SHARD_COUNT, Cluster, ClusterNode, wait_for  # noqa: E402

pytestmark = [pytest.mark.timeout(240)]

FUZZ_FRAMES = 3000
FUZZ_SECONDS = 8.0
MARKER = b"FORGED-BY-FUZZ"
_enc = msgspec.msgpack.Encoder()
ABSURD = [-1, -(2**63), 2**62, 2**63 - 1, 2**64 - 1, 10**18, 0, 1, 7]


class Fuzzer:
    def __init__(self, rng: random.Random, sids: dict[str, str], shard: int, topic: str) -> None:
        self.rng = rng
        self.sids = sids
        self.shard = shard
        self.topic = topic
        self.me = (2, sids["n2"])

    def num(self) -> int:
        return self.rng.choice(ABSURD) if self.rng.random() < 0.7 else self.rng.randrange(0, 1000)

    def member(self, legit: bool) -> tuple[int, str]:
        if legit:
            return self.me
        return self.rng.choice([(1, self.sids["n1"]), (3, self.sids["n3"]), (2, "not-its-storage"),
                                (self.rng.choice(ABSURD), "x"), (99, self.sids["n3"])])

    def forged_entry(self) -> bytes:
        msg = StoredMessage(self.topic, MARKER, 1, True, os.urandom(16), int(time.time() * 1000))
        origin = self.rng.choice([1, 3, 99, 0])
        return c.encode_entry([c.Publish(msg)], origin=origin, boot=self.rng.choice([1, 2, 2**62]), seq=1)

    def raft_message(self) -> Message:
        r = self.rng
        forged = r.random() < 0.5
        m = Message(type=MessageType(r.randrange(1, 13)), from_=self.member(not forged),
                    to=(1, self.sids["n1"]) if r.random() < 0.8 else (r.choice(ABSURD), "y"))
        # a sender that is n2 only ever comes with an absurd number (a plausible one would be a
        # Raft message n2 may send: legitimate, not what this test is about)
        m.term = r.choice([-1, 2**62, 2**63 - 1, 2**64 - 1]) if not forged else self.num()
        m.index, m.commit, m.log_term, m.reject_hint = self.num(), self.num(), self.num(), self.num()
        if r.random() < 0.3:
            m.entries = [Entry(self.num(), self.num(), data=self.forged_entry()) for _ in range(r.randrange(1, 4))]
        m.context = r.randbytes(r.randrange(0, 20))
        return m

    def frame(self) -> bytes:
        r = self.rng
        kind = r.randrange(6)
        if kind == 0:
            group = r.choice([self.shard, SHARD_COUNT, -1, 2**40, r.randrange(SHARD_COUNT)])
            f: Any = RaftMessages([(group, self.raft_message()) for _ in range(r.randrange(1, 4))])
        elif kind == 1:
            forged = r.random() < 0.6
            items = [HeartbeatItem(r.choice([self.shard, -5, 2**33]), r.random() < 0.5, self.member(not forged),
                                   (1, self.sids["n1"]),
                                   r.choice([-1, 2**63 - 1]) if not forged else self.num(), self.num())
                     for _ in range(r.randrange(1, 5))]
            f = Heartbeats(HeartbeatBatch(2 if not forged or r.random() < 0.5 else r.choice([1, 3, -1]), 1, items))
        elif kind == 2:  # a forwarded entry naming another origin (a forged retained message)
            f = Payload("fwd", _enc.encode((r.choice([self.shard, -1, 10**9]), [self.forged_entry()])))
        elif kind == 3:  # an announcement of another node
            f = Payload("member", _enc.encode({"name": r.choice(["n1", "n3", "zz", "\n\x1b[2J CRITICAL"]),
                                               "storage_id": "evil", "members": {"n1": "other"}, "layout": "x"}))
        elif kind == 4:
            f = Payload(r.choice(["snap", "fwd", "member", "??", ""]), r.randbytes(r.randrange(0, 200)))
        else:
            f = Payload("fwd", r.randbytes(r.randrange(0, 64)))
        data = encode_frame(f)
        return self.mutate(data)

    def mutate(self, data: bytes) -> bytes:
        r = self.rng
        roll = r.random()
        if roll < 0.85:
            return data
        body = bytearray(data)
        if roll < 0.93:  # bit flips in the body (the length kept: the stream stays in step)
            for _ in range(r.randrange(1, 6)):
                if len(body) > LENGTH_BYTES:
                    i = r.randrange(LENGTH_BYTES, len(body))
                    body[i] ^= 1 << r.randrange(8)
            return bytes(body)
        if roll < 0.97:  # truncated body, length fixed up (a well-framed short frame)
            cut = r.randrange(LENGTH_BYTES, len(body) + 1)
            short = body[LENGTH_BYTES:cut]
            return len(short).to_bytes(LENGTH_BYTES, "big") + bytes(short)
        # a wrong length: too long, huge, or too short (the rest desynchronises the stream)
        length = r.choice([len(body) + 50, 2**31, 0, max(0, len(body) - LENGTH_BYTES - 3)])
        return length.to_bytes(LENGTH_BYTES, "big") + bytes(body[LENGTH_BYTES:])


async def fuzz(target: ClusterNode, fz: Fuzzer, max_frames: int, max_s: float) -> dict[str, int]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max_s
    sent = connections = closed_by_node = 0
    me = handshake.Identity("n2", "moorline", None, os.urandom)
    while sent < max_frames and loop.time() < deadline:
        reader, writer = await asyncio.open_connection(*target.cluster_addr, local_addr=("127.0.0.1", 0))
        stream = AsyncioStream(reader, writer)
        fr = handshake.FrameReader(stream, FrameDecoder(handshake.MAX_HANDSHAKE_FRAME_BYTES), 65536)
        try:
            async with asyncio.timeout(5):
                await handshake.dial(stream, fr, me, "n1", Stream(fz.rng.randrange(3)))
            connections += 1
            for _ in range(fz.rng.randrange(5, 60)):
                stream.write(fz.frame())
                sent += 1
            await stream.drain()
            try:
                async with asyncio.timeout(0.05):
                    while await reader.read(65536):
                        pass  # Pongs, then the node's Refused and the end when it closed us
                    closed_by_node += 1
            except TimeoutError:
                pass
        except (OSError, handshake.HandshakeError):
            closed_by_node += 1
        finally:
            stream.close()
    return {"frames": sent, "connections": connections, "closed_by_node": closed_by_node}


def publish_via(node: ClusterNode, cid: str, topic: str, payload: bytes) -> int:
    pub = connect(node, cid, clean=True, expiry=0)
    try:
        return int(pub.publish_and_wait(topic, payload, 1, timeout=20).reason)
    finally:
        pub.close()


def test_fuzzed_frames_from_an_authenticated_peer_crash_nothing_and_forge_nothing(tmp_path: Path) -> None:
    seed = int(os.environ.get("MOORLINE_FUZZ_SEED", random.randrange(1 << 30)))
    print(f"fuzz seed {seed} (MOORLINE_FUZZ_SEED={seed} to repeat)")
    cluster = Cluster(tmp_path / "cluster", 3)
    try:
        cluster.start()
        sids = {n["id"]: n["storage_id"] for n in cluster["n1"].get("/v1/cluster")["nodes"]}
        topic = cluster.topic_led_by("n1", "fuzz")
        stats = asyncio.run(fuzz(cluster["n1"], Fuzzer(random.Random(seed), sids, cluster.shard_of(topic), topic),
                                 FUZZ_FRAMES, FUZZ_SECONDS))
        print("fuzz:", stats)
        assert stats["frames"] >= 500, stats

        assert [nd.name for nd in cluster.running()] == ["n1", "n2", "n3"], "a node died"
        cluster.wait_leaders(timeout=60)
        for name in ("n1", "n2", "n3"):  # every node's writes still apply (no admission moved)
            for shard_topic in (topic, f"other/{name}"):
                assert publish_via(cluster[name], f"after-fuzz-{name}", shard_topic, b"after " + name.encode()) == 0
        for nd in cluster.running():
            for shard in range(SHARD_COUNT):
                payloads = [base64.b64decode(m["payload"]) for m in nd.messages(shard)]
                assert MARKER not in payloads, f"{nd.name} stored a forged message in shard {shard}"
        refused = wait_for("n1 counts refused frames", lambda: next(
            n for n in cluster["n1"].get("/v1/cluster")["nodes"] if n["id"] == "n2")["transport"]["frames_refused"], 10)
        print("n1 refused frames from n2:", refused)
        for nd in cluster.nodes.values():
            log = nd.log()
            assert "Traceback" not in log, f"{nd.name} logged a traceback:\n{nd.log_tail(60)}"
            assert "CRITICAL" not in log.replace("\\n\\x1b[2J CRITICAL", ""), f"{nd.name}: a forged log line"
        bad = cluster.bad_log_lines()
        assert not bad, f"ERROR lines or tracebacks: {bad}"
    finally:
        problems = cluster.close()
    assert not problems, problems
