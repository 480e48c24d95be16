"""The console tests use the raw-socket MQTT client (tests/e2e/rawclient.py) and the real-process
cluster harness (tests/cluster_e2e/cluster_harness.py)."""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
for sub in ("e2e", "cluster_e2e"):
    if str(TESTS / sub) not in sys.path:
        sys.path.insert(0, str(TESTS / sub))
