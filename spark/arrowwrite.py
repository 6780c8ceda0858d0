"""Parquet written by the executors straight from the source's Arrow batches.

`txmq spark-export` writes the `messages` table this way when it can (Parquet,
no --partition-by, a local or mounted output folder): Spark plans the read and
runs one task per read partition, and each task streams the partition's Arrow
batches (the compiled decoder's, txmq.spark.fastrows) into one Parquet file
with pyarrow. The rows never enter the JVM. Spark's own writer turns every
Arrow batch into JVM rows and encodes them again: on a 2-core machine that
was 7.9 s of the 1,000,000-record table against 0.7 s for the same bytes
written by pyarrow (docs/spark.md, "Performance").

The result reads back as the same table (`spark.read.parquet` gives the
same schema and rows; a test compares them with Spark's writer), laid out as
Spark lays one out: ``part-NNNNN-<job>-c000.<codec>.parquet`` files and an
empty ``_SUCCESS`` marker. The commit follows Spark's file committer: a task
writes under ``_temporary/<job>/`` and reports its file; once every task has
succeeded the driver renames the reported files into the folder, so a failed
or retried attempt leaves nothing behind, and an interrupted job at most a
``_temporary`` folder, which readers skip (names starting with ``_``).
"""

from __future__ import annotations

import os
import shutil
import uuid

from .formats import EXPORT_FORMATS, export_format
from .source import TxmqDataSource

# Spark's spark.sql.parquet.compression.codec names -> pyarrow's (None: no compression)
CODECS = {"snappy": "snappy", "gzip": "gzip", "zstd": "zstd", "brotli": "brotli", "lz4_raw": "lz4",
          "none": None, "uncompressed": None}
_SUFFIX = {"snappy": ".snappy", "gzip": ".gz", "zstd": ".zstd", "brotli": ".br", "lz4": ".lz4raw", None: ""}
_PARQUET = export_format("parquet")
# pyarrow's Parquet writer writes Parquet only: the one format that says this writer may write it
assert [f for f in EXPORT_FORMATS if f.arrow_writer] == [_PARQUET]


CODEC_CONF = "spark.sql.parquet.compression.codec"


def _codec_name(name: str | None) -> str:
    return (name or "snappy").lower()  # Spark's default


def codec(spark) -> str | None:
    """The session's Parquet codec as pyarrow names it; KeyError for one pyarrow cannot write (see applies)."""
    return CODECS[_codec_name(spark.conf.get(CODEC_CONF, None))]


def local_folder(out: str) -> str | None:
    """The absolute local folder `out` names (a path, or a file: URI without a host); None for any other URI.

    Absolute because the executors' working folder need not be the driver's. A host in a file: URI is left to
    Spark's writer, which knows what its file system makes of it."""
    if out.startswith("file:"):
        rest = out[len("file:"):]
        if rest.startswith("//"):
            if not rest.startswith("///"):
                return None
            rest = rest[2:]
        return os.path.abspath(rest)
    if "://" in out:
        return None
    return os.path.abspath(out)


def applies(fmt: str, partition_by, out: str, codec_name: str | None = None) -> bool:
    """Whether a table can be written this way: a format this writes (Parquet: formats' arrow_writer), not partitioned,
    into a folder this process can see, with a codec (spark.sql.parquet.compression.codec; None: Spark's default)
    pyarrow writes (Spark's lz4 is Hadoop's framing)."""
    return (export_format(fmt).arrow_writer and not partition_by and local_folder(out) is not None
            and _codec_name(codec_name) in CODECS)


def _write_partition(reader, arrow_schema, tmp: str, job: str, compression, no_dictionary: tuple[str, ...]):
    """The executors' side: one Parquet file per read partition, under tmp; yields (final name, temporary path, rows)."""

    def run(items):
        import pyarrow.parquet as pq

        for index, part in items:
            name = f"part-{index:05d}-{job}-c000{_SUFFIX[compression]}{_PARQUET.extension}"
            path = os.path.join(tmp, f"{name}.{uuid.uuid4().hex}")  # an attempt's own file: retries never collide
            rows = 0
            writer = None
            try:
                for batch in reader.read(part):
                    if not batch.num_rows:
                        continue
                    if writer is None:
                        dictionary = [n for n in batch.schema.names if n not in no_dictionary]
                        writer = pq.ParquetWriter(path, arrow_schema, compression=compression, use_dictionary=dictionary)
                    writer.write_batch(batch.cast(arrow_schema) if batch.schema != arrow_schema else batch)
                    rows += batch.num_rows
            finally:
                if writer is not None:
                    writer.close()
            if writer is not None:
                yield name, path, rows

    return run


def write(spark, options: dict[str, str], schema, path: str, no_dictionary: tuple[str, ...] = (),
          in_driver: bool = False) -> int:
    """Write the txmq source's table read with `options` as Parquet files into the folder `path`; the rows written.

    The folder may exist (append): the new files get names of their own. `no_dictionary` names the columns not to
    dictionary-encode (values that rarely repeat, such as message bodies: trying costs time and saves nothing).
    in_driver: this process writes the partitions, one after the other, as the tasks would (a small export: no Spark
    job, no Python worker to start).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyspark.sql.pandas.types import to_arrow_schema

    compression = codec(spark)
    local = local_folder(path)
    if local is None:
        raise ValueError(f"{path} is not a local folder: Spark's writer writes there")
    reader = TxmqDataSource(options).reader(schema)
    parts = list(reader.partitions())
    arrow_schema = to_arrow_schema(schema, timezone="UTC")
    job = uuid.uuid4().hex
    tmp = os.path.join(local, "_temporary", job)
    os.makedirs(tmp, exist_ok=True)
    try:
        done = []
        if parts and in_driver:
            done = list(_write_partition(reader, arrow_schema, tmp, job, compression, no_dictionary)(enumerate(parts)))
        elif parts:
            rdd = spark.sparkContext.parallelize(list(enumerate(parts)), len(parts))
            done = rdd.mapPartitions(_write_partition(reader, arrow_schema, tmp, job, compression, no_dictionary)).collect()
        for name, written, _ in done:
            try:
                os.rename(written, os.path.join(local, name))
            except FileNotFoundError:
                raise FileNotFoundError(
                    f"the executors wrote {written}, which this process cannot see: write to a folder every executor "
                    f"and the driver share, or use Spark's writer (--parquet-writer spark)"
                ) from None
        if not done:  # an empty table still has its schema, as Spark writes it: one file without rows
            name = f"part-00000-{job}-c000{_SUFFIX[compression]}{_PARQUET.extension}"
            pq.write_table(pa.Table.from_batches([], arrow_schema), os.path.join(local, name), compression=compression)
        with open(os.path.join(local, "_SUCCESS"), "wb"):
            pass
        return sum(rows for _, _, rows in done)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            os.rmdir(os.path.join(local, "_temporary"))  # only when no other job is writing there
        except OSError:
            pass
