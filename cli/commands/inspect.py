"""txmq inspect half|op|offsets: the transaction state, from a broker or (--data-dir) from disk."""

import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from txmq.constants import OP_TOPIC

from .. import exitcodes
from ..common import DEFAULT_BROKER, WIRE_INT_MAX, BrokerOpt, CliError, OutputOpt, TokenOpt, parse_duration, run
from ..console import Output, emit_document, esc, fmt_age, fmt_ts, fmt_when, new_table, note, out, print_table, render, resolve_output

app = typer.Typer(help="Look at pending transactions, op records and the check offsets.", no_args_is_help=True)

DataDirOpt = Annotated[
    Optional[Path],
    typer.Option("--data-dir", "-d", help="Read this data directory directly (read-only; works while the broker is down).",
                 show_default=False, rich_help_panel="Connection"),
]

HALF_KEYS = ("tx_id", "half_offset", "commit_log_offset", "topic", "queue_id", "group", "born_at", "stored_at", "age_s", "checks",
             "last_check_at", "last_check_result", "next_check_at")


@app.command(epilog="""Examples:

  txmq inspect half

  txmq inspect half --group shop --older-than 10m

  txmq inspect half --older-than 10m -o jsonl | txmq resolve --rollback - --yes

  txmq inspect half --data-dir /var/lib/txmq      # broker down: read the files

Keys: tx_id, half_offset, commit_log_offset, topic, queue_id, group, born_at, stored_at, age_s, checks,
last_check_at, last_check_result, next_check_at (*_at: ms since the epoch or null). age_s and --older-than
count from stored_at, the broker's clock (born_at is the producer's).""")
def half(
    group: Annotated[Optional[str], typer.Option("--group", "-g", help="Only this producer group.", show_default=False)] = None,
    topic: Annotated[Optional[str], typer.Option("--topic", "-t", help="Only this (real) topic.", show_default=False)] = None,
    older_than: Annotated[Optional[str], typer.Option("--older-than", help="Only transactions stored longer ago than this (30s, 10m, 72h), by the broker's clock.", show_default=False)] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", "-l", help="At most this many rows [default: all; a table on a terminal: 1000]. A cut listing is said on stderr.", min=1, max=10_000_000, show_default=False)] = None,
    data_dir: DataDirOpt = None,
    broker: BrokerOpt = DEFAULT_BROKER,
    token: TokenOpt = None,
    output: OutputOpt = None,
) -> None:
    """Pending transactions (half messages with no outcome yet), oldest first."""
    from ..console import RowSink
    from ._paging import cut_note, effective_limit, stream_pages

    min_age_ms = int(parse_duration(older_than) * 1000) if older_than is not None else 0
    out_fmt = resolve_output(output)
    eff, by_default = effective_limit(limit, out_fmt, 1000)
    with RowSink(out_fmt, lambda r: {k: r.get(k) for k in HALF_KEYS}) as sink:  # the JSON list closed on every way out (Ctrl-C too)
        paged = True
        if data_dir is not None:
            from ._offline import DataDir

            with DataDir(data_dir) as d:
                got, total = d.pending(group, topic, min_age_ms, eff if eff is not None else 1 << 62)
            for r in got:
                sink.add(r)
            more = total > sink.count
        else:
            fields: dict[str, Any] = {"min_age_ms": min_age_ms}
            if group:
                fields["group"] = group
            if topic:
                fields["topic"] = topic
            total_, more, paged = stream_pages(broker, token, "tx_pending", fields, "transactions", "after_half_offset", eff, sink)
            total = total_ if total_ is not None else sink.count
    rows = sink.kept
    now_ms = int(time.time() * 1000)
    if out_fmt is Output.table:  # "sent 3s ago" in one column
        shown = [{**r, "last_check_result": None if r["last_check_result"] is None
                  else f"{check_word(r['last_check_result'])} {fmt_when(r['last_check_at'], now_ms)}".strip()} for r in rows]
        render(
            shown, out_fmt,
            columns=[("tx_id", "TX ID"), ("half_offset", "HALF OFFSET"), ("topic", "TOPIC"), ("queue_id", "Q"), ("group", "GROUP"),
                     ("age_s", "AGE"), ("checks", "CHECKS"), ("last_check_result", "LAST CHECK"), ("next_check_at", "NEXT CHECK")],
            formatters={"age_s": fmt_age, "next_check_at": lambda v: fmt_when(v, now_ms),
                        "last_check_result": lambda v: "-" if v is None else str(v)},
            empty="no pending transactions" + (" matching" if group or topic or older_than else ""),
        )
    if more:
        msg = cut_note(sink.count, total, "pending transactions", asked=limit is not None, old_broker=not paged)
        if not paged and limit is None:
            raise CliError(msg, exitcodes.ERROR)
        note(msg)


