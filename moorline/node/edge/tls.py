"""TLS for the listeners: server contexts, certificate reload on SIGHUP, and an acceptor that admits a
socket before its handshake.

- **Contexts.** ``ssl.SSLContext(PROTOCOL_TLS_SERVER)``: Python's secure server defaults (no SSLv3, no
  compression, its cipher list), TLS 1.2 at least. Client certificates are checked against
  ``tls.ca_file`` only, never the system's CAs (a certificate any public CA signed is no login), and
  against ``tls.crl_file`` when set (a revoked certificate fails the handshake).
- **Reload.** An asyncio server keeps the context it was created with, so every listener gets one
  context for good, whose SNI callback (called for every ClientHello, with or without SNI) points the
  handshake at the newest context. ``TlsContexts.reload`` builds a new one from the files; handshakes
  from then on use it, and established connections are untouched. A reload that fails keeps the old.
- **Admission.** asyncio calls a protocol's ``connection_made`` only after the handshake, too late to
  refuse a flood of handshakes (each costs a key exchange). ``AdmittingListener`` accepts the sockets
  itself: it makes the MQTT ``Connection`` and asks ``MqttServer.admit`` (per-address rate, the cap on
  connections without a completed CONNECT) before a byte is read, then has the handshake run within
  ``mqtt.connect_timeout_s``. The WebSocket listeners are served the same way: there the transport
  goes to aiohttp's request handler and the connection is claimed at the upgrade. Until the upgrade,
  the socket's reads are bounded by ``PRE_UPGRADE_BUFFER_BYTES`` (ws_transport.py).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from moorline.config import ConfigError, TlsConfig

if TYPE_CHECKING:
    from moorline.node.edge.connection import Connection
    from moorline.node.edge.server import MqttServer

log = logging.getLogger("moorline.tls")


def server_context(cfg: TlsConfig) -> ssl.SSLContext:
    """A server context from the configured files; ConfigError naming the file that is wrong."""
    if not cfg.cert_file or not cfg.key_file:
        raise ConfigError("TLS needs tls.cert_file and tls.key_file")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
    except FileNotFoundError as exc:
        raise ConfigError(f"tls: cannot read {exc.filename or cfg.cert_file}: no such file") from exc
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"tls: tls.cert_file {cfg.cert_file} and tls.key_file {cfg.key_file} are not a PEM "
                          f"certificate chain and its private key: {exc}") from exc
    if cfg.ca_file:
        try:
            ctx.load_verify_locations(cafile=cfg.ca_file)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(f"tls: tls.ca_file {cfg.ca_file} is not a readable PEM file of CA certificates: "
                              f"{exc}") from exc
        ctx.verify_mode = ssl.CERT_REQUIRED if cfg.require_client_cert else ssl.CERT_OPTIONAL
        if cfg.crl_file:
            try:
                ctx.load_verify_locations(cafile=cfg.crl_file)
            except (ssl.SSLError, OSError) as exc:
                raise ConfigError(f"tls: tls.crl_file {cfg.crl_file} is not a readable PEM certificate revocation "
                                  f"list: {exc}") from exc
            # Client certificates are checked against the CRL (a CA's CRL must be present for it).
            ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
    return ctx


class TlsContexts:
    """The context every TLS listener is created with, and the newest one its handshakes use."""

    def __init__(self, cfg: TlsConfig) -> None:
        self.cfg = cfg
        self.listening = server_context(cfg)
        self.current = self.listening
        self.listening.sni_callback = self._pick
        self.reloads = 0

    def _pick(self, ssl_object: Any, server_name: str | None, context: ssl.SSLContext) -> None:
        current = self.current
        if current is not context:
            ssl_object.context = current  # this handshake goes on with the newest certificate
        return None

    def reload(self) -> None:
        """Read the files again; ConfigError (and the previous context kept) when they are not usable."""
        self.current = server_context(self.cfg)
        self.reloads += 1


def certificate_login(transport: Any, cfg: TlsConfig) -> str | None:
    """The MQTT username a TLS client certificate gives (``tls.use_identity_as_username``): its
    subject's common name; "" for a verified certificate without one (refused); None when the
    connection has no verified client certificate (a plain listener: the password decides)."""
    if not cfg.use_identity_as_username or transport is None:
        return None
    cert = transport.get_extra_info("peercert")
    if not cert:
        return None
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return ""


class AdmittingListener:
    """Accepts the sockets of an MQTT TLS or WebSocket listener itself (module docstring): each is
    admitted with its peer's address before anything is read from it, then wrapped (TLS handshake
    within ``mqtt.connect_timeout_s``) by ``loop.connect_accepted_socket``.

    ``make_protocol(conn)`` gives the protocol that gets the transport: ``conn`` itself for MQTT over
    TLS, aiohttp's request handler for WebSocket (which claims ``conn`` at the upgrade). A socket whose
    ``conn`` has not started (no ``connection_made``) by ``mqtt.connect_timeout_s`` is closed: a
    handshake or HTTP upgrade that never finishes holds nothing for long."""

    def __init__(self, server: MqttServer, sock: socket.socket, tls: TlsContexts | None,
                 make_protocol: Callable[[Connection], asyncio.BaseProtocol],
                 on_expired: Callable[[Connection], None] | None = None) -> None:
        self.server = server
        self.sock = sock
        self.tls = tls
        self.make_protocol = make_protocol
        self.on_expired = on_expired
        self.timeout_s = server.node.cfg.mqtt.connect_timeout_s
        self._task: asyncio.Task[None] | None = None
        self._starting: set[asyncio.Task[None]] = set()
        self._unstarted: dict[Connection, asyncio.BaseTransport] = {}  # wrapped, connection not yet made

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._accept_loop())

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for task in list(self._starting):
            task.cancel()
        self.sock.close()

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                client, address = await loop.sock_accept(self.sock)
            except (ConnectionAbortedError, InterruptedError):
                continue
            except OSError as exc:  # EMFILE and the like: the next accept may succeed once sockets close
                log.warning("accepting a connection failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            self._admit(client, str(address[0]) if address else "")

    def _admit(self, client: socket.socket, host: str) -> None:
        server = self.server
        conn = server.protocol_factory()
        if len(server.connections) >= server.max_connections:
            log.warning("refusing connection from %s: %d connections open", host, len(server.connections))
            conn._closing = True
            client.close()
            return
        if not server.admit(conn, host):  # counted as pending from here: during the handshake too
            conn._closing = True
            client.close()
            return
        task = asyncio.get_running_loop().create_task(self._start(conn, client))
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)

    async def _start(self, conn: Connection, client: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        expiry = loop.call_later(self.timeout_s, self._expire, conn, client)
        try:
            transport, _ = await loop.connect_accepted_socket(
                lambda: self.make_protocol(conn), client,
                ssl=self.tls.listening if self.tls is not None else None,
                ssl_handshake_timeout=self.timeout_s if self.tls is not None else None)
        except (OSError, TimeoutError, ValueError, RuntimeError) as exc:
            # A client that speaks no TLS, distrusts our certificate, has none we accept, or is too
            # slow: its business, logged at debug only (a flood of them floods no log).
            log.debug("TLS handshake failed: %s", exc)
            expiry.cancel()
            conn._closing = True  # leaves the pending set
            client.close()
            return
        except asyncio.CancelledError:
            expiry.cancel()
            client.close()
            raise
        if conn.transport is None and not conn._closing:
            self._unstarted[conn] = transport  # a WebSocket before its upgrade: _expire closes it
        else:
            expiry.cancel()  # MQTT over TLS: the connection's own timers rule from here

    def _expire(self, conn: Connection, client: socket.socket) -> None:
        transport = self._unstarted.pop(conn, None)
        if conn.transport is not None or conn._closing:
            return  # started (its own timers rule now) or already gone
        conn._closing = True  # leaves the pending set
        if self.on_expired is not None:
            self.on_expired(conn)
        log.debug("closing a socket: no MQTT connection within mqtt.connect_timeout_s")
        if transport is not None:
            transport.abort()  # type: ignore[attr-defined]
        else:
            client.close()
