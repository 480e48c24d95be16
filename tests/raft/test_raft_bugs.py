"""Each RaftBugs switch produces its bad behaviour at the unit level (so the simulator's
checkers have something real to catch), and the correct core does not."""

from __future__ import annotations

from raft_helpers import Group, bootstrap, handle, mid, snapshot_over_log

from moorline.raft import Entry, HardState, Message, MessageType, RaftBugs, StateRole


def _vote_request(term: int) -> Message:
    return Message(type=MessageType.VOTE, from_=mid(2), to=mid(1), term=term, index=1, log_term=1)


def test_vote_without_persist_leaves_vote_out_of_hard_state() -> None:
    for buggy in (False, True):
        node, st = bootstrap(3, 1, RaftBugs(vote_without_persist=buggy))
        node.step(_vote_request(term=2))
        rd, msgs = handle(node, st)
        granted = [m for m in msgs if m.type == MessageType.VOTE_RESP and not m.reject]
        assert granted, "the vote is granted in both cases"
        assert rd.hard_state is not None
        if buggy:
            assert rd.hard_state.vote is None  # a restart forgets the vote: two votes in term 2 possible
        else:
            assert rd.hard_state == HardState(term=2, vote=mid(2), commit=1)
            assert rd.must_sync


def test_vote_without_persist_allows_second_vote_after_restart() -> None:
    node, st = bootstrap(3, 1, RaftBugs(vote_without_persist=True))
    node.step(_vote_request(term=2))
    handle(node, st)
    restarted, _ = bootstrap(3, 1)
    restarted = type(node)(restarted.cfg, st)  # same storage, as after a crash
    restarted.step(Message(type=MessageType.VOTE, from_=mid(3), to=mid(1), term=2, index=1, log_term=1))
    _, msgs = handle(restarted, st)
    assert any(m.type == MessageType.VOTE_RESP and not m.reject and m.to == mid(3) for m in msgs)


def _leader_with_old_term_entry(buggy: bool):
    """Node 1 holds 2/2 (an entry of an older term) and becomes leader in term 3."""
    node, st = bootstrap(3, 1, RaftBugs(commit_prev_term_by_count=buggy))
    st.append([Entry(term=2, index=2, data=b"old")])
    st.set_hard_state(HardState(term=2, vote=None, commit=1))
    node = type(node)(node.cfg, st)
    node.campaign()
    handle(node, st)
    for voter in (2, 3):
        node.step(Message(type=MessageType.PRE_VOTE_RESP, from_=mid(voter), to=mid(1), term=3))
    handle(node, st)
    node.step(Message(type=MessageType.VOTE_RESP, from_=mid(2), to=mid(1), term=3))
    assert node.role == StateRole.LEADER and node.term == 3
    return node, st


def test_commit_prev_term_by_count() -> None:
    for buggy in (False, True):
        node, st = _leader_with_old_term_entry(buggy)
        # Follower 2 acknowledges the old entry 2/2 but not yet the leader's no-op 3/3.
        node.step(Message(type=MessageType.APP_RESP, from_=mid(2), to=mid(1), term=3, index=2))
        # The leader itself holds 2/2 durably, so a majority (1, 2) holds index 2.
        assert node.log.persisted_last_index() >= 2
        if buggy:
            assert node.log.committed == 2  # Figure 8: may later be overwritten
        else:
            assert node.log.committed == 1


def test_no_election_reset_on_append() -> None:
    for buggy in (False, True):
        node, st = bootstrap(3, 2, RaftBugs(no_election_reset_on_append=buggy))
        campaigned = False
        for _ in range(100):
            node.step(
                Message(type=MessageType.APP, from_=mid(1), to=mid(2), term=2, index=1, log_term=1, commit=1)
            )
            node.tick()
            if node.role != StateRole.FOLLOWER:
                campaigned = True
                break
            if node.has_ready():
                handle(node, st)
        assert campaigned == buggy


def test_self_ack_before_sync() -> None:
    for buggy in (False, True):
        node, st = bootstrap(1, 1, RaftBugs(self_ack_before_sync=buggy))
        node.campaign()
        while node.has_ready():
            handle(node, st)
        index = node.propose(b"x")
        if buggy:
            assert node.log.committed == index  # counted before the host synced it
            rd = node.ready()
            assert rd.committed_entries and rd.entries and rd.committed_entries[-1].index == index
            assert not rd.must_sync  # and the host is told it need not sync them
        else:
            assert node.log.committed < index
            rd = node.ready()
            assert [e.index for e in rd.entries] == [index] and rd.must_sync
            assert not rd.committed_entries or rd.committed_entries[-1].index < index


