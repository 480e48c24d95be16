"""Cutting and healing links between the nodes of a chaos cluster.

Two ways, one surface (``Partitioner``):

- ``Firewall``: iptables DROP rules on (node address, cluster port) pairs, in a chain of this
  process's own (``MOORLINE_CHAOS_<pid>``, jumped to from INPUT and OUTPUT), flushed and deleted on
  ``close``. Every node has its own loopback address and leaves from it for its peers (a node binds
  its outgoing connections to the host of its ``--cluster`` address), so a rule matches exactly
  the packets of one link; clients, which connect from 127.0.0.1 to the MQTT ports, are untouched.
  Needs root and the iptables command.
- ``LinkProxy``: one TCP relay per ordered pair of nodes, run by the harness. Node a's
  ``--initial-cluster`` names, for peer b, the relay (a -> b) instead of b itself, so every byte
  from a to b passes through it. Cutting the link stops both relays between a and b from reading
  or forwarding anything (open connections stall with their bytes held, new ones are accepted and
  held before being connected onwards), as dropped packets stall TCP; healing lets them flow
  again. Works anywhere, as any user.

``NoPartitions`` names the peers themselves and refuses to cut (runs without partition faults).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

Address = tuple[str, int]
CHAIN_PREFIX = "MOORLINE_CHAOS_"
IPTABLES_TIMEOUT_S = 30.0
PROXY_CONNECT_TIMEOUT_S = 5.0
PROXY_CALL_TIMEOUT_S = 10.0
PROXY_CHUNK_BYTES = 1 << 16
PARTITION_MODES = ("auto", "iptables", "proxy")

T = TypeVar("T")


class PartitionError(Exception):
    """Partitions cannot be made the way that was asked (no iptables, no root, a failed rule)."""


class Partitioner(Protocol):
    kind: str  # "iptables", "proxy" or "none", for the fault log

    def peer_address(self, src: str, dst: str) -> Address:
        """Where ``src``'s --initial-cluster says ``dst`` is."""
        ...

    def cut(self, a: str, b: str) -> None: ...

    def heal(self, a: str, b: str) -> None: ...

    def heal_all(self) -> None: ...

    def close(self) -> None: ...


class NoPartitions:
    kind = "none"

    def __init__(self, addresses: dict[str, Address]) -> None:
        self.addresses = addresses

    def peer_address(self, src: str, dst: str) -> Address:
        return self.addresses[dst]

    def cut(self, a: str, b: str) -> None:
        raise PartitionError("this run makes no partitions (partition is not among its faults)")

    def heal(self, a: str, b: str) -> None:
        pass

    def heal_all(self) -> None:
        pass

    def close(self) -> None:
        pass


def make_partitioner(mode: str, addresses: dict[str, Address], wanted: bool) -> Partitioner:
    """``mode`` auto / iptables / proxy; ``wanted`` False (no partition faults) gives NoPartitions."""
    if mode not in PARTITION_MODES:
        raise PartitionError(f"partitions are made with one of {', '.join(PARTITION_MODES)}, not {mode!r}")
    if not wanted:
        return NoPartitions(addresses)
    reason = iptables_usable()
    if mode == "iptables" and reason is not None:
        raise PartitionError(f"--partition-with iptables, but iptables cannot be used here: {reason} "
                             "(use --partition-with proxy or auto)")
    if mode == "iptables" or (mode == "auto" and reason is None):
        remove_stale_chains()
        return Firewall(addresses)
    return LinkProxy(addresses)


# ------------------------------------------------------------------------------------------ iptables


