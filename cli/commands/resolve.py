"""txmq resolve --commit|--rollback REF...: an operator decides pending transactions."""

from typing import Annotated, Any, Optional

import typer

from .. import exitcodes
from ..common import DEFAULT_BROKER, BrokerOpt, CliError, OutputOpt, TokenOpt, parse_duration
from ..console import Output, emit_json, emit_line, err, interactive, note, resolve_output
from . import _bulk

EPILOG = """Examples:

  txmq resolve --commit 42                      # half offset 42, as printed by inspect half

  txmq resolve --rollback 7F3A...E1             # a transaction id

  txmq resolve --commit --commit-log-offset 123456

  txmq inspect half --older-than 10m -o jsonl | txmq resolve --rollback - --yes

  txmq inspect half --group shop -o jsonl | jq -r .tx_id | txmq resolve --commit - --yes --dry-run

  txmq resolve --rollback --group shop --older-than 10m --yes   # decided by the broker, in batches

  txmq resolve --commit --all --yes                             # every pending transaction, of every group

Per REF: ref, tx_id, status (ok | already | conflict | not_found), message.
Exit codes: 0 all ok or already; 5 not found / 6 conflict when the only REF failed;
7 when some of several REFs failed."""


def register(app: typer.Typer) -> None:
    app.command("resolve", epilog=EPILOG)(resolve)


