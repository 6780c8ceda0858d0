"""What `resolve` and `discard replay` share: REFs from arguments or stdin, confirmation, per-REF results.

The REF grammar (docs/cli.md, "REFs"):

- an argument or a line of stdin that is a bare token: ASCII digits (an
  optional leading +) are an offset, anything else a transaction id; a run
  of more than 19 digits cannot be an offset (2^62 has 19) and is a
  transaction id (the broker's 32-hex-digit ids are sometimes all digits);
- a JSON string is a transaction id (`jq .tx_id` without -r), whatever it
  looks like; a JSON object is its `tx_id` (which must be a string) when it
  has one, else an offset under the command's offset key (`half_offset`,
  `commit_log_offset`, `discard_offset`) or `offset`, so `txmq inspect half
  -o jsonl | txmq resolve --rollback - --yes` works without jq in between;
- a transaction id has 1 to 255 characters, an offset is 0 to 2^62, a stdin
  line is at most 64 KiB.

Any other input is refused (exit 2) before anything is sent.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any, Callable, Iterator, Sequence

from .. import exitcodes
from ..common import MAX_REF_CHARS, MAX_REF_LINE, NOT_CONFIRMED, WIRE_INT_MAX, CliError, digits_are_offset
from ..console import Output, emit_json, emit_line, err, interactive, out, render

STATUS_EXIT = {"not_found": exitcodes.NOT_FOUND, "conflict": exitcodes.CONFLICT}
OK_STATUSES = ("ok", "already")

_INT = re.compile(r"\+?[0-9]+")
_NEG = re.compile(r"-[0-9]+")

Ref = tuple[str, dict[str, Any]]  # (the REF as shown in the output's `ref`, its wire form)


def _show(text: str) -> str:
    return repr(text[:60] + ("..." if len(text) > 60 else ""))


def _tx_ref(tx_id: str, where: str) -> Ref:
    if not tx_id:
        raise CliError(f"{where}: an empty transaction id", exitcodes.USAGE)
    if len(tx_id) > MAX_REF_CHARS:
        raise CliError(f"{where}: a transaction id of {len(tx_id)} characters: at most {MAX_REF_CHARS}", exitcodes.USAGE)
    return tx_id, {"tx_id": tx_id}


def _offset_ref(n: int, key: str, where: str) -> Ref:
    if not 0 <= n <= WIRE_INT_MAX:
        shown = n if n.bit_length() < 256 else f"of {n.bit_length()} bits"
        raise CliError(f"{where}: offset {shown} is out of range (0 to {WIRE_INT_MAX})", exitcodes.USAGE)
    return str(n), {key: n}


def parse_ref(line: str, where: str, offset_key: str, object_keys: tuple[str, ...] = ()) -> Ref | None:
    """The REF a line names (None for a blank line); `offset_key` is what a bare integer is."""
    text = line.strip()
    if not text:
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # bytes that are not UTF-8 (decoded with surrogateescape)
        raise CliError(f"{where}: not valid UTF-8: {text.encode('utf-8', 'surrogateescape')[:60]!r}", exitcodes.USAGE) from None
    if text[0] in '{["' or text in ("null", "true", "false"):
        try:
            v = json.loads(text)
        except ValueError:
            raise CliError(f"{where}: not valid JSON: {_show(text)}", exitcodes.USAGE) from None
        if isinstance(v, dict):
            if "tx_id" in v:
                if not isinstance(v["tx_id"], str):
                    raise CliError(f"{where}: tx_id must be a string (a transaction id), got {_show(json.dumps(v['tx_id']))}",
                                   exitcodes.USAGE)
                return _tx_ref(v["tx_id"], where)
            for key in dict.fromkeys((offset_key, *object_keys, "offset")):
                if key in v:
                    n = v[key]
                    if isinstance(n, bool) or not isinstance(n, int):
                        raise CliError(f"{where}: {key} must be an integer, got {_show(json.dumps(n))}", exitcodes.USAGE)
                    return _offset_ref(n, offset_key if key == "offset" else key, where)
            keys = ", ".join(dict.fromkeys(("tx_id", offset_key, *object_keys, "offset")))
            raise CliError(f"{where}: JSON object without a tx_id or offset key (one of {keys})", exitcodes.USAGE)
        if isinstance(v, str):
            return _tx_ref(v, where)
        if isinstance(v, int) and not isinstance(v, bool):
            return _offset_ref(v, offset_key, where)
        raise CliError(f"{where}: expected a transaction id, an offset or an object with tx_id, got {_show(text)}", exitcodes.USAGE)
    if len(text.split()) != 1:
        raise CliError(f"{where}: expected one REF{' per line' if where.startswith('stdin') else ''}, got {_show(text)}", exitcodes.USAGE)
    if (_INT.fullmatch(text) and digits_are_offset(text)) or _NEG.fullmatch(text):
        if len(text) > 30:  # far beyond 2^62, and int() of a huge string is slow
            raise CliError(f"{where}: offset {_show(text)} is out of range (0 to {WIRE_INT_MAX})", exitcodes.USAGE)
        return _offset_ref(int(text), offset_key, where)
    return _tx_ref(text, where)


def ref_argument(tx_id: str) -> str:
    """A transaction id as a shell word that `resolve`, `discard replay` and `inspect tx` read back as that id."""
    import shlex

    bare = len(tx_id.split()) == 1 and tx_id == tx_id.strip() and not tx_id.startswith(('{', '[', '"'))
    try:
        if bare and tx_id not in ("null", "true", "false", "-") and parse_ref(tx_id, "", "offset") == (tx_id, {"tx_id": tx_id}):
            return shlex.quote(tx_id)
    except CliError:
        pass
    return shlex.quote(json.dumps(tx_id))


def _stdin_lines() -> Iterator[str]:
    """Lines of stdin, each at most MAX_REF_LINE bytes (a longer one is refused without reading it all)."""
    buf = getattr(sys.stdin, "buffer", None)
    n = 0
    while True:
        raw: bytes | str = buf.readline(MAX_REF_LINE + 1) if buf is not None else sys.stdin.readline(MAX_REF_LINE + 1)
        if not raw:
            return
        n += 1
        line = raw.decode("utf-8", "surrogateescape") if isinstance(raw, bytes) else raw
        if len(raw) > MAX_REF_LINE and not line.endswith("\n"):
            raise CliError(f"stdin line {n}: longer than {MAX_REF_LINE // 1024} KiB: not a REF", exitcodes.USAGE)
        yield line


MAX_JSON_DOCUMENT = 256 << 20  # `-o json` of a listing on stdin: ~500 bytes a row, so about half a million rows


def _json_document_refs(first: str, rest: Iterator[str], offset_key: str, object_keys: tuple[str, ...]) -> list[Ref]:
    """The REFs of a JSON array on stdin (what `inspect half -o json` prints): each element as one line would be."""
    parts, size = [first], len(first)
    for line in rest:
        size += len(line)
        _check_document_size(size)
        parts.append(line)
    return _document_refs("".join(parts), offset_key, object_keys)


def _check_document_size(size: int) -> None:
    if size > MAX_JSON_DOCUMENT:
        raise CliError(f"stdin: a JSON document larger than {MAX_JSON_DOCUMENT >> 20} MiB: use -o jsonl for long listings",
                       exitcodes.USAGE)


def _document_refs(text: str, offset_key: str, object_keys: tuple[str, ...]) -> list[Ref]:
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise CliError(f"stdin: not a valid JSON document ({e})", exitcodes.USAGE) from None
    if not isinstance(doc, list):
        raise CliError("stdin: a JSON document must be an array of REFs or rows", exitcodes.USAGE)
    out: list[Ref] = []
    for i, el in enumerate(doc, 1):
        ref = parse_ref(json.dumps(el), f"stdin element {i}", offset_key, object_keys)
        if ref is None:
            raise CliError(f"stdin element {i}: empty", exitcodes.USAGE)
        out.append(ref)
    return out


def collect_refs(args: Sequence[str], offset_key: str, object_keys: tuple[str, ...] = ()) -> list[Ref]:
    """Arguments in order, with '-' replaced by the REFs read from stdin (once)."""
    refs: list[Ref] = []
    stdin_read = False
    for a in args:
        if a == "-":
            if stdin_read:
                continue
            stdin_read = True
            if sys.stdin.isatty():
                err.print("[dim]reading REFs from stdin, one per line; end with Ctrl-D[/dim]")
            lines = _stdin_lines()
            try:
                for n, line in enumerate(lines, 1):
                    if not refs and line.lstrip().startswith("["):  # a JSON document (`-o json` of a listing)
                        refs.extend(_json_document_refs(line, lines, offset_key, object_keys))
                        break
                    ref = parse_ref(line, f"stdin line {n}", offset_key, object_keys)
                    if ref is not None:
                        refs.append(ref)
            except KeyboardInterrupt:
                err.print("[warn]stopped (interrupted) while reading REFs from stdin: nothing was changed[/warn]")
                raise
        else:
            refs.extend(_argument_refs([a], offset_key, object_keys))
    return refs


def confirm(n: int, what: str, yes: bool, dry_run: bool, always: bool = False) -> None:
    """More than one REF (or `always`, for --all): ask on a terminal, refuse without one, unless --yes."""
    if yes or dry_run or (n <= 1 and not always):
        return
    if not (sys.stdin.isatty() and err.is_terminal):
        raise CliError(f"refusing to {what} {n} transaction{'s' if n != 1 else ''} without a terminal to confirm on: pass --yes (or --dry-run to preview)",
                       exitcodes.USAGE)
    from ..common import confirm as ask

    if not ask(f"{what.capitalize()} {n} transaction{'s' if n != 1 else ''}?"):
        raise CliError(NOT_CONFIRMED, exitcodes.ERROR)


class Tally:
    """What a bulk command did so far, for its one-line summary (also after Ctrl-C or a lost broker)."""

    def __init__(self, total: int | None, verb: str, resume: str) -> None:
        self.total = total  # items to do, when known
        self.verb = verb  # "rolled back", "would be committed", ...
        self.resume = resume
        self.rows: list[dict[str, Any]] = []
        self.failed_rows: list[dict[str, Any]] = []
        self.done = self.already = self.failed = 0
        self.inflight = 0  # items sent in a request not answered yet
        self.read_to: int | None = None  # REFs streamed from stdin: the last line read while more may come

    def add(self, row: dict[str, Any], keep: bool) -> None:
        status = row["status"]
        if status == "ok":
            self.done += 1
        elif status == "already":
            self.already += 1
        else:
            self.failed += 1
            self.failed_rows.append(row)
        if keep:
            self.rows.append(row)

    @property
    def seen(self) -> int:
        return self.done + self.already + self.failed

    def line(self, stopped: str | None = None) -> str:
        parts = [f"{self.done} {self.verb}", f"{self.already} already", f"{self.failed} failed"]
        if self.total is not None:
            parts.append(f"{max(0, self.total - self.seen - self.inflight)} not attempted")
        elif stopped:
            parts.append("the rest not attempted")
        text = ", ".join(parts)
        if self.inflight:
            text += (f", {'up to ' if self.total is None else ''}{self.inflight} unconfirmed"
                     " (sent when it stopped: each is decided once or not at all)")
        if stopped and self.read_to is not None:
            text += f", stdin read up to line {self.read_to}" if self.read_to else ", nothing read from stdin yet"
        if stopped:
            text = f"stopped ({stopped}): {text}; to resume, {self.resume}"
        return text

    def print(self, stopped: str | None = None) -> None:
        from rich.markup import escape

        err.print(("[warn]" if stopped or self.failed else "[ok]") + escape(self.line(stopped)) + "[/]")


def run_bulk(broker: str, token: str | None, op: str, build: Callable[[list[Any]], dict[str, Any]],
             items: Sequence[Any], texts: Sequence[str], output: Output, label: str, chunk: int = 500,
             tally: Tally | None = None) -> list[dict[str, Any]]:
    """Send items to the broker in chunks of one request each, streaming jsonl rows; a progress bar on a terminal.

    With a `tally`, an interruption (Ctrl-C, a lost broker) prints its
    summary line before the error goes on.
    """
    from ..client_ops import connect

    t = tally or Tally(len(items), "done", "run the same command again")

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
                    t.inflight = len(part)
                    results = (await client.request(op, build(part)))["results"]
                    t.inflight = 0
                    for text, r in zip(texts[i:i + size], results):
                        row = {"ref": text, "tx_id": r.get("tx_id"), "status": r.get("status", "error"), "message": r.get("message", "")}
                        t.add(row, keep=output is not Output.jsonl or tally is None)
                        if output is Output.jsonl:
                            emit_line(row)
                    if progress:
                        progress.advance(task, len(part))
            finally:
                if progress:
                    progress.stop()

    guarded(go(), t, bulk=tally is not None)
    return t.rows


# REFs from stdin (`-` with --yes or --dry-run) go to the broker as they arrive: a request once this many
# are read, or when the oldest not sent has waited STREAM_WAIT_S, or at the end of the input.
STREAM_BATCH = 256
STREAM_WAIT_S = 0.1


def streams(args: Sequence[str], yes: bool, dry_run: bool) -> bool:
    """Whether REFs are resolved as stdin delivers them: '-' is among them and nothing is to be confirmed
    (asking needs the count, so without --yes or --dry-run stdin is read whole first)."""
    return "-" in args and (yes or dry_run)


def run_bulk_stream(broker: str, token: str | None, op: str, build: Callable[[list[Any]], dict[str, Any]],
                    args: Sequence[str], offset_key: str, object_keys: tuple[str, ...], output: Output, label: str,
                    tally: Tally) -> list[dict[str, Any]] | None:
    """Like run_bulk, for REF arguments where '-' stands for stdin's lines, sent while stdin is still being read.

    The arguments are parsed first (a bad one is refused before anything is
    sent); stdin's REFs go in batches of STREAM_BATCH, or fewer once the
    oldest has waited STREAM_WAIT_S, so a slow producer upstream (a long
    `inspect half` listing) does not hold up the first decisions. A line that
    is not a REF stops the run there: the batches sent before it stand, what
    was read after the last one is not attempted (the summary says so, exit
    2). Ctrl-C prints the summary of what was done. None when there was no
    REF at all (nothing was sent).
    """
    import contextlib
    import time

    from ..client_ops import connect
    from ._stdin import TIMEOUT, TOO_LONG, StdinReader

    cut = list(args).index("-")
    before = _argument_refs(args[:cut], offset_key, object_keys)
    after = _argument_refs([a for a in args[cut + 1:] if a != "-"], offset_key, object_keys)
    t = tally
    t.total = 0

    async def go() -> None:
        progress = None
        if interactive() and output is Output.table:
            from rich.progress import MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), MofNCompleteColumn(), TimeElapsedColumn(),
                                console=err, transient=True)
        async with contextlib.AsyncExitStack() as stack:
            task = progress.add_task(label, total=None) if progress else None
            pending: list[Ref] = []
            client: Any = None

            async def send(part: list[Ref]) -> None:
                nonlocal client
                if client is None:  # connected with the first batch: input refused at once never reaches the broker
                    client = await stack.enter_async_context(connect(broker, token, request_timeout=300.0))
                    if progress:
                        progress.start()
                t.inflight = len(part)
                results = (await client.request(op, build([w for _, w in part])))["results"]
                t.inflight = 0
                for (text, _), r in zip(part, results):
                    row = {"ref": text, "tx_id": r.get("tx_id"), "status": r.get("status", "error"), "message": r.get("message", "")}
                    t.add(row, keep=output is not Output.jsonl)
                    if output is Output.jsonl:
                        emit_line(row)
                if progress:
                    progress.advance(task, len(part))

            async def take(refs: list[Ref]) -> bool:
                """Queue refs, sending every full batch; whether any was sent."""
                pending.extend(refs)
                t.total = (t.total or 0) + len(refs)
                sent = False
                while len(pending) >= STREAM_BATCH:
                    part = pending[:STREAM_BATCH]
                    del pending[:STREAM_BATCH]
                    await send(part)
                    sent = True
                return sent

            async def flush() -> None:
                if pending:
                    part = pending[:]
                    pending.clear()
                    await send(part)

            reader = StdinReader(MAX_REF_LINE).start()
            try:
                await take(before)
                if sys.stdin.isatty():
                    err.print("[dim]reading REFs from stdin, one per line, each resolved as it comes; end with Ctrl-D[/dim]")
                n = 0  # lines read
                t.read_to = 0
                document: list[str] | None = None  # a JSON array (`-o json` of a listing): parsed at its end
                size = 0
                oldest = 0.0  # when the oldest REF not sent yet arrived
                while True:
                    wait = None if not pending else oldest + STREAM_WAIT_S - time.monotonic()
                    batch = await reader.next_batch(wait)
                    if batch is TIMEOUT:
                        await flush()
                        continue
                    if batch is None:
                        break
                    if batch is TOO_LONG:
                        raise CliError(f"stdin line {n + 1}: longer than {MAX_REF_LINE // 1024} KiB: not a REF", exitcodes.USAGE)
                    arrived = time.monotonic()
                    refs: list[Ref] = []
                    try:
                        for raw in batch:
                            n += 1
                            t.read_to = n
                            line = raw.decode("utf-8", "surrogateescape")
                            if document is not None:
                                size += len(line) + 1
                                _check_document_size(size)
                                document.append(line)
                            elif not t.total and not refs and line.lstrip().startswith("["):
                                document, size = [line], len(line) + 1
                            elif (ref := parse_ref(line, f"stdin line {n}", offset_key, object_keys)) is not None:
                                refs.append(ref)
                    except CliError:
                        t.total = (t.total or 0) + len(refs)  # read, not attempted
                        raise
                    had = bool(pending)
                    if await take(refs) or not had:
                        oldest = arrived
                if document is not None:
                    await take(_document_refs("\n".join(document), offset_key, object_keys))
                t.read_to = None  # the input ended
                await take(after)
                await flush()
            finally:
                reader.close()
                if progress:
                    progress.stop()

    guarded(go(), t, bulk=True)
    return t.rows if t.total else None


def _argument_refs(args: Sequence[str], offset_key: str, object_keys: tuple[str, ...]) -> list[Ref]:
    refs: list[Ref] = []
    for a in args:
        ref = parse_ref(a, f"REF {_show(a)}", offset_key, object_keys)
        if ref is None:
            raise CliError("an empty REF argument: name a transaction by offset or id", exitcodes.USAGE)
        refs.append(ref)
    return refs


def guarded(coro: Any, t: Tally, bulk: bool) -> None:
    """Run coro; on Ctrl-C or a broker error, print the summary (bulk commands) and go on with the error.

    Ctrl-C ends it within a bounded time, even if closing the connection hangs (`run_interruptible`).
    """
    from ..common import run_interruptible

    try:
        run_interruptible(coro)
    except KeyboardInterrupt:
        if bulk:
            t.print("interrupted")
        raise
    except CliError as e:
        if bulk and t.seen + t.inflight:
            what = "broker lost" if e.code == exitcodes.UNREACHABLE else f"error: {e}"
            t.print(what)
        raise


def finish(rows: list[dict[str, Any]], output: Output, verb: str, tally: Tally | None = None) -> None:
    """Print the per-REF outcomes (jsonl was streamed already), the summary of a bulk run, and exit with the documented code."""
    bulk = tally is not None and (tally.seen > 1 or tally.total is None)
    columns = [("ref", "REF"), ("tx_id", "TX ID"), ("status", "STATUS"), ("message", "MESSAGE")]
    if output is Output.json:
        emit_json(rows)
    elif output is Output.table:
        if bulk and out.is_terminal:  # a person: the failures, then the summary, not a row per success
            if tally is not None and tally.failed_rows:
                render(tally.failed_rows, output, columns=columns, formatters={"status": _status_cell})
        else:
            render(rows, output, columns=columns, formatters={"status": _status_cell})
    if tally is not None:
        seen, failed_n = tally.seen, tally.failed
        failed = tally.failed_rows
    else:
        seen = len(rows)
        failed = [r for r in rows if r["status"] not in OK_STATUSES]
        failed_n = len(failed)
    if bulk and tally is not None:
        tally.print()
    elif not failed and output is Output.table and len(rows) > 1:
        done = sum(r["status"] == "ok" for r in rows)
        err.print(f"[ok]{done} {verb}[/ok], {len(rows) - done} already were")
    if not failed_n:
        return
    if seen == 1:
        r = failed[0]
        raise CliError(f"{r['ref']}: {r['message'] or r['status']}", STATUS_EXIT.get(r["status"], exitcodes.ERROR))
    counts: dict[str, int] = {}
    for r in failed:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    detail = ", ".join(f"{n} {s.replace('_', ' ')}" for s, n in sorted(counts.items()))
    raise CliError(f"{failed_n} of {seen} REFs failed ({detail})", exitcodes.PARTIAL)


def _status_cell(s: Any) -> str:
    colour = {"ok": "ok", "already": "dim", "conflict": "err", "not_found": "warn"}.get(str(s), "err")
    return f"[{colour}]{s}[/{colour}]"
