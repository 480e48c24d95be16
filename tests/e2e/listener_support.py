"""Helpers for the TLS, WebSocket and $SYS end-to-end tests: the extra listeners' ports, dev
certificates, a TLS-capable paho client, and a raw MQTT client over a hand-framed WebSocket whose
frames can split or join MQTT packets anywhere.

The WebSocket client side is written by hand on purpose (the broker side is aiohttp's): only a
client of our own can choose exactly where frames start and end.
"""

from __future__ import annotations

import base64
import os
import re
import socket
import ssl
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from e2e_broker import REPO_ROOT, BrokerProc
from rawclient import RawClient

from moorline.certs import DevCertificates, write_dev_certificates

_READY_LINE = re.compile(r"moorline ready (.*)")


def listener_ports(broker: BrokerProc) -> dict[str, int]:
    """Every listener's port, from the broker's last ``moorline ready`` line."""
    lines = [m.group(1) for m in _READY_LINE.finditer(broker.log_path.read_text(errors="replace"))]
    assert lines, broker.log_tail()
    out = {}
    for item in lines[-1].split():
        key, _, where = item.partition("=")
        out[key] = int(where.rpartition(":")[2])
    return out


def dev_certs(base: Path, name: str = "certs", client: str = "dev-client") -> DevCertificates:
    return write_dev_certificates(base / name, ["localhost", "127.0.0.1"], client=client)


def tls_config(certs: DevCertificates, *, listeners: tuple[str, ...] = ("mqtts",), extra: str = "",
               require_client_cert: bool = False, identity: bool = False, auth: str = "") -> str:
    lines = ["[listeners]"] + [f'{key} = "127.0.0.1:0"' for key in listeners]
    lines += [extra, "[tls]", f'cert_file = "{certs.server_cert}"', f'key_file = "{certs.server_key}"',
              f'ca_file = "{certs.ca_cert}"']
    if require_client_cert:
        lines.append("require_client_cert = true")
    if identity:
        lines.append("use_identity_as_username = true")
    return "\n".join(lines) + "\n" + auth


def client_tls_context(ca: Path, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca))
    if cert is not None:
        ctx.load_cert_chain(str(cert), str(key) if key else None)
    return ctx


def broker_errors(broker: BrokerProc) -> list[str]:
    text = broker.log_path.read_text(errors="replace")
    return [line for line in text.splitlines() if " ERROR " in line or "Traceback" in line]


# --- a raw MQTT client over a hand-framed WebSocket ------------------------------------------------

Framer = Callable[[bytes], list[bytes]]


def one_frame(data: bytes) -> list[bytes]:
    return [data]


def split_every(n: int) -> Framer:
    """Each send as frames of ``n`` bytes: packets split across frames anywhere."""
    return lambda data: [data[i:i + n] for i in range(0, len(data), n)] or [b""]


