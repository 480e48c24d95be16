"""Listeners and the process lifecycle: start the node, accept MQTT connections, serve HTTP, stop."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import signal
import socket
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

from moorline.config import ConfigError, NodeConfig
from moorline.mqtt.codec import MQTT_5, encode
from moorline.mqtt.packets import Disconnect
from moorline.mqtt.reasons import ReasonCode as RC
from moorline.mqtt.topics import TopicBounds
from moorline.node.admin.sys_topics import SysTopics
from moorline.node.edge.auth import Authorizer
from moorline.node.edge.connection import Connection
from moorline.node.edge.control import FailedLoginLog
from moorline.node.edge.drain import (
    Drain,
    Phase,
    advertised_address,
    announcement,
    client_address_of_live_peer,
    close_clients,
    hand_over,
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
        self.sys_topics: SysTopics | None = None  # $SYS subscribers of this node (serve() sets it)
        self.drain: Drain | None = None  # set by serve(): while it drains, CONNECTs are sent elsewhere
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
            self.pending = {c for c in self.pending if c.live is None and not c._closing}
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
    from aiohttp import web

    from moorline.node.admin.http_api import make_app
    from moorline.node.edge.tls import AdmittingListener
    from moorline.node.edge.ws_transport import WebSocketListeners

    by_key = {li.key: li for li in listeners}

    def sock(key: str) -> socket.socket:
        bound = by_key[key].sock
        assert bound is not None
        return bound

    authorizer = Authorizer(cfg.auth, loopback_only=loopback, certificate_identities=cfg.tls.use_identity_as_username)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals: list[str] = []  # the signals that asked us to stop, for the log

    def on_signal(sig: signal.Signals) -> None:
        signals.append(sig.name)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):  # from the start: a stop during start-up is a clean exit
        try:
            loop.add_signal_handler(sig, on_signal, sig)
        except NotImplementedError:  # pragma: no cover
            pass
    node = Node(cfg, faults)
    if not await _open_unless_stopped(node, stop):  # a cluster node also connects to its peers and bootstraps here
        log.info("stopped by %s during start-up (before the node was open): nothing to hand over, exit 0",
                 signals[0] if signals else "a signal")
        authorizer.close()
        return 0
    await node.start()
    tune_gc(cfg.runtime)
    tune_allocator(cfg.runtime)
    server = MqttServer(node, authorizer)
    server.sys_topics = SysTopics(node, authorizer, cfg.sys.interval_s,
                                  open_to_all=not authorizer.rules and authorizer.allow_anonymous and loopback,
                                  max_filters_per_connection=cfg.session.max_subscriptions)
    handshake_s = cfg.mqtt.connect_timeout_s
    servers: list[asyncio.AbstractServer] = []
    servers.append(await loop.create_server(server.protocol_factory, sock=sock("mqtt"), backlog=BACKLOG))
    accepting: list[AdmittingListener] = []  # listeners that admit a socket before its handshake or upgrade
    if "mqtts" in by_key:
        accepting.append(AdmittingListener(server, sock("mqtts"), tls, lambda conn: conn))
    drain = Drain(cfg.cluster.drain_timeout_s, node.clock.monotonic)
    server.drain = drain
    drain.on_begin.append(stop.set)
    client_address = node.client_address = advertised_address(node, by_key["mqtt"].bound())
    if node.link is not None:
        link = node.link
        http_address = advertised_address(node, by_key["http"].bound(), advertise=False)
        link.announce_extra = lambda: announcement(node, drain, client_address, http_address)
        drain.on_begin.append(link.announce_now)  # the peers stop sending clients here at once
        link.on_drain_request = lambda peer: _drain_asked(drain, f"asked through {peer} (POST /v1/drain)")
    # shutdown_timeout: open requests (a long fetch, a WebSocket) get shutdown_drain_s to finish, not aiohttp's 60 s
    http_runner = web.AppRunner(make_app(node, authorizer, http_auth, drain), access_log=None,
                                shutdown_timeout=cfg.shutdown_drain_s)
    await http_runner.setup()
    await web.SockSite(http_runner, sock("http"), backlog=BACKLOG).start()
    if "https" in by_key:
        assert tls is not None and http_runner.server is not None
        servers.append(await loop.create_server(http_runner.server, sock=sock("https"), ssl=tls.listening,
                                                ssl_handshake_timeout=handshake_s, backlog=BACKLOG))
    ws_runner: web.AppRunner | None = None
    if "ws" in by_key or "wss" in by_key:
        ws = WebSocketListeners(server)
        ws_runner = web.AppRunner(ws.app, access_log=None, handle_signals=False, shutdown_timeout=cfg.shutdown_drain_s)
        await ws_runner.setup()
        ws.handlers = ws_runner.server
        for key, ctx in (("ws", None), ("wss", tls)):
            if key in by_key:
                accepting.append(AdmittingListener(server, sock(key), ctx, ws.make_protocol, ws.on_expired))
    for listener in accepting:
        listener.start()
    # SIGHUP re-reads the TLS certificates (if any) and the password and token files; never stops the node.
    loop.add_signal_handler(signal.SIGHUP, _on_sighup, tls, authorizer)

    async def watch_fatal() -> None:
        await node.stopping.wait()
        stop.set()

    watcher = asyncio.create_task(watch_fatal())
    node.supervisor.spawn("loop-lag-watcher", server.watch_loop_lag, critical=False)
    node.supervisor.spawn("sys-topics", server.sys_topics.run, critical=False)
    edge_tasks = ["loop-lag-watcher", "sys-topics"]
    if cfg.auth.credentials_poll_s > 0 and (cfg.auth.password_file or cfg.auth.token_file):
        node.supervisor.spawn("credentials-watcher",
                              lambda: authorizer.watch_credentials(cfg.auth.credentials_poll_s), critical=False)
        edge_tasks.append("credentials-watcher")
    bound = " ".join(f"{li.key}={li.bound()[0]}:{li.bound()[1]}" for li in listeners)
    print(f"moorline ready {bound}", flush=True)
    log.info("data dir %s, %d shards", cfg.data_dir, node.shard_count)
    await stop.wait()
    watcher.cancel()
    await node.supervisor.stop(edge_tasks)
    if node.fatal is None:
        drain.request(signals[0] if signals else "stop")  # a no-op when POST /v1/drain began it
        await _drain(node, server, drain)
    log.info("stopping%s: closing listeners and connections", f" ({drain.reason or signals[0]})"
             if drain.reason or signals else "")
    for srv in servers:
        srv.close()
    for listener in accepting:
        listener.close()
    # Cluster: hand every leadership to a caught-up peer while this node's clients are still
    # connected, so their in-flight publishes commit and are acknowledged (bounded).
    # (After a drain: only what came back since, within the drain's time.)
    handover_s = min(cfg.shutdown_drain_s, 3.0)
    if drain.draining:
        handover_s = max(0.1, min(handover_s, drain.remaining(drain.deadline) / 2))
    if node.link is not None:
        await hand_over(node, handover_s)
    for conn in list(server.connections):
        if conn.version == MQTT_5 and not conn._closing and conn.live is not None:
            conn._write(encode(Disconnect(RC.SERVER_SHUTTING_DOWN), MQTT_5))
        conn.abort("server shutting down")
    await asyncio.sleep(0.05)
    await _wait_for_session_closes(node, server, min(cfg.shutdown_drain_s, 2.0))
    if ws_runner is not None:
        await ws_runner.cleanup()
    await http_runner.cleanup()
    authorizer.close()
    await node.stop()
    if node.fatal is not None:
        print(f"moorline: fatal: {node.fatal}", file=sys.stderr, flush=True)
        return 1
    return 0


async def _wait_for_session_closes(node: Node, server: MqttServer, timeout_s: float) -> None:
    """Waits, at most ``timeout_s``, for what closing the connections started: each connection's
    session close (a committed SessionClose, then its will or the session's end) and the cleanups
    they left running (node.background), so a restart finds those sessions disconnected as of now.
    Not for the node's long-lived loops, which end only with ``node.stop()``."""
    clock = node.clock
    deadline = clock.monotonic() + timeout_s
    # A connection proposes its close when its transport reports the loss, a loop turn after the
    # abort (a TLS or WebSocket one after its closing handshake).
    while any(conn.live is not None for conn in server.connections) and clock.monotonic() < deadline:
        await asyncio.sleep(0.01)
    while clock.monotonic() < deadline:
        pending: list[asyncio.Task[Any]] = [*node.lifecycle.unfinished_closes(), *node.background]
        if not pending:
            return
        await asyncio.wait(pending, timeout=max(0.0, deadline - clock.monotonic()))


def _drain_asked(drain: Drain, reason: str) -> None:
    if drain.request(reason):
        log.info("drain %s", reason)


async def _drain(node: Node, server: MqttServer, drain: Drain) -> None:
    """The drain (node/edge/drain.py): CONNECTs are refused from now on; every leadership is handed
    over while the clients are connected; then each connection stops being read and is closed once
    what it sent is answered (MQTT 5: DISCONNECT 0x9C naming a live peer). Within the drain's time."""
    t0 = node.clock.monotonic()
    in_cluster = node.link is not None
    log.info("draining (%s): new connections are sent to other nodes; handing leaderships over, then closing "
             "%d connections once their publishes are answered (within %.0f s, cluster.drain_timeout_s)",
             drain.reason, len(server.connections), drain.timeout_s)
    if in_cluster and not await hand_over(node, max(0.1, drain.remaining() / 2)):
        log.info("drain: no peer left to take a leadership over (all down or draining)")
    drain.advance(Phase.CLOSING_CLIENTS)
    await close_clients(list(server.connections), drain, server.client_address_of_live_peer, in_cluster)
    drain.advance(Phase.STOPPING)
    log.info("drained in %.2f s: %d connections closed once answered, %d at the deadline", node.clock.monotonic() - t0,
             drain.clients_closed, drain.clients_cut)


async def _open_unless_stopped(node: Node, stop: asyncio.Event) -> bool:
    """``node.open_async()``, abandoned when ``stop`` is set first (a cluster node waits up to
    cluster.bootstrap_timeout_s for its peers): then what it opened is closed and False returned."""
    opening = asyncio.ensure_future(node.open_async())
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({opening, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if opening.done():
        # Its errors (a data dir in use, a bootstrap timeout) end start-up as before. Opened (a stop
        # that came meanwhile is served next): the node stops the ordinary way, final snapshots taken.
        opening.result()
        return True
    opening.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await opening
    if node.link is not None:
        await node.link.close()
    node.wal.close()  # no-ops when prepare had not opened or acquired them
    node.dir_lock.release()
    return False


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
