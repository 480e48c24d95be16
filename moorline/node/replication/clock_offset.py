"""How far each peer's wall clock is from this node's, measured over the cluster link; whether
this node may serve (docs/design.md, "Leases and clocks").

Why it matters: a session's owner lease ends at a time its session shard's leader stamped, and a
new owner elsewhere waits until then by the time another (perhaps newer) leader stamped on its
open. Two leaders' wall clocks that differ by more than the lease's safety margin (about
``owner_lease_s * owner_lease_drift`` plus the 1 s the old owner closes its client early: 1.2 s
with the defaults) could let two nodes serve one session. The bound is
``cluster.max_clock_offset_ms``; two nodes each within it of a third may be twice it apart, so the
config refuses a bound above half the margin.

How it is measured: every ``PROBE_INTERVAL_S`` this node sends each peer a probe carrying its
wall time; the peer answers with its own wall time at receipt; the round trip is timed on this
node's monotonic clock. The offset estimate is the peer's time minus the midpoint of the round
trip, give or take half of it (NTP's estimate); of the last ``SAMPLES`` answers the one with the
shortest round trip is used. A peer is *beyond the bound* when even the most favourable reading
of that estimate exceeds it (|offset| - round trip / 2 > bound), and *within* it when its estimate
is fresh (answered within ``STALE_AFTER_S``) and not beyond. In the first ``STALE_AFTER_S``
after the link starts a peer not heard from yet is given the benefit of the doubt (nothing could
have been measured; a node that started alone cannot serve anyway): only one surely beyond counts.

What is refused: a node that does not have a majority of the cluster (itself included) within the
bound does not know that its clock agrees with a majority's: it refuses new client sessions
(CONNACK "server unavailable", the client tries another node) and hands its leaderships over
(so its clock stamps no entry), until it does again. One node with a bad clock stops serving; the
others go on. The current offsets are metrics (``moorline_cluster_clock_offset_ms{peer}``,
``moorline_cluster_clock_out_of_bound``) and in ``moorline cluster status``.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

log = logging.getLogger("moorline.cluster")

PAYLOAD_KIND = "clock"
PROBE_INTERVAL_S = 1.0
SAMPLES = 8  # answers kept per peer; the one with the shortest round trip is the estimate
STALE_AFTER_S = 10.0  # a peer not heard from this long is not known to be within the bound
MAX_PENDING = 16  # probes waiting for an answer, per peer (older ones are forgotten)


class Probe(msgspec.Struct, tag=1, array_like=True, frozen=True):
    seq: int
    wall_ms: int  # the prober's wall clock when sent


class Answer(msgspec.Struct, tag=2, array_like=True, frozen=True):
    seq: int
    wall_ms: int  # the answering node's wall clock when the probe arrived


ClockMessage = Probe | Answer
_enc = msgspec.msgpack.Encoder()
_dec: msgspec.msgpack.Decoder[ClockMessage] = msgspec.msgpack.Decoder(ClockMessage)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Sample:
    offset_ms: float  # the peer's wall clock minus this node's
    error_ms: float  # half the round trip: the true offset is within offset_ms +- error_ms
    at: float  # this node's monotonic time of the answer


class ClockOffsets:
    """Offset estimates to every peer, and the verdict on this node (module doc)."""

    def __init__(self, me: str, names: tuple[str, ...], send: Callable[[str, bytes], object],
                 wall_ms: Callable[[], int], monotonic: Callable[[], float], bound_ms: float) -> None:
        self.me = me
        self.names = names
        self.peers = tuple(n for n in names if n != me)
        self._send = send  # (peer, encoded message) on the control stream
        self._wall_ms = wall_ms
        self._mono = monotonic
        self.bound_ms = bound_ms
        self._seq = 0
        self._pending: dict[str, dict[int, tuple[int, float]]] = {p: {} for p in self.peers}
        self.samples: dict[str, deque[Sample]] = {p: deque(maxlen=SAMPLES) for p in self.peers}
        self._was_out: str | None = None  # the last verdict's reason, for logging changes only
        self._started = monotonic()

    def add_peer(self, name: str) -> None:
        """A member that joined the cluster after this node started (cluster_link.learn_member): probed
        and answered like the others, and counted in the majority."""
        if name == self.me or name in self.peers:
            return
        if name not in self.names:
            self.names = (*self.names, name)
        self.peers = (*self.peers, name)
        self._pending[name] = {}
        self.samples[name] = deque(maxlen=SAMPLES)

    # --- probing ---------------------------------------------------------------------------------
    def probe_all(self) -> None:
        self._seq += 1
        wall, mono = self._wall_ms(), self._mono()
        data = _enc.encode(Probe(self._seq, wall))
        for peer in self.peers:
            pending = self._pending[peer]
            pending[self._seq] = (wall, mono)
            if len(pending) > MAX_PENDING:
                del pending[min(pending)]
            self._send(peer, data)

    def on_payload(self, peer: str, data: bytes) -> None:
        """A ``Payload("clock")`` frame from an authenticated ``peer`` (event loop)."""
        if peer not in self._pending:
            return
        msg = _dec.decode(data)  # DecodeError/ValidationError: the link counts a malformed frame
        if type(msg) is Probe:
            self._send(peer, _enc.encode(Answer(msg.seq, self._wall_ms())))
            return
        sent = self._pending[peer].pop(msg.seq, None)
        if sent is None:
            return  # an answer to a forgotten probe (or a repeated one)
        wall_sent, mono_sent = sent
        rtt_ms = max(0.0, (self._mono() - mono_sent) * 1000)
        offset = msg.wall_ms - (wall_sent + rtt_ms / 2)
        self.samples[peer].append(Sample(offset, rtt_ms / 2, self._mono()))

    # --- estimates and the verdict ---------------------------------------------------------------
    def estimate(self, peer: str) -> Sample | None:
        """The freshest-window estimate with the smallest error; None when stale or unknown."""
        samples = self.samples.get(peer)
        if not samples:
            return None
        now = self._mono()
        fresh = [s for s in samples if now - s.at <= STALE_AFTER_S]
        return min(fresh, key=lambda s: s.error_ms) if fresh else None

    def beyond(self, peer: str) -> bool:
        """Surely further off than the bound (even the most favourable reading of the estimate)."""
        s = self.estimate(peer)
        return s is not None and abs(s.offset_ms) - s.error_ms > self.bound_ms

    def out_of_bound(self) -> str | None:
        """Why this node must not serve (no majority of the cluster, itself included, known to be
        within the bound of its clock), or None."""
        starting = self._mono() - self._started < STALE_AFTER_S
        within = [p for p in self.peers
                  if not self.beyond(p) and (starting or self.estimate(p) is not None)]
        quorum = len(self.names) // 2 + 1
        if 1 + len(within) >= quorum:
            reason = None
        else:
            far = {p: round(s.offset_ms) for p in self.peers if (s := self.estimate(p)) is not None and self.beyond(p)}
            unknown = [p for p in self.peers if self.estimate(p) is None]
            parts = [f"{p} is {ms:+d} ms off" for p, ms in sorted(far.items())]
            parts += [f"no recent clock reading from {p}" for p in unknown]
            reason = (f"this node's clock is not known to be within cluster.max_clock_offset_ms "
                      f"({self.bound_ms:g} ms) of a majority of the cluster: {', '.join(parts)}")
        if reason != self._was_out:
            if reason is not None:
                log.log(logging.ERROR if any(self.beyond(p) for p in self.peers) else logging.WARNING,
                        "refusing to serve clients and to lead: %s", reason)
            elif reason is None and self._was_out is not None:
                log.warning("clocks agree again (within cluster.max_clock_offset_ms of a majority): serving")
            self._was_out = reason
        return reason

    def stats(self) -> dict[str, object]:
        out: dict[str, object] = {"bound_ms": self.bound_ms, "peers": {}}
        for p in self.peers:
            s = self.estimate(p)
            out["peers"][p] = (None if s is None else  # type: ignore[index]
                               {"offset_ms": round(s.offset_ms, 1), "error_ms": round(s.error_ms, 1),
                                "beyond_bound": self.beyond(p)})
        return out
