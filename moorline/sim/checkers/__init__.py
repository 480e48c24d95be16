"""Checkers of the simulator: Raft safety (online), total-queue and linearizability (offline)."""
