"""txmq send: one message, or one per stdin line with many in flight; --tx for half messages."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any, Callable, Optional

import typer

from txmq.constants import PROP_SHARDING_KEY, TOPIC_RE, is_system_topic

from .. import exitcodes
from ..common import DEFAULT_BROKER, INTERRUPT_GRACE_S, BrokerOpt, CliError, OutputOpt, TokenOpt, one_of, parse_duration, run, run_interruptible
from ..console import Output, RowSink, err, esc, fmt_ts, kv_table, out, resolve_output

if TYPE_CHECKING:
    import asyncio

EPILOG = """Examples:

  txmq send orders '{"id": 1}' --tag created --key order-1 --prop region=eu

  seq 1000 | txmq send numbers            # one message per line, results as they are acknowledged

  txmq send orders '{"id": 2}' --tx --group shop --state commit

  txmq send orders '{"id": 3}' --tx --group shop   # left pending: resolve it or let the checker answer

  txmq send orders '{"id": 4, "step": "paid"}' --message-group order-4   # FIFO: one queue per group, in order

  printf 'order-1\tcreated\norder-2\tcreated\norder-1\tpaid\n' | txmq send orders --message-group -   # GROUP<TAB>BODY lines

  txmq send orders '{"id": 5, "cancel_if_unpaid": true}' --delay 30m

  txmq send reports go --deliver-at 2026-01-31T08:00:00Z

