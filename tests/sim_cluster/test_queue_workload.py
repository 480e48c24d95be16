"""Work queues in the cluster simulator (issue 33; docs/queues.md, docs/simulation.md): the workload's
single-active group, poison messages and stalling consumer run and leave a clean history, and each
new judgement fails on that history (or state) doctored to hold exactly its anomaly:

- *delivery_limit_exceeded*: a message of a group with a delivery limit reached more member
  sessions than the limit;
- *dead_letter_lost*: a message the broker dead-lettered never reached the dead-letter subscriber;
- *single_active_two_holders* (a check of the world's state at each delivery to a member): two
  members of the single-active group hold messages at once;
- the bug switch ``dlq_count_not_replicated`` in the pure state machine: no replicated count.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest

from moorline.broker import commands as c
from moorline.broker.effects import Effects
from moorline.broker.topic_state import DELIVERY_LIMIT, TopicLimits
from moorline.sim.cluster.checkers import MAX_DELIVERIES_DETAIL, analyze_history, check_history
from moorline.sim.cluster.workload import DL_GROUP, SA_FILTER, SA_GROUP, Workload, run_workload
from moorline.sim.cluster.world import World
from tests.broker.share_helpers import KEY, group, publish

Rec = dict[str, Any]
SEED = 3


@pytest.fixture(scope="module")
def run() -> Any:
    r = run_workload(SEED, during=_doctor_single_active)
    assert r.drained and not r.workload.errors
    return r


_doctored: list[tuple[str, str]] = []


def _doctor_single_active(world: World, wl: Workload) -> None:
    """Once, while a member of the single-active group holds a message on some replica: a second
    member's claim is put beside it for one check (then taken away again)."""
    if _doctored:
        return
    key = f"{c.SHARE_PREFIX}{SA_GROUP}\x00{SA_FILTER}"
    for sn in world.nodes:
        if sn.node is None or sn.crashed or not sn.ready:
            continue
        for host in sn.node.hosts:
            reg = host.state.topics.regs.get(key)
            if reg is None or not reg.claims or reg.queue is None:
                continue
            free = next((o for o in reg.owed if o not in reg.claims), -1)
            reg.claims[free] = ("intruder", 1)
            before = list(wl.state_findings)
            wl.check_single_active()
            del reg.claims[free]
            _doctored.extend(f for f in wl.state_findings if f not in before)
            wl.state_findings[:] = before
            return


def kinds(records: list[Rec]) -> Counter[str]:
    return Counter(v.kind for v in analyze_history(records).violations)


def test_the_queue_clients_ran_and_the_history_is_clean(run: Any) -> None:
    st = run.workload.stats_by_kind
    assert st["queue"]["deliveries"] > 10 and run.workload.stats["single_active_checks"] > 10
    assert st["dead_letter"]["poison_received"] + st["staller"]["poison_received"] >= 3
    assert st["staller"]["stalls"] >= 1
    dlq = [r for r in run.records if r.get("session") == "dlq" and r["op"] == "deliver"]
    drops = [r for r in run.records if r["op"] == "drop" and r.get("reason") == DELIVERY_LIMIT]
    assert drops and {r["guid"] for r in dlq} == {r["guid"] for r in drops}
    assert check_history(run.records) == []
    assert run.workload.state_findings == []


def test_a_closed_stalled_member_is_disconnected_for_its_ack_timeout(run: Any) -> None:
    closed = [r for r in run.records if r.get("session", "").startswith("dl") and r["op"] == "disconnect"
              and r.get("reason") in ("server disconnect 0x83", "closed by the broker")]
    assert closed, "the stalling consumer was never closed by the broker"


def test_delivery_limit_exceeded_is_caught(run: Any) -> None:
    doctored = copy.deepcopy(run.records)
    for r in doctored:
        if r["op"] == "subscribe" and r.get("share_group") == DL_GROUP and r.get("detail"):
            r["detail"] = f"{MAX_DELIVERIES_DETAIL}1"  # every poison message reached more than one
    assert kinds(doctored)["delivery_limit_exceeded"] >= 1
    assert kinds(run.records)["delivery_limit_exceeded"] == 0


def test_dead_letter_lost_is_caught(run: Any) -> None:
    dead = next(r["guid"] for r in run.records if r["op"] == "drop" and r.get("reason") == DELIVERY_LIMIT)
    doctored = [r for r in copy.deepcopy(run.records)
                if not (r.get("session") == "dlq" and r.get("guid") == dead and r["op"] in ("deliver", "ack"))]
    found = [v for v in analyze_history(doctored).violations if v.kind == "dead_letter_lost"]
    assert [v.guid for v in found] == [dead]


def test_two_holders_of_a_single_active_group_are_caught(run: Any) -> None:
    assert [k for k, _ in _doctored] == ["single_active_two_holders"]
    assert "intruder" in _doctored[0][1]


@pytest.mark.parametrize("broken", [False, True])
def test_the_switch_keeps_no_replicated_count(broken: bool) -> None:
    """dlq_count_not_replicated in the pure state machine: returns never make a message dead, and
    the (leader-memory) dispatcher's ShareDeadLettered is taken for any owed message."""
    s = group("a", max_deliveries=2)
    s.topics.limits = TopicLimits(dlq_count_not_replicated=broken)
    t = s.topics
    (offset,) = publish(s, 1)
    reg = t.regs[KEY]
    for _ in range(2):
        assert t.apply_share_claim(c.ShareClaim(KEY, "a", (offset,), 1), Effects()) == (offset,)
        t.apply_share_return(c.ShareReturn(KEY, "a", (), 1), Effects())
    assert (offset in reg.queue.dead) is not broken  # type: ignore[union-attr]
    t.apply_share_dead_lettered(c.ShareDeadLettered(KEY, (offset,)), Effects())
    assert offset not in reg.owed  # released either way: by the replicated count, or by the dispatcher's word
