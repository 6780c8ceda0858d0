"""txmq topics [create|update|delete|describe]: the broker's topics, their queues, message types and message counts."""

from typing import Annotated, Any, Optional

import typer

from txmq.constants import MESSAGE_TYPES

from .. import exitcodes
from ..common import DEFAULT_BROKER, BrokerOpt, CliError, OutputOpt, TokenOpt, choices, one_of
from ..console import Output, kv_table, note, render, resolve_output

EPILOG = """Examples:

  txmq topics

  txmq topics --system            # include RMQ_SYS_TRANS_HALF_TOPIC and friends

  txmq topics -o jsonl | jq -r .topic

  txmq topics create orders --queues 8 --message-types normal,transaction

Keys: topic, queues, messages, system, message_types (null for a system topic, and from a broker older than topic \
message types)."""

app = typer.Typer(help="List topics; create, update, delete or describe one.", no_args_is_help=False,
                  invoke_without_command=True)

TypesOpt = Annotated[
    Optional[list[str]],
    typer.Option("--message-types", "-m", metavar="TYPES", autocompletion=choices(*MESSAGE_TYPES), show_default=False,
                 help=f"Message types the topic accepts: {', '.join(MESSAGE_TYPES)}, comma-separated or repeated "
                 "(RocketMQ clients are refused other types) [default for a new topic: normal,transaction]."),
]
QueuesOpt = Annotated[Optional[int], typer.Option("--queues", min=1, max=1024, show_default=False,
                                                  help="Number of queues (1 to 1024).")]
# --queues' older short name: -q is a queue id everywhere else (send, consume, read, groups reset)
QueuesShortOpt = Annotated[Optional[int], typer.Option("-q", hidden=True, min=1, max=1024, show_default=False)]
TopicArg = Annotated[str, typer.Argument(metavar="TOPIC", help="Topic name.", show_default=False)]

ROW_COLUMNS = [("topic", "TOPIC"), ("queues", "QUEUES"), ("messages", "MESSAGES"), ("system", "SYSTEM"), ("message_types", "TYPES")]


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="topics")


def _types_text(v: Any) -> str:
    return ",".join(v) if isinstance(v, list) else "-"


@app.callback(epilog=EPILOG)
def topics(
    ctx: typer.Context,
    system: Annotated[bool, typer.Option("--system", "-s", help="Include the system topics (half, op, discard).")] = False,
    broker: BrokerOpt = DEFAULT_BROKER,
    token: TokenOpt = None,
    output: OutputOpt = None,
) -> None:
    """List topics with their queue counts, stored message counts and message types."""
    if ctx.invoked_subcommand is not None:
        return
    from ..client_ops import call

    rows = [{"topic": t["topic"], "queues": t["queues"], "messages": t["messages"], "system": t["system"],
             "message_types": t.get("message_types")}
            for t in call(broker, token, "list_topics", {"system": system})["topics"]]
    render(rows, resolve_output(output), columns=ROW_COLUMNS, formatters={"message_types": _types_text},
           empty="no topics yet (they are created by the first send)")


def parse_message_types(values: list[str] | None) -> list[str] | None:
    """--message-types given once or more, each comma-separated: the names, checked (exit 2), in the broker's order."""
    if not values:
        return None
    names = {part.strip().lower() for v in values for part in v.split(",")}
    names.discard("")
    unknown = sorted(names - set(MESSAGE_TYPES))
    if unknown or not names:
        what = f"unknown message type {unknown[0]!r}" if unknown else "no message type given"
        raise CliError(f"--message-types: {what}: give one or more of {', '.join(MESSAGE_TYPES)}", exitcodes.USAGE)
    return [t for t in MESSAGE_TYPES if t in names]


def _call_with_types(broker: str, token: str | None, op: str, fields: dict[str, Any]) -> dict[str, Any]:
    """One request that may carry message_types: refused here (nothing sent) when the broker predates them."""
    from ..client_ops import connect
    from ..common import run

    async def go() -> dict[str, Any]:
        async with connect(broker, token) as c:
            if "message_types" in fields and "topic_message_types" not in (c.hello.get("features") or []):
                raise CliError(f"broker at {broker} does not support topic message types (it runs an older txmq): "
                               "nothing was changed; upgrade the broker, or leave out --message-types", exitcodes.ERROR)
            return await c.request(op, fields)

    return run(go())


