"""The producer process itself is SIGKILLed in the middle of a stream and started again.

With moorline.client and a spool, against moorline: every message handed to the client before the
kill is stored exactly once, in order (the spool kept the producer ids and sequences, the broker
de-duplicated the resends). The same against Mosquitto, next to paho-mqtt: what each loses (the
side-by-side figure is printed; the client must lose nothing, what paho loses is measured, not
asserted)."""

from __future__ import annotations

import base64
import json
import shutil
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from client_support import Proc, producer_args, wait_until
from cluster_harness import Cluster

COUNT = 3000
KILL_AT = 1500
MOSQ_COUNT = 6000
MOSQ_KILL_AT = 2000


def _handed(p: Proc) -> list[int]:
    return [int(ln.split()[1]) for ln in p.lines() if ln.startswith("handed ")]


def _crash_and_resume(procs: Callable[..., Proc], name: str, pause: Callable[[], None], resume: Callable[[], None],
                      count: int = COUNT, kill_at: int = KILL_AT, **kw: object) -> tuple[list[int], list[int]]:
    """Run a producer; once it handed ``kill_at`` messages, pause the broker (SIGSTOP) so that the
    next ones it hands stay unacknowledged (some of them reach the broker's socket and are applied
    after it resumes, their acknowledgement never seen), SIGKILL the producer, resume the broker,
    start the producer again after the last message it handed; returns what each run handed."""
    p1 = procs(producer_args(count=count, **kw), f"{name}-1")
    wait_until(f"{kill_at} messages handed", lambda: len(_handed(p1)) >= kill_at, 60, p1)
    pause()
    try:
        time.sleep(1.0)  # the producer hands messages up to its window, unacknowledged
        p1.kill9()
    finally:
        resume()
    first = _handed(p1)
    assert first == list(range(len(first)))
    p2 = procs(producer_args(count=count, start=first[-1] + 1, **kw), f"{name}-2")
    wait_until("the restarted producer finished", lambda: "done" in p2.lines(), 90, p2)
    assert p2.wait(30) == 0, p2.stderr()[-3000:]
    return first, _handed(p2)


def test_spool_keeps_what_a_killed_producer_was_handed(cluster: Callable[[int], Cluster],
                                                       procs: Callable[..., Proc], tmp_path: Path) -> None:
    cl = cluster(1)
    topic = "client/spool"
    server = f"127.0.0.1:{cl['n1'].mqtt_port}"
    first, second = _crash_and_resume(procs, "spooled", lambda: cl.pause("n1"), lambda: cl.resume("n1"),
                                      servers=server, topic=topic, window=300,
                                      spool=tmp_path / "producer.spool", client_id="spooled")
    shard = cl.shard_of(topic)
    stored = [int(base64.b64decode(m["payload"])) for m in cl["n1"].messages(shard) if m["topic"] == topic]
    counts = Counter(stored)
    assert not [i for i, n in counts.items() if n > 1], "a message stored twice"
    assert stored == list(range(COUNT)), (f"missing {sorted(set(range(COUNT)) - set(stored))[:20]}; "
                                          f"first run handed {len(first)}, second started at {second[0]}")
    recovered = next(ln for ln in (tmp_path / "spooled-2.out").read_text().splitlines() if ln.startswith("start"))
    print(f"\nspool: killed after {len(first)} handed; restart: {recovered}")
    assert int(recovered.split()[-1]) > 0, "the kill found nothing unacknowledged: the test proved nothing"


def _mosquitto_run(procs: Callable[..., Proc], port: int, send: Callable[[int], None], kind: str,
                   tmp_path: Path) -> dict[str, int]:
    topic = f"client/side-by-side/{kind}"
    sub = procs(["mosquitto_sub", "-h", "127.0.0.1", "-p", str(port), "-t", topic, "-q", "1", "-i", f"sub-{kind}",
                 "-c", "-V", "mqttv311"], f"sub-{kind}")
    wait_until("the subscriber is up", lambda: sub.proc.poll() is None, 5, sub)
    time.sleep(0.5)  # the subscription made before the first publish
    kw: dict[str, object] = dict(servers=f"127.0.0.1:{port}", topic=topic, window=100, client_id=f"pub-{kind}",
                                 count=MOSQ_COUNT, kill_at=MOSQ_KILL_AT)
    if kind == "client":
        kw.update(spool=tmp_path / "mosq.spool", no_extras=True)
    else:
        kw.update(kind="paho")
    first, second = _crash_and_resume(procs, f"mosq-{kind}", lambda: send(signal.SIGSTOP),
                                      lambda: send(signal.SIGCONT), **kw)
    handed = set(first) | set(second)
    wait_until("the subscriber received the tail", lambda: str(MOSQ_COUNT - 1) in sub.lines(), 30, sub)
    time.sleep(0.5)
    got = [int(x) for x in sub.lines()]
    counts = Counter(got)
    return {"handed": len(handed), "lost": len(handed - set(got)),
            "duplicated": sum(n - 1 for n in counts.values() if n > 1)}


def test_against_mosquitto_next_to_paho(mosquitto: Callable[[], tuple[int, Callable[[int], None]]],
                                        procs: Callable[..., Proc], tmp_path: Path) -> None:
    if shutil.which("mosquitto_sub") is None:
        pytest.skip("mosquitto_sub not installed")
    port, send = mosquitto()
    client = _mosquitto_run(procs, port, send, "client", tmp_path)
    paho = _mosquitto_run(procs, port, send, "paho", tmp_path)
    figure = {"messages": MOSQ_COUNT, "producer SIGKILLed after handing": MOSQ_KILL_AT, "moorline.client (spool, extras off)": client,
              "paho-mqtt 2 (QoS 1, 100 in flight)": paho}
    print("\n" + json.dumps(figure, indent=1))
    (tmp_path / "side_by_side.json").write_text(json.dumps(figure))
    assert client["lost"] == 0, client
