"""The entry head (issue 32, item 3): a log entry is a fixed head (version byte, the leader's u64
stamp) and its msgpack EntryBatch. A leader restamps a forwarded entry by copying it with the 8
stamp bytes replaced, never decoding or re-encoding it, and decoding gives every command the
stamp: the times a replica applies (lease ends, message times in the store and the index) are
the leader's, not the forwarding node's. Entries of version 1 (no head), in WALs written before,
decode and apply as they did."""

from __future__ import annotations

import pytest

from moorline.broker import commands as c
from moorline.broker.effects import Effects
from moorline.broker.messages import StoredMessage, decode_message
from moorline.broker.shard import ShardState
from moorline.broker.topic_state import TopicLimits

LEADER_NOW = 1_700_000_000_000
FORWARDER_NOW = LEADER_NOW + 3_600_000  # the forwarding node's clock is an hour ahead
GUID = bytes(range(16))

# Made with d8cc58a's encode_entry (version 1: the plain msgpack EntryBatch) from commands(),
# origin 2, boot 1, seq 5; and that entry as d8cc58a's restamp_entry(…, LEADER_NOW) rewrote it.
OLD_ENTRY = bytes.fromhex(
    "9501929ba5736f70656ecf0000018bd01c5680a3636964c2cd0258c0a0c202cd27100095a370756299a3742f61c405"
    "68656c6c6f01c2c410000102030405060708090a0b0c0d0e0fcf0000018bd01c56803cc0a3636964a175c0c0020105")
OLD_RESTAMPED = bytes.fromhex(
    "9501929ba5736f70656ecf0000018bcfe56800a3636964c2cd0258c0a0c202cd27100095a370756299a3742f61c405"
    "68656c6c6f01c2c410000102030405060708090a0b0c0d0e0fcf0000018bcfe568003cc0a3636964a175c0c0020105")


def commands(ts: int) -> list[c.Command]:
    return [c.SessionOpen(ts, "cid", False, 600, None, owner_node=2, lease_ms=10_000),
            c.Publish(StoredMessage("t/a", b"hello", 1, False, GUID, ts, expiry_s=60, origin="cid"), principal="u")]


def apply_all(cmds: list[c.Command]) -> tuple[ShardState, Effects]:
    state = ShardState(0, "inc", TopicLimits(), 3600)
    fx = Effects()
    for cmd in cmds:
        if type(cmd) is c.Publish:
            state.apply_publishes([cmd], fx)
        else:
            state.apply(cmd, fx)
    return state, fx


def applied_times(cmds: list[c.Command]) -> dict[str, int]:
    """Every time the apply of commands() recorded, read back from the state and its effects."""
    state, fx = apply_all(cmds)
    (offset, record, msg), = fx.appends
    ((index_offset, index_ts, expires),) = list(state.topics.meta.times())
    return {"lease_until": state.sessions.sessions["cid"].lease_until_ms - 10_000,
            "topic_last": state.topics.last_ts_ms,
            "stored_record": decode_message(record).ts_ms,  # what the message store keeps
            "delivered": msg.ts_ms,  # what deliveries and the recent-message cache use
            "index": index_ts,
            "expiry": expires - 60_000}


def test_a_restamped_entry_applies_the_leaders_time_everywhere() -> None:
    forwarded = c.encode_entry(commands(FORWARDER_NOW), origin=2, boot=1, seq=5)
    assert c.entry_stamp(forwarded) is None  # as proposed: its commands keep their times
    stamped = c.restamp_entry(forwarded, LEADER_NOW)
    assert c.entry_stamp(stamped) == LEADER_NOW
    times = applied_times(c.decode_entry(stamped))
    assert times == dict.fromkeys(times, LEADER_NOW), times  # never the forwarder's clock
    # (unstamped, it applies the forwarder's times: the stamp is what moved them)
    assert set(applied_times(c.decode_entry(forwarded)).values()) == {FORWARDER_NOW}
    # a restamp of a restamped entry (a leader change, resent) takes the new stamp
    assert set(applied_times(c.decode_entry(c.restamp_entry(stamped, LEADER_NOW + 7))).values()) == {LEADER_NOW + 7}


