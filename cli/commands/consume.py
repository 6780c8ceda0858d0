"""txmq consume: print committed messages of a topic as a consumer group, committing offsets as it goes."""

from enum import Enum
from typing import Annotated, Any, Optional

import typer

from .. import exitcodes
from ..common import DEFAULT_BROKER, BrokerOpt, CliError, OutputOpt, TokenOpt, run, stop_event
from ..console import Output, RowSink, err, esc, interactive, note, out, resolve_output

EPILOG = """Examples:

  txmq consume orders --group audit --limit 10

  txmq consume orders --group audit --from latest --follow

  txmq consume orders --group audit -o jsonl | jq -r .body

Keys: topic, queue_id, queue_offset, commit_log_offset, msg_id, tx_id (transactional messages only),
tags, keys, properties (all but TAGS and KEYS), body (UTF-8 text) or body_base64, born_at, stored_at.
The group's offsets are committed as messages are printed, so the next run goes on where this one stopped."""


class From(str, Enum):
    earliest = "earliest"
    latest = "latest"


def register(app: typer.Typer) -> None:
    app.command("consume", epilog=EPILOG)(consume)


def consume(
    topic: Annotated[str, typer.Argument(metavar="TOPIC", help="Topic to read.", show_default=False)],
    group: Annotated[str, typer.Option("--group", "-g", help="Consumer group (its committed offsets say where to start).", show_default=False)],
    from_: Annotated[From, typer.Option("--from", help="Where a group with no committed offset starts.")] = From.earliest,
    limit: Annotated[Optional[int], typer.Option("--limit", "-l", help="Stop after this many messages.", show_default=False, min=1)] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep waiting for new messages (until Ctrl-C).")] = False,
    queue: Annotated[Optional[list[int]], typer.Option("--queue", "-q", help="Only this queue id (0 to 1023); repeatable.", show_default=False, min=0, max=1023)] = None,
    broker: BrokerOpt = DEFAULT_BROKER,
    token: TokenOpt = None,
    output: OutputOpt = None,
) -> None:
    """Print committed messages; without --follow, exit once caught up."""
    out_fmt = resolve_output(output)
    run(_consume(broker, token, topic, group, from_.value, limit, follow, queue, out_fmt))


async def _consume(broker: str, token: str | None, topic: str, group: str, from_: str, limit: int | None,
                   follow: bool, queues: list[int] | None, out_fmt: Output) -> None:
    from txmq.client.consumer import Consumer
    from txmq.constants import canonical_topic, is_system_topic
    from txmq.wire import TxmqError

    from ..client_ops import cli_error
    from ..common import parse_address
    from ._messages import message_line, message_row

    parse_address(broker)
    topic = canonical_topic(topic)
    if is_system_topic(topic):
        raise CliError(f"{topic} is a system topic: see it with txmq inspect half|op or txmq discard list", exitcodes.USAGE)
    consumer = Consumer(group, topic, broker, token=token or None, from_=from_, queues=queues, auto_commit=True,
                        auto_commit_interval=1.0, wait_ms=1000 if not follow else 5000, reconnect=follow, connect_timeout=5.0)
    sink = RowSink(out_fmt, table=lambda row: out.print(message_line(row)))
    count = 0
    printed: dict[int, int] = {}  # queue id -> next offset after the last message printed
    status = None
    stop = stop_event()
    try:
        try:
            await consumer.start()
            if not follow:
                topics = (await consumer.client.request("list_topics", {}))["topics"]
                if not any(t["topic"] == topic for t in topics):
                    raise CliError(f"no topic {topic!r} on the broker", exitcodes.NOT_FOUND)
            if follow and interactive() and out_fmt is Output.table:
                # On the console the messages are printed to: rich then prints them above the
                # spinner's line instead of onto it (two consoles on one terminal would interleave).
                status = out.status(f"following {topic} as {group}")
                status.start()
            while not stop.is_set():
                want = None if limit is None else limit - count
                batch = await consumer.poll(timeout=0.25, max_messages=want)
                for m in batch:
                    sink.add(message_row(m))
                    count += 1
                    printed[m.queue_id] = m.queue_offset + 1
                if status is not None and batch:
                    status.update(f"following {topic} as {group}: {count} message(s)")
                if limit is not None and count >= limit:
                    break
                if not follow and not batch and consumer.caught_up():
                    break
        except (TxmqError, TimeoutError) as e:
            raise cli_error(e, broker, bool(token)) from None
    except BaseException:
        sink.abort()
        raise
    finally:
        if status is not None:
            status.stop()
        try:
            await _commit_printed(consumer, printed)
        finally:
            sink.close()  # after abort(): nothing more
    if out_fmt is Output.table and count == 0 and not follow:
        note(f"no new messages on {topic} for group {group}")


async def _commit_printed(consumer: Any, printed: dict[int, int]) -> None:
    """Commit exactly up to what was printed (not what was fetched), then close.

    Also on the way out of an error (a closed pipe, Ctrl-C): the message that
    could not be printed is not committed, so the next run shows it.
    """
    import asyncio

    from txmq.wire import TxmqError

    try:
        if consumer.client.connected:
            done = consumer.committed
            await asyncio.gather(*(consumer.commit((q, off)) for q, off in printed.items() if done.get(q) != off))
    except (TxmqError, TimeoutError) as e:
        err.print(f"[warn]warning:[/warn] offsets not committed: {esc(str(e))}")
    finally:
        await consumer.close(commit=False)
