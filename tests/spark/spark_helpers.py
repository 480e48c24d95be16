"""Helpers of the Spark tests: a moorline handle (real node or fake), failpoints, waits, MQTT."""

from __future__ import annotations

import base64
import json
import os
import re
import selectors
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fake_broker import FakeBroker

FAILPOINT_DIR = tempfile.mkdtemp(prefix="moorline-spark-failpoints-")
# Must be in the environment before the JVM starts, so Python workers inherit it.
os.environ["MOORLINE_SPARK_FAILPOINTS"] = FAILPOINT_DIR

READY = re.compile(r"moorline ready mqtt=(\S+) http=(\S+)")
node_status: dict[str, str] = {}


def arm_failpoint(name: str) -> Path:
    p = Path(FAILPOINT_DIR) / name
    p.touch()
    return p


@dataclass
class Broker:
    """What a test needs from a moorline: an HTTP address, maybe an MQTT one, maybe fake hooks."""

    http: str
    mqtt: str | None
    fake: FakeBroker | None
    kind: str

    def request(self, method: str, path: str, doc: Any = None) -> Any:
        data = None if doc is None else json.dumps(doc).encode()
        req = urllib.request.Request(f"http://{self.http}{path}", data=data, method=method)
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())

    def publish(self, items: list[tuple[str, bytes]]) -> list[dict[str, Any]]:
        msgs = [{"topic": t, "payload": base64.b64encode(p).decode(), "qos": 1} for t, p in items]
        results = self.request("POST", "/v1/publish", {"messages": msgs})["results"]
        assert all(r["status"] == "ok" for r in results), results
        return list(results)

    def read_all(self, prefix: str) -> list[dict[str, Any]]:
        """Every stored message whose topic starts with ``prefix``, straight from the fetch API."""
        out: list[dict[str, Any]] = []
        for s in self.request("GET", "/v1/shards")["shards"]:
            start = s["low_water"]
            while start < s["next_offset"]:
                doc = self.request("GET", f"/v1/shards/{s['shard']}/messages?from={start}&max=5000")
                if not doc["messages"]:
                    break
                out.extend(m for m in doc["messages"] if m["topic"].startswith(prefix))
                start = doc["messages"][-1]["offset"] + 1
        return out


def start_node(tmp: Path, config_toml: str | None = None) -> tuple[subprocess.Popen[str], str, str] | None:
    cmd = [
        sys.executable,
        "-m",
        "moorline",
        "run",
        "--data-dir",
        str(tmp / "node"),
        "--mqtt",
        "127.0.0.1:0",
        "--http",
        "127.0.0.1:0",
    ]
    if config_toml is not None:
        (tmp / "node.toml").write_text(config_toml)
        cmd += ["--config", str(tmp / "node.toml")]
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(tmp))
    except OSError as exc:
        node_status["why"] = str(exc)
        return None
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.poll() is None:
        if sel.select(timeout=0.5):
            line = proc.stdout.readline()
            m = READY.search(line)
            if m:
                return proc, m.group(1), m.group(2)
    err = ""
    if proc.poll() is None:
        proc.kill()
    else:
        err = (proc.stderr.read() if proc.stderr else "")[-500:]
    proc.wait(timeout=10)
    node_status["why"] = f"node did not print its ready line (exit {proc.returncode}): {err.strip()}"
    return None


def node_works(b: Broker) -> bool:
    try:
        doc = b.request("GET", "/v1/shards")
        b.publish([("moorline-spark-probe/x", b"probe")])
        return bool(doc["shard_count"])
    except Exception as exc:  # the node runs but its HTTP API is not there yet
        node_status["why"] = f"node HTTP API not usable: {exc}"
        return False


def wait_for(cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def wait_query(q: Any, cond: Any, timeout_s: float, what: str) -> None:
    """Like ``wait_for`` but fails at once, with the query's error, if the query died."""

    def check() -> bool:
        if not q.isActive:
            raise AssertionError(f"query stopped while waiting for {what}: {q.exception()}")
        return bool(cond())

    wait_for(check, timeout_s, what)


class MqttCollector:
    """An MQTT 5 subscriber (paho) that records every delivery: (topic, payload, guid property)."""

    def __init__(self, address: str, topic_filter: str) -> None:
        import threading

        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        self.got: list[tuple[str, bytes, str | None]] = []
        self._subscribed = threading.Event()
        host, _, port = address.rpartition(":")
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=f"spark-test-{os.getpid()}-{time.time_ns()}",
            protocol=mqtt.MQTTv5,
        )

        def on_connect(client: Any, userdata: Any, flags: Any, rc: Any, props: Any = None) -> None:
            client.subscribe(topic_filter, qos=1)

        def on_subscribe(client: Any, userdata: Any, mid: Any, rcs: Any, props: Any = None) -> None:
            self._subscribed.set()

        def on_message(client: Any, userdata: Any, msg: Any) -> None:
            guid = None
            for k, v in getattr(msg.properties, "UserProperty", None) or []:
                if k == "guid":
                    guid = v
            self.got.append((msg.topic, bytes(msg.payload), guid))

        self.client.on_connect = on_connect
        self.client.on_subscribe = on_subscribe
        self.client.on_message = on_message
        self.client.connect(host, int(port))
        self.client.loop_start()
        if not self._subscribed.wait(20):
            self.close()
            raise AssertionError("MQTT subscription was not acknowledged")

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()
