"""The cluster link takes members at runtime (issue 31, the link part of join): a node that was not
in ``--initial-cluster`` is refused until the member table admits it; once the link learns its node
id and address (``ClusterLink.learn_member``, fed from the member table by the membership driver),
it authenticates like any peer (the cluster secret here), and its Raft traffic and announcements
flow both ways. The link's announce and clock loops run under the node's Supervisor: a loop that
raises is counted and restarted.

Real loopback sockets, in-process links (no broker processes): a few seconds."""

from __future__ import annotations

import asyncio
import os
import random
import socket
from pathlib import Path

import pytest

from moorline.config import ClusterConfig
from moorline.node.replication.cluster_link import CLOCK_TASK, ClusterLink
from moorline.node.replication.cluster_spec import ClusterSpec
from moorline.node.supervisor import Supervisor
from moorline.raft import Message, MessageType

HOST = "127.0.0.1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


async def _until(what: str, check: object, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not check():  # type: ignore[operator]
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.05)


def _link(me: str, initial: tuple[str, ...], addresses: dict[str, tuple[str, int]], cfg: ClusterConfig,
          ids: dict[str, int] | None = None) -> tuple[ClusterLink, list[tuple[int, Message]]]:
    spec = ClusterSpec(me, initial, dict(addresses), addresses[me], dict(ids or {}))
    link = ClusterLink(spec, cfg, f"sid-{me}", None, random.Random(me), "layout")
    got: list[tuple[int, Message]] = []
    link.on_raft = lambda shard, m: got.append((shard, m))
    return link, got


def test_a_member_learned_at_runtime_is_a_peer(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 32)
    secret.chmod(0o600)
    cfg = ClusterConfig(cluster_id="join-link", secret_file=str(secret))

    async def go() -> None:
        addr = {name: (HOST, _free_port()) for name in ("n1", "n2", "n4")}
        initial = ("n1", "n2")
        n1, got1 = _link("n1", initial, {k: addr[k] for k in initial}, cfg)
        # n4 joined: it knows the initial members; its own id (4) came from the member table.
        n4, got4 = _link("n4", initial, addr, cfg, ids={"n4": 4})
        sup = Supervisor(lambda exc: None, 0.05, 0.2)
        calls: list[int] = []
        probe = n1.clocks.probe_all

        def flaky() -> None:
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("injected into the clock loop")
            probe()

        n1.clocks.probe_all = flaky  # type: ignore[method-assign]
        await n1.start(sup)
        await n4.start()
        try:
            await asyncio.sleep(1.5)
            assert "n4" not in n1.announced, "n1 took a node that is not a member of its cluster"
            assert n1.transport.stats().peers.get("n4") is None

            assert n1.learn_member("n4", 4, addr["n4"])
            assert not n1.learn_member("n4", 4, addr["n4"])  # already known
            assert not n1.learn_member("n9", 2, (HOST, 1))  # node id 2 is n2's
            assert not n1.learn_member("n1", 7, (HOST, 1))  # this node
            await _until("n1 and n4 hear each other's announcements",
                         lambda: "n4" in n1.announced and "n1" in n4.announced)
            assert n1.spec.name_of(4) == "n4" and n1.spec.node_id("n4") == 4
            assert "n4" in n1.clocks.peers and "n4" in n1.clocks.names  # probed, answered, counted

            n4.send(3, [Message(type=MessageType.HEARTBEAT, from_=(4, "sid-n4"), to=(1, "sid-n1"), term=2)])
            n4.send(5, [Message(type=MessageType.APP, from_=(4, "sid-n4"), to=(1, "sid-n1"), term=2)])
            n1.send(5, [Message(type=MessageType.APP_RESP, from_=(1, "sid-n1"), to=(4, "sid-n4"), term=2)])
            await _until("Raft messages between n1 and the learned n4", lambda: len(got1) >= 2 and got4)
            assert sorted((s, m.type) for s, m in got1) == [(3, MessageType.HEARTBEAT), (5, MessageType.APP)]
            assert [(s, m.type) for s, m in got4] == [(5, MessageType.APP_RESP)]
            assert not n1.frames_refused and not n4.frames_refused

            # The supervised clock loop raised at its first probe: counted, restarted, probing again.
            await _until("the clock loop restarted after its failure", lambda: len(calls) >= 2, 5.0)
            assert sup.failures == {CLOCK_TASK: 1}
            assert sup.running(CLOCK_TASK) and sup.running("cluster-announce")
        finally:
            await n4.close()
            await n1.close()
        assert not sup.running(CLOCK_TASK) and not sup.running("cluster-announce")

    asyncio.run(go())


async def _probe(cfg: ClusterConfig, me: str, address: tuple[str, int]) -> object:
    """``probe_member`` as a joining node runs it: the member's name, or the error."""
    from moorline.cluster import handshake, read_secret_file
    from moorline.cluster.net import AsyncioNetwork
    from moorline.cluster.tls import load_cluster_tls
    from moorline.node.replication.cluster_join import probe_member

    t = cfg.tls
    tls = load_cluster_tls(t.cert_file, t.key_file, t.ca_file) if t.cert_file and t.key_file and t.ca_file else None
    secret = read_secret_file(cfg.secret_file) if cfg.secret_file else None
    ident = handshake.Identity(node=me, cluster_id=cfg.cluster_id, secret=secret, nonce_source=os.urandom, tls=tls)
    try:
        return await probe_member(address, ident, HOST, AsyncioNetwork(), 5.0)
    except handshake.HandshakeError as exc:
        return exc


@pytest.mark.parametrize("mode", ["secret", "tls"])
def test_a_joining_node_learns_an_admitting_members_name(tmp_path: Path, mode: str) -> None:
    """The joining node knows addresses, not names: its probe learns the member's name through a
    full handshake (the member's secret proof, or its certificate), only once that member admitted
    it; another credential is refused."""
    from moorline.certs import write_node_certificates
    from moorline.config import ClusterTlsConfig

    if mode == "tls":
        files = write_node_certificates(tmp_path / "certs", ["n1", "n4", "n5"])
        ca = str(tmp_path / "certs" / "ca.crt")

        def cfg_of(name: str) -> ClusterConfig:
            crt, key = files[name]
            return ClusterConfig(cluster_id="join-probe", tls=ClusterTlsConfig(str(crt), str(key), ca))
    else:
        secret = tmp_path / "secret"
        secret.write_bytes(b"p" * 32)
        secret.chmod(0o600)
        wrong = tmp_path / "wrong"
        wrong.write_bytes(b"q" * 32)
        wrong.chmod(0o600)

        def cfg_of(name: str) -> ClusterConfig:
            return ClusterConfig(cluster_id="join-probe", secret_file=str(wrong if name == "n5" else secret))

    async def go() -> None:
        addr = {"n1": (HOST, _free_port())}
        n1, _ = _link("n1", ("n1",), addr, cfg_of("n1"))
        await n1.start()
        try:
            refused = await _probe(cfg_of("n4"), "n4", addr["n1"])
            assert "not a peer" in str(refused), refused  # not admitted yet
            assert n1.learn_member("n4", 4, (HOST, _free_port()))
            assert n1.learn_member("n5", 5, (HOST, _free_port()))
            assert await _probe(cfg_of("n4"), "n4", addr["n1"]) == "n1"
            # n5 is admitted, but its secret is not the cluster's; with TLS, a certificate naming n5
            # does not pass for n4
            other = await _probe(cfg_of("n5"), "n5" if mode == "secret" else "n4", addr["n1"])
            assert isinstance(other, Exception), other
        finally:
            await n1.close()

    asyncio.run(go())
