"""One SparkSession for the whole verify suite (local[2]), and a builder for handcrafted histories."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    if shutil.which("java") is None:  # pragma: no cover - CI has Java 17
        pytest.skip("pyspark needs a Java runtime")
    from moorline.verify.job import make_spark

    session = make_spark("local[2]", shuffle_partitions=1, app_name="moorline-verify-tests")
    yield session
    session.stop()


class Hist:
    """Handcrafted history: every call appends events 1 ms apart, in call order."""

    def __init__(self, run: str = "r1") -> None:
        self.run = run
        self.rows: list[dict[str, Any]] = []
        self.t_ns = 1_000_000_000

    def ev(self, type: str, op: str, **kw: Any) -> Hist:
        self.t_ns += 1_000_000
        row: dict[str, Any] = {
            "run": self.run,
            "index": len(self.rows),
            "type": type,
            "op": op,
            "mono_ns": self.t_ns,
            "wall_ms": self.t_ns // 1_000_000,
            "process": kw.get("session"),
        }
        row.update(kw)
        self.rows.append(row)
        return self

    def connect(self, session: str, present: bool = True, clean_start: bool = False) -> Hist:
        self.ev("invoke", "connect", session=session, clean_start=clean_start, session_expiry=3600)
        return self.ev("ok", "connect", session=session, session_present=present)

    def lose_connection(self, session: str) -> Hist:
        return self.ev("info", "disconnect", session=session, reason="connection lost")

    def disconnect(self, session: str) -> Hist:
        return self.ev("ok", "disconnect", session=session)

    def subscribe(
        self,
        session: str,
        filter: str,
        qos: int = 1,
        group: str | None = None,
        sticky: bool = False,
        no_local: bool = False,
    ) -> Hist:
        self.ev(
            "invoke",
            "subscribe",
            session=session,
            filter=filter,
            qos=qos,
            share_group=group,
            sticky=sticky,
            no_local=no_local,
        )
        return self.ev(
            "ok",
            "subscribe",
            session=session,
            filter=filter,
            qos=qos,
            share_group=group,
            sticky=sticky,
            no_local=no_local,
        )

    def unsubscribe(self, session: str, filter: str, group: str | None = None) -> Hist:
        return self.ev("ok", "unsubscribe", session=session, filter=filter, share_group=group)

    def publish(
        self,
        session: str,
        guid: str,
        topic: str = "t/a",
        qos: int = 1,
        outcome: str | None = "ok",
        pid: int = 1,
    ) -> Hist:
        self.ev("invoke", "publish", session=session, guid=guid, topic=topic, qos=qos, packet_id=pid)
        if outcome is not None:
            self.ev(outcome, "publish", session=session, guid=guid, topic=topic, qos=qos, packet_id=pid)
        return self

    def deliver(
        self,
        session: str,
        guid: str | None,
        topic: str = "t/a",
        qos: int = 1,
        pid: int = 1,
        dup: bool = False,
        ack: bool = True,
        detail: str | None = None,
    ) -> Hist:
        self.ev(
            "ok", "deliver", session=session, guid=guid, topic=topic, qos=qos, packet_id=pid, dup=dup, detail=detail
        )
        if ack and qos > 0:
            self.ack(session, guid, pid, qos)
        return self

    def ack(self, session: str, guid: str | None, pid: int, qos: int = 1) -> Hist:
        return self.ev("ok", "ack", session=session, guid=guid, packet_id=pid, qos=qos)

    def drop(self, guid: str, reason: str, session: str | None = None) -> Hist:
        return self.ev("drop", "drop", guid=guid, reason=reason, session=session, shard=0, offset=0)

    def fault(self, reason: str, detail: str = "") -> Hist:
        return self.ev("fault", "fault", reason=reason, detail=detail, process="harness")


@pytest.fixture(scope="session")
def hist() -> type[Hist]:
    return Hist
