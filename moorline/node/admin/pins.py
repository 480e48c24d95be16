"""Readers' retention pins through the shard logs (``POST /v1/pins``, ``DELETE /v1/pins/{reader}``).

A pin (the Spark source sets one per query: the offsets its batch reads from) is replicated state
of each topic shard it names (``broker.commands.Pin``): the node that receives the request
proposes it to those shards, whichever nodes lead them, and every replica applies it, so the
leader of a shard, wherever it runs and after any leader change, holds retention for it until its
TTL runs out on the leader's entry times. Owner (the caller's principal) and limits are checked
twice: here, across every shard as this node's replicas know them (pins.max_pins readers,
pins.max_pins_per_principal of one principal), and where the pin applies, per shard (a hard bound
no replica lagging behind can get round). A renewal naming fewer shards takes the pin off the others (those this node's
replicas know of; a replica behind lets one run out by its TTL instead)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from moorline.broker import commands as c

if TYPE_CHECKING:
    from moorline.config import NodeConfig
    from moorline.node.node import Node

REFUSALS = {
    "held": (403, "pin {reader!r} is held by another principal"),
    "too_many": (429, "too many pins (pins.max_pins = {max_pins} per shard)"),
    "too_many_for_owner": (429, "too many pins for this principal (pins.max_pins_per_principal = {max_per_owner} "
                                "per shard)"),
}


async def _outcomes(futs: dict[int, asyncio.Future[Any] | None], timeout_s: float) -> dict[int, Any]:
    """Each shard's result, or the exception that stands for it (no outcome in time: TimeoutError)."""
    waiting = [f for f in futs.values() if f is not None]
    if waiting:
        await asyncio.wait(waiting, timeout=timeout_s)
    out: dict[int, Any] = {}
    for shard, fut in futs.items():
        if fut is None or not fut.done():
            if fut is not None:
                fut.add_done_callback(_consume)
            out[shard] = TimeoutError(f"no outcome within mqtt.publish_timeout_s ({timeout_s:g} s)")
        elif fut.cancelled():
            out[shard] = asyncio.CancelledError()
        else:
            exc = fut.exception()
            out[shard] = exc if exc is not None else fut.result()
    return out


def _consume(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


def pin_owners(node: Node, now_ms: int) -> dict[str, str]:
    """Reader -> owner of every pin this node's replicas hold that has not run out by ``now_ms``."""
    out: dict[str, str] = {}
    for host in node.hosts:
        for reader, (_offset, until_ms, owner) in host.state.pins.items():
            if until_ms >= now_ms:
                out[reader] = owner
    return out


async def set_pin(node: Node, cfg: NodeConfig, owner: str, reader: str, offsets: dict[int, int],
                  ttl_ms: int) -> tuple[int, dict[str, Any]]:
    """Propose the pin to every shard in ``offsets``; (HTTP status, body). A new pin refused by
    one shard is taken off the shards that took it."""
    pins = cfg.pins
    now = node.now_ms()
    known = pin_owners(node, now)
    holder = known.get(reader)
    if holder is not None and holder != owner:
        return 403, {"error": REFUSALS["held"][1].format(reader=reader)}
    if holder is None:
        if len(known) >= pins.max_pins:
            return 429, {"error": f"too many pins (pins.max_pins = {pins.max_pins})"}
        if sum(1 for w in known.values() if w == owner) >= pins.max_pins_per_principal:
            return 429, {"error": f"too many pins for this principal (pins.max_pins_per_principal = "
                                  f"{pins.max_pins_per_principal})"}
    futs: dict[int, asyncio.Future[Any] | None] = {}
    for shard, offset in sorted(offsets.items()):
        futs[shard] = node.propose(shard, c.Pin(reader, owner, offset, ttl_ms, pins.max_pins,
                                                pins.max_pins_per_principal, now))
    for shard in range(node.shard_count):
        if shard not in offsets and reader in node.hosts[shard].state.pins:
            node.propose(shard, c.Unpin(reader, owner), want=False)
    results = await _outcomes(futs, cfg.mqtt.publish_timeout_s)
    refused = sorted((s, r) for s, r in results.items() if isinstance(r, str) and r != "ok")
    failed = sorted((s, r) for s, r in results.items() if isinstance(r, BaseException))
    if refused or failed:
        took = [s for s, r in results.items() if r == "ok"]
        for shard in took:  # all or nothing, as far as it goes: never a pin on some shards only
            node.propose(shard, c.Unpin(reader, owner), want=False)
    if refused:
        status, text = REFUSALS.get(refused[0][1], (409, "pin refused: {result}"))
        return status, {"error": text.format(reader=reader, max_pins=pins.max_pins,
                                             max_per_owner=pins.max_pins_per_principal, result=refused[0][1]),
                        "shard": refused[0][0]}
    if failed:
        shard, exc = failed[0]
        return 503, {"error": f"shard {shard}: the pin's outcome is unknown ({exc!s}); try again", "shard": shard}
    return 200, {"reader": reader, "offsets": {str(k): v for k, v in sorted(offsets.items())}, "ttl_ms": ttl_ms}


async def remove_pin(node: Node, cfg: NodeConfig, owner: str, reader: str) -> tuple[int, dict[str, Any]]:
    """Propose the pin's removal to every shard; (HTTP status, body)."""
    futs: dict[int, asyncio.Future[Any] | None] = {
        shard: node.propose(shard, c.Unpin(reader, owner)) for shard in range(node.shard_count)}
    results = await _outcomes(futs, cfg.mqtt.publish_timeout_s)
    if any(r == "held" for r in results.values()):
        return 403, {"error": f"pin {reader!r} is held by another principal"}
    failed = sorted((s, r) for s, r in results.items() if isinstance(r, BaseException))
    if failed:
        shard, exc = failed[0]
        return 503, {"error": f"shard {shard}: the removal's outcome is unknown ({exc!s}); try again", "shard": shard}
    return 200, {"ok": True}