def test_restamp_is_a_copy_with_the_stamp_bytes_replaced_and_decodes_nothing() -> None:
    forwarded = c.encode_entry(commands(FORWARDER_NOW), origin=2, boot=1, seq=5)
    stamped = c.restamp_entry(forwarded, LEADER_NOW)
    assert len(stamped) == len(forwarded)
    assert stamped[:1] == forwarded[:1] == bytes([c.ENTRY_VERSION])
    assert stamped[1:c.ENTRY_HEAD_BYTES] == LEADER_NOW.to_bytes(8, "big")
    assert stamped[c.ENTRY_HEAD_BYTES:] == forwarded[c.ENTRY_HEAD_BYTES:]
    # nothing of the body is read: a body no decoder takes is restamped all the same
    garbage = forwarded[:c.ENTRY_HEAD_BYTES] + b"\xc1 not msgpack"
    assert c.restamp_entry(garbage, 5)[c.ENTRY_HEAD_BYTES:] == b"\xc1 not msgpack"
    with pytest.raises(ValueError):
        c.decode_entry(garbage)
    head = c.decode_head(stamped)  # the proposal id, read without the commands (cluster link, apply)
    assert (head.origin, head.boot, head.seq) == (2, 1, 5)
    with pytest.raises(ValueError, match="out of range"):
        c.restamp_entry(forwarded, -1)


def test_an_unstamped_entry_keeps_each_commands_time() -> None:
    """A leader's own proposal: the times its commands were made with, one by one."""
    cmds = [c.SessionHousekeeping(LEADER_NOW), c.SessionHousekeeping(LEADER_NOW + 3), c.SessionHousekeeping(0)]
    assert c.decode_entry(c.encode_entry(cmds)) == cmds


def test_a_version_1_entry_decodes_and_applies_as_before() -> None:
    """Entries written before the head (d8cc58a's encoder) in existing WALs: the same commands,
    the same state after apply, byte for byte."""
    old = c.decode_batch(OLD_ENTRY)
    assert (old.version, old.origin, old.boot, old.seq) == (1, 2, 1, 5)
    assert old.commands == commands(FORWARDER_NOW)
    assert c.entry_stamp(OLD_ENTRY) is None
    assert c.decode_head(OLD_ENTRY).seq == 5
    restamped = c.decode_entry(OLD_RESTAMPED)  # an old leader restamped it in its commands
    assert restamped == commands(LEADER_NOW)
    for data, ts in ((OLD_ENTRY, FORWARDER_NOW), (OLD_RESTAMPED, LEADER_NOW)):
        state, _ = apply_all(c.decode_entry(data))
        expected, _ = apply_all(commands(ts))
        assert state.snapshot() == expected.snapshot()
    assert set(applied_times(restamped).values()) == {LEADER_NOW}
    # a node of an earlier version forwards a version-1 entry: restamped the old way, still version 1
    again = c.restamp_entry(OLD_ENTRY, LEADER_NOW)
    assert again == OLD_RESTAMPED


def test_unknown_or_damaged_entries_get_a_clear_error() -> None:
    body = c.encode_entry(commands(LEADER_NOW))[c.ENTRY_HEAD_BYTES:]
    cases = {
        bytes([3]) + bytes(8) + body: "unsupported entry version 3",
        bytes([0x7F]) + body: "unsupported entry version 127",
        b"": "empty entry",
        bytes([c.ENTRY_VERSION, 0, 0]): "shorter than its head",
        # a head of version 2 over a body naming version 1, and a headless body naming version 7
        bytes([c.ENTRY_VERSION]) + bytes(8) + OLD_ENTRY: "unsupported entry version 1",
        b"\x95\x07" + OLD_ENTRY[2:]: "unsupported entry version 7",
    }
    for data, message in cases.items():
        with pytest.raises(ValueError, match=message):
            c.decode_entry(data)
    with pytest.raises(ValueError, match="unsupported entry version 3"):
        c.restamp_entry(bytes([3]) + bytes(8) + body, LEADER_NOW)


def test_format_1_for_a_rolling_upgrade_is_what_nodes_before_format_2_wrote() -> None:
    """cluster.entry_format = 1: the proposal is byte for byte the entry d8cc58a's encoder made,
    which nodes before format 2 read; restamped as they did it."""
    entry = c.encode_entry(commands(FORWARDER_NOW), 2, 1, 5, version=c.LEGACY_ENTRY_VERSION)
    assert entry == OLD_ENTRY
    assert c.restamp_entry(entry, LEADER_NOW) == OLD_RESTAMPED
