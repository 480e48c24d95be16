"""Fixtures of the moorline.client tests (defined in client_support.py, which the tests import)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from client_support import cluster, mosquitto, procs  # noqa: E402,F401
