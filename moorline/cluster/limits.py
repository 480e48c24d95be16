"""Every bound of the cluster transport, with its unit in its name and a default."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TransportLimits:
    # Largest frame either side accepts. Raft appends are bounded by raft.max_bytes_per_append
    # (1 MiB by default) per group; snapshots must be sent in chunks below this.
    max_frame_bytes: int = 64 << 20
    # Per (peer, stream) send queue. When either bound is reached new frames are dropped and
    # counted (Raft retransmits); a frame is always accepted into an empty queue, however large.
    max_queue_frames: int = 4096
    max_queue_bytes: int = 16 << 20
    # Bytes handed to the socket per drain, and read per read call.
    write_batch_bytes: int = 256 << 10
    read_chunk_bytes: int = 256 << 10
    # Dialing: connect and handshake timeouts, then a jittered exponential backoff between attempts
    # (attempt n waits a uniform draw from [1/2, 1] x min(cap, base x 2^n)).
    connect_timeout_s: float = 2.0
    handshake_timeout_s: float = 2.0
    backoff_base_s: float = 0.1
    backoff_cap_s: float = 2.0
    # Liveness. A dialer pings a connection it has written nothing on for keepalive_interval_s; a
    # listener sends a Pong every keepalive_interval_s. Either side closes a connection that
    # brought it no byte for idle_timeout_s (a cut link hangs, it does not reset), and a dialer
    # closes one whose socket did not take a write slice (write_batch_bytes) within
    # write_stall_timeout_s (a stalled peer). Large frames go out slice by slice, so a slow link
    # is not a stall as long as one slice (plus half the kernel's send buffer) leaves in time.
    keepalive_interval_s: float = 1.0
    idle_timeout_s: float = 5.0
    write_stall_timeout_s: float = 10.0
    # Incoming connections that have not finished the handshake (TLS and Hello/Proof): beyond
    # max_pending_handshakes from addresses that are not a member's cluster host, or beyond
    # max_pending_handshakes_per_address from any one address, new ones are closed at once, so
    # unauthenticated sockets cannot pile up. Connections from a member's cluster host (an IP
    # address in --initial-cluster) never count against the global bound: a restarted peer always
    # finds a slot, however many idle sockets other hosts hold. The listener closes a connection
    # that has not authenticated within preauth_timeout_s (the dialer's own bound is
    # handshake_timeout_s).
    max_pending_handshakes: int = 64
    max_pending_handshakes_per_address: int = 8
    preauth_timeout_s: float = 2.0
    # close() waits at most this long for its tasks to end.
    close_timeout_s: float = 2.0

    def validate(self) -> None:
        positive = {
            "max_frame_bytes": self.max_frame_bytes,
            "max_queue_frames": self.max_queue_frames,
            "max_queue_bytes": self.max_queue_bytes,
            "write_batch_bytes": self.write_batch_bytes,
            "read_chunk_bytes": self.read_chunk_bytes,
            "connect_timeout_s": self.connect_timeout_s,
            "handshake_timeout_s": self.handshake_timeout_s,
            "backoff_base_s": self.backoff_base_s,
            "backoff_cap_s": self.backoff_cap_s,
            "keepalive_interval_s": self.keepalive_interval_s,
            "idle_timeout_s": self.idle_timeout_s,
            "write_stall_timeout_s": self.write_stall_timeout_s,
            "max_pending_handshakes": self.max_pending_handshakes,
            "max_pending_handshakes_per_address": self.max_pending_handshakes_per_address,
            "preauth_timeout_s": self.preauth_timeout_s,
            "close_timeout_s": self.close_timeout_s,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"{name} must be positive, not {value!r}")
        if self.max_frame_bytes >= 1 << 32:
            raise ValueError("max_frame_bytes must be below 4 GiB (4-byte frame length)")
        if self.backoff_cap_s < self.backoff_base_s:
            raise ValueError("backoff_cap_s must be >= backoff_base_s")
        if self.idle_timeout_s <= self.keepalive_interval_s:
            raise ValueError("idle_timeout_s must be above keepalive_interval_s, or idle links would be closed")
