"""A QoS 2 "Method B" subscriber whose node is killed mid-stream resumes on another node (issue 21):
no loss, no duplicate, and every resend carries the packet id the message was first sent with
(delivery batches are committed in the session shard before any PUBLISH of them is sent)."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import pytest
from cluster_clients import connect, subscribe
from cluster_harness import ClusterFactory
from qos2_receiver import MethodBSubscriber

pytestmark = [pytest.mark.cluster_e2e, pytest.mark.timeout(150)]

SEED = 20261125
N = 300


def test_qos2_method_b_subscriber_resumes_on_another_node(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(3)
    rng = random.Random(SEED)
    # The session lives on n2 and its shard is led by n2: the kill takes both away.
    session_shard = cluster.shard_led_by("n2")
    cid = cluster.client_id_on_shard("q2-sub", session_shard)
    topics = [cluster.topic_led_by(name, f"q2/{name}") for name in ("n1", "n2", "n3")]
    sub = connect(cluster["n2"], cid, expect_present=False)
    subscribe(sub, [(t, 2) for t in topics])
    sub.disconnect()

    pub = connect(cluster["n1"], "q2-pub", clean=True, expiry=0)
    for i in range(N):
        done = pub.publish_and_wait(topics[i % len(topics)], f"{i}".encode(), 2, timeout=15)
        assert done.reason == 0, done
    pub.disconnect()

    subscriber = MethodBSubscriber(cid, withhold_every=15)
    c = connect(cluster["n2"], cid, expect_present=True, receive_maximum=32)
    kill_at = rng.randint(N // 4, N // 2)
    t = threading.Thread(target=subscriber.consume, args=(c,), kwargs={"quiet": 30.0, "delay": 0.004},
                         daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while len(subscriber.delivered) < kill_at and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert len(subscriber.delivered) >= kill_at, f"stalled at {len(subscriber.delivered)}\n{cluster.describe()}"
    cluster.kill9("n2")
    t.join(30)
    assert not t.is_alive()
    c.close()
    subscriber.withhold_every = 0
    before = len(subscriber.delivered)
    assert subscriber.withheld, "no message was left without PUBREC at the kill"
    assert before < N, "all delivered before the kill; the test proved nothing"

    # Resumed on n3; a client whose connection is closed reconnects (to n3 again), as any would.
    reconnects = 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        c = connect(cluster["n3"], cid, expect_present=True, timeout=30)
        ended = subscriber.consume(c, quiet=3.0, timeout=max(1.0, deadline - time.monotonic()))
        if ended == "quiet":  # everything was delivered
            c.disconnect()
            break
        c.close()
        reconnects += 1
        print(f"the connection to n3 ended ({ended}) after {len(subscriber.delivered)} deliveries")
    print(f"{before} of {N} delivered before the kill, {subscriber.resends} resends, "
          f"{subscriber.withheld_total} PUBRECs withheld, {reconnects} reconnects to n3")
    assert subscriber.violations == [], subscriber.violations[:5]
    assert subscriber.withheld == set(), f"never resent although not PUBREC'd: pids {sorted(subscriber.withheld)}"
    counts = Counter(subscriber.delivered)
    assert [p for p, k in counts.items() if k > 1] == [], "delivered more than once"
    missing = sorted(set(range(N)) - {int(p) for p in subscriber.delivered})
    assert not missing, f"{len(missing)} of {N} lost: {missing[:20]}\n{cluster.describe()}"
    for i, topic in enumerate(topics):
        per = [int(p) for p in subscriber.delivered if int(p) % len(topics) == i]
        assert per == sorted(per), f"order broken on {topic}"
    cluster.assert_no_errors()
