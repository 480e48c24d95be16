"""Listener sockets, bound before anything else happens.

``moorline run`` binds every configured listener first and opens the data directory only once all of
them are its own: a port in use stops start-up naming the listener (``--http 127.0.0.1:8888 is in
use``) and leaves no data directory behind. The bound sockets are then handed to the asyncio and
aiohttp servers (``create_server(sock=...)``, ``SockSite``).
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass

from moorline.config import ConfigError, NodeConfig

BACKLOG = 1024

# (config key, how start-up errors name it, TLS?): the two with command-line flags by their flag.
LISTENER_KINDS: tuple[tuple[str, str, bool], ...] = (
    ("mqtt", "--mqtt", False),
    ("http", "--http", False),
    ("mqtts", "listeners.mqtts", True),
    ("https", "listeners.https", True),
    ("ws", "listeners.ws", False),
    ("wss", "listeners.wss", True),
)


class ListenerUnavailable(OSError):
    """A listener's address cannot be bound; the message names the listener."""


@dataclass
class Listener:
    key: str  # listeners.<key>
    name: str  # as errors name it
    host: str
    port: int
    tls: bool
    sock: socket.socket | None = None

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"

    def bound(self) -> tuple[str, int]:
        assert self.sock is not None
        addr = self.sock.getsockname()
        return str(addr[0]), int(addr[1])


def parse_hostport(value: str, what: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"{what} must be HOST:PORT, not {value!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def configured(cfg: NodeConfig) -> list[Listener]:
    """The listeners the configuration asks for, parsed (ConfigError on a malformed address)."""
    out = []
    for key, name, tls in LISTENER_KINDS:
        value = getattr(cfg.listeners, key)
        if value:
            host, port = parse_hostport(value, name)
            out.append(Listener(key, name, host, port, tls))
    return out


def bind_all(listeners: list[Listener]) -> None:
    """Bind and listen on every socket, or none: ListenerUnavailable naming the first that failed."""
    try:
        for listener in listeners:
            listener.sock = _bind(listener)
    except BaseException:
        close_all(listeners)
        raise


def close_all(listeners: list[Listener]) -> None:
    for listener in listeners:
        if listener.sock is not None:
            listener.sock.close()
            listener.sock = None


def _bind(listener: Listener) -> socket.socket:
    try:
        infos = socket.getaddrinfo(listener.host, listener.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ListenerUnavailable(f"{listener.name} {listener.where}: unknown host ({exc.strerror})") from exc
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        # As asyncio's create_server does: a restart may bind while old connections are in TIME_WAIT.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.listen(BACKLOG)  # listening now: the port is ours (a bound, idle socket could still be shared)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ListenerUnavailable(f"{listener.name} {listener.where} is in use") from exc
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ListenerUnavailable(f"{listener.name} {listener.where}: no such address on this machine") from exc
        if exc.errno == errno.EACCES:
            raise ListenerUnavailable(f"{listener.name} {listener.where}: permission denied (ports below 1024 "
                                      "need privileges)") from exc
        raise ListenerUnavailable(f"{listener.name} {listener.where}: cannot listen: {exc.strerror}") from exc
    return sock
