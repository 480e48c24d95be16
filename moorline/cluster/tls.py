"""The cluster link over TLS with mutual certificates: contexts, and the node name a certificate proves.

Every node holds a certificate signed by the cluster CA (``cluster.tls.ca_file``) and presents it on
both sides of every connection (it dials and it listens). A certificate names its node by a URI
subject alternative name ``urn:moorline:node:<name>`` (exactly one such name; the subject CN is not
used). A URI, not the CN or a DNS name, so that a certificate issued by the same CA for another
purpose (an MQTT client certificate, whose CN is a user name; a web server's DNS name) can never
pass for a node. Host names are not checked: the peer is who its certificate names, wherever it
connects from, and the transport then refuses a dialer whose Hello claims another name and a
listener whose certificate names another node than the one dialled.

A CRL file (``cluster.tls.crl_file``) revokes node certificates (checked for the leaf).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from moorline.cluster.auth import ClusterConfigError

NODE_URI_PREFIX: Final = "urn:moorline:node:"


def node_uri(name: str) -> str:
    return NODE_URI_PREFIX + name


@dataclass(frozen=True, slots=True)
class ClusterTls:
    """The two contexts of a node: ``server`` for connections it accepts, ``client`` for those it dials."""

    server: ssl.SSLContext
    client: ssl.SSLContext


def _readable(path: str, what: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise ClusterConfigError(f"cluster.tls.{what} {p} does not exist or is not a file")
    return str(p)


def load_cluster_tls(cert_file: str, key_file: str, ca_file: str, crl_file: str | None = None) -> ClusterTls:
    """Contexts for the cluster link; ClusterConfigError (naming the file and the reason) when the
    files cannot be used. Both sides require the peer's certificate, signed by ``ca_file``."""
    cert = _readable(cert_file, "cert_file")
    key = _readable(key_file, "key_file")
    ca = _readable(ca_file, "ca_file")
    crl = _readable(crl_file, "crl_file") if crl_file else None
    contexts: list[ssl.SSLContext] = []
    for purpose in (ssl.Purpose.CLIENT_AUTH, ssl.Purpose.SERVER_AUTH):
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if purpose is ssl.Purpose.CLIENT_AUTH else ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.check_hostname = False  # the node name in the certificate is checked instead (module doc)
        ctx.verify_mode = ssl.CERT_REQUIRED
        try:
            ctx.load_cert_chain(cert, key)
        except (ssl.SSLError, OSError) as exc:
            raise ClusterConfigError(f"cannot use cluster.tls.cert_file {cert} with key_file {key}: {exc}") from None
        try:
            ctx.load_verify_locations(cafile=ca)
        except (ssl.SSLError, OSError) as exc:
            raise ClusterConfigError(f"cannot use cluster.tls.ca_file {ca}: {exc}") from None
        if crl is not None:
            try:
                ctx.load_verify_locations(cafile=crl)
            except (ssl.SSLError, OSError) as exc:
                raise ClusterConfigError(f"cannot use cluster.tls.crl_file {crl}: {exc}") from None
            ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
        contexts.append(ctx)
    own = _own_node_names(contexts[0], cert)
    if len(own) != 1:
        raise ClusterConfigError(
            f"cluster.tls.cert_file {cert} must name exactly one node by a subject alternative name "
            f"URI:{NODE_URI_PREFIX}<node name> (it names {len(own)}); moorline certs dev --nodes writes such "
            "certificates")
    return ClusterTls(server=contexts[0], client=contexts[1])


def _own_node_names(ctx: ssl.SSLContext, cert_file: str) -> list[str]:
    # ssl has no parser for a certificate that is not a peer's; cryptography is a dependency already.
    from cryptography import x509

    with open(cert_file, "rb") as f:
        cert = x509.load_pem_x509_certificate(f.read())
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [u[len(NODE_URI_PREFIX):] for u in san.get_values_for_type(x509.UniformResourceIdentifier)
            if u.startswith(NODE_URI_PREFIX)]


def cert_node_name(cert_file: str) -> str | None:
    """The node a certificate file names (for the startup check that it is this node's own)."""
    names = _own_node_names(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), cert_file)
    return names[0] if len(names) == 1 else None


def peer_node_name(peercert: dict[str, Any] | None) -> str | None:
    """The node name a verified peer certificate (``SSLObject.getpeercert()``) proves, or None when
    it names no node or more than one."""
    if not peercert:
        return None
    names = [value[len(NODE_URI_PREFIX):] for kind, value in peercert.get("subjectAltName", ())
             if kind == "URI" and isinstance(value, str) and value.startswith(NODE_URI_PREFIX)]
    return names[0] if len(names) == 1 else None
