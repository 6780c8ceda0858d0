"""txmq send: one message, or one per stdin line with many in flight; --tx for half messages."""

import os
import sys
import time
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any, Optional

import typer

from txmq.constants import TOPIC_RE, is_system_topic

from .. import exitcodes
from ..common import DEFAULT_BROKER, BrokerOpt, CliError, OutputOpt, TokenOpt, run, run_interruptible
from ..console import Output, RowSink, err, esc, kv_table, out, resolve_output

EPILOG = """Examples:

  txmq send orders '{"id": 1}' --tag created --key order-1 --prop region=eu

  seq 1000 | txmq send numbers            # one message per line, results as they are acknowledged

  txmq send orders '{"id": 2}' --tx --group shop --state commit

  txmq send orders '{"id": 3}' --tx --group shop   # left pending: resolve it or let the checker answer

Output keys: msg_id, topic, queue_id, commit_log_offset, and queue_offset (plain)
or tx_id, half_offset, state (--tx); with stdin lines also line (1-based)."""


class TxState(str, Enum):
    commit = "commit"
    rollback = "rollback"
    unknown = "unknown"


_OUTCOME = {"commit": "committed", "rollback": "rolled_back", "unknown": "pending"}


def register(app: typer.Typer) -> None:
    app.command("send", epilog=EPILOG)(send)


def send(
    topic: Annotated[str, typer.Argument(metavar="TOPIC", help="Topic to send to.", show_default=False)],
    body: Annotated[Optional[str], typer.Argument(metavar="BODY", help="Message body; '-' (or none with stdin piped) sends one message per stdin line.", show_default=False)] = None,
    tag: Annotated[Optional[str], typer.Option("--tag", "-t", help="The message's tag (TAGS).", show_default=False)] = None,
    key: Annotated[Optional[list[str]], typer.Option("--key", "-k", help="A key (KEYS); repeatable.", show_default=False)] = None,
    prop: Annotated[Optional[list[str]], typer.Option("--prop", "-p", help="A user property K=V; repeatable.", show_default=False)] = None,
    queue: Annotated[Optional[int], typer.Option("--queue", "-q", help="Queue id, 0 to 1023 [default: round robin].", show_default=False, min=0, max=1023)] = None,
    tx: Annotated[bool, typer.Option("--tx", help="Send a half (transactional) message, then end it with --state.", rich_help_panel="Transactions")] = False,
    group: Annotated[Optional[str], typer.Option("--group", "-g", help="Producer group (required with --tx).", show_default=False, rich_help_panel="Transactions")] = None,
    state: Annotated[Optional[TxState], typer.Option("--state", help="How to end the transaction [default: unknown = leave it pending].", show_default=False, rich_help_panel="Transactions")] = None,
    window: Annotated[int, typer.Option("--window", help="Messages in flight at once when reading stdin.", min=1, max=65536)] = 256,
    broker: BrokerOpt = DEFAULT_BROKER,
    token: TokenOpt = None,
    output: OutputOpt = None,
) -> None:
    """Send a message, or one message per line of stdin.

    Each line's result is printed (and flushed) as soon as the broker
    acknowledges it, so if the broker goes away the output is an exact record
    of what was stored.
    """
    if not TOPIC_RE.match(topic):
        raise CliError(f"invalid topic name {topic!r}: letters, digits, %, |, _ and - only, at most 127", exitcodes.USAGE)
    if is_system_topic(topic):
        raise CliError(f"{topic} is a system topic and cannot be sent to", exitcodes.USAGE)
    if tx and not group:
        raise CliError("--tx needs --group (the producer group that owns the transaction)", exitcodes.USAGE)
    if not tx and (state is not None or group is not None):
        raise CliError("--group and --state only apply with --tx", exitcodes.USAGE)
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
    if tx:
        props["TRAN_MSG"] = "true"
        props["PGROUP"] = group  # type: ignore[assignment]
    stream = body == "-" or (body is None and not sys.stdin.isatty())
    if body is None and not stream:
        raise CliError("no message body: give BODY, or pipe lines on stdin (BODY '-')", exitcodes.USAGE)
    spec = _Spec(topic, props, queue, group if tx else None, (state or TxState.unknown).value)
    out_fmt = resolve_output(output)
    if stream:
        st = _Tally(RowSink(out_fmt, table=_print_sent))
        try:
            run_interruptible(_send_stream(broker, token, spec, window, out_fmt, st))
        except KeyboardInterrupt:  # the summary line, as resolve and discard replay print it; exit 130
            st.sink.close()
            if st.line:
                err.print(f"[warn]{esc(st.stopped('interrupted'))}[/warn]")
            raise
        except BaseException:
            st.sink.abort()
            raise
    else:
        kv_table(run(_send_one(broker, token, spec, (body or "").encode())), out_fmt)


def _print_sent(row: dict[str, Any]) -> None:
    extra = (f"tx_id={esc(row['tx_id'])} half_offset={row['half_offset']} state={row['state']}"
             if "tx_id" in row else f"queue_offset={row['queue_offset']}")
    out.print(f"[ok]sent[/ok] line {row['line']}: msg_id={esc(row['msg_id'])} queue_id={row['queue_id']} {extra}")


