"""The compiled `messages` decoder (spark/_columns.pyx) gives the Python path's rows, bit for bit.

No SparkSession: the readers are called directly, as an executor calls them.
"""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.spark

pa = pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")


def _fast():
    from txmq.spark import fastrows

    if fastrows.columns is None:
        pytest.skip("txmq.spark._columns is not built here (or TXMQ_PURE_PYTHON is set)")
    return fastrows


def test_the_compiled_decoder_is_built_where_the_store_speedups_are():
    """Built by the same setup.py step as the store's speed-ups: one without the other is a broken build."""
    from txmq.spark import fastrows
    from txmq.store import codec

    if os.environ.get("TXMQ_PURE_PYTHON"):
        pytest.skip("pure Python asked for")
    assert (fastrows.columns is not None) == (codec.speedups is not None)


def _tables(data_dir, **options):
    from pyspark.sql.pandas.types import to_arrow_schema

    from txmq.spark.schema import messages_schema
    from txmq.spark.source import ReadOptions, TxmqReader

    reader = TxmqReader(ReadOptions(str(data_dir), **options), messages_schema())
    schema = to_arrow_schema(messages_schema(), timezone="UTC")
    parts = reader.partitions()
    fast = pa.Table.from_batches([b for p in parts for b in reader._fast(p, schema)], schema=schema)
    slow = pa.Table.from_batches([b for p in parts for b in reader._python(p.start, p.end, p.log_end, schema)], schema=schema)
    return fast, slow


ODD_VALUES = ["7", "+3", "-2", " 12 ", "1_0", "٣", "abc", "", "99999999999", "2147483647", "-2147483648", "2147483648",
              "0012", "-", "+", "１２"]


def test_compiled_rows_equal_the_python_rows_for_every_kind_and_odd_property_values(tmp_path):
    _fast()
    from txmq.constants import DISCARD_TOPIC, DISCARD_TOPIC_ALIAS, HALF_TOPIC, OP_TOPIC
    from txmq.store import Message, Store, StoreConfig, TxType

    d = tmp_path / "d"
    msgs = []
    for i, v in enumerate(ODD_VALUES * 3):
        topic = [HALF_TOPIC, OP_TOPIC, DISCARD_TOPIC, DISCARD_TOPIC_ALIAS, "orders", "订单"][i % 6]
        tx = [TxType.PREPARED, TxType.COMMIT, TxType.ROLLBACK, TxType.NORMAL][i % 4]
        props = {"REAL_QID": v, "TRANSACTION_CHECK_TIMES": v, "UNIQ_KEY": v, "PGROUP": f"g{i}", "REAL_TOPIC": "orders",
                 "TAGS": "ü" * (i % 3), "KEYS": "k1 k2"}
        if i % 5 == 0:
            props = {f"p{j}": "x" * j for j in range(40)}  # a map16 of properties, none of the named ones
        if i % 7 == 0:
            props = {}
        born = [-(1 << 62), 1 << 62, 1_700_000_000_000][i % 3]
        body = os.urandom([0, 1, 300, 70_000][i % 4])
        msgs.append(Message(topic, i % 3, tx, born, props, body, prepared_offset=[-1, 12345][i % 2]))
    with Store(d, StoreConfig(segment_size=256 << 10)) as s:
        for m in msgs:
            s.append([m])
    fast, slow = _tables(d, partition_bytes=64 << 10, batch_rows=7)
    assert fast.num_rows == len(msgs)
    assert fast.equals(slow), [n for n in fast.column_names if not fast.column(n).equals(slow.column(n))]


def test_compiled_filters_equal_the_python_filters(tmp_path):
    _fast()
    from txmq.store import Message, Store, TxType

    d = tmp_path / "d"
    with Store(d) as s:
        s.append([Message(f"t{i % 3}", 0, TxType.NORMAL, i, {"REAL_TOPIC": "t1"} if i % 4 == 0 else {}, b"b")
                  for i in range(200)])
    for opts in ({"topics": frozenset({"t1"})}, {"kinds": frozenset({"normal"})}, {"kinds": frozenset({"half"})}):
        fast, slow = _tables(d, **opts)
        assert fast.equals(slow) and fast.num_rows == slow.num_rows


def test_a_damaged_record_in_the_middle_is_reported_as_the_python_path_reports_it(tmp_path):
    _fast()
    from txmq.store import CorruptRecordError, Message, Store, StoreReader, TxType

    d = tmp_path / "d"
    with Store(d) as s:
        s.append([Message("t", 0, TxType.NORMAL, 1, {}, bytes(100)) for _ in range(50)])
    with StoreReader(d) as r:
        victim = list(r.scan())[20]
    seg = sorted((d / "commitlog").iterdir())[0]
    with open(seg, "r+b") as f:
        f.seek(victim.commit_log_offset + victim.size - 1)
        f.write(b"\x01")
    with pytest.raises(CorruptRecordError, match=f"crc mismatch at {victim.commit_log_offset}"):
        _tables(d)
    report = tmp_path / "damage"
    report.mkdir()
    fast, slow = _tables(d, damage_report=str(report))
    assert fast.equals(slow) and fast.num_rows == 49
    assert victim.commit_log_offset not in fast.column("commit_log_offset").to_pylist()
