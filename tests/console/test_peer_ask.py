"""The cluster-wide admin requests (node/admin/peer_ask.py over ``ClusterLink.ask``), in process:
three real cluster links on loopback (cluster secret); n2 answers, n3 is connected but drops the
requests. The fan-out answers with n2's rows and names n3 within the per-peer timeout; an answer
from another peer than the one asked is refused; a peer not heard from is not asked at all."""

from __future__ import annotations

import asyncio
import random
import socket
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from moorline.cluster import Payload
from moorline.config import ClusterConfig
from moorline.node.admin.peer_ask import ask_peers, live_peers
from moorline.node.replication.cluster_link import ADMIN_ANSWER_PAYLOAD, ClusterLink, _fwd_enc
from moorline.node.replication.cluster_spec import ClusterSpec
from moorline.raft import Stream

HOST = "127.0.0.1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


async def _until(what: str, check: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def test_fan_out_names_a_silent_peer_within_the_timeout(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 32)
    secret.chmod(0o600)
    cfg = ClusterConfig(cluster_id="peer-ask", secret_file=str(secret))
    names = ("n1", "n2", "n3")

    async def go() -> None:
        addr = {n: (HOST, _free_port()) for n in names}
        links = {n: ClusterLink(ClusterSpec(n, names, dict(addr), addr[n], {}), cfg, f"sid-{n}", None,
                                random.Random(n), "layout") for n in names}
        asked: list[tuple[str, str, dict[str, Any]]] = []

        def n2_answers(peer: str, op: str, args: dict[str, Any]) -> dict[str, Any]:
            asked.append((peer, op, args))
            return {"total": 1, "items": [{"client_id": "c-on-n2", "node": "n2"}]}

        links["n2"].on_admin_request = n2_answers
        links["n3"]._on_admin_ask = lambda peer, body: None  # type: ignore[method-assign]  # n3 never answers
        for link in links.values():
            await link.start()
        try:
            n1 = links["n1"]
            await _until("n1 hears n2 and n3", lambda: {"n2", "n3"} <= set(n1.announced))
            node = SimpleNamespace(link=n1, membership=SimpleNamespace(table=None))
            live, down = live_peers(node, time.monotonic())
            assert live == ["n2", "n3"] and down == {}

            started = time.monotonic()
            got = await ask_peers(n1, live, "clients", {"q": "", "limit": 10}, 0.5)
            took = time.monotonic() - started
            assert got["n2"].answer == {"total": 1, "items": [{"client_id": "c-on-n2", "node": "n2"}]}
            assert got["n3"].answer is None and "no answer within 0.5 s" in got["n3"].error, got
            assert 0.5 <= took < 1.5, took  # bounded by the per-peer timeout, asked at once
            assert asked == [("n1", "clients", {"q": "", "limit": 10})]
            assert n1._asked == {}  # nothing left waiting
            print(f"fan-out to 2 peers, one silent: {took * 1000:.0f} ms; n2 answered in "
                  f"{got['n2'].took_s * 1000:.1f} ms")

            # A handler's refusal and failure come back as errors, not timeouts.
            links["n2"].on_admin_request = lambda peer, op, args: {"error": "no such op"}
            got = await ask_peers(n1, ["n2"], "nope", {}, 2.0)
            assert got["n2"].answer is None and got["n2"].error == "refused: no such op"

            # n2 answers a request asked of n3 (which stays silent): refused as forged, not taken.
            waiting = asyncio.ensure_future(n1.ask("n3", "clients", {"q": "", "limit": 1}, 1.0))
            await _until("the request to n3 made", lambda: bool(n1._asked))
            rid = max(n1._asked)
            links["n2"].transport.send("n1", Stream.CONTROL, Payload(ADMIN_ANSWER_PAYLOAD, _fwd_enc.encode(
                {"id": rid, "answer": {"total": 99, "items": []}})))
            await _until("n2's forged answer refused", lambda: n1.frames_refused.get("n2", 0) >= 1, 3.0)
            with pytest.raises(TimeoutError):
                await waiting

            # A peer not heard from lately is reported, not asked.
            await links["n3"].close()
            n1.announced["n3"] = (time.monotonic() - 60, n1.announced["n3"][1])
            live, down = live_peers(node, time.monotonic())
            assert live == ["n2"] and list(down) == ["n3"] and "not heard from" in down["n3"]
        finally:
            for link in links.values():
                await link.close()

    asyncio.run(go())
