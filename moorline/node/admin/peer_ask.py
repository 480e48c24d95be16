"""Asking the other members on an admin's behalf, over the cluster link (``GET /v1/clients`` and
``DELETE /v1/clients/{id}`` for the whole cluster; docs/console.md, docs/http-api.md).

Connected clients are the one thing no replicated state lists (a connection is a socket on one
node), so the node asked puts the same question to every live peer at once as an admin request on
the cluster link (``ClusterLink.ask``: a request/response on the control stream). That link is
already authenticated (cluster TLS certificates, else the cluster secret) and is the one path
members are required to have to each other; the caller's own credentials never leave the node
that authenticated them: that node checks the caller's role (and, for a non-admin, narrows the
question to the caller's own user name) before asking, and a peer answers only what it was asked.

"Live": a peer heard from (its announcement) within ``ANNOUNCEMENT_FRESH_S`` and not forgotten or
left in the member table. Each answer is bounded by ``http.peer_request_timeout_s``; a peer not
live, or not answering in time, is reported by name, never silently left out.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from moorline.node.edge.drain import ANNOUNCEMENT_FRESH_S

GONE_STATES = ("forgotten", "left")  # members that are no longer asked


@dataclass
class PeerAnswer:
    answer: dict[str, Any] | None  # None: no answer (``error`` says why)
    error: str = ""
    took_s: float = field(default=0.0, compare=False)


def live_peers(node: Any, now: float) -> tuple[list[str], dict[str, str]]:
    """(the peers heard from lately, name -> why a peer cannot be asked). Members the member table
    says are gone (forgotten, left) are neither."""
    link = node.link
    if link is None:
        return [], {}
    gone: set[str] = set()
    table = node.membership.table
    if table is not None:
        gone = {m.name for m in table.members.values() if m.state in GONE_STATES}
    names = set(link.spec.names) | set(link.announced)
    live: list[str] = []
    unreachable: dict[str, str] = {}
    for name in sorted(names):
        if name == link.spec.me or name in gone:
            continue
        got = link.announced.get(name)
        if got is None or now - got[0] > ANNOUNCEMENT_FRESH_S:
            unreachable[name] = f"not heard from within {ANNOUNCEMENT_FRESH_S:g} s"
        else:
            live.append(name)
    return live, unreachable


async def ask_peers(link: Any, peers: list[str], op: str, args: dict[str, Any],
                    timeout_s: float) -> dict[str, PeerAnswer]:
    """The same admin request to every peer in ``peers`` at once; each one's answer, or why there
    was none, by name. Returns within ``timeout_s`` (and a little)."""
    loop = asyncio.get_running_loop()

    async def one(peer: str) -> PeerAnswer:
        started = loop.time()
        try:
            got = await link.ask(peer, op, args, timeout_s)
        except TimeoutError:
            return PeerAnswer(None, f"no answer within {timeout_s:g} s (http.peer_request_timeout_s)",
                              loop.time() - started)
        except KeyError:
            return PeerAnswer(None, "not a member this node's cluster link knows")
        if isinstance(got.get("error"), str):
            return PeerAnswer(None, f"refused: {got['error'][:200]}", loop.time() - started)
        return PeerAnswer(got, took_s=loop.time() - started)

    names = sorted(peers)
    answers = await asyncio.gather(*(one(n) for n in names))
    return dict(zip(names, answers, strict=True))
