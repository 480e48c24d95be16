"""Peer authentication: proofs, replay, the handshake both ways, the secret file, the loopback rule."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from moorline.cluster import auth, handshake
from moorline.cluster.wire import (
    Challenge,
    FrameDecoder,
    Hello,
    Payload,
    Proof,
    RaftMessages,
    Refused,
    encode_frame,
    preamble,
)
from moorline.raft.types import Stream
from tests.cluster.memstream import pair

pytestmark = pytest.mark.timeout(30)

SECRET = b"correct horse battery staple"
NA, NB = b"a" * 32, b"b" * 32


def t(dialer: str = "n1", listener: str = "n2", na: bytes = NA, nb: bytes = NB, cluster: str = "c",
      stream: int = Stream.CONTROL) -> bytes:
    return auth.transcript(cluster, stream, dialer, listener, na, nb)


# --- proofs -------------------------------------------------------------------------------------


def test_proof_verifies_only_with_the_same_secret_role_and_nonces() -> None:
    mac = auth.make_proof(SECRET, t(), auth.DIALER)
    assert auth.check_proof(SECRET, t(), auth.DIALER, mac)
    assert not auth.check_proof(b"another secret of some length", t(), auth.DIALER, mac)
    assert not auth.check_proof(SECRET, t(), auth.LISTENER, mac), "a dialer's proof reflected as a listener's"
    # replay: the same proof on another connection, where the listener drew another nonce
    assert not auth.check_proof(SECRET, t(nb=b"c" * 32), auth.DIALER, mac)
    assert not auth.check_proof(SECRET, t(na=b"c" * 32), auth.DIALER, mac)
    assert not auth.check_proof(SECRET, t(cluster="d"), auth.DIALER, mac)
    assert not auth.check_proof(SECRET, t(stream=Stream.APPEND), auth.DIALER, mac)
    assert not auth.check_proof(SECRET, t(dialer="n3"), auth.DIALER, mac)


def test_transcript_fields_cannot_slide_into_each_other() -> None:
    assert t(dialer="n1", listener="2n") != t(dialer="n12", listener="n")
    assert t(na=b"ab", nb=b"c") != t(na=b"a", nb=b"bc")


def test_the_secret_is_not_in_any_handshake_byte() -> None:
    async def body() -> None:
        a, b = pair()
        me_a = handshake.Identity("n1", "c", SECRET, os.urandom)
        me_b = handshake.Identity("n2", "c", SECRET, os.urandom)
        ra = handshake.FrameReader(a, FrameDecoder(4096), 65536)
        rb = handshake.FrameReader(b, FrameDecoder(4096), 65536)
        hello, _ = await asyncio.gather(handshake.accept(b, rb, me_b, lambda n: n == "n1"),
                                        handshake.dial(a, ra, me_a, "n2", Stream.APPEND))
        assert hello.node == "n1" and hello.stream == Stream.APPEND
        wire = b"".join(a.written + b.written)
        assert SECRET not in wire and len(wire) > 100

    asyncio.run(body())


# --- the handshake, both sides ------------------------------------------------------------------


async def _handshake(secret_a: bytes | None, secret_b: bytes | None, cluster_b: str = "c",
                     listener_name: str = "n2", peers_of_b: tuple[str, ...] = ("n1",)
                     ) -> tuple[BaseException | None, BaseException | None]:
    a, b = pair()
    me_a = handshake.Identity("n1", "c", secret_a, os.urandom)
    me_b = handshake.Identity(listener_name, cluster_b, secret_b, os.urandom)
    ra = handshake.FrameReader(a, FrameDecoder(4096), 65536)
    rb = handshake.FrameReader(b, FrameDecoder(4096), 65536)
    res = await asyncio.gather(handshake.accept(b, rb, me_b, lambda n: n in peers_of_b),
                               handshake.dial(a, ra, me_a, "n2", Stream.CONTROL), return_exceptions=True)
    errs = [r if isinstance(r, BaseException) else None for r in res]
    return errs[1], errs[0]


def test_matching_secrets_authenticate_both_ways() -> None:
    assert asyncio.run(_handshake(SECRET, SECRET)) == (None, None)
    assert asyncio.run(_handshake(None, None)) == (None, None)  # loopback clusters: empty key, same code path


def test_different_secrets_are_refused_with_the_reason_on_both_sides() -> None:
    dial_err, accept_err = asyncio.run(_handshake(SECRET, b"a different secret of 30 bytes"))
    assert isinstance(accept_err, handshake.HandshakeError) and "authentication failed" in str(accept_err)
    assert accept_err.peer == "n1"
    assert isinstance(dial_err, handshake.PeerRefused) and "authentication failed" in str(dial_err)
    dial_err, accept_err = asyncio.run(_handshake(SECRET, None))
    assert "authentication failed" in str(accept_err) and "authentication failed" in str(dial_err)


def test_wrong_cluster_unknown_node_and_wrong_listener_are_named() -> None:
    dial_err, accept_err = asyncio.run(_handshake(SECRET, SECRET, cluster_b="other"))
    assert "wrong cluster" in str(dial_err) and "'other'" in str(accept_err)
    dial_err, accept_err = asyncio.run(_handshake(SECRET, SECRET, peers_of_b=("n3",)))
    assert "not a peer of n2" in str(dial_err)
    dial_err, accept_err = asyncio.run(_handshake(SECRET, SECRET, listener_name="n9", peers_of_b=("n1",)))
    assert "answered as node 'n9'" in str(dial_err) and "answered as node 'n9'" in str(accept_err)


def test_a_listener_that_cannot_prove_the_secret_is_refused_by_the_dialer() -> None:
    async def body() -> None:
        a, b = pair()
        ra = handshake.FrameReader(a, FrameDecoder(4096), 65536)
        dial = asyncio.create_task(handshake.dial(a, ra, handshake.Identity("n1", "c", SECRET, os.urandom), "n2",
                                                  Stream.CONTROL))
        # an impostor listener: knows the protocol, not the secret
        b.write(preamble() + encode_frame(Challenge("n2", b"x" * 32)))
        await asyncio.sleep(0.01)
        b.write(encode_frame(Proof(b"\x00" * 32)))
        with pytest.raises(handshake.HandshakeError, match="n2 did not prove the cluster secret"):
            await dial
        frames = FrameDecoder(4096).feed(b"".join(a.written))
        assert isinstance(frames[0], Hello) and isinstance(frames[1], Proof) and isinstance(frames[2], Refused)

    asyncio.run(body())


def test_no_data_frame_is_accepted_in_place_of_a_proof() -> None:
    async def body() -> None:
        a, b = pair()
        rb = handshake.FrameReader(b, FrameDecoder(4096), 65536)
        acc = asyncio.create_task(handshake.accept(b, rb, handshake.Identity("n2", "c", SECRET, os.urandom),
                                                   lambda n: True))
        a.write(preamble() + encode_frame(Hello("n1", "c", Stream.CONTROL, 1, b"n" * 32)))
        await asyncio.sleep(0.01)
        a.write(encode_frame(RaftMessages([])) + encode_frame(Payload("k", b"d")))
        with pytest.raises(handshake.HandshakeError, match="expected Proof, got RaftMessages"):
            await acc

    asyncio.run(body())


def test_an_unauthenticated_dialer_cannot_make_the_listener_buffer_much() -> None:
    async def body() -> None:
        a, b = pair()
        rb = handshake.FrameReader(b, FrameDecoder(handshake.MAX_HANDSHAKE_FRAME_BYTES), 65536)
        acc = asyncio.create_task(handshake.accept(b, rb, handshake.Identity("n2", "c", SECRET, os.urandom),
                                                   lambda n: True))
        a.write(preamble() + (10 << 20).to_bytes(4, "big"))
        with pytest.raises(handshake.HandshakeError, match="above the maximum of 4096 bytes"):
            await acc

    asyncio.run(body())


def test_handshake_stream_closed_early_is_a_clear_error() -> None:
    async def body() -> None:
        a, b = pair()
        rb = handshake.FrameReader(b, FrameDecoder(4096), 65536)
        acc = asyncio.create_task(handshake.accept(b, rb, handshake.Identity("n2", "c", SECRET, os.urandom),
                                                   lambda n: True))
        a.write(preamble())
        a.close()
        with pytest.raises(handshake.HandshakeError, match="connection closed during the handshake"):
            await acc

    asyncio.run(body())


# --- the secret file ----------------------------------------------------------------------------


def _write(path: Path, content: bytes, mode: int) -> Path:
    path.write_bytes(content)
    os.chmod(path, mode)
    return path


def test_secret_file_is_read_and_stripped(tmp_path: Path) -> None:
    p = _write(tmp_path / "secret", b"  0123456789abcdef0123\n", 0o600)
    assert auth.read_secret_file(p) == b"0123456789abcdef0123"
    p = _write(tmp_path / "group", b"0123456789abcdef0123", 0o640)
    assert auth.read_secret_file(p) == b"0123456789abcdef0123"


@pytest.mark.parametrize(
    ("content", "mode", "message"),
    [
        (b"0123456789abcdef", 0o644, "accessible to every user (mode 0644); run: chmod 600"),
        (b"0123456789abcdef", 0o602, "accessible to every user"),
        (b"", 0o600, "is empty"),
        (b"  \n", 0o600, "is empty"),
        (b"short", 0o600, "is 5 bytes; use at least 16"),
    ],
)
def test_bad_secret_files_are_refused_with_the_fix(tmp_path: Path, content: bytes, mode: int, message: str) -> None:
    p = _write(tmp_path / "secret", content, mode)
    with pytest.raises(auth.ClusterConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        auth.read_secret_file(p)


def test_missing_secret_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(auth.ClusterConfigError, match="does not exist"):
        auth.read_secret_file(tmp_path / "nope")
    with pytest.raises(auth.ClusterConfigError, match="not a regular file"):
        auth.read_secret_file(tmp_path)


# --- listening without a secret -----------------------------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.11", "::1", "[::1]", "localhost"])
def test_loopback_may_listen_without_a_secret(host: str) -> None:
    auth.require_secret_or_loopback(host, None)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.0.0.5", "node1.example.com"])
def test_anything_else_needs_a_secret(host: str) -> None:
    with pytest.raises(auth.ClusterConfigError, match="without a cluster secret"):
        auth.require_secret_or_loopback(host, None)
    auth.require_secret_or_loopback(host, SECRET)
