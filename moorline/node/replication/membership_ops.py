"""The operators' changes to the membership, and join admission: methods of the membership driver
(``MembershipOps`` is a base class of ``MembershipDriver``), called by the HTTP routes
(admin/cluster_admin_api.py) and, for a join request, by the cluster link. Like the reconciler's,
each goes through the metadata group (``propose_meta``, ``_operator_change``) and is answered
with an ``OpResult``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moorline.broker import commands as c
from moorline.broker.membership import GONE, MembershipState
from moorline.cluster.auth import ClusterConfigError, require_tls_or_loopback
from moorline.config import ConfigError
from moorline.node.replication.cluster_spec import parse_hostport
from moorline.node.replication.membership_views import MembershipViews, move_summary
from moorline.node.replication.reconcile import forget_check, live_majority_after_removal
from moorline.node.replication.shard_host import ShardUnavailable, outcome_within

log = logging.getLogger("moorline.membership")  # the driver's logger (membership.py)

PROPOSE_TIMEOUT_S = 5.0


@dataclass
class OpResult:
    """An operator command's answer: the HTTP status and its JSON body."""

    status: int
    body: dict[str, Any]


class MembershipOps(MembershipViews):
    if TYPE_CHECKING:  # MembershipDriver's (membership.py); declared for the type checker only
        def kick(self) -> None: ...

    # --- join: a member admitted by an operator starts with --join ---------------------------
    def on_join_request(self, peer: str, body: dict[str, Any]) -> None:
        """The link heard a join request (``cluster_join.join_cluster``) from an admitted member."""
        self.node.run_in_background(asyncio.get_running_loop().create_task(self._answer_join(peer, body)))

    async def _answer_join(self, peer: str, body: dict[str, Any]) -> None:
        """Bind the joining node's storage to its entry (a replicated command), then tell it the
        cluster (its node id, the initial members, every member's id and address, the layout).
        Unanswered when the metadata group cannot commit now: the node asks again."""
        table, link = self.table, self.node.link
        meta = self.node.meta_host
        record = meta.state.cluster if meta is not None else None
        if table is None or link is None or record is None:
            return
        sid = body.get("storage_id")
        m = table.members.get(peer)
        why = None
        if not isinstance(sid, str) or not sid:
            why = "the join request names no storage id"
        elif m is None:
            why = f"{peer} is not a member: admit it first (moorline cluster join {peer} --cluster HOST:PORT)"
        elif m.state != "active":
            why = f"{peer} is {m.state}"
        elif m.storage_id and m.storage_id != sid:
            why = (f"{peer} is a member with storage id {m.storage_id}, and this data directory's is {sid}: a wiped "
                   f"or new node under a member's name is forgotten first (moorline cluster forget {peer}), then "
                   f"admitted again (moorline cluster join)")
        if why is None and m is not None and not m.storage_id:
            try:
                why = await self.propose_meta(c.MemberAnnounce(
                    c.MemberInfo(peer, m.node_id, str(sid), m.cluster, m.client, m.zone), self.node.now_ms()))
            except (TimeoutError, ShardUnavailable):
                return
            if why is None:
                log.info("%s joined the cluster (node id %d, storage %s)", peer, m.node_id, sid)
                self.kick()
        if why is not None:
            log.warning("refused %s's join: %s", peer, why)
            link.send_welcome(peer, {"error": why})
            return
        assert m is not None
        link.send_welcome(peer, {
            "node_id": m.node_id, "cluster_id": record.cluster_id,
            "names": [name for name, _, _ in record.members],
            "initial": [[name, nid, s] for name, nid, s in record.members],
            "shard_count": record.shard_count, "replicas": record.replicas,
            # the shard.learners the groups' initial configurations were placed with (cluster.json)
            "learners": self.node.cluster_meta.get("learners", "all"),
            "members": {x.name: [x.node_id, x.cluster, x.storage_id] for x in table.members.values()
                        if x.state not in GONE and x.cluster},
        })

    async def admit(self, name: str, cluster: str, zone: str) -> OpResult:
        """``moorline cluster join``: a node that is to join gets its entry (and node id) before it
        starts; every member's link then takes its connections. It binds its storage on its first
        start with ``--join``."""
        table = self._require_table()
        if isinstance(table, OpResult):
            return table
        if not name or any(ch in name for ch in "@=,: /") or len(name) > 64:
            return OpResult(400, {"error": f"a node name is 1 to 64 characters without '@=,: /', not {name!r}"})
        try:
            host, _ = parse_hostport(cluster, "the cluster address")
        except ConfigError as exc:
            return OpResult(400, {"error": str(exc)})
        if not self.node.cfg.cluster.tls.cert_file and self.node.seams.cluster_network is None:
            try:
                require_tls_or_loopback([host])
            except ClusterConfigError as exc:
                return OpResult(409, {"error": str(exc)})
        seeds = ",".join(x.cluster for x in table.members.values()
                         if x.state == "active" and x.cluster and x.name in self.live_names())
        start = f"moorline run --node-id {name} --cluster {cluster} --join {seeds}"
        m = table.members.get(name)
        if m is not None and m.state != "forgotten":
            if not m.storage_id and m.cluster == cluster:
                return OpResult(200, {"member": name, "node_id": m.node_id, "state": "admitted, not started yet",
                                      "start": start})
            return OpResult(409, {"error": f"{name} is already a member ({m.state}); a node under a member's name "
                                           f"joins again once that member is forgotten"})
        if any(x.cluster == cluster and x.state not in GONE for x in table.members.values()):
            return OpResult(409, {"error": f"{cluster} is another member's cluster address"})
        node_id = table.next_node_id()
        refused = await self._operator_change(c.MemberAnnounce(c.MemberInfo(name, node_id, "", cluster, "", zone),
                                                               self.node.now_ms()))
        if isinstance(refused, OpResult):
            return refused
        self.kick()
        return OpResult(201, {"member": name, "node_id": node_id, "state": "admitted, not started yet",
                              "start": start,
                              "note": "start the node with this command (and the cluster's secret or its certificate, "
                                      "and the same shard settings); it becomes a learner of every shard, then "
                                      "the reconciler gives it its share of voters"})

    async def propose_meta(self, cmd: c.Command) -> Any:
        """``cmd`` through the metadata group: what its apply returned (TimeoutError or
        ShardUnavailable when not committed within PROPOSE_TIMEOUT_S). Public: the driver's
        announcements and planning (membership.py) propose through it too."""
        fut = self.node.propose(self.node.meta_group, cmd)
        if fut is None:
            raise ShardUnavailable("the metadata group took no proposal")
        return await outcome_within(fut, PROPOSE_TIMEOUT_S)

    async def _operator_change(self, cmd: c.Command) -> Any:
        """An operator's change through the metadata group: what its apply returned, or the answer
        to give instead (503: not committed in time; 409: the member table refused it, saying why)."""
        try:
            result = await self.propose_meta(cmd)
        except (TimeoutError, ShardUnavailable) as exc:
            return OpResult(503, {"error": f"the metadata group did not commit the change: {exc}"})
        if isinstance(result, str):
            return OpResult(409, {"error": result})
        return result


    # --- operators' commands ------------------------------------------------------------------
    def _require_table(self) -> MembershipState | OpResult:
        table = self.table
        if table is None or self.node.link is None:
            return OpResult(409, {"error": "this node is not a cluster member with a member table yet "
                                           "(single node, or the metadata group has no cluster record)"})
        return table

    async def forget(self, name: str, force: bool) -> OpResult:
        table = self._require_table()
        if isinstance(table, OpResult):
            return table
        m = table.members.get(name)
        if m is None:
            return OpResult(404, {"error": f"no member named {name!r}"})
        if m.state == "forgotten":
            return OpResult(200, {"member": name, "state": "forgotten", "note": "already forgotten"})
        live_names = self.live_names()
        risks: list[str] = []
        if name in live_names:
            risks.append(f"{name} is live (this node hears from it): forget is for a node gone for good; "
                         f"a live node is taken out with leave")
        live = {x.member_id for x in table.members.values() if x.name in live_names and x.name != name}
        voters = {h.shard: h.raft.active_conf_state.voters for h in self.node.groups}
        problems = forget_check(voters, m.member_id, live)
        if problems:
            risks.append("removing it would leave these groups without a live majority of their voters (they "
                         "could not commit the change, nor anything else): " + "; ".join(problems))
        if risks and not force:
            return OpResult(409, {"error": f"refusing to forget {name}", "reasons": risks,
                                  "force": "--force records the node as forgotten anyway: its memberships are "
                                           "removed where a live majority remains; the groups named stay "
                                           "unavailable until enough of their voters return, and a live node "
                                           "forgotten keeps serving what it can until it is stopped"})
        refused = await self._operator_change(c.MemberSetState(name, "forgotten", self.node.now_ms()))
        if isinstance(refused, OpResult):
            return refused
        self.kick()
        return OpResult(200, {"member": name, "state": "forgotten", "forced": bool(risks),
                              "risks": risks, "shards": sorted(s for s, v in voters.items() if m.member_id in v)})

    async def leave(self, name: str) -> OpResult:
        """A live node goes away: every shard it votes in gets a voter elsewhere first, then loses
        its (grow before shrink); once it is in no shard it is ``left``, and it stops by itself."""
        table = self._require_table()
        if isinstance(table, OpResult):
            return table
        m = table.members.get(name)
        if m is None:
            return OpResult(404, {"error": f"no member named {name!r}"})
        if m.state in ("leaving", "left"):
            return OpResult(200, {"member": name, "state": m.state, "note": f"already {m.state}"})
        if m.state == "forgotten":
            return OpResult(409, {"error": f"{name} was forgotten"})
        live_names = self.live_names()
        if name not in live_names:
            return OpResult(409, {"error": f"{name} is not live (this node does not hear from it): a node gone for "
                                           f"good is forgotten (moorline cluster forget), not left"})
        others = [x.name for x in table.members.values() if x.name != name and x.state == "active"
                  and x.name in live_names]
        need = max(table.targets, default=0)
        if len(others) < need:
            return OpResult(409, {"error": f"refusing: after {name} leaves, {len(others)} live active node(s) remain "
                                           f"({', '.join(sorted(others)) or 'none'}) and a shard needs {need} voters; "
                                           f"the shards it votes in could not be given a replacement"})
        refused = await self._operator_change(c.MemberSetState(name, "leaving", self.node.now_ms()))
        if isinstance(refused, OpResult):
            return refused
        self.kick()
        voted = sorted(h.shard for h in self.node.hosts if m.member_id in h.raft.active_conf_state.voters)
        return OpResult(202, {"member": name, "state": "leaving", "shards": voted,
                              "note": "each of these shards gets a voter elsewhere, then loses this node's; once "
                                      "it is in no shard it is left and stops (exit 0)"})

    async def change_replica(self, shard: int, name: str, kind: str) -> OpResult:
        """``add-replica`` (kind "add": promote a caught-up learner, else add it as a learner first) or
        ``remove-replica`` (kind "remove")."""
        table = self._require_table()
        if isinstance(table, OpResult):
            return table
        if not 0 <= shard < self.node.shard_count:
            return OpResult(404, {"error": f"no shard {shard} (shards are 0..{self.node.shard_count - 1})"})
        m = table.members.get(name)
        if m is None:
            return OpResult(404, {"error": f"no member named {name!r}"})
        conf = self.node.groups[shard].raft.active_conf_state
        if kind == "add":
            if m.member_id in conf.voters:
                return OpResult(409, {"error": f"{name} is already a voter of shard {shard}"})
            move_kind = "promote" if m.member_id in conf.learners else "add_learner"
        else:
            if m.member_id not in conf.voters and m.member_id not in conf.learners:
                return OpResult(409, {"error": f"{name} is not a member of shard {shard}"})
            if m.member_id in conf.voters:
                live_names = self.live_names()
                live = {x.member_id for x in table.members.values() if x.name in live_names}
                if not live_majority_after_removal(conf.voters, m.member_id, live):
                    return OpResult(409, {"error": f"removing {name} would leave shard {shard} without a live "
                                                   f"majority of its voters"})
            move_kind = "remove"
        result = await self._operator_change(c.MoveStart(shard, move_kind, name, m.node_id, m.storage_id, "manual",
                                                         self.node.now_ms()))
        if isinstance(result, OpResult):
            return result
        return OpResult(202, {"shard": shard, "move": move_summary(result),
                              "note": "the shard's leader proposes it; GET /v1/cluster shows it until it is done"
                                      + (" (a learner first: add-replica again once it is caught up to make it a "
                                         "voter)" if move_kind == "add_learner" else "")})

