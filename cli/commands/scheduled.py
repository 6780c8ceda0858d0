"""txmq scheduled list|cancel: delayed and timed messages not yet delivered, and taking them back before they are due."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer

from .. import exitcodes
from ..common import DEFAULT_BROKER, BrokerOpt, CliError, OutputOpt, TokenOpt
from ..console import Output, emit_json, emit_line, err, fmt_ts, interactive, kv_table, note, render, resolve_output

app = typer.Typer(help="Delayed and timed messages: list them, cancel them before they are due (without a command: list them).",
                  no_args_is_help=False, invoke_without_command=True)

TopicOpt = Annotated[Optional[str], typer.Option("--topic", "-t", help="Only messages for this topic.", show_default=False)]
LimitOpt = Annotated[Optional[int], typer.Option("--limit", "-l", help="At most this many rows [default: all; a table on a terminal: "
                                                 "1000]. A cut listing is said on stderr.", min=1, max=10_000_000, show_default=False)]
PAGE = 1000
CANCELS_IN_FLIGHT = 256


@app.callback(epilog="""Examples:

  txmq scheduled              # the same as txmq scheduled list

  txmq scheduled --topic orders -o jsonl""")
def scheduled(ctx: typer.Context, topic: TopicOpt = None, limit: LimitOpt = None, broker: BrokerOpt = DEFAULT_BROKER,
              token: TokenOpt = None, output: OutputOpt = None) -> None:
    """Delayed and timed messages: list them, cancel them before they are due (without a command: list them)."""
    if ctx.invoked_subcommand is None:
        list_(topic, limit, broker, token, output)


@app.command("list", epilog="""Examples:

  txmq scheduled list

  txmq scheduled list --topic orders -o jsonl | jq -r .msg_id

The same as txmq inspect scheduled (keys and notes there).""")
def list_(topic: TopicOpt = None, limit: LimitOpt = None, broker: BrokerOpt = DEFAULT_BROKER, token: TokenOpt = None,
          output: OutputOpt = None) -> None:
    """Delayed and timed messages not yet delivered, soonest due first."""
    from .inspect import scheduled as listing

    listing(topic, limit, broker, token, output)


@app.command("cancel", epilog="""Examples:

  txmq scheduled cancel 7A3F0C2B9D1E44A50000000000000001

  txmq scheduled cancel ORDER-42-TIMEOUT --topic orders

  txmq scheduled cancel --all --topic orders --dry-run

  txmq scheduled cancel --all --topic orders --yes

