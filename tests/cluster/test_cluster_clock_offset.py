"""Issue 29 item 6 (the measurement): peers' wall-clock offsets measured over the cluster link
(replication/clock_offset.py), NTP-style, and the verdict a node serves by: a majority of the
cluster, itself included, within cluster.max_clock_offset_ms of its clock."""

from __future__ import annotations

from moorline.node.replication.clock_offset import STALE_AFTER_S, ClockOffsets


class World:
    """Three nodes' clocks (wall offsets from true time) and a link of fixed one-way delay."""

    def __init__(self, offsets_ms: dict[str, int], delay_s: float = 0.002) -> None:
        self.t = 1000.0  # true time, s
        self.offsets = offsets_ms
        self.delay = delay_s
        self.queue: list[tuple[float, str, str, bytes]] = []
        names = tuple(sorted(offsets_ms))
        self.nodes = {n: ClockOffsets(n, names, self._sender(n), self._wall(n), lambda: self.t, 500)
                      for n in names}

    def _sender(self, src: str):  # type: ignore[no-untyped-def]
        def send(peer: str, data: bytes) -> None:
            self.queue.append((self.t + self.delay, src, peer, data))
        return send

    def _wall(self, name: str):  # type: ignore[no-untyped-def]
        return lambda: int(self.t * 1000) + self.offsets[name]

    def run(self, seconds: float) -> None:
        end = self.t + seconds
        next_probe = self.t
        while self.t < end:
            if self.t >= next_probe:
                for n in self.nodes.values():
                    n.probe_all()
                next_probe += 1.0
            due = [q for q in self.queue if q[0] <= self.t]
            self.queue = [q for q in self.queue if q[0] > self.t]
            for _at, src, dst, data in due:
                self.nodes[dst].on_payload(src, data)
            self.t += 0.001


def test_offsets_are_measured_within_the_round_trip() -> None:
    w = World({"n1": 0, "n2": 300, "n3": -200})
    w.run(3)
    s = w.nodes["n1"].estimate("n2")
    assert s is not None and abs(s.offset_ms - 300) <= s.error_ms + 1 and s.error_ms <= 3
    s = w.nodes["n2"].estimate("n3")
    assert s is not None and abs(s.offset_ms + 500) <= s.error_ms + 1
    assert all(w.nodes[n].out_of_bound() is None for n in w.nodes)  # n2-n3 is 500 ms: not beyond


def test_the_node_whose_clock_is_off_refuses_and_the_others_serve() -> None:
    w = World({"n1": 0, "n2": 100, "n3": 2_000})
    w.run(3)
    assert w.nodes["n1"].beyond("n3") and w.nodes["n3"].beyond("n1")
    assert w.nodes["n1"].out_of_bound() is None and w.nodes["n2"].out_of_bound() is None
    reason = w.nodes["n3"].out_of_bound()
    assert reason is not None and "n1 is -2000 ms off" in reason, reason
    stats = w.nodes["n1"].stats()
    assert stats["peers"]["n3"]["beyond_bound"] is True  # type: ignore[index]


def test_a_peer_not_heard_from_counts_only_after_the_start() -> None:
    w = World({"n1": 0, "n2": 0, "n3": 0})
    n1 = w.nodes["n1"]
    assert n1.out_of_bound() is None  # nothing measured yet: the first seconds give the benefit of the doubt
    w.run(STALE_AFTER_S + 2)
    assert n1.out_of_bound() is None  # measured: within
    n1.samples["n2"].clear()  # past the start, nothing recent from n2 and n3 (down, or cut off)
    n1.samples["n3"].clear()
    reason = n1.out_of_bound()
    assert reason is not None and "no recent clock reading from n2" in reason
