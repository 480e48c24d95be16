"""$SYS topics: published every sys.interval_s to connections subscribed to a $SYS filter, never
stored in a shard log, never matched by `#` or `+/...`, and readable only with a grant."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from e2e_broker import BrokerFactory
from e2e_support import Paho, wait_until
from listener_support import broker_errors
from rawclient import PUBLISH, RawClient

from moorline.node.edge.credentials import hash_password

pytestmark = [pytest.mark.e2e, pytest.mark.moorline_only, pytest.mark.timeout(120)]

FAST = "[sys]\ninterval_s = 0.2\n"


def _latest(client: Paho, topic: str, quiet: float = 0.6) -> bytes | None:
    last = None
    for msg in client.drain(quiet):
        if msg.topic == topic:
            last = msg.payload
    return last


@pytest.mark.parametrize("version", [4, 5])
def test_clients_connected_follows_clients_coming_and_going(broker_factory: BrokerFactory, uniq: str,
                                                             version: int) -> None:
    broker = broker_factory(config_text=FAST)  # loopback, anonymous, no ACL: $SYS open (as the HTTP admin)
    watcher = Paho(broker.mqtt_port, version=version)
    watcher.connect()
    codes = watcher.subscribe("$SYS/broker/clients/connected")
    assert int(getattr(codes[0], "value", codes[0])) == 0
    topic = "$SYS/broker/clients/connected"

    def connected_is(n: int) -> bool:
        return _latest(watcher, topic, 0.5) == str(n).encode()

    assert wait_until(lambda: connected_is(1), timeout=10)
    others = [Paho(broker.mqtt_port, version=5) for _ in range(3)]
    for c in others:
        c.connect()
    assert wait_until(lambda: connected_is(4), timeout=10)
    for c in others[:2]:
        c.disconnect()
    assert wait_until(lambda: connected_is(2), timeout=10)
    # the whole tree, with Mosquitto's names and moorline's shards
    wide = Paho(broker.mqtt_port, version=version)
    wide.connect()
    wide.subscribe("$SYS/#")
    seen = {m.topic: m for m in wide.drain(0.6)}
    for name in ("version", "uptime", "clients/connected", "messages/received", "messages/sent",
                 "subscriptions/count", "retained messages/count", "load/messages/received/1min"):
        assert f"$SYS/broker/{name}" in seen, sorted(seen)
    assert seen["$SYS/broker/version"].payload.startswith(b"moorline ")
    assert seen["$SYS/broker/version"].retain  # the current values come flagged retained
    for name in ("next_offset", "low_water", "owed_messages", "dropped"):
        assert f"$SYS/moorline/shards/0/{name}" in seen
    for c in (watcher, wide, others[2]):
        c.disconnect()
    assert broker_errors(broker) == []


def test_wildcards_never_deliver_sys_and_sys_stays_out_of_the_log(broker_factory: BrokerFactory, uniq: str) -> None:
    broker = broker_factory(config_text=FAST)
    everything = Paho(broker.mqtt_port, version=5)
    everything.connect()
    everything.subscribe("#")
    everything.subscribe("+/broker/#")
    everything.subscribe("+/+/+/+")
    sys_sub = Paho(broker.mqtt_port, version=5)
    sys_sub.connect()
    sys_sub.subscribe("$SYS/broker/uptime")
    assert wait_until(lambda: any(m.topic == "$SYS/broker/uptime" for m in sys_sub.drain(0.3)), timeout=10)
    pub = Paho(broker.mqtt_port, version=5)
    pub.connect()
    pub.publish(f"{uniq}/marker", b"m", qos=1)
    got = everything.drain(1.5)  # several $SYS rounds
    assert [m.topic for m in got] == [f"{uniq}/marker"]
    with urllib.request.urlopen(f"{broker.http_url}/v1/shards", timeout=10) as resp:
        shards = json.load(resp)["shards"]
    assert sum(s["next_offset"] for s in shards) == 1  # the marker only: no $SYS message was stored
    # a $share group cannot take $SYS
    assert int(getattr(pub.subscribe("$share/g/$SYS/#")[0], "value", 0)) == 0x9E
    for c in (everything, sys_sub, pub):
        c.disconnect()


def _auth_config(tmp_path: Path, acl: str, admins: str = "[]") -> str:
    passwd = tmp_path / "passwd"
    passwd.write_text("".join(f"{u}:{hash_password('pw-' + u)}\n" for u in ("alice", "ops", "root")))
    return (f'[auth]\nallow_anonymous = false\npassword_file = "{passwd}"\nadmin_users = {admins}\n{acl}\n{FAST}')


@pytest.mark.parametrize("version", [4, 5])
def test_sys_needs_a_grant(broker_factory: BrokerFactory, tmp_path: Path, uniq: str, version: int) -> None:
    acl = """
[[auth.acl]]
user = "ops"
action = "subscribe"
pattern = "$SYS/#"

[[auth.acl]]
action = "all"
pattern = "#"
"""
    broker = broker_factory(config_text=_auth_config(tmp_path, acl, '["root"]'))
    for user, granted in (("alice", False), ("ops", True), ("root", True)):
        with RawClient("127.0.0.1", broker.mqtt_port, version=version) as raw:
            assert raw.connect(f"{uniq}-{user}", username=user, password=f"pw-{user}".encode()).reason == 0
            ack = raw.subscribe([("$SYS/#", 0), ("$SYS/broker/clients/connected", 0)])
            want = 0 if granted else (0x87 if version == 5 else 0x80)
            assert ack.reasons == [want, want], (user, ack)
            if granted:
                msg = raw.next_message(5)
                assert msg.type == PUBLISH and msg.topic.startswith("$SYS/")
            else:
                assert raw.recv_or_none(0.8) is None  # nothing arrives without the grant
            raw.disconnect()
    # Without any ACL rule, on a node that authenticates: only admin users.
    broker.stop_clean()
    plain = broker_factory(config_text=_auth_config(tmp_path, "", '["root"]'))
    for user, granted in (("alice", False), ("root", True)):
        with RawClient("127.0.0.1", plain.mqtt_port, version=version) as raw:
            assert raw.connect(f"{uniq}-{user}", username=user, password=f"pw-{user}".encode()).reason == 0
            ack = raw.subscribe([("$SYS/#", 0)])
            assert ack.reasons == [0 if granted else (0x87 if version == 5 else 0x80)], (user, ack)
            raw.disconnect()
    assert broker_errors(plain) == []