Output keys: msg_id, topic, queue_id, commit_log_offset, and queue_offset (plain;
-1 for a delayed message, with deliver_at and deliver_at_ms: its due time, ms since the epoch;
a table shows the time and leaves out the queue offset)
or tx_id, half_offset, state (--tx); with stdin lines also line (1-based)."""


class TxState(str, Enum):
    commit = "commit"
    rollback = "rollback"
    unknown = "unknown"


_OUTCOME = {"commit": "committed", "rollback": "rolled_back", "unknown": "pending"}

# After Ctrl-C, how long the lines in flight may take to finish, within the grace run_interruptible gives.
FINISH_AFTER_INTERRUPT_S = INTERRUPT_GRACE_S - 0.5


def register(app: typer.Typer) -> None:
    app.command("send", epilog=EPILOG)(send)


def send(
    topic: Annotated[str, typer.Argument(metavar="TOPIC", help="Topic to send to.", show_default=False)],
    body: Annotated[Optional[str], typer.Argument(metavar="BODY", help="Message body; '-' (or none with stdin piped) sends one message per stdin line.", show_default=False)] = None,
    tag: Annotated[Optional[str], typer.Option("--tag", help="The message's tag (TAGS).", show_default=False)] = None,
    key: Annotated[Optional[list[str]], typer.Option("--key", "-k", help="A key (KEYS); repeatable.", show_default=False)] = None,
    prop: Annotated[Optional[list[str]], typer.Option("--prop", "-p", help="A user property K=V; repeatable.", show_default=False)] = None,
    queue: Annotated[Optional[int], typer.Option("--queue", "-q", help="Queue id, 0 to 1023 [default: round robin].", show_default=False, min=0, max=1023)] = None,
    message_group: Annotated[Optional[str], typer.Option("--message-group", "-G", help="FIFO: the message group (its queue, in send order); '-': each stdin line is GROUP<TAB>BODY.", show_default=False)] = None,
    tx: Annotated[bool, typer.Option("--tx", help="Send a half (transactional) message, then end it with --state.", rich_help_panel="Transactions")] = False,
    group: Annotated[Optional[str], typer.Option("--group", "-g", help="Producer group (required with --tx).", show_default=False, rich_help_panel="Transactions")] = None,
    state: Annotated[Optional[TxState], typer.Option("--state", help="How to end the transaction [default: unknown = leave it pending].", show_default=False, rich_help_panel="Transactions")] = None,
    delay: Annotated[Optional[str], typer.Option("--delay", help="Deliver it this long after the broker stores it (30s, 10m, 2h; "
                                                 "each stdin line counts from its own store time); consumers see nothing until "
                                                 "then. At most the broker's --max-delay (3 days by default).", show_default=False,
                                                 rich_help_panel="Delayed delivery")] = None,
    deliver_at: Annotated[Optional[str], typer.Option("--deliver-at", help="Deliver it at this time: ISO 8601 "
                                                      "(2026-01-31T08:00:00Z; without a zone, local time) or epoch milliseconds; "
                                                      "a time past = now.", show_default=False,
                                                      rich_help_panel="Delayed delivery")] = None,
    window: Annotated[int, typer.Option("--window", help="Messages in flight at once when reading stdin.", min=1, max=65536)] = 256,
    broker: BrokerOpt = DEFAULT_BROKER,
    token: TokenOpt = None,
    output: OutputOpt = None,
    tag_short: Annotated[Optional[str], typer.Option("-t", hidden=True, show_default=False)] = None,  # --tag's older short name
) -> None:
    """Send a message, or one message per line of stdin.

    Each line's result is printed (and flushed) as soon as the broker
    acknowledges it, so if the broker goes away the output is an exact record
    of what was stored.
    """
    tag = one_of(tag, tag_short, "--tag", "-t")
    if not TOPIC_RE.match(topic):
        raise CliError(f"invalid topic name {topic!r}: letters, digits, %, |, _ and - only, at most 127", exitcodes.USAGE)
    if is_system_topic(topic):
        raise CliError(f"{topic} is a system topic and cannot be sent to", exitcodes.USAGE)
    if tx and not group:
        raise CliError("--tx needs --group (the producer group that owns the transaction)", exitcodes.USAGE)
    if not tx and (state is not None or group is not None):
        raise CliError("--group and --state only apply with --tx", exitcodes.USAGE)
    group_per_line = _check_message_group(message_group, tx, queue)
    props: dict[str, str] = {}
    for p in prop or []:
        k, sep, v = p.partition("=")
        if not sep or not k:
            raise CliError(f"bad --prop {p!r}: expected KEY=VALUE", exitcodes.USAGE)
        props[k] = v
    if tag is not None:
        props["TAGS"] = tag
    if key:
        for k in key:
            if not k or len(k.split()) != 1 or k != k.strip():  # KEYS is space-separated: 'a b' would be two keys
                raise CliError(f"bad --key {k!r}: a key is one word, without spaces (give --key again for several)",
                               exitcodes.USAGE)
        props["KEYS"] = " ".join(key)
    if delay is not None or deliver_at is not None:
        if message_group is not None:
            raise CliError("--message-group does not go with --delay or --deliver-at: a FIFO message cannot be delayed "
                           "(as in RocketMQ 5)", exitcodes.USAGE)
        if tx:
            raise CliError("--delay and --deliver-at do not apply to --tx: a transactional message cannot be delayed", exitcodes.USAGE)
        props.update(schedule_props(delay, deliver_at))
    if tx:
        props["TRAN_MSG"] = "true"
        props["PGROUP"] = group  # type: ignore[assignment]
    if message_group is not None and not group_per_line:
        props[PROP_SHARDING_KEY] = message_group
    stream = body == "-" or (body is None and not sys.stdin.isatty())
    if body is None and not stream:
        raise CliError("no message body: give BODY, or pipe lines on stdin (BODY '-')", exitcodes.USAGE)
    if group_per_line and not stream:
        raise CliError("--message-group - takes each message's group from its stdin line (GROUP<TAB>BODY): "
                       "pipe lines on stdin, or give the group itself", exitcodes.USAGE)
    spec = _Spec(topic, props, queue, group if tx else None, (state or TxState.unknown).value, _tx_ids(props) if tx else None,
                 group_per_line)
    out_fmt = resolve_output(output)
    if stream:
        st = _Tally(RowSink(out_fmt, table=_print_sent))
        try:
            run_interruptible(_send_stream(broker, token, spec, window, st))
        except KeyboardInterrupt:  # the summary line, as resolve and discard replay print it; exit 130
            st.sink.close()
            if st.line:
                err.print(f"[warn]{esc(st.stopped('interrupted'))}[/warn]")
            raise
        except BaseException:
            st.sink.abort()
            raise
        finally:
            _name_unended(st.unended, spec, broker)
    else:
        unended: dict[int, _Unended] = {}
        try:
            row = run(_send_one(broker, token, spec, (body or "").encode(), unended))
        except BaseException:
            _name_unended(unended, spec, broker)
            raise
        if out_fmt is Output.table:
            kv_table(human_row(row), out_fmt, formatters={"deliver_at": _due})
        else:
            kv_table(row, out_fmt)


def human_row(row: dict[str, Any]) -> dict[str, Any]:
    """A send's row as a table shows it: a scheduled message's due time as a time, without the queue offset it
    does not have yet (-1: it enters its queue when due) nor the due time in epoch milliseconds."""
    if row.get("deliver_at_ms") is None:
        return row
    return {k: v for k, v in row.items() if k not in ("queue_offset", "deliver_at_ms")}


def _due(ms: Any) -> str:
    from ..console import fmt_when

    return f"{fmt_ts(ms)} ({fmt_when(ms)})"


def _check_message_group(message_group: str | None, tx: bool, queue: int | None) -> bool:
    """--message-group's value checked as the broker would; True for '-' (each stdin line names its group)."""
    if message_group is None:
        return False
    if tx:
        raise CliError("--message-group does not go with --tx: a transactional message cannot have a message group "
                       "(as in RocketMQ 5)", exitcodes.USAGE)
    if queue is not None:
        raise CliError("--message-group chooses the queue: leave --queue out", exitcodes.USAGE)
    if message_group == "-":
        return True
    from txmq.broker.fifo import group_problem

    problem = group_problem(message_group)
    if problem is not None:
        raise CliError(f"bad --message-group {message_group!r}: {problem}", exitcodes.USAGE)
    return False


