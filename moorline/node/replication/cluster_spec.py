"""The cluster as a node's configuration describes it: the initial members and their addresses
(``--initial-cluster``, parsed into a ``ClusterSpec``, which also takes members learned at runtime
from the member table), and the node's cluster TLS.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moorline.cluster.auth import ClusterConfigError
from moorline.cluster.tls import ClusterTls, cert_node_name, load_cluster_tls
from moorline.config import ClusterConfig, ConfigError


def load_node_tls(cfg: ClusterConfig, me: str) -> ClusterTls | None:
    """Cluster TLS from cluster.tls.* (None when not configured); the certificate must name ``me``."""
    t = cfg.tls
    if not (t.cert_file and t.key_file and t.ca_file):
        return None
    tls = load_cluster_tls(t.cert_file, t.key_file, t.ca_file, t.crl_file)
    named = cert_node_name(t.cert_file)
    if named != me:
        raise ClusterConfigError(f"cluster.tls.cert_file {t.cert_file} is the certificate of node {named!r}, "
                                 f"not of this node ({me!r}): each node needs its own certificate")
    return tls




def parse_hostport(value: str, what: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"{what} must be HOST:PORT, not {value!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


@dataclass(frozen=True)
class ClusterSpec:
    """The cluster as this node's link knows it. ``names`` are the initial members (the cluster's
    key and bootstrap); ``ids`` and ``addresses`` also hold members learned at runtime from the
    member table (``ClusterLink.learn_member``)."""

    me: str
    names: tuple[str, ...]  # initial_cluster order: their node ids are positions + 1
    addresses: dict[str, tuple[str, int]]
    listen: tuple[str, int]
    ids: dict[str, int] = field(default_factory=dict)  # every known member's node id (initial ones filled in)

    def __post_init__(self) -> None:
        for pos, name in enumerate(self.names):
            self.ids.setdefault(name, pos + 1)

    def node_id(self, name: str) -> int:
        """KeyError: not a member this node knows."""
        return self.ids[name]

    def name_of(self, node_id: int) -> str:
        """KeyError: no member this node knows has that id."""
        for name, nid in self.ids.items():
            if nid == node_id:
                return name
        raise KeyError(node_id)

    def has_id(self, node_id: int) -> bool:
        return any(nid == node_id for nid in self.ids.values())

    @property
    def known(self) -> tuple[str, ...]:
        """Every member this node knows (initial ones first, then as learned)."""
        return tuple(self.ids)

    @property
    def my_id(self) -> int:
        return self.node_id(self.me)


def parse_cluster(cfg: ClusterConfig) -> ClusterSpec | None:
    """None without cluster settings (one node); a checked spec otherwise."""
    given = [cfg.node_id, cfg.initial_cluster]
    if all(v is None for v in given) and cfg.listen is None:
        return None
    if cfg.node_id is None or cfg.initial_cluster is None:
        raise ConfigError("a cluster needs --node-id and --initial-cluster (and --cluster for its peer address)")
    names: list[str] = []
    addresses: dict[str, tuple[str, int]] = {}
    for item in cfg.initial_cluster.split(","):
        name, sep, addr = item.strip().partition("=")
        if not sep or not name:
            raise ConfigError(f"--initial-cluster items are NAME=HOST:PORT, not {item!r}")
        if name in addresses:
            raise ConfigError(f"--initial-cluster names {name!r} twice")
        names.append(name)
        addresses[name] = parse_hostport(addr, f"--initial-cluster {name}")
    if len(names) not in (1, 3, 5):
        raise ConfigError(f"--initial-cluster must name 1, 3 or 5 nodes, not {len(names)}")
    if cfg.node_id not in addresses:
        raise ConfigError(f"--node-id {cfg.node_id!r} is not in --initial-cluster ({', '.join(names)})")
    listen = parse_hostport(cfg.listen, "--cluster") if cfg.listen else addresses[cfg.node_id]
    return ClusterSpec(cfg.node_id, tuple(names), addresses, listen)
