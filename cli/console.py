"""The one place that holds the rich consoles and the output format rules.

Only cli/ prints. Data goes to stdout; messages and errors go to stderr.
Without a terminal there is no colour and no box drawing, and tables are
never wrapped or truncated (a pipe has no width).
"""

from __future__ import annotations

import base64
import json
import sys
from enum import Enum
from typing import Any, Callable, Sequence

from rich.console import Console
from rich.markup import escape as esc  # text from users, the broker or the system: never read as markup
from rich.theme import Theme

THEME = Theme({"ok": "green", "warn": "yellow", "err": "bold red", "dim": "dim", "key": "cyan"})

out = Console(theme=THEME, soft_wrap=True, highlight=False)
err = Console(theme=THEME, stderr=True, soft_wrap=True, highlight=False)


class Output(str, Enum):
    table = "table"
    json = "json"
    jsonl = "jsonl"


def default_output() -> Output:
    return Output.table if sys.stdout.isatty() else Output.jsonl


def resolve_output(output: Output | None) -> Output:
    return output or default_output()


def interactive() -> bool:
    """Both ends are a person: live views and progress bars are allowed."""
    return out.is_terminal and err.is_terminal


def to_jsonable(v: Any) -> Any:
    if isinstance(v, (bytes, bytearray)):
        try:
            return bytes(v).decode("utf-8")
        except UnicodeDecodeError:
            return base64.b64encode(bytes(v)).decode("ascii")
    if isinstance(v, dict):
        return {str(k): to_jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [to_jsonable(x) for x in v]
    if isinstance(v, Enum):
        return v.value
    return v


def emit_line(obj: dict[str, Any]) -> None:
    """One JSON object per line, flushed at once (pipelines see progress)."""
    sys.stdout.write(json.dumps(to_jsonable(obj), separators=(",", ":"), ensure_ascii=False) + "\n")
    sys.stdout.flush()


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(to_jsonable(obj), indent=2, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def emit_document(doc: Any, output: Output) -> bool:
    """``-o json``: doc as one indented document; ``-o jsonl``: as one line. False for a table, which the caller draws."""
    if output is Output.json:
        emit_json(doc)
        return True
    if output is Output.jsonl:
        emit_line(doc)
        return True
    return False


class RowSink:
    """Rows as they come, in the output format asked for.

    ``-o jsonl``: a line each. ``-o json``: one list, streamed element by
    element, so memory stays flat however many rows there are; it is valid
    JSON once closed, so close it on every way out (``with`` does). A table:
    each row to ``table`` (printed as it comes), or, without one, kept in
    ``kept`` for the caller to draw at the end.
    """

    def __init__(self, output: Output, shape: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                 table: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.output = output
        self.shape = shape
        self.table = table
        self.kept: list[dict[str, Any]] = []
        self.count = 0
        self._opened = False
        self._closed = False

    def add(self, raw: dict[str, Any]) -> None:
        row = self.shape(raw) if self.shape is not None else raw
        self.count += 1
        if self.output is Output.jsonl:
            emit_line(row)
        elif self.output is Output.json:
            text = json.dumps(to_jsonable(row), indent=2, ensure_ascii=False)
            sys.stdout.write(("[\n" if not self._opened else ",\n") + "  " + text.replace("\n", "\n  "))
            sys.stdout.flush()
            self._opened = True
        elif self.table is not None:
            self.table(row)
        else:
            self.kept.append(row)

    def close(self) -> None:
        """End the JSON list (``[]`` when there was no row); once."""
        if self._closed:
            return
        self._closed = True
        if self.output is Output.json:
            sys.stdout.write("\n]\n" if self._opened else "[]\n")
            sys.stdout.flush()

    def abort(self) -> None:
        """The command failed: end a list already begun (what was printed stays valid), print none otherwise."""
        if not self._opened:
            self._closed = True
        self.close()

    def __enter__(self) -> "RowSink":
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.abort() if exc_type is not None else self.close()


def warn(message: str) -> None:
    """A one-line warning on stderr (never on stdout, which may be piped)."""
    from rich.markup import escape

    err.print("[warn]warning:[/warn] " + escape(message))


def note(message: str) -> None:
    from rich.markup import escape

    err.print("[dim]" + escape(message) + "[/dim]")


def fmt_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 0:
        return "-" + fmt_age(-seconds)
    s = int(seconds)
    if s < 60:
        if seconds < 1:
            return f"{int(seconds * 1000)}ms"
        return f"{seconds:.1f}s" if seconds < 10 else f"{s}s"
    m, s = divmod(s, 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    if h < 48:
        return f"{h}h{m:02d}m"
    d, h = divmod(h, 24)
    return f"{d}d{h:02d}h"


def fmt_duration(seconds: float | None) -> str:
    """A duration as it would be typed: 500ms, 6s, 1m30s, 72h (exact, for settings)."""
    if seconds is None:
        return "-"
    if seconds and seconds < 1:
        return f"{seconds * 1000:g}ms"
    if seconds != int(seconds):
        return f"{seconds:g}s"
    s = int(seconds)
    parts = []
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if unit == "d" and not (s >= 7 * 86400 and s % 86400 == 0):
            continue  # 72h reads better than 3d
        if s >= n:
            parts.append(f"{s // n}{unit}")
            s %= n
    if s or not parts:
        parts.append(f"{s}s")
    return "".join(parts)


def fmt_ts(ms: int | None) -> str:
    """An absolute time (ms since the epoch) as every command shows one: ISO 8601 in UTC, to the
    millisecond, with its zone: 2026-01-31T12:00:00.250Z (what `--since`/`--to` read back)."""
    if not ms:
        return "-"
    import datetime as _dt

    try:
        t = _dt.datetime.fromtimestamp(ms / 1000, _dt.timezone.utc)
    except (OverflowError, OSError, ValueError):  # beyond what datetime holds: the number itself
        return str(ms)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


def fmt_when(ms: int | None, now_ms: int | None = None) -> str:
    """An absolute time as relative to now: '3m12s ago', 'in 4s'."""
    if not ms:
        return "-"
    import time as _time

    now_ms = now_ms if now_ms is not None else int(_time.time() * 1000)
    d = (ms - now_ms) / 1000
    if abs(d) < 0.5:
        return "now"
    return f"in {fmt_age(d)}" if d > 0 else f"{fmt_age(-d)} ago"


def new_table(title: str | None = None):
    from rich import box
    from rich.table import Table

    from rich.text import Text

    # Two spaces between columns, on a terminal (the rule under the header; each column's divider is a
    # space of the box) as in a pipe (no box: a space of padding each side), so rows fit 120 columns.
    terminal = out.is_terminal
    return Table(
        title=Text(title) if title is not None else None, box=box.SIMPLE_HEAD if terminal else None, header_style="bold",
        show_edge=False, pad_edge=False, title_justify="left", padding=(0, 1, 0, 0) if terminal else (0, 1),
    )


def print_table(table: Any) -> None:
    """On a terminal as rich draws it; in a pipe as plain aligned text, never wrapped.

    A table too wide for the terminal even with its free-text columns folded
    (ids, offsets and times are never cut) is printed as in a pipe, its long
    lines left to the terminal to wrap: rich would cut the ids and drop whole
    columns to make it fit.
    """
    if out.is_terminal:
        from rich.measure import Measurement

        if Measurement.get(out, out.options.update_width(1 << 16), table).minimum <= out.width:
            out.print(table)
            return
    plain = Console(width=1 << 16, no_color=True, color_system=None, highlight=False, soft_wrap=True,
                    force_terminal=False, theme=THEME)
    with plain.capture() as cap:
        plain.print(table)
    text = "\n".join(line.rstrip() for line in cap.get().splitlines()).strip("\n")
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def render(rows: Sequence[dict[str, Any]], output: Output, columns: Sequence[tuple[str, str]] | None = None,
           title: str | None = None, formatters: dict[str, Callable[[Any], str]] | None = None,
           document: Any = None, empty: str | None = None) -> None:
    """Print rows as a table, one JSON document, or JSON lines."""
    if output is Output.json:
        emit_json(document if document is not None else list(rows))
        return
    if output is Output.jsonl:
        for r in rows:
            emit_line(r)
        return
    if not rows and empty is not None:
        err.print(f"[dim]{esc(empty)}[/dim]")
        return
    columns = columns or [(k, k) for k in (rows[0].keys() if rows else [])]
    formatters = formatters or {}
    table = new_table(title)
    for key, label in columns:
        if is_exact(key):  # ids and offsets are copied: never wrapped or cut, the free-text columns give way
            table.add_column(label, no_wrap=True, overflow="ignore", min_width=len(label))
        else:
            table.add_column(label, overflow="fold")
    for r in rows:
        table.add_row(*[_cell(r.get(k), formatters.get(k)) for k, _ in columns])
    print_table(table)


def is_exact(key: str) -> bool:
    """A column whose values are copied whole (ids, offsets, times): never wrapped in a table."""
    return key in ("tx_id", "msg_id", "ref") or key.endswith(("_id", "offset", "_at"))


def _cell(v: Any, f: Any) -> str:
    from rich.markup import escape

    if f is not None:
        return f(v)
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (bytes, bytearray)):
        return escape(to_jsonable(v))
    if isinstance(v, dict):
        return escape(",".join(f"{k}={x}" for k, x in v.items())) or "-"
    return escape(str(v))


def kv_table(d: dict[str, Any], output: Output, title: str | None = None,
             formatters: dict[str, Callable[[Any], str]] | None = None) -> None:
    if emit_document(d, output):
        return
    formatters = formatters or {}
    t = new_table(title)
    t.show_header = False
    t.add_column(style="key")
    t.add_column(overflow="fold")
    for k, v in d.items():
        t.add_row(k, _cell(v, formatters.get(k)))
    print_table(t)
