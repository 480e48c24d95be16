"""Listeners and the process lifecycle: start the node, accept MQTT connections, serve HTTP, stop."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
import sys
import time
from collections import OrderedDict
from typing import Any

from moorline.config import ConfigError, NodeConfig
from moorline.mqtt.codec import MQTT_5, encode
from moorline.mqtt.packets import Disconnect
from moorline.mqtt.reasons import ReasonCode as RC
from moorline.mqtt.topics import TopicBounds
from moorline.node.auth import Authorizer
from moorline.node.connection import Connection
from moorline.node.node import Node
from moorline.node.runtime import tune_allocator, tune_gc
from moorline.testing.faults import NO_FAULTS, Faults

log = logging.getLogger("moorline.server")


def parse_hostport(value: str, what: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"{what} must be HOST:PORT, not {value!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


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


class MqttServer:
    def __init__(self, node: Node, authorizer: Authorizer) -> None:
        self.node = node
        self.authorizer = authorizer
        self.connections: set[Connection] = set()
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

    def protocol_factory(self) -> Connection:
        return Connection(self)

    def admit(self, conn: Connection, host: str) -> bool:
        """A new socket from ``host``: within its address's connection rate and the cap on
        connections that have not completed CONNECT? Counts it as pending when it is."""
        now = time.monotonic()
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
    mqtt_host, mqtt_port = parse_hostport(cfg.listeners.mqtt, "--mqtt")
    http_host, http_port = parse_hostport(cfg.listeners.http, "--http")
    loopback = is_loopback(mqtt_host) and is_loopback(http_host)
    http_auth = http_auth_required(cfg, http_host, loopback)  # refuses an open non-loopback HTTP listener
    authorizer = Authorizer(cfg.auth, loopback_only=loopback)
    node = Node(cfg, faults)
    await node.open_async()  # a cluster node also connects to its peers and bootstraps here
    await node.start()
    tune_gc(cfg.runtime)
    tune_allocator(cfg.runtime)
    server = MqttServer(node, authorizer)
    loop = asyncio.get_running_loop()
    mqtt = await loop.create_server(server.protocol_factory, mqtt_host, mqtt_port, backlog=1024)
    mqtt_bound = mqtt.sockets[0].getsockname()
    from moorline.node.http_api import start_http

    http_runner, http_bound = await start_http(node, authorizer, http_auth, http_host, http_port)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except NotImplementedError:  # pragma: no cover
            pass

    async def watch_fatal() -> None:
        await node.stopping.wait()
        stop.set()

    watcher = asyncio.create_task(watch_fatal())
    lag_watcher = asyncio.create_task(server.watch_loop_lag())
    print(f"moorline ready mqtt={mqtt_bound[0]}:{mqtt_bound[1]} http={http_bound[0]}:{http_bound[1]}", flush=True)
    log.info("data dir %s, %d shards", cfg.data_dir, node.shard_count)
    await stop.wait()
    watcher.cancel()
    lag_watcher.cancel()
    log.info("stopping: closing listeners and connections")
    mqtt.close()
    # Cluster: hand every leadership to a caught-up peer while this node's clients are still
    # connected, so their in-flight publishes commit and are acknowledged (bounded).
    await node.hand_over_leadership(timeout_s=min(cfg.shutdown_drain_s, 3.0))
    for conn in list(server.connections):
        if conn.version == MQTT_5 and not conn._closing and conn.live is not None:
            conn._write(encode(Disconnect(RC.SERVER_SHUTTING_DOWN), MQTT_5))
        conn.abort("server shutting down")
    await asyncio.sleep(0.05)
    pending: list[Any] = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    # Let session closes (committed SessionClose) finish, bounded.
    if pending:
        await asyncio.wait(pending, timeout=min(cfg.shutdown_drain_s, 2.0))
    await http_runner.cleanup()
    authorizer.close()
    await node.stop()
    if node.fatal is not None:
        print(f"moorline: fatal: {node.fatal}", file=sys.stderr, flush=True)
        return 1
    return 0
