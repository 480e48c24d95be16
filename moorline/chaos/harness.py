"""One chaos run: a broker, a workload, seeded faults, a drain, and the history of it all.

Timeline of a run: start the broker; start subscribers (plain QoS 1, a Method B QoS 2 receiver, a
$share group of two) and publishers (QoS 1 and QoS 2); at seeded moments SIGKILL the broker, damage
its files as asked (truncate to the synced length from the ledger, flip a bit of synced data), and
restart it; after ``duration_s`` stop the publishers, let subscribers drain until quiet, disconnect
them cleanly, record the broker's counted drops (GET /v1/drops), stop the broker.

With ``nodes`` 3 or 5 the same workload runs against a cluster (``cluster_run.py``).
"""

from __future__ import annotations

import random
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moorline.chaos.node import (
    CORRUPTION_RE,
    Broker,
    MosquittoProcess,
    NodeProcess,
    NodeStartError,
    flip_synced_byte,
    truncate_to_ledger,
)
from moorline.chaos.partition import PARTITION_MODES
from moorline.chaos.schedule import CLUSTER_FAULT_KINDS
from moorline.chaos.wire import Endpoint, Subscriber, Subscription
from moorline.chaos.workload import AckTrigger, Publisher
from moorline.testing.faults import Faults
from moorline.verify.history import HistoryWriter

FAULT_KINDS = frozenset({"kill", "truncate", "bitflip"})  # one node
TOPIC_PREFIX = "chaos"
SINGLE_CONNECT_TIMEOUT_S = 3.0
# A takeover on a cluster waits for the previous owner's lease (session.owner_lease_s, 10 s) when
# that owner was cut off: a client must wait longer than that for its CONNACK.
CLUSTER_CONNECT_TIMEOUT_S = 15.0


@dataclass
class ChaosConfig:
    duration_s: float = 20.0
    faults: frozenset[str] = frozenset({"kill"})
    seed: int = 1
    kills_per_run: int = 2
    topics: int = 4
    publishers_qos1: int = 2
    publishers_qos2: int = 2
    publish_interval_s: float = 0.01
    publish_timeout_s: float = 5.0
    drain_quiet_s: float = 2.0
    drain_max_s: float = 30.0
    sleeper_lead_s: float = 1.0  # the sleeper subscriber leaves this long before each kill
    ack_wait_s: float = 2.0  # how long an armed kill waits for an acknowledgement to fire inside
    broker: str = "moorline"  # or "mosquitto" (client-side development only)
    node_faults: dict[str, Any] = field(default_factory=dict)  # testing.Faults fields (broken builds)
    shards: int | None = None
    # --- a cluster (nodes 3 or 5; cluster_run.py)
    nodes: int = 1
    pauses_per_run: int = 2  # SIGSTOP ... SIGCONT episodes (with "pause" in faults)
    partitions_per_run: int = 2  # minority cut off, then healed (with "partition" in faults)
    pause_s: float = 3.0  # longer than an election timeout (raft: 1-2 s by default)
    partition_s: float = 5.0
    base_address: str = "127.0.0.31"  # node i listens on base + i - 1
    partition_with: str = "auto"  # auto (iptables when usable, else proxy), iptables, proxy
    node_config_text: str | None = None  # TOML given to every node (--config)
    connect_timeout_s: float | None = None  # CONNECT to CONNACK; None: 3 s on one node, 15 s on a cluster
    keep_data: bool = False  # keep the nodes' data directories in the run directory
    start_timeout_s: float = 60.0  # a cluster's nodes ready and every shard led
    leaders_timeout_s: float = 30.0  # every shard led again after the last fault healed
    settle_s: float = 2.0  # the workload goes on at least this long after the last fault healed

    def __post_init__(self) -> None:
        if self.nodes not in (1, 3, 5):
            raise ValueError(f"nodes must be 1, 3 or 5, not {self.nodes}")
        known = FAULT_KINDS if self.nodes == 1 else CLUSTER_FAULT_KINDS
        unknown = set(self.faults) - known
        if unknown:
            where = "one node" if self.nodes == 1 else f"a cluster of {self.nodes}"
            raise ValueError(f"faults {sorted(unknown)} are not made on {where}; known: {sorted(known)}")
        if self.duration_s <= 0 or min(self.kills_per_run, self.pauses_per_run, self.partitions_per_run) < 0:
            raise ValueError("duration must be > 0 and the numbers of kills, pauses and partitions >= 0")
        if self.pause_s <= 0 or self.partition_s <= 0:
            raise ValueError("pause and partition durations must be > 0")
        if self.nodes > 1 and self.broker != "moorline":
            raise ValueError("a cluster runs moorline nodes only (--broker mosquitto is for one node)")
        if self.partition_with not in PARTITION_MODES:
            raise ValueError(f"partitions are made with one of {', '.join(PARTITION_MODES)}, "
                             f"not {self.partition_with!r}")

    @property
    def client_connect_timeout_s(self) -> float:
        if self.connect_timeout_s is not None:
            return self.connect_timeout_s
        return SINGLE_CONNECT_TIMEOUT_S if self.nodes == 1 else CLUSTER_CONNECT_TIMEOUT_S


