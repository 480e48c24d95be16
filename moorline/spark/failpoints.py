"""Test-only fault injection points (FoundationDB's BUGGIFY idea, armed from outside).

When ``MOORLINE_SPARK_FAILPOINTS`` names a directory, a point fires once for each file of its
name a test creates there: the first task to delete the file wins, so concurrent tasks cannot
both fire one arming. ``mark()`` leaves a ``mark-<name>`` file there (TigerBeetle-style coverage
marks: a test asserts a rare path really ran). Unset (production), each is one environment lookup.
"""

from __future__ import annotations

import os

ENV = "MOORLINE_SPARK_FAILPOINTS"


class InjectedFailure(RuntimeError):
    """Raised at an armed failpoint."""


def fires(name: str) -> bool:
    directory = os.environ.get(ENV)
    if not directory:
        return False
    try:
        os.unlink(os.path.join(directory, name))
    except FileNotFoundError:
        return False
    return True


def mark(name: str) -> None:
    """Coverage mark: record that a rare path ran, so a test can prove it was reached."""
    directory = os.environ.get(ENV)
    if directory:
        with open(os.path.join(directory, f"mark-{name}"), "a"):
            pass


def marked(name: str) -> bool:
    directory = os.environ.get(ENV)
    return bool(directory) and os.path.exists(os.path.join(str(directory), f"mark-{name}"))


def maybe_fail(name: str) -> None:
    if fires(name):
        raise InjectedFailure(f"moorline test failpoint {name!r} fired")