def resolve(
    refs: Annotated[Optional[list[str]], typer.Argument(metavar="REF", help="Half offsets, transaction ids, or '-' to read them from stdin (one per line, or JSON lines with tx_id).", show_default=False)] = None,
    commit: Annotated[bool, typer.Option("--commit", help="Commit: deliver the messages to their topics.")] = False,
    rollback: Annotated[bool, typer.Option("--rollback", help="Roll back: drop the messages.")] = False,
    commit_log_offset: Annotated[bool, typer.Option("--commit-log-offset", help="Bare integers are commit-log offsets, not half offsets.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation (required for several REFs without a terminal).")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", "-n", help="Show what would happen; change nothing.")] = False,
    all_: Annotated[bool, typer.Option("--all", help="Instead of REFs: every pending transaction (of every group, unless --group), in batches.")] = False,
    group: Annotated[Optional[str], typer.Option("--group", "-g", help="Instead of REFs: every pending transaction of this producer group, decided by the broker in batches.", show_default=False)] = None,
    topic: Annotated[Optional[str], typer.Option("--topic", "-t", help="With --all or --group: only this (real) topic.", show_default=False)] = None,
    older_than: Annotated[Optional[str], typer.Option("--older-than", help="With --all or --group: only transactions stored longer ago than this (10m, 72h), by the broker's clock.", show_default=False)] = None,
    broker: BrokerOpt = DEFAULT_BROKER,
    token: TokenOpt = None,
    output: OutputOpt = None,
) -> None:
    """Force pending transactions to commit or roll back.

    A bare integer REF is a half offset (as printed by `txmq inspect half`),
    or a commit-log offset with --commit-log-offset; anything else is a
    transaction id. Each REF gets its own outcome: done (ok), already decided
    the same way (already), decided the other way or discarded (conflict),
    or not found (not_found).
    """
    if commit == rollback:
        raise CliError("give exactly one of --commit or --rollback", exitcodes.USAGE)
    if all_ or group is not None or topic is not None or older_than is not None:
        if refs:
            raise CliError("give REFs or --all/--group (not both)", exitcodes.USAGE)
        if group is None and not all_:
            raise CliError("--topic and --older-than select with --all (every group) or --group G", exitcodes.USAGE)
        min_age_ms = int(parse_duration(older_than) * 1000) if older_than is not None else 0
        _resolve_where(commit, group, topic, min_age_ms, yes, dry_run, broker, token, resolve_output(output))
        return
    if not refs:
        raise CliError("no REF given: name transactions by half offset or id, or '-' to read them from stdin", exitcodes.USAGE)
    action = "commit" if commit else "rollback"
    offset_key = "commit_log_offset" if commit_log_offset else "half_offset"
    out_fmt = resolve_output(output)

    def build(part: list[dict[str, Any]]) -> dict[str, Any]:
        return {"action": action, "refs": part, "dry_run": dry_run}

    label = ("committing" if commit else "rolling back") + (" (dry run)" if dry_run else "")
    verb = ("would be " if dry_run else "") + ("committed" if commit else "rolled back")
    resume = "run the same command again (those decided answer `already`)"
    if _bulk.streams(refs, yes, dry_run):  # stdin's REFs resolved as they arrive
        tally = _bulk.Tally(None, verb, resume)
        rows = _bulk.run_bulk_stream(broker, token, "tx_resolve", build, refs, offset_key, ("half_offset", "commit_log_offset"),
                                     out_fmt, label, tally)
        if rows is None:
            _nothing_on_stdin(out_fmt)
            return
        _bulk.finish(rows, out_fmt, verb, tally)
        return
    refs_ = _bulk.collect_refs(refs, offset_key, ("half_offset", "commit_log_offset"))
    if not refs_:
        _nothing_on_stdin(out_fmt)
        return
    texts = [t for t, _ in refs_]
    items = [w for _, w in refs_]
    _bulk.confirm(len(items), "commit" if commit else "roll back", yes, dry_run)
    tally = _bulk.Tally(len(items), verb, resume)
    rows = _bulk.run_bulk(broker, token, "tx_resolve", build, items, texts, out_fmt, label, tally=tally)
    _bulk.finish(rows, out_fmt, verb, tally)


def _nothing_on_stdin(out_fmt: Output) -> None:
    note("no REFs on stdin: nothing to resolve")
    if out_fmt is Output.json:
        emit_json([])


def _resolve_where(commit: bool, group: str | None, topic: str | None, min_age_ms: int, yes: bool, dry_run: bool,
                   broker: str, token: str | None, out_fmt: Output) -> None:
    """Every pending transaction matching, in batches: with a group, the broker picks and decides each batch
    (tx_resolve_where); for every group (--all), a page of the listing is decided by id at a time (tx_resolve)."""
    from txmq.wire import ErrorCode, TxmqError

    from ..client_ops import call, connect

    sel: dict[str, Any] = {"min_age_ms": min_age_ms}
    if group is not None:
        sel["group"] = group
    if topic:
        sel["topic"] = topic
    listing = call(broker, token, "tx_pending", {**sel, "limit": 1})
    total = listing.get("total", len(listing["transactions"]))
    what = (f"transactions of group {group}" if group is not None else "transactions") + (f" on topic {topic}" if topic else "")
    if not total:
        note(f"no pending {what}" + (" matching" if min_age_ms else "") + ": nothing to resolve")
        if out_fmt is Output.json:
            emit_json([])
        return
    _bulk.confirm(total, "commit" if commit else "roll back", yes, dry_run, always=True)
    action = "commit" if commit else "rollback"
    verb = ("would be " if dry_run else "") + ("committed" if commit else "rolled back")
    tally = _bulk.Tally(None, verb, "run the same command again (what is decided is no longer pending)")
    label = ("committing" if commit else "rolling back") + (" (dry run)" if dry_run else "")

    async def batch_by_group(client: Any, after: int) -> tuple[list[dict[str, Any]], Any]:
        try:
            reply = await client.request("tx_resolve_where", {**sel, "action": action, "limit": BATCH, "after_half_offset": after,
                                                              "dry_run": dry_run})
        except TxmqError as e:
            if e.code == ErrorCode.UNKNOWN_OPERATION:
                raise CliError(f"the broker at {broker} does not decide transactions by group (an older version): "
                               f"use `txmq inspect half --group {group} -o jsonl | txmq resolve --{action} - --yes`",
                               exitcodes.ERROR) from None
            raise
        return reply["results"], reply.get("cursor")

    async def batch_of_listing(client: Any, after: int) -> tuple[list[dict[str, Any]], Any]:
        page = await client.request("tx_pending", {**sel, "limit": BATCH, "after_half_offset": after})
        if "cursor" not in page:
            raise CliError(f"the broker at {broker} does not page its pending transactions (an older version): "
                           f"use `txmq inspect half -o jsonl | txmq resolve --{action} - --yes`", exitcodes.ERROR)
        if not page["transactions"]:
            return [], None
        refs = [{"tx_id": t["tx_id"]} for t in page["transactions"]]
        results = (await client.request("tx_resolve", {"action": action, "refs": refs, "dry_run": dry_run}))["results"]
        return [dict(r, ref=r.get("tx_id") or r.get("ref")) for r in results], page["cursor"]

    batch = batch_by_group if group is not None else batch_of_listing

    async def go() -> None:
        progress = None
        if interactive() and out_fmt is Output.table:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                console=err, transient=True)
        async with connect(broker, token, request_timeout=300.0) as client:
            task = progress.add_task(label, total=total) if progress else None
            if progress:
                progress.start()
            try:
                after = -1
                while True:
                    tally.inflight = BATCH
                    try:
                        results, cursor = await batch(client, after)
                    finally:
                        tally.inflight = 0
                    for r in results:
                        row = {"ref": r.get("ref") or r.get("tx_id"), "tx_id": r.get("tx_id"), "status": r.get("status", "error"),
                               "message": r.get("message", "")}
                        tally.add(row, keep=out_fmt is not Output.jsonl)
                        if out_fmt is Output.jsonl:
                            emit_line(row)
                    if progress:
                        progress.advance(task, len(results))
                    if cursor is None:
                        return
                    after = cursor
            finally:
                if progress:
                    progress.stop()

    _bulk.guarded(go(), tally, bulk=True)
    _bulk.finish(tally.rows, out_fmt, verb, tally)


BATCH = 500
