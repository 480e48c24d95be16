"""A new node's first start with ``--join``: it asks a live member (a seed, given by its cluster
address) to bind its storage to the member table's entry an operator admitted (``moorline cluster
join``), and takes the member's welcome (its node id, the initial members, every member's id and
address, the shard layout). The member's side: ``ClusterLink`` passes a join request on to the
membership driver (membership_ops.py), which answers with ``ClusterLink.send_welcome``.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import msgspec

from moorline.cluster import ClusterTransport, Payload, TransportLimits, auth, handshake, read_secret_file
from moorline.cluster.auth import require_secret_or_loopback, require_tls_or_loopback
from moorline.cluster.net import AsyncioNetwork
from moorline.cluster.wire import PROTOCOL_VERSION, Challenge, FrameDecoder, Hello, Proof, Refused, preamble
from moorline.config import ClusterConfig, ConfigError
from moorline.node.replication.cluster_spec import load_node_tls
from moorline.node.seams import PRODUCTION, Seams
from moorline.raft import Stream

# The same msgpack encoding as the link's announcements (cluster_link.py).
_enc = msgspec.msgpack.Encoder()
_member_dec = msgspec.msgpack.Decoder(dict[str, Any])

JOIN_PAYLOAD = "join"  # a joining node -> a live member: {name, storage_id}
WELCOME_PAYLOAD = "welcome"  # the member's answer: the cluster (join_cluster), or {"error": why}


async def probe_member(address: tuple[str, int], me: handshake.Identity, bind_host: str | None,
                       net: Any, timeout_s: float) -> str:
    """The name of the member listening at ``address``, authenticated as the link authenticates a
    peer (the cluster secret's proof both ways, or the certificate with cluster TLS): a joining node
    is given members' addresses, not their names. The member must have admitted this node already
    (it refuses a node it does not know, saying so: HandshakeError). One short CONTROL connection."""
    stream = await net.connect(address[0], address[1], bind_host)
    try:
        async with asyncio.timeout(timeout_s):
            proven = await handshake.secure(stream, me, server_side=False)
            reader = handshake.FrameReader(stream, FrameDecoder(handshake.MAX_HANDSHAKE_FRAME_BYTES), 4096)
            nonce = me.nonce_source(auth.NONCE_BYTES)
            stream.write(preamble())
            handshake.send_frames(stream, Hello(node=me.node, cluster_id=me.cluster_id, stream=Stream.CONTROL,
                                                version=PROTOCOL_VERSION, nonce=nonce))
            await stream.drain()
            challenge = await reader.next_frame()
            if isinstance(challenge, Refused):
                raise handshake.HandshakeError(f"refused: {challenge.reason}")
            if not isinstance(challenge, Challenge) or len(challenge.nonce) < auth.MIN_NONCE_BYTES:
                raise handshake.HandshakeError("no valid Challenge")
            name = challenge.node
            if proven is not None and proven != name:
                raise handshake.HandshakeError(f"answered as {name!r} with the certificate of {proven!r}")
            t = auth.transcript(me.cluster_id, Stream.CONTROL, me.node, name, nonce, challenge.nonce)
            handshake.send_frames(stream, Proof(auth.make_proof(me.secret, t, auth.DIALER)))
            await stream.drain()
            proof = await reader.next_frame()
            if isinstance(proof, Refused):
                raise handshake.HandshakeError(f"refused: {proof.reason}")
            if not isinstance(proof, Proof) or not auth.check_proof(me.secret, t, auth.LISTENER, proof.mac):
                raise handshake.HandshakeError(f"{name!r} did not prove the cluster secret")
            return str(name)
    finally:
        stream.close()


async def join_cluster(cfg: ClusterConfig, me: str, listen: tuple[str, int], storage_id: str,
                       seeds: list[tuple[str, int]], rng: random.Random, seams: Seams = PRODUCTION
                       ) -> dict[str, Any]:
    """A new node's first start (``--join``): ask a live member (any of ``seeds``, cluster
    addresses) to bind this node's storage to the member table's entry an operator admitted
    (``moorline cluster join``), and return the member's welcome: this node's node id, the initial
    members, every member's id and address, the shard layout. ConfigError when no member welcomes
    it within cluster.bootstrap_timeout_s (saying what each answered)."""
    secret = read_secret_file(cfg.secret_file) if cfg.secret_file else None
    tls = load_node_tls(cfg, me)
    if tls is None:
        require_secret_or_loopback(listen[0], secret)
        if seams.cluster_network is None:
            require_tls_or_loopback([listen[0], *(h for h, _ in seeds)])
    got: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()

    def on_frame(peer: str, frame: Any) -> None:
        if type(frame) is Payload and frame.kind == WELCOME_PAYLOAD and not got.done():
            try:
                body = _member_dec.decode(frame.data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                return
            got.set_result({**body, "from": peer})

    limits = TransportLimits(max_pending_handshakes=cfg.max_pending_handshakes,
                             max_pending_handshakes_per_address=cfg.max_pending_handshakes_per_address,
                             preauth_timeout_s=cfg.preauth_timeout_s)
    transport = ClusterTransport(me, listen, {}, secret, on_frame, rng, cluster_id=cfg.cluster_id,
                                 net=seams.cluster_network, limits=limits, clock=seams.clock.monotonic,
                                 nonce_source=seams.random_bytes, tls=tls)
    identity = handshake.Identity(node=me, cluster_id=cfg.cluster_id, secret=secret,
                                  nonce_source=seams.random_bytes, tls=tls)
    net = seams.cluster_network or AsyncioNetwork()
    bind_host = None if listen[0] in ("0.0.0.0", "::", "") else listen[0]
    answers: dict[str, str] = {}
    request = _enc.encode({"name": me, "storage_id": storage_id})
    await transport.start()
    try:
        deadline = seams.clock.monotonic() + cfg.bootstrap_timeout_s
        while True:
            for seed in seeds:
                where = "{}:{}".format(*seed)
                try:
                    name = await probe_member(seed, identity, bind_host, net, cfg.preauth_timeout_s)
                except (handshake.HandshakeError, OSError, TimeoutError) as exc:
                    answers[where] = str(exc) or type(exc).__name__
                    continue
                answers[where] = f"{name}: no welcome yet"
                if name not in transport.peer_names():
                    transport.add_peer(name, seed)
                transport.send(name, Stream.CONTROL, Payload(JOIN_PAYLOAD, request))
            try:
                welcome = await asyncio.wait_for(asyncio.shield(got), 2.0)
            except TimeoutError:
                if seams.clock.monotonic() > deadline:
                    raise ConfigError(
                        f"--join: no member welcomed {me} within {cfg.bootstrap_timeout_s:.0f} s; they answered: "
                        + "; ".join(f"{k}: {v}" for k, v in answers.items())
                        + f". A node joins once a live member admitted it: moorline cluster join {me} "
                          f"--cluster {listen[0]}:{listen[1]} --http HOST:PORT (any live node's HTTP)") from None
                continue
            if "error" in welcome:
                raise ConfigError(f"--join: {welcome['from']} refused {me}: {welcome['error']}")
            return welcome
    finally:
        await transport.close()