A message id names every scheduled message sent with it (a producer may reuse an id); --topic narrows it.
The cancel is stored in the log as the send was, so it holds across a restart or a crash. Exit 5 when no
scheduled message has this id (delivered already, cancelled, or never scheduled). Keys: msg_id, cancelled
(topic, deliver_at_ms, deliver_at, commit_log_offset of each message cancelled). --all cancels every scheduled
message (of --topic); per message id: ref, msg_id, status (ok | already: delivered or cancelled meanwhile),
message, cancelled.""")
def cancel(
    msg_id: Annotated[Optional[str], typer.Argument(metavar="MSG_ID", help="The message id its send printed (or txmq inspect scheduled "
                                                    "shows).", show_default=False)] = None,
    topic: Annotated[Optional[str], typer.Option("--topic", "-t", help="Only the message of this topic.", show_default=False)] = None,
    all_: Annotated[bool, typer.Option("--all", help="Every scheduled message (of --topic), instead of MSG_ID.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="With --all: do not ask for confirmation.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", "-n", help="With --all: show what would be cancelled; change nothing.")] = False,
    broker: BrokerOpt = DEFAULT_BROKER,
    token: TokenOpt = None,
    output: OutputOpt = None,
) -> None:
    """Cancel a scheduled message by its id (or --all of them): it is never delivered."""
    from ..client_ops import call

    if (msg_id is not None) == all_:
        raise CliError("give a MSG_ID or --all (not both)", exitcodes.USAGE)
    out_fmt = resolve_output(output)
    if all_:
        _cancel_all(topic, yes, dry_run, broker, token, out_fmt)
        return
    if yes or dry_run:
        raise CliError("--yes and --dry-run go with --all", exitcodes.USAGE)
    fields = {"msg_id": msg_id}
    if topic:
        fields["topic"] = topic
    reply = call(broker, token, "cancel_scheduled", fields)
    for c in reply.get("cancelled", []):
        c.setdefault("deliver_at", c.get("deliver_at_ms"))  # the key every other listing has (added; deliver_at_ms stays)
    if out_fmt is not Output.table:
        kv_table(reply, out_fmt)
        return
    done = reply["cancelled"]
    kv_table({"msg_id": reply["msg_id"], "cancelled": len(done), "topic": ", ".join(sorted({c["topic"] for c in done})),
              "was_due": min(c["deliver_at_ms"] for c in done)}, out_fmt, formatters={"was_due": fmt_ts})


def _cancel_all(topic: str | None, yes: bool, dry_run: bool, broker: str, token: str | None, out_fmt: Output) -> None:
    """Every scheduled message (of topic), a page of the listing at a time, each id cancelled with its own request."""
    import sys

    from ..client_ops import call, connect
    from ..common import NOT_CONFIRMED, confirm, run_interruptible
    from . import _bulk

    sel = {"topic": topic} if topic else {}
    total = call(broker, token, "list_scheduled", {**sel, "limit": 1}).get("total") or 0
    what = "scheduled messages" + (f" for topic {topic}" if topic else "")
    if not total:
        note(f"no {what}: nothing to cancel")
        if out_fmt is Output.json:
            emit_json([])
        return
    if not (yes or dry_run):
        if not (sys.stdin.isatty() and err.is_terminal):
            raise CliError(f"refusing to cancel {total} {what} without a terminal to confirm on: pass --yes (or --dry-run to preview)",
                           exitcodes.USAGE)
        if not confirm(f"Cancel {total} {what}?"):
            raise CliError(NOT_CONFIRMED, exitcodes.ERROR)
    verb = ("would be " if dry_run else "") + "cancelled"
    tally = _bulk.Tally(None, verb, "run the same command again (what is cancelled is no longer listed)")

    def add(row: dict[str, Any]) -> None:
        tally.add(row, keep=out_fmt is not Output.jsonl)
        if out_fmt is Output.jsonl:
            emit_line(row)

    async def cancel_one(client: Any, mid: str) -> dict[str, Any]:
        from txmq.wire import ErrorCode, TxmqError

        try:
            reply = await client.request("cancel_scheduled", {"msg_id": mid, **sel})
        except TxmqError as e:
            if e.code == ErrorCode.NO_SUCH_MESSAGE:
                return {"ref": mid, "msg_id": mid, "status": "already", "message": "delivered or cancelled meanwhile", "cancelled": []}
            return {"ref": mid, "msg_id": mid, "status": "error", "message": e.message, "cancelled": []}
        done = reply.get("cancelled", [])
        for c in done:
            c.setdefault("deliver_at", c.get("deliver_at_ms"))
        return {"ref": mid, "msg_id": mid, "status": "ok", "message": f"cancelled {len(done)}", "cancelled": done}

    async def go() -> None:
        import asyncio

        async with connect(broker, token, request_timeout=300.0) as client:
            after = None
            seen: set[str] = set()  # an id is cancelled once, whatever number of messages it names
            while True:
                page = await client.request("list_scheduled", {**sel, "limit": PAGE, **({"after": after} if after else {})})
                ids = [m["msg_id"] for m in page["messages"] if m["msg_id"] not in seen]
                ids = list(dict.fromkeys(ids))
                seen.update(ids)
                if len(seen) > 1_000_000:  # bounded memory: a later page repeating an id answers `already`
                    seen.clear()
                for i in range(0, len(ids), CANCELS_IN_FLIGHT):
                    part = ids[i:i + CANCELS_IN_FLIGHT]
                    if dry_run:
                        rows = [{"ref": mid, "msg_id": mid, "status": "ok", "message": "would cancel (dry run)", "cancelled": []}
                                for mid in part]
                    else:
                        tally.inflight = len(part)
                        rows = await asyncio.gather(*(cancel_one(client, mid) for mid in part))
                        tally.inflight = 0
                    for row in rows:
                        add(row)
                after = page.get("cursor")
                if not after:
                    return

    progress = interactive() and out_fmt is Output.table
    if progress:
        note(f"{'listing' if dry_run else 'cancelling'} {total} {what}")
    try:
        run_interruptible(go())
    except KeyboardInterrupt:
        tally.print("interrupted")
        raise
    except CliError as e:
        if tally.seen + tally.inflight:
            tally.print("broker lost" if e.code == exitcodes.UNREACHABLE else f"error: {e}")
        raise
    if out_fmt is Output.json:
        emit_json(tally.rows)
    elif out_fmt is Output.table:
        shown = tally.failed_rows if out_fmt is Output.table and progress else tally.rows
        if shown:
            render(shown, out_fmt, columns=[("msg_id", "MSG ID"), ("status", "STATUS"), ("message", "MESSAGE")])
    tally.print()
    if tally.failed:
        raise CliError(f"{tally.failed} of {tally.seen} message ids failed", exitcodes.PARTIAL)