@dataclass
class RunResult:
    run: str
    history: Path
    events: int
    published: int
    acked: int
    kills: int
    corruption_detected: bool
    drops: int
    notes: list[str]
    restart_failed: bool = False  # the node would not start again for a reason other than corruption
    # --- a cluster
    restarts: int = 0
    truncations: int = 0  # kills followed by truncation to the synced length
    pauses: int = 0
    partitions: int = 0
    leader_changes: int = 0  # seen by polling GET /v1/shards during the run
    fault_log: list[str] = field(default_factory=list)  # one line per fault step, with its time
    run_dir: Path | None = None  # node logs, ledgers, the secret, faults.txt
    partition_kind: str | None = None  # iptables or proxy
    client_errors: list[str] = field(default_factory=list)  # client threads that died: the run proves nothing


@dataclass
class _RunState:
    kills: int = 0
    corruption: bool = False
    restart_failed: bool = False
    flipped: bool = False

    @property
    def stopped_early(self) -> bool:
        return self.corruption or self.restart_failed


def _fault_times(cfg: ChaosConfig, rng: random.Random) -> list[float]:
    if not cfg.faults & {"kill", "truncate", "bitflip"} or cfg.kills_per_run == 0:
        return []
    return sorted(rng.uniform(0.15, 0.85) * cfg.duration_s for _ in range(cfg.kills_per_run))


def _make_broker(cfg: ChaosConfig, work: Path, ledger: Path) -> Broker:
    if cfg.broker == "mosquitto":
        return MosquittoProcess(work / "mosquitto")
    faults = Faults(**{**cfg.node_faults, "sync_ledger": str(ledger)})
    config_file = None
    if cfg.node_config_text is not None:
        config_file = work / "node.toml"
        config_file.write_text(cfg.node_config_text, encoding="utf-8")
    return NodeProcess(data_dir=work / "data", faults=faults, shards=cfg.shards, config_file=config_file)


def run_once(
    cfg: ChaosConfig, run_id: str, out_dir: Path, progress: Callable[[float], None] | None = None
) -> RunResult:
    """Execute one run; its history goes to ``out_dir/history-<run_id>.jsonl``."""
    if cfg.nodes > 1:
        from moorline.chaos.cluster_run import run_cluster_once

        return run_cluster_once(cfg, run_id, out_dir, progress)
    rng = random.Random(f"{cfg.seed}/{run_id}")
    out_dir.mkdir(parents=True, exist_ok=True)
    history_path = out_dir / f"history-{run_id}.jsonl"
    history_path.unlink(missing_ok=True)
    notes: list[str] = []
    with (
        tempfile.TemporaryDirectory(prefix="moorline-chaos-") as tmp,
        HistoryWriter(history_path, run_id) as hist,
    ):
        work = Path(tmp)
        ledger = work / "ledger.jsonl"
        broker = _make_broker(cfg, work, ledger)
        broker.start()

        def endpoint() -> Endpoint:
            return Endpoint(*broker.mqtt)

        w = start_workload(cfg, run_id, hist, rng, lambda _role: endpoint)
        subs, pubs, asleep, trigger = w.subs, w.pubs, w.asleep, w.trigger
        stop_subs, stop_pubs, sub_threads, pub_threads = w.stop_subs, w.stop_pubs, w.sub_threads, w.pub_threads

        start = time.monotonic()
        state = _RunState()
        try:
            _fault_loop(cfg, rng, hist, broker, ledger, asleep, trigger, start, progress, state, notes)
            if not state.stopped_early:
                _sleep_until(start + cfg.duration_s, start, cfg.duration_s, progress)
            stop_pubs.set()
            for t in pub_threads:
                t.join(cfg.publish_timeout_s + 10)
            if not state.stopped_early:
                _drain(subs, cfg)
        except BaseException:
            broker.kill()
            raise
        finally:
            stop_pubs.set()
            stop_subs.set()
            for t in pub_threads + sub_threads:
                t.join(cfg.publish_timeout_s + 10)
            if state.stopped_early:
                broker.kill()
        if state.flipped and not state.corruption and isinstance(broker, NodeProcess):
            # A damaged shard may be refused only when first used: look through everything it logged.
            line = _corruption_line(broker.log_text())
            if line is not None:
                state.corruption = True
                hist.record(
                    "fault", "fault", process="harness", reason="corruption_detected", detail=line[:2000]
                )
                notes.append(f"node reported corruption: {line}")
        drops = 0
        if broker.has_http and not state.stopped_early and isinstance(broker, NodeProcess):
            try:
                for d in broker.get_json("/v1/drops").get("drops", []):
                    drops += 1
                    hist.record(
                        "drop",
                        "drop",
                        process="broker",
                        guid=d.get("guid"),
                        reason=d.get("reason"),
                        session=d.get("session"),
                        shard=d.get("shard"),
                        offset=d.get("offset"),
                    )
            except OSError as exc:
                notes.append(f"GET /v1/drops failed: {exc}")
                hist.record("fault", "fault", process="harness", reason="drops_unavailable", detail=str(exc))
        broker.stop()
        if progress is not None:
            progress(1.0)
        kills, corruption = state.kills, state.corruption
        return RunResult(
            run_id,
            history_path,
            hist.count,
            sum(p.published for p in pubs),
            sum(p.acked for p in pubs),
            kills,
            corruption,
            drops,
            notes,
            state.restart_failed,
            client_errors=list(w.died),
        )