def check_word(result: str) -> str:
    """A last check's result as a table shows it, short enough for a row of 120 columns: "no producer" for
    "no producer online", "unreadable" for "unreadable: <why>" (-o json has the broker's words)."""
    if result == "no producer online":
        return "no producer"
    if result.startswith("unreadable"):
        return "unreadable"
    return result


@app.command(epilog="""Examples:

  txmq inspect op                       # the newest 50 op records

  txmq inspect op --from 0 --limit 1000 -o jsonl

  txmq inspect op --data-dir /var/lib/txmq

Keys: op_offset, half_offset, tx_id, action (commit | rollback), decided_by (producer | check | operator),
decided_at, group, topic, checks, commit_log_offset (of the op record), half_commit_log_offset, processed
(whether the check service's op progress has passed it).""")
def op(
    from_: Annotated[Optional[int], typer.Option("--from", help="First op-queue offset [default: the newest --limit records].", show_default=False, min=0)] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", "-l", help="At most this many records [default: all; a table on a terminal: the newest 50]. A cut listing is said on stderr.", min=1, show_default=False)] = None,
    data_dir: DataDirOpt = None,
    broker: BrokerOpt = DEFAULT_BROKER,
    token: TokenOpt = None,
    output: OutputOpt = None,
) -> None:
    """Op records: the decisions (commit or rollback) written to RMQ_SYS_TRANS_OP_HALF_TOPIC."""
    from ..console import RowSink
    from ._paging import cut_note, effective_limit

    if from_ is not None and from_ > WIRE_INT_MAX:
        raise CliError(f"--from {from_} is out of range: offsets are 0 to {WIRE_INT_MAX}", exitcodes.USAGE)
    out_fmt = resolve_output(output)
    eff, _ = effective_limit(limit, out_fmt, 50)
    progress_box: list[int] = [0]
    with RowSink(out_fmt, lambda m: _op_row(m, progress_box[0])) as sink:  # the JSON list closed on every way out (Ctrl-C too)
        if data_dir is not None:
            from ._offline import DataDir

            with DataDir(data_dir) as d:
                lo, hi = d.queue_bounds(OP_TOPIC, 0)
                progress_box[0] = d.progress.op
                off = start = _op_start(from_, eff, lo, hi)
                while (eff is None or sink.count < eff) and off < hi:
                    batch, nxt = d.read(OP_TOPIC, 0, off, 1024 if eff is None else min(1024, eff - sink.count))
                    if not batch and nxt <= off:
                        break
                    for m in batch:
                        sink.add(m)
                    off = nxt
        else:
            start, lo, hi = run(_pull_ops(broker, token, from_, eff, sink, progress_box))
    if out_fmt is Output.table:
        now_ms = int(time.time() * 1000)  # relative ages, as inspect half shows them
        render(
            sink.kept, out_fmt,
            columns=[("op_offset", "OP OFFSET"), ("half_offset", "HALF OFFSET"), ("tx_id", "TX ID"), ("action", "ACTION"),
                     ("decided_by", "BY"), ("decided_at", "DECIDED"), ("group", "GROUP"), ("topic", "TOPIC"), ("processed", "PROCESSED")],
            formatters={"decided_at": lambda v: fmt_when(v, now_ms), "action": lambda a: f"[{'ok' if a == 'commit' else 'warn'}]{a}[/]"},
            empty="no op records",
        )
    total = hi - max(lo, from_ if from_ is not None else lo)
    if sink.count < total:
        note(cut_note(sink.count, total, "op records" + (f" from {from_}" if from_ is not None else ""), asked=limit is not None)
             + ("" if from_ is not None else "; --from OFFSET for older ones"))


