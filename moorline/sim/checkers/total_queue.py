"""A total-queue checker (Jepsen ``total-queue`` style) plus per-queue FIFO.

Inputs are client-side observations only:
- one ``EnqueueOp`` per message id (covering all its retries): when it was first invoked, when
  (if ever) an attempt was acknowledged, and whether every attempt was refused for sure;
- ``Delivery`` records (dequeue results) with the delivery number the queue reported;
- the set of (msg id, delivery) pairs whose ack was acknowledged.

Verdicts, after a final drain:
- lost: acknowledged enqueue never delivered;
- unexpected: delivered but never attempted, refused for sure, or with another value;
- duplicated: delivered again after an acknowledged ack, or two deliveries both claiming to be
  the first (a redelivery needs a reason: the previous delivery was not acknowledged);
- recovered: indeterminate enqueues that were delivered (allowed, counted);
- fifo: a first delivery of B completed before the dequeue that first delivered A began, although
  A's enqueue was acknowledged before B's was first invoked.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class EnqueueOp:
    msg_id: str
    queue: str
    value: str
    invoke_ms: int
    ok_ms: int | None = None  # acknowledged by some attempt
    refused: bool = False  # every attempt was refused before entering the log


@dataclass(slots=True)
class Delivery:
    msg_id: str
    queue: str
    value: str
    delivery: int  # 1 = first delivery according to the queue
    invoke_ms: int
    ok_ms: int


@dataclass(slots=True)
class QueueVerdict:
    lost: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    fifo: list[str] = field(default_factory=list)
    recovered: int = 0
    acknowledged: int = 0
    delivered: int = 0

    @property
    def ok(self) -> bool:
        return not (self.lost or self.unexpected or self.duplicated or self.fifo)

    def problems(self) -> list[str]:
        out: list[str] = []
        for name in ("lost", "unexpected", "duplicated", "fifo"):
            items: list[str] = getattr(self, name)
            if items:
                out.append(f"total-queue {name}: {len(items)} e.g. {items[:3]}")
        return out


def check_total_queue(
    enqueues: list[EnqueueOp], deliveries: list[Delivery], acked: set[tuple[str, int]]
) -> QueueVerdict:
    v = QueueVerdict()
    by_id = {e.msg_id: e for e in enqueues}
    delivered: dict[str, list[Delivery]] = {}
    for d in sorted(deliveries, key=lambda d: (d.ok_ms, d.invoke_ms)):
        delivered.setdefault(d.msg_id, []).append(d)
        e = by_id.get(d.msg_id)
        if e is None or e.refused:
            v.unexpected.append(f"{d.msg_id} delivered but never (successfully) attempted")
        elif e.value != d.value or e.queue != d.queue:
            v.unexpected.append(f"{d.msg_id} delivered with another value or queue")
    v.delivered = len(delivered)
    for e in enqueues:
        if e.ok_ms is not None:
            v.acknowledged += 1
            if e.msg_id not in delivered:
                v.lost.append(f"{e.msg_id} acknowledged at {e.ok_ms}ms, never delivered")
        elif e.msg_id in delivered and not e.refused:
            v.recovered += 1
    for msg_id, ds in delivered.items():
        firsts = [d for d in ds if d.delivery == 1]
        if len(firsts) > 1:
            v.duplicated.append(f"{msg_id} delivered {len(firsts)} times as a first delivery")
        for i, d in enumerate(ds[:-1]):
            if (msg_id, d.delivery) in acked:
                later = ds[i + 1]
                v.duplicated.append(
                    f"{msg_id} delivery {d.delivery} acked, delivered again (#{later.delivery} at {later.ok_ms}ms)"
                )
                break
    _check_fifo(by_id, delivered, v)
    return v


def _check_fifo(by_id: dict[str, EnqueueOp], delivered: dict[str, list[Delivery]], v: QueueVerdict) -> None:
    per_queue: dict[str, list[tuple[EnqueueOp, Delivery]]] = {}
    for msg_id, ds in delivered.items():
        e = by_id.get(msg_id)
        first = next((d for d in ds if d.delivery == 1), None)
        if e is None or first is None:
            continue
        per_queue.setdefault(e.queue, []).append((e, first))
    for queue, pairs in sorted(per_queue.items()):
        # A must precede B when enq(A) was acknowledged before enq(B) was invoked. Sweep B by
        # enqueue invoke time, keeping the latest dequeue-invoke among such A's.
        by_ack = sorted((p for p in pairs if p[0].ok_ms is not None), key=lambda p: p[0].ok_ms or 0)
        by_inv = sorted(pairs, key=lambda p: p[0].invoke_ms)
        j = 0
        latest: tuple[int, str] | None = None
        for eb, db in by_inv:
            while j < len(by_ack) and (by_ack[j][0].ok_ms or 0) < eb.invoke_ms:
                ea, da = by_ack[j]
                if latest is None or da.invoke_ms > latest[0]:
                    latest = (da.invoke_ms, ea.msg_id)
                j += 1
            if latest is not None and db.ok_ms < latest[0]:
                v.fifo.append(f"queue {queue}: {db.msg_id} first-delivered before older {latest[1]}")
                if len(v.fifo) >= 5:
                    return
