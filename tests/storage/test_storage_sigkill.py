"""A real process appends and syncs, reporting each acknowledged index; it is SIGKILLed mid-run, then
every file is cut back to its ledger length plus part of its unsynced bytes (power loss). Every
acknowledged entry must be recovered."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from moorline.storage.ledger import read_ledger
from moorline.storage.wal import WriteAheadLog

CHILD = r"""
import sys
from pathlib import Path
from moorline.storage.wal import WriteAheadLog
w = WriteAheadLog(Path(sys.argv[1]), segment_bytes=8192, ledger=Path(sys.argv[2]))
rec = w.open()
g = rec.groups.get(0)
start = g.entries[-1].index + 1 if g is not None and g.entries else 1
for i in range(start, start + 200000):  # bounded; the parent kills us long before
    w.append_entries(0, [(1, i, 0, b"k" * (i % 97))])
    w.set_hard_state(0, 1, b"", i)  # coalesced: written once per sync, after the entries
    if i % 5 == 0:
        w.sync()
        print(i, flush=True)
"""


def test_sigkill_then_power_loss_keeps_acknowledged(tmp_path: Path) -> None:
    rng = random.Random(7)
    wal_dir, ledger = tmp_path / "wal", tmp_path / "ledger.jsonl"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    for _round in range(3):
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(wal_dir), str(ledger)],
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        acked = 0
        deadline = time.monotonic() + 20
        try:
            assert child.stdout is not None
            while acked < 300 + rng.randint(0, 200) and time.monotonic() < deadline:
                line = child.stdout.readline()
                if not line:
                    break
                acked = int(line)
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
        assert acked >= 300
        for file, synced in read_ledger(ledger).items():
            p = Path(file)
            if p.exists() and p.stat().st_size > synced:
                os.truncate(p, synced + rng.randint(0, p.stat().st_size - synced))
        wal = WriteAheadLog(wal_dir, segment_bytes=8192, ledger=ledger)  # as the node passes it
        rec = wal.open()
        wal.close()
        assert rec.corrupted == []
        got = [e.index for e in rec.groups[0].entries]
        assert got[:acked] == list(range(1, acked + 1))  # every acknowledged entry, in order
        assert all(e.data == b"k" * (e.index % 97) for e in rec.groups[0].entries)
        hs = rec.groups[0].hard_state
        assert hs is not None and acked <= hs.commit <= got[-1]
