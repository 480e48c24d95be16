"""Runs the workloads against each broker and returns plain dicts (what goes into the JSON)."""

from __future__ import annotations

import multiprocessing
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnProcess
from pathlib import Path
from typing import Any

from bench import loadgen, paho_clients, tls_bench
from bench.brokers import ALL_BROKERS, Broker, BrokerUnavailable, RunningBroker
from bench.report import target_format, target_met

# A deliberately loosened build, started through the test entry point (moorline/testing/faulty_node.py).
LOOSE_PACKET_IDS_FAULTS = {"__faults__": '{"loose_packet_ids": true}'}
Log = Callable[[str], None]


@dataclass(frozen=True)
class PahoWorkload:
    """One publisher -> one subscriber, QoS 1, ``window`` unacknowledged both ways."""

    name: str
    payload_bytes: int
    messages: int
    warmup: int
    window: int = 256
    persistent_subscriber: bool = False  # the subscriber's session outlives its connection


SHALLOW_WINDOW = 16  # QoS 1 messages in flight in the shallow run


@dataclass(frozen=True)
class SaturationWorkload:
    """Lean load generator: ``pairs`` processes, each a windowed QoS 1 publisher + subscriber on its own topic."""

    pair_counts: tuple[int, ...]
    warm_s: float
    measure_s: float
    payload_bytes: int = 100
    window: int = 256
    max_pairs: int = 4  # on 2 cores more client processes only take CPU from the broker


@dataclass(frozen=True)
class BenchConfig:
    brokers: tuple[str, ...]
    reps: int
    w1: PahoWorkload
    w2: PahoWorkload
    saturation: SaturationWorkload
    # One pair with few messages in flight: latency-bound, so each round trip carries a handful of
    # messages and CPU per message shows what a round costs (wake-ups, syscalls, a sync, fixed work).
    shallow: SaturationWorkload
    client_timeout_s: float = 180.0
    targets: dict[str, float] = field(
        default_factory=lambda: {"w1_cpu_s_per_10k": 0.15, "w2_cpu_s_per_10k": 2.0}
    )


def full_config(brokers: tuple[str, ...], reps: int) -> BenchConfig:
    return BenchConfig(
        brokers=brokers,
        reps=reps,
        w1=PahoWorkload("w1", 100, 20_000, 1_000),
        w2=PahoWorkload("w2", 64 * 1024, 2_000, 1_000),
        saturation=SaturationWorkload(pair_counts=(1, 2), warm_s=1.5, measure_s=5.0),
        shallow=SaturationWorkload(pair_counts=(1,), warm_s=1.0, measure_s=4.0, window=SHALLOW_WINDOW),
    )


def quick_config(brokers: tuple[str, ...]) -> BenchConfig:
    return BenchConfig(
        brokers=brokers,
        reps=1,
        w1=PahoWorkload("w1", 100, 2_000, 200),
        w2=PahoWorkload("w2", 64 * 1024, 200, 50),
        saturation=SaturationWorkload(pair_counts=(1,), warm_s=0.5, measure_s=1.5),
        shallow=SaturationWorkload(pair_counts=(1,), warm_s=0.3, measure_s=1.0, window=SHALLOW_WINDOW),
        client_timeout_s=60.0,
    )


