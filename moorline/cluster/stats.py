"""Counters the transport keeps per peer and stream, and the snapshot it reports (for /v1/cluster).

Times are the transport's clock (the event loop's ``time()``); reports give ages in seconds, which
mean the same on every node whatever its clock's origin.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from moorline.cluster.net import Address
from moorline.raft.types import Stream

STREAMS: tuple[Stream, ...] = (Stream.CONTROL, Stream.APPEND, Stream.SNAPSHOT)
STREAM_NAMES: dict[Stream, str] = {Stream.CONTROL: "control", Stream.APPEND: "append", Stream.SNAPSHOT: "snapshot"}


@dataclass(slots=True)
class StreamCounters:
    frames_sent: int = 0  # handed to the socket
    bytes_sent: int = 0
    frames_received: int = 0  # data frames delivered to the handler
    bytes_received: int = 0  # every byte read after the handshake (incl. keep-alives)
    dropped_queue_full: int = 0
    dropped_disconnected: int = 0  # queued when the connection broke or could not be made
    connects: int = 0  # outgoing connections authenticated
    connect_failures: int = 0  # attempts that failed (connect, handshake)


@dataclass(slots=True)
class PeerState:
    name: str
    address: Address
    streams: dict[Stream, StreamCounters] = field(default_factory=lambda: {s: StreamCounters() for s in STREAMS})
    last_contact_at: float | None = None  # any byte from the peer, on any of its connections
    last_error: str | None = None
    last_error_at: float | None = None
    auth_failures: int = 0  # handshakes that failed on a proof, either direction

    def note_error(self, message: str, now: float) -> None:
        self.last_error = message
        self.last_error_at = now


class StreamStats(msgspec.Struct, kw_only=True):
    outgoing_connected: bool
    incoming_connected: bool
    incoming_from: str | None  # "host:port" the peer's connection comes from
    queued_frames: int
    queued_bytes: int
    frames_sent: int
    bytes_sent: int
    frames_received: int
    bytes_received: int
    dropped_queue_full: int
    dropped_disconnected: int
    connects: int
    connect_failures: int


class PeerStats(msgspec.Struct, kw_only=True):
    address: str
    connected_streams: list[str]  # outgoing streams up (authenticated)
    incoming_streams: list[str]
    last_contact_age_s: float | None
    last_error: str | None
    last_error_age_s: float | None
    auth_failures: int
    frames_sent: int
    bytes_sent: int
    frames_received: int
    bytes_received: int
    dropped: int
    streams: dict[str, StreamStats]


class TransportStats(msgspec.Struct, kw_only=True):
    node: str
    listen_address: str | None
    peers: dict[str, PeerStats]
    refused_connections: int  # incoming handshakes that failed, from anyone
    last_refusal: str | None
    dropped_unknown_peer: int  # frames sent to a name that is not a peer


def escape(text: str, limit: int = 300) -> str:
    """Text that came from the network, fit for one log line: control and non-ASCII characters
    escaped (no forged line breaks or terminal sequences), at most ``limit`` characters kept."""
    out = text[:limit].encode("unicode_escape", "backslashreplace").decode("ascii")
    return out + "..." if len(text) > limit else out


def fmt_address(address: Address) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
