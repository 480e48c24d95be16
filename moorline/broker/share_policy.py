"""Work-queue policies of ``$share`` groups (docs/queues.md): which groups are single-active,
their delivery limit and ack timeout (from the node's ``[queue]`` config, stamped into the group's
``Register`` so every replica applies the same), and the dead-letter message of a message past
its delivery limit (published under a GUID derived from group, shard and offset: exactly once)."""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

from moorline.broker.messages import MessageProps, StoredMessage
from moorline.hashing import guid128

SHARE_MODE_PROPERTY = "moorline-share-mode"  # SUBSCRIBE user property (MQTT 5) ...
SINGLE_ACTIVE = "single-active"  # ... and the value that makes the group single-active


@dataclass(frozen=True, slots=True)
class GroupPolicy:
    single_active: bool
    max_deliveries: int
    ack_timeout_ms: int


def wants_single_active(user_properties: tuple[tuple[str, str], ...]) -> bool:
    """Whether a SUBSCRIBE's user properties ask for a single-active group."""
    return any(k.lower() == SHARE_MODE_PROPERTY and v.strip().lower() == SINGLE_ACTIVE
               for k, v in user_properties)


def group_policy(single_active: list[str], limited: list[str], max_deliveries: int, ack_timeout_s: float,
                 group: str, asked_single_active: bool = False) -> GroupPolicy:
    """The policy a group's Register carries, from the ``[share]`` config and the subscription."""
    single = asked_single_active or any(fnmatchcase(group, pat) for pat in single_active)
    lim = any(fnmatchcase(group, pat) for pat in limited)
    return GroupPolicy(single, max_deliveries if lim else 0, int(ack_timeout_s * 1000) if lim else 0)


def dead_letter_guid(group: str, filter_: str, shard: int, offset: int) -> bytes:
    """The dead-letter copy's GUID: the same on every node and every attempt, so a leader change
    between the publish and ShareDeadLettered publishes it again as a duplicate, never twice."""
    return guid128("dlq", group, filter_, shard, offset)


def dead_letter_message(template: str, group: str, filter_: str, shard: int, offset: int, msg: StoredMessage,
                        attempts: int, last_member: str, now_ms: int) -> StoredMessage:
    """The copy of ``msg`` for the dead-letter topic, with user properties naming the original
    topic, the delivery attempts and the last member it was handed to."""
    topic = template.format(group=group, topic=msg.topic)
    old = msg.props or MessageProps()
    extra = (("moorline-original-topic", msg.topic), ("moorline-deliveries", str(attempts)),
             ("moorline-last-consumer", last_member), ("moorline-share-group", group))
    props = MessageProps(old.payload_format, old.content_type, old.response_topic, old.correlation_data,
                         old.user_properties + extra)
    return StoredMessage(topic, msg.payload, max(msg.qos, 1), False, dead_letter_guid(group, filter_, shard, offset),
                         now_ms, None, props, msg.origin)
