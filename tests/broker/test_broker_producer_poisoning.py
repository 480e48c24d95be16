"""Issue 30 item 1, in the pure state machine: another user cannot poison a sequenced producer.

Attack: mallory publishes once with the victim's producer id and ``seq = 2**62``; before the fix
every later message of the victim's producer was answered "duplicate" and never stored."""

from __future__ import annotations

import random

import msgspec

from moorline.broker import commands as c
from moorline.broker.effects import Effects
from moorline.broker.messages import StoredMessage
from moorline.broker.shard import SNAPSHOT_VERSION, ShardState
from moorline.broker.topic_state import SEQ_JUMP_REASON_CODE, TopicLimits

P = bytes.fromhex("0011223344556677")


def msg(topic: str = "orders/x", payload: bytes = b"x", guid: bytes | None = None) -> StoredMessage:
    return StoredMessage(topic, payload, 1, False, guid or random.randbytes(16), 1000, None, None, "pub")


def pub(s: ShardState, principal: str, seq: int, payload: bytes = b"x") -> str:
    fx = Effects()
    guid = P + seq.to_bytes(8, "big")
    return s.apply(c.Publish(msg(payload=payload, guid=guid), principal, P, seq), fx).status


def test_another_users_huge_sequence_does_not_make_the_victims_messages_duplicates() -> None:
    s = ShardState(0, "inc", TopicLimits(), 3600)
    assert pub(s, "victim", 1) == "ok"
    assert pub(s, "mallory", 2**62) == "ok"  # mallory's own producer (principal, id): harmless
    assert pub(s, "victim", 2) == "ok"
    assert pub(s, "victim", 3) == "ok"
    assert pub(s, "victim", 3) == "duplicate"


def test_a_sequence_jumping_past_max_seq_gap_is_refused_not_applied_not_duplicate() -> None:
    s = ShardState(0, "inc", TopicLimits(max_seq_gap=1000), 3600)
    assert pub(s, "u", 5) == "ok"
    fx = Effects()
    r = s.apply(c.Publish(msg(guid=P + (5000).to_bytes(8, "big")), "u", P, 5000), fx)
    assert (r.status, r.reason_code) == ("refused", SEQ_JUMP_REASON_CODE) and "max_seq_gap" in r.reason
    assert not fx.appends and s.topics.next_offset == 1
    assert pub(s, "u", 6) == "ok"  # the producer's sequence is untouched
    # Within the bound, the first row of a later Spark batch is accepted as before.
    s2 = ShardState(0, "inc", TopicLimits(), 3600)
    assert pub(s2, "u", 7 << 32) == "ok" and pub(s2, "u", (7 << 32) + 1) == "ok"
    assert pub(s2, "u", 9 << 32) == "ok"
    assert pub(s2, "u", 1 << 62) == "refused"


def test_version_3_snapshot_producers_go_to_the_principal_of_their_guid() -> None:
    s = ShardState(0, "inc", TopicLimits(), 3600)
    assert pub(s, "alice", 1) == "ok"
    p2 = bytes.fromhex("8899aabbccddeeff")
    fx = Effects()
    assert s.apply(c.Publish(msg(guid=p2 + (4).to_bytes(8, "big")), "", p2, 4), fx).status == "ok"
    s.apply(c.Register(0, "cl\x00orders/#", "cl", 1, "orders/#", 1), fx)
    raw = msgspec.msgpack.decode(s.snapshot())
    assert raw["version"] == SNAPSHOT_VERSION == 6  # 5: $share work-queue fields (defaults when absent); 6: pins
    # Version 3: producers keyed by the id alone, registrations with a copy of the client id.
    raw["version"] = 3
    raw["producers"] = [[P, 1, 0, 1000], [p2, 4, 1, 1000]]
    for r in raw["regs"]:
        r["client_id"] = "cl"
    old = ShardState.restore(msgspec.msgpack.encode(raw), TopicLimits(), 3600)
    assert old.topics.producers == s.topics.producers
    assert old.topics.regs["cl\x00orders/#"].client_id == "cl"
    assert old.snapshot() == s.snapshot()
    assert pub(old, "alice", 1) == "duplicate" and pub(old, "alice", 2) == "ok"
