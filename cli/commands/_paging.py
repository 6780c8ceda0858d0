"""Listings that never stop silently: page through the broker with a cursor, stream rows as they come.

The rule (docs/cli.md, "Listings"): without `--limit`, a listing shows every
row, fetched in pages of PAGE rows, except a table on a terminal, which
shows the first DEFAULT_TERMINAL_LIMIT. Whenever a limit cuts a listing, a
note on stderr says so, in every output format.
"""

from __future__ import annotations

from typing import Any

from ..console import Output, RowSink, out

PAGE = 1000


def effective_limit(limit: int | None, output: Output, terminal_default: int) -> tuple[int | None, bool]:
    """(the limit to apply or None for all, whether it is the terminal default rather than asked for)."""
    if limit is not None:
        return limit, False
    if output is Output.table and out.is_terminal:
        return terminal_default, True
    return None, False


def stream_pages(broker: str, token: str | None, op: str, fields: dict[str, Any], rows_key: str, cursor_field: str,
                 limit: int | None, sink: RowSink) -> tuple[int | None, bool, bool]:
    """Fetch pages until the cursor ends or `limit` rows: (total the broker reported or None, more rows left, broker pages).

    A broker without cursors (an older version) answers one page: the rows
    it gave, and `more` when its total says there were others (the caller
    then says so and exits non-zero unless the user asked for a limit).
    """
    from ..client_ops import connect
    from ..common import run

    async def go() -> tuple[int | None, bool, bool]:
        total: int | None = None
        async with connect(broker, token, request_timeout=120.0) as c:
            after: int | None = None
            while True:
                want = PAGE if limit is None else min(PAGE, limit - sink.count)
                req = dict(fields, limit=want)
                if after is not None:
                    req[cursor_field] = after
                reply = await c.request(op, req)
                rows = reply[rows_key]
                if total is None and reply.get("total") is not None:
                    total = reply["total"]
                for r in rows:
                    sink.add(r)
                if "cursor" not in reply:  # an older broker: one page only
                    return total, total is not None and total > sink.count, False
                after = reply["cursor"]
                if after is None:
                    return total, False, True
                if limit is not None and sink.count >= limit:
                    return total, True, True

    return run(go())


def cut_note(shown: int, total: int | None, what: str, asked: bool, old_broker: bool = False) -> str:
    of = f" of {total}" if total is not None else ""
    if old_broker:
        return (f"showing {shown}{of} {what}: the broker does not page listings (an older version); "
                f"upgrade it, or narrow the listing with filters")
    if asked:
        return f"showing {shown}{of} {what} (--limit)"
    return f"showing the first {shown}{of} {what}: --limit N for more, or -o jsonl for all"
