"""The cluster simulator's world: virtual time across processes, TCP semantics of the in-memory
network, and real nodes booting, crashing and rejoining in it (moorline/sim/cluster)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from moorline.sim.cluster.runner import compare_replicas
from moorline.sim.cluster.vloop import Scheduler
from moorline.sim.cluster.vnet import LinkDelay, SimNetwork
from moorline.sim.cluster.world import World


def test_loops_share_virtual_time_and_a_seed_fixes_their_interleaving() -> None:
    def run(seed: int) -> list[tuple[float, str]]:
        s = Scheduler(random.Random(seed))
        seen: list[tuple[float, str]] = []

        async def tick(name: str, period: float) -> None:
            for _ in range(5):
                await asyncio.sleep(period)
                seen.append((round(s.now, 6), name))

        for name in "abc":
            s.new_loop(name).create_task(tick(name, 0.5))  # every loop due at the same instants
        s.run_until(10.0)
        return seen

    first = run(1)
    assert [t for t, _ in first] == sorted(t for t, _ in first) and first[-1][0] == 2.5
    assert run(1) == first  # replayable
    orders = {tuple(n for _, n in run(seed)) for seed in range(20)}
    assert len(orders) > 1  # same-instant work of different processes interleaves by seed


def stream_pair(seed: int = 0, jitter: float = 0.01) -> tuple[Scheduler, SimNetwork, list[bytes], object]:
    s = Scheduler(random.Random(seed))
    net = SimNetwork(s, random.Random(seed), LinkDelay(0.001, jitter))
    a, b = s.new_loop("a"), s.new_loop("b")
    received: list[bytes] = []
    server_side: list[object] = []

    async def serve() -> None:
        await net.for_host("h2", b).listen("h2", 1, lambda st: server_side.append(st))

    s.run_task(b, serve(), 1.0)
    client = s.run_task(a, net.for_host("h1", a).connect("h2", 1, None), 5.0)
    s.run_until(s.now + 0.1)

    async def reader() -> None:
        st = server_side[0]
        while True:
            try:
                chunk = await st.read(1 << 16)  # type: ignore[attr-defined]
            except OSError:
                received.append(b"<reset>")
                return
            if not chunk:
                received.append(b"<eof>")
                return
            received.append(chunk)

    b.create_task(reader())
    return s, net, received, client


def test_bytes_arrive_in_order_whatever_each_write_is_delayed() -> None:
    s, _net, received, client = stream_pair(jitter=0.05)
    for i in range(200):
        client.write(b"%d," % i)  # type: ignore[attr-defined]
    s.run_until(s.now + 5)
    assert b"".join(received).decode() == "".join(f"{i}," for i in range(200))


def test_a_cut_link_holds_bytes_and_a_heal_delivers_them_in_order() -> None:
    s, net, received, client = stream_pair()
    client.write(b"before,")  # type: ignore[attr-defined]
    s.run_until(s.now + 1)
    net.cut("h1", "h2", both=False)
    client.write(b"during1,")  # type: ignore[attr-defined]
    client.write(b"during2,")  # type: ignore[attr-defined]
    s.run_until(s.now + 5)
    assert b"".join(received) == b"before,"  # a cut TCP link hangs: nothing lost, nothing delivered
    net.heal()
    client.write(b"after")  # type: ignore[attr-defined]
    s.run_until(s.now + 1)
    assert b"".join(received) == b"before,during1,during2,after"


def test_reset_and_crash_break_the_stream() -> None:
    s, net, received, client = stream_pair()
    client.write(b"x")  # type: ignore[attr-defined]
    s.run_until(s.now + 1)
    net.crash_host("h1")
    s.run_until(s.now + 1)
    assert received == [b"x", b"<reset>"]

    s2, _net2, received2, client2 = stream_pair()
    client2.close()  # type: ignore[attr-defined]
    s2.run_until(s2.now + 1)
    assert received2 == [b"<eof>"]


def test_a_protocol_listener_half_closes_as_tcp_does() -> None:
    # A draining node shuts its side for writing (Connection.close_after_goodbye): the client reads
    # what was written, then EOF, and the node still reads until the client closes (seed 74186).
    s = Scheduler(random.Random(0))
    net = SimNetwork(s, random.Random(0), LinkDelay(0.001, 0.01))
    a, b = s.new_loop("a"), s.new_loop("b")
    events: list[str] = []

    class Server(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            assert isinstance(transport, asyncio.Transport) and transport.can_write_eof()
            transport.write(b"bye")
            transport.write_eof()
            transport.write(b"ignored after the FIN")

        def data_received(self, data: bytes) -> None:
            events.append(f"server read {data.decode()}")

        def eof_received(self) -> bool | None:
            events.append("server eof")
            return None

        def connection_lost(self, exc: Exception | None) -> None:
            events.append(f"server lost {exc}")

    net.for_host("h2", b).serve_protocol("h2", 1, Server)
    client = s.run_task(a, net.for_host("h1", a).connect("h2", 1, None), 5.0)

    async def talk() -> None:
        got = b""
        while chunk := await client.read(1 << 16):
            got += chunk
        events.append(f"client read {got.decode()} then eof")
        client.write(b"late")
        client.close()

    a.create_task(talk())
    s.run_until(s.now + 2)
    assert events == ["client read bye then eof", "server read late", "server eof", "server lost None"]


@pytest.mark.timeout(120)
def test_real_nodes_form_a_cluster_survive_a_crash_and_converge(tmp_path: Path) -> None:
    world = World(7, tmp_path)
    try:
        world.start_all()
        assert world.wait_ready(60), world.events
        victim = world.nodes[1]
        world.run_for(2)
        world.crash(victim)
        world.run_for(3)
        survivors = [sn.node for sn in world.nodes if sn is not victim]
        # The survivors keep (or elect) a leader for every group.
        assert all(h.raft.lead is not None and h.raft.lead[0] != victim.index
                   for n in survivors if n is not None for h in n.groups)
        world.start(victim)
        assert world.wait_ready(60), world.events
        world.run_for(5)
        assert compare_replicas(world) == []
        assert victim.boots == 2 and not any(sn.errors for sn in world.nodes)
    finally:
        world.close()
