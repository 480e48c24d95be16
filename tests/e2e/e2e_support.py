"""Client-side helpers for the end-to-end suite: paho wrapper, mosquitto_pub/sub runners, waits."""

from __future__ import annotations

import queue
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

TIMEOUT_S = 10.0


def wait_until(cond: Callable[[], bool], timeout: float = TIMEOUT_S, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval)
    return cond()


def props(packet_type: int, **kw: Any) -> Properties:
    """Properties(PacketTypes.X) from keyword names like MessageExpiryInterval=5, UserProperty=[(k, v)]."""
    p = Properties(packet_type)
    for k, v in kw.items():
        setattr(p, k, v)
    return p


def publish_props(**kw: Any) -> Properties:
    return props(PacketTypes.PUBLISH, **kw)


def connect_props(**kw: Any) -> Properties:
    return props(PacketTypes.CONNECT, **kw)


class Paho:
    """A paho-mqtt client driven synchronously: connect, subscribe and publish wait for their acks."""

    def __init__(self, port: int, client_id: str = "", version: int = 5, clean: bool = True,
                 session_expiry: int | None = None, connect_properties: Properties | None = None,
                 will: tuple[str, bytes, int, bool] | None = None, will_properties: Properties | None = None,
                 username: str | None = None, password: str | None = None, keepalive: int = 60,
                 host: str = "127.0.0.1") -> None:
        self.version = version
        self.host, self.port = host, port
        proto = mqtt.MQTTv5 if version == 5 else mqtt.MQTTv311
        kwargs: dict[str, Any] = {"callback_api_version": CallbackAPIVersion.VERSION2, "client_id": client_id,
                                  "protocol": proto}
        if version != 5:
            kwargs["clean_session"] = clean
        self.client = mqtt.Client(**kwargs)
        self.clean = clean
        self.keepalive = keepalive
        self.connect_properties = connect_properties
        if version == 5 and session_expiry is not None:
            self.connect_properties = self.connect_properties or connect_props()
            self.connect_properties.SessionExpiryInterval = session_expiry
        if will is not None:
            self.client.will_set(will[0], will[1], will[2], will[3], properties=will_properties)
        if username is not None:
            self.client.username_pw_set(username, password)
        self.messages: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
        self.connack: threading.Event = threading.Event()
        self.connack_rc: Any = None
        self.connack_flags: Any = None
        self.connack_props: Any = None
        self.disconnected = threading.Event()
        self.disconnect_rc: Any = None
        self._subacks: dict[int, list[Any]] = {}
        self._unsubacks: dict[int, Any] = {}
        self._pubacks: dict[int, Any] = {}
        self._cv = threading.Condition()
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self.client.on_subscribe = self._on_subscribe
        self.client.on_unsubscribe = self._on_unsubscribe
        self.client.on_publish = self._on_publish
        self.client.on_disconnect = self._on_disconnect
        self.client.reconnect_delay_set(1, 1)

    # ---- callbacks (paho network thread)

    def _on_connect(self, client: Any, userdata: Any, flags: Any, rc: Any, properties: Any) -> None:
        self.connack_rc, self.connack_flags, self.connack_props = rc, flags, properties
        self.connack.set()

    def _on_message(self, client: Any, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        self.messages.put(msg)

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, rcs: Any, properties: Any) -> None:
        with self._cv:
            self._subacks[mid] = list(rcs)
            self._cv.notify_all()

    def _on_unsubscribe(self, client: Any, userdata: Any, mid: int, rcs: Any, properties: Any) -> None:
        with self._cv:
            self._unsubacks[mid] = rcs
            self._cv.notify_all()

    def _on_publish(self, client: Any, userdata: Any, mid: int, rc: Any, properties: Any) -> None:
        with self._cv:
            self._pubacks[mid] = rc
            self._cv.notify_all()

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, rc: Any, properties: Any) -> None:
        self.disconnect_rc = rc
        self.disconnected.set()

    # ---- operations

    def connect(self, timeout: float = TIMEOUT_S, expect_success: bool = True) -> Any:
        kwargs: dict[str, Any] = {"keepalive": self.keepalive}
        if self.version == 5:
            kwargs["clean_start"] = self.clean
            kwargs["properties"] = self.connect_properties
        self.connack.clear()
        self.client.connect(self.host, self.port, **kwargs)
        self.client.loop_start()
        assert self.connack.wait(timeout), "no CONNACK"
        if expect_success:
            assert not self.connack_rc.is_failure, f"CONNACK {self.connack_rc}"
        return self.connack_rc

    @property
    def session_present(self) -> bool:
        return bool(self.connack_flags.session_present)

    def _wait(self, table: dict[int, Any], mid: int, timeout: float) -> Any:
        with self._cv:
            ok = self._cv.wait_for(lambda: mid in table, timeout)
            assert ok, f"no ack for mid {mid}"
            return table.pop(mid)

    def subscribe(self, topic: str, qos: int = 0, options: SubscribeOptions | None = None,
                  properties: Properties | None = None, timeout: float = TIMEOUT_S) -> list[Any]:
        if self.version == 5:
            opts = options or SubscribeOptions(qos=qos)
            rc, mid = self.client.subscribe(topic, options=opts, properties=properties)
        else:
            rc, mid = self.client.subscribe(topic, qos)
        assert rc == mqtt.MQTT_ERR_SUCCESS and mid is not None, rc
        return self._wait(self._subacks, mid, timeout)  # type: ignore[no-any-return]

    def unsubscribe(self, topic: str, timeout: float = TIMEOUT_S) -> Any:
        rc, mid = self.client.unsubscribe(topic)
        assert rc == mqtt.MQTT_ERR_SUCCESS and mid is not None, rc
        return self._wait(self._unsubacks, mid, timeout)

    def publish(self, topic: str, payload: bytes | str, qos: int = 0, retain: bool = False,
                properties: Properties | None = None, timeout: float = TIMEOUT_S) -> Any:
        """Publish and wait until the flow completes (PUBACK / PUBCOMP); returns paho's reason code."""
        info = self.client.publish(topic, payload, qos, retain, properties=properties)
        assert info.rc == mqtt.MQTT_ERR_SUCCESS, info.rc
        return self._wait(self._pubacks, info.mid, timeout)

    def get(self, timeout: float = TIMEOUT_S) -> mqtt.MQTTMessage:
        try:
            return self.messages.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no message within {timeout}s") from None

    def collect(self, n: int, timeout: float = TIMEOUT_S) -> list[mqtt.MQTTMessage]:
        deadline = time.monotonic() + timeout
        out: list[mqtt.MQTTMessage] = []
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                out.append(self.messages.get(timeout=left))
            except queue.Empty:
                break
        return out

    def drain(self, quiet: float = 0.5) -> list[mqtt.MQTTMessage]:
        """Everything that arrives until `quiet` seconds pass without a message."""
        out: list[mqtt.MQTTMessage] = []
        while True:
            try:
                out.append(self.messages.get(timeout=quiet))
            except queue.Empty:
                return out

    def disconnect(self, properties: Properties | None = None) -> None:
        self.client.disconnect(properties=properties) if self.version == 5 else self.client.disconnect()
        self.disconnected.wait(5)
        self.client.loop_stop()


