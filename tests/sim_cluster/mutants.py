"""Mutation testing of the cluster simulator (issue 28 item 5; docs/simulation.md, "Mutation testing").

A maintained list of realistic one-to-five-line slips in node code. Each is applied to a COPY of
the ``moorline/`` tree (never as a switch in production code): its original snippet is searched
for in every ``.py`` file of the copy and must occur exactly once in the whole tree (files move;
the snippet, not a path, locates the mutation). A mutant whose snippet is not found exactly once
is reported ``stale``: the list needs maintenance, it neither survived nor was caught.

For each mutant the copy is run with ``moorline sim --cluster``'s seed runner (seeds of the
default fault mix and workload from ``--start``, 3 nodes) in a child process whose
``PYTHONPATH`` points at the copy (it, not the installed package, is imported: the child checks)
with ``PYTHONHASHSEED=0`` (as ``moorline sim --cluster`` forces it), until the first seed with a
violation or the seed budget. A sanity run of the unmutated copy on the first seeds comes first:
if the unmutated build is not clean there, no mutant result means anything. A catch counts only
if the unmutated copy is clean at that seed too (or the mutant shows a kind it does not): a seed
the default build fails itself is reported as such, and the mutant runs on from the next seed.

    python -m tests.sim_cluster.mutants                       # every mutant, 200 seeds each
    python -m tests.sim_cluster.mutants --seeds 40 --jobs 1   # a cheaper pass
    python -m tests.sim_cluster.mutants --only read_barrier_off_by_one --seeds 10
    python -m tests.sim_cluster.mutants --check               # only: every snippet found once
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout whose moorline/ tree is mutated
PACKAGE = "moorline"
SIMULATOR_DIRS = ("sim", "testing")  # what judges the code: never a mutation's target
SEED_WALL_LIMIT_S = 240.0  # a seed of one 3-node world that takes longer than this hung


@dataclass(frozen=True)
class Mutant:
    name: str
    area: str
    original: str  # occurs exactly once in the whole moorline/ tree
    replacement: str
    slip: str  # what the slip is, in one line


MUTANTS: list[Mutant] = [
    # --- group commit -------------------------------------------------------------------------
    Mutant(
        "gc_vote_unsynced", "group commit",
        "if rd is not None and not rd.must_sync and not rd.entries and rd.snapshot is None:",
        "if rd is not None and not rd.entries and rd.snapshot is None:",
        "a Ready whose hard state must be durable before its messages (a vote) is handled without a sync",
    ),
    Mutant(
        "gc_followup_unsynced", "group commit",
        "if rd.entries or rd.snapshot is not None or rd.must_sync:",
        "if rd.entries or rd.snapshot is not None:",
        "after a sync, a following Ready that must be synced (a vote, a new term) is sent at once instead",
    ),
    # --- snapshots ----------------------------------------------------------------------------
    Mutant(
        "snapshot_restore_forgets_proposals", "snapshots",
        "st.proposals = {o: (b, s) for o, b, s in snap.proposals}",
        "st.proposals = {}",
        "a restored replica forgets the apply-order table (which proposals of each node it applied)",
    ),
    Mutant(
        "snapshot_restore_owed_count", "snapshots",
        "t.owed_count[o] = t.owed_count.get(o, 0) + 1",
        "t.owed_count[o] = 1",
        "a restored replica counts a message owed to several registrations as owed to one",
    ),
    Mutant(
        "snapshot_restore_drops_retained", "snapshots",
        "t.retained = {m.topic: m for m in snap.retained}",
        "t.retained = {m.topic: m for m in snap.retained if m.qos > 0}",
        "a restored replica keeps only the QoS 1/2 retained messages",
    ),
    Mutant(
        "install_keeps_deposed_tail", "snapshots",
        "        if wal.last_index(shard) > index:\n            wal.truncate(shard, index + 1)\n",
        "",
        "installing a leader's snapshot leaves the deposed leader's entries after its index in the WAL",
    ),
    # --- the apply-order table ----------------------------------------------------------------
    Mutant(
        "admit_gap", "apply order",
        "elif boot < last[0] or seq != last[1] + 1:",
        "elif boot < last[0] or seq <= last[1]:",
        "a node's proposal applies even when an earlier one of the same boot is missing (a gap)",
    ),
    Mutant(
        "admit_new_boot_any_seq", "apply order",
        "            if seq != 1:\n                return False  # a new boot starts at 1",
        "            if seq < 1:\n                return False  # a new boot starts at 1",
        "a new boot's first applied proposal need not be its first",
    ),
    Mutant(
        "deliver_batch_gap", "apply order",
        "if cmd.first_seq != s.next_seq:",
        "if cmd.first_seq < s.next_seq:",
        "a delivery batch applies although a batch before it never committed (a seqno gap)",
    ),
    # --- release and retention ----------------------------------------------------------------
    Mutant(
        "unowe_frees_shared", "release",
        "            if n == 1:\n                del owed_count[offset]",
        "            if n <= 2:\n                del owed_count[offset]",
        "a message owed to two registrations is free for release once one acknowledged it",
    ),
    Mutant(
        "pubrec_finishes_delivery", "release",
        "            if kind == 2:\n                d.state = RELEASING",
        "            if kind == 2 and not s.inflight:\n                d.state = RELEASING",
        "a PUBREC finishes an outbound QoS 2 delivery (released, no PUBREL state kept)",
    ),
    Mutant(
        "retention_ignores_pin", "retention",
        "            if 0 <= cmd.pin_floor <= offset:\n                pinned.append(item)\n                continue\n",
        "",
        "retention releases messages at or above the pin floor (still to be read by a lagging session)",
    ),
    # --- read barriers ------------------------------------------------------------------------
    Mutant(
        "read_barrier_off_by_one", "read barrier",
        "                if index <= applied:\n                    fut.set_result(None)",
        "                if index <= applied + 1:\n                    fut.set_result(None)",
        "a read barrier passes when the replica has applied one entry less than the read index",
    ),
    Mutant(
        "read_barrier_failure_passes", "read barrier",
        "            for shard, fut in asked.items():\n                if fut.done() and not fut.cancelled() and fut.exception() is None:",
        "            for shard, fut in asked.items():\n                if fut.done() and not fut.cancelled():",
        "a read barrier that failed (no leader, read not answered) counts as passed",
    ),
    Mutant(
        "replica_catch_up_off_by_one", "read barrier",
        "            if hosts[shard].state.topics.next_offset <= offset:\n                behind[shard]",
        "            if hosts[shard].state.topics.next_offset < offset:\n                behind[shard]",
        "a resuming session does not wait for its replica to hold the newest message it has in flight",
    ),
    # --- wills --------------------------------------------------------------------------------
    Mutant(
        "will_not_on_close", "wills",
        "        self.will_on_close = True\n",
        "        self.will_on_close = False\n",
        "a connection that ends without DISCONNECT does not publish its will",
    ),
    Mutant(
        "will_lost_on_lease_lapse", "wills",
        "                if s.will is not None:\n                    s.will_due_ms = s.disconnected_at_ms",
        "                if s.will is not None and s.expiry_s > 0:\n                    s.will_due_ms = s.disconnected_at_ms",
        "a session whose owner's lease lapsed (its node dead) owes no will when its expiry is 0",
    ),
    Mutant(
        "will_kept_on_reconnect", "wills",
        "        old.will_due_ms = None  # a reconnect within the will delay cancels the will\n",
        "",
        "a reconnect within the will delay does not cancel the pending will",
    ),
    # --- leases -------------------------------------------------------------------------------
    Mutant(
        "lease_close_after_deadline", "leases",
        "now >= deadline - LEASE_CHECK_MARGIN_S",
        "now >= deadline + LEASE_CHECK_MARGIN_S",
        "an owner that could not renew closes its client a margin after its lease's end, not before",
    ),
    Mutant(
        "lease_lapse_early", "leases",
        "now_ms > s.lease_until_ms + LEASE_LAPSE_GRACE_MS",
        "now_ms > s.lease_until_ms - LEASE_LAPSE_GRACE_MS",
        "the session shard ends a connected session a grace before its owner's lease ends, not after",
    ),
    # --- forwarding and resend ----------------------------------------------------------------
    Mutant(
        "forward_no_resend", "forwarding",
        "if not force and lead == self._lead_seen and self.ticks - oldest.sent_tick < self.resend_after_ticks:",
        "if not force and lead == self._lead_seen:",
        "proposals forwarded to the leader are never sent again when a frame carrying them was lost",
    ),
    Mutant(
        "held_proposal_overtaken", "forwarding",
        "        if self.held_from is not None:\n            return  # behind a proposal our log refused",
        "        if False:\n            return  # behind a proposal our log refused",
        "a new proposal goes into the log ahead of an earlier one the log refused (held)",
    ),
    Mutant(
        "resend_without_dup", "resend",
        "outs.append(OutboundPublish(msg, d.item.qos, d.item.retain, True, pid, d.item.sub_ids))",
        "outs.append(OutboundPublish(msg, d.item.qos, d.item.retain, False, pid, d.item.sub_ids))",
        "a resumed session resends its unacknowledged deliveries without DUP=1",
    ),
    Mutant(
        "delivery_cursor_ignored", "resend",
        "if offset <= cursor or not is_owed(owner, offset):",
        "if not is_owed(owner, offset):",
        "the pump delivers again a message it already sent (not yet acknowledged) on the same connection",
    ),
    # --- packet ids ---------------------------------------------------------------------------
    Mutant(
        "packet_id_per_batch", "packet ids",
        "                pid = packet_id_of(seq)\n                pid_to_seq[pid] = seq",
        "                pid = packet_id_of(seq - first)\n                pid_to_seq[pid] = seq",
        "packet ids numbered from the batch's start, so ids still in flight are reused",
    ),
    # --- $share claims ------------------------------------------------------------------------
    Mutant(
        "share_double_claim", "$share",
        "if offset in reg.owed and offset not in reg.claims and not (dead and offset in dead):",
        "if offset in reg.owed and not (dead and offset in dead):",
        "a $share message already claimed by one member can be claimed by another",
    ),
    Mutant(
        "share_claim_any_incarnation", "$share",
        "return holder[0] == self.client_id and same_incarnation(holder[1], self.incarnation)",
        "return holder[0] == self.client_id",
        "a session serves $share claims made for an earlier session of its client id",
    ),
    Mutant(
        "share_stale_leave", "$share",
        "elif current is not None and (same_incarnation(current, cmd.session_inc) or cmd.session_inc > current):",
        "elif current is not None:",
        "an ended session's leave, applied late, removes the newer session's $share membership",
    ),
    # --- Raft ---------------------------------------------------------------------------------
    Mutant(
        "vote_log_check_term_only", "raft",
        "return last_term > my_term or (last_term == my_term and last_index >= self.last_index())",
        "return last_term >= my_term",
        "a vote is granted to a candidate with the same last term but a shorter log",
    ),
]


# --- locating and applying ---------------------------------------------------------------------
def _sources(tree: Path) -> list[Path]:
    return sorted(p for p in (tree / PACKAGE).rglob("*.py") if "__pycache__" not in p.parts)


def locate(tree: Path, mutant: Mutant, texts: dict[Path, str] | None = None) -> tuple[Path | None, int]:
    """The file of ``tree`` holding the mutant's snippet and how often the snippet occurs in the
    whole tree (the mutant applies only when that is 1)."""
    count = 0
    where: Path | None = None
    for path in _sources(tree):
        text = texts[path] if texts is not None else path.read_text(encoding="utf-8")
        n = text.count(mutant.original)
        if n:
            count += n
            where = path
    return (where if count == 1 else None), count


def source_texts(tree: Path) -> dict[Path, str]:
    return {p: p.read_text(encoding="utf-8") for p in _sources(tree)}


def apply_mutant(tree: Path, mutant: Mutant) -> Path:
    """Applies the mutant to the copy at ``tree``; returns the file changed. ValueError when stale."""
    where, count = locate(tree, mutant)
    if where is None:
        raise ValueError(f"{mutant.name}: snippet found {count} times in {tree / PACKAGE}, not once")
    text = where.read_text(encoding="utf-8")
    where.write_text(text.replace(mutant.original, mutant.replacement, 1), encoding="utf-8")
    return where


def copy_tree(dest: Path, source: Path = ROOT, rev: str | None = None) -> Path:
    """The ``moorline/`` package of ``source`` (its working tree, or the git revision ``rev``)
    under ``dest``; returns ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    if rev is None:
        shutil.copytree(source / PACKAGE, dest / PACKAGE, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    else:
        archive = subprocess.run(["git", "-C", str(source), "archive", rev, PACKAGE], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


# --- running seeds in a child process on the copy ----------------------------------------------
# The child imports moorline from the copy (cwd and PYTHONPATH are the copy; the installed
# editable package's finder comes after the path), says which file it imported, then runs seeds
# in turn, one JSON line each, and stops after the first seed with a violation.
_CHILD = r"""
import json, sys
import moorline
print(json.dumps({"imported": moorline.__file__}), flush=True)
from moorline.sim.cluster.runner import RunConfig, run_seed
args = json.loads(sys.argv[1])
cfg = RunConfig(draw_config=args["draw_config"], timed_sync=args["timed_sync"], aimed_crashes=args["aimed_crashes"])
for seed in range(args["start"], args["start"] + args["seeds"]):
    r = run_seed(seed, args["nodes"], cfg=cfg)
    kinds = sorted({f.kind for f in r.findings})
    print(json.dumps({"seed": seed, "kinds": kinds, "wall_s": round(r.wall_s, 2),
                      "detail": [f"{f.kind}: {f.detail}"[:300] for f in r.findings[:3]],
                      "paths": r.paths}), flush=True)
    if kinds and args["stop_at_first"]:
        break
"""


@dataclass
class Outcome:
    name: str
    area: str
    status: str  # caught, survived, stale, hung, broken (the copy did not even run)
    seed: int | None = None  # the first seed that caught it
    kinds: list[str] = field(default_factory=list)
    seeds_run: int = 0
    wall_s: float = 0.0
    detail: list[str] = field(default_factory=list)
    file: str = ""
    paths: dict[str, int] = field(default_factory=dict)  # rare node paths reached over the seeds run
    failing: list[str] = field(default_factory=list)  # every seed run with a violation: "seed: kinds"


@dataclass
class RunOptions:
    seeds: int = 200
    start: int = 0
    nodes: int = 3
    draw_config: bool = True  # the default mix of moorline sim --cluster (runner.RunConfig)
    timed_sync: bool = True
    aimed_crashes: bool = True
    rev: str | None = None
    keep: bool = False


def run_copy(tree: Path, opts: RunOptions, seeds: int, stop_at_first: bool = True, start: int | None = None) -> Outcome:
    """Seeds of the default mix on the copy at ``tree``; the outcome's status is caught (a seed
    had a violation), survived, hung (a seed over SEED_WALL_LIMIT_S) or broken."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PYTHONPATH=str(tree), PYTHONHASHSEED="0", PYTHONDONTWRITEBYTECODE="1")
    start = opts.start if start is None else start
    args = json.dumps({"start": start, "seeds": seeds, "nodes": opts.nodes, "draw_config": opts.draw_config,
                       "timed_sync": opts.timed_sync, "aimed_crashes": opts.aimed_crashes,
                       "stop_at_first": stop_at_first})
    out = Outcome("", "", "survived")
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, args], cwd=tree, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    assert proc.stdout is not None
    try:
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        buf = ""
        last = time.monotonic()
        while True:
            if not sel.select(timeout=5.0):
                if time.monotonic() - last > SEED_WALL_LIMIT_S:
                    out.status = "hung"
                    out.seed = start + out.seeds_run
                    out.kinds = ["seed_over_wall_limit"]
                    proc.kill()
                    break
                continue
            chunk = os.read(proc.stdout.fileno(), 65536).decode()
            if not chunk:
                break
            buf += chunk
            while "\n" in buf:
                line, buf = buf.split("\n", 1)
                last = time.monotonic()
                lines.append(line)
                rec = json.loads(line)
                if "imported" in rec:
                    if not Path(rec["imported"]).resolve().is_relative_to(tree.resolve()):
                        proc.kill()
                        raise RuntimeError(f"the child imported {rec['imported']}, not the copy in {tree}")
                    continue
                out.seeds_run += 1
                for k, v in rec["paths"].items():
                    out.paths[k] = out.paths.get(k, 0) + v
                if rec["kinds"]:
                    out.failing.append(f"{rec['seed']}: {', '.join(rec['kinds'])}")
                if rec["kinds"] and out.status == "survived":
                    out.status = "caught"
                    out.seed = rec["seed"]
                    out.kinds = rec["kinds"]
                    out.detail = rec["detail"]
    finally:
        rc = proc.wait()
        err = proc.stderr.read() if proc.stderr is not None else ""
    out.wall_s = time.monotonic() - started
    if out.status != "hung" and rc != 0:
        out.status = "broken"
        out.detail = [err.strip().splitlines()[-1] if err.strip() else f"exit status {rc}"]
    return out


class Baseline:
    """The unmutated copy, run on the seeds where a mutant was caught: a catch counts only when the
    unmutated build is clean at that seed or the mutant shows a violation kind it does not (a seed
    the default build itself fails is a finding of its own, never a mutant's catch)."""

    def __init__(self, opts: RunOptions) -> None:
        self.opts = opts
        self.base = Path(tempfile.mkdtemp(prefix="moorline-mutant-baseline-"))
        self.tree = copy_tree(self.base, rev=opts.rev)
        self.kinds: dict[int, list[str]] = {}
        self.details: dict[int, list[str]] = {}
        self._lock = threading.Lock()

    def at(self, seed: int) -> list[str]:
        with self._lock:
            if seed not in self.kinds:
                out = run_copy(self.tree, self.opts, 1, stop_at_first=False, start=seed)
                self.kinds[seed] = out.kinds if out.status != "broken" else ["broken"]
                self.details[seed] = out.detail
            return self.kinds[seed]

    def dirty(self) -> dict[int, list[str]]:
        return {s: k for s, k in sorted(self.kinds.items()) if k}

    def close(self) -> None:
        if not self.opts.keep:
            shutil.rmtree(self.base, ignore_errors=True)


def run_mutant(mutant: Mutant | None, opts: RunOptions, seeds: int, stop_at_first: bool = True,
               baseline: Baseline | None = None) -> Outcome:
    """One mutant (None: the unmutated copy) on a fresh copy of the tree."""
    base = Path(tempfile.mkdtemp(prefix=f"moorline-mutant-{mutant.name if mutant else 'sanity'}-"))
    try:
        tree = copy_tree(base, rev=opts.rev)
        file = ""
        if mutant is not None:
            try:
                file = str(apply_mutant(tree, mutant).relative_to(tree))
            except ValueError as exc:
                return Outcome(mutant.name, mutant.area, "stale", detail=[str(exc)])
        start, end = opts.start, opts.start + seeds
        total = Outcome("", "", "survived")
        excused: list[str] = []
        while start < end:
            out = run_copy(tree, opts, end - start, stop_at_first, start=start)
            total.seeds_run += out.seeds_run
            total.failing += out.failing
            total.wall_s += out.wall_s
            for k, v in out.paths.items():
                total.paths[k] = total.paths.get(k, 0) + v
            if out.status == "caught" and out.seed is not None and baseline is not None:
                clean_kinds = baseline.at(out.seed)
                if clean_kinds and set(out.kinds) <= set(clean_kinds):
                    excused.append(f"seed {out.seed}: {', '.join(out.kinds)} (the unmutated build too)")
                    start = out.seed + 1
                    continue
            total.status, total.seed, total.kinds, total.detail = out.status, out.seed, out.kinds, out.detail
            break
        total.detail = total.detail + excused
        total.name, total.area, total.file = (mutant.name, mutant.area, file) if mutant else ("(unmutated)", "-", "")
        return total
    finally:
        if not opts.keep:
            shutil.rmtree(base, ignore_errors=True)


def score(outcomes: Iterable[Outcome]) -> tuple[int, int]:
    """(killed, judged): hung counts as killed (a run that never ends is seen), stale is not judged."""
    judged = [o for o in outcomes if o.status in ("caught", "survived", "hung")]
    return sum(o.status != "survived" for o in judged), len(judged)


def check_snippets(tree: Path = ROOT) -> list[str]:
    """Every mutant whose snippet does not occur exactly once in ``tree``'s moorline/ (stale)."""
    texts = source_texts(tree)
    names = [m.name for m in MUTANTS]
    problems = [f"duplicate mutant name {n}" for n in sorted({n for n in names if names.count(n) > 1})]
    for m in MUTANTS:
        _, count = locate(tree, m, texts)
        if count != 1:
            problems.append(f"{m.name}: snippet found {count} times")
        if m.original == m.replacement:
            problems.append(f"{m.name}: replacement equals the original")
        where, _ = locate(tree, m, texts)
        if where is not None and where.relative_to(tree / PACKAGE).parts[0] in SIMULATOR_DIRS:
            problems.append(f"{m.name}: its snippet is in the simulator ({where.relative_to(tree)}), not node code")
    return problems


def _table(outcomes: list[Outcome]) -> str:
    rows = [("mutant", "area", "result", "first seed", "caught by", "seeds", "wall s")]
    for o in outcomes:
        rows.append((o.name, o.area, o.status, "" if o.seed is None else str(o.seed), ", ".join(o.kinds),
                     str(o.seeds_run), f"{o.wall_s:.0f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.sim_cluster.mutants", description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", default=[], metavar="NAME", help="this mutant only (repeatable)")
    ap.add_argument("--seeds", type=int, default=200, help="seed budget per mutant (default 200)")
    ap.add_argument("--start", type=int, default=0, help="first seed (default 0)")
    ap.add_argument("--jobs", type=int, default=1, help="mutants run at once, one process each (default 1)")
    ap.add_argument("--sanity", type=int, default=3, help="seeds the unmutated copy must pass first (default 3)")
    # The default mix has all three on (as moorline sim --cluster); --no-... turns one off.
    ap.add_argument("--draw-config", action=argparse.BooleanOptionalAction, default=True,
                    help="each seed draws its node configuration (default: on)")
    ap.add_argument("--timed-sync", action=argparse.BooleanOptionalAction, default=True,
                    help="syncs take virtual time (world.TimedSync; default: on)")
    ap.add_argument("--aimed-crashes", action=argparse.BooleanOptionalAction, default=True,
                    help="crashes aimed at protocol moments (default: on)")
    ap.add_argument("--rev", default=None, help="mutate this git revision's tree instead of the working tree")
    ap.add_argument("--json", type=Path, default=None, help="write the outcomes to this file")
    ap.add_argument("--check", action="store_true", help="only check that every snippet occurs once")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--keep", action="store_true", help="keep the mutated copies (their paths are printed)")
    a = ap.parse_args(argv)
    if a.list:
        for m in MUTANTS:
            print(f"{m.name:36} {m.area:14} {m.slip}")
        return 0
    if a.check:
        problems = check_snippets()
        for p in problems:
            print(p)
        print(f"{len(MUTANTS)} mutants, {len(problems)} problems")
        return 1 if problems else 0
    if not 1 <= a.jobs <= 8 or a.seeds < 1 or a.sanity < 0:
        ap.error("--jobs must be 1..8, --seeds at least 1, --sanity at least 0")
    unknown = [n for n in a.only if n not in {m.name for m in MUTANTS}]
    if unknown:
        ap.error(f"unknown mutant {', '.join(unknown)}; --list shows them")
    todo = [m for m in MUTANTS if not a.only or m.name in a.only]
    opts = RunOptions(seeds=a.seeds, start=a.start, draw_config=a.draw_config, timed_sync=a.timed_sync,
                      aimed_crashes=a.aimed_crashes, rev=a.rev, keep=a.keep)
    flags = " ".join(f for f, on in (("--no-draw-config", a.draw_config), ("--no-timed-sync", a.timed_sync),
                                     ("--no-aimed-crashes", a.aimed_crashes)) if not on) or "default mix"
    print(f"{len(todo)} mutants, seeds {a.start}..{a.start + a.seeds - 1} each ({flags}), {a.jobs} at a time",
          flush=True)
    sanity: Outcome | None = None
    if a.sanity:
        sanity = run_mutant(None, opts, min(a.sanity, a.seeds), stop_at_first=False)
        print(f"sanity (unmutated copy, {sanity.seeds_run} seeds): "
              f"{'clean' if sanity.status == 'survived' else sanity.status + ' ' + ', '.join(sanity.kinds)} "
              f"in {sanity.wall_s:.0f} s", flush=True)
        if sanity.status != "survived":
            print(f"  failing seeds: {'; '.join(sanity.failing)}")
            for d in sanity.detail:
                print(f"  {d}")
            print("the unmutated build is not clean on these seeds: no mutant result would mean anything")
            return 2
    outcomes: list[Outcome] = []
    baseline = Baseline(opts)

    def one(m: Mutant) -> Outcome:
        o = run_mutant(m, opts, a.seeds, baseline=baseline)
        where = f" at seed {o.seed} ({', '.join(o.kinds)})" if o.seed is not None else ""
        print(f"{o.name}: {o.status}{where} after {o.seeds_run} seeds, {o.wall_s:.0f} s", flush=True)
        return o

    try:
        with ThreadPoolExecutor(a.jobs) as pool:
            outcomes = list(pool.map(one, todo))
    finally:
        baseline.close()
    dirty = baseline.dirty()
    print()
    print(_table(outcomes))
    killed, judged = score(outcomes)
    stale = [o.name for o in outcomes if o.status == "stale"]
    broken = [o.name for o in outcomes if o.status == "broken"]
    print(f"\nmutation score: {killed}/{judged}" + (f" = {100 * killed / judged:.0f} %" if judged else "")
          + (f"; stale (snippet not found once): {', '.join(stale)}" if stale else "")
          + (f"; broken copies: {', '.join(broken)}" if broken else ""))
    for seed, kinds in dirty.items():
        print(f"the UNMUTATED build fails seed {seed} ({', '.join(kinds)}): a finding of its own; "
              f"no mutant's catch there counted: {'; '.join(baseline.details.get(seed, []))}")
    if a.json is not None:
        a.json.write_text(json.dumps({"options": asdict(opts), "sanity": asdict(sanity) if sanity else None,
                                      "unmutated_failing": {str(k): v for k, v in dirty.items()},
                                      "outcomes": [asdict(o) for o in outcomes]}, indent=1), encoding="utf-8")
    return 0 if killed == judged and not stale and not broken else 1


if __name__ == "__main__":
    sys.exit(main())
