"""txmq groups list|describe|reset|update: consumer groups, their committed offsets and lag, moving them, their settings."""

import sys
from typing import Annotated, Optional

import typer

from .. import exitcodes
from ..common import DEFAULT_BROKER, NOT_CONFIRMED, BrokerOpt, CliError, OutputOpt, TokenOpt, confirm
from ..console import Output, err, note, render, resolve_output

app = typer.Typer(help="Consumer groups: committed offsets, lag, resetting them, FIFO (without a command: list them).",
                  no_args_is_help=False, invoke_without_command=True)

QUEUE_COLUMNS = [("topic", "TOPIC"), ("queue_id", "QUEUE"), ("committed", "COMMITTED"), ("max_offset", "MAX"), ("lag", "LAG")]


@app.callback(epilog="""Examples:

  txmq groups                 # the same as txmq groups list

  txmq groups -o json""")
def groups(ctx: typer.Context, broker: BrokerOpt = DEFAULT_BROKER, token: TokenOpt = None, output: OutputOpt = None) -> None:
    """Consumer groups: committed offsets, lag, resetting them, FIFO (without a command: list them)."""
    if ctx.invoked_subcommand is None:
        list_(broker, token, output)


@app.command("list", epilog="""Examples:

  txmq groups list

  txmq groups list -o jsonl | jq -r 'select(.lag > 0) | .group'

Keys: group, topics, consumers (live consumer connections), lag (messages left to read in every queue of its topics: from the
committed offset, or from the queue's first message in a queue it never committed, where its consumers start), fifo
(its RocketMQ consumers receive each queue in order: txmq groups update GROUP --fifo).""")
def list_(broker: BrokerOpt = DEFAULT_BROKER, token: TokenOpt = None, output: OutputOpt = None) -> None:
    """List consumer groups: those with committed offsets, and those with live consumers."""
    from ..client_ops import call

    rows = call(broker, token, "list_groups", {})["groups"]
    render(rows, resolve_output(output),
           columns=[("group", "GROUP"), ("topics", "TOPICS"), ("consumers", "CONSUMERS"), ("lag", "LAG"), ("fifo", "FIFO")],
           formatters={"topics": lambda v: ",".join(v) or "-", "fifo": lambda v: "yes" if v else "-"},
           empty="no consumer groups yet")


@app.command("describe", epilog="""Examples:

  txmq groups describe audit

  txmq groups describe audit --topic orders -o json

Keys (one row per topic and queue): topic, queue_id, committed (null when the group never committed that queue),
min_offset, max_offset, lag (max_offset minus the committed offset, or minus min_offset when not committed).
-o json: {group, consumers, topics, queues, total_lag, fifo}.""")
def describe(
    group: Annotated[str, typer.Argument(metavar="GROUP", help="Consumer group.", show_default=False)],
    topic: Annotated[Optional[str], typer.Option("--topic", "-t", help="Only this topic (also one the group never committed).", show_default=False)] = None,
    broker: BrokerOpt = DEFAULT_BROKER,
    token: TokenOpt = None,
    output: OutputOpt = None,
) -> None:
    """Committed offset, max offset and lag per topic and queue, with totals."""
    from ..client_ops import call

    fields = {"group": group}
    if topic:
        fields["topic"] = topic
    d = call(broker, token, "describe_group", fields)
    out_fmt = resolve_output(output)
    render(d["queues"], out_fmt, columns=QUEUE_COLUMNS, title=f"group {group}", document=d,
           empty=f"group {group} has no committed offsets")
    if out_fmt is Output.table:
        fifo = ", FIFO (each queue in order)" if d.get("fifo") else ""
        note(f"total lag {d['total_lag']}, {d['consumers']} live consumer connection(s){fifo}")


@app.command("update", epilog="""Examples:

  txmq groups update orders-fifo --fifo        # its RocketMQ consumers receive each queue in order

  txmq groups update orders-fifo --no-fifo

A FIFO group (RocketMQ's consumeMessageOrderly) receives the messages of each queue in order, one receive's batch of a
queue in flight at a time: the queue's next message comes only after those are acknowledged, or have used their delivery
attempts and gone to the dead-letter topic %DLQ%GROUP. Send with a message group (txmq send --message-group) so that
every message of a group is in one queue. The setting is kept in the data directory (groups.json) and takes effect at the
next receive; RocketMQ consumers learn it from the settings answer (an SDK reads it when it starts). The group need not
exist yet. Keys: group, fifo, old {fifo}, changed.""")
def update(
    group: Annotated[str, typer.Argument(metavar="GROUP", help="Consumer group.", show_default=False)],
    fifo: Annotated[Optional[bool], typer.Option("--fifo/--no-fifo", help="Receive each queue in order (FIFO), or concurrently.", show_default=False)] = None,
    broker: BrokerOpt = DEFAULT_BROKER,
    token: TokenOpt = None,
    output: OutputOpt = None,
) -> None:
    """Change a consumer group's settings: --fifo (in order per queue) or --no-fifo."""
    from ..client_ops import call
    from ..console import kv_table

    if fifo is None:
        raise CliError("nothing to change: give --fifo or --no-fifo", exitcodes.USAGE)
    d = call(broker, token, "update_group", {"group": group, "fifo": fifo})
    kv_table(d, resolve_output(output), title=f"group {group}",
             formatters={"old": lambda v: f"fifo={str(v.get('fifo')).lower()}"})


