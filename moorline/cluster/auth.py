"""Peer authentication with a shared cluster secret: pure functions, no IO but reading the secret file.

The handshake (driven by ``moorline.cluster.handshake``) is a mutual challenge-response:

    dialer   -> Hello(node, cluster id, stream, version, dialer nonce)
    listener -> Challenge(node, listener nonce)
    dialer   -> Proof(HMAC(secret, transcript ‖ "dialer"))
    listener -> Proof(HMAC(secret, transcript ‖ "listener"))

where the transcript binds a fixed context, the cluster id, the stream, both node names and both
nonces. The secret never goes on the wire. Each side checks a proof over a nonce it drew itself
for this connection, so a proof recorded on one connection fails on any other; the role in the
MAC keeps a listener's proof from being reflected back as a dialer's. The listener proves itself
only after the dialer has, so an unauthenticated caller cannot use a listener as an oracle.

Without a secret the same handshake runs with an empty key: it still catches a wrong cluster id
or a node answering on the wrong address, but proves nothing, which is why a listener without a
secret may bind to loopback only (``require_secret_or_loopback``).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import stat
import struct
from pathlib import Path
from typing import Final

from moorline.config import ConfigError

NONCE_BYTES: Final = 32
MIN_NONCE_BYTES: Final = 16  # a peer's nonce shorter than this is refused as malformed
MIN_SECRET_BYTES: Final = 16
MAX_SECRET_BYTES: Final = 4096
CONTEXT: Final = b"moorline cluster peer auth v1"
DIALER: Final = b"dialer"
LISTENER: Final = b"listener"
_FIELD_LEN = struct.Struct(">I")


class ClusterConfigError(ConfigError):
    """The cluster secret or the cluster listener's address is unusable; the message says why."""


def transcript(
    cluster_id: str, stream: int, dialer: str, listener: str, dialer_nonce: bytes, listener_nonce: bytes
) -> bytes:
    """Everything a proof vouches for, each field length-prefixed so no two transcripts collide."""
    parts = [
        CONTEXT,
        cluster_id.encode(),
        str(int(stream)).encode(),
        dialer.encode(),
        listener.encode(),
        dialer_nonce,
        listener_nonce,
    ]
    return b"".join(_FIELD_LEN.pack(len(p)) + p for p in parts)


def make_proof(secret: bytes | None, transcript_bytes: bytes, role: bytes) -> bytes:
    return hmac.new(secret or b"", transcript_bytes + _FIELD_LEN.pack(len(role)) + role, hashlib.sha256).digest()


def check_proof(secret: bytes | None, transcript_bytes: bytes, role: bytes, mac: bytes) -> bool:
    return hmac.compare_digest(make_proof(secret, transcript_bytes, role), mac)


# --- the secret file ----------------------------------------------------------------------------


def read_secret_file(path: str | Path) -> bytes:
    """The cluster secret: the file's bytes without surrounding whitespace (so ``echo`` works).

    Refused, with the reason and the fix: a missing or unreadable file, a directory, an empty or
    short secret (< 16 bytes), and a file that every user may read or write (any "other" permission
    bit): such a secret lets any local user join the cluster, read every message and write any.
    Group permissions are allowed, for deployments that share a service group.
    """
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise ClusterConfigError(f"cluster secret file {p} does not exist (create it with: "
                                 f"head -c 32 /dev/urandom | base64 > {p} && chmod 600 {p})") from None
    except OSError as exc:
        raise ClusterConfigError(f"cannot read cluster secret file {p}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ClusterConfigError(f"cluster secret file {p} is not a regular file")
    if os.name == "posix" and st.st_mode & 0o007:
        raise ClusterConfigError(
            f"cluster secret file {p} is accessible to every user (mode {stat.S_IMODE(st.st_mode):04o}); "
            f"run: chmod 600 {p}"
        )
    if st.st_size > MAX_SECRET_BYTES:
        raise ClusterConfigError(f"cluster secret file {p} holds {st.st_size} bytes; a secret is at most "
                                 f"{MAX_SECRET_BYTES} bytes (is this the right file?)")
    try:
        secret = p.read_bytes().strip()
    except OSError as exc:
        raise ClusterConfigError(f"cannot read cluster secret file {p}: {exc.strerror or exc}") from None
    if not secret:
        raise ClusterConfigError(f"cluster secret file {p} is empty")
    if len(secret) < MIN_SECRET_BYTES:
        raise ClusterConfigError(
            f"cluster secret in {p} is {len(secret)} bytes; use at least {MIN_SECRET_BYTES} "
            f"(e.g. head -c 32 /dev/urandom | base64 > {p})"
        )
    return secret


# --- listening without a secret -----------------------------------------------------------------


def is_loopback_host(host: str) -> bool:
    """``localhost`` or a loopback IP literal. Any other name is not trusted to stay on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def require_secret_or_loopback(host: str, secret: bytes | None) -> None:
    """Raise ClusterConfigError when a cluster listener on ``host`` would accept anyone: without a
    secret the handshake proves nothing, so only a loopback address keeps other machines out."""
    if secret is None and not is_loopback_host(host):
        raise ClusterConfigError(
            f"refusing to listen for cluster peers on {host or '*'} without a cluster secret or cluster TLS: any machine "
            "that can reach it could join the cluster; set cluster.tls.cert_file, key_file and ca_file "
            "(moorline certs dev --nodes writes a dev set) or use loopback cluster addresses"
        )


def require_tls_or_loopback(hosts: list[str]) -> None:
    """Raise ClusterConfigError unless every cluster address (the listener's and every peer's) is
    loopback: the shared-secret mode authenticates only the handshake and binds no node name to the
    secret, so it is fit only for a cluster whose links never leave this machine."""
    off = [h or "*" for h in hosts if not is_loopback_host(h)]
    if off:
        raise ClusterConfigError(
            f"refusing to run the cluster link without TLS: {off[0]} is not a loopback address, and the "
            "shared-secret mode is only for clusters on one machine (it authenticates the handshake, not "
            "the frames after it, and any holder of the secret could act as any node); use cluster TLS: "
            "set cluster.tls.cert_file, key_file and ca_file on every node (moorline certs dev --nodes "
            "n1,n2,n3 writes a dev set)"
        )
