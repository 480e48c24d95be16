"""Where an HTTP request came from, for the listener's guards (http_api.py's middlewares and the
WebSocket listener's): the host of a Host header or an Origin, and whether the request arrived on a
loopback address."""

from __future__ import annotations

import ipaddress

from aiohttp import web


def host_of(value: str) -> str:
    """The host part of a Host header or an Origin's authority (no port, no IPv6 brackets), lower case."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value[1:]
    return value.rpartition(":")[0] if value.count(":") == 1 else value


def is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def arrived_on_loopback(request: web.Request) -> bool:
    """Whether the request came in on a loopback address of this machine (where a rebound DNS name
    leads: the open default node)."""
    transport = request.transport
    local = transport.get_extra_info("sockname") if transport is not None else None
    if not local:
        return True
    try:
        ip = ipaddress.ip_address(str(local[0]).partition("%")[0])
    except ValueError:
        return True
    mapped = getattr(ip, "ipv4_mapped", None)
    return bool(ip.is_loopback or (mapped is not None and mapped.is_loopback))
