"""Unit checks of RaftNode rules that the golden scenarios do not pin down."""

from __future__ import annotations

import pytest
from raft_helpers import Group, bootstrap, handle, mid, snapshot_over_log

from moorline.invariant import InvariantViolation
from moorline.raft import (
    ConfChange,
    ConfChangeType,
    ConfState,
    Entry,
    EntryType,
    HardState,
    Message,
    MessageType,
    ProposalDropped,
    RaftNode,
    StateRole,
)


def test_single_node_commits_only_after_its_own_sync() -> None:
    node, st = bootstrap(1, 1)
    node.campaign()
    while node.has_ready():
        handle(node, st)
    assert node.is_leader
    i = node.propose(b"a")
    rd = node.ready()
    assert [e.index for e in rd.entries] == [i] and rd.must_sync
    assert not any(e.index == i for e in rd.committed_entries)
    st.append(rd.entries)
    node.advance(rd)
    rd2 = node.ready()
    assert [e.data for e in rd2.committed_entries] == [b"a"]
    node.advance(rd2)


def test_ready_twice_without_advance_is_a_programming_error() -> None:
    node, _ = bootstrap(1, 1)
    node.campaign()
    node.ready()
    with pytest.raises(InvariantViolation):
        node.ready()


def test_messages_for_another_storage_id_are_ignored() -> None:
    node, st = bootstrap(3, 2)
    stale = Message(type=MessageType.VOTE, from_=mid(1), to=(2, "old-storage"), term=5, index=9, log_term=5)
    node.step(stale)
    assert node.term == 1 and not node.has_ready()


def test_follower_refuses_proposals_and_read_without_leader() -> None:
    node, _ = bootstrap(3, 2)
    with pytest.raises(ProposalDropped):
        node.propose(b"x")
    with pytest.raises(ProposalDropped):
        node.read_index(b"r")


def test_uncommitted_bytes_bound() -> None:
    g = Group(3, max_uncommitted_bytes=250)
    leader = g.elect(1)
    leader.propose(b"x" * 100)
    leader.propose(b"x" * 100)
    with pytest.raises(ProposalDropped):
        leader.propose(b"x" * 100)
    g.stabilize()
    leader.propose(b"x" * 100)  # committed entries free the budget


def test_new_leader_read_index_waits_for_its_noop() -> None:
    g = Group(3)
    leader = g.nodes[mid(1)]
    leader.campaign()
    # Run the election but not the no-op's replication: deliver only vote traffic.
    for _ in range(6):
        for m_id, node in g.nodes.items():
            if node.has_ready():
                _, msgs = handle(node, g.storages[m_id])
                for m in msgs:
                    if m.type != MessageType.APP:
                        g.nodes[m.to].step(m)
    assert leader.is_leader and leader.log.committed < leader.log.last_index()
    leader.read_index(b"ctx")
    rd, _ = handle(leader, g.storages[mid(1)])
    assert not rd.read_states
    leader.tick()  # the dropped no-op probe is retried after the next heartbeat response
    reads = []
    for _ in range(20):
        for m_id, node in g.nodes.items():
            if node.has_ready():
                rd, msgs = handle(node, g.storages[m_id])
                if node is leader:
                    reads.extend(rd.read_states)
                for m in msgs:
                    g.nodes[m.to].step(m)
    assert leader.log.term(leader.log.committed) == leader.term
    assert [(r.ctx, r.index) for r in reads] == [(b"ctx", leader.log.committed)]


def test_leader_cannot_remove_itself() -> None:
    g = Group(3)
    leader = g.elect(1)
    g.stabilize()
    with pytest.raises(ProposalDropped):
        leader.propose_conf_change(ConfChange(ConfChangeType.REMOVE, mid(1)))