def _expect(conn: Connection, tag: str, timeout_s: float, proc: SpawnProcess) -> tuple[Any, ...]:
    """Next message from a client process, which must be ``tag``; bounded in time, fails if the process died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if conn.poll(0.1):
            message = conn.recv()
            if message[0] == tag:
                return tuple(message)
            if message[0] == "error":
                raise RuntimeError(f"{proc.name}: {message[1]}")
            raise RuntimeError(f"{proc.name}: expected {tag!r}, got {message!r}")
        if not proc.is_alive():
            raise RuntimeError(f"{proc.name} exited with {proc.exitcode} while we waited for {tag!r}")
    raise TimeoutError(f"{proc.name}: no {tag!r} within {timeout_s} s")


def _stop_clients(procs: list[SpawnProcess]) -> None:
    for proc in procs:
        if proc.pid is None:
            continue  # never started: an earlier client failed first
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()  # our own child, by its handle
            proc.join(timeout=5)


def _with_broker(
    kind: Broker, env: Mapping[str, str] | None, body: Callable[[RunningBroker], dict[str, Any]]
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"moorline-bench-{kind.name}-") as tmp:
        workdir = Path(tmp)
        try:
            broker = kind.start(workdir, env)
        except Exception as exc:
            raise RuntimeError(f"{exc}{_stderr_tail(workdir)}") from exc
        try:
            result = body(broker)
            if not broker.alive():
                raise RuntimeError(f"{kind.name} died during the run (exit {broker.proc.returncode})")
            result["peak_rss_mb"] = broker.peak_rss_bytes() / 2**20
        except Exception as exc:
            broker.stop()
            # The temporary dir goes away with the broker's log: keep the end of it in the error.
            raise RuntimeError(f"{exc}{_stderr_tail(workdir)}") from exc
        finally:
            broker.stop()
        result.update(broker.findings())  # read from its logs after it stopped, before the dir goes
        return result


def _stderr_tail(workdir: Path, limit: int = 800) -> str:
    """The end of the broker's stderr; a cluster's members each have theirs in a subdirectory."""
    tails = []
    for path in [workdir / "stderr.log", *sorted(workdir.glob("*/stderr.log"))]:
        try:
            text = path.read_text(errors="replace").strip()
        except OSError:
            continue
        if text:
            where = "" if path.parent == workdir else f" ({path.parent.name})"
            tails.append(f" | broker stderr{where}: ...{text[-limit:]}")
    return "".join(tails)


def run_paho_once(
    kind: Broker, workload: PahoWorkload, timeout_s: float, env: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Fresh broker, warm-up, then the measured pass with the broker's CPU read just before and just after."""
    ctx = multiprocessing.get_context("spawn")

    def body(broker: RunningBroker) -> dict[str, Any]:
        topic = broker.topic_for(f"bench/{workload.name}")
        sub_conn, sub_child = ctx.Pipe()
        pub_conn, pub_child = ctx.Pipe()
        common = (broker.protocol, topic, workload.warmup, workload.messages)
        sub = ctx.Process(
            target=paho_clients.subscriber_main,
            args=(sub_child, broker.subscribe_port, *common, workload.window, timeout_s,
                  workload.persistent_subscriber),
            name="paho-subscriber",
            daemon=True,
        )
        pub = ctx.Process(
            target=paho_clients.publisher_main,
            args=(pub_child, broker.publish_port, *common, workload.payload_bytes, workload.window, timeout_s),
            name="paho-publisher",
            daemon=True,
        )
        try:
            sub.start()
            _expect(sub_conn, "ready", 60, sub)
            pub.start()
            _expect(pub_conn, "ready", 60, pub)
            pub_conn.send("warmup")
            _, warm_ok = _expect(pub_conn, "warm_acked", timeout_s, pub)
            _expect(sub_conn, "warm_done", timeout_s, sub)
            if not warm_ok:
                raise RuntimeError("warm-up publishes were not all acknowledged in time")
            cpu_before = broker.cpu_seconds_by_member()
            pub_conn.send("go")
            _, pub_result = _expect(pub_conn, "done", timeout_s + 10, pub)
            _, sub_result = _expect(sub_conn, "result", timeout_s + 10, sub)
            cpu_after = broker.cpu_seconds_by_member()
        finally:
            _stop_clients([pub, sub])
        cpu_by_member = {member: cpu_after[member] - cpu_before[member] for member in cpu_before}
        cpu = sum(cpu_by_member.values())  # a cluster's figure is the sum over all its nodes
        elapsed_s = (sub_result["last_receive_ns"] - pub_result["first_publish_ns"]) / 1e9
        received = sub_result["received"]
        return {
            "complete": bool(pub_result["complete"] and sub_result["complete"]),
            "messages": workload.messages,
            "received": received,
            "duplicates": sub_result["duplicates"],
            "elapsed_s": elapsed_s,
            "msgs_per_s": received / elapsed_s if elapsed_s > 0 else 0.0,
            "latency_p50_ms": sub_result["latency_p50_ns"] / 1e6,
            "latency_p99_ms": sub_result["latency_p99_ns"] / 1e6,
            "latency_max_ms": sub_result["latency_max_ns"] / 1e6,
            "cpu_s": cpu,
            "cpu_s_per_10k": cpu / received * 10_000 if received else None,
            **({"topic": topic, "cpu_s_by_member": cpu_by_member} if len(cpu_by_member) > 1 else {}),
        }

    return _with_broker(kind, env, body)


