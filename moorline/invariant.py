"""Always-on assertions (TigerBeetle style): never rely on ``python -O`` keeping ``assert``."""

from __future__ import annotations

from typing import NoReturn


class InvariantViolation(AssertionError):
    """A programming error: an invariant the code promises was broken."""


def invariant(condition: object, message: str = "invariant violated") -> None:
    """Raise ``InvariantViolation`` when ``condition`` is false. Stays on in production."""
    if not condition:
        raise InvariantViolation(message)


def violated(message: str) -> NoReturn:
    """Raise ``InvariantViolation``: for hot paths, where the check is an inline ``if`` so the message
    (often an f-string) is only built when the invariant actually broke."""
    raise InvariantViolation(message)
