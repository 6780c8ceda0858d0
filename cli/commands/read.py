"""txmq read: print a topic's messages without a consumer group, committing nothing (like `kcat -C`)."""

from typing import Annotated, Any, Optional

import typer

from .. import exitcodes
from ..common import DEFAULT_BROKER, BrokerOpt, CliError, OutputOpt, TokenOpt, one_of, run, stop_event
from ..console import Output, RowSink, note, out, resolve_output

EPILOG = """Examples:

  txmq read orders                          # everything, then exit

  txmq read orders --from 10m --limit 20    # the first 20 messages stored in the last 10 minutes

  txmq read orders --queue 2 --from 1500 -o jsonl | jq -r .body

  txmq read orders --from latest --follow   # new messages until Ctrl-C

--from: earliest (default), latest, an offset (in each queue read), a duration ago (10m) or an ISO-8601 time
(local time without a zone): per queue, the first message stored at or after it. No group, no offset is committed.
Keys: as for consume."""


def register(app: typer.Typer) -> None:
    app.command("read", epilog=EPILOG)(read)


def read(
    topic: Annotated[str, typer.Argument(metavar="TOPIC", help="Topic to read.", show_default=False)],
    queue: Annotated[Optional[list[int]], typer.Option("--queue", "-q", help="Only this queue id (0 to 1023); repeatable.", show_default=False, min=0, max=1023)] = None,
    from_: Annotated[str, typer.Option("--from", help="earliest | latest | OFFSET | TIME (10m ago, or ISO-8601).")] = "earliest",
    limit: Annotated[Optional[int], typer.Option("--limit", "-l", help="Stop after this many messages.", show_default=False, min=1)] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep waiting for new messages (until Ctrl-C).")] = False,
    broker: BrokerOpt = DEFAULT_BROKER,
    token: TokenOpt = None,
    output: OutputOpt = None,
    count: Annotated[Optional[int], typer.Option("--count", "-c", hidden=True, show_default=False, min=1)] = None,  # --limit's older name
) -> None:
    """Print messages without a consumer group; without --follow, exit at the end."""
    from ._positions import parse_position

    pos = parse_position(from_)
    limit = one_of(limit, count, "--limit", "--count")
    run(_read(broker, token, topic, queue, pos, limit, follow, resolve_output(output)))


async def _read(broker: str, token: str | None, topic: str, queues: list[int] | None, pos: Any, count: int | None,
                follow: bool, out_fmt: Output) -> None:
    import asyncio

    from txmq.client.message import ReceivedMessage
    from txmq.constants import canonical_topic, is_system_topic

    from ..client_ops import connect
    from ._messages import message_line, message_row

    topic = canonical_topic(topic)
    if is_system_topic(topic):
        raise CliError(f"{topic} is a system topic: see it with txmq inspect half|op or txmq discard list", exitcodes.USAGE)
    printed = 0
    stop = stop_event()
    with RowSink(out_fmt, table=lambda row: out.print(message_line(row))) as sink:  # a valid JSON list on every way out
        async with connect(broker, token) as c:
            topics = {t["topic"]: t["queues"] for t in (await c.request("list_topics", {}))["topics"]}
            if topic not in topics:
                raise CliError(f"no topic {topic!r} on the broker", exitcodes.NOT_FOUND)
            n = topics[topic]
            qs = sorted(set(queues)) if queues else list(range(n))
            bad = [q for q in qs if q >= n]
            if bad:
                raise CliError(f"queue {bad[0]} does not exist: topic {topic} has {n} queues", exitcodes.NOT_FOUND)
            # where each queue starts; the end is taken now, so a read without --follow stops there
            probes = await asyncio.gather(*(c.request("pull", {"topic": topic, "queue_id": q, "offset": 0, "max_count": 1}) for q in qs))
            bounds = {q: (p["min_offset"], p["max_offset"]) for q, p in zip(qs, probes)}
            if pos.kind == "time":
                at = (await c.request("offsets_for_time", {"topic": topic, "time_ms": pos.time_ms, "queue_ids": qs}))["offsets"]
                start = {q: at[str(q)] for q in qs}
            elif pos.kind == "offset":
                start = {q: pos.offset for q in qs}
            else:
                start = {q: bounds[q][0 if pos.kind == "earliest" else 1] for q in qs}
            ends = {q: bounds[q][1] for q in qs}
            nxt = dict(start)

            def emit(m: dict[str, Any]) -> None:
                nonlocal printed
                sink.add(message_row(ReceivedMessage.from_map(m)))
                printed += 1

            while not stop.is_set() and (count is None or printed < count):
                live = [q for q in qs if follow or nxt[q] < ends[q]]
                if not live:
                    break
                want = 32 if count is None else max(1, min(32, count - printed))
                replies = await asyncio.gather(*(c.request("pull", {
                    "topic": topic, "queue_id": q, "offset": nxt[q], "max_count": want,
                    "wait_ms": 1000 if follow else 0}) for q in live))
                for q, r in zip(live, replies):
                    if r["status"] == "offset_too_small" or r["status"] == "offset_overflow":
                        nxt[q] = r["next_offset"]  # past retention, or an offset past the end: go to the nearest
                        if r["status"] == "offset_overflow" and not follow:
                            ends[q] = nxt[q]
                        continue
                    for m in r["messages"]:
                        if count is not None and printed >= count:
                            break
                        if not follow and m["queue_offset"] >= ends[q]:
                            break
                        emit(m)
                        nxt[q] = m["queue_offset"] + 1
                    else:
                        nxt[q] = max(nxt[q], r["next_offset"])
                    if not follow and not r["messages"]:
                        ends[q] = min(ends[q], nxt[q])
    if out_fmt is Output.table and printed == 0 and not follow:
        note(f"no messages on {topic} from there")
