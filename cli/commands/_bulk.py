"""What `resolve` and `discard replay` share: REFs from arguments or stdin, confirmation, per-REF results.

A REF on stdin may be a bare token (an offset or a transaction id), a JSON
string (`jq .tx_id` without -r), a JSON number, or a JSON object with a
`tx_id` key, so `txmq inspect half -o jsonl | txmq resolve --rollback - --yes`
works without jq in between.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Callable, Iterable, Sequence

import typer

from .. import exitcodes
from ..common import CliError
from ..console import Output, emit_json, emit_line, err, interactive, render

STATUS_EXIT = {"not_found": exitcodes.NOT_FOUND, "conflict": exitcodes.CONFLICT}
OK_STATUSES = ("ok", "already")


def ref_token(line: str, where: str) -> str | None:
    """The REF a line of stdin names, or None for a blank line."""
    text = line.strip()
    if not text:
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # stdin bytes that are not UTF-8 (decoded with surrogateescape)
        raise CliError(f"{where}: not valid UTF-8: {text.encode('utf-8', 'surrogateescape')[:60]!r}", exitcodes.USAGE) from None
    if text[0] in '{["' or text in ("null", "true", "false"):
        try:
            v = json.loads(text)
        except ValueError:
            raise CliError(f"{where}: not valid JSON: {text[:60]!r}", exitcodes.USAGE) from None
        if isinstance(v, dict):
            v = v.get("tx_id")
            if v is None:
                raise CliError(f"{where}: JSON object without a tx_id key", exitcodes.USAGE)
        if isinstance(v, bool) or not isinstance(v, (str, int)):
            raise CliError(f"{where}: expected a transaction id, an offset or an object with tx_id, got {text[:60]!r}", exitcodes.USAGE)
        return str(v)
    if len(text.split()) != 1:
        raise CliError(f"{where}: expected one REF per line, got {text[:60]!r}", exitcodes.USAGE)
    return text


def collect_refs(args: Sequence[str]) -> list[str]:
    """Arguments in order, with '-' replaced by the REFs read from stdin (once)."""
    refs: list[str] = []
    stdin_read = False
    for a in args:
        if a == "-":
            if stdin_read:
                continue
            stdin_read = True
            if sys.stdin.isatty():
                err.print("[dim]reading REFs from stdin, one per line; end with Ctrl-D[/dim]")
            for n, line in enumerate(sys.stdin, 1):
                tok = ref_token(line, f"stdin line {n}")
                if tok is not None:
                    refs.append(tok)
        else:
            tok = ref_token(a, f"REF {a!r}")
            if tok is not None:
                refs.append(tok)
    return refs


def is_int(text: str) -> bool:
    return text.isdigit() or (text.startswith("+") and text[1:].isdigit())


def confirm(n: int, what: str, yes: bool, dry_run: bool, always: bool = False) -> None:
    """More than one REF (or `always`, for --all): ask on a terminal, refuse without one, unless --yes."""
    if yes or dry_run or (n <= 1 and not always):
        return
    if not (sys.stdin.isatty() and err.is_terminal):
        raise CliError(f"refusing to {what} {n} transaction{'s' if n != 1 else ''} without a terminal to confirm on: pass --yes (or --dry-run to preview)",
                       exitcodes.USAGE)
    if not typer.confirm(f"{what.capitalize()} {n} transaction{'s' if n != 1 else ''}?", default=False, err=True):
        raise CliError("aborted: nothing was changed", exitcodes.ERROR)


def run_bulk(broker: str, token: str | None, op: str, build: Callable[[list[Any]], dict[str, Any]],
             items: Sequence[Any], texts: Sequence[str], output: Output, label: str, chunk: int = 500) -> list[dict[str, Any]]:
    """Send items to the broker in chunks of one request each, streaming jsonl rows; a progress bar on a terminal."""
    from ..client_ops import connect
    from ..common import run

    rows: list[dict[str, Any]] = []

    async def go() -> None:
        progress = None
        size = chunk
        if interactive() and output is Output.table and len(items) > 1:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                console=err, transient=True)
            size = max(1, min(chunk, len(items) // 50 or 1))
        async with connect(broker, token, request_timeout=300.0) as client:
            task = progress.add_task(label, total=len(items)) if progress else None
            if progress:
                progress.start()
            try:
                for i in range(0, len(items), size):
                    part = list(items[i:i + size])
                    results = (await client.request(op, build(part)))["results"]
                    for text, r in zip(texts[i:i + size], results):
                        row = {"ref": text, "tx_id": r.get("tx_id"), "status": r.get("status", "error"), "message": r.get("message", "")}
                        rows.append(row)
                        if output is Output.jsonl:
                            emit_line(row)
                    if progress:
                        progress.advance(task, len(part))
            finally:
                if progress:
                    progress.stop()

    run(go())
    return rows


def finish(rows: list[dict[str, Any]], output: Output, verb: str) -> None:
    """Print the per-REF outcomes (jsonl was streamed already) and exit with the documented code."""
    if output is Output.json:
        emit_json(rows)
    elif output is Output.table:
        render(rows, output, columns=[("ref", "REF"), ("tx_id", "TX ID"), ("status", "STATUS"), ("message", "MESSAGE")],
               formatters={"status": _status_cell})
    failed = [r for r in rows if r["status"] not in OK_STATUSES]
    if not failed:
        done = sum(r["status"] == "ok" for r in rows)
        if output is Output.table and len(rows) > 1:
            err.print(f"[ok]{done} {verb}[/ok], {len(rows) - done} already were")
        return
    if len(rows) == 1:
        r = rows[0]
        raise CliError(f"{r['ref']}: {r['message'] or r['status']}", STATUS_EXIT.get(r["status"], exitcodes.ERROR))
    counts: dict[str, int] = {}
    for r in failed:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    detail = ", ".join(f"{n} {s.replace('_', ' ')}" for s, n in sorted(counts.items()))
    raise CliError(f"{len(failed)} of {len(rows)} REFs failed ({detail})", exitcodes.PARTIAL)


def _status_cell(s: Any) -> str:
    colour = {"ok": "ok", "already": "dim", "conflict": "err", "not_found": "warn"}.get(str(s), "err")
    return f"[{colour}]{s}[/{colour}]"


def dedupe(seq: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(seq))
