"""``MoorlineDataSource``: ``spark.dataSource.register(MoorlineDataSource)``, then ``format("moorline")``."""

from __future__ import annotations

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
)
from pyspark.sql.types import StructType

from moorline.spark.options import (
    ALL_OPTIONS,
    MoorlineOptionError,
    check_known,
    parse_read_options,
    parse_write_options,
)
from moorline.spark.reader import READ_SCHEMA, MoorlineBatchReader, MoorlineStreamReader
from moorline.spark.writer import MoorlineBatchWriter, MoorlineStreamWriter, resolve_columns

APPEND_ONLY_BATCH = 'moorline does not support Overwrite mode: moorline is append-only, use mode("append")'
APPEND_ONLY_STREAM = (
    "moorline does not support Complete mode (nor Update mode): Spark's Python sinks take "
    'outputMode("append") only; aggregate with a watermark in append mode'
)


class MoorlineDataSource(DataSource):
    """Reads moorline shards by offset and publishes rows with exactly-once identities."""

    def __init__(self, options: dict[str, str]) -> None:
        super().__init__(options)
        check_known(self.options, ALL_OPTIONS, "reads or writes")

    @classmethod
    def name(cls) -> str:
        return "moorline"

    def schema(self) -> str:
        return READ_SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        return MoorlineBatchReader(parse_read_options(self.options, streaming=False))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:  # noqa: N802 (Spark's name)
        return MoorlineStreamReader(parse_read_options(self.options, streaming=True))

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        # Without .mode(...) Spark itself refuses the write (ErrorIfExists) before asking us.
        if overwrite:
            raise MoorlineOptionError(APPEND_ONLY_BATCH)
        opts = parse_write_options(self.options)
        return MoorlineBatchWriter(opts, resolve_columns(schema, opts))

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:  # noqa: N802
        # Complete mode arrives here as overwrite=True; Spark refuses Update mode itself, before
        # asking us, with "moorline does not support Update mode": one wording for both.
        if overwrite:
            raise MoorlineOptionError(APPEND_ONLY_STREAM)
        opts = parse_write_options(self.options)
        return MoorlineStreamWriter(opts, resolve_columns(schema, opts))
