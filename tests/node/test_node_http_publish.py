"""POST /v1/publish answers per item and never calls "refused" what may have entered a log
(docs/design.md promise 6): items are validated before anything is proposed, a proposal whose outcome
fails or does not come within mqtt.publish_timeout_s is "unknown", and only what was never proposed
(or what the shard refused at apply) is "refused". Runs the HTTP app against a stand-in node."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from moorline.broker import commands as c
from moorline.broker.topic_state import PublishResult
from moorline.config import AuthConfig, NodeConfig
from moorline.hashing import shard_of
from moorline.node.admin.http_api import make_app
from moorline.node.clock import SystemClock
from moorline.node.edge.auth import Authorizer
from moorline.node.replication.shard_host import ShardUnavailable

pytestmark = pytest.mark.timeout(60)


class StandInNode:
    """What the publish route uses of a Node. ``outcome(topic)`` says what a proposal gets: a
    PublishResult, an exception to fail its future with, "hang", or "unavailable" (propose raises)."""

    shard_count = 4

    def __init__(self, outcome: dict[str, Any]) -> None:
        self.cfg = NodeConfig()
        self.cfg.mqtt.publish_timeout_s = 0.3
        self.outcome = outcome
        self.proposed: list[str] = []
        self.pending: list[asyncio.Future[Any]] = []
        self.published = {"mqtt": 0, "http": 0, "spark": 0}  # counters the route keeps, by source
        self.publish_denied = {"mqtt": 0, "http": 0, "spark": 0}
        # What the console's sampler reads (started with the app): counters, the data directory.
        self.stats: dict[str, int] = {}
        self.clock = SystemClock()
        self.data_dir = Path(__file__).parent / "no-such-data-dir"

    def now_ms(self) -> int:
        return 1_000

    def topic_shard(self, topic: str) -> int:
        return shard_of(topic, self.shard_count)

    def propose(self, shard: int, cmd: c.Command, want: bool = True) -> asyncio.Future[Any]:
        assert isinstance(cmd, c.Publish)
        what = self.outcome[cmd.msg.topic]
        if what == "unavailable":
            raise ShardUnavailable(f"shard {shard} unavailable: test")
        self.proposed.append(cmd.msg.topic)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.pending.append(fut)
        if isinstance(what, PublishResult):
            fut.set_result(what)
        elif isinstance(what, BaseException):
            asyncio.get_running_loop().call_soon(fut.set_exception, what)
        return fut


def item(topic: str, payload: bytes = b"x") -> dict[str, Any]:
    return {"topic": topic, "payload": base64.b64encode(payload).decode()}


async def post(node: StandInNode, body: Any) -> tuple[int, Any]:
    app = make_app(node, Authorizer(AuthConfig(), loopback_only=True), auth_required=False)  # type: ignore[arg-type]
    async with TestClient(TestServer(app)) as client:
        resp = await client.post("/v1/publish", json=body)
        return resp.status, await resp.json()


def test_outcomes_per_item(caplog: pytest.LogCaptureFixture) -> None:
    node = StandInNode({
        "a/ok": PublishResult("ok", 7),
        "a/failed": RuntimeError("entry lost with its leader"),
        "a/hang": "hang",
        "a/down": "unavailable",
        "a/refused": PublishResult("refused", -1, 0x97, "shard full"),
    })
    topics = ["a/ok", "a/failed", "a/hang", "a/down", "a/refused", "$x/dollar"]
    status, body = asyncio.run(post(node, {"messages": [item(t) for t in topics]}))
    assert status == 200, body
    got = [(r["status"], r.get("reason")) for r in body["results"]]
    down = f"shard {node.topic_shard('a/down')} unavailable: test"
    assert got == [("ok", None), ("unknown", None), ("unknown", None), ("refused", down),
                   ("refused", "shard full"), ("refused", "not authorized")]
    assert "entry lost" in body["results"][1]["error"] and "publish_timeout_s" in body["results"][2]["error"]
    assert node.proposed == ["a/ok", "a/failed", "a/hang", "a/refused"]  # never the $-topic, nor the down shard
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


def test_a_malformed_item_fails_the_request_before_anything_is_proposed() -> None:
    node = StandInNode({"a/1": PublishResult("ok", 1)})
    for bad in ({"topic": "a/+"}, {"topic": 5}, {"topic": "a/2", "payload": "%%%"}, {"topic": "a/2", "qos": 3},
                {"topic": "a/2", "guid": "abc"}, "not an object"):
        status, body = asyncio.run(post(node, {"messages": [item("a/1"), bad]}))
        assert status == 400 and body["item"] == 1, (bad, body)
    assert node.proposed == []


def test_an_item_larger_than_max_packet_size_is_refused_alone() -> None:
    node = StandInNode({"a/small": PublishResult("ok", 1), "a/big": PublishResult("ok", 2)})
    node.cfg.mqtt.max_packet_size = 1000
    status, body = asyncio.run(post(node, {"messages": [item("a/big", b"x" * 1000), item("a/small")]}))
    assert status == 200
    assert [r["status"] for r in body["results"]] == ["refused", "ok"]
    assert "max_packet_size" in body["results"][0]["reason"] and node.proposed == ["a/small"]
