"""Asking the other nodes' HTTP listeners on the caller's behalf (``GET /v1/clients`` and
``DELETE /v1/clients/{id}`` for the whole cluster; docs/console.md).

Connected clients are the one thing no replicated state lists (a connection is a socket on one
node), so the node asked fetches each live peer's own list (``?scope=node``) over HTTP. Where a
peer's HTTP listener is: its cluster-link announcement (node/edge/drain.py ``announcement``,
``"http"``), trusted while fresh (``ANNOUNCEMENT_FRESH_S``). The request carries the caller's own
``Authorization`` header, so each peer applies its own authentication and the caller's role there:
this node never acts on another with more than the caller has. Every peer is asked at once (one
request each: the cluster's size bounds them), each answer bounded by
``http.peer_request_timeout_s``; a peer that is not heard from, has no HTTP address, or does not
answer in time is reported as unreachable, never silently left out.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

import aiohttp
from yarl import URL

from moorline.node.edge.drain import ANNOUNCEMENT_FRESH_S

GONE_STATES = ("forgotten", "left")  # members that are no longer asked


@dataclass
class PeerAnswer:
    status: int  # 0: no answer (``error`` says why)
    body: Any = None
    error: str = ""


def peer_addresses(node: Any, now: float) -> tuple[dict[str, str], dict[str, str]]:
    """(name -> HTTP address of each peer heard from lately, name -> why a peer cannot be asked).
    Members the member table says are gone (forgotten, left) are neither."""
    link = node.link
    if link is None:
        return {}, {}
    gone: set[str] = set()
    table = node.membership.table
    if table is not None:
        gone = {m.name for m in table.members.values() if m.state in GONE_STATES}
    names = set(link.spec.names) | set(link.announced)
    live: dict[str, str] = {}
    unreachable: dict[str, str] = {}
    for name in sorted(names):
        if name == link.spec.me or name in gone:
            continue
        got = link.announced.get(name)
        if got is None or now - got[0] > ANNOUNCEMENT_FRESH_S:
            unreachable[name] = f"not heard from within {ANNOUNCEMENT_FRESH_S:g} s"
        elif not isinstance(got[1].get("http"), str):
            unreachable[name] = "it announces no HTTP address (an older version?)"
        else:
            live[name] = got[1]["http"]
    return live, unreachable


def peer_url(address: str, path: str, query: dict[str, str]) -> URL:
    """``path`` holds already quoted segments (``quote_segment``)."""
    qs = urlencode(query)
    return URL(f"http://{address}{path}" + (f"?{qs}" if qs else ""), encoded=True)


def quote_segment(value: str) -> str:
    return quote(value, safe="")


async def ask_peers(addresses: dict[str, str], method: str, path: str, query: dict[str, str],
                    authorization: str | None, timeout_s: float) -> dict[str, PeerAnswer]:
    """One request to every peer in ``addresses`` at once; each answer (status and JSON body) or why
    there was none, by peer name."""
    if not addresses:
        return {}
    headers = {"Accept": "application/json", "Content-Type": "application/json"}
    if authorization:
        headers["Authorization"] = authorization

    async def one(session: aiohttp.ClientSession, address: str) -> PeerAnswer:
        try:
            async with session.request(method, peer_url(address, path, query), headers=headers,
                                       allow_redirects=False) as resp:
                try:
                    body = await resp.json(content_type=None)
                except ValueError:
                    return PeerAnswer(0, error=f"answered {resp.status} without JSON")
                return PeerAnswer(resp.status, body)
        except TimeoutError:
            return PeerAnswer(0, error=f"no answer within {timeout_s:g} s (http.peer_request_timeout_s)")
        except aiohttp.ClientError as exc:
            return PeerAnswer(0, error=f"{type(exc).__name__}: {exc}"[:200])

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        names = sorted(addresses)
        answers = await asyncio.gather(*(one(session, addresses[n]) for n in names))
    return dict(zip(names, answers, strict=True))


def answer_error(ans: PeerAnswer) -> str:
    """A peer's non-answer or refusal, in words."""
    if ans.status == 0:
        return ans.error
    detail = ans.body.get("error") if isinstance(ans.body, dict) else None
    return f"answered {ans.status}" + (f": {str(detail)[:200]}" if detail else "")
