"""What applying commands asks of the host: store writes, releases, wake-ups, cross-shard commands.

The state machines stay pure: they never touch files or other shards; the host drains these.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moorline.broker.messages import StoredMessage


@dataclass(slots=True)
class Effects:
    # (offset, encoded record, the message itself: the host may keep it for delivery)
    appends: list[tuple[int, bytes, StoredMessage]] = field(default_factory=list)
    releases: list[int] = field(default_factory=list)
    # (offset, registration) newly owed, in apply order: the shape of a session's pending index, so
    # the host can hand runs of one registration to it without rebuilding a tuple per message.
    owed_new: list[tuple[int, str]] = field(default_factory=list)
    owed_regs: set[str] = field(default_factory=set)  # registrations whose owed set changed (dispatch, caps)
    claims: list[tuple[str, str, tuple[int, ...]]] = field(default_factory=list)  # (share reg, member, offsets)
    # (registration, its retained messages, the shard's next offset when the Register applied) of
    # each Register applied that asked for them: the host hands them to the session in apply order
    # with the live messages (offsets below the third element before them, the rest after), so
    # neither overtakes the other on a topic.
    retained_new: list[tuple[str, tuple[StoredMessage, ...], int]] = field(default_factory=list)

    def store_release(self, offsets: list[int]) -> None:
        self.releases.extend(offsets)

    def owed(self, reg_key: str, offset: int = -1) -> None:
        self.owed_regs.add(reg_key)
        if offset >= 0:
            self.owed_new.append((offset, reg_key))

    def claimed(self, reg_key: str, member: str, offsets: tuple[int, ...]) -> None:
        self.claims.append((reg_key, member, offsets))

    def clear(self) -> None:
        self.appends.clear()
        self.releases.clear()
        self.owed_regs.clear()
        self.owed_new.clear()
        self.claims.clear()
        self.retained_new.clear()
