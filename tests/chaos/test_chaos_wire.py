"""The crash harness's raw MQTT subscriber: what it records must stay true when the broker dies mid-flow."""

from __future__ import annotations

import json
import socket
import struct
from pathlib import Path

import pytest

from moorline.chaos.wire import PUBCOMP, PUBREL, Subscriber, WireError, _packet
from moorline.verify.history import HistoryWriter


def _subscriber(history: HistoryWriter) -> tuple[Subscriber, socket.socket]:
    sub = Subscriber("q2b", lambda: ("127.0.0.1", 1), history, [])
    mine, broker = socket.socketpair()
    sub._sock = mine
    sub.connected = True
    return sub, broker


def test_pubrel_keeps_the_packet_id_held_when_pubcomp_cannot_be_sent(tmp_path: Path) -> None:
    history = HistoryWriter(tmp_path / "h.jsonl", "r")
    sub, broker = _subscriber(history)
    sub._held[799] = "ab" * 16
    broker.close()  # the broker died: PUBCOMP cannot go out (a Unix socket pair sees that at once)
    with pytest.raises(WireError):
        sub._handle((PUBREL, 2, struct.pack("!H", 799)))
    assert sub._held == {799: "ab" * 16}
    history.close()
    assert (tmp_path / "h.jsonl").read_text() == ""  # no ack recorded for a release that never happened


def test_pubrel_after_pubcomp_sent_records_the_ack_with_its_guid(tmp_path: Path) -> None:
    history = HistoryWriter(tmp_path / "h.jsonl", "r")
    sub, broker = _subscriber(history)
    sub._held[7] = "cd" * 16
    sub._handle((PUBREL, 2, struct.pack("!H", 7)))
    assert broker.recv(16) == _packet(PUBCOMP, 0, struct.pack("!H", 7))
    assert sub._held == {}
    history.close()
    [rec] = [json.loads(line) for line in (tmp_path / "h.jsonl").read_text().splitlines()]
    assert (rec["op"], rec["packet_id"], rec["guid"], rec["qos"]) == ("ack", 7, "cd" * 16, 2)
    broker.close()
