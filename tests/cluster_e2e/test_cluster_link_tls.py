"""The cluster link against a peer that holds valid credentials but lies (issue 30.5), on real
processes: a frame naming another sender than the authenticated peer changes nothing; an absurd
boot from the node itself cannot lock it out; a cluster runs over TLS with node certificates, and
the shared-secret mode is refused off loopback.

The attacker dials a node's cluster port with the real handshake. The harness's clusters are on
loopback without a secret (still allowed there), so the attacker's credentials are a node name,
as a TLS certificate would be one node's: what it may do is what that one node may do.
"""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster_clients import connect
from cluster_harness import REPO_ROOT, Cluster, ClusterFactory, ClusterNode, wait_for

from moorline.broker import commands as c
from moorline.broker.messages import StoredMessage
from moorline.cluster import handshake
from moorline.cluster.net import AsyncioStream
from moorline.cluster.wire import FrameDecoder, Payload, encode_frame
from moorline.raft.types import Stream

pytestmark = [pytest.mark.cluster_e2e, pytest.mark.timeout(180)]

_enc = __import__("msgspec").msgpack.Encoder()


async def _send_as(target: ClusterNode, claim: str, frames: list[Payload], source: str = "127.0.0.1") -> None:
    """Authenticate to ``target`` as node ``claim`` (no secret: loopback cluster), send ``frames``
    on the append stream, give the node a moment to read them, close."""
    me = handshake.Identity(claim, "moorline", None, os.urandom)
    reader, writer = await asyncio.open_connection(*target.cluster_addr, local_addr=(source, 0))
    stream = AsyncioStream(reader, writer)
    fr = handshake.FrameReader(stream, FrameDecoder(handshake.MAX_HANDSHAKE_FRAME_BYTES), 65536)
    try:
        async with asyncio.timeout(10):
            await handshake.dial(stream, fr, me, target.name, Stream.APPEND)
        stream.write(b"".join(encode_frame(f) for f in frames))
        await stream.drain()
        await asyncio.sleep(0.5)
    finally:
        stream.close()


def send_as(target: ClusterNode, claim: str, frames: list[Payload]) -> None:
    asyncio.run(_send_as(target, claim, frames))


def forwarded(shard: int, entries: list[bytes]) -> Payload:
    return Payload("fwd", _enc.encode((shard, entries)))


def retained_publish(topic: str, payload: bytes) -> c.Command:
    return c.Publish(StoredMessage(topic, payload, 1, True, os.urandom(16), int(time.time() * 1000)))


def stored_payloads(cluster: Cluster, shard: int) -> dict[str, list[bytes]]:
    return {nd.name: [base64.b64decode(m["payload"]) for m in nd.messages(shard)] for nd in cluster.running()}


def publish_via(node: ClusterNode, cid: str, topic: str, payload: bytes) -> int:
    pub = connect(node, cid, clean=True, expiry=0)
    try:
        return int(pub.publish_and_wait(topic, payload, 1, timeout=15).reason)
    finally:
        pub.close()


def test_a_peer_forwarding_an_entry_of_another_origin_commits_nothing_and_locks_no_one_out(
        cluster_factory: ClusterFactory) -> None:
    """Attack: a peer authenticated as n2 forwards to the leader n1 an entry naming n3 as its origin
    (boot 2, seq 1), carrying a retained message: it would commit a message n3 never sent, on every
    node, and move n3's admission past its boot (n3's writes to the shard skipped from then on)."""
    cluster = cluster_factory(3)
    topic = cluster.topic_led_by("n1", "forged")
    shard = cluster.shard_of(topic)
    entry = c.encode_entry([retained_publish(topic, b"forged by n2 as n3")], origin=3, boot=2, seq=1)
    send_as(cluster["n1"], "n2", [forwarded(shard, [entry])])

    # n3's own writes to the shard still apply
    assert publish_via(cluster["n3"], "honest-n3", topic, b"from n3") == 0
    wait_for("the honest message on every node",
             lambda: all(b"from n3" in p for p in stored_payloads(cluster, shard).values()) or None, 20)
    for name, payloads in stored_payloads(cluster, shard).items():
        assert b"forged by n2 as n3" not in payloads, f"{name} stored the forged message"
    status = cluster["n1"].get("/v1/cluster")
    n2 = next(n for n in status["nodes"] if n["id"] == "n2")
    assert n2["transport"]["frames_refused"] >= 1, n2
    assert "claims another sender than the authenticated peer" in cluster["n1"].log()


def test_a_node_cannot_lock_itself_out_with_one_absurd_boot(cluster_factory: ClusterFactory) -> None:
    """Attack: a peer holding n3's credentials forwards an entry of n3 with boot 2**62: admitted, no
    proposal of n3's real boots would ever apply to that shard again (surviving restarts)."""
    cluster = cluster_factory(3)
    topic = cluster.topic_led_by("n1", "boot")
    shard = cluster.shard_of(topic)
    entry = c.encode_entry([], origin=3, boot=2**62, seq=1)
    send_as(cluster["n1"], "n3", [forwarded(shard, [entry])])
    time.sleep(1.0)
    assert publish_via(cluster["n3"], "after-jump", topic, b"after the jump") == 0
    wait_for("n3's message stored", lambda: b"after the jump" in stored_payloads(cluster, shard)["n1"] or None, 20)


def _node_certs(tmp: Path) -> Path:
    subprocess.run([sys.executable, "-m", "moorline.cli", "certs", "dev", "--out", str(tmp), "--nodes", "n1,n2,n3"],
                   check=True, cwd=str(REPO_ROOT), capture_output=True, timeout=60)
    return tmp / "cluster"


def test_three_nodes_over_cluster_tls(cluster_factory: ClusterFactory, tmp_path: Path) -> None:
    certs = _node_certs(tmp_path / "certs")
    config = (f'[cluster.tls]\ncert_file = "{certs}/@NODE@.crt"\nkey_file = "{certs}/@NODE@.key"\n'
              f'ca_file = "{certs}/ca.crt"\n')
    cluster = cluster_factory(3, config)
    topic = cluster.topic_led_by("n2", "tls")
    assert publish_via(cluster["n1"], "tls-pub", topic, b"over tls") == 0
    shard = cluster.shard_of(topic)
    wait_for("the message on every node",
             lambda: all(b"over tls" in p for p in stored_payloads(cluster, shard).values()) or None, 20)
    # the shared-secret handshake alone (no certificate) is refused by a TLS node
    with pytest.raises((handshake.HandshakeError, OSError, TimeoutError)):
        send_as(cluster["n1"], "n2", [])


def test_secret_mode_across_machines_is_refused_at_start(tmp_path: Path) -> None:
    """A shared-secret cluster with a member off loopback would be open to a relay injecting frames
    after the handshake: the node refuses to start and says to use cluster TLS."""
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef0123456789abcdef\n")
    secret.chmod(0o600)
    proc = subprocess.run(
        [sys.executable, "-m", "moorline.cli", "run", "--node-id", "n1", "--cluster", "127.0.0.11:0",
         "--initial-cluster", "n1=127.0.0.11:7101,n2=192.0.2.2:7101,n3=192.0.2.3:7101",
         "--cluster-secret-file", str(secret), "--data-dir", str(tmp_path / "data"),
         "--mqtt", "127.0.0.1:0", "--http", "127.0.0.1:0"],
        cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "cluster TLS" in proc.stderr + proc.stdout and "Traceback" not in proc.stderr + proc.stdout
