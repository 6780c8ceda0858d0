"""txmq scheduled cancel: take a delayed or timed message back before it is due."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ..common import DEFAULT_BROKER, BrokerOpt, OutputOpt, TokenOpt
from ..console import Output, fmt_ts, kv_table, resolve_output

app = typer.Typer(help="Delayed and timed messages: cancel one before it is due (list them: txmq inspect scheduled).",
                  no_args_is_help=True)


@app.command("cancel", epilog="""Examples:

  txmq scheduled cancel 7A3F0C2B9D1E44A50000000000000001

  txmq scheduled cancel ORDER-42-TIMEOUT --topic orders

A message id names every scheduled message sent with it (a producer may reuse an id); --topic narrows it.
The cancel is stored in the log as the send was, so it holds across a restart or a crash. Exit 5 when no
scheduled message has this id (delivered already, cancelled, or never scheduled). Keys: msg_id, cancelled
(topic, deliver_at_ms, commit_log_offset of each message cancelled).""")
def cancel(
    msg_id: Annotated[str, typer.Argument(metavar="MSG_ID", help="The message id its send printed (or txmq inspect scheduled shows).",
                                          show_default=False)],
    topic: Annotated[Optional[str], typer.Option("--topic", "-t", help="Only the message of this topic.", show_default=False)] = None,
    broker: BrokerOpt = DEFAULT_BROKER,
    token: TokenOpt = None,
    output: OutputOpt = None,
) -> None:
    """Cancel a scheduled message by its id: it is never delivered."""
    from ..client_ops import call

    fields = {"msg_id": msg_id}
    if topic:
        fields["topic"] = topic
    out_fmt = resolve_output(output)
    reply = call(broker, token, "cancel_scheduled", fields)
    if out_fmt is not Output.table:
        kv_table(reply, out_fmt)
        return
    done = reply["cancelled"]
    kv_table({"msg_id": reply["msg_id"], "cancelled": len(done), "topic": ", ".join(sorted({c["topic"] for c in done})),
              "was_due": min(c["deliver_at_ms"] for c in done)}, out_fmt, formatters={"was_due": fmt_ts})
