"""``moorline certs dev --out DIR``: a self-signed CA, a server certificate and a client certificate,
so that TLS can be tried in one command. For development and tests: the keys are written unencrypted.

Files written to DIR: ``ca.crt`` / ``ca.key`` (the CA), ``server.crt`` / ``server.key`` (for the
``--name`` values: DNS names and IP addresses, as subject alternative names), ``client.crt`` /
``client.key`` (subject CN = ``--client``, the MQTT username under ``tls.use_identity_as_username``),
and ``moorline-tls.toml``, a configuration that serves MQTT over TLS and secure WebSocket with them.

With ``--nodes n1,n2,n3`` it also writes the certificates of a dev cluster's link (cluster TLS,
docs/cluster-transport.md) to ``DIR/cluster/``: a separate cluster CA (``ca.crt`` / ``ca.key``: a
CA only for nodes, so no MQTT client certificate is ever signed by it) and, per node, ``NAME.crt``
/ ``NAME.key`` naming the node by the subject alternative name ``URI:urn:moorline:node:NAME``
(usable to dial and to listen), and ``NAME.toml`` with its ``[cluster.tls]`` keys.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Certificates for TLS listeners.")

DEFAULT_NAMES = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class DevCertificates:
    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    config: Path


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "moorline dev"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _alt_names(names: list[str]) -> list[x509.GeneralName]:
    out: list[x509.GeneralName] = []
    for name in names:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            out.append(x509.DNSName(name))
    return out


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _issue(subject: x509.Name, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
           issuer_key: ec.EllipticCurvePrivateKey, days: int, ca: bool,
           usage: list[x509.ObjectIdentifier], alt_names: list[x509.GeneralName]) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
            decipher_only=False), critical=True)
    else:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_encipherment=False, key_cert_sign=False, crl_sign=False,
            content_commitment=False, data_encipherment=False, key_agreement=True, encipher_only=False,
            decipher_only=False), critical=True)
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        builder = builder.add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
                                        critical=False)
    if alt_names:
        builder = builder.add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def write_dev_certificates(out: Path, names: list[str], client: str = "dev-client", days: int = 825,
                           ca_name: str = "moorline dev CA", ca: tuple[Path, Path] | None = None) -> DevCertificates:
    """Write the files to ``out`` (made if missing). With ``ca`` = (cert, key) of an existing CA
    (e.g. to renew a server certificate), that CA signs and is not replaced."""
    if not names:
        raise ValueError("at least one --name (the host clients connect to)")
    out.mkdir(parents=True, exist_ok=True)
    if ca is None:
        ca_key = _key()
        ca_subject = _name(ca_name)
        ca_cert = _issue(ca_subject, ca_key, ca_subject, ca_key, days, True, [], [])
        _write_key(out / "ca.key", ca_key)
        _write_cert(out / "ca.crt", ca_cert)
    else:
        ca_cert = x509.load_pem_x509_certificate(ca[0].read_bytes())
        loaded = serialization.load_pem_private_key(ca[1].read_bytes(), password=None)
        if not isinstance(loaded, ec.EllipticCurvePrivateKey):
            raise ValueError("the CA key must be an EC key written by moorline certs dev")
        ca_key = loaded
    server_key = _key()
    server = _issue(_name(names[0]), server_key, ca_cert.subject, ca_key, days, False,
                    [ExtendedKeyUsageOID.SERVER_AUTH], _alt_names(names))
    _write_key(out / "server.key", server_key)
    _write_cert(out / "server.crt", server)
    client_key = _key()
    client_cert = _issue(_name(client), client_key, ca_cert.subject, ca_key, days, False,
                         [ExtendedKeyUsageOID.CLIENT_AUTH], [])
    _write_key(out / "client.key", client_key)
    _write_cert(out / "client.crt", client_cert)
    config = out / "moorline-tls.toml"
    config.write_text(
        "# Written by moorline certs dev: MQTT over TLS and secure WebSocket with the dev certificates.\n"
        "[listeners]\n"
        'mqtts = "127.0.0.1:8883"\n'
        'wss = "127.0.0.1:8884"\n\n'
        "[tls]\n"
        f'cert_file = "{(out / "server.crt").resolve()}"\n'
        f'key_file = "{(out / "server.key").resolve()}"\n'
        f'ca_file = "{(out / "ca.crt").resolve()}"\n'
    )
    return DevCertificates(out / "ca.crt", out / "ca.key", out / "server.crt", out / "server.key",
                           out / "client.crt", out / "client.key", config)


def check_node_names(nodes: list[str]) -> None:
    if not nodes:
        raise ValueError("--nodes needs at least one node name")
    for n in nodes:
        if not n or len(n) > 64 or not all(ch.isascii() and (ch.isalnum() or ch in "-_.") for ch in n):
            raise ValueError(f"node name {n!r}: use 1 to 64 letters, digits, '-', '_' and '.'")
    if len(set(nodes)) != len(nodes):
        raise ValueError("--nodes names a node twice")


def write_node_certificates(out: Path, nodes: list[str], days: int = 825) -> dict[str, tuple[Path, Path]]:
    """A cluster CA and one certificate per node in ``out`` (made if missing): {node: (cert, key)}."""
    from moorline.cluster.tls import node_uri

    check_node_names(nodes)
    out.mkdir(parents=True, exist_ok=True)
    ca_key = _key()
    ca_subject = _name("moorline dev cluster CA")
    ca_cert = _issue(ca_subject, ca_key, ca_subject, ca_key, days, True, [], [])
    _write_key(out / "ca.key", ca_key)
    _write_cert(out / "ca.crt", ca_cert)
    made: dict[str, tuple[Path, Path]] = {}
    for n in nodes:
        key = _key()
        cert = _issue(_name(n), key, ca_subject, ca_key, days, False,
                      [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
                      [x509.UniformResourceIdentifier(node_uri(n))])
        _write_key(out / f"{n}.key", key)
        _write_cert(out / f"{n}.crt", cert)
        (out / f"{n}.toml").write_text(
            f"# Written by moorline certs dev --nodes: the cluster link of node {n} over TLS.\n"
            "[cluster.tls]\n"
            f'cert_file = "{(out / f"{n}.crt").resolve()}"\n'
            f'key_file = "{(out / f"{n}.key").resolve()}"\n'
            f'ca_file = "{(out / "ca.crt").resolve()}"\n'
        )
        made[n] = (out / f"{n}.crt", out / f"{n}.key")
    return made


@app.command("dev")
def dev(
    out: Annotated[Path, typer.Option(help="directory to write the files to")],
    name: Annotated[list[str] | None, typer.Option(
        help="a DNS name or IP address the server is reached by (repeat); default: localhost, 127.0.0.1, ::1")] = None,
    client: Annotated[str, typer.Option(help="the client certificate's CN (an MQTT username)")] = "dev-client",
    days: Annotated[int, typer.Option(help="validity in days")] = 825,
    nodes: Annotated[str | None, typer.Option(
        help="also write cluster-link certificates for these nodes (comma-separated, e.g. n1,n2,n3) to OUT/cluster")
    ] = None,
) -> None:
    """Write a self-signed CA, a server certificate for the given names and a client certificate
    (and, with --nodes, a cluster CA and a certificate per node for cluster TLS)."""
    if days < 1:
        typer.echo("moorline certs dev: --days must be 1 or more", err=True)
        raise typer.Exit(2)
    names = list(name) if name else list(DEFAULT_NAMES)
    node_names = [n.strip() for n in nodes.split(",")] if nodes is not None else []
    try:
        if nodes is not None:
            check_node_names(node_names)
        made = write_dev_certificates(out, names, client, days)
        node_certs = write_node_certificates(out / "cluster", node_names, days) if nodes is not None else {}
    except (OSError, ValueError) as exc:
        typer.echo(f"moorline certs dev: {exc}", err=True)
        raise typer.Exit(2) from exc
    if node_certs:
        typer.echo(f"wrote the cluster CA {out / 'cluster' / 'ca.crt'} and node certificates for "
                   f"{', '.join(node_certs)}; node NAME runs with --config {out / 'cluster'}/NAME.toml "
                   "(its [cluster.tls] keys)")
    typer.echo(f"wrote {made.ca_cert} (the CA clients trust), {made.server_cert} for {', '.join(names)}, "
               f"{made.client_cert} (CN={client}) and {made.config}")
    typer.echo(f"try: moorline run --config {made.config}   then   mosquitto_pub -h localhost -p 8883 "
               f"--cafile {made.ca_cert} -t hello -m world")