def drive_pairs(
    workload: SaturationWorkload,
    placements: list[tuple[int, int, dict[str, Any]]],
    protocol: Any,
    read_cpu: Callable[[], Any],
    timeout_s: float,
) -> tuple[list[dict[str, Any]], Any, Any]:
    """One load-generator process per (pair index, publisher port, extra pair_main kwargs), started
    together; the brokers' CPU read (``read_cpu``) at the start and the end of the measuring window.
    Returns every pair's result and the two CPU readings."""
    ctx = multiprocessing.get_context("spawn")
    conns: list[Connection] = []
    procs: list[SpawnProcess] = []
    total_s = workload.warm_s + workload.measure_s + 5
    try:
        for index, port, extra in placements:
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=loadgen.pair_main,
                args=(child, port, protocol, index, workload.window, workload.payload_bytes,
                      workload.warm_s, workload.measure_s, total_s),
                kwargs=extra,
                name=f"loadgen-{index}",
                daemon=True,
            )
            proc.start()
            conns.append(parent)
            procs.append(proc)
        for conn, proc in zip(conns, procs, strict=True):
            _expect(conn, "ready", 60, proc)
        start_at = time.monotonic() + 0.2
        for conn in conns:
            conn.send(("go", start_at))
        time.sleep(max(0.0, start_at + workload.warm_s - time.monotonic()))
        cpu_before = read_cpu()
        time.sleep(max(0.0, start_at + workload.warm_s + workload.measure_s - time.monotonic()))
        cpu_after = read_cpu()
        results = [_expect(conn, "result", timeout_s, proc)[1] for conn, proc in zip(conns, procs, strict=True)]
    finally:
        _stop_clients(procs)
    return results, cpu_before, cpu_after


def saturation_figures(pairs: int, workload: SaturationWorkload, results: list[dict[str, Any]],
                       cpu: float) -> dict[str, Any]:
    """Delivered and acknowledged messages in the measuring window, summed over the pairs, per second
    and against the brokers' CPU."""
    delivered = sum(r["delivered_in_window"] for r in results)
    acked = sum(r["acked_in_window"] for r in results)
    return {
        "pairs": pairs,
        "measure_s": workload.measure_s,
        "delivered": delivered,
        "msgs_per_s": delivered / workload.measure_s,
        "publish_acks_per_s": acked / workload.measure_s,
        "cpu_s": cpu,
        "cpu_s_per_10k": cpu / delivered * 10_000 if delivered else None,
    }


def run_saturation_once(
    kind: Broker, workload: SaturationWorkload, pairs: int, timeout_s: float
) -> dict[str, Any]:
    def body(broker: RunningBroker) -> dict[str, Any]:
        placements: list[tuple[int, int, dict[str, Any]]] = [(index, broker.port, {}) for index in range(pairs)]
        results, before, after = drive_pairs(workload, placements, broker.protocol, broker.cpu_seconds, timeout_s)
        return saturation_figures(pairs, workload, results, after - before)

    return _with_broker(kind, None, body)


