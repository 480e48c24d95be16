"""Listeners and the process lifecycle: start the node, accept MQTT connections, serve HTTP, stop."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
import socket
import sys
from collections import OrderedDict
from pathlib import Path

from moorline.config import ConfigError, NodeConfig
from moorline.mqtt.topics import TopicBounds
from moorline.node.admin.sys_topics import SysTopics
from moorline.node.edge.auth import Authorizer
from moorline.node.edge.connection import Connection
from moorline.node.edge.control import FailedLoginLog
from moorline.node.edge.drain import (
    Drain,
    client_address_of_live_peer,
)
from moorline.node.edge.listeners import BACKLOG, Listener, bind_all, close_all, configured
from moorline.node.edge.listeners import parse_hostport as parse_hostport
from moorline.node.edge.tls import TlsContexts
from moorline.node.node import Node
from moorline.node.runtime import tune_allocator, tune_gc
from moorline.testing.faults import NO_FAULTS, Faults

log = logging.getLogger("moorline.server")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def http_auth_required(cfg: NodeConfig, http_host: str, loopback_only: bool) -> bool:
    """Whether every HTTP route needs credentials: when anonymous clients are not allowed (an unset
    ``auth.allow_anonymous`` allows them only while every listener is on loopback), or the HTTP
    listener is reachable from other hosts. Raises ConfigError, before anything is created, for an
    HTTP listener off loopback that would serve anyone."""
    auth = cfg.auth
    if is_loopback(http_host):
        return not (auth.allow_anonymous if auth.allow_anonymous is not None else loopback_only)
    if auth.allow_anonymous:
        raise ConfigError(f"refusing to serve HTTP on {http_host} with auth.allow_anonymous = true: anyone who "
                          "can reach it could read every message and publish; bind --http to a loopback address "
                          "or leave allow_anonymous unset")
    if not auth.password_file and not auth.token_file:
        raise ConfigError(f"refusing to serve HTTP on {http_host} without authentication: set auth.password_file "
                          "(HTTP Basic) or auth.token_file (bearer tokens), or bind --http to a loopback address")
    return True


def rate_key(host: str) -> str:
    """The address a connection rate is counted for: the IP, or for IPv6 its /64 (one host
    usually has a whole /64, so counting single IPv6 addresses would limit nothing)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if ip.version == 6:
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False).network_address)
    return str(ip)


class ConnectionRateLimiter:
    """A token bucket per address: ``burst`` connections at once, refilled at ``rate`` a second.
    At most ``max_addresses`` buckets are kept, the least recently seen forgotten first (a
    forgotten address starts again with a full bucket: memory stays bounded under a flood from
    many addresses, where a per-address limit could not help anyway). Time comes from the caller."""

    def __init__(self, rate: float, burst: int, max_addresses: int) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.max_addresses = max_addresses
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # address -> (tokens, as of)

    def __len__(self) -> int:
        return len(self._buckets)

    def allow(self, address: str, now: float) -> bool:
        """Take one token for ``address``; False (nothing taken) when it has none left."""
        bucket = self._buckets.pop(address, None)
        if bucket is None:
            tokens = self.burst
            if len(self._buckets) >= self.max_addresses:
                self._buckets.popitem(last=False)
        else:
            tokens = min(self.burst, bucket[0] + (now - bucket[1]) * self.rate)
        allowed = tokens >= 1.0
        self._buckets[address] = (tokens - 1.0 if allowed else tokens, now)  # now the most recently seen
        return allowed


REFUSAL_LOG_INTERVAL_S = 10.0  # refused connections are logged at most this often (a flood floods no log)


