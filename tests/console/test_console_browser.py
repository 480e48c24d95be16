"""The web console in a real browser (headless Chromium over the DevTools protocol) against a
3-node cluster with authentication (issue 35): it loads without console errors; the overview shows
3 nodes, up; after SIGKILL of one node the overview marks it down and every shard it led shows a
new leader within seconds; each page is screenshotted into the test's folder; a non-admin user sees
no admin page or action and only its own sessions. Skipped only when chromium is not installed
(scripts/test.sh installs it)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest
from cluster_harness import Cluster
from rawclient import DISCONNECT, P_SESSION_EXPIRY, RawClient

from tests.console.cdp import Browser, chromium_path
from tests.console.support import USERS, auth_config, basic, call, write_passwords

pytestmark = pytest.mark.timeout(240)
HOST = "127.0.0.1"
DOWN_WITHIN_S = 10.0  # SIGKILL to "down" on the overview
NEW_LEADERS_WITHIN_S = 15.0  # SIGKILL to a new leader on the shards page for every shard it led
PAGES = ("overview", "shards", "sessions", "groups", "drops")


def mqtt(port: int, cid: str, user: str) -> RawClient:
    deadline = time.monotonic() + 30
    while True:
        c = RawClient(HOST, port, 5, timeout=10)
        try:
            ack = c.connect(cid, clean=False, props=[(P_SESSION_EXPIRY, 600)], username=user,
                            password=USERS[user].encode())
            if ack.reason == 0:
                return c
        except OSError:
            pass
        c.close()
        assert time.monotonic() < deadline, f"{cid} could not connect"
        time.sleep(0.3)


def every_shard_led(c: Cluster) -> bool:
    for name in c.names:
        status, body = call(c[name].http_url, "GET", "/v1/shards", "root")
        if status != 200 or not all(s["leader"] for s in body["shards"]):
            return False
    return True


def publish_until(c: RawClient, stop: threading.Event) -> None:
    i = 0
    while not stop.is_set():
        try:
            c.publish_and_wait(f"metrics/{i % 8}", b"%d" % i, qos=1, timeout=5)
        except (OSError, AssertionError, ConnectionError):
            time.sleep(0.2)  # the topic's shard changing leader: go on
        i += 1
        if i % 20 == 0:
            time.sleep(0.05)


def read_until(c: RawClient, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            c.recv_or_none(0.2)
        except (OSError, ConnectionError):
            return


@pytest.fixture
def cluster(tmp_path: Path) -> object:
    if chromium_path() is None:
        pytest.skip("chromium is not installed (scripts/test.sh installs it with apt-get)")
    write_passwords(tmp_path / "passwords")
    c = Cluster(tmp_path / "cluster", 3, auth_config(tmp_path / "passwords", "[http]\nconsole_update_interval_s = 0.5\n"))
    try:
        c.start(wait_leaders=False)  # the harness asks without credentials: asked here as the admin
        deadline = time.monotonic() + 60
        while not every_shard_led(c):
            assert time.monotonic() < deadline, "no leader for every shard within 60 s"
            time.sleep(0.2)
        yield c
    finally:
        problems = c.close()
        assert not problems, problems
        bad = c.bad_log_lines()  # an exception in the console's routes or sampler is logged as ERROR
        assert not bad, bad


def test_console_in_chromium(cluster: Cluster, tmp_path: Path) -> None:
    n1 = cluster["n1"]
    url = n1.http_url + "/"
    # The console's data routes answer 401 without credentials (the page too: same authentication).
    for path in ("/", "/v1/me", "/v1/console/stream", "/v1/sessions", "/v1/clients"):
        assert call(n1.http_url, "GET", path)[0] == 401, path
    clients = [mqtt(n1.mqtt_port, "alice-sensor", "alice"), mqtt(n1.mqtt_port, "bob-sensor", "bob")]
    clients[0].subscribe([("$share/workers/jobs/#", 1)])
    # Traffic for the rate charts: a QoS 1 publisher and a QoS 0 reader on n1, until the test ends.
    publisher, reader = mqtt(n1.mqtt_port, "traffic-pub", "root"), mqtt(n1.mqtt_port, "traffic-sub", "root")
    reader.subscribe([("metrics/#", 0)])
    stop = threading.Event()
    threads = [threading.Thread(target=publish_until, args=(publisher, stop), daemon=True),
               threading.Thread(target=read_until, args=(reader, stop), daemon=True)]
    for t in threads:
        t.start()
    shots = tmp_path / "screenshots"
    shots.mkdir()
    try:
        asyncio.run(drive(cluster, url, shots))
        bye = clients[1].expect(DISCONNECT, timeout=5)  # disconnected from the console's Sessions page
        assert bye.reason == 0x98, bye
        # A session served by another node is ended through that node (409 names it).
        status, body = call(cluster["n3"].http_url, "DELETE", "/v1/sessions/alice-sensor", "root")
        assert status == 409 and body["owner_node"] == "n1", body
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        for c in (*clients, publisher, reader):
            c.close()
    print(f"screenshots in {shots}")


async def drive(cluster: Cluster, url: str, shots: Path) -> None:
    browser = Browser(shots.parent / "chromium-profile")
    await browser.start()
    try:
        await browser.set_auth(basic("root"))
        await browser.goto(url)
        await browser.wait_for("the console to start", "document.body && document.body.dataset.ready === '1'", 20)
        nodes = await browser.wait_for(
            "3 nodes up on the overview",
            "(() => { const c = [...document.querySelectorAll('#nodes [data-node]')];"
            " return c.length === 3 && c.every(e => e.dataset.state === 'up') ? c.map(e => e.dataset.node) : null })()",
            20)
        assert sorted(nodes) == ["n1", "n2", "n3"]
        await browser.wait_for("a sparkline", "document.querySelectorAll('#charts svg.spark polyline').length >= 3", 10)
        await browser.wait_for("live rates above 0 (publishes in, deliveries out)",
                               "['in', 'out'].every(k => parseFloat(document.querySelector("
                               "`[data-chart=\"${k}\"] .chart-value`).textContent) > 0)", 15)
        await asyncio.sleep(3)  # a few more points on the sparklines for the screenshot
        for page in PAGES:
            await browser.eval(f"location.hash = '#{page}'")
            await browser.wait_for(f"the {page} page", f"document.body.dataset.page === '{page}'", 10)
            if page == "shards":
                await browser.wait_for("16 shards with leaders",
                                       "document.querySelectorAll('#shards-table tr[data-shard]').length === 16", 10)
            if page == "sessions":
                await browser.wait_for("both sessions", "!!document.querySelector('[data-client=\"alice-sensor\"]')"
                                       " && !!document.querySelector('[data-client=\"bob-sensor\"]')", 10)
                await browser.eval("document.querySelector('[data-client=\"alice-sensor\"]').click()")
                await browser.wait_for("the session's details and admin actions",
                                       "!document.getElementById('session-detail').hidden"
                                       " && document.querySelectorAll('.admin-action').length >= 1", 10)
            if page == "groups":
                await browser.wait_for("the $share group", "document.querySelector('#groups-table tbody')"
                                       ".textContent.includes('workers')", 10)
            await asyncio.sleep(0.3)
            await browser.screenshot(shots / f"{page}.png")
        assert browser.errors == [], browser.errors

        # An admin action from the page (same-origin DELETE, through the listener's Origin check):
        # disconnect bob's client, confirmed.
        await browser.eval("location.hash = '#sessions'")
        await browser.wait_for("bob's session", "!!document.querySelector('[data-client=\"bob-sensor\"]')", 10)
        await browser.eval("window.confirm = () => true;"
                           " document.querySelector('[data-client=\"bob-sensor\"]').click()")
        await browser.wait_for("bob's session details with a disconnect button",
                               "document.getElementById('session-detail').dataset.client === 'bob-sensor'"
                               " && !!document.querySelector('[data-action=\"disconnect\"]')", 10)
        await browser.eval("document.querySelector('[data-action=\"disconnect\"]').click()")
        await browser.wait_for("the disconnect's answer", "document.getElementById('toast').textContent"
                               ".includes('\"disconnected\":true')", 10)
        assert browser.errors == [], browser.errors

        # SIGKILL a node that leads shards (not the one serving the console).
        # (n2 may lead nothing for a moment after start: the rebalancer hands preferred leaderships
        # back a few per 5-s round, so the grid is read once it shows n2 leading some shard)
        await browser.eval("location.hash = '#shards'")
        led = json.loads(await browser.wait_for("n2 leading a shard in the grid", (
            "(() => { const s = [...document.querySelectorAll('#shards-table tr[data-shard]')]"
            ".filter(r => r.dataset.leader === 'n2').map(r => r.dataset.shard);"
            " return s.length ? JSON.stringify(s) : ''; })()"), 40))
        assert led, "n2 leads no shard"
        killed_at = time.monotonic()
        cluster.kill9("n2")
        await browser.eval("location.hash = '#overview'")
        await browser.wait_for("n2 marked down", "document.querySelector('#nodes [data-node=\"n2\"]')"
                               ".dataset.state === 'down'", DOWN_WITHIN_S)
        down_s = time.monotonic() - killed_at
        await browser.screenshot(shots / "overview-n2-down.png")
        await browser.eval("location.hash = '#shards'")
        check = ("(() => { const rows = [...document.querySelectorAll('#shards-table tr[data-shard]')]"
                 f".filter(r => {json.dumps(led)}.includes(r.dataset.shard));"
                 " return rows.length > 0 && rows.every(r => r.dataset.leader && r.dataset.leader !== 'n2') })()")
        await browser.wait_for(f"new leaders for shards {led}", check, max(1.0, NEW_LEADERS_WITHIN_S - down_s))
        print(f"n2 down on the overview after {down_s:.1f} s, its {len(led)} shards led again after "
              f"{time.monotonic() - killed_at:.1f} s")
        await browser.screenshot(shots / "shards-after-kill.png")
        assert browser.errors == [], browser.errors

        # A non-admin user: no admin page, no admin action, only its own sessions.
        await browser.set_auth(basic("alice"))
        await browser.goto(url)
        await browser.wait_for("the console as alice", "document.body.dataset.ready === '1'"
                               " && document.body.dataset.admin === '0'", 20)
        await browser.wait_for("alice's session", "!!document.querySelector('[data-client=\"alice-sensor\"]')", 10)
        shown = json.loads(await browser.eval(
            "JSON.stringify([...document.querySelectorAll('#sessions-table [data-client]')].map(r => r.dataset.client))"))
        assert shown == ["alice-sensor"], shown
        assert json.loads(await browser.eval("JSON.stringify([...document.querySelectorAll('#nav a')]"
                                             ".map(a => a.dataset.page))")) == ["clients", "sessions"]
        await browser.eval("document.querySelector('[data-client=\"alice-sensor\"]').click()")
        await browser.wait_for("the session's details", "!document.getElementById('session-detail').hidden", 10)
        assert await browser.eval("document.querySelectorAll('.admin-action, [data-action]').length") == 0
        await browser.eval("location.hash = '#overview'")
        await browser.wait_for("the overview refused", "document.body.dataset.page === 'denied'", 5)
        await browser.eval("location.hash = '#sessions'")
        await asyncio.sleep(0.3)
        await browser.screenshot(shots / "sessions-non-admin.png")
        assert browser.errors == [], browser.errors
    finally:
        await browser.close()
