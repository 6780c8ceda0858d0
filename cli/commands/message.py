"""txmq message get|find: look a message up by message id, or by key in a bounded time window."""

import time
from typing import Annotated, Any, Optional

import typer

from .. import exitcodes
from ..common import DEFAULT_BROKER, BrokerOpt, CliError, OutputOpt, TokenOpt, parse_duration
from ..console import Output, RowSink, emit_json, err, note, out, resolve_output

app = typer.Typer(help="Look messages up by message id or by key.", no_args_is_help=True)


def _print(rows: list[dict[str, Any]], out_fmt: Output) -> None:
    from ._messages import message_line

    with RowSink(out_fmt, table=lambda r: out.print(message_line(r))) as sink:
        for r in rows:
            sink.add(r)


def _row(m: dict[str, Any]) -> dict[str, Any]:
    from txmq.client.message import ReceivedMessage

    from ._messages import message_row

    return message_row(ReceivedMessage.from_map(m))


@app.command("get", epilog="""Examples:

  txmq message get 00000000000004D2

  txmq send orders hello -o json | jq -r .msg_id | xargs txmq message get

A plain message's id is its commit-log offset in 16 hex digits (what send prints): one read, no scan.
A transactional message's id is its transaction id, which names no offset: it is looked up as a key
(txmq message find --key ID, within --since). Keys: as for consume. -o json prints one object.""")
def get(
    msg_id: Annotated[str, typer.Argument(metavar="MSG_ID", help="Message id (as send and consume print it).", show_default=False)],
    since: Annotated[str, typer.Option("--since", help="For a transaction id: how far back to look (a duration).")] = "1h",
    broker: BrokerOpt = DEFAULT_BROKER,
    token: TokenOpt = None,
    output: OutputOpt = None,
) -> None:
    """Print one message by its message id."""
    import re

    from ..client_ops import call

    out_fmt = resolve_output(output)
    m, by_offset = None, ""
    if re.fullmatch(r"[0-9A-Fa-f]{16}", msg_id):
        # 16 hex digits name a commit-log offset, unless a producer chose such a UNIQ_KEY: the broker
        # answers not found when the record there has another id, and the id is then looked up as a key
        try:
            m = _row(call(broker, token, "get_message", {"msg_id": msg_id})["message"])
        except CliError as e:
            if e.code != exitcodes.NOT_FOUND:
                raise
            by_offset = e.message
    if m is None:
        found = _find(broker, token, msg_id, None, since, 1, None)
        if not found["messages"]:
            raise CliError((f"{by_offset}, and no message" if by_offset else "no message")
                           + f" with id {msg_id!r} stored in the last {since}"
                           + (" (scan limit reached: narrow it)" if found["truncated"] else "") + ": try a longer --since",
                           exitcodes.NOT_FOUND)
        m = _row(found["messages"][0])
    if out_fmt is Output.json:
        emit_json(m)  # one message: the document, not a list of one
    else:
        _print([m], out_fmt)


def _find(broker: str, token: str | None, key: str, topic: str | None, since: str, limit: int, max_scan: int | None) -> dict:
    from ..client_ops import call

    fields: dict[str, Any] = {"key": key, "since_ms": max(0, int((time.time() - parse_duration(since)) * 1000)), "limit": limit}
    if topic:
        fields["topic"] = topic
    if max_scan:
        fields["max_scan"] = max_scan
    return call(broker, token, "find_messages", fields)


@app.command("find", epilog="""Examples:

  txmq message find --key order-1

  txmq message find --key order-1 --topic orders --since 2d -o jsonl

Finds messages whose KEYS hold KEY (send --key), or whose id is KEY, among those stored in the last --since (1h):
each queue's start is found by binary search on store time, then at most --max-scan (100000) records are read.
There is no key index: a longer window costs a longer scan. A note (and "truncated" in the broker's reply) says when the
limit stopped it. Keys: as for consume.""")
def find(
    key: Annotated[str, typer.Option("--key", "-k", help="Message key to look for.", show_default=False)],
    topic: Annotated[Optional[str], typer.Option("--topic", "-t", help="Only this topic (default: every user topic).", show_default=False)] = None,
    since: Annotated[str, typer.Option("--since", help="How far back to look (a duration).")] = "1h",
    limit: Annotated[int, typer.Option("--limit", "-l", help="At most this many messages.", min=1, max=10_000)] = 100,
    max_scan: Annotated[int, typer.Option("--max-scan", help="At most this many records read (1 to 1000000).", min=1, max=1_000_000)] = 100_000,
    broker: BrokerOpt = DEFAULT_BROKER,
    token: TokenOpt = None,
    output: OutputOpt = None,
) -> None:
    """Find messages by key, within a bounded time window."""
    out_fmt = resolve_output(output)
    found = _find(broker, token, key, topic, since, limit, max_scan)
    rows = [_row(m) for m in found["messages"]]
    _print(rows, out_fmt)
    if found["truncated"]:
        err.print(f"[warn]warning:[/warn] stopped after reading {found['scanned']} records (--max-scan, or 16 MiB of "
                  "messages found): there may be more")
    if not rows and out_fmt is Output.table:
        note(f"no message with key {key!r} in the last {since}")
