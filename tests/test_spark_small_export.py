"""A small export on a local master is read by the driver: the same tables, without Spark's Python processes.

Spark reads a Python data source through Python processes it starts one after
the other (finding the source, creating it, planning the read, the reading
workers): seconds each on a busy machine, whatever the size of the log. A
small export skips them; these tests check it writes what Spark's read writes,
directly from a data directory and through a broker, and that past its bound
the reading is Spark's again.
"""

from __future__ import annotations

import pytest

from brokerproc import BrokerProcess
from test_spark import run_scenario

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    d = tmp_path_factory.mktemp("small") / "data"
    run_scenario(d)  # every record kind, every transaction outcome
    return d


def _export(spark, out, **kw):
    from txmq.spark.export import ExportOptions, export

    return export(spark, ExportOptions(kw.pop("data_dir", ""), str(out), **kw))


def _jobs(spark, table: str) -> set[int]:
    return set(spark.sparkContext.statusTracker().getJobIdsForGroup(f"txmq-{table}"))


def _read_back(spark, out, fmt: str) -> dict[str, tuple[str, list[dict]]]:
    """Each table as written: its schema (as the files hold it) and its rows."""
    from txmq.spark.formats import export_format

    tables = {}
    for name, key in (("messages", "commit_log_offset"), ("transactions", "tx_id")):
        reader = spark.read.format(fmt)
        if export_format(fmt).text_columns:  # CSV: every column a string, as written
            reader = reader.options(**export_format(fmt).options).option("header", True)
        df = reader.load(str(out / name))
        rows = sorted((r.asDict() for r in df.collect()), key=lambda r: str(r[key]))
        assert rows, name
        tables[name] = (df.schema.simpleString(), rows)
    return tables


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_a_small_export_read_by_the_driver_writes_the_tables_sparks_read_writes(spark, scenario, tmp_path, fmt):
    messages_jobs = _jobs(spark, "messages")
    small = _export(spark, tmp_path / "driver", data_dir=str(scenario), fmt=fmt)
    if fmt == "parquet":  # written from the driver's Arrow batches: no Spark job, no Python worker started
        assert _jobs(spark, "messages") == messages_jobs
    spark_read = _export(spark, tmp_path / "spark", data_dir=str(scenario), fmt=fmt, driver_read_bytes=0)
    assert _jobs(spark, "messages") != messages_jobs  # Spark's read ran for the messages table
    assert [(t.name, t.rows) for t in small.tables] == [(t.name, t.rows) for t in spark_read.tables]
    assert small.bytes_read == spark_read.bytes_read and small.end_offset == spark_read.end_offset
    assert _read_back(spark, tmp_path / "driver", fmt) == _read_back(spark, tmp_path / "spark", fmt)


def test_a_small_export_through_a_broker_read_by_the_driver_writes_the_tables_sparks_read_writes(spark, tmp_path):
    d = tmp_path / "data"
    run_scenario(d, plain=9)
    with BrokerProcess(d, "--check-interval", "1d") as b:
        messages_jobs = _jobs(spark, "messages")
        small = _export(spark, tmp_path / "driver", broker=b.address)
        assert _jobs(spark, "messages") == messages_jobs
        spark_read = _export(spark, tmp_path / "spark", broker=b.address, driver_read_bytes=0)
    assert [(t.name, t.rows) for t in small.tables] == [(t.name, t.rows) for t in spark_read.tables]
    assert small.rows_planned == spark_read.rows_planned > 0
    assert _read_back(spark, tmp_path / "driver", "parquet") == _read_back(spark, tmp_path / "spark", "parquet")


def test_past_the_drivers_bound_spark_reads_the_log(spark, scenario, tmp_path):
    from txmq.spark.export import read_in_driver
    from txmq.store import StoreReader

    with StoreReader(str(scenario)) as r:
        end = r.max_offset
    options = {"path": str(scenario), "endOffset": str(end)}
    assert read_in_driver(options, 1) is None  # more Arrow bytes than allowed: left to Spark
    table = read_in_driver(options, 64 << 20)
    assert table is not None and table.num_rows > 0
    messages_jobs = _jobs(spark, "messages")
    res = _export(spark, tmp_path / "out", data_dir=str(scenario), driver_read_bytes=end // 2)  # the log is larger
    assert _jobs(spark, "messages") != messages_jobs and res.tables[0].rows == table.num_rows


def test_an_empty_selection_read_by_the_driver_still_writes_both_tables(spark, scenario, tmp_path):
    res = _export(spark, tmp_path / "out", data_dir=str(scenario), topics=("no-such-topic",))
    assert [(t.name, t.rows) for t in res.tables] == [("messages", 0), ("transactions", 0)]
    for name in ("messages", "transactions"):
        assert spark.read.parquet(str(tmp_path / "out" / name)).count() == 0
