"""Publishers (paho-mqtt, MQTT 5) that record every publish from the client's point of view.

Each publisher sends one message at a time with a fresh ``guid`` user property, waits for its
acknowledgement (PUBACK, or PUBCOMP for QoS 2) up to ``publish_timeout_s``, and records the outcome:
``ok``, ``fail`` (reason code >= 0x80) or ``info`` (timeout or connection lost: indeterminate). An
indeterminate message is retried with the same guid on a new connection, at most ``retries`` times
(the broker de-duplicates by guid, so a retry is safe).
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moorline.chaos.wire import Endpoint
from moorline.verify.history import HistoryWriter


class AckTrigger:
    """A one-shot action run by whichever publisher sees the next successful acknowledgement, on its
    own thread, right inside paho's callback: the tightest moment to crash a node that acks too early."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._action: Callable[[], None] | None = None
        self.fired = threading.Event()

    def arm(self, action: Callable[[], None]) -> None:
        with self._lock:
            self._action = action
            self.fired.clear()

    def fire(self) -> None:
        with self._lock:
            action, self._action = self._action, None
        if action is not None:
            action()
            self.fired.set()

    def disarm(self) -> None:
        with self._lock:
            self._action = None


@dataclass
class Publisher:
    client_id: str
    qos: int
    topics: list[str]
    endpoint: Callable[[], Endpoint]  # asked at every connect: a cluster's clients move between nodes
    history: HistoryWriter
    rng: random.Random
    publish_timeout_s: float = 5.0
    connect_timeout_s: float = 3.0
    interval_s: float = 0.01
    retries: int = 3
    payload_bytes: int = 64
    node: str = "n1"
    ack_trigger: AckTrigger | None = None
    published: int = 0
    acked: int = 0
    _client: Any = None
    _results: dict[int, Any] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _connected: bool = False

    def _rec(self, type: str, op: str, **kw: object) -> None:
        self.history.record(type, op, process=self.client_id, session=self.client_id, node=self.node, **kw)

    # ---------------------------------------------------------------- connection
    def _connect(self) -> bool:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        self._drop_client()
        host, port, self.node = self.endpoint()
        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=self.client_id, protocol=mqtt.MQTTv5)
        connack: dict[str, Any] = {}

        def on_connect(_c: Any, _u: Any, flags: Any, reason: Any, _p: Any) -> None:
            connack["reason"] = reason
            connack["present"] = bool(getattr(flags, "session_present", False))

        def on_publish(_c: Any, _u: Any, mid: int, reason: Any, _p: Any) -> None:
            with self._lock:
                self._results[mid] = reason
            if self.ack_trigger is not None and not getattr(reason, "is_failure", False):
                self.ack_trigger.fire()

        client.on_connect = on_connect
        client.on_publish = on_publish
        self._rec("invoke", "connect", clean_start=True, session_expiry=0)
        try:
            client.connect(host, port, keepalive=20, clean_start=True)
        except OSError as exc:
            self._rec("fail", "connect", reason="refused", detail=str(exc))
            return False
        deadline = time.monotonic() + self.connect_timeout_s
        while "reason" not in connack and time.monotonic() < deadline:
            if client.loop(timeout=0.05) != mqtt.MQTT_ERR_SUCCESS:
                break
        reason = connack.get("reason")
        if reason is None or reason.is_failure:
            self._rec("fail", "connect", reason="timeout" if reason is None else str(reason))
            try:
                client.disconnect()
            except Exception:  # noqa: BLE001 - best effort on a broken connection
                pass
            return False
        self._client = client
        self._connected = True
        self._rec("ok", "connect", session_present=connack["present"])
        return True

    def _drop_client(self, clean: bool = False) -> None:
        if self._client is not None:
            try:
                self._client.disconnect()
                self._client.loop(timeout=0.05)
            except Exception:  # noqa: BLE001 - the socket may already be gone
                pass
            if self._connected:
                self._rec(
                    "ok" if clean else "info", "disconnect", reason=None if clean else "connection lost"
                )
        self._client = None
        self._connected = False
        with self._lock:
            self._results.clear()

    # ---------------------------------------------------------------- publishing
    def _publish_once(self, guid: str, topic: str) -> str:
        """One attempt; returns the recorded outcome type."""
        import paho.mqtt.client as mqtt
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        props = Properties(PacketTypes.PUBLISH)
        props.UserProperty = [("guid", guid)]
        payload = guid.encode() + b"." * max(0, self.payload_bytes - len(guid))
        self._rec("invoke", "publish", guid=guid, topic=topic, qos=self.qos)
        info = self._client.publish(topic, payload, qos=self.qos, properties=props)
        if info.rc != mqtt.MQTT_ERR_SUCCESS:
            self._rec("info", "publish", guid=guid, topic=topic, qos=self.qos, reason=f"send rc={info.rc}")
            self._drop_client()
            return "info"
        deadline = time.monotonic() + self.publish_timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                reason = self._results.pop(info.mid, None)
            if reason is not None:
                failed = getattr(reason, "is_failure", False)
                self._rec(
                    "fail" if failed else "ok",
                    "publish",
                    guid=guid,
                    topic=topic,
                    qos=self.qos,
                    packet_id=info.mid,
                    reason=str(reason) if failed else None,
                )
                return "fail" if failed else "ok"
            if self._client.loop(timeout=0.02) != mqtt.MQTT_ERR_SUCCESS:
                self._rec(
                    "info",
                    "publish",
                    guid=guid,
                    topic=topic,
                    qos=self.qos,
                    packet_id=info.mid,
                    reason="connection lost",
                )
                self._drop_client()
                return "info"
        self._rec(
            "info", "publish", guid=guid, topic=topic, qos=self.qos, packet_id=info.mid, reason="timeout"
        )
        self._drop_client()
        return "info"

    def run(self, stop: Callable[[], bool]) -> None:
        retry: tuple[str, str, int] | None = None  # (guid, topic, attempts so far)
        while not stop():
            if self._client is None and not self._connect():
                time.sleep(0.2)
                continue
            if retry is None:
                guid, topic, attempts = (
                    uuid.UUID(int=self.rng.getrandbits(128)).hex,
                    self.rng.choice(self.topics),
                    0,
                )
                self.published += 1
            else:
                guid, topic, attempts = retry
            outcome = self._publish_once(guid, topic)
            if outcome == "ok":
                self.acked += 1
            retry = (
                (guid, topic, attempts + 1) if outcome == "info" and attempts + 1 <= self.retries else None
            )
            if self._client is not None:
                self._client.loop(timeout=0)
            time.sleep(self.interval_s)
        if self._client is not None:
            self._drop_client(clean=True)


def new_guid(rng: random.Random) -> str:
    return uuid.UUID(int=rng.getrandbits(128)).hex
