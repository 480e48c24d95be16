"""The $share claims (and membership) of a member's session incarnation that has ended go back to
the group even when the end's own proposals never made it (``ShareDispatch.return_ended``, on the
shard's leader, from replicated state).

Found by ``moorline sim --cluster`` seed 30722 (single-active group ``sa``, drawn
``raft.max_pending_proposals = 8``): a clean-start CONNECT of sa3 committed its open, which ended
incarnation 4, but ``end_session``'s ShareReturn was refused (eight proposals of that node already
waited for shard 1's leader) and nothing proposed it again. Incarnation 4's unacknowledged claim
stayed in the group for good; when sa2 became the active member and claimed, the group had two
holders at once (``single_active_two_holders``), and the message was never delivered again.

Here the open that replaces the member's session is committed directly, so nothing of
``end_session`` runs, as when its proposals are refused or its node crashes right after the open.
On f451631 the ended incarnation's claims stayed for good."""

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


async def _group(node: Node, name: str, flt: str, qos: int, members: list[tuple[str, int]]) -> str:
    rk = f"{c.SHARE_PREFIX}{name}\0{flt}"
    shard = node.topic_shard(flt)
    await _run(node, shard, c.Register(node.now_ms(), rk, "", -1, flt, qos, share_group=name, single_active=True))
    for member, inc in members:
        await _run(node, shard, c.ShareMember(rk, member, True, inc))
    return rk


async def _publish(node: Node, topic: str, qos: int, n: int) -> None:
    for i in range(n):
        await node.publish(StoredMessage(topic, b"x", qos, False, f"{topic}/{i}".encode().ljust(16, b"."),
                                         node.now_ms()))


def test_claims_of_an_ended_incarnation_go_back_to_the_group(tmp_path: Path) -> None:
    async def main() -> None:
        node = Node(_config(tmp_path))
        node.open()
        await node.start()
        try:
            a = await _open(node, "a")
            b = await _open(node, "b")
            topic = "q/sa"
            shard = node.topic_shard(topic)
            rk = await _group(node, "sa", topic, 1, [("a", a.incarnation), ("b", b.incarnation)])
            reg = node.hosts[shard].state.topics.regs[rk]
            await _publish(node, topic, 1, 3)
            offsets = list(reg.owed)
            assert reg.queue is not None and reg.queue.active == "a"
            granted = await _run(node, shard, c.ShareClaim(rk, "a", tuple(offsets[:2]), a.incarnation, 0))
            assert list(granted) == offsets[:2]
            # A QoS 2 group as well: a claim that may have been sent at QoS 2 never goes to another
            # member (MQTT-4.8.2-5); with the session's delivery log gone it is dropped, counted.
            topic2 = "q/sa2"
            shard2 = node.topic_shard(topic2)
            rk2 = await _group(node, "sb", topic2, 2, [("a", a.incarnation), ("b", b.incarnation)])
            reg2 = node.hosts[shard2].state.topics.regs[rk2]
            await _publish(node, topic2, 2, 1)
            (offset2,) = list(reg2.owed)
            assert await _run(node, shard2, c.ShareClaim(rk2, "a", (offset2,), a.incarnation, 0)) == (offset2,)
            # a's session is replaced by a clean start; nothing of end_session runs.
            a2 = await _open(node, "a")
            assert a2.incarnation > a.incarnation
            returned = await _until(lambda: not reg.claims and "a" not in reg.members)
            assert returned, f"claims {reg.claims}, members {reg.members} (incarnation {a.incarnation} ended)"
            assert reg.queue.active == "b"
            assert list(reg.owed) == offsets, "returned claims are still owed to the group"
            assert reg.queue.attempts == {offsets[0]: 1, offsets[1]: 1}, reg.queue.attempts
            dropped = await _until(lambda: not reg2.claims and offset2 not in reg2.owed)
            assert dropped, f"QoS 2 group: claims {reg2.claims}, owed {list(reg2.owed)}"
            assert node.hosts[shard2].state.topics.drop_counts.get("share_qos2_member_gone") == 1
            # A member whose session is only disconnected keeps its claims (it resumes them).
            granted = await _run(node, shard, c.ShareClaim(rk, "b", tuple(offsets), b.incarnation, 0))
            assert list(granted) == offsets
            await _run(node, node.session_shard("b"), c.SessionClose(node.now_ms(), "b", b.epoch, False))
            await asyncio.sleep(0.4)
            assert sorted(reg.claims) == offsets and reg.members.get("b") == b.incarnation
            assert node.share.ended_returned == 2
        finally:
            await node.stop()

    asyncio.run(main())


# A QoS 2 message claimed by a member whose session ended without returning its claims is
# dropped (counted), never handed back to the group, whatever QoS the group's registration records
# (``ShareDispatch.return_ended``; MQTT-4.8.2-5).
#
# Found by ``moorline sim --cluster`` seed 50085 (default mix with joins): sh2 (subscribed to
# ``$share/g1/s/#`` at QoS 2) was sent offset 54 of shard 3 at QoS 2 and had not PUBREC'd it when its
# clean-start CONNECT ended incarnation 1; ``end_session`` was refused on shard 1
# (raft.max_pending_proposals) before it reached shard 3, so the shard's leader returned the claim
# from replicated state 12 s later. It dropped only claims of groups whose ``Registration.qos`` was 2,
# but that is the QoS of the group's last Register (sh1's, at QoS 1), not of the member's
# subscription: the claim went back undropped, sh2's next incarnation claimed it and received the
# message again at QoS 2 (duplicate). On d74f269 the claim here goes back to the group.
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
