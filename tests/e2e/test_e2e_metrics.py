"""/metrics counts publishes by where they entered (moorline only): MQTT, POST /v1/publish, the Spark
sink's client; and publishes the ACL refused, by the same sources: a 3.1.1 client gets a normal
PUBACK and its message is dropped, a 5.0 client gets 0x87, an HTTP item is answered "refused".
Every metric the endpoint emits, with its labels, is in docs/metrics.md, and nothing else is."""

from __future__ import annotations

import base64
import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_broker import BrokerProc, running_broker
from rawclient import RawClient

pytestmark = [pytest.mark.e2e, pytest.mark.moorline_only]
HOST = "127.0.0.1"
SOURCES = ("mqtt", "http", "spark")
METRICS_DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"

# Anonymous clients on loopback; with a rule present, what no rule allows is denied (nope/...).
CONFIG = """
[[auth.acl]]
action = "all"
pattern = "ok/#"
"""


@pytest.fixture(scope="module")
def acl_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProc]:
    with running_broker(tmp_path_factory.mktemp("metrics"), config_text=CONFIG) as b:
        yield b


def counters(b: BrokerProc, name: str) -> dict[str, int]:
    with urllib.request.urlopen(b.http_url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    got = {m.group(1): int(m.group(2)) for m in re.finditer(rf'^{name}{{source="(\w+)"}} (\d+)$', text, re.M)}
    assert set(got) == set(SOURCES), f"{name} by source missing from /metrics:\n{text}"
    return got


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {s: after[s] - before[s] for s in SOURCES}


def http_publish(b: BrokerProc, topics: list[str]) -> list[dict[str, Any]]:
    body = {"messages": [{"topic": t, "payload": base64.b64encode(b"x").decode()} for t in topics]}
    req = urllib.request.Request(b.http_url + "/v1/publish", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["results"]  # type: ignore[no-any-return]


def test_publishes_and_acl_refusals_are_counted_by_source(acl_broker: BrokerProc) -> None:
    from moorline.spark.node_client import NodeClient

    published, denied = counters(acl_broker, "moorline_published_total"), counters(
        acl_broker, "moorline_publish_denied_total")

    v3 = RawClient(HOST, acl_broker.mqtt_port, 4)
    assert v3.connect("metrics-v3").reason == 0
    assert v3.publish_and_wait("ok/mqtt", b"1", 1).reason == 0
    assert v3.publish_and_wait("nope/mqtt", b"2", 1).reason == 0  # 3.1.1: acknowledged and dropped
    v3.disconnect()
    v5 = RawClient(HOST, acl_broker.mqtt_port, 5)
    assert v5.connect("metrics-v5").reason == 0
    assert v5.publish_and_wait("nope/mqtt", b"3", 1).reason == 0x87
    v5.disconnect()

    results = http_publish(acl_broker, ["ok/http/1", "ok/http/2", "nope/http"])
    assert [r["status"] for r in results] == ["ok", "ok", "refused"], results
    assert results[2]["reason"] == "not authorized"

    with NodeClient((f"{HOST}:{acl_broker.http_port}",), 30.0) as client:  # the Spark sink's client
        sink = client.publish([{"topic": t, "payload": base64.b64encode(b"s").decode()}
                               for t in ("ok/spark", "nope/spark")])
    assert [r["status"] for r in sink] == ["ok", "refused"], sink

    assert delta(published, counters(acl_broker, "moorline_published_total")) == {"mqtt": 1, "http": 2, "spark": 1}
    assert delta(denied, counters(acl_broker, "moorline_publish_denied_total")) == {"mqtt": 2, "http": 1, "spark": 1}


def _metrics(b: BrokerProc) -> str:
    with urllib.request.urlopen(b.http_url + "/metrics", timeout=30) as r:
        return r.read().decode()


def documented_metrics() -> dict[str, set[str]]:
    """docs/metrics.md's table: metric name -> its label names."""
    rows = re.findall(r"^\| `(moorline_\w+)` \|\s*(\w+)\s*\|([^|]*)\|", METRICS_DOC.read_text(), re.M)
    return {name: set(re.findall(r"`(\w+)`", labels)) for name, _, labels in rows}


def test_every_metric_the_endpoint_emits_is_documented(acl_broker: BrokerProc) -> None:
    # A refused login first, so that labelled metrics have samples to show their labels: a bearer
    # token nobody issued (an MQTT username with a password is accepted, unproven, on an open node).
    req = urllib.request.Request(acl_broker.http_url + "/v1/shards", headers={"Authorization": "Bearer nope"})
    try:
        urllib.request.urlopen(req, timeout=30).close()
    except urllib.error.HTTPError as exc:
        assert exc.code == 401, exc
    assert 'moorline_logins_refused_total{reason="BAD_CREDENTIALS"}' in _metrics(acl_broker)
    with urllib.request.urlopen(acl_broker.http_url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    emitted: dict[str, set[str]] = {m.group(1): set() for m in re.finditer(r"^# TYPE (\w+) \w+$", text, re.M)}
    for m in re.finditer(r"^(\w+)(?:\{([^}]*)\})? \S+$", text, re.M):
        name = m.group(1)
        if name not in emitted:  # a histogram's series: NAME_bucket{le}, NAME_sum, NAME_count
            name = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in emitted, f"sample without a # TYPE line: {m.group(0)}"
        emitted[name] |= set(re.findall(r'(\w+)="', m.group(2) or ""))
    documented = documented_metrics()
    assert sorted(set(emitted) - set(documented)) == [], "metrics /metrics emits that docs/metrics.md lacks"
    assert sorted(set(documented) - set(emitted)) == [], "metrics docs/metrics.md lists that /metrics lacks"
    wrong = {n: (labels, documented[n]) for n, labels in emitted.items() if labels - documented[n]}
    assert wrong == {}, "labels emitted (left) that docs/metrics.md does not name (right)"