class WsSocket:
    """Enough of a socket for ``RawClient`` over a WebSocket: each ``sendall`` goes out as the frames
    ``framer`` cuts it into (masked, binary); ``recv`` gives the next binary frame's payload."""

    def __init__(self, host: str, port: int, path: str = "/mqtt", protocol: str | None = "mqtt",
                 tls: ssl.SSLContext | None = None, timeout: float = 10.0) -> None:
        raw = socket.create_connection((host, port), timeout=timeout)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock: Any = tls.wrap_socket(raw, server_hostname=host) if tls is not None else raw
        self.framer: Framer = one_frame
        self.buf = bytearray()
        key = base64.b64encode(os.urandom(16)).decode()
        head = (f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n")
        if protocol is not None:
            head += f"Sec-WebSocket-Protocol: {protocol}\r\n"
        self.sock.sendall((head + "\r\n").encode())
        while b"\r\n\r\n" not in self.buf:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise ConnectionError(f"closed during the upgrade: {bytes(self.buf)!r}")
            self.buf += chunk
        end = self.buf.index(b"\r\n\r\n") + 4
        self.response = bytes(self.buf[:end]).decode(errors="replace")
        del self.buf[:end]
        self.status = int(self.response.split()[1])

    def settimeout(self, t: float | None) -> None:
        self.sock.settimeout(t)

    def setsockopt(self, *args: Any) -> None:
        self.sock.setsockopt(*args)

    def close(self) -> None:
        self.sock.close()

    def send_frame(self, payload: bytes, opcode: int = 0x2) -> None:
        mask = os.urandom(4)
        n = len(payload)
        if n < 126:
            head = struct.pack("!BB", 0x80 | opcode, 0x80 | n)
        elif n < 65536:
            head = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, n)
        else:
            head = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, n)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.sock.sendall(head + mask + masked)

    def sendall(self, data: bytes) -> None:
        for frame in self.framer(data):
            self.send_frame(frame)

    def _read(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionResetError("EOF")
            self.buf += chunk
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def recv_frame(self) -> tuple[int, bytes]:
        b0, b1 = self._read(2)
        n = b1 & 0x7F
        if n == 126:
            (n,) = struct.unpack("!H", self._read(2))
        elif n == 127:
            (n,) = struct.unpack("!Q", self._read(8))
        return b0 & 0x0F, self._read(n)

    def recv(self, _n: int) -> bytes:
        while True:
            opcode, payload = self.recv_frame()
            if opcode in (0x0, 0x2):
                return payload
            if opcode == 0x8:
                return b""  # close frame: EOF for the MQTT client
            if opcode == 0x9:
                self.send_frame(payload, 0xA)  # ping -> pong


def ws_raw_client(port: int, version: int, tls: ssl.SSLContext | None = None) -> tuple[RawClient, WsSocket]:
    """A ``RawClient`` speaking over a WebSocket (its socket replaced by a ``WsSocket``)."""
    ws = WsSocket("127.0.0.1", port, tls=tls)
    assert ws.status == 101, ws.response
    client = RawClient.__new__(RawClient)
    client.version = version
    client.sock = ws  # type: ignore[assignment]
    client.buf = bytearray()
    client.next_pid = 1
    client.closed = False
    client.pending = []
    return client, ws


def wait_log(broker: BrokerProc, needle: str, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if needle in broker.log_path.read_text(errors="replace"):
            return True
        time.sleep(0.05)
    return False


def paho_client(port: int, version: int = 5, *, transport: str = "tcp", tls: ssl.SSLContext | None = None,
                client_id: str = "", username: str | None = None, password: str | None = None) -> Any:
    """The suite's synchronous ``Paho`` wrapper, over TLS and/or WebSocket (paho's own transports)."""
    import paho.mqtt.client as mqtt
    from e2e_support import Paho
    from paho.mqtt.enums import CallbackAPIVersion

    wrapper = Paho(port, client_id=client_id, version=version)
    old = wrapper.client
    kwargs: dict[str, Any] = {"callback_api_version": CallbackAPIVersion.VERSION2, "client_id": client_id,
                              "protocol": mqtt.MQTTv5 if version == 5 else mqtt.MQTTv311, "transport": transport}
    if version != 5:
        kwargs["clean_session"] = True
    client = mqtt.Client(**kwargs)
    for name in ("on_connect", "on_message", "on_subscribe", "on_unsubscribe", "on_publish", "on_disconnect"):
        setattr(client, name, getattr(old, name))
    client.reconnect_delay_set(1, 1)
    if username is not None:
        client.username_pw_set(username, password)
    if tls is not None:
        client.tls_set_context(tls)
    wrapper.client = client
    return wrapper


def run_moorline(tmp_path: Path, args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``moorline run`` on ``tmp_path / "data"`` that is expected to stop by itself (a start-up error)."""
    full_env = {**os.environ, **(env or {}), "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, "-m", "moorline.cli", "run", "--data-dir", str(tmp_path / "data"), *args],
                          capture_output=True, text=True, timeout=60, env=full_env, cwd=str(REPO_ROOT))
