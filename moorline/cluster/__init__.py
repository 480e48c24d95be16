"""Inter-node transport of a moorline cluster (see docs/cluster-transport.md).

| module | what it holds |
|---|---|
| `wire.py` | sans-IO framing: preamble, length-prefixed msgpack frames, `FrameDecoder` |
| `auth.py` | challenge-response proofs (HMAC-SHA256), the secret file, the loopback rule |
| `handshake.py` | the handshake over a byte stream, both sides |
| `net.py` | the network seam (`Network`, `ByteStream`, `Listener`) and its asyncio implementation |
| `links.py` | one outgoing connection per (peer, stream): queue, dialing, backoff, liveness |
| `incoming.py` | the listener's side: authenticate, then deliver frames to the handler |
| `transport.py` | `ClusterTransport`, which owns all of the above |
| `limits.py`, `stats.py` | every bound with its default; the counters reported for /v1/cluster |
"""

from moorline.cluster.auth import ClusterConfigError, read_secret_file, require_secret_or_loopback
from moorline.cluster.limits import TransportLimits
from moorline.cluster.net import AsyncioNetwork, ByteStream, Listener, Network
from moorline.cluster.stats import PeerStats, StreamStats, TransportStats
from moorline.cluster.transport import ClusterTransport
from moorline.cluster.wire import (
    DataFrame,
    Frame,
    FrameDecoder,
    FrameTooLarge,
    Heartbeats,
    Payload,
    ProtocolError,
    RaftMessages,
)

__all__ = [
    "AsyncioNetwork",
    "ByteStream",
    "ClusterConfigError",
    "ClusterTransport",
    "DataFrame",
    "Frame",
    "FrameDecoder",
    "FrameTooLarge",
    "Heartbeats",
    "Listener",
    "Network",
    "Payload",
    "PeerStats",
    "ProtocolError",
    "RaftMessages",
    "StreamStats",
    "TransportLimits",
    "TransportStats",
    "read_secret_file",
    "require_secret_or_loopback",
]
