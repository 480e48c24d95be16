"""The drain state machine and its pure parts (moorline/node/edge/drain.py): phases, the Server
Reference lookup, readiness, the CONNACK a draining node answers with, and closing clients only
once what they sent is answered (fake connections). The real thing, with processes, is
tests/cluster_e2e/test_cluster_drain.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from moorline.mqtt.codec import MQTT_5, decode_one, encode
from moorline.mqtt.packets import Disconnect
from moorline.mqtt.reasons import ReasonCode as RC
from moorline.node.edge import drain as d
from moorline.raft.progress import ProgressState


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


# --- phases -------------------------------------------------------------------------------------


def test_phases_go_forward_only_and_a_second_request_changes_nothing() -> None:
    clock = Clock()
    began: list[str] = []
    drain = d.Drain(20.0, clock)
    drain.on_begin.append(lambda: began.append(drain.reason))
    assert not drain.draining and drain.status() == {"phase": "serving"}
    with pytest.raises(ValueError):
        drain.advance(d.Phase.CLOSING_CLIENTS)  # not draining yet
    assert drain.request("SIGTERM")
    assert drain.draining and drain.phase == d.Phase.DRAINING and began == ["SIGTERM"]
    assert not drain.request("POST /v1/drain")  # idempotent: the first reason stays, on_begin ran once
    assert drain.reason == "SIGTERM" and began == ["SIGTERM"]
    drain.advance(d.Phase.CLOSING_CLIENTS)
    drain.advance(d.Phase.CLOSING_CLIENTS)  # staying is fine
    with pytest.raises(ValueError):
        drain.advance(d.Phase.DRAINING)
    drain.advance(d.Phase.STOPPING)
    assert drain.status()["phase"] == "stopping"


def test_deadlines_keep_a_reserve_for_the_stop() -> None:
    clock = Clock()
    drain = d.Drain(20.0, clock)
    drain.request("SIGTERM")
    assert drain.deadline == 120.0
    assert drain.work_deadline == 115.0  # a quarter, at most 5 s
    clock.t += 10
    assert drain.remaining() == pytest.approx(5.0)
    assert drain.remaining(drain.deadline) == pytest.approx(10.0)
    clock.t += 100
    assert drain.remaining() == 0.0
    short = d.Drain(2.0, clock)
    short.request("x")
    assert short.work_deadline == pytest.approx(clock.t + 1.5)


# --- a fake cluster node --------------------------------------------------------------------------


class FakeRaft:
    def __init__(self, me: tuple[int, int], lead: tuple[int, int] | None, voters: list[tuple[int, int]],
                 committed: int = 100) -> None:
        self.id = me
        self.lead = lead
        self.active_conf_state = SimpleNamespace(voters=voters, members=lambda: list(voters))
        self.log = SimpleNamespace(committed=committed)
        self.progress: dict[tuple[int, int], Any] = {}
        self.active: set[tuple[int, int]] = set(voters)
        if lead == me:
            for m in voters:
                self.progress[m] = SimpleNamespace(match=committed, state=ProgressState.REPLICATE)

    @property
    def is_leader(self) -> bool:
        return self.lead == self.id

    def is_active(self, m: tuple[int, int]) -> bool:
        return m in self.active


N1, N2, N3 = (1, 11), (2, 22), (3, 33)
NAMES = {1: "n1", 2: "n2", 3: "n3"}


def fake_node(leaders: list[tuple[int, int] | None], now: float = 100.0) -> Any:
    """n1's view of a 3-node cluster; group i led by ``leaders[i]`` (the last one is the metadata group)."""
    groups = [SimpleNamespace(shard=i, failed=None, raft=FakeRaft(N1, lead, [N1, N2, N3]))
              for i, lead in enumerate(leaders)]
    announced = {name: (now, {"client": f"127.0.0.1:{1880 + i}", "draining": False,
                              "leads": [g.shard for g in groups if g.raft.lead == m], "lagging": []})
                 for i, (name, m) in enumerate((("n2", N2), ("n3", N3)), start=2)}
    link = SimpleNamespace(spec=SimpleNamespace(names=["n1", "n2", "n3"], known=["n1", "n2", "n3"], me="n1",
                                                ids={"n1": 1, "n2": 2, "n3": 3}),
                           transport=SimpleNamespace(peer_names=lambda: {"n2", "n3"}), announced=announced)
    return SimpleNamespace(
        link=link, groups=groups, hosts=groups[:-1], meta_group=len(groups) - 1,
        placement=[SimpleNamespace(voters=("n1", "n2", "n3"))] * (len(groups) - 1),
        node_name=lambda node_id: NAMES[node_id], cfg=SimpleNamespace(cluster=SimpleNamespace(ready_max_lag_entries=10)),
    )