def _split_group(line: bytes) -> tuple[str, bytes]:
    """(group, body) of a stdin line under --message-group -: GROUP<TAB>BODY."""
    group, tab, body = line.partition(b"\t")
    if not tab:
        raise ValueError("no tab: with --message-group - each line is GROUP<TAB>BODY")
    try:
        text = group.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("the message group before the tab is not UTF-8 text") from None
    from txmq.broker.fifo import group_problem

    problem = group_problem(text)
    if problem is not None:
        raise ValueError(problem)
    return text, body


def schedule_props(delay: str | None, deliver_at: str | None) -> dict[str, str]:
    """The properties of --delay (TIMER_DELAY_MS, counted by the broker) or --deliver-at (TIMER_DELIVER_MS)."""
    if delay is not None and deliver_at is not None:
        raise CliError("give --delay or --deliver-at, not both", exitcodes.USAGE)
    if delay is not None:
        return {"TIMER_DELAY_MS": str(int(parse_duration(delay) * 1000))}
    return {"TIMER_DELIVER_MS": str(parse_deliver_at(deliver_at or ""))}


def parse_deliver_at(text: str) -> int:
    """Epoch ms of --deliver-at: ISO 8601 (naive = local time) or epoch milliseconds."""
    from datetime import datetime

    t = text.strip()
    if t.isascii() and t.isdigit() and len(t) <= 15:
        return int(t)
    try:
        dt = datetime.fromisoformat(t[:-1] + "+00:00" if t.endswith(("Z", "z")) else t)
    except ValueError:
        raise CliError(f"bad --deliver-at {text!r}: use an ISO 8601 time (2026-01-31T08:00:00Z, or local time without a zone) "
                       "or epoch milliseconds", exitcodes.USAGE) from None
    if dt.tzinfo is None:
        dt = dt.astimezone()
    ms = int(dt.timestamp() * 1000)
    if ms < 0:
        raise CliError(f"--deliver-at {text!r} is before 1970", exitcodes.USAGE)
    return ms


def _print_sent(row: dict[str, Any]) -> None:
    extra = (f"tx_id={esc(row['tx_id'])} half_offset={row['half_offset']} state={row['state']}"
             if "tx_id" in row else f"queue_offset={row['queue_offset']}")
    if row.get("deliver_at_ms") is not None:
        extra = f"deliver_at={fmt_ts(row['deliver_at_ms'])}"

    out.print(f"[ok]sent[/ok] line {row['line']}: msg_id={esc(row['msg_id'])} queue_id={row['queue_id']} {extra}")


