"""TopicState.owed_bytes (what session.max_queued_bytes is enforced against) always equals the sizes
of the messages each registration is owed, through publishes, acks, drops, expiry, unregister and
a snapshot restore."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from moorline.broker import commands as c
from moorline.broker.effects import Effects
from moorline.broker.messages import StoredMessage
from moorline.broker.shard import ShardState
from moorline.broker.topic_state import TopicLimits, TopicState

REGS = {"c1\x00a/#": "a/#", "c2\x00a/b": "a/b", "c3\x00+/b": "+/b"}
TOPICS = ["a/b", "a/c", "x/b"]


def recomputed(t: TopicState) -> dict[str, int]:
    return {k: sum(t.meta.size_of(o) or 0 for o in r.owed) for k, r in t.regs.items() if r.owed}


op = st.one_of(
    st.tuples(st.just("pub"), st.sampled_from(TOPICS), st.integers(0, 300), st.sampled_from([None, 1])),
    st.tuples(st.just("ack"), st.sampled_from(sorted(REGS)), st.integers(0, 5)),
    st.tuples(st.just("drop"), st.sampled_from(sorted(REGS)), st.integers(0, 5)),
    st.tuples(st.just("unreg"), st.sampled_from(sorted(REGS)), st.sampled_from(["unsubscribe", "session_expired"])),
    st.tuples(st.just("reg"), st.sampled_from(sorted(REGS))),
    st.tuples(st.just("tick"), st.integers(0, 3000)),
)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(op, max_size=60))
def test_owed_bytes_match_the_owed_messages(ops: list[tuple]) -> None:  # type: ignore[type-arg]
    s = ShardState(0, "inc", TopicLimits(retention_min_age_ms=1000), 3600)
    t = s.topics
    now = 1000
    for k, f in REGS.items():
        s.apply(c.Register(now, k, k.split("\x00")[0], 1, f, 1), Effects())
    for o in ops:
        fx = Effects()
        if o[0] == "pub":
            now += 10
            guid = now.to_bytes(16, "big")
            s.apply(c.Publish(StoredMessage(o[1], b"p" * o[2], 1, False, guid, now, o[3], None, "pub")), fx)
        elif o[0] in ("ack", "drop") and o[1] in t.regs:
            owed = list(t.regs[o[1]].owed)[: o[2]]
            cmd = c.AckReport(o[1], tuple(owed)) if o[0] == "ack" else c.DropOwed(o[1], tuple(owed), "queue_cap")
            s.apply(cmd, fx)
        elif o[0] == "unreg":
            s.apply(c.Unregister(o[1], 1, o[2]), fx)
        elif o[0] == "reg":
            s.apply(c.Register(now, o[1], o[1].split("\x00")[0], 1, REGS[o[1]], 1), fx)
        elif o[0] == "tick":
            now += o[1]
            s.apply(c.Housekeeping(now, -1), fx)
        assert t.owed_bytes == recomputed(t)
    restored = ShardState.restore(s.snapshot(), t.limits, 3600)
    assert restored.topics.owed_bytes == recomputed(t)
