"""Issue 33: the [queue] work-queue configuration (bad values are clear errors), which groups a
policy reaches, the SUBSCRIBE user property, and the dead-letter copy of a message."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from moorline.broker.messages import MessageProps, StoredMessage
from moorline.broker.share_policy import (
    GroupPolicy,
    dead_letter_guid,
    dead_letter_message,
    group_policy,
    wants_single_active,
)
from moorline.config import ConfigError, load_config


@pytest.mark.parametrize("override, needle", [
    ({"queue.max_deliveries": -1}, "queue.max_deliveries"),
    ({"queue.ack_timeout_s": -0.5}, "queue.ack_timeout_s"),
    ({"queue.dead_letter_topic": "dlq/{grp}/{topic}"}, "queue.dead_letter_topic"),
    ({"queue.dead_letter_topic": "dlq/#"}, "queue.dead_letter_topic"),
    ({"queue.dead_letter_topic": ""}, "queue.dead_letter_topic"),
    ({"queue.single_active": "orders-*"}, "must be a list"),
])
def test_bad_queue_config_is_a_clear_error(override: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(None, override)


@pytest.mark.parametrize("key", ["single_active", "limited_groups", "max_deliveries", "dead_letter_topic",
                                 "ack_timeout_s"])
def test_the_old_share_names_are_an_error_naming_the_new_key(key: str, tmp_path: Path) -> None:
    """Issue 33 names the keys queue.*: a file (or environment variable) still using share.* is told
    the new name, never silently read or ignored."""
    value = {"single_active": '["a"]', "limited_groups": '["a"]', "max_deliveries": "3",
             "dead_letter_topic": '"dlq/{group}"', "ack_timeout_s": "2.0"}[key]
    f = tmp_path / "m.toml"
    f.write_text(f"[share]\ndispatch = \"round_robin\"\n{key} = {value}\n")
    with pytest.raises(ConfigError, match=rf"share\.{key} is now queue\.{key}"):
        load_config(f)
    with pytest.raises(ConfigError, match=rf"share\.{key} is now queue\.{key}"):
        load_config(None, environ={f"MOORLINE_SHARE__{key.upper()}": value})
    f.write_text(f"[share]\ndispatch = \"sticky_topic\"\n[queue]\n{key} = {value}\n")
    cfg = load_config(f)
    assert cfg.share.dispatch == "sticky_topic" and getattr(cfg.queue, key) == tomllib.loads(f"v = {value}")["v"]


def test_policies_reach_the_groups_their_patterns_match() -> None:
    assert group_policy(["orders-*"], ["*"], 3, 1.5, "orders-eu") == GroupPolicy(True, 3, 1500)
    assert group_policy(["orders-*"], ["*"], 3, 1.5, "billing") == GroupPolicy(False, 3, 1500)
    assert group_policy([], ["bulk-*"], 3, 1.5, "billing") == GroupPolicy(False, 0, 0)
    assert group_policy([], [], 0, 0, "x", asked_single_active=True).single_active


def test_the_subscribe_user_property() -> None:
    assert wants_single_active((("moorline-share-mode", "single-active"),))
    assert wants_single_active((("Moorline-Share-Mode", " Single-Active "),))
    assert not wants_single_active((("moorline-share-mode", "round-robin"),))
    assert not wants_single_active(())


def test_the_dead_letter_copy() -> None:
    props = MessageProps(content_type="application/json", user_properties=(("k", "v"),))
    msg = StoredMessage("jobs/1", b"body", 0, False, b"g" * 16, 5, 60, props, "producer")
    dl = dead_letter_message("$dlq/{group}/{topic}", "g1", "jobs/#", 3, 42, msg, 4, "worker-7", 9000)
    assert dl.topic == "$dlq/g1/jobs/1" and dl.payload == b"body" and dl.qos == 1 and not dl.retain
    assert dl.guid == dead_letter_guid("g1", "jobs/#", 3, 42) != dead_letter_guid("g1", "jobs/#", 3, 43)
    assert dl.props is not None and dl.props.content_type == "application/json"
    assert dict(dl.props.user_properties) == {
        "k": "v", "moorline-original-topic": "jobs/1", "moorline-deliveries": "4",
        "moorline-last-consumer": "worker-7", "moorline-share-group": "g1"}
    assert dl.ts_ms == 9000 and dl.expiry_s is None
