"""Where group commits run: SyncTimer keeps fast syncs on the event loop, sends slow ones to the thread
and probes the disk again from the loop now and then."""

from __future__ import annotations

from moorline.node.replication.group_commit import SyncTimer


def _decisions(timer: SyncTimer, n: int, inline_s: float) -> list[bool]:
    """n passes; each inline one is timed at ``inline_s`` (as GroupCommit does)."""
    out = []
    for _ in range(n):
        inline = timer.use_inline()
        out.append(inline)
        if inline:
            timer.note(inline_s)
    return out


def test_fast_disk_syncs_on_the_loop() -> None:
    timer = SyncTimer(inline_max_s=0.005)
    assert all(_decisions(timer, 100, 0.001))
    assert abs(timer.mean_s - 0.001) < 1e-4


def test_slow_disk_goes_to_the_thread_and_is_probed() -> None:
    timer = SyncTimer(inline_max_s=0.005)
    first = _decisions(timer, 40, 0.050)
    # The first slow samples pull the mean over the bound within a few passes, then only probes run inline.
    assert first[:1] == [True] and first.index(False) <= 3
    later = _decisions(timer, 10 * SyncTimer.PROBE_EVERY, 0.050)
    assert sum(later) == 10, later.count(True)
    gaps = [i for i, x in enumerate(later) if x]
    assert all(b - a == SyncTimer.PROBE_EVERY for a, b in zip(gaps, gaps[1:], strict=False))


def test_disk_that_became_fast_gets_its_syncs_back() -> None:
    timer = SyncTimer(inline_max_s=0.005)
    _decisions(timer, 50, 0.050)
    assert timer.mean_s > timer.inline_max_s
    recovered = _decisions(timer, 20 * SyncTimer.PROBE_EVERY, 0.0005)
    assert recovered[-50:] == [True] * 50


def test_zero_bound_always_uses_the_thread() -> None:
    timer = SyncTimer(inline_max_s=0.0)
    assert not any(timer.use_inline() for _ in range(100))
