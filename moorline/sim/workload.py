"""Simulated clients: queue producers/consumers and register clients, recording histories.

Clients talk to nodes over the simulated network (client links are delayed, never dropped by
faults, but a crashed node answers nothing). A request that gets no answer within the timeout
is indeterminate. Enqueues are retried with the same message id (de-duplicated at apply);
writes and compare-and-sets are not retried after a timeout (they are not idempotent).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moorline.sim.checkers.linearizable import RegOp
from moorline.sim.checkers.total_queue import Delivery, EnqueueOp
from moorline.sim.loop import EventLoop, Timer
from moorline.sim.marks import Marks
from moorline.sim.network import SimNetwork


@dataclass(slots=True)
class WorkloadParams:
    queue_clients: int = 6
    kv_clients: int = 6
    queues: int = 2
    keys: int = 3
    timeout_ms: int = 800
    max_attempts: int = 6  # per logical op; keep attempts * timeout well under the dedup window
    think_ms_max: int = 20
    forget_ack_p: float = 0.1  # a consumer "crashes" before acking
    enqueue_weight: float = 0.55
    read_weight: float = 0.4
    cas_weight: float = 0.3


@dataclass(slots=True)
class History:
    enqueues: list[EnqueueOp] = field(default_factory=list)
    deliveries: list[Delivery] = field(default_factory=list)
    acked: set[tuple[str, int]] = field(default_factory=set)
    reg_ops: list[RegOp] = field(default_factory=list)
    ops_done: int = 0
    ops_ok: int = 0


class Budget:
    """Shared count of logical operations still to start."""

    def __init__(self, ops: int) -> None:
        self.remaining = ops
        self.started = 0

    def take(self) -> bool:
        if self.remaining <= 0:
            return False
        self.remaining -= 1
        self.started += 1
        return True


@dataclass(slots=True)
class _Op:
    kind: str
    args: tuple[Any, ...]
    invoke_ms: int
    attempts: int = 0
    maybe: bool = False  # some attempt may have entered the log
    record: Any = None
    counted: bool = True  # part of the op budget (drain and ack follow-ups are not)


class Client:
    """One sequential client (a new op starts after the previous one ends)."""

    def __init__(
        self,
        cid: int,
        role: str,
        loop: EventLoop,
        net: SimNetwork,
        rng: random.Random,
        nodes: list[int],
        params: WorkloadParams,
        history: History,
        budget: Budget,
        marks: Marks,
        on_idle: Callable[[], None],
    ) -> None:
        self.cid = cid
        self.role = role  # "queue" | "kv"
        self.loop = loop
        self.net = net
        self.rng = rng
        self.nodes = nodes
        self.p = params
        self.h = history
        self.budget = budget
        self.marks = marks
        self.on_idle = on_idle
        self.target = rng.choice(nodes)
        self.req = 0
        self.n = 0
        self.op: _Op | None = None
        self.timer: Timer | None = None
        self.idle = False
        self.draining = False
        self.drain_empty_since: int | None = None
        self.drain_done = False
        self.last_value: dict[str, Any] = {}
        self.pending_ack: tuple[str, str, int] | None = None
        net.attach(cid, self._on_reply)

    # -- scheduling ------------------------------------------------------------------------
    def start(self) -> None:
        self.loop.call_later(self.rng.randint(0, self.p.think_ms_max), self._next)

    def start_drain(self) -> None:
        self.draining = True
        if self.idle:
            self.idle = False
            self.loop.call_later(0, self._next)

    def _next(self) -> None:
        if self.pending_ack is not None:
            queue, msg_id, delivery = self.pending_ack
            self.pending_ack = None
            self._begin("ack", (queue, msg_id, delivery), counted=False)
            return
        if self.draining:
            if self.role != "queue" or self.drain_done:
                self._go_idle()
                return
            self._begin("deq", (f"q{self.n % self.p.queues}",), counted=False)
            self.n += 1
            return
        if not self.budget.take():
            self._go_idle()
            return
        rng = self.rng
        self.n += 1
        if self.role == "queue":
            q = f"q{rng.randrange(self.p.queues)}"
            if rng.random() < self.p.enqueue_weight:
                msg_id = f"m{self.cid}-{self.n}"
                rec = EnqueueOp(msg_id, q, f"v{self.cid}-{self.n}", self.loop.now_ms)
                self.h.enqueues.append(rec)
                self._begin("enq", (q, msg_id, rec.value), record=rec)
            else:
                self._begin("deq", (q,))
        else:
            key = f"k{rng.randrange(self.p.keys)}"
            x = rng.random()
            if x < self.p.read_weight:
                self._begin("read", (key,))
            elif x < self.p.read_weight + self.p.cas_weight:
                self._begin("cas", (key, self.last_value.get(key), f"{self.cid}-{self.n}"))
            else:
                self._begin("put", (key, f"{self.cid}-{self.n}"))

    def _go_idle(self) -> None:
        self.idle = True
        self.on_idle()

    def _begin(self, kind: str, args: tuple[Any, ...], record: Any = None, counted: bool = True) -> None:
        self.op = _Op(kind, args, self.loop.now_ms, record=record, counted=counted)
        self._attempt()

    def _attempt(self) -> None:
        op = self.op
        assert op is not None
        op.attempts += 1
        if op.attempts > 1:
            self.marks.hit("client_retry")
        self.req += 1
        if op.kind == "read":
            payload: tuple[Any, ...] = ("read", self.req, op.args[0])
        else:
            payload = ("cmd", self.req, op.kind, *op.args)
        self.net.send(self.cid, self.target, payload, reliable=True)
        self.timer = self.loop.call_later(self.p.timeout_ms, self._on_timeout, self.req)

    # -- outcomes --------------------------------------------------------------------------
    def _on_timeout(self, req: int) -> None:
        op = self.op
        if op is None or req != self.req:
            return
        self.target = self.rng.choice(self.nodes)
        if op.kind == "enq":
            op.maybe = True
            if op.attempts < self.p.max_attempts:
                self._attempt()
                return
        elif op.kind in ("put", "cas"):
            self._record_reg(op, None, None)
        # deq / ack / read timing out: indeterminate, nothing to record
        self._end(False)

    def _on_reply(self, src: int, payload: Any) -> None:
        _tag, req, result = payload
        op = self.op
        if op is None or req != self.req:
            return  # a late answer to an attempt we gave up on
        assert self.timer is not None
        self.timer.cancel()
        status = result[0]
        if status in ("not_leader", "dropped"):
            hint = result[1] if status == "not_leader" else 0
            self.target = hint if hint in self.nodes else self.rng.choice(self.nodes)
            if op.attempts < self.p.max_attempts:
                backoff = min(400, 20 << op.attempts)
                self.loop.call_later(self.rng.randint(backoff // 2, backoff), self._retry_if, req)
                return
            if op.kind == "enq" and not op.maybe:
                op.record.refused = True
            elif op.kind == "enq":
                pass  # indeterminate: an earlier attempt may have entered the log
            elif op.kind in ("put", "cas") and op.maybe:
                self._record_reg(op, None, None)
            self._end(False)
            return
        now = self.loop.now_ms
        if op.kind == "enq":
            op.record.ok_ms = now
        elif op.kind == "deq":
            if status == "msg":
                _s, msg_id, value, delivery = result
                self.h.deliveries.append(Delivery(msg_id, op.args[0], value, delivery, op.invoke_ms, now))
                if self.draining or self.rng.random() >= self.p.forget_ack_p:
                    self.pending_ack = (op.args[0], msg_id, delivery)
                if self.draining:
                    self.drain_empty_since = None
            elif self.draining:
                self._drain_empty()
        elif op.kind == "ack":
            if status == "ok":
                self.h.acked.add((op.args[1], op.args[2]))
        elif op.kind == "read":
            self._record_reg(op, now, result[1])
        elif op.kind == "put":
            self._record_reg(op, now, None)
        elif op.kind == "cas":
            self._record_reg(op, now, True if status == "ok" else ("fail", result[1]))
        self._end(True)

    def _retry_if(self, req: int) -> None:
        if self.op is not None and req == self.req:
            self._attempt()

    def _record_reg(self, op: _Op, ret_ms: int | None, out: Any) -> None:
        key = op.args[0]
        if op.kind == "read":
            self.h.reg_ops.append(RegOp(key, "read", None, out, op.invoke_ms, ret_ms, self.cid))
            self.last_value[key] = out
        elif op.kind == "put":
            self.h.reg_ops.append(RegOp(key, "write", op.args[1], None, op.invoke_ms, ret_ms, self.cid))
            if ret_ms is not None:
                self.last_value[key] = op.args[1]
        else:
            self.h.reg_ops.append(
                RegOp(key, "cas", (op.args[1], op.args[2]), out, op.invoke_ms, ret_ms, self.cid)
            )
            if ret_ms is not None and out is True:
                self.last_value[key] = op.args[2]
            elif isinstance(out, tuple):
                self.last_value[key] = out[1]

    def _drain_empty(self) -> None:
        """Every queue must answer empty for longer than the visibility timeout (so unacked
        in-flight messages had their chance to come back) before the drain ends."""
        now = self.loop.now_ms
        if self.drain_empty_since is None:
            self.drain_empty_since = now
        elif now - self.drain_empty_since > self.visibility_wait_ms:
            self.drain_done = True

    visibility_wait_ms = 1_500

    def _end(self, ok: bool) -> None:
        op = self.op
        self.op = None
        assert op is not None
        self.h.ops_done += 1
        if ok and op.counted:
            self.h.ops_ok += 1
        delay = self.rng.randint(0, self.p.think_ms_max)
        if self.draining:
            delay = max(delay, 20)
        self.loop.call_later(delay, self._next)