def _op_start(from_: int | None, limit: int | None, lo: int, hi: int) -> int:
    if from_ is not None:
        return max(from_, lo)
    if limit is None:
        return lo
    return max(lo, hi - limit)


async def _pull_ops(broker: str, token: str | None, from_: int | None, limit: int | None, sink: Any,
                    progress_box: list[int]) -> tuple[int, int, int]:
    from ..client_ops import connect

    async with connect(broker, token) as c:
        progress_box[0] = (await c.request("tx_offsets", {}))["op"]["progress"]
        head = await c.request("pull", {"topic": OP_TOPIC, "queue_id": 0, "offset": 0, "max_count": 1})
        lo, hi = head.get("min_offset", 0), head.get("max_offset", 0)
        off = start = _op_start(from_, limit, lo, hi)
        while (limit is None or sink.count < limit) and off < hi:
            want = 1024 if limit is None else min(1024, limit - sink.count)
            r = await c.request("pull", {"topic": OP_TOPIC, "queue_id": 0, "offset": off, "max_count": want})
            status = r.get("status")
            if status == "found":
                for m in r["messages"]:
                    if m["queue_offset"] >= off and (limit is None or sink.count < limit):
                        sink.add(m)
                off = r["next_offset"]
            elif status == "offset_too_small":
                off = r["min_offset"]
            else:
                break
        return start, lo, hi


