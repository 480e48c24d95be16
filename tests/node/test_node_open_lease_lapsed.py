"""A CONNECT whose session open committed but whose own owner lease ran out before it could be
served is refused (server unavailable) and its session handed back; it is never served.

Found by the cluster simulator, default-mix seeds 30456 and 30575 (session_lost): a clean-start
CONNECT to a node whose SessionOpen committed just before the node was paused for 11 s (7 s in
30575); its lease (5 s) ran out unrenewed, and the session shard's leader ended the session as a
connection lost at the lease's end, then expired it (expiry 2 s). On resuming, the node sent the
CONNACK anyway (only a takeover that had waited for the previous owner checked its own lease
before serving), for a session that no longer existed; its SUBSCRIBE failed, the node closed the
connection, and the client's reconnect 0.8 s later (clean start 0) found no session.

On f451631 the open below is served (the CONNACK would be sent) 0.6 s into a 1.5 s lease that is
checked 1 s before its end."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from moorline.broker import commands as c
from moorline.config import NodeConfig
from moorline.node.errors import ShardUnavailable
from moorline.node.node import Node

pytestmark = pytest.mark.timeout(60)

LEASE_S = 1.5  # session.owner_lease_s: served only until 1 s before 1.47 s (the drift margin) after the open
STALL_S = 0.6  # the node stalls (paused) this long between the open's commit and serving it


async def _scenario(tmp_path: Path, stall_s: float) -> tuple[BaseException | None, Any]:
    cfg = NodeConfig()
    cfg.data_dir = str(tmp_path / "data")
    cfg.shard.count = 2
    cfg.sys.interval_s = 0
    cfg.session.owner_lease_s = LEASE_S
    node = Node(cfg)
    node.open()
    await node.start()
    try:
        shard = node.session_shard("c")
        bounded = node.bounded

        async def stalled(fut: asyncio.Future[Any], s: int) -> Any:
            res = await bounded(fut, s)
            await asyncio.sleep(stall_s)  # committed; then the node is paused before it serves
            return res

        node.bounded = stalled  # type: ignore[method-assign]
        refused: BaseException | None = None
        try:
            await node.open_session("c", False, 60, None, "")
        except ShardUnavailable as exc:
            refused = exc
        node.bounded = bounded  # type: ignore[method-assign]
        # The abandoned session's close is committed once a later proposal of its shard is.
        fut = node.propose(shard, c.SessionHousekeeping(node.now_ms()))
        assert fut is not None
        await asyncio.wait_for(fut, 10)
        return refused, node.hosts[shard].state.sessions.sessions.get("c")
    finally:
        await node.stop()


def test_an_open_whose_lease_ran_out_before_serving_is_refused_and_handed_back(tmp_path: Path) -> None:
    refused, sess = asyncio.run(_scenario(tmp_path, STALL_S))
    assert isinstance(refused, ShardUnavailable), "served a session on a lease that had run out"
    assert "lease" in str(refused)
    assert sess is not None and not sess.connected, f"the session was not handed back: {sess!r}"


def test_an_open_served_within_its_lease_is_served(tmp_path: Path) -> None:
    refused, sess = asyncio.run(_scenario(tmp_path, 0.0))
    assert refused is None, f"refused although its lease was good: {refused!r}"
    assert sess is not None and sess.connected