def test_server_reference_names_a_fresh_live_peer_spread_by_client_id() -> None:
    node = fake_node([N1, N2, N3])
    refs = {d.client_address_of_live_peer(node, f"c{i}", 100.0) for i in range(50)}
    assert refs == {"127.0.0.1:1882", "127.0.0.1:1883"}
    assert d.client_address_of_live_peer(node, "c1", 100.0) == d.client_address_of_live_peer(node, "c1", 100.0)
    node.link.announced["n3"][1]["draining"] = True
    assert {d.client_address_of_live_peer(node, f"c{i}", 100.0) for i in range(20)} == {"127.0.0.1:1882"}
    # n2 not heard from lately: nobody left
    assert d.client_address_of_live_peer(node, "c1", 100.0 + d.ANNOUNCEMENT_FRESH_S + 0.1) is None
    assert d.client_address_of_live_peer(SimpleNamespace(link=None), "c1", 0.0) is None


def test_cluster_ready_when_every_peer_is_fresh_and_every_group_whole() -> None:
    node = fake_node([N1, N2, N3, N2])
    assert d.cluster_readiness(node, None, 100.0) == []
    drain = d.Drain(20.0, Clock())
    drain.request("SIGTERM")
    assert d.cluster_readiness(node, drain, 100.0) == ["this node is draining (SIGTERM)"]
    assert d.node_readiness(node, drain) == ["this node is draining (SIGTERM)"]


def test_cluster_not_ready_says_why() -> None:
    node = fake_node([N1, N2, N3, N2])
    lead = node.groups[0].raft  # n1 leads shard 0
    lead.progress[N3].match = 80  # 20 behind, over 10
    assert d.cluster_readiness(node, None, 100.0) == ["shard 0: n3 20 entries behind"]
    lead.progress[N3].match = 95
    lead.progress[N2].state = ProgressState.SNAPSHOT
    assert d.cluster_readiness(node, None, 100.0) == ["shard 0: n2 being sent a snapshot"]
    lead.progress[N2].state = ProgressState.REPLICATE
    lead.active.discard(N2)
    assert d.cluster_readiness(node, None, 100.0) == ["shard 0: n2 not heard from"]
    lead.active.add(N2)
    lead.active_conf_state.voters = [N1, N2]  # below the placement's three
    lead.active_conf_state.members = lambda: [N1, N2]
    assert d.cluster_readiness(node, None, 100.0) == ["shard 0: 2 of 3 voters"]

    node = fake_node([N1, N2, N3, N2])
    node.link.announced["n2"][1]["lagging"] = [1]  # n2 leads shard 1 and reports a replica behind
    node.link.announced["n3"][1]["draining"] = True
    assert d.cluster_readiness(node, None, 100.0) == [
        "n3 is draining", "shard 1: a replica is not caught up (as its leader n2 reports)"]

    node = fake_node([N1, N2, None, N2])
    node.link.announced["n2"][1]["leads"] = [3]  # n1 thinks n2 leads shard 1; n2 no longer says so
    assert d.cluster_readiness(node, None, 100.0) == ["shard 1: leadership moving (to n2)", "shard 2: no leader"]

    node = fake_node([N1, N2, N3, N2])
    reasons = d.cluster_readiness(node, None, 100.0 + d.ANNOUNCEMENT_FRESH_S + 1)  # peers silent: down
    assert reasons[:2] == ["n2 not heard from within 2.5 s", "n3 not heard from within 2.5 s"]
    assert "the metadata group: its leader n2 not heard from" in reasons