def test_conf_change_in_force_when_appended_and_reverted_on_truncation() -> None:
    node, st = bootstrap(3, 2)
    cc = ConfChange(ConfChangeType.ADD_LEARNER, mid(4)).encode()
    # Leader 1 (term 2) sends a conf change that is not committed yet.
    node.step(
        Message(
            type=MessageType.APP,
            from_=mid(1),
            to=mid(2),
            term=2,
            index=1,
            log_term=1,
            commit=1,
            entries=[Entry(2, 2, EntryType.CONF_CHANGE, cc)],
        )
    )
    assert node.active_conf_state == ConfState.of([mid(1), mid(2), mid(3)], [mid(4)])
    assert node.conf_state == ConfState.of([mid(1), mid(2), mid(3)])  # not applied yet
    handle(node, st)
    # A new leader (term 3) overwrites index 2: the change is gone, and so is its configuration.
    node.step(
        Message(
            type=MessageType.APP,
            from_=mid(3),
            to=mid(2),
            term=3,
            index=1,
            log_term=1,
            commit=1,
            entries=[Entry(3, 2)],
        )
    )
    assert node.active_conf_state == ConfState.of([mid(1), mid(2), mid(3)])


def test_restart_restores_configuration_from_the_log() -> None:
    g = Group(3)
    leader = g.elect(1)
    leader.propose_conf_change(ConfChange(ConfChangeType.ADD_LEARNER, mid(4)))
    g.stabilize()
    st = g.storages[mid(2)]
    again = RaftNode(g.nodes[mid(2)].cfg, st)
    assert again.active_conf_state == ConfState.of([mid(1), mid(2), mid(3)], [mid(4)])


def test_corrupted_replica_never_grants_votes() -> None:
    node, st = bootstrap(3, 2)
    node.mark_corrupted()
    for t in (MessageType.PRE_VOTE, MessageType.VOTE):
        node.step(Message(type=t, from_=mid(1), to=mid(2), term=5, index=10, log_term=4))
    _, msgs = handle(node, st)
    assert msgs and all(m.reject for m in msgs)
    for _ in range(100):
        node.tick()
    assert node.role == StateRole.FOLLOWER


def test_stale_leader_steps_down_on_higher_term_response() -> None:
    g = Group(3)
    leader = g.elect(1)
    leader.step(Message(type=MessageType.APP_RESP, from_=mid(2), to=mid(1), term=leader.term + 1, index=0))
    assert leader.role == StateRole.FOLLOWER


def test_hard_state_vote_is_persisted_before_vote_response() -> None:
    node, st = bootstrap(3, 1)
    node.step(Message(type=MessageType.VOTE, from_=mid(2), to=mid(1), term=2, index=1, log_term=1))
    rd = node.ready()
    assert rd.hard_state == HardState(term=2, vote=mid(2), commit=1) and rd.must_sync
    assert [m.type for m in rd.messages] == [MessageType.VOTE_RESP] and not rd.early_messages


def test_snapshot_over_a_held_entry_acks_no_further_than_the_commit_index() -> None:
    """A follower that already holds a snapshot's last entry keeps its log, but entries after it may
    be another leader's branch: its acknowledgement must not claim them (the leader would count it
    toward committing entries it does not hold)."""
    node, st, acks = snapshot_over_log([
        Entry(term=2, index=2, data=b"a"),
        Entry(term=2, index=3, data=b"b"),
        Entry(term=3, index=4, data=b"other-branch"),
        Entry(term=3, index=5, data=b"other-branch"),
    ], term=4, snap_index=3, snap_term=2)  # the snapshot agrees at 3
    assert acks == [3], acks  # was [5]: entries 4-5 of term 3 claimed for a term-4 leader
    assert node.log.committed == 3 and st.last_index() == 5


def test_a_follower_heard_from_last_period_counts_as_active_right_after_the_reset() -> None:
    """check-quorum clears recent_active at the start of every election period, so a host that
    asks at that tick (the leader rebalancer asked every 50 ticks, a multiple of the period) saw
    every live follower as inactive and never moved leadership. is_active also looks at the last
    whole period, and still turns False once a follower stays silent for a whole period."""
    g = Group(3, check_quorum=True)
    leader = g.elect(1)
    leader.propose(b"x")
    g.stabilize()
    assert leader.progress[mid(2)].recent_active
    for _ in range(leader.cfg.election_tick):  # the period ends without any response being stepped
        leader.tick()
    assert leader.is_leader and not leader.progress[mid(2)].recent_active
    assert leader.is_active(mid(2))
    leader.propose(b"y")  # 2 answers, 3 is silent from now on
    g.stabilize(down={3})
    for _ in range(leader.cfg.election_tick):
        leader.tick()
    assert leader.is_leader and leader.is_active(mid(2)) and not leader.is_active(mid(3))
