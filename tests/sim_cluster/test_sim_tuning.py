"""Per-seed node configuration of the cluster simulator (issue 28 item 1): each seed draws its own,
from ranges that include tiny values, deterministically from the seed, and every draw is a valid
node configuration."""

from __future__ import annotations

from collections import defaultdict

from moorline.config import NodeConfig
from moorline.sim.cluster.tuning import _CHOICES, DEFAULT_TUNING, NodeTuning, draw_tuning


def test_a_seed_always_draws_the_same_configuration() -> None:
    assert draw_tuning(123) == draw_tuning(123)
    assert len({draw_tuning(s) for s in range(50)}) > 40  # and seeds differ


def test_every_choice_and_the_default_of_every_knob_are_drawn() -> None:
    seen: dict[str, set[object]] = defaultdict(set)
    for seed in range(400):
        t = draw_tuning(seed)
        for name in _CHOICES:
            seen[name].add(getattr(t, name))
    for name, choices in _CHOICES.items():
        assert seen[name] == {*choices, getattr(DEFAULT_TUNING, name)}, name


def test_every_draw_is_a_valid_node_configuration() -> None:
    for seed in range(200):
        t = draw_tuning(seed)
        cfg = NodeConfig()
        t.apply(cfg)
        cfg.validate()
        assert cfg.shard.snapshot_every_entries == t.snapshot_every_entries
        assert cfg.mqtt.max_packet_size <= cfg.raft.max_entry_bytes


def test_differences_name_only_what_was_drawn_away_from_the_defaults() -> None:
    assert DEFAULT_TUNING.differences() == {}
    t = NodeTuning(snapshot_every_entries=40, shards=1)
    assert t.differences() == {"snapshot_every_entries": 40, "shards": 1}
