"""Shard replicas: Raft groups and their stores, group commit, snapshots, the cluster link, placement."""
