"""The simulator builds its nodes with the production composition root (moorline/node/assembly.py):
what runs in a simulated node is what ``moorline run`` runs — the loop-lag watcher on virtual time,
$SYS, the admin HTTP API (served on the virtual network), the cluster link's announce and drain
hooks — and a drain is the assembly's shutdown, as ``moorline run`` does it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moorline.sim.cluster.world import HTTP_PORT, MQTT_PORT, World


def _http_get(world: World, host: str, path: str) -> tuple[int, dict[str, object]]:
    """A GET over the virtual network, from a client host of its own."""
    loop = world.scheduler.new_loop(f"http-client-{path}")
    net = world.net.for_host("10.0.9.1", loop)

    async def get() -> bytes:
        stream = await net.connect(host, HTTP_PORT, None)
        stream.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := await stream.read(1 << 16):
            data += chunk
        return data

    raw = world.scheduler.run_task(loop, get(), world.scheduler.now + 10)
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


@pytest.mark.timeout(120)
def test_simulated_nodes_run_the_production_assembly(tmp_path: Path) -> None:
    world = World(11, tmp_path)
    try:
        world.start_all()
        assert world.wait_ready(60), world.events
        for sn in world.nodes:
            asm = sn.assembly
            assert asm is not None and sn.node is asm.node and sn.server is asm.server
            assert asm.node.client_address == f"{sn.host}:{MQTT_PORT}"
            assert all(asm.node.supervisor.running(t) for t in ("loop-lag-watcher", "sys-topics"))
        n1, n2 = world.nodes[0], world.nodes[1]
        assert n1.node is not None and n2.node is not None and n2.loop is not None and n2.assembly is not None

        # The admin HTTP API answers on the virtual network.
        status, body = _http_get(world, n1.host, "/v1/health")
        assert status == 200, body

        # The lag watcher runs on the node's virtual clock: a 2 s pause stops reading client sockets.
        server = n1.server
        assert server is not None
        paused: list[bool] = []
        world.pause(n1, 2.0)
        end = world.scheduler.now + 2.5
        while world.scheduler.now < end:
            world.run_for(0.01)
            paused.append(server.reading_paused)
        assert True in paused and not paused[-1], "reads paused after the lag, resumed after"

        # The peers hear of a drain at once (the link's announce hook), and the shutdown stops the node.
        world.run_for(1.0)
        assert not n1.node.link.announced["n2"][1].get("draining")  # type: ignore[union-attr]
        assert n1.node.link.announced["n2"][1].get("client") == f"{n2.host}:{MQTT_PORT}"  # type: ignore[union-attr]
        stopping = n2.loop.create_task(n2.assembly.shutdown("test drain"))
        world.run_for(0.5)
        assert n1.node.link.announced["n2"][1].get("draining") is True  # type: ignore[union-attr]
        world.run_for(10.0)
        assert stopping.done() and stopping.exception() is None
        assert n2.assembly.drain.reason == "test drain" and not n2.node.supervisor.running("loop-lag-watcher")
        assert not any(sn.errors for sn in world.nodes), [sn.errors for sn in world.nodes]
    finally:
        world.close()
