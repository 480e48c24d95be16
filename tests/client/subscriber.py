"""A subscriber process for the client tests: moorline.client with a persistent session, explicit
acks. Writes ``subscribed`` once its subscription is acknowledged, then ``got PAYLOAD dup=0|1`` per
message, and acks only the first ``--ack`` messages it gets (then keeps the rest unacknowledged
until it is killed, or exits after ``--exit-after`` messages)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from moorline.client import Client


def out(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def main(a: argparse.Namespace) -> None:
    async with Client(a.servers.split(","), client_id=a.client_id, session_expiry=600, clean_start=a.clean,
                      keepalive=5) as c:
        sub = await c.subscribe(a.filter, qos=1).start()
        out(f"subscribed session_present={int(c.session_present)}")
        n = 0
        async for msg in sub:
            n += 1
            out(f"got {msg.payload.decode()} dup={int(msg.dup)}")
            if n <= a.ack:
                await msg.ack()
                out(f"acked {msg.payload.decode()}")
            if a.exit_after and n >= a.exit_after:
                return


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--servers", required=True)
    p.add_argument("--client-id", required=True)
    p.add_argument("--filter", required=True)
    p.add_argument("--ack", type=int, default=1_000_000)
    p.add_argument("--exit-after", type=int, default=0)
    p.add_argument("--clean", action="store_true")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(main(p.parse_args()))
