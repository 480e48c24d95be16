"""What a session's delivery hands its connection (``OutboundPublish``) and the read ACL it
applies at delivery (``ReadFilter``); split out of delivery.py."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import msgspec

from moorline.broker.messages import StoredMessage

READ_FILTER_CACHE_ENTRIES = 4096  # registrations whose read-check answer a session remembers


class OutboundPublish(msgspec.Struct, gc=False):
    """One PUBLISH to write (a Struct: built once per delivered message, it costs a third of a
    slotted dataclass)."""

    msg: StoredMessage
    qos: int
    retain: bool
    dup: bool
    packet_id: int | None
    sub_ids: tuple[int, ...]


class ReadFilter:
    """The read ACL at delivery: a wildcard subscription may reach topics its principal may not
    read; those messages are never sent to it. A plain subscription's are dropped, counted as
    ``acl_no_reader``; a $share member's claims on them go back to the group, declined by the
    member (ShareDecline), and reach another member, or are dropped as ``acl_no_reader`` once every
    member declined them. ``needs_check(filter)`` is asked once per registration (False: every
    topic it can match is readable, the hot path)."""

    def __init__(self, needs_check: Callable[[str], bool], can_read: Callable[[str], bool]) -> None:
        self._needs_check = needs_check
        self.can_read = can_read
        self._by_reg: dict[str, bool] = {}

    def allowed(self, reg_keys: Iterable[str], topic: str) -> bool:
        by_reg = self._by_reg
        for rk in reg_keys:
            need = by_reg.get(rk)
            if need is None:
                if len(by_reg) >= READ_FILTER_CACHE_ENTRIES:
                    by_reg.clear()
                # A registration key ends with its topic filter, after the last NUL (which no
                # topic filter can contain).
                need = by_reg[rk] = self._needs_check(rk.rpartition("\x00")[2])
            if need:
                return self.can_read(topic)
        return True
