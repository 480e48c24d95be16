"""The per-link relay that makes partitions where iptables cannot: a cut link carries nothing (open
connections stall with their bytes held, new ones are held before being connected onwards), a
healed one delivers everything it held, and other links are untouched."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from moorline.chaos.partition import LinkProxy, NoPartitions, PartitionError, make_partitioner


class EchoServer:
    """Answers every byte with the same byte (a stand-in for a node's cluster listener)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.address = self.sock.getsockname()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(4096):
                conn.sendall(data)


@pytest.fixture
def proxy() -> Iterator[LinkProxy]:
    servers = {name: EchoServer() for name in ("a", "b", "c")}
    p = LinkProxy({name: s.address for name, s in servers.items()})
    try:
        yield p
    finally:
        p.close()
        for s in servers.values():
            s.sock.close()


def _dial(p: LinkProxy, src: str, dst: str) -> socket.socket:
    s = socket.create_connection(p.peer_address(src, dst), timeout=5)
    s.settimeout(0.5)
    return s


def _echoed(s: socket.socket, data: bytes) -> bytes:
    s.sendall(data)
    got = b""
    try:
        while len(got) < len(data):
            chunk = s.recv(4096)
            if not chunk:
                break
            got += chunk
    except TimeoutError:
        pass
    return got


def test_chaos_proxy_cut_holds_bytes_and_heal_delivers_them(proxy: LinkProxy) -> None:
    ab = _dial(proxy, "a", "b")
    ac = _dial(proxy, "a", "c")
    assert _echoed(ab, b"before") == b"before"
    proxy.cut("a", "b")
    assert _echoed(ab, b"during") == b""  # stalled, not refused or reset
    late = _dial(proxy, "b", "a")  # the other direction is cut too: accepted, held
    assert _echoed(late, b"new") == b""
    assert _echoed(ac, b"other link") == b"other link"
    proxy.heal("a", "b")
    ab.settimeout(5)
    late.settimeout(5)
    assert ab.recv(100) == b"during"  # held, then delivered in order: TCP after a partition heals
    assert late.recv(100) == b"new"
    assert proxy.connections("a", "b") == 1 and proxy.connections("b", "a") == 1
    for s in (ab, ac, late):
        s.close()


def test_chaos_proxy_heal_all_and_close(proxy: LinkProxy) -> None:
    proxy.cut("a", "b")
    proxy.cut("b", "c")
    proxy.heal_all()
    s = _dial(proxy, "c", "b")
    s.settimeout(5)
    assert _echoed(s, b"x") == b"x"
    address = proxy.peer_address("c", "b")
    proxy.close()
    with pytest.raises(OSError):
        socket.create_connection(address, timeout=2)
    s.close()


def test_chaos_no_partitions_refuses_to_cut() -> None:
    p = make_partitioner("proxy", {"a": ("127.0.0.1", 1), "b": ("127.0.0.1", 2)}, wanted=False)
    assert isinstance(p, NoPartitions) and p.peer_address("a", "b") == ("127.0.0.1", 2)
    with pytest.raises(PartitionError):
        p.cut("a", "b")
    with pytest.raises(PartitionError, match="one of auto, iptables, proxy"):
        make_partitioner("nftables", {}, wanted=True)
