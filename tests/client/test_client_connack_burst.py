"""moorline.client: messages a broker sends right behind CONNACK (a resumed session's resends of
unacknowledged deliveries, which a moorline node writes in the same loop pass as the CONNACK) can
be acknowledged. Before the fix they were created under the previous connection's generation
(``Client._gen`` was bumped only when ``_connect`` resumed after the CONNACK), so ``msg.ack()``
silently sent nothing: the broker's in-flight window filled and delivery stopped for good
(test_publishes_survive_two_kills_of_the_connected_node, flake of 2026-11-28 04:28)."""

from __future__ import annotations

import asyncio

from moorline.client import Client
from moorline.mqtt import packets as P
from moorline.mqtt.codec import Decoder, encode


def test_messages_sent_with_the_connack_can_be_acknowledged() -> None:
    n = 5
    pubacks: list[int] = []

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        dec = Decoder(role="server")
        while data := await r.read(65536):
            for pk in dec.feed(data):
                if isinstance(pk, P.Connect):
                    burst = encode(P.Connack(True, 0), 5)  # session present, then its resends
                    for i in range(n):
                        burst += encode(P.Publish("t/x", str(i).encode(), 1, False, True, 100 + i), 5)
                    w.write(burst)  # one write: the client reads them together with the CONNACK
                elif isinstance(pk, P.Subscribe):
                    w.write(encode(P.Suback(pk.packet_id, (1,)), 5))
                elif isinstance(pk, P.Puback):
                    pubacks.append(pk.packet_id)
            await w.drain()

    async def main() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            async with Client([f"127.0.0.1:{port}"], client_id="c", session_expiry=600, clean_start=False) as c:
                sub = await c.subscribe("t/#", qos=1).start()
                got = []
                async for msg in sub:
                    assert msg.dup
                    got.append(msg.payload)
                    await msg.ack()
                    if len(got) == n:
                        break
                for _ in range(100):  # the PUBACKs are on their way (loopback): 1 s at most
                    if len(pubacks) == n:
                        break
                    await asyncio.sleep(0.01)
        finally:
            server.close()
        assert got == [str(i).encode() for i in range(n)]
        assert pubacks == [100 + i for i in range(n)], "acks of messages that came with the CONNACK were not sent"

    asyncio.run(asyncio.wait_for(main(), 20))
