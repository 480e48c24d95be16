"""Whole-node durability: snapshots + WAL reclaim across kill -9, and checksum failures that must
be reported (never silently truncated)."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from tests.node.nodeproc import NodeProcess


def _client(cid: str, port: int, clean: bool = False) -> mqtt.Client:
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=cid, clean_session=clean, protocol=mqtt.MQTTv311)
    c.connect("127.0.0.1", port)
    return c


def _collect(port: int, cid: str, topic: str, n: int, timeout: float = 20.0) -> list[bytes]:
    import threading

    got: list[bytes] = []
    done = threading.Event()

    def on_message(_c: object, _u: object, m: mqtt.MQTTMessage) -> None:
        got.append(bytes(m.payload))
        if len(got) >= n:
            done.set()

    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=cid, clean_session=False, protocol=mqtt.MQTTv311)
    c.on_message = on_message
    c.connect("127.0.0.1", port)
    c.subscribe(topic, qos=1)
    c.loop_start()
    done.wait(timeout)
    c.disconnect()
    c.loop_stop()
    return got


def _publish(port: int, topic: str, payloads: list[bytes]) -> None:
    c = _client("pub", port, clean=True)
    c.loop_start()
    infos = [c.publish(topic, p, qos=1) for p in payloads]
    for i in infos:
        i.wait_for_publish(20)
        assert i.is_published()
    c.disconnect()
    c.loop_stop()


def test_snapshots_and_wal_reclaim_survive_kill(tmp_path: Path) -> None:
    cfg = tmp_path / "node.toml"
    cfg.write_text(
        "[shard]\nsnapshot_every_entries = 20\nhousekeeping_interval_s = 0.2\n"
        "[storage]\nwal_segment_bytes = 65536\nstore_segment_bytes = 32768\n"
    )
    node = NodeProcess(tmp_path / "data", cfg).start()
    try:
        sub = _client("keeper", node.mqtt_port)
        sub.subscribe("snap/t", qos=1)
        sub.loop(1.0)
        sub.disconnect()
        payloads = [f"m{i:05d}".encode() * 20 for i in range(1500)]
        _publish(node.mqtt_port, "snap/t", payloads)
        wal_bytes = sum(f.stat().st_size for f in (tmp_path / "data" / "wal").glob("*"))
        for _ in range(50):  # housekeeping snapshots idle groups and reclaims old segments
            time.sleep(0.1)
            segs = list((tmp_path / "data" / "wal").glob("*.log"))
            if len(segs) <= 3:
                break
        assert len(segs) <= 3, f"old WAL segments were not reclaimed ({len(segs)} left, {wal_bytes} bytes)"
        node.kill()
        node.start()
        got = _collect(node.mqtt_port, "keeper", "snap/t", len(payloads))
        assert got == payloads  # every acknowledged message, in order, once
        assert list((tmp_path / "data" / "snapshots").rglob("*")), "snapshots were taken"
        assert node.stop() == 0
    finally:
        if node.proc and node.proc.poll() is None:
            node.kill()


def test_bitflip_in_synced_wal_is_reported_not_truncated(tmp_path: Path) -> None:
    node = NodeProcess(tmp_path / "data").start()
    try:
        payloads = [f"p{i}".encode() * 10 for i in range(200)]
        _publish(node.mqtt_port, "flip/t", payloads)
        node.kill()
        seg = sorted((tmp_path / "data" / "wal").glob("*.log"))[0]
        data = bytearray(seg.read_bytes())
        pos = len(data) // 3
        data[pos] ^= 0x40
        seg.write_bytes(bytes(data))
        try:
            node.start(timeout=20)
        except RuntimeError:
            log = node.log.read_text()
            assert "corrupt" in log.lower() or "checksum" in log.lower()
            assert str(seg.name) in log, "the error names the file"
            return
        req = urllib.request.Request(f"http://127.0.0.1:{node.http_port}/v1/shards")
        shards = json.load(urllib.request.urlopen(req, timeout=5))["shards"]
        failed = [s for s in shards if not s["available"]]
        assert failed, "a checksum failure in synced data must stop the shard"
        assert seg.name in failed[0]["error"]
        print("reported:", failed[0]["error"])
        node.stop()
    finally:
        if node.proc and node.proc.poll() is None:
            node.kill()


@pytest.mark.parametrize("unsafe", [False])
def test_clean_stop_exits_zero(tmp_path: Path, unsafe: bool) -> None:
    node = NodeProcess(tmp_path / "data").start()
    _publish(node.mqtt_port, "x", [b"1"])
    assert node.stop() == 0
