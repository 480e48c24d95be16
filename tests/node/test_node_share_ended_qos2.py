"""A QoS 2 message claimed by a member whose session ended without returning its claims is
dropped (counted), never handed back to the group, whatever QoS the group's registration records
(``ShareDispatch.return_ended``; MQTT-4.8.2-5).

Found by ``moorline sim --cluster`` seed 50085 (default mix with joins): sh2 (subscribed to
``$share/g1/s/#`` at QoS 2) was sent offset 54 of shard 3 at QoS 2 and had not PUBREC'd it when its
clean-start CONNECT ended incarnation 1; ``end_session`` was refused on shard 1
(raft.max_pending_proposals) before it reached shard 3, so the shard's leader returned the claim
from replicated state 12 s later. It dropped only claims of groups whose ``Registration.qos`` was 2,
but that is the QoS of the group's last Register (sh1's, at QoS 1), not of the member's
subscription: the claim went back undropped, sh2's next incarnation claimed it and received the
message again at QoS 2 (duplicate). On d74f269 the claim here goes back to the group."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from moorline.broker import commands as c
from moorline.broker.messages import StoredMessage
from moorline.config import NodeConfig
from moorline.node.node import Node

pytestmark = pytest.mark.timeout(60)

WAIT_S = 5.0  # housekeeping rounds run every 0.05 s; two are needed


def _config(tmp_path: Path) -> NodeConfig:
    cfg = NodeConfig()
    cfg.data_dir = str(tmp_path / "data")
    cfg.shard.count = 2
    cfg.shard.housekeeping_interval_s = 0.05
    cfg.sys.interval_s = 0
    return cfg


async def _run(node: Node, shard: int, cmd: c.Command) -> Any:
    fut = node.propose(shard, cmd)
    assert fut is not None
    return await asyncio.wait_for(fut, 10)


async def _open(node: Node, client_id: str) -> Any:
    return await _run(node, node.session_shard(client_id), c.SessionOpen(node.now_ms(), client_id, True, 3600, None))


async def _until(cond: Any, timeout: float = WAIT_S) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if cond():
            return True
        await asyncio.sleep(0.02)
    return bool(cond())


def test_qos2_claim_of_an_ended_incarnation_is_dropped_when_the_group_registered_qos1_last(tmp_path: Path) -> None:
    async def main() -> None:
        node = Node(_config(tmp_path))
        node.open()
        await node.start()
        try:
            a = await _open(node, "a")
            b = await _open(node, "b")
            topic = "q/g"
            shard = node.topic_shard(topic)
            rk = f"{c.SHARE_PREFIX}g\0{topic}"
            # a subscribes at QoS 2, then b at QoS 1: the group's registration records QoS 1.
            await _run(node, shard, c.Register(node.now_ms(), rk, "", -1, topic, 2, share_group="g"))
            await _run(node, shard, c.ShareMember(rk, "a", True, a.incarnation))
            await _run(node, shard, c.Register(node.now_ms(), rk, "", -1, topic, 1, share_group="g"))
            await _run(node, shard, c.ShareMember(rk, "b", True, b.incarnation))
            reg = node.hosts[shard].state.topics.regs[rk]
            assert reg.qos == 1
            await node.publish(StoredMessage(topic, b"x", 2, False, b"q/g/0".ljust(16, b"."), node.now_ms()))
            (offset,) = list(reg.owed)
            # Claimed for a (which receives at its own QoS, 2; sent, not PUBREC'd).
            assert await _run(node, shard, c.ShareClaim(rk, "a", (offset,), a.incarnation, 0)) == (offset,)
            # a's session is replaced by a clean start; nothing of end_session runs.
            a2 = await _open(node, "a")
            assert a2.incarnation > a.incarnation
            gone = await _until(lambda: (not reg.claims and "a" not in reg.members) or node.share.ended_returned > 0)
            assert gone, f"claims {reg.claims}, members {reg.members} (incarnation {a.incarnation} ended)"
            await _until(lambda: not reg.claims)
            assert offset not in reg.owed, "a QoS 2 message a member may have received went back to the group"
            assert not reg.claims
            assert node.hosts[shard].state.topics.drop_counts.get("share_qos2_member_gone") == 1
        finally:
            await node.stop()

    asyncio.run(main())