def mosquitto_sub(port: int, topic: str, count: int, *, qos: int = 1, version: str = "311",
                  client_id: str | None = None, persistent: bool = False, session_expiry: int | None = None,
                  timeout_s: int = 20, extra: list[str] | None = None) -> subprocess.Popen[bytes]:
    """Start mosquitto_sub printing 'topic payload' lines; exits after `count` messages or `timeout_s`."""
    cmd = ["mosquitto_sub", "-h", "127.0.0.1", "-p", str(port), "-t", topic, "-q", str(qos), "-v",
           "-C", str(count), "-W", str(timeout_s), "-V", version]
    if client_id:
        cmd += ["-i", client_id]
    if persistent:
        cmd += ["-c"]
    if session_expiry is not None:
        cmd += ["-x", str(session_expiry)]
    cmd += extra or []
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def mosquitto_pub(port: int, topic: str, message: str | None, *, qos: int = 1, version: str = "311",
                  retain: bool = False, extra: list[str] | None = None, stdin_lines: list[str] | None = None,
                  client_id: str | None = None, timeout_s: float = 30) -> subprocess.CompletedProcess[bytes]:
    cmd = ["mosquitto_pub", "-h", "127.0.0.1", "-p", str(port), "-t", topic, "-q", str(qos), "-V", version]
    if client_id:
        cmd += ["-i", client_id]
    if retain:
        cmd += ["-r"]
    data = None
    if stdin_lines is not None:
        cmd += ["-l"]
        data = ("\n".join(stdin_lines) + "\n").encode()
    elif message is None:
        cmd += ["-n"]
    else:
        cmd += ["-m", message]
    cmd += extra or []
    return subprocess.run(cmd, input=data, capture_output=True, timeout=timeout_s)


