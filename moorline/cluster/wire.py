"""Framing of the inter-node protocol, sans-IO (bytes in, frames out; no sockets, no clocks).

A connection starts with a 6-byte preamble, ``b"MLCL"`` and the protocol version (big-endian
u16), sent by both sides. Every frame after it is a 4-byte big-endian body length followed by a
msgpack body: one of the tagged structs below (``array_like``, so a frame carries field values,
not field names). The preamble is outside the frame format on purpose: a future version may
change the frames themselves, and both sides can still name each other's version in an error
instead of failing to decode.

Frame kinds:

* handshake (see ``moorline.cluster.auth``): ``Hello``, ``Challenge``, ``Proof``, ``Refused``;
* data, handed to the node: ``RaftMessages``, ``Heartbeats``, ``Payload``;
* liveness, consumed by the transport: ``Ping`` (dialer -> listener), ``Pong`` (listener -> dialer).
"""

from __future__ import annotations

import struct
from typing import Final

import msgspec

from moorline.raft.coalesce import GroupId, HeartbeatBatch
from moorline.raft.types import Message, Stream

PROTOCOL_VERSION: Final = 1
MAGIC: Final = b"MLCL"
_PREAMBLE = struct.Struct(">4sH")
PREAMBLE_BYTES: Final = _PREAMBLE.size
_LENGTH = struct.Struct(">I")
LENGTH_BYTES: Final = _LENGTH.size

# Largest frame the 4-byte length can describe; real limits are far lower (TransportLimits).
ABSOLUTE_MAX_FRAME_BYTES: Final = (1 << 32) - 1


def preamble(version: int = PROTOCOL_VERSION) -> bytes:
    return _PREAMBLE.pack(MAGIC, version)


# --- frames -------------------------------------------------------------------------------------


class Hello(msgspec.Struct, tag=1, array_like=True, frozen=True):
    """Dialer -> listener, first frame: who I am, which cluster, which stream, my nonce."""

    node: str
    cluster_id: str
    stream: Stream
    version: int
    nonce: bytes


class Challenge(msgspec.Struct, tag=2, array_like=True, frozen=True):
    """Listener -> dialer: who answered, and the listener's nonce."""

    node: str
    nonce: bytes


class Proof(msgspec.Struct, tag=3, array_like=True, frozen=True):
    """Either side: HMAC proving knowledge of the cluster secret (the dialer's first)."""

    mac: bytes


class Refused(msgspec.Struct, tag=4, array_like=True, frozen=True):
    """Either side, last frame before closing: why, in words, so both logs can say it."""

    reason: str


class RaftMessages(msgspec.Struct, tag=5, array_like=True, gc=False):
    """Raft messages of any groups, each with its group id (the core's Message has none)."""

    messages: list[tuple[GroupId, Message]]


class Heartbeats(msgspec.Struct, tag=6, array_like=True, gc=False):
    """The coalesced heartbeats (or responses) of every group between two nodes."""

    batch: HeartbeatBatch


class Payload(msgspec.Struct, tag=7, array_like=True, gc=False):
    """Opaque node traffic (forwarded publishes and their acks): the transport never looks inside."""

    kind: str
    data: bytes


class Ping(msgspec.Struct, tag=8, array_like=True, frozen=True):
    """Dialer keep-alive on an otherwise idle connection."""


class Pong(msgspec.Struct, tag=9, array_like=True, frozen=True):
    """Listener's periodic sign of life on a connection it reads (the dialer's idle check)."""


Frame = Hello | Challenge | Proof | Refused | RaftMessages | Heartbeats | Payload | Ping | Pong
DataFrame = RaftMessages | Heartbeats | Payload
DATA_FRAMES: Final = (RaftMessages, Heartbeats, Payload)


# --- errors -------------------------------------------------------------------------------------


class ProtocolError(Exception):
    """The byte stream broke the protocol; the connection must be closed. The message says how."""


class FrameTooLarge(ProtocolError):
    def __init__(self, size_bytes: int, max_bytes: int) -> None:
        super().__init__(f"frame of {size_bytes} bytes is above the maximum of {max_bytes} bytes")
        self.size_bytes = size_bytes
        self.max_bytes = max_bytes