@app.command("reset", epilog="""Examples:

  txmq groups reset audit --topic orders --to earliest --dry-run

  txmq groups reset audit --topic orders --to 10m --yes            # first message stored 10 minutes ago or later

  txmq groups reset audit --topic orders --to 2026-01-31T12:00:00Z --queue 0 --yes

--to: earliest, latest, an offset (kept within each queue's min and max), a duration ago (10m, 2h) or an ISO-8601
time (local time without a zone): per queue, the first message stored at or after it (the queue's end when none).
A group with live consumers is refused (exit 6): they commit their own positions every second and would overwrite
the reset; stop them, or --force it. Keys: topic, queue_id, old, new, min_offset, max_offset, lag.""")
def reset(
    group: Annotated[str, typer.Argument(metavar="GROUP", help="Consumer group.", show_default=False)],
    topic: Annotated[str, typer.Option("--topic", "-t", help="Topic whose offsets to reset.", show_default=False)],
    to: Annotated[str, typer.Option("--to", help="earliest | latest | OFFSET | TIME (10m ago, or ISO-8601).", show_default=False)],
    queue: Annotated[Optional[list[int]], typer.Option("--queue", "-q", help="Only this queue id (0 to 1023); repeatable.", show_default=False, min=0, max=1023)] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", "-n", help="Show the plan; change nothing.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask (required without a terminal).")] = False,
    force: Annotated[bool, typer.Option("--force", help="Reset even while the group has live consumers (they may overwrite it).")] = False,
    broker: BrokerOpt = DEFAULT_BROKER,
    token: TokenOpt = None,
    output: OutputOpt = None,
) -> None:
    """Move a group's committed offsets on a topic (shows the plan first)."""
    from ..client_ops import call
    from ._positions import parse_position

    pos = parse_position(to)
    out_fmt = resolve_output(output)
    fields = {"group": group, "topic": topic, "to": pos.kind, "force": force}
    if pos.offset is not None:
        fields["offset"] = pos.offset
    if pos.time_ms is not None:
        fields["time_ms"] = pos.time_ms
    if queue:
        fields["queue_ids"] = sorted(set(queue))
    if not dry_run and not yes and not (sys.stdin.isatty() and err.is_terminal):
        raise CliError("refusing to reset offsets without a terminal to confirm on: pass --yes (or --dry-run to preview)",
                       exitcodes.USAGE)
    plan = call(broker, token, "reset_offsets", {**fields, "dry_run": True})
    if dry_run or not yes:
        _show(plan, out_fmt if dry_run else Output.table)
        if dry_run:
            return
        if plan["consumers"] and not force:
            raise CliError(f"group {group!r} has {plan['consumers']} live consumer connection(s): stop them first, or --force",
                           exitcodes.CONFLICT)
        if not confirm(f"Reset group {group} on {topic} ({len(plan['queues'])} queue(s))?"):
            raise CliError(NOT_CONFIRMED, exitcodes.ERROR)
    done = call(broker, token, "reset_offsets", {**fields, "dry_run": False})
    if out_fmt is Output.table and not dry_run and not yes:
        note(f"reset {len(done['queues'])} queue(s)")
        return
    _show(done, out_fmt)
    if done["consumers"]:
        err.print(f"[warn]warning:[/warn] {done['consumers']} live consumer connection(s) may overwrite the reset")


def _show(d: dict, out_fmt: Output) -> None:
    render(d["queues"], out_fmt, title=("plan: " if d["dry_run"] else "reset: ") + f"group {d['group']} on {d['topic']}",
           columns=[("topic", "TOPIC"), ("queue_id", "QUEUE"), ("old", "OLD"), ("new", "NEW"), ("max_offset", "MAX"), ("lag", "LAG")],
           document=d)
