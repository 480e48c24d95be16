"""A CONNECT that waits for the previous owner's lease keeps its own lease renewed meanwhile, so
the session it serves afterwards is not ended under a connected client (found by the cluster
simulator, drawn-configuration seed 20211: a takeover from another node waited 9.4 s of a 10 s
lease for the previous owner; the waiting open was not renewed (only live sessions were), and
the lease loop dropped its deadline as "a CONNECT that never became a live session". Served once
the wait ended, it was never renewed nor closed: the session shard's housekeeping ended the
session as its owner's lease had lapsed, its $share claim went to another member, while the
client stayed connected and was sent the message too: duplicate).

On 38673de the session is gone from the session shard while the node still serves the client."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from moorline.broker import commands as c
from moorline.config import NodeConfig
from moorline.mqtt.codec import Decoder, encode
from moorline.mqtt.packets import Connack, Connect, Properties
from tests.node.served_node import served_node

pytestmark = pytest.mark.timeout(60)

LEASE_S = 3.0  # this node's owner lease (session.owner_lease_s)
PREVIOUS_LEASE_MS = 3500  # another node's lease on the session: the takeover waits it out


async def _scenario(tmp_path: Path) -> tuple[bool, bool, str]:
    cfg = NodeConfig()
    cfg.data_dir = str(tmp_path / "data")
    cfg.shard.count = 2
    cfg.shard.housekeeping_interval_s = 0.05
    cfg.sys.interval_s = 0
    cfg.session.owner_lease_s = LEASE_S
    async with served_node(cfg) as (node, port):
        writer: asyncio.StreamWriter | None = None
        try:
            shard = node.session_shard("t")
            # The client's connection on another node (member 7), whose lease runs 3.5 s more: longer
            # than this node's own lease would last unrenewed (3 s less the drift margin).
            fut = node.propose(shard, c.SessionOpen(node.now_ms(), "t", True, 0, None, owner_node=7,
                                                    lease_ms=PREVIOUS_LEASE_MS))
            assert fut is not None
            await asyncio.wait_for(fut, 10)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(encode(Connect(protocol_level=5, client_id="t", clean_start=True,
                                        properties=Properties(session_expiry_interval=0)), 5))
            decoder = Decoder(role="client", version=5)
            data = await asyncio.wait_for(reader.read(65536), 15)
            packets = decoder.feed(data)
            assert packets and isinstance(packets[0], Connack), packets
            assert packets[0].reason_code == 0, packets[0]  # served once the previous owner's lease ran out
            # Past this node's unrenewed lease plus the session shard's grace (1 s): the session lives
            # on as long as the node serves it.
            await asyncio.sleep(LEASE_S)
            live = node.live.get("t")
            sess = node.hosts[shard].state.sessions.sessions.get("t")
            served = live is not None and "t" in node.connections
            alive = sess is not None and live is not None and sess.epoch == live.epoch and sess.connected
            return served, alive, f"live={live is not None} session={sess!r}"
        finally:
            if writer is not None:
                writer.close()


def test_a_takeover_that_waited_keeps_its_lease_renewed(tmp_path: Path) -> None:
    served, alive, detail = asyncio.run(_scenario(tmp_path))
    assert served, f"the node stopped serving a client whose session shard was reachable: {detail}"
    assert alive, f"the session ended under a client the node still serves: {detail}"
