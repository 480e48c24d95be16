"""The composition root of a serving node: ``NodeAssembly`` builds a node and its edge from its
config, faults and Seams, starts it and shuts it down. ``moorline run`` (edge/server.py) and the
cluster simulator (sim/cluster/world.py) both build their nodes here, so what runs in a simulated
node is what runs in production: the node, its authorizer (on the seams' clock), the MQTT server,
``$SYS``, the drain and the cluster link's announce and drain hooks, the loop-lag watcher, the
credentials watcher and the admin HTTP app.

What is not here is about the real process: sockets and listeners (TLS, WebSocket), signals,
process tuning, "moorline ready". The caller binds what this exposes: ``server.protocol_factory``
(MQTT connections) and ``http_runner`` (its ``server`` is the HTTP protocol factory).

    asm = NodeAssembly(cfg, faults, seams, loopback_only=..., http_auth=...)
    if await asm.start((mqtt_host, mqtt_port), http_address):   # False: stopped while opening
        ... bind asm.server.protocol_factory, asm.http_runner ...
        await asm.wait_for_stop()                                 # asked to stop, drained, or fatal
        await asm.shutdown(reason)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from moorline.config import NodeConfig
from moorline.mqtt.codec import MQTT_5
from moorline.mqtt.packets import Disconnect
from moorline.mqtt.reasons import ReasonCode as RC
from moorline.node.admin.http_api import make_app
from moorline.node.admin.sys_topics import SysTopics
from moorline.node.edge.auth import Authorizer
from moorline.node.edge.drain import Drain, Phase, advertised_address, announcement, close_clients, hand_over
from moorline.node.edge.server import MqttServer
from moorline.node.node import Node
from moorline.node.seams import PRODUCTION, Seams
from moorline.testing.faults import NO_FAULTS, Faults

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger("moorline.server")

WAIT_AFTER_ABORT_S = 0.05  # after the connections are aborted, before their closes are waited for
EDGE_TASKS = ("loop-lag-watcher", "sys-topics", "credentials-watcher")


class NodeAssembly:
    """One serving node, whole after ``__init__`` (nothing opened yet): ``start`` opens and starts
    it, ``shutdown`` drains and stops it (bounded as ``moorline run`` is: cluster.drain_timeout_s,
    then shutdown_drain_s for the hand-over and the connections' closes)."""

    def __init__(self, cfg: NodeConfig, faults: Faults = NO_FAULTS, seams: Seams = PRODUCTION, *,
                 loopback_only: bool, http_auth: bool) -> None:
        """``loopback_only``: every listener is on loopback (anonymous clients are allowed unless
        auth.allow_anonymous says otherwise, and $SYS is open to them). ``http_auth``: every HTTP
        route needs credentials (edge/server.py ``http_auth_required``)."""
        self.cfg = cfg
        # Built first: a stop before the node opened closes it (its hashing threads) and nothing else.
        self.authorizer = Authorizer(cfg.auth, loopback_only=loopback_only, clock=seams.clock.monotonic,
                                     certificate_identities=cfg.tls.use_identity_as_username)
        self.node = Node(cfg, faults, seams)
        node, authorizer = self.node, self.authorizer
        self.server = MqttServer(node, authorizer)
        self.sys_topics = self.server.sys_topics = SysTopics(
            node, authorizer, cfg.sys.interval_s,
            open_to_all=not authorizer.rules and authorizer.allow_anonymous and loopback_only,
            max_filters_per_connection=cfg.session.max_subscriptions)
        self.drain = self.server.drain = Drain(cfg.cluster.drain_timeout_s, node.clock.monotonic)
        self.stop_asked = asyncio.Event()  # a signal, a drain (POST /v1/drain, a peer's request), a fatal error
        self.drain.on_begin.append(self.stop_asked.set)
        self.http_app = make_app(node, authorizer, http_auth, self.drain)
        self.http_runner: web.AppRunner | None = None  # set up by ``start``
        self.edge_tasks: list[str] = []  # the supervisor's tasks ``start`` spawned
        self.started = False

    # --- start -----------------------------------------------------------------------------------
    async def start(self, mqtt_address: tuple[str, int], http_address: tuple[str, int] | None) -> bool:
        """Open the node (a cluster node connects to its peers and bootstraps), start it, and start
        the edge: the client address its peers hand out, the link's hooks, the HTTP app's runner,
        the edge's loops under the node's supervisor. ``mqtt_address`` and ``http_address`` are where
        the caller's listeners are bound. False (nothing left open) when a stop was asked first."""
        from aiohttp import web

        node, cfg = self.node, self.cfg
        if not await self._open_unless_stopped():
            self.authorizer.close()
            return False
        await node.start()
        node.client_address = client_address = advertised_address(node, mqtt_address)
        drain = self.drain
        if node.link is not None:
            link = node.link
            http_advertised = (advertised_address(node, http_address, advertise=False)
                               if http_address is not None else None)
            link.announce_extra = lambda: announcement(node, drain, client_address, http_advertised)
            drain.on_begin.append(link.announce_now)  # the peers stop sending clients here at once
            link.on_drain_request = lambda peer: self.request_drain(f"asked through {peer} (POST /v1/drain)")
        # shutdown_timeout: open requests (a long fetch, a WebSocket) get shutdown_drain_s to finish, not aiohttp's 60 s
        self.http_runner = web.AppRunner(self.http_app, access_log=None, handle_signals=False,
                                         shutdown_timeout=cfg.shutdown_drain_s)
        await self.http_runner.setup()
        self._spawn("loop-lag-watcher", self.server.watch_loop_lag)
        self._spawn("sys-topics", self.sys_topics.run)
        if cfg.auth.credentials_poll_s > 0 and (cfg.auth.password_file or cfg.auth.token_file):
            self._spawn("credentials-watcher", lambda: self.authorizer.watch_credentials(cfg.auth.credentials_poll_s))
        self.started = True
        return True

    def _spawn(self, name: str, fn: Callable[[], Any]) -> None:
        self.node.supervisor.spawn(name, fn, critical=False)
        self.edge_tasks.append(name)

    async def _open_unless_stopped(self) -> bool:
        """``node.open_async()``, abandoned when a stop is asked first (a cluster node waits up to
        cluster.bootstrap_timeout_s for its peers): then what it opened is closed and False returned."""
        node = self.node
        opening = asyncio.ensure_future(node.open_async())
        stopping = asyncio.ensure_future(self.stop_asked.wait())
        try:
            await asyncio.wait([opening, stopping], return_when=asyncio.FIRST_COMPLETED)
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

    def request_drain(self, reason: str) -> None:
        if self.drain.request(reason):
            log.info("drain %s", reason)

    async def wait_for_stop(self) -> None:
        """Until a stop is asked (``stop_asked``, a drain) or the node fails (node.stopping)."""
        waits = [asyncio.ensure_future(self.stop_asked.wait()), asyncio.ensure_future(self.node.stopping.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    # --- shutdown --------------------------------------------------------------------------------
    async def shutdown(self, reason: str, close_listeners: Callable[[], None] = lambda: None,
                       runners: Sequence[web.AppRunner] = ()) -> None:
        """Stop the edge's loops; unless the node failed, drain (``reason``: why, for the log and
        GET /v1/drain; a no-op when a drain already began); ``close_listeners`` (the caller's);
        hand the leaderships over while the clients are still connected; DISCONNECT (MQTT 5, 0x8B)
        and abort every connection; wait (bounded) for their sessions' closes; clean up ``runners``
        (the caller's, e.g. WebSocket) then the HTTP app's; stop the node. ``start`` must have
        returned True."""
        node, cfg, drain, server = self.node, self.cfg, self.drain, self.server
        await node.supervisor.stop(self.edge_tasks)
        if node.fatal is None:
            drain.request(reason)
            await self._drain()
        log.info("stopping%s: closing listeners and connections", f" ({drain.reason or reason})"
                 if drain.reason or reason else "")
        close_listeners()
        # Cluster: hand every leadership to a caught-up peer while this node's clients are still
        # connected, so their in-flight publishes commit and are acknowledged (bounded).
        # (After a drain: only what came back since, within the drain's time.)
        handover_s = min(cfg.shutdown_drain_s, 3.0)
        if drain.draining:
            handover_s = max(0.1, min(handover_s, drain.remaining(drain.deadline) / 2))
        if node.link is not None:
            await hand_over(node, handover_s)
        for conn in list(server.connections):
            if conn.version == MQTT_5 and not conn.closing and conn.live is not None:
                conn.send_disconnect(Disconnect(RC.SERVER_SHUTTING_DOWN))
            conn.abort("server shutting down")
        await asyncio.sleep(WAIT_AFTER_ABORT_S)
        await wait_for_session_closes(node, server, min(cfg.shutdown_drain_s, 2.0))
        for runner in runners:
            await runner.cleanup()
        if self.http_runner is not None:
            await self.http_runner.cleanup()
        self.authorizer.close()
        await node.stop()

    async def _drain(self) -> None:
        """The drain (node/edge/drain.py): CONNECTs are refused from now on; every leadership is handed
        over while the clients are connected; then each connection stops being read and is closed once
        what it sent is answered (MQTT 5: DISCONNECT 0x9C naming a live peer). Within the drain's time."""
        node, server, drain = self.node, self.server, self.drain
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
        log.info("drained in %.2f s: %d connections closed once answered, %d at the deadline",
                 node.clock.monotonic() - t0, drain.clients_closed, drain.clients_cut)


async def wait_for_session_closes(node: Node, server: MqttServer, timeout_s: float) -> None:
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
