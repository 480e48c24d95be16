"""W1 over TLS: the same paho publisher and subscriber as W1, through a TLS listener, for moorline and
Mosquitto, with the same certificates (``moorline certs dev``, made once per run); reported as the
ratio of CPU per message over TLS to plain W1, measured interleaved with it in the same run.

moorline gets ``listeners.mqtts`` (through its environment), Mosquitto a second ``listener`` with
``certfile``/``keyfile``; the clients verify the server against the dev CA (``MOORLINE_BENCH_TLS_CA``,
read by ``bench/paho_clients.py`` in the client processes).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from bench.brokers import READY_TIMEOUT_S, Broker, RunningBroker, _wait_for_port, free_port
from moorline.certs import DevCertificates, write_dev_certificates

TLS_CA_ENV = "MOORLINE_BENCH_TLS_CA"
TLS_BROKERS = ("moorline", "mosquitto")


TLS_VARIANT_ENV = {"__tls__": "1"}  # the variant env that asks TlsCapable for the TLS listener


class TlsCapable(Broker):
    """``inner``, started with a TLS listener (its clients sent there, trusting ``ca``) when the
    variant's env carries ``__tls__``, else as it is. Plain W1 and W1 over TLS then run as two
    variants of one ``_paho_reps`` call, interleaved rep by rep, so outside load hits both alike."""

    def __init__(self, inner: Broker, certs: DevCertificates) -> None:
        self.inner = inner
        self.name = inner.name
        self.certs = certs

    def prepare(self, log: Callable[[str], None]) -> str:
        return self.inner.prepare(log)

    def start(self, workdir: Path, env: Mapping[str, str] | None = None) -> RunningBroker:
        extra = dict(env or {})
        if not extra.pop("__tls__", None):
            os.environ.pop(TLS_CA_ENV, None)  # this run's clients (spawned after this) connect in plain
            return self.inner.start(workdir, extra)
        port = free_port()
        cert, key = self.certs.server_cert, self.certs.server_key
        if self.name == "moorline":
            extra.update({"MOORLINE_LISTENERS__MQTTS": f"127.0.0.1:{port}",
                          "MOORLINE_TLS__CERT_FILE": str(cert), "MOORLINE_TLS__KEY_FILE": str(key)})
        elif self.name == "mosquitto":
            extra["__extra_config__"] = f"listener {port} 127.0.0.1\ncertfile {cert}\nkeyfile {key}\n"
        else:
            raise ValueError(f"no TLS set-up for {self.name}")
        broker = self.inner.start(workdir, extra)
        try:
            _wait_for_port(port, broker.proc, READY_TIMEOUT_S)
        except Exception:
            broker.stop()
            raise
        broker.port = port
        for attr in ("publish_port", "subscribe_port"):  # where the W1 clients connect
            if hasattr(broker, attr):
                setattr(broker, attr, port)
        os.environ[TLS_CA_ENV] = str(self.certs.ca_cert)  # the client processes are spawned with it
        return broker


_certs: tuple[tempfile.TemporaryDirectory[str], DevCertificates] | None = None


def with_tls(kind: Broker) -> TlsCapable:
    """``kind`` able to run the W1 TLS variant; every broker of a run gets the same certificates."""
    global _certs
    if _certs is None:
        tmp = tempfile.TemporaryDirectory(prefix="moorline-bench-tls-")
        _certs = (tmp, write_dev_certificates(Path(tmp.name), ["127.0.0.1", "localhost"]))
    return TlsCapable(kind, _certs[1])


def plain_clients() -> None:
    """Client processes spawned from now on connect without TLS."""
    os.environ.pop(TLS_CA_ENV, None)


def cleanup() -> None:
    """After a run: no TLS for later clients, the certificates removed."""
    global _certs
    plain_clients()
    if _certs is not None:
        _certs[0].cleanup()
        _certs = None


def _figures(results: dict[str, Any], broker: str, workload: str) -> dict[str, Any]:
    block = results.get(broker, {}).get(workload, {})
    return block.get("median") or {}


def compare(results: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Per broker: W1 CPU-s/10k and msgs/s plain and over TLS, and TLS / plain CPU per message."""
    out: dict[str, dict[str, float | None]] = {}
    for broker in results:
        plain, tls = _figures(results, broker, "w1"), _figures(results, broker, "w1_tls")
        if not tls:
            continue
        cpu_plain, cpu_tls = plain.get("cpu_s_per_10k"), tls.get("cpu_s_per_10k")
        out[broker] = {
            "w1_cpu_s_per_10k_plain": cpu_plain,
            "w1_cpu_s_per_10k_tls": cpu_tls,
            "tls_to_plain_cpu": cpu_tls / cpu_plain if cpu_plain and cpu_tls is not None else None,
            "w1_msgs_per_s_plain": plain.get("msgs_per_s"),
            "w1_msgs_per_s_tls": tls.get("msgs_per_s"),
        }
    return out