def sub_lines(proc: subprocess.Popen[bytes], timeout: float = 30) -> list[str]:
    out, err = proc.communicate(timeout=timeout)
    return out.decode().splitlines()


def mosquitto_presubscribe(port: int, topic: str, client_id: str, *, qos: int = 1, version: str = "311",
                           session_expiry: int = 3600) -> None:
    """Create a persistent session subscribed to `topic` (`mosquitto_sub -c -E`: exits once SUBACKed)."""
    cmd = ["mosquitto_sub", "-h", "127.0.0.1", "-p", str(port), "-t", topic, "-q", str(qos), "-c",
           "-i", client_id, "-E", "-V", version]
    if version == "5":
        cmd += ["-x", str(session_expiry)]
    r = subprocess.run(cmd, capture_output=True, timeout=30)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)


class LiveMosquittoSub:
    """A running `mosquitto_sub -v` whose output lines are read as they come.

    ready() publishes probe messages (QoS 0, via `probe`) until the first one is printed, which proves the
    subscription is active; later probe lines are filtered out by `messages()`.
    """

    PROBE = "__probe__"

    def __init__(self, port: int, topic: str, *, qos: int = 0, version: str = "311", timeout_s: int = 30,
                 extra: list[str] | None = None) -> None:
        cmd = ["mosquitto_sub", "-h", "127.0.0.1", "-p", str(port), "-t", topic, "-q", str(qos), "-v",
               "-W", str(timeout_s), "-V", version] + (extra or [])
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.lines: queue.Queue[str] = queue.Queue()
        self._t = threading.Thread(target=self._pump, daemon=True)
        self._t.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.put(raw.decode().rstrip("\n"))

    def ready(self, probe: Callable[[str], None], timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            probe(self.PROBE)
            try:
                line = self.lines.get(timeout=0.2)
                if line.endswith(self.PROBE):
                    return
                raise AssertionError(f"unexpected line before probe: {line!r}")
            except queue.Empty:
                continue
        raise AssertionError(f"mosquitto_sub did not get a probe in {timeout}s")

    def messages(self, n: int, timeout: float = 15.0) -> list[str]:
        out: list[str] = []
        deadline = time.monotonic() + timeout
        while len(out) < n and time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if not line.endswith(self.PROBE):
                out.append(line)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(10)


def collect_group(clients: list[Paho], n: int, timeout: float = TIMEOUT_S, quiet: float = 0.4) -> list[list[Any]]:
    """Messages per client until together they hold `n` (then `quiet` more seconds, to catch extras)."""
    got: list[list[Any]] = [[] for _ in clients]
    deadline = time.monotonic() + timeout
    extra_until: float | None = None
    while True:
        moved = False
        for i, c in enumerate(clients):
            try:
                got[i].append(c.messages.get_nowait())
                moved = True
            except queue.Empty:
                pass
        total = sum(len(g) for g in got)
        now = time.monotonic()
        if total >= n and extra_until is None:
            extra_until = now + quiet
        if (extra_until is not None and now >= extra_until) or now >= deadline:
            return got
        if not moved:
            time.sleep(0.01)