def test_announcement_lists_the_groups_led_and_those_not_whole() -> None:
    node = fake_node([N1, N2, N1, N1])
    node.groups[2].raft.progress[N2].match = 0
    body = d.announcement(node, d.Drain(20.0, Clock()), "127.0.0.1:1881")
    assert body == {"client": "127.0.0.1:1881", "draining": False, "leads": [0, 2, 3], "lagging": [2]}


def test_a_draining_node_answers_connect_with_0x9c_and_a_reference() -> None:
    v5 = d.refusal_connack(MQTT_5, "127.0.0.1:1882", in_cluster=True)
    assert v5.reason_code == RC.USE_ANOTHER_SERVER and v5.properties.server_reference == "127.0.0.1:1882"
    assert encode(d.refusal_connack(4, None, in_cluster=True), 4) == b"\x20\x02\x00\x03"  # 3.1.1: unavailable
    assert d.refusal_connack(MQTT_5, None, in_cluster=False).reason_code == RC.SERVER_UNAVAILABLE


# --- closing clients ------------------------------------------------------------------------------


class FakeConn:
    def __init__(self, cid: str, version: int, busy_for: int, events: list[str]) -> None:
        self.client_id = cid
        self.peer = f"127.0.0.1:{cid}"
        self.version = version
        self.live: object | None = object()
        self._closing = False
        self.busy_for = busy_for  # polls with an unanswered publish
        self.events = events
        self.written: list[bytes] = []
        self.reading = True
        self.peer_closed = False

    def stop_reading_for_drain(self) -> None:
        self.reading = False

    def has_unanswered_work(self) -> bool:
        self.busy_for -= 1
        return self.busy_for >= 0

    def close_session_for_drain(self) -> asyncio.Future[None]:
        self.events.append(f"release {self.client_id}")
        self.live = None
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.01, fut.set_result, None)
        return fut

    @property
    def closing(self) -> bool:
        return self._closing

    def send_disconnect(self, packet: Disconnect) -> None:
        self.written.append(encode(packet, MQTT_5))

    @property
    def transport(self) -> Any:
        return SimpleNamespace(is_closing=lambda: self.peer_closed)

    def close_after_goodbye(self, why: str) -> None:
        self.events.append(f"close {self.client_id}")
        self._closing = True
        self.peer_closed = True  # the client closes on our FIN

    def close_transport(self) -> None:
        self.peer_closed = True


def test_clients_are_closed_once_answered_after_their_session_is_released() -> None:
    async def run() -> tuple[list[str], list[FakeConn], d.Drain]:
        events: list[str] = []
        conns = [FakeConn("a", MQTT_5, 3, events), FakeConn("b", 4, 0, events)]
        drain = d.Drain(20.0, asyncio.get_running_loop().time)
        drain.request("test")
        await d.close_clients(conns, drain, lambda cid: "127.0.0.1:1882", in_cluster=True)  # type: ignore[arg-type]
        return events, conns, drain

    events, (a, b), drain = asyncio.run(run())
    assert not a.reading and not b.reading
    # b had nothing unanswered: released and closed first; a only after its three busy polls
    assert events == ["release b", "close b", "release a", "close a"]
    assert b.written == []  # 3.1.1: closed, no DISCONNECT
    [pkt] = a.written
    dis = decode_one(pkt, MQTT_5, role="client")
    assert isinstance(dis, Disconnect) and dis.reason_code == RC.USE_ANOTHER_SERVER
    assert dis.properties.server_reference == "127.0.0.1:1882"
    assert (drain.clients_closed, drain.clients_cut) == (2, 0)