class _Tally:
    """What `send` of stdin lines did so far, for its summary line (also after Ctrl-C)."""

    def __init__(self, sink: RowSink) -> None:
        self.sent = 0
        self.failed = 0
        self.line = 0  # the last input line read
        self.sink = sink  # each line's result, as it comes
        self.unconfirmed = 0  # lines in flight when it stopped

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

    def fields(self, body: bytes) -> dict[str, Any]:
        f: dict[str, Any] = {"topic": self.topic, "body": body, "born_ts": time.time_ns() // 1_000_000}
        if self.props:
            f["properties"] = dict(self.props)
        if self.queue is not None:
            f["queue_id"] = self.queue
        return f


async def _deliver(client: Any, spec: _Spec, body: bytes, end_queued: Any = None) -> dict[str, Any]:
    """Send one message; with --tx, end it too. ``end_queued`` is called once the end request is queued
    (pipelined: the caller may start the next line while the end's reply is on its way)."""
    r = await client.request("send", spec.fields(body))
    if spec.group is None:
        return {"msg_id": r["msg_id"], "topic": r["topic"], "queue_id": r["queue_id"],
                "queue_offset": r["queue_offset"], "commit_log_offset": r["commit_log_offset"]}
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


async def _send_one(broker: str, token: str | None, spec: _Spec, body: bytes) -> dict[str, Any]:
    from ..client_ops import connect

    async with connect(broker, token) as client:
        return await _deliver(client, spec, body)


async def _send_stream(broker: str, token: str | None, spec: _Spec, window: int, out_fmt: Output, st: _Tally) -> None:
    import asyncio

    from ..client_ops import cli_error, connect, exit_code_of

    failures: list[tuple[int, BaseException]] = []
    sent = 0
    lost: list[BaseException] = []
    closed: list[int] = []

    show = st.sink.add

    async with connect(broker, token) as client:
        sem = asyncio.Semaphore(window)
        ends = asyncio.Semaphore(window)  # --tx: ends whose reply is awaited after their line's slot was freed
        tasks: set[asyncio.Task[None]] = set()

        async def one(line_no: int, body: bytes) -> None:
            nonlocal sent
            freed = False
            end_slot = False

            def end_queued() -> None:
                # The half is acknowledged and its end queued: the next line may go (its half shares
                # the broker's group-commit fsync with this end); at most `window` such ends wait.
                nonlocal freed
                freed = True
                sem.release()

            try:
                if spec.group is not None and spec.state != "unknown":
                    await ends.acquire()
                    end_slot = True
                row = await _deliver(client, spec, body, end_queued if end_slot else None)
            except asyncio.CancelledError:  # Ctrl-C: in flight, answer unknown
                st.unconfirmed += 1
                raise
            except Exception as exc:
                if exit_code_of(exc) == exitcodes.UNREACHABLE:
                    lost.append(exc)  # reported once, at the end
                else:
                    failures.append((line_no, exc))
                    st.failed += 1
                    err.print(f"[err]error:[/err] line {line_no}: {esc(_msg(exc))}")
            else:
                sent += 1
                st.sent = sent
                try:
                    show({"line": line_no, **row})
                except BrokenPipeError:  # the reader went away (`| head`): stop sending
                    closed.append(line_no)
            finally:
                if not freed:
                    sem.release()
                if end_slot:
                    ends.release()

        line_no = 0
        try:
            async for line in _stdin_lines():
                line_no += 1
                st.line = line_no
                if not line.strip():
                    continue
                await sem.acquire()
                if lost or closed:
                    sem.release()
                    break
                t = asyncio.get_running_loop().create_task(one(line_no, line))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
        except asyncio.CancelledError:  # Ctrl-C: the lines in flight end as unconfirmed, before the connection closes
            flying = list(tasks)
            for t in flying:
                t.cancel()
            if flying:
                await asyncio.wait(flying)
            raise
    if closed:
        raise BrokenPipeError  # main() exits quietly
    st.sink.close()
    if line_no:  # the one-line summary of a bulk run (docs/cli.md, "Summary of a bulk run")
        if lost:
            err.print(f"[warn]stopped (broker lost): {sent} sent, {len(failures)} failed, input read up to line {line_no}; "
                      f"to resume, resend the lines with no printed result and those after line {line_no}[/warn]")
        else:
            err.print(f"{sent} sent, {len(failures)} failed, 0 not attempted")
    if lost:
        raise CliError(f"{cli_error(lost[0], broker).message}; {sent} message(s) were acknowledged (printed above), "
                       f"the rest were not sent or not acknowledged", exitcodes.UNREACHABLE)
    if failures:
        raise CliError(f"{len(failures)} of {len(failures) + sent} message(s) failed", exitcodes.PARTIAL)
    if line_no == 0:
        err.print("[dim]no input lines: nothing sent[/dim]")


def _msg(exc: BaseException) -> str:
    from rich.markup import escape

    return escape(getattr(exc, "message", None) or str(exc) or type(exc).__name__)


async def _stdin_lines():
    """Lines of stdin (bytes, without the newline) read by a thread, in chunks as they arrive."""
    import asyncio
    import threading

    loop = asyncio.get_running_loop()
    q: asyncio.Queue[list[bytes] | None] = asyncio.Queue(maxsize=16)
    fd = sys.stdin.fileno()

    def put(item: list[bytes] | None) -> bool:
        try:
            asyncio.run_coroutine_threadsafe(q.put(item), loop).result()
            return True
        except (RuntimeError, Exception):  # the loop is gone: the command ended early
            return False

    def reader() -> None:
        buf = b""
        try:
            while True:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                buf += chunk
                *lines, buf = buf.split(b"\n")
                if lines and not put([ln[:-1] if ln.endswith(b"\r") else ln for ln in lines]):
                    return
            if buf:
                put([buf[:-1] if buf.endswith(b"\r") else buf])
        except OSError:
            pass
        finally:
            put(None)

    threading.Thread(target=reader, name="txmq-stdin", daemon=True).start()
    while True:
        batch = await q.get()
        if batch is None:
            return
        for line in batch:
            yield line