def _fault_loop(
    cfg: ChaosConfig,
    rng: random.Random,
    hist: HistoryWriter,
    broker: Broker,
    ledger: Path,
    asleep: threading.Event,
    trigger: AckTrigger,
    start: float,
    progress: Callable[[float], None] | None,
    state: _RunState,
    notes: list[str],
) -> None:
    """Kill, damage and restart the broker at the seeded moments; stops early if it cannot restart.

    At each moment the kill is armed to fire inside the next successful acknowledgement a publisher
    receives (or after ``ack_wait_s`` without one): a node acknowledging before its data is durable
    is then caught with the acknowledged data still unsynced."""
    for at in _fault_times(cfg, rng):
        _sleep_until(start + max(0.0, at - cfg.sleeper_lead_s), start, cfg.duration_s, progress)
        asleep.set()
        _sleep_until(start + at, start, cfg.duration_s, progress)
        state.kills += 1
        trigger.arm(broker.send_kill)
        after_ack = trigger.fired.wait(cfg.ack_wait_s)
        trigger.disarm()
        hist.record(
            "fault",
            "fault",
            process="harness",
            reason="kill",
            detail=f"SIGKILL at {at:.2f}s" + (" right after an acknowledgement" if after_ack else ""),
        )
        broker.kill()
        if "truncate" in cfg.faults:
            cut = truncate_to_ledger(ledger, rng)
            hist.record("fault", "fault", process="harness", reason="truncate", detail=";".join(cut)[:2000])
        if "bitflip" in cfg.faults and not state.flipped:
            flip = flip_synced_byte(ledger, rng)
            if flip is not None:
                state.flipped = True
                hist.record(
                    "fault",
                    "fault",
                    process="harness",
                    reason="bitflip",
                    detail=f"{flip[0]} offset {flip[1]}",
                )
        hist.record("fault", "fault", process="harness", reason="restart")
        try:
            broker.start()
        except NodeStartError as exc:
            line = _corruption_line(exc.log_tail)
            if line is not None:
                state.corruption = True
                hist.record(
                    "fault", "fault", process="harness", reason="corruption_detected", detail=line[:2000]
                )
                notes.append(f"node refused to start: {line}")
            else:
                state.restart_failed = True
                hist.record(
                    "fault", "fault", process="harness", reason="restart_failed", detail=exc.log_tail[-2000:]
                )
                notes.append(f"node did not restart: {exc}\n{exc.log_tail}")
            return
        asleep.clear()
        if isinstance(broker, NodeProcess):
            line = _corruption_line(broker.current_log())
            if line is not None:
                state.corruption = True
                hist.record(
                    "fault", "fault", process="harness", reason="corruption_detected", detail=line[:2000]
                )
                notes.append(f"node reported corruption: {line}")


@dataclass
class Workload:
    """The clients of a run and their threads (started), the sleeper last among ``subs``."""

    subs: list[Subscriber]
    pubs: list[Publisher]
    asleep: threading.Event  # while set, the sleeper stays away (its session kept)
    trigger: AckTrigger
    stop_subs: threading.Event
    stop_pubs: threading.Event
    sub_threads: list[threading.Thread]
    pub_threads: list[threading.Thread]
    died: list[str] = field(default_factory=list)  # "client: error" of every client thread that raised


