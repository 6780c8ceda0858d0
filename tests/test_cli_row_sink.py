"""RowSink: the rows of a listing in the format asked for, printed as they come."""

from __future__ import annotations

import json

import pytest

from txmq.cli.console import Output, RowSink, emit_document


def test_a_json_list_is_streamed_and_valid_once_closed(capsys):
    with RowSink(Output.json, shape=lambda r: {"n": r["n"] * 2}) as sink:
        for n in range(3):
            sink.add({"n": n})
            assert capsys.readouterr().out  # each row leaves at once
    assert capsys.readouterr().out.endswith("]\n")


def test_the_streamed_list_is_the_document_json_dumps_would_print(capsys):
    rows = [{"a": 1, "b": [1, 2]}, {"a": 2, "b": {"c": b"bytes"}}]
    with RowSink(Output.json) as sink:
        for r in rows:
            sink.add(r)
    streamed = capsys.readouterr().out
    emit_document(rows, Output.json)
    assert streamed == capsys.readouterr().out


@pytest.mark.parametrize("rows, expected", [(0, "[]\n"), (2, None)])
def test_close_prints_an_empty_list_and_abort_keeps_what_was_printed_valid(capsys, rows, expected):
    sink = RowSink(Output.json)
    for n in range(rows):
        sink.add({"n": n})
    sink.close()
    sink.close()  # once
    text = capsys.readouterr().out
    assert json.loads(text) == [{"n": n} for n in range(rows)]
    if expected is not None:
        assert text == expected


def test_a_failed_command_prints_no_list_unless_one_was_begun(capsys):
    with pytest.raises(RuntimeError):
        with RowSink(Output.json):
            raise RuntimeError("broker unreachable")
    assert capsys.readouterr().out == ""
    with pytest.raises(RuntimeError):
        with RowSink(Output.json) as sink:
            sink.add({"n": 1})
            raise RuntimeError("broker lost")
    assert json.loads(capsys.readouterr().out) == [{"n": 1}]


def test_jsonl_is_a_line_per_row_and_a_table_gets_each_row_or_keeps_them(capsys):
    with RowSink(Output.jsonl) as sink:
        sink.add({"n": 1})
        sink.add({"n": 2})
    assert capsys.readouterr().out == '{"n":1}\n{"n":2}\n'
    printed = []
    with RowSink(Output.table, table=printed.append) as sink:
        sink.add({"n": 1})
    kept = RowSink(Output.table)
    kept.add({"n": 2})
    kept.close()
    assert printed == [{"n": 1}] and kept.kept == [{"n": 2}] and capsys.readouterr().out == ""
