"""The damage helpers touch exactly what they claim: unsynced tails, or one bit of synced data."""

from __future__ import annotations

import json
import random
from pathlib import Path

from moorline.chaos.node import flip_synced_byte, read_ledger, truncate_to_ledger


def _setup(tmp_path: Path) -> tuple[Path, Path, Path]:
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    a.write_bytes(bytes(range(200)))
    b.write_bytes(b"x" * 50)
    ledger = tmp_path / "ledger.jsonl"
    lines = [
        {"file": str(a), "synced_length": 10},
        {"file": str(a), "synced_length": 100},
        {"file": str(b), "synced_length": 50},
        {"file": str(tmp_path / "gone.log"), "synced_length": 5},
    ]
    ledger.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"file": "torn')
    return a, b, ledger


def test_chaos_ledger_later_lines_win_and_torn_line_is_ignored(tmp_path: Path) -> None:
    a, b, ledger = _setup(tmp_path)
    assert read_ledger(ledger) == {str(a): 100, str(b): 50, str(tmp_path / "gone.log"): 5}


def test_chaos_truncate_keeps_synced_prefix_plus_at_most_extra(tmp_path: Path) -> None:
    a, b, ledger = _setup(tmp_path)
    done = truncate_to_ledger(ledger, random.Random(3), extra_bytes_max=16)
    assert 100 <= a.stat().st_size <= 116
    assert a.read_bytes() == bytes(range(a.stat().st_size))  # a prefix, nothing rewritten
    assert b.stat().st_size == 50  # fully synced: untouched
    assert len(done) == 1 and done[0].startswith("a.log:200->")


def test_chaos_bitflip_changes_one_bit_below_synced_length(tmp_path: Path) -> None:
    a, b, ledger = _setup(tmp_path)
    before = {p: p.read_bytes() for p in (a, b)}
    name, offset = flip_synced_byte(ledger, random.Random(5)) or ("", -1)
    path = Path(name)
    after = path.read_bytes()
    diff = [i for i, (x, y) in enumerate(zip(before[path], after, strict=True)) if x != y]
    assert diff == [offset]
    assert offset < read_ledger(ledger)[name]
    assert bin(before[path][offset] ^ after[offset]).count("1") == 1
