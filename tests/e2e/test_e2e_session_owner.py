"""A session belongs to the principal that created it (issue 19 item 1): a CONNECT with its client id by
another user is refused (3.1.1 return code 5, 5.0 0x87) and leaves the session and its live connection
untouched; without a password file (a username proves nothing) takeover by client id stays MQTT's."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_broker import REPO_ROOT, BrokerFactory, BrokerProc, running_broker
from rawclient import DISCONNECT, RawClient

pytestmark = [pytest.mark.e2e, pytest.mark.moorline_only]
HOST = "127.0.0.1"
P_SESSION_EXPIRY = 0x11


def _passwd(file: Path, user: str, password: str) -> None:
    r = subprocess.run([sys.executable, "-m", "moorline.cli", "passwd", str(file), user, password],
                       capture_output=True, cwd=str(REPO_ROOT), timeout=60)
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def owner_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProc]:
    tmp = tmp_path_factory.mktemp("owner")
    pw = tmp / "passwords"
    _passwd(pw, "alice", "wonderland")
    _passwd(pw, "mallory", "evil")
    with running_broker(tmp, config_text=f'[auth]\nallow_anonymous = false\npassword_file = "{pw}"\n') as b:
        yield b


def _login(b: BrokerProc, version: int, cid: str, user: str, pw: str, clean: bool = False) -> tuple[RawClient, int, bool]:
    c = RawClient(HOST, b.mqtt_port, version)
    props = [(P_SESSION_EXPIRY, 3600)] if version == 5 and not clean else None
    ack = c.connect(cid, clean=clean, props=props, username=user, password=pw.encode())
    return c, ack.reason, ack.session_present


@pytest.mark.parametrize("version", [4, 5])
def test_another_user_cannot_resume_or_take_over(owner_broker: BrokerProc, uniq: str, version: int) -> None:
    cid, topic = f"{uniq}-c", f"{uniq}/t"
    alice, rc, _ = _login(owner_broker, version, cid, "alice", "wonderland")
    assert rc == 0
    assert alice.subscribe([(topic, 1)]).reasons == [1]
    alice.close()  # the session stays, with its subscription, and queues what follows
    pub, rc, _ = _login(owner_broker, version, f"{uniq}-p", "alice", "wonderland", clean=True)
    pub.publish_and_wait(topic, b"for-alice-1", qos=1)

    for clean in (False, True):  # neither resume nor a clean start may touch alice's session
        mallory, rc, present = _login(owner_broker, version, cid, "mallory", "evil", clean=clean)
        assert rc == (0x87 if version == 5 else 5), f"mallory got CONNACK {rc:#x} for alice's session"
        assert not present
        mallory.wait_closed()

    alice, rc, present = _login(owner_broker, version, cid, "alice", "wonderland")
    assert rc == 0 and present, "alice's session was lost or replaced"
    msg = alice.next_message()
    assert msg.payload == b"for-alice-1"
    alice.ack(msg)

    # A live connection is not disconnected by another user's attempt either.
    mallory, rc, _ = _login(owner_broker, version, cid, "mallory", "evil")
    assert rc != 0
    pub.publish_and_wait(topic, b"for-alice-2", qos=1)
    msg = alice.next_message()
    assert msg.payload == b"for-alice-2"
    alice.ack(msg)
    assert all(p.type != DISCONNECT for p in alice.pending)
    alice.ping()
    for c in (alice, pub, mallory):
        c.close()


def test_without_password_file_takeover_by_client_id_works(broker_factory: BrokerFactory, uniq: str) -> None:
    b = broker_factory()
    cid = f"{uniq}-c"
    first = RawClient(HOST, b.mqtt_port, 5)
    assert first.connect(cid, clean=False, props=[(P_SESSION_EXPIRY, 600)], username="u1").reason == 0
    second = RawClient(HOST, b.mqtt_port, 5)
    ack = second.connect(cid, clean=False, props=[(P_SESSION_EXPIRY, 600)], username="u2")
    assert ack.reason == 0 and ack.session_present
    closed = first.wait_closed()
    assert any(p.type == DISCONNECT and p.reason == 0x8E for p in closed)
    second.close()


def test_takeover_across_users_with_password_file_is_a_config_error(broker_factory: BrokerFactory,
                                                                     tmp_path: Path) -> None:
    pw = tmp_path / "pw"
    _passwd(pw, "alice", "x")
    b = broker_factory(start=False, config_text=f'[auth]\npassword_file = "{pw}"\nsession_takeover_across_users = true\n')
    with pytest.raises(RuntimeError, match="session_takeover_across_users"):
        b.start()