def median_of(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-figure median over the repetitions (each figure on its own, as peers.md reports them)."""
    out: dict[str, Any] = {}
    for key in reps[0]:
        values = [
            r[key] for r in reps if isinstance(r.get(key), int | float) and not isinstance(r.get(key), bool)
        ]
        if values:
            out[key] = statistics.median(values)
    out["complete"] = all(r.get("complete", True) for r in reps)
    out["peak_rss_mb"] = max(r["peak_rss_mb"] for r in reps)
    return out


def _guarded(log: Log, what: str, action: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return action()
    except Exception as exc:  # one broker's failure must not lose the other brokers' figures
        log(f"[red]{what} failed: {type(exc).__name__}: {exc}[/red]")
        return {"error": f"{type(exc).__name__}: {exc}"}


def _paho_reps(
    kind: Broker,
    config: BenchConfig,
    log: Log,
    variants: Mapping[str, tuple[PahoWorkload, Mapping[str, str] | None]],
) -> dict[str, dict[str, Any]]:
    """``config.reps`` repetitions of each variant (name -> workload, extra broker env), interleaved rep by rep
    so that a drift in outside load hits every variant alike (the strict/loose packet-id difference is small)."""
    reps: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    errors: dict[str, str] = {}
    for rep in range(config.reps):
        for name, (workload, env) in variants.items():
            if name in errors:
                continue
            label = f"{kind.name} {name}"

            def once(workload: PahoWorkload = workload, env: Mapping[str, str] | None = env) -> dict[str, Any]:
                return run_paho_once(kind, workload, config.client_timeout_s, env)

            result = _guarded(log, f"{label} rep {rep + 1}", once)
            if "error" in result:
                errors[name] = result["error"]
                continue
            log(
                f"{label} rep {rep + 1}/{config.reps}: {result['msgs_per_s']:,.0f} msgs/s, "
                f"p50 {result['latency_p50_ms']:.1f} ms, {result['cpu_s_per_10k'] or 0:.3f} CPU-s/10k"
            )
            reps[name].append(result)
    return {
        name: {"error": errors[name], "reps": reps[name]}
        if name in errors
        else {"median": median_of(reps[name]), "reps": reps[name]}
        for name in variants
    }


def _saturation_sweep(kind: Broker, config: BenchConfig, log: Log) -> dict[str, Any]:
    steps: list[dict[str, Any]] = []
    # Start with the configured pair counts, then keep adding a pair while the last one still paid off (> 5 %),
    # up to max_pairs: the reported figure should be the broker's ceiling, not the load generator's.
    pair_counts = list(config.saturation.pair_counts)
    index = 0
    while index < len(pair_counts):
        pairs = pair_counts[index]
        index += 1

        def one_step(pairs: int = pairs) -> dict[str, Any]:
            return run_saturation_once(kind, config.saturation, pairs, config.client_timeout_s)

        result = _guarded(log, f"{kind.name} saturation x{pairs}", one_step)
        if "error" in result:
            return {"error": result["error"], "steps": steps}
        log(f"{kind.name} saturation {pairs} pair(s): {result['msgs_per_s']:,.0f} msgs/s delivered")
        steps.append(result)
        rising = len(steps) > 1 and steps[-1]["msgs_per_s"] > 1.05 * steps[-2]["msgs_per_s"]
        if index == len(pair_counts) and rising and pairs < config.saturation.max_pairs:
            pair_counts.append(pairs + 1)
    best = max(steps, key=lambda r: r["msgs_per_s"])
    # If the best is the largest pair count and clearly above the one before, the clients may still be the limit.
    still_rising = (
        len(steps) > 1 and best is steps[-1] and steps[-1]["msgs_per_s"] > 1.05 * steps[-2]["msgs_per_s"]
    )
    return {"max": best, "steps": steps, "still_rising": still_rising}


def _shallow(kind: Broker, config: BenchConfig, log: Log) -> dict[str, Any]:
    """One run of the shallow pipeline (one pair, ``config.shallow.window`` in flight)."""
    result = _guarded(log, f"{kind.name} shallow",
                      lambda: run_saturation_once(kind, config.shallow, 1, config.client_timeout_s))
    if "error" in result:
        return result
    log(f"{kind.name} shallow ({config.shallow.window} in flight): {result['msgs_per_s']:,.0f} msgs/s, "
        f"{result['cpu_s_per_10k']:.3f} CPU-s/10k")
    return {"run": result}


def run(config: BenchConfig, log: Log) -> dict[str, Any]:
    """Every requested broker through W1, W2, the saturation sweep (and for moorline the loose packet-id W1)."""
    brokers: dict[str, Any] = {}
    results: dict[str, Any] = {}
    for name in config.brokers:
        if name not in ALL_BROKERS:
            brokers[name] = {
                "status": "skipped",
                "reason": f"unknown broker (known: {', '.join(ALL_BROKERS)})",
            }
            log(f"[yellow]skipping {name}: unknown broker[/yellow]")
            continue
        kind = ALL_BROKERS[name]()
        try:
            version = kind.prepare(log)
        except (BrokerUnavailable, OSError, RuntimeError) as exc:
            brokers[name] = {"status": "skipped", "reason": str(exc)}
            log(f"[yellow]skipping {name}: {exc}[/yellow]")
            continue
        brokers[name] = {"status": "ok", "version": version}
        log(f"[bold]{name}[/bold] {version}")
        w1_variants: dict[str, tuple[PahoWorkload, Mapping[str, str] | None]] = {"w1": (config.w1, None)}
        if name == "moorline":
            # The delivery-batch commit exists only for sessions that outlive their connection (a clean
            # session has nothing to resume), so strict vs loose packet ids is measured with such a subscriber.
            persistent = replace(config.w1, name="w1", persistent_subscriber=True)
            w1_variants["w1_persistent"] = (persistent, None)
            w1_variants["w1_persistent_loose_packet_ids"] = (persistent, LOOSE_PACKET_IDS_FAULTS)
        w1_kind: Broker = kind
        if name in tls_bench.TLS_BROKERS:  # W1 again through a TLS listener, interleaved with plain W1
            w1_kind = tls_bench.with_tls(kind)
            w1_variants["w1_tls"] = (config.w1, tls_bench.TLS_VARIANT_ENV)
        w1 = _paho_reps(w1_kind, config, log, w1_variants)
        tls_bench.plain_clients()  # what follows connects in plain
        per: dict[str, Any] = {
            "w1": w1["w1"],
            "w2": _paho_reps(kind, config, log, {"w2": (config.w2, None)})["w2"],
            "saturation": _saturation_sweep(kind, config, log),
            "shallow": _shallow(kind, config, log),
        }
        for extra in ("w1_persistent", "w1_persistent_loose_packet_ids"):
            if extra in w1:
                per[extra] = w1[extra]
        if "w1_tls" in w1:
            per["w1_tls"] = w1["w1_tls"]
        results[name] = per
    tls_bench.cleanup()
    return {
        "config": asdict(config),
        "brokers": brokers,
        "results": results,
        "comparison": compare(results, config),
    }


def _fig(results: dict[str, Any], broker: str, workload: str, key: str) -> float | None:
    block = results.get(broker, {}).get(workload, {})
    figures = block.get("median") or block.get("max") or block.get("run") or {}
    value = figures.get(key)
    return float(value) if isinstance(value, int | float) else None


def compare(results: dict[str, Any], config: BenchConfig) -> dict[str, Any]:
    """moorline's targets and its ratios to each peer measured in this same run."""
    out: dict[str, Any] = {"targets": [], "ratios": {}, "strict_packet_ids": None, "tls": tls_bench.compare(results)}
    if "moorline" not in results:
        return out
    w1_cpu = _fig(results, "moorline", "w1", "cpu_s_per_10k")
    w2_cpu = _fig(results, "moorline", "w2", "cpu_s_per_10k")
    sat = _fig(results, "moorline", "saturation", "msgs_per_s")
    mosq_sat = _fig(results, "mosquitto", "saturation", "msgs_per_s")
    targets = [
        ("W1 CPU-s/10k", w1_cpu, "<=", config.targets["w1_cpu_s_per_10k"]),
        ("W2 CPU-s/10k", w2_cpu, "<=", config.targets["w2_cpu_s_per_10k"]),
        ("saturation msgs/s vs mosquitto", sat, ">=", mosq_sat),
    ]
    for label, value, op, target in targets:
        met = target_met(value, op, target, target_format(label))
        out["targets"].append({"target": label, "moorline": value, "op": op, "bound": target, "met": met})
    for peer in results:
        if peer == "moorline":
            continue
        ratios: dict[str, float | None] = {}
        for workload in ("w1", "w2", "saturation", "shallow"):
            for key in ("msgs_per_s", "cpu_s_per_10k"):
                mine, theirs = _fig(results, "moorline", workload, key), _fig(results, peer, workload, key)
                ratios[f"{workload}_{key}"] = mine / theirs if mine is not None and theirs else None
        out["ratios"][peer] = ratios
    strict = _fig(results, "moorline", "w1_persistent", "cpu_s_per_10k")
    loose = _fig(results, "moorline", "w1_persistent_loose_packet_ids", "cpu_s_per_10k")
    if strict is not None and loose is not None:
        out["strict_packet_ids"] = {
            "w1_cpu_s_per_10k_strict": strict,
            "w1_cpu_s_per_10k_loose": loose,
            "cost_cpu_s_per_10k": strict - loose,
            "w1_msgs_per_s_strict": _fig(results, "moorline", "w1_persistent", "msgs_per_s"),
            "w1_msgs_per_s_loose": _fig(results, "moorline", "w1_persistent_loose_packet_ids", "msgs_per_s"),
        }
    return out
