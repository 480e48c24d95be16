"""The project's documentation stands alone and says what the code does:

- no tracked file points outside the repository (to a design folder a user does not have);
- every relative link in README.md and docs/*.md leads to a file that exists (and, with an
  anchor, to a heading of it);
- docs/design.md lists every configuration key of moorline/config.py with its current default;
- the commands the docs name exist (`python -m bench`; `moorline bench` is not installed by pip).
"""

from __future__ import annotations

import dataclasses
import math
import re
import subprocess
import sys
import tomllib
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from moorline.config import NodeConfig

REPO = Path(__file__).resolve().parents[1]
# Spelled in two pieces so that this file does not name what it looks for.
OUTSIDE_REFERENCES = ("../" + "shared", "shared/" + "notes", "DESIGN" + ".md")
SKIP_DIRS = {".git", "build", "dist", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache", ".hypothesis"}


def project_files() -> list[Path]:
    """The tracked files (git ls-files), or every file of the tree outside caches without git."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=30).stdout
        files = [REPO / name for name in out.decode().split("\0") if name]
    except (OSError, subprocess.SubprocessError):
        files = [p for p in REPO.rglob("*") if p.is_file() and not SKIP_DIRS.intersection(p.relative_to(REPO).parts)]
    return [f for f in files if f.is_file() and ".egg-info" not in str(f)]


def test_no_file_refers_outside_the_repository() -> None:
    found = []
    for path in project_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary
        for n, line in enumerate(text.splitlines(), 1):
            found += [f"{path.relative_to(REPO)}:{n}: {line.strip()}" for ref in OUTSIDE_REFERENCES if ref in line]
    assert found == [], "references to documents outside the repository (use docs/design.md):\n" + "\n".join(found)


def markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def without_code(text: str) -> str:
    """Markdown without fenced code blocks and inline code (links there are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+?)\s*$", text, re.M)}


def relative_links(path: Path) -> Iterator[str]:
    for m in re.finditer(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", without_code(path.read_text(encoding="utf-8"))):
        target = m.group(1)
        if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            yield target


@pytest.mark.parametrize("doc", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(doc: Path) -> None:
    broken = []
    for target in relative_links(doc):
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert broken == [], f"{doc.relative_to(REPO)}: " + "; ".join(broken)


def config_keys(cls: type = NodeConfig, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every key of the configuration, dotted, with its default."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from config_keys(hints[f.name], f"{prefix}{f.name}.")
        elif f.default is not dataclasses.MISSING:
            yield prefix + f.name, f.default
        else:
            assert f.default_factory is not dataclasses.MISSING, f"{prefix}{f.name} has no default"
            yield prefix + f.name, f.default_factory()


def documented_limits() -> dict[str, str]:
    """docs/design.md's Limits table: key -> its default cell."""
    text = (REPO / "docs" / "design.md").read_text(encoding="utf-8")
    section = text.split("\n## Limits", 1)[1]
    return {m.group(1): m.group(2).strip() for m in re.finditer(r"^\| `([\w.]+)` \|([^|]*)\|", section, re.M)}


def same_default(cell: str, default: Any) -> bool:
    if default is None:
        return cell == "unset"
    m = re.match(r"`([^`]*)`", cell)
    if m is None:
        return False
    value = tomllib.loads(f"v = {m.group(1)}")["v"]
    if isinstance(default, bool) or isinstance(value, bool):
        return value is default
    if isinstance(default, int | float) and isinstance(value, int | float):
        return math.isclose(value, default)
    return bool(value == default)


def test_design_lists_every_config_key_with_its_default() -> None:
    documented = documented_limits()
    keys = dict(config_keys())
    missing = [f"| `{k}` | {default!r} | ... |" for k, default in keys.items() if k not in documented]
    assert missing == [], "keys of moorline/config.py missing from docs/design.md's Limits table:\n" + "\n".join(missing)
    wrong = {k: (documented[k], keys[k]) for k in keys if not same_default(documented[k], keys[k])}
    assert wrong == {}, "defaults in docs/design.md (left) that moorline/config.py does not have (right)"


def test_the_benchmark_command_the_docs_name_runs() -> None:
    proc = subprocess.run([sys.executable, "-m", "bench", "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    named = [f"{p.relative_to(REPO)}" for p in [*markdown_files(), REPO / "bench" / "README.md"]
             if "moorline bench" in p.read_text(encoding="utf-8")]
    # pip installs the moorline package only; bench/ lives in the checkout, so the docs name
    # `python -m bench` (run from the repository root).
    assert named == [], f"`moorline bench` is not installed by pip, yet named in {named}"


def test_one_port_per_purpose_in_the_docs_and_examples() -> None:
    """HTTP listens on 8888 by default; 8883 is MQTT over TLS's registered port and appears only
    where TLS is meant; 8080 is nobody's here."""
    wrong = []
    for path in [*markdown_files(), *sorted((REPO / "examples").glob("*.py")), REPO / "moorline" / "config.py"]:
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if ":8080" in line or (":8883" in line and not re.search(r"mqtts|TLS", line)):
                wrong.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert wrong == [], "\n".join(wrong)