def test_self_ack_three_nodes_needs_leader_sync() -> None:
    g = Group(3)
    leader = g.elect(1)
    index = leader.propose(b"y")
    rd = leader.ready()  # host starts syncing; appends go out early
    assert [m.to for m in rd.early_messages] == [mid(2), mid(3)]
    leader.step(Message(type=MessageType.APP_RESP, from_=mid(2), to=mid(1), term=leader.term, index=index))
    assert leader.log.committed < index  # leader's own copy is not durable yet
    g.storages[mid(1)].append(rd.entries)
    leader.advance(rd)
    assert leader.log.committed == index


def test_hard_state_sync_skipped_sends_a_vote_before_its_fsync() -> None:
    for buggy in (False, True):
        node, st = bootstrap(3, 1, RaftBugs(hard_state_sync_skipped=buggy))
        node.step(_vote_request(term=2))
        rd = node.ready()
        assert rd.hard_state == HardState(term=2, vote=mid(2), commit=1)  # written either way
        assert any(m.type == MessageType.VOTE_RESP and not m.reject for m in rd.messages)
        assert rd.must_sync is not buggy  # the grant may leave before the vote is durable


def test_accept_stale_term_append() -> None:
    for buggy in (False, True):
        node, st = bootstrap(3, 2, RaftBugs(accept_stale_term_append=buggy))
        # term 3: entry 2 from the leader of term 3
        node.step(Message(type=MessageType.APP, from_=mid(1), to=mid(2), term=3, index=1, log_term=1,
                          entries=[Entry(term=3, index=2, data=b"new")], commit=1))
        handle(node, st)
        # a deposed leader of term 2 sends its own entry 2
        node.step(Message(type=MessageType.APP, from_=mid(3), to=mid(2), term=2, index=1, log_term=1,
                          entries=[Entry(term=2, index=2, data=b"old")], commit=1))
        _, msgs = handle(node, st)
        assert node.term == 3
        if buggy:
            assert st.term(2) == 2 and node.lead == mid(3)  # the acknowledged entry of term 3 is gone
        else:
            assert st.term(2) == 3 and node.lead == mid(1)
            assert [(m.type, m.term, m.to) for m in msgs] == [(MessageType.APP_RESP, 3, mid(3))]


def test_conf_change_while_pending() -> None:
    from moorline.raft import ConfChange, ConfChangeType, ProposalDropped

    for buggy in (False, True):
        g = Group(3, bugs={1: RaftBugs(conf_change_while_pending=buggy)})
        leader = g.elect(1)
        leader.propose_conf_change(ConfChange(ConfChangeType.REMOVE, mid(3)))  # not applied yet
        second = ConfChange(ConfChangeType.REMOVE, mid(2))
        if buggy:
            leader.propose_conf_change(second)
            assert len(leader.active_conf_state.voters) == 1  # two voters gone at once
        else:
            try:
                leader.propose_conf_change(second)
            except ProposalDropped as exc:
                assert "pending" in str(exc)
            else:
                raise AssertionError("a second change while one is pending was accepted")


def test_forget_vote_on_restart() -> None:
    for buggy in (False, True):
        node, st = bootstrap(3, 1)
        node.step(_vote_request(term=2))
        handle(node, st)  # the vote for node 2 is durable
        restarted = type(node)(bootstrap(3, 1, RaftBugs(forget_vote_on_restart=buggy))[0].cfg, st)
        assert restarted.term == 2
        assert restarted.vote == (None if buggy else mid(2))
        restarted.step(Message(type=MessageType.VOTE, from_=mid(3), to=mid(1), term=2, index=1, log_term=1))
        _, msgs = handle(restarted, st)
        granted = [m for m in msgs if m.type == MessageType.VOTE_RESP and not m.reject]
        assert bool(granted) == buggy  # a second vote in term 2


def test_heartbeat_commit_unclamped() -> None:
    for buggy in (False, True):
        g = Group(3, bugs={1: RaftBugs(heartbeat_commit_unclamped=buggy)})
        leader = g.elect(1)
        leader.propose(b"x")
        g.stabilize(down={3})  # node 3 is behind: its match is below the commit index
        assert leader.log.committed > leader.progress[mid(3)].match
        for _ in range(leader.cfg.heartbeat_tick):
            leader.tick()
        rd = leader.ready()
        hb = [m for m in rd.early_messages + rd.messages if m.type == MessageType.HEARTBEAT and m.to == mid(3)]
        assert hb
        expected = leader.log.committed if buggy else leader.progress[mid(3)].match
        assert hb[0].commit == expected


def test_snapshot_keeps_log_tail() -> None:
    for buggy in (False, True):
        _, st, ack = snapshot_over_log(
            [Entry(term=2, index=2, data=b"a"), Entry(term=3, index=3, data=b"b"), Entry(term=3, index=4, data=b"c")],
            term=5, snap_index=3, snap_term=4, bugs=RaftBugs(snapshot_keeps_log_tail=buggy),
        )  # the snapshot disagrees at 3
        if buggy:
            assert st.last_index() == 4 and st.term(4) == 3 and ack == [4]  # entry 4 of another branch kept
        else:
            assert st.last_index() == 3 and ack == [3]
