"""Typed errors of ``moorline.client``. Every one is an ``MqttClientError``; none of them is a bug."""

from __future__ import annotations


class MqttClientError(Exception):
    """Base class of everything ``moorline.client`` raises on purpose."""


class ClientClosed(MqttClientError):
    """The client was closed (or never entered) before the operation could finish."""


class PublishTimeout(MqttClientError):
    """Not acknowledged within ``publish_timeout``. The message stays in the retransmit buffer and
    is resent (with the same producer and sequence) until acknowledged or older than ``max_age``:
    it is applied at most once, perhaps later."""


class PublishRefused(MqttClientError):
    """The broker answered with an error reason code: the message was not applied."""

    def __init__(self, reason_code: int, reason: str = "") -> None:
        text = f"publish refused (reason 0x{reason_code:02X})"
        if reason:
            text += f": {reason}"
        super().__init__(text)
        self.reason_code = reason_code
        self.reason = reason


class MessageExpired(MqttClientError):
    """Older than the retransmit buffer's ``max_age`` without an acknowledgement: given up. It may
    have been applied (at most once); later messages of the same topic are given up with it, so the
    order of what succeeded is kept."""


class BufferFull(MqttClientError):
    """The retransmit buffer is at its byte or count bound (``when_full="raise"``, or ``"block"`` for
    longer than ``publish_timeout``). Nothing was queued."""


class SubscribeFailed(MqttClientError):
    """The broker refused a subscription (SUBACK reason code >= 0x80)."""

    def __init__(self, topic_filter: str, reason_code: int) -> None:
        super().__init__(f"subscription to {topic_filter!r} refused (reason 0x{reason_code:02X})")
        self.topic_filter = topic_filter
        self.reason_code = reason_code


class SpoolError(MqttClientError):
    """The spool file cannot be used (locked by another process, unreadable, not a spool)."""


class BatchFailed(MqttClientError):
    """Some publishes of a ``batch()`` failed; ``errors`` maps their index in the batch to the error."""

    def __init__(self, errors: dict[int, BaseException], total: int) -> None:
        first = next(iter(errors.values()))
        super().__init__(f"{len(errors)} of {total} publishes failed (first: {first})")
        self.errors = errors
        self.total = total