class VersionMismatch(ProtocolError):
    def __init__(self, peer_version: int) -> None:
        super().__init__(
            f"peer speaks moorline cluster protocol version {peer_version}; this node speaks "
            f"version {PROTOCOL_VERSION} (run the same moorline release on every node)"
        )
        self.peer_version = peer_version


# --- encoding -----------------------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()


def encode_frame(frame: Frame) -> bytes:
    """Length prefix + body, built in one buffer (no copy of a large body to prepend its length)."""
    buf = bytearray(LENGTH_BYTES)
    _encoder.encode_into(frame, buf, LENGTH_BYTES)
    size = len(buf) - LENGTH_BYTES
    if size > ABSOLUTE_MAX_FRAME_BYTES:
        raise FrameTooLarge(size, ABSOLUTE_MAX_FRAME_BYTES)
    _LENGTH.pack_into(buf, 0, size)
    return bytes(buf)


def frame_body_bytes(encoded: bytes) -> int:
    return len(encoded) - LENGTH_BYTES


# --- decoding -----------------------------------------------------------------------------------

_decoder: msgspec.msgpack.Decoder[Frame] = msgspec.msgpack.Decoder(Frame)  # type: ignore[arg-type]


class FrameDecoder:
    """Bytes in, frames out. ``feed`` returns every frame completed by the new bytes.

    Bounded: a length above ``max_frame_bytes`` is refused as soon as its 4 bytes arrive, so the
    buffer never holds more than one frame of at most that size plus its length (bytes for later
    frames given in the same ``feed`` are decoded before it returns). After an error every later
    ``feed`` raises the same error: the connection is finished.
    """

    def __init__(self, max_frame_bytes: int, expect_preamble: bool = True) -> None:
        if not 0 < max_frame_bytes <= ABSOLUTE_MAX_FRAME_BYTES:
            raise ValueError(f"max_frame_bytes must be in 1..{ABSOLUTE_MAX_FRAME_BYTES}")
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()
        self._need_preamble = expect_preamble
        self._error: ProtocolError | None = None
        self.peer_version: int | None = None

    @property
    def buffered_bytes(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        if self._error is not None:
            raise self._error
        try:
            return self._feed(data)
        except ProtocolError as exc:
            self._error = exc
            self._buf.clear()
            raise

    def _feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        buf = self._buf
        buf += data
        if self._need_preamble:
            if len(buf) < PREAMBLE_BYTES:
                if not MAGIC.startswith(bytes(buf[: len(MAGIC)])):
                    raise self._not_ours()
                return []
            magic, version = _PREAMBLE.unpack_from(buf, 0)
            if magic != MAGIC:
                raise self._not_ours()
            self.peer_version = version
            if version != PROTOCOL_VERSION:
                raise VersionMismatch(version)
            self._need_preamble = False
            del buf[:PREAMBLE_BYTES]
        frames: list[Frame] = []
        pos = 0
        end = len(buf)
        view = memoryview(buf)
        try:
            while end - pos >= LENGTH_BYTES:
                (size,) = _LENGTH.unpack_from(buf, pos)
                if size > self.max_frame_bytes:
                    raise FrameTooLarge(size, self.max_frame_bytes)
                if end - pos - LENGTH_BYTES < size:
                    break
                start = pos + LENGTH_BYTES
                body = view[start : start + size]
                try:
                    frames.append(_decode_body(body))
                finally:
                    body.release()  # even when an error's traceback still refers to it
                pos = start + size
        finally:
            view.release()  # a bytearray cannot be resized while a view of it exists
        if pos:
            del buf[:pos]
        return frames

    def _not_ours(self) -> ProtocolError:
        return ProtocolError(
            f"not a moorline cluster connection (first bytes {bytes(self._buf[:PREAMBLE_BYTES])!r}); "
            "is a client connecting to the --cluster port?"
        )


def _decode_body(body: memoryview) -> Frame:
    try:
        return _decoder.decode(body)
    except (msgspec.MsgspecError, ValueError, TypeError, RecursionError) as exc:
        raise ProtocolError(f"undecodable frame of {len(body)} bytes: {exc}") from None