def _op_row(m: dict[str, Any], op_progress: int) -> dict[str, Any]:
    p = m.get("properties") or {}
    body = m.get("body") or b""
    try:
        half_offset: int | None = int(bytes(body).decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        half_offset = None
    half_cl = p.get("TXMQ_HALF_CL_OFFSET")
    return {
        "op_offset": m["queue_offset"],
        "half_offset": half_offset,
        "tx_id": p.get("UNIQ_KEY"),
        "action": {2: "commit", 3: "rollback"}.get(m.get("tx_type", 0), "unknown"),
        "decided_by": p.get("TXMQ_DECIDED_BY"),
        "decided_at": m.get("store_ts"),
        "group": p.get("PGROUP"),
        "topic": p.get("REAL_TOPIC"),
        "checks": int(p.get("TRANSACTION_CHECK_TIMES") or 0),
        "commit_log_offset": m["commit_log_offset"],
        "half_commit_log_offset": int(half_cl) if half_cl and half_cl.isdigit() else m.get("prepared_offset"),
        "processed": m["queue_offset"] < op_progress,
    }


@app.command("tx", epilog="""Examples:

  txmq inspect tx 7F3AC0DE5E1B4A6D0000000000000012

  txmq inspect tx 42                          # a half offset

  txmq inspect tx 123456 --commit-log-offset  # any record of the transaction

  txmq inspect tx 42 --data-dir /var/lib/txmq -o json

Keys: tx_id, state, group, topic, queue_id, checks, decided_by, decided_at, origin_commit_log_offset,
born_at, last_check_at, last_check_result, next_check_at, message ({topic, queue_id, queue_offset,
commit_log_offset} of the committed message, or null), events (the timeline: event = half | check |
replay | discard | commit | rollback | message, at, by, offsets, checks, answer, reason), scanned,
scan_truncated. Unknown transaction: exit 5.""")
def tx(
    ref: Annotated[str, typer.Argument(help="A transaction id, a half offset, or (with --commit-log-offset) the commit-log offset of any of its records.", show_default=False)],
    commit_log_offset: Annotated[bool, typer.Option("--commit-log-offset", help="A bare integer REF is a commit-log offset, not a half offset.")] = False,
    data_dir: DataDirOpt = None,
    broker: BrokerOpt = DEFAULT_BROKER,
    token: TokenOpt = None,
    output: OutputOpt = None,
) -> None:
    """One transaction's whole history: half copies, check-backs, decision, committed message, discard and replay."""
    from ._bulk import parse_ref

    parsed = parse_ref(ref, f"REF {ref[:60]!r}", "commit_log_offset" if commit_log_offset else "half_offset",
                       ("half_offset", "commit_log_offset"))  # the REF grammar of resolve (docs/cli.md, "REFs")
    if parsed is None:
        raise CliError("an empty REF: name a transaction by id or offset", exitcodes.USAGE)
    fields: dict[str, Any] = parsed[1]
    if data_dir is not None:
        from ._offline import DataDir

        with DataDir(data_dir) as d:
            doc = d.history(fields)
        if doc is None:
            raise CliError(f"no transaction at {' '.join(f'{k} {v}' for k, v in fields.items())} in {data_dir}", exitcodes.NOT_FOUND)
    else:
        from ..client_ops import call

        doc = call(broker, token, "tx_history", fields)
    out_fmt = resolve_output(output)
    if emit_document(doc, out_fmt):
        return
    now_ms = int(time.time() * 1000)
    out.print(f"transaction {esc(doc['tx_id'])}: [bold]{doc['state']}[/bold]"
              + (f" by {doc['decided_by']} {fmt_when(doc['decided_at'], now_ms)}" if doc.get("decided_by") else "")
              + f"   group {esc(doc['group'])}   topic {esc(doc['topic'])} queue {doc.get('queue_id')}   checks {doc['checks']}")
    if doc.get("message"):
        m = doc["message"]
        out.print(f"message: {esc(m['topic'])} queue {m['queue_id']} offset {m['queue_offset']} (commit-log offset {m['commit_log_offset']})")
    if doc["state"] == "pending":
        out.print(f"last check: {esc(doc.get('last_check_result') or '-')} {fmt_when(doc.get('last_check_at'), now_ms) if doc.get('last_check_at') else ''}"
                  f"   next check: {fmt_when(doc.get('next_check_at'), now_ms) if doc.get('next_check_at') else '-'}")

    def detail(e: dict[str, Any]) -> str:
        if e["event"] == "message":
            return f"{e['topic']} queue {e['queue_id']} offset {e['queue_offset']}"
        if e["event"] == "discard":
            return f"{e.get('reason')} (discard offset {e.get('discard_offset')})"
        if e["event"] in ("commit", "rollback"):
            return f"op offset {e.get('op_offset')}" if e.get("op_offset") is not None else ""
        return f"answer: {e['answer']}" if e.get("answer") else ""

    rows = [{**e, "detail": detail(e)} for e in doc.get("events", [])]
    render(rows, out_fmt,
           columns=[("at", "AT"), ("event", "EVENT"), ("by", "BY"), ("half_offset", "HALF OFFSET"),
                    ("commit_log_offset", "COMMIT-LOG OFFSET"), ("checks", "CHECKS"), ("detail", "DETAIL")],
           formatters={"at": fmt_ts, "half_offset": lambda v: "-" if v is None else str(v), "checks": lambda v: "-" if v is None else str(v)},
           empty="no records of it are left in the log")
    if doc.get("scan_truncated"):
        note(f"check copies: read {doc.get('scanned')} half records and stopped (the bound); later copies are not shown")
    if doc.get("note"):
        note(doc["note"])


@app.command(epilog="""Examples:

  txmq inspect offsets

  txmq inspect offsets -o json | jq .half

  txmq inspect offsets --data-dir /var/lib/txmq

Keys: {"half": {"progress", "max"}, "op": {"progress", "max"}, "pending", "discarded", "held_by"}.
held_by (null unless the half progress is behind): the pending transaction it cannot pass, {tx_id, group,
topic, half_offset, age_s, checks, last_check_result, reason}.""")
def offsets(
    data_dir: DataDirOpt = None,
    broker: BrokerOpt = DEFAULT_BROKER,
    token: TokenOpt = None,
    output: OutputOpt = None,
) -> None:
    """The check service's half and op progress offsets against the queues' max offsets."""
    if data_dir is not None:
        from ._offline import DataDir

        with DataDir(data_dir) as d:
            doc = d.offsets()
    else:
        from ..client_ops import call

        doc = call(broker, token, "tx_offsets", {})
    doc = {"half": {"progress": doc["half"]["progress"], "max": doc["half"]["max"]},
           "op": {"progress": doc["op"]["progress"], "max": doc["op"]["max"]},
           "pending": doc["pending"], "discarded": doc.get("discarded", 0), "held_by": doc.get("held_by")}
    out_fmt = resolve_output(output)
    if emit_document(doc, out_fmt):
        return
    t = new_table()
    for label in ("QUEUE", "PROGRESS", "MAX", "BEHIND"):
        t.add_column(label, justify="left" if label == "QUEUE" else "right")
    for name, topic in (("half", "RMQ_SYS_TRANS_HALF_TOPIC"), ("op", "RMQ_SYS_TRANS_OP_HALF_TOPIC")):
        q = doc[name]
        t.add_row(f"{name} ({topic})", str(q["progress"]), str(q["max"]), str(max(0, q["max"] - q["progress"])))
    print_table(t)
    out.print(f"pending: {doc['pending']}   discarded: {doc['discarded']}")
    h = doc["held_by"]
    if h is not None:
        out.print(f"half progress held by {esc(h['tx_id'])} (group {esc(h['group'])}, topic {esc(h['topic'])}, half offset {h['half_offset']}, "
                  f"age {fmt_age(h['age_s'])}, {h['checks']} checks): {esc(h['reason'])}")



SCHEDULED_KEYS = ("msg_id", "topic", "queue_id", "deliver_at", "tags", "keys", "born_at", "stored_at", "size", "commit_log_offset")


@app.command(epilog="""Examples:

  txmq inspect scheduled

  txmq inspect scheduled --topic orders -o jsonl

  txmq inspect scheduled --topic orders -o jsonl | jq -r .msg_id | xargs -n1 txmq scheduled cancel

Keys: msg_id, topic, queue_id (the real topic and queue it goes to), deliver_at (ms since the epoch),
tags, keys, born_at, stored_at, size, commit_log_offset (of the scheduled record). How many are
scheduled (for --topic: for it) goes to stderr.""")
def scheduled(
    topic: Annotated[Optional[str], typer.Option("--topic", "-t", help="Only messages for this topic.", show_default=False)] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", "-l", help="At most this many rows [default: all; a table on a terminal: 1000]. A cut listing is said on stderr.", min=1, max=10_000_000, show_default=False)] = None,
    broker: BrokerOpt = DEFAULT_BROKER,
    token: TokenOpt = None,
    output: OutputOpt = None,
) -> None:
    """Delayed and timed messages not yet delivered, soonest due first."""
    from ..console import RowSink
    from ._paging import cut_note, effective_limit, stream_pages

    out_fmt = resolve_output(output)
    eff, _by_default = effective_limit(limit, out_fmt, 1000)

    def shape(r: dict[str, Any]) -> dict[str, Any]:
        return {"msg_id": r["msg_id"], "topic": r["topic"], "queue_id": r.get("queue_id"), "deliver_at": r["deliver_at_ms"],
                "tags": r.get("tags"), "keys": r.get("keys"), "born_at": r.get("born_ts"), "stored_at": r.get("store_ts"),
                "size": r.get("size"), "commit_log_offset": r["commit_log_offset"]}

    with RowSink(out_fmt, shape) as sink:
        total, more, _paged = stream_pages(broker, token, "list_scheduled", {"topic": topic} if topic else {}, "messages",
                                           "after", eff, sink)
    now_ms = int(time.time() * 1000)
    if out_fmt is Output.table:
        render(sink.kept, out_fmt,
               columns=[("msg_id", "MSG ID"), ("topic", "TOPIC"), ("queue_id", "Q"), ("deliver_at", "DUE"), ("tags", "TAG"),
                        ("keys", "KEYS"), ("stored_at", "STORED")],
               formatters={"deliver_at": lambda v: f"{fmt_ts(v)} ({fmt_when(v, now_ms)})", "stored_at": lambda v: fmt_when(v, now_ms),
                           "tags": lambda v: "-" if v is None else str(v), "keys": lambda v: "-" if v is None else str(v)},
               empty="no scheduled messages" + (f" for topic {topic}" if topic else ""))
    # One line on stderr: how many, or the cut (which says how many), or (a table) that there are none.
    if more:
        note(cut_note(sink.count, total, "scheduled messages" + (f" for topic {topic}" if topic else ""), asked=limit is not None))
    elif sink.count:
        note(f"{total if total is not None else sink.count} scheduled message(s)" + (f" for topic {topic}" if topic else ""))
