"""Test-only entry point: ``python -m moorline.testing.faulty_node --faults JSON run [run options]``.

Starts a node exactly as ``moorline run`` does, with a ``Faults`` object injected. Harnesses
(e2e tests, ``moorline chaos``, the benchmark's comparison variants) use it; the production command
has no way to turn these switches on.
"""

from __future__ import annotations

import sys

from moorline.testing.faults import Faults


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] != "--faults":
        print("usage: python -m moorline.testing.faulty_node --faults JSON run [options]", file=sys.stderr)
        raise SystemExit(2)
    try:
        faults = Faults.from_json(argv[1])
    except (ValueError, TypeError) as exc:
        print(f"faulty_node: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    if faults.any_broken:
        print(f"faulty_node: DELIBERATELY BROKEN BUILD for tests: {faults.to_json()}", file=sys.stderr, flush=True)
    from moorline.cli import app
    from moorline.node import cli as node_cli

    node_cli.inject_faults(faults)
    app(argv[2:], prog_name="faulty_node")


if __name__ == "__main__":
    main(sys.argv[1:])
