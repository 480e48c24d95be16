"""The read API node code uses on a shard's state: registrations, what each is owed, the ``$share``
claims, and the sessions (issue 29: outside ``moorline/broker`` only these functions reach ``regs``,
``owed`` and ``claims``; tests/test_layers.py checks it). Reads only: every change goes through a
committed command. The views returned are live (they change with the next apply); copy one before
an ``await`` if it must not."""

from __future__ import annotations

from collections.abc import ItemsView, KeysView, Mapping, ValuesView

from moorline.broker.session_state import Session, SessionState
from moorline.broker.topic_state import Registration, TopicState


def registration(topics: TopicState, reg_key: str) -> Registration | None:
    """The registration ``reg_key`` (client id \\0 filter, or $share \\0 group \\0 filter), if any."""
    return topics.regs.get(reg_key)


def registrations(topics: TopicState) -> ItemsView[str, Registration]:
    """(registration key, registration) of every registration of the shard, in the order they came."""
    return topics.regs.items()


def registration_keys(topics: TopicState) -> KeysView[str]:
    """The key of every registration of the shard, in the order they came."""
    return topics.regs.keys()


def owed_offsets(reg: Registration) -> KeysView[int]:
    """The offsets ``reg`` is owed and has not acknowledged, ascending."""
    return reg.owed.keys()


def owed_after(reg: Registration, cursor: int) -> list[int]:
    """The offsets ``reg`` is owed above ``cursor`` (its session's delivered cursor), ascending."""
    return [o for o in reg.owed if o > cursor]


def is_owed(reg: Registration, offset: int) -> bool:
    return offset in reg.owed


def owed_count(reg: Registration) -> int:
    return len(reg.owed)


def claims_of(reg: Registration) -> Mapping[int, tuple[str, int]]:
    """A $share group's claims: offset -> (member, the session incarnation it was claimed for)."""
    return reg.claims


def claim_of(reg: Registration, offset: int) -> tuple[str, int] | None:
    """Who holds the claim on ``offset`` of a $share group (member, incarnation), if anyone."""
    return reg.claims.get(offset)


def session_of(sessions: SessionState, client_id: str) -> Session | None:
    """The session of ``client_id`` in its session shard's state, if it has one."""
    return sessions.sessions.get(client_id)


def all_sessions(sessions: SessionState) -> ValuesView[Session]:
    """Every session of the shard, in the order they came."""
    return sessions.sessions.values()


def session_count(sessions: SessionState) -> int:
    return len(sessions.sessions)
