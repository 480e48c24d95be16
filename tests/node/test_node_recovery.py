"""Whole-node durability: snapshots + WAL reclaim across kill -9, and checksum failures that must
be reported (never silently truncated)."""

from __future__ import annotations

import base64
import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from moorline.broker import commands as c
from moorline.broker.messages import StoredMessage
from moorline.hashing import guid128, shard_of
from moorline.storage.wal import WriteAheadLog, segment_name
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


PAGE = 4096


def _http_json(port: int, path: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def _stored_payloads(port: int, shard: int) -> list[bytes]:
    status, body = _http_json(port, f"/v1/shards/{shard}/messages?from=0&max=10000")
    assert status == 200, body
    return [base64.b64decode(m["payload"]) for m in body["messages"]]


def _unfinished_group_commit(wal_dir: Path, shard: int, topic: str, count: int) -> tuple[Path, int, list[int]]:
    """After a kill: one more group commit of ``count`` publishes to ``shard`` whose write reached
    the file but whose fdatasync never returned. Returns (segment, where the write starts, where
    each entry's record starts)."""
    w = WriteAheadLog(wal_dir)
    rec = w.open()
    g = rec.groups[shard]
    last = g.entries[-1] if g.entries else None
    term, index = (last.term, last.index) if last is not None else (g.hard_state.term, g.snapshot_index)  # type: ignore[union-attr]
    w.sync()  # the restarted node's first sync: a new segment, its checkpoints
    assert w._fd is not None
    seg, start = wal_dir / segment_name(w._fd_seq), w._fd_length
    starts = []
    for i in range(count):
        msg = StoredMessage(topic, f"torn-{i:03d}-".encode() * 40, 1, False, guid128("torn", i), 1)
        starts.append(w._seg_size)
        w.append_entries(shard, [(term, index + 1 + i, 0, c.encode_entry([c.Publish(msg)]))])
    ((_, chunk),) = w._pending
    os.pwrite(w._fd, bytes(chunk), start)  # written, never synced
    os.close(w._fd)  # the power goes
    return seg, start, starts


def _zero_page(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(bytes(PAGE))


def test_a_page_hole_in_the_last_group_commit_is_a_torn_tail_not_corruption(tmp_path: Path) -> None:
    """A power loss left one 4 KiB page of the last group commit's write unwritten while later
    pages of it arrived. Nothing in that write was acknowledged: the node starts, everything
    acknowledged is there, the records from the hole on are gone, and the log says so (today's
    code refused to start: "record header fails its checksum and valid records follow")."""
    node = NodeProcess(tmp_path / "data").start()
    try:
        topic = "power/t"
        shard = shard_of(topic, 16)
        acked = [f"acked-{i}".encode() for i in range(50)]
        _publish(node.mqtt_port, topic, acked)
        node.kill()
        seg, start, starts = _unfinished_group_commit(tmp_path / "data" / "wal", shard, topic, 30)
        hole = (start // PAGE + 2) * PAGE  # the write's third page; later pages of it arrived
        _zero_page(seg, hole)
        first_lost = max(i for i, s in enumerate(starts) if s <= hole)
        assert 0 < first_lost < 25

        node.start()
        stored = _stored_payloads(node.http_port, shard)
        torn = [f"torn-{i:03d}-".encode() * 40 for i in range(30)]
        assert stored == acked + torn[:first_lost]  # acknowledged all there; the torn ones from the hole on gone
        log = node.log.read_text()
        assert "torn tail truncated" in log and seg.name in log and "sync batch" in log
        assert "Traceback" not in log
        status, health = _http_json(node.http_port, "/v1/health")
        assert status == 200 and health["ok"], health
        assert node.stop() == 0
    finally:
        if node.proc and node.proc.poll() is None:
            node.kill()


def test_a_page_hole_in_an_earlier_synced_group_commit_is_still_corruption(tmp_path: Path) -> None:
    """The same hole in data whose fdatasync returned (a later group commit follows it) is
    corruption: the shard whose record it hit stops, or, where the hole took a record's header,
    the node refuses to start; either way naming the file and offset, never truncating."""
    node = NodeProcess(tmp_path / "data").start()
    try:
        topic = "power/t"
        shard = shard_of(topic, 16)
        _publish(node.mqtt_port, topic, [f"acked-{i}".encode() * 50 for i in range(60)])
        node.kill()
        seg, _start, _starts = _unfinished_group_commit(tmp_path / "data" / "wal", shard, topic, 30)
        earlier = sorted((tmp_path / "data" / "wal").glob("wal-*.log"))[0]
        assert earlier != seg and earlier.stat().st_size > 3 * PAGE
        size = earlier.stat().st_size
        _zero_page(earlier, PAGE)
        try:
            node.start(timeout=20)
        except RuntimeError:
            log = node.log.read_text()
            assert "refusing to start" in log and earlier.name in log and "offset" in log
        else:
            status, health = _http_json(node.http_port, "/v1/health")
            assert status == 503 and list(health["failed_shards"]) == [str(shard)], health
            assert earlier.name in health["failed_shards"][str(shard)] and "offset" in health["failed_shards"][str(shard)]
            assert node.stop() == 0
        assert earlier.stat().st_size == size  # never truncated
    finally:
        if node.proc and node.proc.poll() is None:
            node.kill()


@pytest.mark.parametrize("unsafe", [False])
def test_clean_stop_exits_zero(tmp_path: Path, unsafe: bool) -> None:
    node = NodeProcess(tmp_path / "data").start()
    _publish(node.mqtt_port, "x", [b"1"])
    assert node.stop() == 0
