"""One data directory has one owner (issue 20 item 1), and an unusable one is named in words."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moorline.storage.dirlock import DataDirInUse, DataDirLock, DataDirUnusable

REPO = Path(__file__).resolve().parents[2]


def _run(data_dir: Path, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "moorline.cli", "run", "--data-dir", str(data_dir), "--mqtt", "127.0.0.1:0",
         "--http", "127.0.0.1:0"], capture_output=True, text=True, timeout=timeout, cwd=str(REPO),
        env={**os.environ, "PYTHONPATH": str(REPO)})


def test_second_process_on_the_same_data_dir_exits_at_once(tmp_path: Path) -> None:
    data = tmp_path / "data"
    first = subprocess.Popen(
        [sys.executable, "-m", "moorline.cli", "run", "--data-dir", str(data), "--mqtt", "127.0.0.1:0",
         "--http", "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(REPO),
        env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"})
    try:
        assert first.stdout is not None
        for line in first.stdout:
            if "moorline ready" in line:
                break
        second = _run(data)
        assert second.returncode == 2, second.stdout + second.stderr
        assert f"data directory {data} is in use by pid {first.pid}" in second.stderr
        assert "ready" not in second.stdout
    finally:
        first.terminate()
        assert first.wait(30) == 0


def test_lock_is_released_with_the_holder(tmp_path: Path) -> None:
    lock = DataDirLock(tmp_path / "d")
    lock.acquire()
    with pytest.raises(DataDirInUse):
        DataDirLock(tmp_path / "d").acquire()
    lock.release()
    again = DataDirLock(tmp_path / "d")
    again.acquire()  # a released (or dead holder's) lock never blocks
    again.release()


def test_a_file_or_unwritable_data_dir_is_named_in_words(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(DataDirUnusable, match="is a file, not a directory"):
        DataDirLock(f).acquire()
    r = _run(f)
    assert r.returncode == 2 and "is a file, not a directory" in r.stderr and "Errno" not in r.stderr
    if os.geteuid() != 0:  # root may write anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(DataDirUnusable, match="not writable"):
            DataDirLock(ro).acquire()