def guarded(name: str, target: Callable[..., None], died: list[str]) -> Callable[..., None]:
    """``target`` run in a client thread: an exception it raises is recorded in ``died`` (a run
    whose clients died exercised nothing, and must fail), not only printed by the thread."""

    def run(*args: Any, **kwargs: Any) -> None:
        try:
            target(*args, **kwargs)
        except Exception as exc:  # reported once per run by the caller, not as a thread traceback
            died.append(f"{name}: {type(exc).__name__}: {exc}")

    return run


def start_workload(
    cfg: ChaosConfig,
    run_id: str,
    hist: HistoryWriter,
    rng: random.Random,
    endpoints: Callable[[str], Callable[[], Endpoint]],
) -> Workload:
    """Subscribers (connected, bounded wait), then publishers. ``endpoints(role)`` gives each client
    its way of choosing a node at every connect (role ``sleeper`` for the sleeper, else ``client``)."""
    topics = [f"{TOPIC_PREFIX}/t{i}" for i in range(cfg.topics)]
    connect_s = cfg.client_connect_timeout_s

    def sub(name: str, s: Subscription, role: str = "client") -> Subscriber:
        return Subscriber(f"{run_id}-{name}", endpoints(role), hist, [s], connect_timeout_s=connect_s)

    subs = [
        sub("sub-q1", Subscription(f"{TOPIC_PREFIX}/#", 1)),
        sub("sub-q2b", Subscription(f"{TOPIC_PREFIX}/#", 2)),
        sub("share-m1", Subscription(f"{TOPIC_PREFIX}/#", 1, "g")),
        sub("share-m2", Subscription(f"{TOPIC_PREFIX}/#", 1, "g")),
    ]
    # The sleeper is away (session kept) from shortly before each kill until after the restart,
    # so messages committed around the crash must come back from the node's storage.
    sleeper = sub("sleeper", Subscription(f"{TOPIC_PREFIX}/#", 1), role="sleeper")
    asleep = threading.Event()
    trigger = AckTrigger()
    pubs = [
        Publisher(
            f"{run_id}-pub-q{q}-{i}",
            q,
            topics,
            endpoints("client"),
            hist,
            random.Random(rng.getrandbits(64)),
            publish_timeout_s=cfg.publish_timeout_s,
            connect_timeout_s=connect_s,
            interval_s=cfg.publish_interval_s,
            ack_trigger=trigger,
        )
        for q, n in ((1, cfg.publishers_qos1), (2, cfg.publishers_qos2))
        for i in range(n)
    ]
    stop_subs = threading.Event()
    stop_pubs = threading.Event()
    died: list[str] = []
    sub_threads = [threading.Thread(target=guarded(s.client_id, s.run, died), args=(stop_subs.is_set,), daemon=True)
                   for s in subs]
    sub_threads.append(
        threading.Thread(
            target=guarded(sleeper.client_id, sleeper.run, died), args=(stop_subs.is_set,),
            kwargs={"offline": asleep.is_set}, daemon=True,
        )
    )
    subs.append(sleeper)
    for t in sub_threads:
        t.start()
    _wait_until(lambda: all(s.connected for s in subs), max(10.0, 2 * connect_s))
    pub_threads = [threading.Thread(target=guarded(p.client_id, p.run, died), args=(stop_pubs.is_set,), daemon=True)
                   for p in pubs]
    for t in pub_threads:
        t.start()
    return Workload(subs, pubs, asleep, trigger, stop_subs, stop_pubs, sub_threads, pub_threads, died)


def _corruption_line(log: str) -> str | None:
    for line in log.splitlines():
        if CORRUPTION_RE.search(line):
            return line.strip()
    return None


def _wait_until(cond: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def _sleep_until(
    when: float, start: float, duration_s: float, progress: Callable[[float], None] | None
) -> bool:
    while True:
        now = time.monotonic()
        if progress is not None:
            progress(min(0.95, (now - start) / duration_s * 0.95))
        if now >= when:
            return True
        time.sleep(min(0.2, when - now))


def _drain(subs: list[Subscriber], cfg: ChaosConfig) -> None:
    """Wait until every subscriber is connected and none received anything for ``drain_quiet_s``."""
    deadline = time.monotonic() + cfg.drain_max_s
    while time.monotonic() < deadline:
        now = time.monotonic()
        if all(s.connected for s in subs) and all(
            now - s.last_delivery_mono >= cfg.drain_quiet_s for s in subs
        ):
            return
        time.sleep(0.1)
