"""PySpark Structured Streaming source and sink for moorline (needs the ``spark`` extra).

from moorline.spark import MoorlineDataSource
spark.dataSource.register(MoorlineDataSource)
spark.readStream.format("moorline").option("servers", "127.0.0.1:8888").option("topics", "sensors/#").load()
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moorline.spark.interpreter import use_running_python

if TYPE_CHECKING:
    from moorline.spark.source import MoorlineDataSource

__all__ = ["MoorlineDataSource", "use_running_python"]

# Importing the integration before the SparkSession starts is enough for Spark's workers to run
# this interpreter (a virtualenv's, with pyarrow and moorline), unless PYSPARK_PYTHON is set.
use_running_python()


def __getattr__(name: str) -> Any:
    # Lazy, so the pure modules (options, planning, sequencing) import without pyspark.
    if name == "MoorlineDataSource":
        from moorline.spark.source import MoorlineDataSource

        return MoorlineDataSource
    raise AttributeError(name)
