"""One in-process node serving MQTT on a loopback port, for tests that drive it with raw clients:
built from ``cfg``, started, and stopped again (listener, node, authorizer) however the test ends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from moorline.config import NodeConfig
from moorline.node.edge.auth import Authorizer
from moorline.node.edge.server import MqttServer
from moorline.node.node import Node


@asynccontextmanager
async def served_node(cfg: NodeConfig) -> AsyncIterator[tuple[Node, int]]:
    """(the node, its MQTT port)."""
    node = Node(cfg)
    node.open()
    await node.start()
    authorizer = Authorizer(cfg.auth, loopback_only=True)
    server = await asyncio.get_running_loop().create_server(MqttServer(node, authorizer).protocol_factory,
                                                            "127.0.0.1", 0)
    try:
        yield node, server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await node.stop()
        authorizer.close()
