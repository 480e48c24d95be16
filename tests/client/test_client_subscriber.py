"""A subscriber with explicit acks that crashes between receiving a message and acknowledging it gets
that message again when its persistent session resumes on another node of the cluster; the one it
acknowledged before does not come again."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable

from client_support import HERE, Proc, wait_until
from cluster_harness import Cluster

from moorline.client import Client


def _sub_args(server: str, **kw: object) -> list[str]:
    args = [sys.executable, str(HERE / "subscriber.py"), "--servers", server]
    for k, v in kw.items():
        args += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return args


async def _publish(server: str, topic: str, payloads: list[str]) -> None:
    async with Client([server]) as c:
        for pl in payloads:
            await c.publish(topic, pl, qos=1)


def test_unacked_message_comes_again_after_a_crash_and_resume_elsewhere(cluster: Callable[[int], Cluster],
                                                                        procs: Callable[..., Proc]) -> None:
    cl = cluster(3)
    s1, s2 = (f"127.0.0.1:{cl[n].mqtt_port}" for n in ("n1", "n2"))
    topic = "client/acks/1"
    common = dict(client_id="acker", filter="client/acks/#")
    sub = procs(_sub_args(s1, clean=True, ack=1, **common), "sub-1")
    wait_until("subscribed", lambda: any(ln.startswith("subscribed") for ln in sub.lines()), 30, sub)
    asyncio.run(_publish(s1, topic, ["first", "second"]))
    wait_until("both received", lambda: "got second dup=0" in sub.lines(), 30, sub)
    assert "acked first" in sub.lines() and "acked second" not in sub.lines()
    time.sleep(0.5)  # the ack of "first" reaches the broker
    sub.kill9()  # between receive and ack of "second"

    again = procs(_sub_args(s2, exit_after=1, **common), "sub-2")
    wait_until("the resumed subscriber got a message", lambda: any(ln.startswith("got ") for ln in again.lines()),
               60, again)
    assert again.wait(30) == 0, again.stderr()[-2000:]
    lines = again.lines()
    assert lines[0] == "subscribed session_present=1", lines
    got = [ln for ln in lines if ln.startswith("got ")]
    assert got == ["got second dup=1"], f"after resume on n2: {got}"
