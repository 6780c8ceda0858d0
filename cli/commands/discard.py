"""txmq discard list|replay: transactions moved to TRANS_CHECK_MAX_TIME_TOPIC, and putting them back."""

import time
from enum import Enum
from typing import Annotated, Any, Optional

import typer

from .. import exitcodes
from ..common import DEFAULT_BROKER, BrokerOpt, CliError, OutputOpt, TokenOpt
from ..console import emit_json, fmt_when, note, render, resolve_output
from . import _bulk

app = typer.Typer(help="List and replay discarded transactions (checked too often, or past retention); without a command: list them.",
                  no_args_is_help=False, invoke_without_command=True)

DISCARD_KEYS = ("tx_id", "topic", "group", "checks", "discarded_at", "discard_offset", "reason", "commit_log_offset")


class ReplayTo(str, Enum):
    half = "half"
    commit = "commit"


@app.callback(epilog="""Examples:

  txmq discard                # the same as txmq discard list

  txmq discard -o jsonl | txmq discard replay - --yes""")
def discard(
    ctx: typer.Context,
    limit: Annotated[Optional[int], typer.Option("--limit", "-l", help="At most this many rows [default: all; a table on a terminal: 1000]. A cut listing is said on stderr.", min=1, max=10_000_000, show_default=False)] = None,
    broker: BrokerOpt = DEFAULT_BROKER,
    token: TokenOpt = None,
    output: OutputOpt = None,
) -> None:
    """List and replay discarded transactions (without a command: list them)."""
    if ctx.invoked_subcommand is None:
        list_(limit, broker, token, output)


@app.command("list", epilog="""Examples:

  txmq discard list

  txmq discard list -o jsonl | jq -r 'select(.group == "shop") | .tx_id'

Keys: tx_id, topic, group, checks, discarded_at, discard_offset, reason (max-checks | retention),
commit_log_offset (of the discard record).""")
def list_(
    limit: Annotated[Optional[int], typer.Option("--limit", "-l", help="At most this many rows [default: all; a table on a terminal: 1000]. A cut listing is said on stderr.", min=1, max=10_000_000, show_default=False)] = None,
    broker: BrokerOpt = DEFAULT_BROKER,
    token: TokenOpt = None,
    output: OutputOpt = None,
) -> None:
    """Discarded transactions, in discard-topic order."""
    from ..console import Output, RowSink
    from ._paging import cut_note, effective_limit, stream_pages

    out_fmt = resolve_output(output)
    eff, _ = effective_limit(limit, out_fmt, 1000)
    with RowSink(out_fmt, lambda r: {k: r.get(k) for k in DISCARD_KEYS}) as sink:  # the JSON list closed on every way out (Ctrl-C too)
        total, more, paged = stream_pages(broker, token, "discard_list", {}, "discarded", "after_discard_offset", eff, sink)
    now_ms = int(time.time() * 1000)
    if out_fmt is Output.table:
        render(
            sink.kept, out_fmt,
            columns=[("discard_offset", "OFFSET"), ("tx_id", "TX ID"), ("topic", "TOPIC"), ("group", "GROUP"), ("checks", "CHECKS"),
                     ("reason", "REASON"), ("discarded_at", "DISCARDED")],
            formatters={"discarded_at": lambda v: fmt_when(v, now_ms)},
            empty="no discarded transactions",
        )
    if more or (not paged and sink.count >= (eff or 1000)):
        msg = cut_note(sink.count, total, "discarded transactions", asked=limit is not None, old_broker=not paged)
        if not paged and limit is None:
            raise CliError(msg, exitcodes.ERROR)
        note(msg)


@app.command(epilog="""Examples:

  txmq discard replay 3                       # discard offset 3, back to the half queue (checks reset)

  txmq discard replay 7F3A...E1 --to commit   # commit it straight to its topic

  txmq discard replay --all --dry-run

  txmq discard list -o jsonl | txmq discard replay - --to half --yes

Per REF: ref, tx_id, status (ok | already | conflict | not_found), message. Exit codes as for resolve.""")
def replay(
    refs: Annotated[Optional[list[str]], typer.Argument(metavar="REF", help="Discard offsets, transaction ids, or '-' for stdin.", show_default=False)] = None,
    all_: Annotated[bool, typer.Option("--all", help="Every discarded transaction.")] = False,
    to: Annotated[ReplayTo, typer.Option("--to", help="half: back to the half queue for new check-backs (check count reset); commit: commit it now.")] = ReplayTo.half,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", "-n", help="Show what would happen; change nothing.")] = False,
    broker: BrokerOpt = DEFAULT_BROKER,
    token: TokenOpt = None,
    output: OutputOpt = None,
) -> None:
    """Replay discarded transactions to the half queue or straight to commit."""
    if bool(refs) == all_:
        raise CliError("give REFs or --all (not both)", exitcodes.USAGE)
    out_fmt = resolve_output(output)
    verb = "replay" if to is ReplayTo.half else "replay and commit"

    def build(part: list[dict[str, Any]]) -> dict[str, Any]:
        return {"to": to.value, "refs": part, "dry_run": dry_run}

    verb_done = ("would be " if dry_run else "") + f"replayed to {to.value}"
    resume = ("feed what is still discarded: `txmq discard list -o jsonl | txmq discard replay - --yes`"
              + (f" --to {to.value}" if to is not ReplayTo.half else ""))
    label = f"replaying to {to.value}" + (" (dry run)" if dry_run else "")
    if refs and _bulk.streams(refs, yes, dry_run):  # stdin's REFs replayed as they arrive
        tally = _bulk.Tally(None, verb_done, resume)
        streamed = _bulk.run_bulk_stream(broker, token, "discard_replay", build, refs, "discard_offset", (), out_fmt, label, tally)
        if streamed is None:
            note("nothing to replay")
            if out_fmt.value == "json":
                emit_json([])
            return
        _bulk.finish(streamed, out_fmt, verb_done, tally)
        return
    if all_:
        from ..client_ops import call
        from ._paging import stream_pages

        listed = _Collect()  # in pages of 1000, with the cursor: memory and request size stay bounded on the broker
        _, _, paged = stream_pages(broker, token, "discard_list", {}, "discarded", "after_discard_offset", None, listed)
        if not paged:  # an older broker answers one page: ask it for everything, as before
            listed.rows = call(broker, token, "discard_list", {"limit": 10_000_000})["discarded"]
        refs_: list[_bulk.Ref] = [(r["tx_id"], {"tx_id": r["tx_id"]}) for r in listed.rows]
    else:
        refs_ = _bulk.collect_refs(refs or [], "discard_offset")
    if not refs_:
        note("nothing to replay")
        if out_fmt.value == "json":
            emit_json([])
        return
    texts = [t for t, _ in refs_]
    items = [w for _, w in refs_]
    _bulk.confirm(len(items), verb, yes, dry_run, always=all_)
    tally = _bulk.Tally(len(items), verb_done, resume)
    rows = _bulk.run_bulk(broker, token, "discard_replay", build, items, texts, out_fmt, label, tally=tally)
    _bulk.finish(rows, out_fmt, verb_done, tally)


class _Collect:
    """A stream_pages sink that keeps the raw rows."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    @property
    def count(self) -> int:
        return len(self.rows)

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
