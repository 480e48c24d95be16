"""Test-only fault injection points (FoundationDB's BUGGIFY idea, armed from outside).

When ``MOORLINE_SPARK_FAILPOINTS`` names a directory, a point fires once for each file of its
name a test creates there: the first task to delete the file wins, so concurrent tasks cannot
both fire one arming. Unset (production), ``fires()`` is one environment lookup.
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


def maybe_fail(name: str) -> None:
    if fires(name):
        raise InjectedFailure(f"moorline test failpoint {name!r} fired")