@app.command("create", epilog="""Examples:

  txmq topics create orders

  txmq topics create orders --queues 8 --message-types normal,transaction

  txmq topics create ticks -m normal -m fifo -o json

A topic that exists already is exit 6 and left as it is (change it with `txmq topics update`). A topic takes \
FIFO messages (a message group) only if it accepts fifo, delayed ones only if it accepts delay. \
Keys: topic, queues, message_types, created.""")
def create(
    topic: TopicArg,
    queues: QueuesOpt = None,
    message_types: TypesOpt = None,
    broker: BrokerOpt = DEFAULT_BROKER,
    token: TokenOpt = None,
    output: OutputOpt = None,
    queues_short: QueuesShortOpt = None,
) -> None:
    """Create a topic with its queues and the message types it accepts."""
    fields = _topic_fields(topic, one_of(queues, queues_short, "--queues", "-q"), message_types)
    r = _call_with_types(broker, token, "create_topic", fields)
    if not r.get("created"):
        have = f"{r.get('queues')} queues, message types {_types_text(r.get('message_types'))}"
        raise CliError(f"topic {topic} already exists ({have}): nothing was changed; use `txmq topics update {topic}`",
                       exitcodes.CONFLICT)
    row = {"topic": r["topic"], "queues": r["queues"], "message_types": r.get("message_types"), "created": True}
    kv_table(row, resolve_output(output), title=f"topic {topic} created", formatters={"message_types": _types_text})


def _topic_fields(topic: str, queues: int | None, message_types: list[str] | None) -> dict[str, Any]:
    """A create_topic / update_topic request's fields: what was given of the queues and the message types."""
    fields: dict[str, Any] = {"topic": topic}
    if queues is not None:
        fields["queues"] = queues
    types = parse_message_types(message_types)
    if types is not None:
        fields["message_types"] = types
    return fields


@app.command("update", epilog="""Examples:

  txmq topics update orders --queues 16

  txmq topics update orders --message-types normal,transaction,delay

Queues grow; they shrink only by queues that never held a message and that no pending transaction was sent to \
(exit 6 otherwise). New message types apply to the next send; pending transactions commit whatever the types. \
Keys: topic, queues, message_types, old_queues, old_message_types.""")
def update(
    topic: TopicArg,
    queues: QueuesOpt = None,
    message_types: TypesOpt = None,
    broker: BrokerOpt = DEFAULT_BROKER,
    token: TokenOpt = None,
    output: OutputOpt = None,
    queues_short: QueuesShortOpt = None,
) -> None:
    """Change a topic's queue count or the message types it accepts."""
    fields = _topic_fields(topic, one_of(queues, queues_short, "--queues", "-q"), message_types)
    if len(fields) == 1:
        raise CliError("nothing to change: give --queues, --message-types or both", exitcodes.USAGE)
    r = _call_with_types(broker, token, "update_topic", fields)
    old = r.get("old") or {}
    row = {"topic": r["topic"], "queues": r["queues"], "message_types": r.get("message_types"),
           "old_queues": old.get("queues"), "old_message_types": old.get("message_types")}
    kv_table(row, resolve_output(output), title=f"topic {topic} updated",
             formatters={"message_types": _types_text, "old_message_types": _types_text})


@app.command("delete", epilog="""Examples:

  txmq topics delete orders

  txmq topics delete orders --force          # even while transactions sent to it are pending

The topic leaves the broker's topic table: no route, send or receive names it any more (with auto-creation on, the \
next send creates it again). Its stored messages stay in the log until retention deletes them: `txmq topics create` \
of the same name brings them back, with at least as many queues; consumer groups keep their offsets. Refused (exit \
6) while transactions sent to the topic are pending, unless --force: they then stay pending, and one that commits \
creates the topic again. Keys: topic, deleted, queues, messages, pending_transactions.""")
def delete(
    topic: TopicArg,
    force: Annotated[bool, typer.Option("--force", help="Delete even while transactions sent to the topic are pending.")] = False,
    broker: BrokerOpt = DEFAULT_BROKER,
    token: TokenOpt = None,
    output: OutputOpt = None,
) -> None:
    """Delete a topic (its stored messages stay until retention)."""
    from ..client_ops import call

    r = call(broker, token, "delete_topic", {"topic": topic, "force": force})
    out = resolve_output(output)
    kv_table(r, out, title=f"topic {topic} deleted")
    if out is Output.table and r.get("messages"):
        note(f"its {r['messages']} stored message(s) stay in the log until retention deletes them")


@app.command("describe", epilog="""Examples:

  txmq topics describe orders

  txmq topics describe orders -o json | jq .pending_transactions

Keys (one row per queue): queue_id, min_offset, max_offset, messages, pending_transactions (transactions sent to the \
queue, not yet committed or rolled back). -o json: {topic, queues, message_types, messages, pending_transactions, \
per_queue}.""")
def describe(
    topic: TopicArg,
    broker: BrokerOpt = DEFAULT_BROKER,
    token: TokenOpt = None,
    output: OutputOpt = None,
) -> None:
    """A topic's queues with their offsets and messages, its message types and pending transactions."""
    from ..client_ops import call

    d = call(broker, token, "describe_topic", {"topic": topic})
    out = resolve_output(output)
    render(d["per_queue"], out, title=f"topic {topic}", document=d,
           columns=[("queue_id", "QUEUE"), ("min_offset", "MIN"), ("max_offset", "MAX"), ("messages", "MESSAGES"),
                    ("pending_transactions", "PENDING")])
    if out is Output.table:
        note(f"{d['queues']} queue(s), message types {_types_text(d.get('message_types'))}, {d['messages']} message(s), "
             f"{d['pending_transactions']} pending transaction(s)")