def iptables_usable() -> str | None:
    """None when this process can add and remove iptables rules; otherwise why not."""
    if shutil.which("iptables") is None:
        return "the iptables command is not installed"
    if os.geteuid() != 0:
        return "iptables needs root"
    probe = f"{CHAIN_PREFIX}P{os.getpid()}"[:28]
    try:
        r = _ipt("-N", probe, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"iptables cannot run: {exc}"
    if r.returncode != 0:
        return f"iptables cannot create a chain: {r.stderr.strip() or r.stdout.strip()}"
    _ipt("-X", probe, check=False)
    return None


def _ipt(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["iptables", "-w", "5", *args], capture_output=True, text=True,
                       timeout=IPTABLES_TIMEOUT_S)
    if check and r.returncode != 0:
        raise PartitionError(f"iptables {' '.join(args)}: {r.stderr.strip()}")
    return r


def _remove_chain(chain: str) -> None:
    for parent in ("INPUT", "OUTPUT"):
        while _ipt("-D", parent, "-j", chain, check=False).returncode == 0:
            pass
    _ipt("-F", chain, check=False)
    _ipt("-X", chain, check=False)


def remove_stale_chains() -> list[str]:
    """Chains left by chaos runs whose process is gone (killed before it could clean up)."""
    r = _ipt("-S", check=False)
    removed = []
    for chain in sorted(set(re.findall(rf"^-N ({CHAIN_PREFIX}P?(\d+))$", r.stdout, re.MULTILINE))):
        name, pid = chain[0], int(chain[1])
        if pid == os.getpid() or _pid_alive(pid):
            continue
        _remove_chain(name)
        removed.append(name)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Firewall:
    """This process's iptables chain: DROP rules between pairs of nodes' cluster endpoints."""

    kind = "iptables"

    def __init__(self, addresses: dict[str, Address]) -> None:
        self.addresses = addresses
        self.chain = f"{CHAIN_PREFIX}{os.getpid()}"
        self.active = False

    def peer_address(self, src: str, dst: str) -> Address:
        return self.addresses[dst]

    def _ensure(self) -> None:
        if self.active:
            return
        if _ipt("-L", self.chain, "-n", check=False).returncode != 0:
            _ipt("-N", self.chain)
        self.active = True  # from here on close() removes the chain, whatever fails next
        for parent in ("INPUT", "OUTPUT"):
            if _ipt("-C", parent, "-j", self.chain, check=False).returncode != 0:
                _ipt("-I", parent, "1", "-j", self.chain)

    def _rules(self, a: str, b: str) -> list[list[str]]:
        """Every packet between node a and node b: a's connections to b's port and b's to a's."""
        (ha, pa), (hb, pb) = self.addresses[a], self.addresses[b]
        return [
            ["-s", ha, "-d", hb, "-p", "tcp", "--dport", str(pb), "-j", "DROP"],
            ["-s", hb, "-d", ha, "-p", "tcp", "--sport", str(pb), "-j", "DROP"],
            ["-s", hb, "-d", ha, "-p", "tcp", "--dport", str(pa), "-j", "DROP"],
            ["-s", ha, "-d", hb, "-p", "tcp", "--sport", str(pa), "-j", "DROP"],
        ]

    def cut(self, a: str, b: str) -> None:
        self._ensure()
        for rule in self._rules(a, b):
            if _ipt("-C", self.chain, *rule, check=False).returncode != 0:
                _ipt("-A", self.chain, *rule)

    def heal(self, a: str, b: str) -> None:
        if not self.active:
            return
        for rule in self._rules(a, b):
            while _ipt("-D", self.chain, *rule, check=False).returncode == 0:
                pass

    def heal_all(self) -> None:
        if self.active:
            _ipt("-F", self.chain, check=False)

    def close(self) -> None:
        if self.active:
            _remove_chain(self.chain)
            self.active = False


# --------------------------------------------------------------------------------------------- proxy


@dataclass
class _Link:
    """The relay for one ordered pair (src dials dst)."""

    target: Address
    open: asyncio.Event
    server: asyncio.Server | None = None
    address: Address = ("", 0)
    writers: set[asyncio.StreamWriter] = field(default_factory=set)
    connections: int = 0


class LinkProxy:
    """One relay per ordered pair of nodes, served by an event loop on a thread of its own."""

    kind = "proxy"

    def __init__(self, addresses: dict[str, Address]) -> None:
        self.addresses = addresses
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="chaos-link-proxy", daemon=True)
        self._thread.start()
        self._links: dict[tuple[str, str], _Link] = {}
        try:
            for src in addresses:
                for dst, target in addresses.items():
                    if src != dst:
                        self._links[(src, dst)] = self._call(self._listen(target))
        except BaseException:
            self.close()
            raise

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(PROXY_CALL_TIMEOUT_S)

    def peer_address(self, src: str, dst: str) -> Address:
        return self._links[(src, dst)].address

    def connections(self, src: str, dst: str) -> int:
        """How many connections the relay (src -> dst) has accepted so far."""
        return self._links[(src, dst)].connections

    async def _listen(self, target: Address) -> _Link:
        link = _Link(target, asyncio.Event())
        link.open.set()
        # The relay listens on the target's host: only the port differs from the node itself.
        link.server = await asyncio.start_server(lambda r, w: self._serve(link, r, w), target[0], 0)
        sockname = link.server.sockets[0].getsockname()
        link.address = (str(sockname[0]), int(sockname[1]))
        return link

    async def _serve(self, link: _Link, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link.connections += 1
        link.writers.add(writer)
        upstream: asyncio.StreamWriter | None = None
        try:
            await link.open.wait()  # a link cut while this connection came in: held, as a lost SYN
            try:
                up_reader, up_writer = await asyncio.wait_for(
                    asyncio.open_connection(*link.target), PROXY_CONNECT_TIMEOUT_S)
            except (OSError, TimeoutError):
                return  # the node is down: the dialer sees its connection close
            upstream = up_writer
            link.writers.add(up_writer)
            pumps = [asyncio.ensure_future(self._pump(link, reader, up_writer)),
                     asyncio.ensure_future(self._pump(link, up_reader, writer))]
            _done, pending = await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        finally:
            for w in (writer, upstream):
                if w is not None:
                    link.writers.discard(w)
                    w.close()

    @staticmethod
    async def _pump(link: _Link, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while True:
                await link.open.wait()
                data = await reader.read(PROXY_CHUNK_BYTES)
                if not data:
                    return
                await link.open.wait()  # cut while reading: the bytes are held, not lost
                writer.write(data)
                await writer.drain()

    async def _set(self, pairs: list[tuple[str, str]], is_open: bool) -> None:
        for pair in pairs:
            link = self._links[pair]
            if is_open:
                link.open.set()
            else:
                link.open.clear()

    def cut(self, a: str, b: str) -> None:
        self._call(self._set([(a, b), (b, a)], False))

    def heal(self, a: str, b: str) -> None:
        self._call(self._set([(a, b), (b, a)], True))

    def heal_all(self) -> None:
        self._call(self._set(list(self._links), True))

    async def _shutdown(self) -> None:
        for link in self._links.values():
            if link.server is not None:
                link.server.close()
            link.open.set()
            for w in list(link.writers):
                w.close()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        if others:
            await asyncio.wait(others, timeout=PROXY_CALL_TIMEOUT_S / 2)

    def close(self) -> None:
        if not self._loop.is_running():
            return
        with contextlib.suppress(Exception):
            self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(PROXY_CALL_TIMEOUT_S)
        if not self._thread.is_alive():
            self._loop.close()
