"""Data-driven Raft scenarios: tests/raft/testdata/*.txt hold commands and golden output.

Format: optional ``#`` comment lines, a command line, ``----``, the expected output, a blank
line. Set MOORLINE_REWRITE_GOLDEN=1 to regenerate the outputs (then review the diff by hand).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from moorline.raft.interaction import InteractionEnv

TESTDATA = Path(__file__).parent / "testdata"
REWRITE = os.environ.get("MOORLINE_REWRITE_GOLDEN") == "1"


def parse(text: str) -> list[tuple[list[str], str, str]]:
    """Blocks of (comment lines, command, expected output)."""
    blocks: list[tuple[list[str], str, str]] = []
    lines = text.splitlines()
    i = 0
    comments: list[str] = []
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
            continue
        if line.startswith("#"):
            comments.append(line)
            i += 1
            continue
        cmd = line
        i += 1
        if i >= len(lines) or lines[i] != "----":
            raise ValueError(f"expected ---- after {cmd!r}")
        i += 1
        out: list[str] = []
        while i < len(lines) and lines[i].strip():
            out.append(lines[i])
            i += 1
        blocks.append((comments, cmd, "\n".join(out)))
        comments = []
    return blocks


def render(blocks: list[tuple[list[str], str, str]]) -> str:
    parts: list[str] = []
    for comments, cmd, out in blocks:
        parts.extend(comments)
        parts.extend([cmd, "----", out, ""])
    return "\n".join(parts).rstrip("\n") + "\n"


FILES = sorted(TESTDATA.glob("*.txt"))


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_raft_interaction(path: Path) -> None:
    blocks = parse(path.read_text())
    env = InteractionEnv()
    got: list[tuple[list[str], str, str]] = []
    failures: list[str] = []
    for comments, cmd, expected in blocks:
        actual = env.run(cmd)
        got.append((comments, cmd, actual))
        if actual != expected and not failures:
            failures.append(f"{path.name}: command {cmd!r}\n--- expected\n{expected}\n--- actual\n{actual}")
    if REWRITE:
        path.write_text(render(got))
        return
    assert not failures, failures[0]
