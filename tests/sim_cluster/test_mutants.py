"""CI's sample of the mutation run (tests/sim_cluster/mutants.py; docs/simulation.md, "Mutation testing").

The whole run (every mutant, up to 200 seeds each) is a separate command; here: every mutant's
snippet still occurs exactly once in node code (so the list never goes stale silently, as files
move), a stale snippet is reported as stale and never applied, the unmutated copy is clean on the
sample's seed, and a few cheap mutants are caught by the simulator on a copy of the tree within
the seeds they needed in the full run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sim_cluster.mutants import (
    MUTANTS,
    ROOT,
    Mutant,
    RunOptions,
    check_snippets,
    locate,
    run_mutant,
    score,
)

# Cheap mutants (their first catch at the first seeds of the default mix: drawn configuration, timed
# syncs, aimed crashes; the full run's table in docs/simulation.md) and the seed budget each gets here.
SAMPLE: dict[str, int] = {
    "snapshot_restore_owed_count": 2,  # snapshot_rebuild_differs (world_checks.derived_state)
    "will_not_on_close": 2,  # will_not_published (checkers._wills)
    "resend_without_dup": 2,  # resend_without_dup, duplicate (history checkers)
    "share_double_claim": 1,  # packet_id_misuse, duplicate: the $share claims (caught since the default mix draws)
}


def test_every_snippet_occurs_once_in_node_code() -> None:
    assert len(MUTANTS) >= 20
    assert check_snippets() == []


def test_a_stale_snippet_is_reported_not_applied(tmp_path: Path) -> None:
    stale = Mutant("gone", "test", "this text is in no file of moorline\n", "x", "a snippet that moved away")
    assert locate(ROOT, stale) == (None, 0)
    out = run_mutant(stale, RunOptions(seeds=1), 1)
    assert out.status == "stale" and out.seeds_run == 0
    assert score([out]) == (0, 0)  # neither caught nor survived


def test_the_unmutated_copy_is_clean() -> None:
    out = run_mutant(None, RunOptions(seeds=1), 1, stop_at_first=False)
    assert out.status == "survived", out.detail  # no violation: the copy ran its seed clean
    assert out.seeds_run == 1


@pytest.mark.parametrize("name", sorted(SAMPLE))
def test_a_sample_mutant_is_caught(name: str) -> None:
    mutant = next(m for m in MUTANTS if m.name == name)
    out = run_mutant(mutant, RunOptions(seeds=SAMPLE[name]), SAMPLE[name])
    assert out.status == "caught", (out.status, out.detail)
    assert out.file.startswith("moorline/")
