"""Issue 33, against a real broker process (docs/queues.md):

- ``$share`` with No Local is a protocol error (MQTT-3.8.3-4: DISCONNECT 0x82);
- a shared subscription's Subscription Identifier comes with its messages (MQTT 5 3.8.2.1.2);
- ``moorline groups`` and the per-group metrics show a group's backlog, members and active member.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request
import zlib

import pytest
from e2e_broker import BrokerProc
from rawclient import DISCONNECT, P_SUBSCRIPTION_ID, RawClient, encode_subscribe
from test_e2e_work_queues import metric, publish

pytestmark = [pytest.mark.e2e, pytest.mark.moorline_only]
HOST = "127.0.0.1"


def test_no_local_on_a_shared_subscription_is_a_protocol_error(shared_broker: BrokerProc, uniq: str) -> None:
    c = RawClient(HOST, shared_broker.mqtt_port, 5)
    assert c.connect(f"{uniq}-nl").reason == 0
    c.send(encode_subscribe(c.alloc_pid(), [(f"$share/g{uniq}/{uniq}/t", 1, {"no_local": True})], 5))
    got = c.wait_closed(5.0)
    assert [(pk.type, pk.reason) for pk in got] == [(DISCONNECT, 0x82)], got
    # No Local on a plain subscription stays fine.
    d = RawClient(HOST, shared_broker.mqtt_port, 5)
    assert d.connect(f"{uniq}-nl2").reason == 0
    assert d.subscribe([(f"{uniq}/t", 1, {"no_local": True})]).reasons == [1]  # type: ignore[attr-defined]
    d.disconnect()


def test_shared_subscription_identifier_is_delivered(shared_broker: BrokerProc, uniq: str) -> None:
    port, topic = shared_broker.mqtt_port, f"{uniq}/jobs"
    c = RawClient(HOST, port, 5)
    assert c.connect(f"{uniq}-sid").reason == 0
    assert c.subscribe([(f"$share/g{uniq}/{topic}", 1)], props=[(P_SUBSCRIPTION_ID, 42)]).reasons == [1]
    publish(port, f"{uniq}-p", topic, [b"one"])
    m = c.next_message(5.0)
    assert m.payload == b"one" and m.props_all(P_SUBSCRIPTION_ID) == [42]
    c.ack(m)
    c.disconnect()


def test_groups_command_and_group_metrics(shared_broker: BrokerProc, uniq: str) -> None:
    """``moorline groups --http`` prints each group's backlog and members; /metrics has them too."""
    short = f"{zlib.crc32(uniq.encode()):08x}"  # names short enough for the table's columns
    port, topic, group, keep = shared_broker.mqtt_port, f"{short}/jobs", f"g{short}", f"k{short}"
    c = RawClient(HOST, port, 5)
    assert c.connect(f"{short}-m", clean=True).reason == 0
    assert c.subscribe([(f"$share/{group}/{topic}", 1)], props=[(0x26, ("moorline-share-mode", "single-active"))]).reasons == [1]  # type: ignore[attr-defined]
    c.disconnect()  # its session ends: no member, the backlog stays
    c = RawClient(HOST, port, 5)
    assert c.connect(keep, clean=False, props=[(0x11, 600)]).reason == 0
    assert c.subscribe([(f"$share/{group}/{topic}", 1)]).reasons == [1]  # type: ignore[attr-defined]
    c.disconnect()  # offline: its group keeps what is published
    publish(port, f"{short}-p", topic, [b"a", b"b", b"c"])
    http = shared_broker.http_url.removeprefix("http://")
    out = subprocess.run([sys.executable, "-m", "moorline", "groups", "--http", http, "--q", short],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    row = next((line for line in out.stdout.splitlines() if group in line), out.stdout)
    cells = [x.strip() for x in row.strip("│ ").split("│")]
    assert cells[:3] == [group, topic, "3"], row  # group, filter, backlog
    assert cells[4] == "1" and cells[5] == keep, row  # one member, the active one
    lbl = rf'group="{group}",filter="{re.escape(topic)}"'
    assert metric(shared_broker, rf"moorline_share_group_backlog\{{{lbl}\}}") == 3
    assert metric(shared_broker, rf"moorline_share_group_members\{{{lbl}\}}") == 1
    with urllib.request.urlopen(shared_broker.http_url + "/metrics", timeout=10) as r:
        assert f'moorline_share_group_active_member{{group="{group}",filter="{topic}",member="{keep}"}} 1' \
            in r.read().decode()
    bad = subprocess.run([sys.executable, "-m", "moorline", "groups", "--http", "127.0.0.1:1"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "no node answered" in bad.stderr and "Traceback" not in bad.stderr
