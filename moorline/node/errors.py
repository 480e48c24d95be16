"""Errors the node's parts raise to the edge (connection handlers) and the admin API."""

from __future__ import annotations


class NodeFailure(Exception):
    pass


class SessionOwnedByOther(Exception):
    """A CONNECT found its client id's session owned by another principal: refused, nothing changed."""


class SessionQuotaExceeded(Exception):
    """A CONNECT would give its user more than session.max_persistent_per_user persistent sessions:
    refused, nothing changed."""


class ShardUnavailable(Exception):
    """The shard refuses service (e.g. corruption detected in synced data)."""
