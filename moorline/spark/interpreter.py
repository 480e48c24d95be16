"""Spark's Python workers run the interpreter that runs the driver (so a virtualenv works).

Spark starts its Python workers (and, on the driver, the processes that look up and plan Python
data sources) with ``PYSPARK_PYTHON`` / ``PYSPARK_DRIVER_PYTHON``, else with whatever ``python3``
is first on the PATH: from a virtualenv that was not activated, that is the system interpreter,
without pyarrow or moorline. Setting both to ``sys.executable`` before the JVM starts keeps every
process on the interpreter that has them. A value the user set is left alone.
"""

from __future__ import annotations

import os
import sys

VARIABLES = ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")


def use_running_python() -> dict[str, str]:
    """Set the variables Spark reads to this interpreter unless set; returns what is in force."""
    if sys.executable:  # empty when embedded: then Spark's default is all there is
        for name in VARIABLES:
            if not os.environ.get(name):
                os.environ[name] = sys.executable
    return {name: os.environ.get(name, "") for name in VARIABLES}
