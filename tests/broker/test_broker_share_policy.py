"""Issue 33: the [share] work-queue configuration (bad values are clear errors), which groups a
policy reaches, the SUBSCRIBE user property, and the dead-letter copy of a message."""

from __future__ import annotations

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
    ({"share.max_deliveries": -1}, "share.max_deliveries"),
    ({"share.ack_timeout_s": -0.5}, "share.ack_timeout_s"),
    ({"share.dead_letter_topic": "dlq/{grp}/{topic}"}, "share.dead_letter_topic"),
    ({"share.dead_letter_topic": "dlq/#"}, "share.dead_letter_topic"),
    ({"share.dead_letter_topic": ""}, "share.dead_letter_topic"),
    ({"share.single_active": "orders-*"}, "must be a list"),
])
def test_bad_share_config_is_a_clear_error(override: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(None, override)


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
