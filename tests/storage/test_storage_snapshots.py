"""SnapshotStore: save/load, keep the latest two, corruption is reported, never skipped."""

from __future__ import annotations

from pathlib import Path

import pytest

from moorline.storage.ledger import SyncLedger, read_ledger
from moorline.storage.snapshots import HEADER_BYTES, SnapshotCorruption, SnapshotStore


def test_save_load_and_keep_two(tmp_path: Path) -> None:
    ledger = SyncLedger(tmp_path / "ledger.jsonl")
    s = SnapshotStore(tmp_path / "snaps", ledger=ledger)
    assert s.load_latest(1) is None and s.list_groups() == []
    s.save(1, 10, 2, b"ten")
    s.save(1, 20, 2, b"twenty")
    p30 = s.save(1, 30, 3, b"thirty" * 1000)
    s.save(-1, 5, 1, b"")  # e.g. the metadata group
    assert s.load_latest(1) == (30, 3, b"thirty" * 1000)
    assert s.load_latest(-1) == (5, 1, b"")
    assert [i for i, _, _ in s.list_snapshots(1)] == [20, 30]
    assert s.list_groups() == [-1, 1]
    assert read_ledger(ledger.path)[str(p30)] == HEADER_BYTES + 6000
    # A fresh instance sees the same files.
    assert SnapshotStore(tmp_path / "snaps").load_latest(1) == (30, 3, b"thirty" * 1000)


def test_unfinished_tmp_file_is_ignored(tmp_path: Path) -> None:
    s = SnapshotStore(tmp_path)
    s.save(2, 7, 1, b"seven")
    (tmp_path / "group-2" / "snap-00000000000000000009-00000000000000000001.snap.tmp").write_bytes(b"half")
    assert s.load_latest(2) == (7, 1, b"seven")
    assert not list((tmp_path / "group-2").glob("*.tmp"))


@pytest.mark.parametrize("where", ["header", "data", "truncated", "extended"])
def test_corrupt_latest_raises_naming_the_file(tmp_path: Path, where: str) -> None:
    s = SnapshotStore(tmp_path)
    s.save(3, 1, 1, b"first")
    path = s.save(3, 2, 1, b"second snapshot data")
    raw = bytearray(path.read_bytes())
    if where == "header":
        raw[12] ^= 0x01
    elif where == "data":
        raw[HEADER_BYTES + 4] ^= 0x80
    elif where == "truncated":
        del raw[-3:]
    else:
        raw += b"x"
    path.write_bytes(bytes(raw))
    with pytest.raises(SnapshotCorruption) as err:
        s.load_latest(3)
    assert err.value.path == path and str(path) in str(err.value)


def test_renamed_file_is_detected(tmp_path: Path) -> None:
    s = SnapshotStore(tmp_path)
    path = s.save(4, 8, 2, b"eight")
    path.rename(path.with_name("snap-00000000000000000009-00000000000000000002.snap"))
    with pytest.raises(SnapshotCorruption):
        s.load_latest(4)


def test_storage_id_created_once_and_checked(tmp_path: Path) -> None:
    from moorline.storage.identity import ID_FILE, StorageIdError, load_or_create_storage_id

    d = tmp_path / "node"
    sid = load_or_create_storage_id(d, random_bytes=lambda n: b"\x01" * n)
    assert sid == "01" * 16
    assert load_or_create_storage_id(d) == sid  # stable across restarts
    (d / "wal").mkdir()
    assert load_or_create_storage_id(d) == sid
    raw = (d / ID_FILE).read_text()
    (d / ID_FILE).write_text(raw.replace("01", "02", 1))
    with pytest.raises(StorageIdError):
        load_or_create_storage_id(d)
    (d / ID_FILE).unlink()
    with pytest.raises(StorageIdError):  # old data without its id: refuse a new identity
        load_or_create_storage_id(d)
    assert load_or_create_storage_id(tmp_path / "fresh") != sid
