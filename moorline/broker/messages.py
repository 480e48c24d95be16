"""The message as stored in a shard's message store and carried in commands."""

from __future__ import annotations

import msgspec


class MessageProps(msgspec.Struct, array_like=True, frozen=True):
    """MQTT 5 properties that travel with a message (forwarded to subscribers unaltered)."""

    payload_format: int | None = None
    content_type: str | None = None
    response_topic: str | None = None
    correlation_data: bytes | None = None
    user_properties: tuple[tuple[str, str], ...] = ()


class StoredMessage(msgspec.Struct, array_like=True, frozen=True):
    topic: str
    payload: bytes
    qos: int
    retain: bool
    guid: bytes  # 16 bytes
    ts_ms: int  # stamped by the proposing leader's host, never read from a clock at apply
    expiry_s: int | None = None  # MQTT 5 message expiry interval, from ts_ms
    props: MessageProps | None = None
    origin: str = ""  # publishing client id (for no-local)

    def expires_at_ms(self) -> int | None:
        return None if self.expiry_s is None else self.ts_ms + self.expiry_s * 1000

    def size(self) -> int:
        return len(self.payload) + len(self.topic) + 64


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(StoredMessage)


def encode_message(msg: StoredMessage) -> bytes:
    return _enc.encode(msg)


def decode_message(data: bytes) -> StoredMessage:
    return _dec.decode(data)