def test_at_the_deadline_the_unanswered_are_closed_and_counted() -> None:
    async def run() -> tuple[d.Drain, FakeConn]:
        clock = Clock()
        conn = FakeConn("stuck", MQTT_5, 10**9, [])
        drain = d.Drain(4.0, clock)
        drain.request("test")
        clock.t += 3.5  # past the work deadline (4 - 1)
        await d.close_clients([conn], drain, lambda cid: None, in_cluster=True)  # type: ignore[list-item]
        return drain, conn

    drain, conn = asyncio.run(run())
    assert conn._closing and (drain.clients_closed, drain.clients_cut) == (0, 1)


def test_a_hand_over_stops_trying_once_no_peer_can_take_over() -> None:
    """A whole cluster stopping at once: every peer drains, nobody can take a leadership; the
    hand-over gives up at once instead of trying until its bound."""
    async def run(draining: bool) -> tuple[bool, float]:
        node = fake_node([N1, N2, N3, N2], now=0.0)
        loop = asyncio.get_running_loop()
        node.clock = SimpleNamespace(monotonic=loop.time)
        for name in ("n2", "n3"):
            node.link.announced[name] = (loop.time(), {"draining": draining})
        handed: list[float] = []

        async def hand_over_leadership(timeout_s: float) -> None:
            await asyncio.sleep(0.3 if not draining else timeout_s)  # transfers that never finish
            handed.append(timeout_s)

        node.hand_over_leadership = hand_over_leadership
        t0 = loop.time()
        done = await d.hand_over(node, 30.0)
        return done, loop.time() - t0

    done, took = asyncio.run(run(draining=True))
    assert not done and took < 1.0
    done, took = asyncio.run(run(draining=False))
    assert done and 0.3 <= took < 1.0


def test_leadership_neither_returns_to_nor_is_handed_to_a_draining_node() -> None:
    """Peers read a node's drain from its announcement: the rebalance does not move a leadership
    back to it (its preferred node), and a hand-over picks a peer that is not draining."""
    from moorline.node.replication.leadership import Leadership

    class Link:
        def __init__(self) -> None:
            self.draining: set[str] = set()

        def peer_draining(self, name: str) -> bool:
            return name in self.draining

    class Raft(FakeRaft):
        def __init__(self) -> None:
            super().__init__(N1, N1, [N1, N2, N3])
            self.lead_transferee: tuple[int, int] | None = None
            self.progress[N3].match = 99  # n2 the most caught up, by a little

        def transfer_leader(self, to: tuple[int, int]) -> None:
            self.lead_transferee = to

    link = Link()
    host = SimpleNamespace(shard=0, failed=None, raft=Raft())
    kicked: list[int] = []
    node = SimpleNamespace(groups=[host], preferred_leader=[N2], member=N1, link=link,
                           node_name=lambda node_id: NAMES[node_id], commit=SimpleNamespace(kick=kicked.append),
                           faults=SimpleNamespace(no_clock_bound=True))  # (clock offsets: not this test's)
    lead = Leadership(node)  # type: ignore[arg-type]
    link.draining.add("n2")
    lead._rebalance_leaders()
    assert host.raft.lead_transferee is None  # n2 is its preferred leader, but drains
    link.draining.clear()
    lead._rebalance_leaders()
    assert host.raft.lead_transferee == N2

    host.raft = Raft()
    link.draining.add("n2")

    async def hand() -> None:
        task = asyncio.ensure_future(lead.hand_over_leadership(0.2))
        await asyncio.sleep(0.01)
        assert host.raft.lead_transferee == N3  # not n2, the most caught up: it drains too
        host.raft.lead = N3
        await task

    asyncio.run(hand())