class _Tally:
    """What `send` of stdin lines did so far, for its summary line (also after Ctrl-C)."""

    def __init__(self, sink: RowSink) -> None:
        self.sent = 0
        self.failed = 0
        self.line = 0  # the last input line read
        self.sink = sink  # each line's result, as it comes
        self.unconfirmed = 0  # lines in flight when it stopped
        self.unended: dict[int, _Unended] = {}  # --tx, by line: the transactions started whose row is not printed

    def stopped(self, why: str) -> str:
        return (f"stopped ({why}): {self.sent} sent, {self.failed} failed"
                + (f", up to {self.unconfirmed} unconfirmed (in flight when it stopped: stored or not)" if self.unconfirmed else "")
                + f", input read up to line {self.line}; to resume, resend the lines with no printed result"
                f" and those after line {self.line}")


@dataclass(frozen=True, slots=True)
class _Spec:
    """What every message of one `send` shares."""

    topic: str
    props: dict[str, str]
    queue: int | None
    group: str | None  # set for --tx
    state: str  # commit | rollback | unknown
    new_tx_id: Callable[[], str] | None = None  # --tx: each half's id is chosen here, so an unacknowledged one has a name
    group_per_line: bool = False  # --message-group -: each stdin line is GROUP<TAB>BODY

    def fields(self, body: bytes, tx_id: str | None = None) -> dict[str, Any]:
        if self.group_per_line:
            message_group, body = _split_group(body)
        f: dict[str, Any] = {"topic": self.topic, "body": body, "born_ts": time.time_ns() // 1_000_000}
        if self.props or tx_id is not None or self.group_per_line:
            f["properties"] = dict(self.props)
            if tx_id is not None:
                f["properties"]["UNIQ_KEY"] = tx_id
            if self.group_per_line:
                f["properties"][PROP_SHARDING_KEY] = message_group
        if self.queue is not None:
            f["queue_id"] = self.queue
        return f


@dataclass(slots=True)
class _Unended:
    """A transaction `send --tx` started and has no outcome for yet (its line's row is not printed)."""

    tx_id: str
    half_offset: int | None = None  # once the half is acknowledged


def _tx_ids(props: dict[str, str]) -> Callable[[], str]:
    """Where each half's id comes from: the --prop UNIQ_KEY given, else ids chosen here."""
    given = props.get("UNIQ_KEY")
    if given is not None:
        return lambda: given
    from txmq.client.transaction import TxIds

    return TxIds()


def _settled(exc: BaseException) -> bool:
    """Whether a refused send or end leaves nothing to end: refused before anything was stored, or decided
    already (CONFLICT, TX_NOT_FOUND). A lost connection, a timeout or a failed write may have stored it."""
    from txmq.client.connection import ConnectionLost
    from txmq.wire import ErrorCode, TxmqError

    return isinstance(exc, TxmqError) and not isinstance(exc, ConnectionLost) and exc.code is not ErrorCode.STORE_ERROR


async def _deliver(client: Any, spec: _Spec, body: bytes, end_queued: Any = None,
                   unended: dict[int, _Unended] | None = None, line: int = 0) -> dict[str, Any]:
    """Send one message; with --tx, end it too. ``end_queued`` is called once the end request is queued
    (pipelined: the caller may start the next line while the end's reply is on its way). With --tx the
    line's transaction is in ``unended`` from before its half is sent until its outcome is known."""
    tx_id = spec.new_tx_id() if spec.new_tx_id is not None else None
    if tx_id is None:
        return await _send_and_end(client, spec, body, None, end_queued)
    track = unended if unended is not None else {}
    track[line] = started = _Unended(tx_id)
    try:
        row = await _send_and_end(client, spec, body, started, end_queued)
    except Exception as exc:
        if _settled(exc):
            del track[line]
        raise
    del track[line]
    return row


async def _send_and_end(client: Any, spec: _Spec, body: bytes, started: _Unended | None, end_queued: Any) -> dict[str, Any]:
    r = await client.request("send", spec.fields(body, started.tx_id if started is not None else None))
    if r.get("topic_created"):
        _note_topic_created(r["topic"])
    if spec.group is None:
        row = {"msg_id": r["msg_id"], "topic": r["topic"], "queue_id": r["queue_id"],
               "queue_offset": r["queue_offset"], "commit_log_offset": r["commit_log_offset"]}
        if "deliver_at_ms" in r:
            row["deliver_at_ms"] = r["deliver_at_ms"]
            row["deliver_at"] = r["deliver_at_ms"]  # as inspect scheduled names it (ms since the epoch, as every *_at)
        return row
    if started is not None:
        started.half_offset = r["half_offset"]
    row = {"msg_id": r.get("msg_id", r["tx_id"]), "topic": r["topic"], "queue_id": r["queue_id"],
           "commit_log_offset": r["commit_log_offset"], "tx_id": r["tx_id"], "half_offset": r["half_offset"],
           "state": "pending"}
    if spec.state != "unknown":
        fields = {"group": spec.group, "tx_id": r["tx_id"], "commit_log_offset": r["commit_log_offset"],
                  "half_offset": r["half_offset"], "state": spec.state, "from_check": False}
        if end_queued is None:
            e = await client.request("end_transaction", fields)
        else:
            from txmq.wire import TxmqError

            try:
                reply = client.send_request("end_transaction", fields)
            except TxmqError:  # no live connection: the retrying path
                end_queued()
                e = await client.request("end_transaction", fields)
            else:
                end_queued()
                e = await reply
        row["state"] = e.get("outcome", _OUTCOME[spec.state])
    return row


def _note_topic_created(topic: str) -> None:
    """Once per topic, on stderr: a send that created its topic may be a typo (`txmq send ordres ...`)."""
    if topic not in _CREATED:
        _CREATED.add(topic)
        err.print(f"[warn]note: topic {esc(topic)} did not exist: this send created it (`txmq topics describe {esc(topic)}`; "
                  f"a broker started with --no-auto-create-topics refuses such sends)[/warn]")


_CREATED: set[str] = set()


def _name_unended(unended: dict[int, _Unended], spec: _Spec, broker: str) -> None:
    """On stderr: each transaction the run started and did not see ended, and the command that ends them.

    `send` is no producer of its group, so nothing checks them back: left
    alone they stay pending, holding the half progress back until retention.
    """
    if not unended or spec.group is None:
        return
    import shlex

    from ._bulk import ref_argument

    txs = sorted(unended.items())
    n = len(txs)
    err.print(f"[warn]{n} transaction{'s' if n != 1 else ''} of this run not ended: each may be pending, "
              f"and no check-back comes to `send`:[/warn]")
    for line, u in txs:
        what = (f"half stored (half_offset {u.half_offset}), its end ({spec.state}) not confirmed" if u.half_offset is not None
                else "half sent, not acknowledged (stored or not)")
        err.print(f"  line {line}: tx_id {esc(u.tx_id)}: {what}")
    action = "commit" if spec.state == "commit" else "rollback"
    if action == "commit":
        err.print("end them as asked, then resend only the lines it answers not_found for (that half was never stored):")
    elif spec.state == "rollback":
        err.print("end them as asked, then resend their lines:")
    else:  # unknown: pending as asked, but their lines printed no tx_id
        err.print("roll them back before resending their lines:")
    target = "" if broker == DEFAULT_BROKER else f" --broker {shlex.quote(broker)}"
    ids = " ".join(ref_argument(tx_id) for tx_id in dict.fromkeys(u.tx_id for _, u in txs))
    err.print(f"  txmq resolve --{action} --yes{esc(target)} {esc(ids)}", soft_wrap=True)


async def _send_one(broker: str, token: str | None, spec: _Spec, body: bytes, unended: dict[int, _Unended]) -> dict[str, Any]:
    from ..client_ops import connect

    async with connect(broker, token) as client:
        return await _deliver(client, spec, body, unended=unended, line=1)


async def _send_stream(broker: str, token: str | None, spec: _Spec, window: int, st: _Tally) -> None:
    import asyncio

    from ..client_ops import connect

    async with connect(broker, token) as client:
        stream = _Stream(client, spec, window, st)
        try:
            await stream.send_lines()
        except asyncio.CancelledError:
            await stream.finish_after_interrupt()
            raise
    if stream.closed:
        raise BrokenPipeError  # main() exits quietly
    _report_stream(stream, broker)


class _Stream:
    """The lines of one `send` from stdin, each sent by a task of its own, at most `window` in flight."""

    def __init__(self, client: Any, spec: _Spec, window: int, st: _Tally) -> None:
        import asyncio

        self.client = client
        self.spec = spec
        self.st = st
        self.slots = asyncio.Semaphore(window)
        self.ends = asyncio.Semaphore(window)  # --tx: ends whose reply is awaited after their line's slot was freed
        self.tasks: set[asyncio.Task[None]] = set()
        self.lost: list[BaseException] = []  # the broker was lost: reported once, at the end
        self.closed = False  # stdout's reader went away (`| head`): stop sending

    async def send_lines(self) -> None:
        """Start a task for each non-blank stdin line as a slot frees, until the input ends or the run stops; then wait for them."""
        import asyncio
        import contextlib

        from ._stdin import stdin_lines

        async with contextlib.aclosing(stdin_lines()) as lines:
            async for line in lines:
                self.st.line += 1
                if not line.strip():
                    continue
                await self.slots.acquire()
                if self.lost or self.closed:
                    self.slots.release()
                    break
                t = asyncio.get_running_loop().create_task(self.send_line(self.st.line, line))
                self.tasks.add(t)
                t.add_done_callback(self.tasks.discard)
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)

    async def send_line(self, line_no: int, body: bytes) -> None:
        import asyncio

        freed = False
        end_slot = False

        def end_queued() -> None:
            # The half is acknowledged and its end queued: the next line may go (its half shares
            # the broker's group-commit fsync with this end); at most `window` such ends wait.
            nonlocal freed
            freed = True
            self.slots.release()

        try:
            if self.spec.group is not None and self.spec.state != "unknown":
                await self.ends.acquire()
                end_slot = True
            row = await _deliver(self.client, self.spec, body, end_queued if end_slot else None, self.st.unended, line_no)
        except asyncio.CancelledError:  # Ctrl-C: in flight, answer unknown
            self.st.unconfirmed += 1
            raise
        except Exception as exc:
            self._failed(line_no, exc)
        else:
            self._sent(line_no, row)
        finally:
            if not freed:
                self.slots.release()
            if end_slot:
                self.ends.release()

    def _failed(self, line_no: int, exc: Exception) -> None:
        from ..client_ops import exit_code_of

        if exit_code_of(exc) == exitcodes.UNREACHABLE:
            self.lost.append(exc)
        else:
            self.st.failed += 1
            err.print(f"[err]error:[/err] line {line_no}: {esc(_msg(exc))}")

    def _sent(self, line_no: int, row: dict[str, Any]) -> None:
        self.st.sent += 1
        try:
            self.st.sink.add({"line": line_no, **row})
        except BrokenPipeError:
            self.closed = True

    async def finish_after_interrupt(self) -> None:
        """After Ctrl-C no line more is read. The lines in flight may finish for a while (a --tx half acknowledged
        gets its end, whose reply prints the row); then the rest end as unconfirmed, before the connection closes."""
        import asyncio

        flying = list(self.tasks)
        if flying:
            _, left = await asyncio.wait(flying, timeout=FINISH_AFTER_INTERRUPT_S)
            for t in left:
                t.cancel()
            if left:
                await asyncio.wait(left)


def _report_stream(stream: _Stream, broker: str) -> None:
    """The one-line summary of a bulk run (docs/cli.md, "Summary of a bulk run"), and its exit code."""
    from ..client_ops import cli_error

    st = stream.st
    st.sink.close()
    if st.line:
        if stream.lost:
            err.print(f"[warn]stopped (broker lost): {st.sent} sent, {st.failed} failed, input read up to line {st.line}; "
                      f"to resume, resend the lines with no printed result and those after line {st.line}[/warn]")
        else:
            err.print(f"{st.sent} sent, {st.failed} failed, 0 not attempted")
    if stream.lost:
        raise CliError(f"{cli_error(stream.lost[0], broker).message}; {st.sent} message(s) were acknowledged (printed above), "
                       f"the rest were not sent or not acknowledged", exitcodes.UNREACHABLE)
    if st.failed:
        raise CliError(f"{st.failed} of {st.failed + st.sent} message(s) failed", exitcodes.PARTIAL)
    if st.line == 0:
        err.print("[dim]no input lines: nothing sent[/dim]")


def _msg(exc: BaseException) -> str:
    from rich.markup import escape

    return escape(getattr(exc, "message", None) or str(exc) or type(exc).__name__)
