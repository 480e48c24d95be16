"""The cluster link over TLS with mutual certificates (issue 30.5), and the bounds on handshakes in
progress (issue 30.6), over real sockets on loopback aliases. Each attack test names the attack."""

from __future__ import annotations

import asyncio
import datetime
import os
import random
import socket
import ssl
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from moorline import certs as certs_module
from moorline.certs import write_dev_certificates
from moorline.cluster import ClusterConfigError, ClusterTransport, TransportLimits, handshake
from moorline.cluster.net import AsyncioStream
from moorline.cluster.wire import FrameDecoder, Payload
from moorline.raft.types import Stream
from tests.cluster.helpers import (
    CLUSTER_ID,
    FAST,
    HOSTS,
    SECRET,
    Inbox,
    requires_loopback_aliases,
    wait_until,
)

pytestmark = [pytest.mark.timeout(60), requires_loopback_aliases]


def run(coro_fn, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    async def bounded() -> None:
        async with asyncio.timeout(timeout_s):
            await coro_fn()

    asyncio.run(bounded())


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cluster-certs")
    certs_module.write_node_certificates(out, ["n1", "n2", "n3"])
    return out


def load_cluster_tls(*args: str | None) -> Any:
    from moorline.cluster.tls import load_cluster_tls as load  # (new in issue 30: imported where used)

    return load(*args)  # type: ignore[arg-type]


def tls_of(certs: Path, name: str, crl: Path | None = None) -> Any:
    return load_cluster_tls(str(certs / f"{name}.crt"), str(certs / f"{name}.key"), str(certs / "ca.crt"),
                            str(crl) if crl else None)


async def start(name: str, host: str, tls: Any, peers: dict[str, tuple[str, int]] | None = None,
                limits: TransportLimits = FAST, secret: bytes | None = None) -> tuple[ClusterTransport, Inbox]:
    inbox = Inbox()
    kw: dict[str, Any] = {"tls": tls} if tls is not None else {}
    t = ClusterTransport(name, (host, 0), dict(peers or {}), secret, inbox, random.Random(1), cluster_id=CLUSTER_ID,
                         limits=limits, **kw)
    await t.start()
    return t, inbox


def test_two_nodes_exchange_frames_over_tls(certs: Path) -> None:
    async def body() -> None:
        a, ia = await start("n1", HOSTS[0], tls_of(certs, "n1"))
        b, ib = await start("n2", HOSTS[1], tls_of(certs, "n2"))
        try:
            a.add_peer("n2", b.listen_address)
            b.add_peer("n1", a.listen_address)
            await wait_until(lambda: a.stats().peers["n2"].connected_streams == ["control", "append", "snapshot"]
                             and b.stats().peers["n1"].connected_streams == ["control", "append", "snapshot"],
                             10, "every stream up over TLS")
            a.send("n2", Stream.APPEND, Payload("k", b"over tls"))
            await wait_until(lambda: len(ib.payloads("n1")) == 1, 10, "the payload at n2")
            assert ib.payloads("n1")[0].data == b"over tls"
        finally:
            await asyncio.gather(a.close(), b.close())

    run(body)


async def _raw_tls_dial(certs: Path, cert_name: str, address: tuple[str, int], claim: str,
                        source: str = HOSTS[3]) -> str:
    """Dial with ``cert_name``'s certificate, claim to be ``claim`` in the Hello: the outcome in words."""
    me = handshake.Identity(claim, CLUSTER_ID, None, os.urandom, tls_of(certs, cert_name))  # type: ignore[call-arg]
    reader, writer = await asyncio.open_connection(*address, local_addr=(source, 0))
    stream = AsyncioStream(reader, writer)
    fr = handshake.FrameReader(stream, FrameDecoder(handshake.MAX_HANDSHAKE_FRAME_BYTES), 65536)
    try:
        await handshake.dial(stream, fr, me, "n1", Stream.CONTROL)
        return "accepted"
    except handshake.HandshakeError as exc:
        return f"refused: {exc}"
    finally:
        stream.close()


def test_a_node_certificate_holder_claiming_another_node_is_refused(certs: Path) -> None:
    """Attack: n3 (valid certificate) dials n1 and says it is n2, to act as n2."""
    async def body() -> None:
        a, inbox = await start("n1", HOSTS[0], tls_of(certs, "n1"), peers={"n2": (HOSTS[1], 1), "n3": (HOSTS[2], 1)})
        try:
            outcome = await _raw_tls_dial(certs, "n3", a.listen_address, claim="n2")
            assert outcome.startswith("refused") and "certificate names 'n3'" in outcome, outcome
            assert inbox.frames == []
            assert "certificate names 'n3'" in (a.stats().last_refusal or "")
            # its own name is accepted: the refusal is about the claim, not the certificate
            assert await _raw_tls_dial(certs, "n3", a.listen_address, claim="n3") == "accepted"
        finally:
            await a.close()

    run(body)


def test_an_address_presenting_another_nodes_certificate_is_not_trusted_as_the_dialled_node(certs: Path) -> None:
    """Attack: whoever answers on n2's address with n3's certificate is not n2 to its dialers."""
    async def body() -> None:
        impostor, _ = await start("n2", HOSTS[1], tls_of(certs, "n3"))  # says n2, proves n3
        a, _ = await start("n1", HOSTS[0], tls_of(certs, "n1"), peers={"n2": impostor.listen_address})
        try:
            await wait_until(lambda: "certificate of node 'n3'" in (a.stats().peers["n2"].last_error or ""), 10,
                             "n1 refuses the impostor")
            assert a.stats().peers["n2"].connected_streams == []
        finally:
            await asyncio.gather(a.close(), impostor.close())

    run(body)


def test_an_mqtt_client_certificate_of_the_same_ca_cannot_join_as_a_node(tmp_path: Path, certs: Path) -> None:
    """Attack: a certificate the cluster CA signed for something else (an MQTT user's, CN=n2) is
    presented as a node's: it names no node by the URI subject alternative name, so it is refused."""
    # the cluster CA signs an MQTT client certificate with CN=n2
    write_dev_certificates(tmp_path, ["localhost"], client="n2", ca=(certs / "ca.crt", certs / "ca.key"))
    with pytest.raises(ClusterConfigError, match="must name exactly one node"):
        load_cluster_tls(str(tmp_path / "client.crt"), str(tmp_path / "client.key"), str(certs / "ca.crt"))

    async def body() -> None:
        a, inbox = await start("n1", HOSTS[0], tls_of(certs, "n1"), peers={"n2": (HOSTS[1], 1)})
        try:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.check_hostname = False
            ctx.load_verify_locations(str(certs / "ca.crt"))
            ctx.load_cert_chain(str(tmp_path / "client.crt"), str(tmp_path / "client.key"))
            from moorline.cluster.tls import ClusterTls

            tls = ClusterTls(server=ctx, client=ctx)
            me = handshake.Identity("n2", CLUSTER_ID, None, os.urandom, tls)  # type: ignore[call-arg]
            reader, writer = await asyncio.open_connection(*a.listen_address, local_addr=(HOSTS[3], 0))
            stream = AsyncioStream(reader, writer)
            fr = handshake.FrameReader(stream, FrameDecoder(handshake.MAX_HANDSHAKE_FRAME_BYTES), 65536)
            with pytest.raises((handshake.HandshakeError, OSError)):
                await handshake.dial(stream, fr, me, "n1", Stream.CONTROL)
            stream.close()
            await wait_until(lambda: "names no node" in (a.stats().last_refusal or ""), 5, "the refusal")
            assert inbox.frames == []
        finally:
            await a.close()

    run(body)


def test_a_revoked_node_certificate_is_refused(tmp_path: Path, certs: Path) -> None:
    """Attack: a node whose certificate was revoked (cluster.tls.crl_file) keeps dialling."""
    ca_cert = x509.load_pem_x509_certificate((certs / "ca.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((certs / "ca.key").read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    revoked = x509.load_pem_x509_certificate((certs / "n3.crt").read_bytes())
    now = datetime.datetime.now(datetime.UTC)
    crl = (x509.CertificateRevocationListBuilder().issuer_name(ca_cert.subject).last_update(now)
           .next_update(now + datetime.timedelta(days=1))
           .add_revoked_certificate(x509.RevokedCertificateBuilder().serial_number(revoked.serial_number)
                                    .revocation_date(now).build())
           .sign(ca_key, hashes.SHA256()))
    crl_path = tmp_path / "cluster.crl"
    crl_path.write_bytes(crl.public_bytes(serialization.Encoding.PEM))

    async def body() -> None:
        a, inbox = await start("n1", HOSTS[0], tls_of(certs, "n1", crl=crl_path),
                               peers={"n2": (HOSTS[1], 1), "n3": (HOSTS[2], 1)})
        try:
            assert (await _raw_tls_dial(certs, "n3", a.listen_address, claim="n3")).startswith("refused")
            assert await _raw_tls_dial(certs, "n2", a.listen_address, claim="n2") == "accepted"
            assert inbox.frames == []
        finally:
            await a.close()

    run(body)


def test_secret_mode_with_a_peer_off_loopback_is_refused() -> None:
    """Attack surface: a shared-secret cluster across machines (an on-path relay injects frames after
    the handshake, any holder of the secret acts as any node): refused at start, naming cluster TLS."""
    async def body() -> None:
        t = ClusterTransport("n1", (HOSTS[0], 0), {"n2": ("10.1.2.3", 7000)}, SECRET, Inbox(), random.Random(0))
        with pytest.raises(ClusterConfigError, match="cluster TLS"):
            await t.start()
        await t.close()
        t = ClusterTransport("n1", ("0.0.0.0", 0), {}, SECRET, Inbox(), random.Random(0))
        with pytest.raises(ClusterConfigError, match="cluster TLS"):
            await t.start()
        await t.close()

    run(body)


# --- 30.6: handshakes in progress ---------------------------------------------------------------


def test_idle_sockets_from_one_host_do_not_keep_a_restarted_peer_out() -> None:
    """Attack: one host opens 80 idle connections to the cluster port (more than the 64 handshake
    slots) and holds them; the peer n2, restarting, must still connect at once."""
    slow = TransportLimits(backoff_base_s=0.05, backoff_cap_s=0.2, connect_timeout_s=1.0, handshake_timeout_s=5.0,
                           preauth_timeout_s=5.0, close_timeout_s=1.0)

    async def body() -> None:
        a, _ = await start("n1", HOSTS[0], None, peers={"n2": (HOSTS[1], 1)}, limits=slow, secret=SECRET)
        socks: list[socket.socket] = []
        try:
            for _ in range(80):
                s = socket.socket()
                s.setblocking(False)
                s.bind((HOSTS[3], 0))
                try:
                    s.connect(a.listen_address)
                except BlockingIOError:
                    pass
                socks.append(s)
            await asyncio.sleep(0.3)  # every one accepted (or refused) by now
            b, _ = await start("n2", HOSTS[1], None, peers={"n1": a.listen_address}, limits=slow, secret=SECRET)
            try:
                await wait_until(lambda: b.stats().peers["n1"].connected_streams == ["control", "append", "snapshot"],
                                 3.0, "n2 connects although another host holds idle sockets")
            finally:
                await b.close()
            assert "max_pending_handshakes_per_address" in (a.stats().last_refusal or "")
        finally:
            for s in socks:
                s.close()
            await a.close()

    run(body)


def test_idle_pre_auth_connections_are_closed_after_preauth_timeout() -> None:
    """A socket that never authenticates is closed within preauth_timeout_s."""
    limits = TransportLimits(backoff_base_s=0.05, backoff_cap_s=0.2, preauth_timeout_s=0.3, close_timeout_s=1.0)

    async def body() -> None:
        a, _ = await start("n1", HOSTS[0], None, limits=limits, secret=SECRET)
        try:
            reader, writer = await asyncio.open_connection(*a.listen_address, local_addr=(HOSTS[3], 0))
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            async with asyncio.timeout(3):
                while await reader.read(65536):
                    pass  # the preamble and the Refused, then the end
            assert loop.time() - t0 < 2.0
            writer.close()
            assert "timed out" in (a.stats().last_refusal or "")
        finally:
            await a.close()

    run(body)
