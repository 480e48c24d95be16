"""An asyncio MQTT 5 client that keeps every message until the broker acknowledged it.

    async with Client(["n1:1883", "n2:1883", "n3:1883"], client_id="app-1") as c:
        await c.publish("sensors/1", b"21.5")          # returns once acknowledged
        async for msg in c.subscribe("sensors/#"):
            ...
            await msg.ack()

See docs/client.md.
"""

from moorline.client.buffer import BufferLimits, RetransmitBuffer
from moorline.client.client import Batch, Client, Message, Subscription
from moorline.client.errors import (
    BatchFailed,
    BufferFull,
    ClientClosed,
    MessageExpired,
    MqttClientError,
    PublishRefused,
    PublishTimeout,
    SpoolError,
    SubscribeFailed,
)

__all__ = [
    "Client", "Message", "Subscription", "Batch", "BufferLimits", "RetransmitBuffer", "MqttClientError",
    "ClientClosed", "PublishTimeout", "PublishRefused", "MessageExpired", "BufferFull", "SubscribeFailed",
    "SpoolError", "BatchFailed",
]