class SourceLog:
    """Lines a client's misbehaviour causes, limited per source address (``rate_key``): a token
    bucket of ``per_minute`` lines refilled over a minute. ``allow`` says whether to log now and how
    many lines from that source were left out since the last one it allowed; the limit is the source's,
    never the text's (a client chooses its text, not its address). At most ``max_sources`` tracked."""

    def __init__(self, per_minute: int, max_sources: int = 10_000) -> None:
        self.per_minute = float(per_minute)
        self.max_sources = max_sources
        self._sources: OrderedDict[str, list[float]] = OrderedDict()  # key -> [tokens, as of, left out]

    def allow(self, host: str, now: float) -> tuple[bool, int]:
        key = rate_key(host)
        entry = self._sources.pop(key, None)
        if entry is None:
            if len(self._sources) >= self.max_sources:
                self._sources.popitem(last=False)
            entry = [self.per_minute, now, 0.0]
        entry[0] = min(self.per_minute, entry[0] + (now - entry[1]) * self.per_minute / 60.0)
        entry[1] = now
        self._sources[key] = entry
        if entry[0] < 1.0:
            entry[2] += 1
            return False, 0
        entry[0] -= 1.0
        left_out, entry[2] = int(entry[2]), 0.0
        return True, left_out


class MqttServer:
    def __init__(self, node: Node, authorizer: Authorizer) -> None:
        self.node = node
        self.authorizer = authorizer
        # Insertion-ordered (not a set): a drain or a lag pause goes through connections in the order
        # they came, the same in every run (the simulator replays a seed exactly), not by object address.
        self.connections: dict[Connection, None] = {}
        lcfg = node.cfg.listeners
        self.max_connections = lcfg.max_connections
        self.reading_paused = False
        mcfg = node.cfg.mqtt
        self.topic_bounds = TopicBounds(mcfg.max_topic_levels, mcfg.max_topic_length)
        # Connections that have not completed CONNECT. Ones that have (``live`` set) or closed are
        # pruned only when the cap is reached: connection.py needs no hook for either, and the set
        # stays bounded by the cap.
        self.pending: set[Connection] = set()
        self.max_pending = lcfg.max_pending_connections
        self.rate_limiter = ConnectionRateLimiter(
            lcfg.max_connection_rate_per_address, lcfg.connection_burst_per_address,
            lcfg.rate_limit_tracked_addresses) if lcfg.max_connection_rate_per_address > 0 else None
        self.rate_limit_loopback = lcfg.rate_limit_loopback
        self.refused: dict[str, int] = {"rate": 0, "pending": 0}  # connections refused, by cause
        self._refusals_unlogged = 0
        self._refusal_logged_at = -REFUSAL_LOG_INTERVAL_S
        self.sys_topics: SysTopics | None = None  # $SYS subscribers of this node (node/assembly.py sets it)
        self.drain: Drain | None = None  # set by node/assembly.py: while it drains, CONNECTs are sent elsewhere
        self.failed_logins = FailedLoginLog(node.cfg.log.failed_login_interval_s, node.clock.monotonic)
        self.client_log = SourceLog(node.cfg.log.per_source_lines_per_minute)

    def log_client(self, logger: logging.Logger, level: int, host: str, msg: str, *args: object) -> None:
        """Log a line a client caused, within its source's budget (SourceLog); %r its values."""
        if not logger.isEnabledFor(level):
            return
        allowed, left_out = self.client_log.allow(host, self.node.clock.monotonic())
        if allowed:
            if left_out:
                msg += f" ({left_out} more lines from this address left out)"
            logger.log(level, msg, *args)

    def client_address_of_live_peer(self, client_id: str) -> str | None:
        """Where to send a client of this node that it will not serve (MQTT 5 Server Reference)."""
        return client_address_of_live_peer(self.node, client_id, self.node.clock.monotonic())

    def protocol_factory(self) -> Connection:
        return Connection(self)

    def admit(self, conn: Connection, host: str) -> bool:
        """A new socket from ``host``: within its address's connection rate and the cap on
        connections that have not completed CONNECT? Counts it as pending when it is."""
        if conn in self.pending:
            return True  # admitted at accept, before its TLS handshake or WebSocket upgrade (node/edge/tls.py)
        now = self.node.clock.monotonic()
        limiter = self.rate_limiter
        if (limiter is not None and (self.rate_limit_loopback or not is_loopback(host))
                and not limiter.allow(rate_key(host), now)):
            return self._refuse("rate", host, now)
        if len(self.pending) >= self.max_pending:
            self.pending = {c for c in self.pending if c.live is None and not c.closing}
            if len(self.pending) >= self.max_pending:
                return self._refuse("pending", host, now)
        self.pending.add(conn)
        return True

    def _refuse(self, cause: str, host: str, now: float) -> bool:
        self.refused[cause] += 1
        self._refusals_unlogged += 1
        if now - self._refusal_logged_at >= REFUSAL_LOG_INTERVAL_S:
            what = ("connection rate of this address over listeners.max_connection_rate_per_address"
                    if cause == "rate" else
                    f"{self.max_pending} connections without a completed CONNECT (listeners.max_pending_connections)")
            log.warning("refusing connections: %s (latest from %s; %d refused since the last such line)",
                        what, host, self._refusals_unlogged)
            self._refusal_logged_at = now
            self._refusals_unlogged = 0
        return False

    async def watch_loop_lag(self) -> None:
        """When the event loop lags past the threshold, stop reading MQTT sockets until it recovers."""
        loop = asyncio.get_running_loop()
        threshold = self.node.cfg.loop_lag_threshold_ms / 1000
        interval = 0.1
        while True:
            t0 = loop.time()
            await asyncio.sleep(interval)
            lag = loop.time() - t0 - interval
            if lag > threshold and not self.reading_paused:
                log.warning("event loop lag %.0f ms: pausing reads", lag * 1000)
                self.reading_paused = True
                for conn in self.connections:
                    conn.set_reading(False)
            elif lag < threshold / 2 and self.reading_paused:
                self.reading_paused = False
                for conn in self.connections:
                    conn.set_reading(True)


