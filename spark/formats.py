"""The output formats of `txmq spark-export` (``--format``), each described once.

The export (spark/export.py), the Arrow writer (spark/arrowwrite.py) and the
CLI's ``--format`` choices and help (cli/commands/spark.py) all read this
table: a format is added here, as one more ``ExportFormat``. Nothing here
imports pyspark or the store: the CLI builds its options from it at start-up.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, eq=False)
class ExportFormat:
    name: str  # --format's value, and Spark's data source name for it
    extension: str  # the data files' (after the codec's suffix: part-...-c000.snappy.parquet)
    options: Mapping[str, str]  # Spark writer options, every table (the batch and the --follow writer)
    table_options: Mapping[str, Mapping[str, str]]  # more, for one table in a batch export
    text_columns: bool  # holds no maps or binary: properties written as a JSON object string, body as base64
    arrow_writer: bool  # the messages table may be written by the executors with pyarrow (spark/arrowwrite.py)
    follow_transactions: bool  # --follow may keep the transactions table in it (the fold writes Parquet)
    note: str = ""  # what --format's help says of it besides its name


EXPORT_FORMATS: tuple[ExportFormat, ...] = (
    ExportFormat(
        name="parquet", extension=".parquet", options={},
        # bodies rarely repeat: trying to dictionary-encode them costs a third of the write
        table_options={"messages": {"parquet.enable.dictionary#body": "false"}},
        text_columns=False, arrow_writer=True, follow_transactions=True,
    ),
    ExportFormat(
        name="json", extension=".json", options={}, table_options={},
        text_columns=False, arrow_writer=False, follow_transactions=False,
    ),
    ExportFormat(
        name="csv", extension=".csv",
        options={"header": "true", "escape": '"'},  # RFC 4180 quoting: a quote inside a field is doubled
        table_options={},
        text_columns=True, arrow_writer=False, follow_transactions=False,
        note="properties as a JSON string, body as base64",
    ),
)  # fmt: skip
FORMATS = tuple(f.name for f in EXPORT_FORMATS)
DEFAULT_FORMAT = "parquet"
_BY_NAME = {f.name: f for f in EXPORT_FORMATS}
assert DEFAULT_FORMAT in _BY_NAME and len(_BY_NAME) == len(EXPORT_FORMATS)


def export_format(name: str) -> ExportFormat:
    """The format called name; ValueError naming the choices for any other."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}") from None


def format_help() -> str:
    """--format's help: the names, then what is particular to some ("parquet, json or csv (csv: ...).")."""
    names = ", ".join(FORMATS[:-1]) + " or " + FORMATS[-1] if len(FORMATS) > 1 else FORMATS[0]
    notes = "; ".join(f"{f.name}: {f.note}" for f in EXPORT_FORMATS if f.note)
    return f"{names} ({notes})." if notes else f"{names}."
