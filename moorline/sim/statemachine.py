"""The replicated state machine the simulator runs: a queue service and a key-value register.

Deterministic from the applied entries only: time comes from the leader's stamp inside each
command (made non-decreasing here), never from a replica's clock. De-duplication of enqueues is
decided at apply from replicated state, expired by entry time. Snapshots are canonical bytes so
replicas can be compared byte for byte.

Commands (msgpack arrays):
  ["enq", client, req, ts, queue, msg_id, value]   -> ["ok"] | ["dup"]
  ["deq", client, req, ts, queue]                   -> ["msg", msg_id, value, delivery] | ["empty"]
  ["ack", client, req, ts, queue, msg_id, delivery] -> ["ok"] | ["stale"]
  ["put", client, req, ts, key, value]              -> ["ok"]
  ["cas", client, req, ts, key, expect, new]        -> ["ok"] | ["fail", current]
"""

from __future__ import annotations

from collections import deque
from typing import Any

import msgspec

from moorline.invariant import invariant

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()

Result = tuple[Any, ...]


def encode_command(cmd: list[Any]) -> bytes:
    return _enc.encode(cmd)


def decode_command(data: bytes) -> list[Any]:
    out = _dec.decode(data)
    invariant(isinstance(out, list) and out, "command is a non-empty array")
    return out  # type: ignore[no-any-return]


class SimStateMachine:
    """Queue + register state. ``dedup_at_apply=False`` is the test-only broken variant."""

    def __init__(
        self,
        dedup_window_ms: int = 60_000,
        visibility_ms: int = 1_000,
        max_dedup_ids: int = 1_000_000,
        dedup_at_apply: bool = True,
    ) -> None:
        self.dedup_window_ms = dedup_window_ms
        self.visibility_ms = visibility_ms
        self.max_dedup_ids = max_dedup_ids
        self.dedup_at_apply = dedup_at_apply
        self.time_ms = 0
        self.seq = 0
        self.queues: dict[str, deque[tuple[int, str, str]]] = {}  # queue -> (seq, msg_id, value)
        self.inflight: dict[
            str, tuple[str, int, int, str, int]
        ] = {}  # id -> (queue, deadline, seq, value, delivery)
        self.deliveries: dict[str, int] = {}
        self.dedup: dict[str, int] = {}  # msg_id -> entry time (insertion = apply order)
        self.kv: dict[str, Any] = {}
        self.redeliveries = 0
        self.dedup_hits = 0

    # -- apply ----------------------------------------------------------------------------
    def apply(self, data: bytes) -> tuple[int, int, Result]:
        """Apply one command; returns (client, req, result)."""
        cmd = decode_command(data)
        op, client, req, ts = cmd[0], cmd[1], cmd[2], cmd[3]
        if ts > self.time_ms:  # leaders' stamps may go back across a leader change
            self.time_ms = ts
        self._expire_dedup()
        if op == "enq":
            return client, req, self._enqueue(cmd[4], cmd[5], cmd[6])
        if op == "deq":
            return client, req, self._dequeue(cmd[4])
        if op == "ack":
            return client, req, self._ack(cmd[5], cmd[6])
        if op == "put":
            self.kv[cmd[4]] = cmd[5]
            return client, req, ("ok",)
        if op == "cas":
            cur = self.kv.get(cmd[4])
            if cur == cmd[5]:
                self.kv[cmd[4]] = cmd[6]
                return client, req, ("ok",)
            return client, req, ("fail", cur)
        raise ValueError(f"unknown command {op!r}")

    def _expire_dedup(self) -> None:
        horizon = self.time_ms - self.dedup_window_ms
        dedup = self.dedup
        while dedup:
            first = next(iter(dedup))
            if dedup[first] >= horizon and len(dedup) <= self.max_dedup_ids:
                break
            del dedup[first]

    def _enqueue(self, queue: str, msg_id: str, value: str) -> Result:
        if self.dedup_at_apply:
            if msg_id in self.dedup:
                self.dedup_hits += 1
                return ("dup",)
            self.dedup[msg_id] = self.time_ms
        self.seq += 1
        self.queues.setdefault(queue, deque()).append((self.seq, msg_id, value))
        return ("ok",)

    def _dequeue(self, queue: str) -> Result:
        self._requeue_expired(queue)
        q = self.queues.get(queue)
        if not q:
            return ("empty",)
        seq, msg_id, value = q.popleft()
        delivery = self.deliveries.get(msg_id, 0) + 1
        self.deliveries[msg_id] = delivery
        self.inflight[msg_id] = (queue, self.time_ms + self.visibility_ms, seq, value, delivery)
        return ("msg", msg_id, value, delivery)

    def _requeue_expired(self, queue: str) -> None:
        now = self.time_ms
        expired = [(v[2], k, v[3]) for k, v in self.inflight.items() if v[0] == queue and v[1] < now]
        if not expired:
            return
        q = self.queues.setdefault(queue, deque())
        for seq, msg_id, value in sorted(expired, reverse=True):
            del self.inflight[msg_id]
            q.appendleft((seq, msg_id, value))
            self.redeliveries += 1

    def _ack(self, msg_id: str, delivery: int) -> Result:
        cur = self.inflight.get(msg_id)
        if cur is None or cur[4] != delivery:
            return ("stale",)
        del self.inflight[msg_id]
        self.deliveries.pop(msg_id, None)
        return ("ok",)

    def read(self, key: str) -> Any:
        return self.kv.get(key)

    # -- snapshots ------------------------------------------------------------------------
    def snapshot(self) -> bytes:
        """Canonical encoding: sorted where order is not state, insertion order where it is."""
        state = [
            1,  # format version
            self.time_ms,
            self.seq,
            [[name, [list(m) for m in q]] for name, q in sorted(self.queues.items())],
            sorted([k, *v] for k, v in self.inflight.items()),
            sorted(self.deliveries.items()),
            list(self.dedup.items()),  # insertion order is apply order: the expiry order
            sorted(self.kv.items()),
        ]
        return _enc.encode(state)

    def restore(self, raw: bytes) -> None:
        if not raw:
            self.__init__(self.dedup_window_ms, self.visibility_ms, self.max_dedup_ids, self.dedup_at_apply)  # type: ignore[misc]
            return
        st = _dec.decode(raw)
        invariant(st[0] == 1, "unknown snapshot format")
        self.time_ms, self.seq = st[1], st[2]
        self.queues = {name: deque((m[0], m[1], m[2]) for m in q) for name, q in st[3]}
        self.inflight = {r[0]: (r[1], r[2], r[3], r[4], r[5]) for r in st[4]}
        self.deliveries = {k: v for k, v in st[5]}
        self.dedup = {k: v for k, v in st[6]}
        self.kv = {k: v for k, v in st[7]}