async def serve(cfg: NodeConfig, faults: Faults = NO_FAULTS) -> int:
    """Bind every listener, then open the node, serve until SIGINT/SIGTERM (or a fatal error), stop.
    SIGHUP re-reads the TLS certificates (new handshakes use them, open connections stay) and the
    password and token files (new logins use them)."""
    listeners = configured(cfg)
    loopback = all(is_loopback(li.host) for li in listeners)
    http_auth = False
    for li in listeners:  # refuses an open non-loopback HTTP(S) listener
        if li.key in ("http", "https"):
            http_auth = http_auth_required(cfg, li.host, loopback) or http_auth
    tls = TlsContexts(cfg.tls) if any(li.tls for li in listeners) else None  # unreadable certificates: stop here
    bind_all(listeners)  # a port in use stops us here, before the data directory is touched
    try:
        from moorline.storage.dirlock import check_private

        if (changed := check_private(Path(cfg.data_dir), cfg.storage.allow_group_read)) is not None:
            log.info("%s", changed)
    except BaseException:
        close_all(listeners)
        raise
    try:
        return await _serve_bound(cfg, faults, listeners, loopback, http_auth, tls)
    finally:
        close_all(listeners)


async def _serve_bound(cfg: NodeConfig, faults: Faults, listeners: list[Listener], loopback: bool, http_auth: bool,
                       tls: TlsContexts | None) -> int:
    """The real process around the node's assembly (node/assembly.py, which builds, starts and
    stops the node and its edge): signals, the bound sockets, TLS and WebSocket listeners."""
    from aiohttp import web

    from moorline.node.assembly import NodeAssembly
    from moorline.node.edge.tls import AdmittingListener
    from moorline.node.edge.ws_transport import WebSocketListeners

    by_key = {li.key: li for li in listeners}

    def sock(key: str) -> socket.socket:
        bound = by_key[key].sock
        assert bound is not None
        return bound

    asm = NodeAssembly(cfg, faults, loopback_only=loopback, http_auth=http_auth)
    loop = asyncio.get_running_loop()
    signals: list[str] = []  # the signals that asked us to stop, for the log

    def on_signal(sig: signal.Signals) -> None:
        signals.append(sig.name)
        asm.stop_asked.set()

    for sig in (signal.SIGINT, signal.SIGTERM):  # from the start: a stop during start-up is a clean exit
        try:
            loop.add_signal_handler(sig, on_signal, sig)
        except NotImplementedError:  # pragma: no cover
            pass
    # a cluster node also connects to its peers and bootstraps here
    if not await asm.start(by_key["mqtt"].bound(), by_key["http"].bound()):
        log.info("stopped by %s during start-up (before the node was open): nothing to hand over, exit 0",
                 signals[0] if signals else "a signal")
        return 0
    node, server, http_runner = asm.node, asm.server, asm.http_runner
    assert http_runner is not None and http_runner.server is not None
    tune_gc(cfg.runtime)
    tune_allocator(cfg.runtime)
    handshake_s = cfg.mqtt.connect_timeout_s
    servers: list[asyncio.AbstractServer] = []
    servers.append(await loop.create_server(server.protocol_factory, sock=sock("mqtt"), backlog=BACKLOG))
    accepting: list[AdmittingListener] = []  # listeners that admit a socket before its handshake or upgrade
    if "mqtts" in by_key:
        accepting.append(AdmittingListener(server, sock("mqtts"), tls, lambda conn: conn))
    await web.SockSite(http_runner, sock("http"), backlog=BACKLOG).start()
    if "https" in by_key:
        assert tls is not None
        servers.append(await loop.create_server(http_runner.server, sock=sock("https"), ssl=tls.listening,
                                                ssl_handshake_timeout=handshake_s, backlog=BACKLOG))
    runners: list[web.AppRunner] = []
    if "ws" in by_key or "wss" in by_key:
        ws = WebSocketListeners(server)
        ws_runner = web.AppRunner(ws.app, access_log=None, handle_signals=False, shutdown_timeout=cfg.shutdown_drain_s)
        await ws_runner.setup()
        runners.append(ws_runner)
        ws.handlers = ws_runner.server
        for key, ctx in (("ws", None), ("wss", tls)):
            if key in by_key:
                accepting.append(AdmittingListener(server, sock(key), ctx, ws.make_protocol, ws.on_expired))
    for listener in accepting:
        listener.start()
    # SIGHUP re-reads the TLS certificates (if any) and the password and token files; never stops the node.
    loop.add_signal_handler(signal.SIGHUP, _on_sighup, tls, asm.authorizer)

    bound = " ".join(f"{li.key}={li.bound()[0]}:{li.bound()[1]}" for li in listeners)
    print(f"moorline ready {bound}", flush=True)
    log.info("data dir %s, %d shards", cfg.data_dir, node.shard_count)
    await asm.wait_for_stop()

    def close_listeners() -> None:
        for srv in servers:
            srv.close()
        for listener in accepting:
            listener.close()

    await asm.shutdown(signals[0] if signals else "stop", close_listeners, runners)
    if node.fatal is not None:
        print(f"moorline: fatal: {node.fatal}", file=sys.stderr, flush=True)
        return 1
    return 0


def _on_sighup(tls: TlsContexts | None, authorizer: Authorizer) -> None:
    if authorizer.cfg.password_file or authorizer.cfg.token_file:
        authorizer.reload("SIGHUP")
    if tls is not None:
        _reload_tls(tls)
    else:
        log.info("SIGHUP: no TLS listener, no certificates to reload")


def _reload_tls(tls: TlsContexts) -> None:
    try:
        tls.reload()
    except ConfigError as exc:
        log.error("SIGHUP: TLS certificates not reloaded, the previous ones stay in use: %s", exc)
        return
    log.info("SIGHUP: TLS certificates reloaded from %s (new connections use them)", tls.cfg.cert_file)
