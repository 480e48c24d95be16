"""``format("moorline")`` without a register call.

PySpark looks through the installed top-level modules named ``pyspark_*`` for one defining
``DefaultSource`` (a ``DataSource`` subclass) and registers it under its ``name()`` on the driver
(pyspark/sql/worker/lookup_data_sources.py); the class travels to executors pickled by reference,
so moorline must be installed wherever Spark runs Python. ``spark.dataSource.register(
MoorlineDataSource)`` keeps working (and is needed in a development checkout installed with
``pip install -e``, whose modules that lookup cannot list).
"""

from __future__ import annotations

import sys

try:
    from moorline.spark.source import MoorlineDataSource as DefaultSource
except ImportError as exc:  # pyspark or pyarrow missing: leave the lookup of other sources intact
    print(f"pyspark_moorline: format('moorline') is not available: {exc}", file=sys.stderr)
else:
    __all__ = ["DefaultSource"]
