"""Linearizability of a key-value register (Wing & Gong search with Porcupine's memoization).

A history is partitioned per key; each key is checked alone. An operation that completed has
an invoke and a return time; an indeterminate one (the client timed out) has no return and
may take effect at any point after its invoke, or never. The search linearizes operations from
a linked list of call/return events, memoizing (set of linearized ops, register value) so a
failing branch is never explored twice. The search is bounded (``max_steps``); running out
gives "unknown", never a pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class RegOp:
    key: str
    kind: str  # "read" | "write" | "cas"
    arg: Any  # write: value; cas: (expect, new); read: None
    out: Any  # read: value; write: None; cas: True, or ("fail", current value); None when indeterminate
    invoke_ms: int
    return_ms: int | None  # None: indeterminate (may or may not have happened)
    client: int = 0


FAILED_CAS = "__failed_cas__"  # a cas that failed without telling the current value


def _step(state: Any, op: RegOp) -> tuple[bool, Any]:
    if op.kind == "read":
        return state == op.out, state
    if op.kind == "write":
        return True, op.arg
    expect, new = op.arg
    if op.return_ms is None:  # outcome unknown: either branch is acceptable
        return True, (new if state == expect else state)
    if op.out is True:
        return state == expect, new
    if isinstance(op.out, tuple):  # failed, and the register held op.out[1]
        return state != expect and state == op.out[1], state
    return state != expect, state


def _observed_values(ops: list[RegOp]) -> set[Any]:
    seen: set[Any] = set()
    for o in ops:
        if o.return_ms is None:
            continue
        if o.kind == "read":
            seen.add(o.out)
        elif o.kind == "cas":
            if o.out is True:
                seen.add(o.arg[0])
            elif isinstance(o.out, tuple):
                seen.add(o.out[1])
    return seen


def _prune_unobserved(ops: list[RegOp]) -> list[RegOp]:
    """Drop indeterminate writes/cas whose value no completed op ever observed. Sound because
    every observation names the value it saw (reads, the expected value of a successful cas,
    the current value reported by a failed cas): if such a write took effect, nothing ever
    looked at the register while it held that value, so a linearization without it exists
    (an indeterminate cas linearized in that window can be left out as well). Values written
    are unique per operation, which the simulator's clients guarantee."""
    seen = _observed_values(ops)
    out = []
    for o in ops:
        if o.return_ms is None and o.kind in ("write", "cas"):
            value = o.arg if o.kind == "write" else o.arg[1]
            if value not in seen:
                continue
        out.append(o)
    return out


class _Node:
    __slots__ = ("op", "is_call", "match", "prev", "next", "id")

    def __init__(self, op: RegOp | None, is_call: bool, ident: int) -> None:
        self.op = op
        self.is_call = is_call
        self.id = ident
        self.match: _Node | None = None
        self.prev: _Node | None = None
        self.next: _Node | None = None


def _lift(call: _Node) -> None:
    assert call.prev is not None
    call.prev.next = call.next
    if call.next is not None:
        call.next.prev = call.prev
    ret = call.match
    if ret is not None:
        assert ret.prev is not None
        ret.prev.next = ret.next
        if ret.next is not None:
            ret.next.prev = ret.prev


def _unlift(call: _Node) -> None:
    ret = call.match
    if ret is not None:
        assert ret.prev is not None
        ret.prev.next = ret
        if ret.next is not None:
            ret.next.prev = ret
    assert call.prev is not None
    call.prev.next = call
    if call.next is not None:
        call.next.prev = call


def check_register(
    ops: list[RegOp], initial: Any = None, max_steps: int = 2_000_000, prune: bool = True
) -> str:
    """'ok', 'violation' or 'unknown' (search budget exhausted) for one key's history."""
    ops = [o for o in ops if not (o.kind == "read" and o.return_ms is None)]  # lost reads say nothing
    if prune:
        ops = _prune_unobserved(ops)
    if not ops:
        return "ok"
    events: list[tuple[int, int, int]] = []  # (time, 0 call / 1 return, op number)
    for i, o in enumerate(ops):
        events.append((o.invoke_ms, 0, i))
        if o.return_ms is not None:
            events.append((o.return_ms, 1, i))
    events.sort()  # at equal times calls come first: such ops count as concurrent
    head = _Node(None, False, -1)
    calls: dict[int, _Node] = {}
    tail = head
    for _t, kind, i in events:
        node = _Node(ops[i], kind == 0, i)
        if kind == 0:
            calls[i] = node
        else:
            calls[i].match = node
        node.prev = tail
        tail.next = node
        tail = node
    remaining = sum(1 for o in ops if o.return_ms is not None)
    state = initial
    linearized = 0
    cache: set[tuple[int, Any]] = set()
    stack: list[tuple[_Node, Any]] = []
    entry = head.next
    steps = 0
    while remaining > 0:
        steps += 1
        if steps > max_steps:
            return "unknown"
        if entry is not None and entry.is_call:
            op = entry.op
            assert op is not None
            ok, new_state = _step(state, op)
            if ok:
                bit = linearized | (1 << entry.id)
                key = (bit, new_state)
                if key not in cache:
                    cache.add(key)
                    stack.append((entry, state))
                    state = new_state
                    linearized = bit
                    if entry.match is not None:
                        remaining -= 1
                    _lift(entry)
                    entry = head.next
                    continue
            entry = entry.next
        else:
            # a return reached (its op must already be linearized) or the end: backtrack
            if not stack:
                return "violation"
            entry, state = stack.pop()
            linearized &= ~(1 << entry.id)
            if entry.match is not None:
                remaining += 1
            _unlift(entry)
            entry = entry.next
    return "ok"


def check_registers(ops: list[RegOp], max_steps: int = 2_000_000) -> dict[str, str]:
    """Check each key separately; returns the verdict per key."""
    by_key: dict[str, list[RegOp]] = {}
    for o in ops:
        by_key.setdefault(o.key, []).append(o)
    return {k: check_register(v, max_steps=max_steps) for k, v in sorted(by_key.items())}
