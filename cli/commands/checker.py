"""txmq checker: answer the check-backs of a producer group, always the same way or through a command."""

import json
import time
from enum import Enum
from typing import Annotated, Any, Optional

import typer

from .. import exitcodes
from ..common import DEFAULT_BROKER, BrokerOpt, CliError, OutputOpt, TokenOpt, parse_duration, run, stop_event
from ..console import Output, RowSink, err, esc, note, out, resolve_output, to_jsonable, warn
from ._bulk import ref_argument

EPILOG = """Examples:

  txmq checker --group shop --answer rollback          # drain the transactions of an app that is gone

  txmq checker --group shop --answer commit --now --idle-exit 5s

  txmq checker --group shop --exec './is-order-paid.sh'   # message JSON on stdin; prints commit|rollback|unknown

  txmq checker --group shop --exec 'grep -qx "$TXMQ_TX_ID" paid.txt && echo commit || echo rollback'

One line per check answered; keys: tx_id, group, topic, queue_id, half_offset, commit_log_offset,
checks, answer (commit | rollback | unknown), status (ok | already | noop | conflict | not_found | error),
outcome (committed | rolled_back | pending | null), message, event (checked).
A transaction answered unknown that the broker later discards (max checks reached) gets one more line:
event discarded, status and outcome discarded, answer unknown (the checker asks the broker every few
seconds about the transactions it answered unknown, at most 10000 of them).
--exec gets the message as JSON on stdin (the consume keys plus group, half_offset and checks) and
TXMQ_TX_ID, TXMQ_GROUP, TXMQ_TOPIC in its environment; any other output than commit, rollback or
unknown, a non-zero exit or a timeout answers unknown, with a warning."""


FOLLOW_INTERVAL_S = 2.0  # how often the outcomes of transactions answered unknown are asked for
FOLLOW_MAX = 10_000  # transactions answered unknown followed at once (the oldest are let go)


class Answer(str, Enum):
    commit = "commit"
    rollback = "rollback"
    unknown = "unknown"


_ALIASES = {"commit": "commit", "commit_message": "commit", "rollback": "rollback", "rollback_message": "rollback",
            "unknown": "unknown", "unknow": "unknown"}


def register(app: typer.Typer) -> None:
    app.command("checker", epilog=EPILOG)(checker)


def checker(
    group: Annotated[str, typer.Option("--group", "-g", help="The producer group whose check-backs to answer.", show_default=False)],
    answer: Annotated[Optional[Answer], typer.Option("--answer", "-a", help="Answer every check-back this way.", show_default=False)] = None,
    exec_: Annotated[Optional[str], typer.Option("--exec", "-e", help="Run this shell command per check-back; it reads the message JSON on stdin and prints commit, rollback or unknown.", show_default=False)] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", "-l", help="Exit after answering this many check-backs.", show_default=False, min=1)] = None,
    idle_exit: Annotated[Optional[str], typer.Option("--idle-exit", help="Exit after this long without a check-back (e.g. 10s).", show_default=False)] = None,
    now: Annotated[bool, typer.Option("--now", help="Ask the broker to check every pending transaction of the group at once, instead of waiting for its next pass.")] = False,
    exec_timeout: Annotated[str, typer.Option("--exec-timeout", help="How long --exec may run before the answer is unknown.")] = "30s",
    broker: BrokerOpt = DEFAULT_BROKER,
    token: TokenOpt = None,
    output: OutputOpt = None,
) -> None:
    """Stay connected as a producer of --group and answer its check-backs.

    Runs until SIGINT/SIGTERM, --limit answers, or --idle-exit without one.
    """
    if (answer is None) == (exec_ is None):
        raise CliError("give exactly one of --answer or --exec", exitcodes.USAGE)
    idle_s = parse_duration(idle_exit) if idle_exit is not None else None
    timeout_s = parse_duration(exec_timeout)
    out_fmt = resolve_output(output)
    _quiet_client_logs()
    run(_Checker(group, answer.value if answer else None, exec_, limit, idle_s, timeout_s, now, out_fmt).run(broker, token))


class _Checker:
    def __init__(self, group: str, answer: str | None, cmd: str | None, limit: int | None, idle_s: float | None,
                 exec_timeout_s: float, now: bool, out_fmt: Output) -> None:
        self.group, self.answer, self.cmd, self.limit = group, answer, cmd, limit
        self.idle_s, self.exec_timeout_s, self.now, self.out_fmt = idle_s, exec_timeout_s, now, out_fmt
        self.sink = RowSink(out_fmt, table=_print_check)  # each check answered, as it comes
        self.answered = 0
        # transactions answered unknown and still pending, followed until decided: tx id -> its check line
        self.unknown: dict[str, dict[str, Any]] = {}
        self.follow = True

    async def run(self, broker: str, token: str | None) -> None:
        import asyncio

        from ..client_ops import connect

        pushes: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

        def on_push(op: str, fields: dict[str, Any]) -> None:
            if op == "check_transaction":
                pushes.put_nowait(fields)

        stop = stop_event()
        with self.sink:
            async with connect(broker, token, producer_groups=(self.group,), reconnect=True, push_handler=on_push) as client:
                how = f"answering {self.answer}" if self.answer else f"running {self.cmd!r}"
                note(f"checker for group {self.group} on {broker}: {how}; Ctrl-C to stop")
                if self.now:
                    await self._check_now(client)
                follower = asyncio.ensure_future(self._follow_loop(client))
                try:
                    why = await self._loop(client, pushes, stop)
                finally:
                    follower.cancel()
                await self._follow_unknown(client)
        note(f"checker stopped ({why}): {self.answered} check-back(s) answered")

    async def _loop(self, client: Any, pushes: Any, stop: Any) -> str:
        import asyncio

        last = time.monotonic()
        stop_wait = asyncio.ensure_future(stop.wait())
        try:
            while True:
                if self.limit is not None and self.answered >= self.limit:
                    return "limit reached"
                timeout = None
                if self.idle_s is not None:
                    timeout = max(0.0, last + self.idle_s - time.monotonic())
                get = asyncio.ensure_future(pushes.get())
                done, _ = await asyncio.wait({get, stop_wait}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    return "signal" if stop_wait in done else "idle"
                await self._answer(client, get.result())
                last = time.monotonic()
                if stop.is_set():
                    return "signal"
        finally:
            stop_wait.cancel()

    async def _follow_loop(self, client: Any) -> None:
        import asyncio

        while True:
            await asyncio.sleep(FOLLOW_INTERVAL_S)
            await self._follow_unknown(client)

    async def _follow_unknown(self, client: Any) -> None:
        """Ask the broker what became of the transactions answered unknown; a line for each one discarded."""
        import asyncio

        from txmq.wire import ErrorCode, TxmqError

        ids = list(self.unknown)
        for i in range(0, len(ids), 256):
            if not self.follow:
                return
            chunk = ids[i:i + 256]
            got = await asyncio.gather(*(client.request("tx_history", {"tx_id": t, "summary": True}) for t in chunk),
                                       return_exceptions=True)
            for tx_id, r in zip(chunk, got):
                if isinstance(r, TxmqError):
                    if r.code is ErrorCode.UNKNOWN_OPERATION:
                        if self.follow:
                            warn("the broker runs an older txmq (no tx_history): discards of transactions answered "
                                 "unknown are not reported; see `txmq discard list`")
                        self.follow = False
                        self.unknown.clear()
                        return
                    if r.code is ErrorCode.TX_NOT_FOUND:
                        self.unknown.pop(tx_id, None)
                    continue
                if isinstance(r, BaseException):
                    return  # connection lost (reconnecting): try again next time
                if r.get("state") == "pending":
                    continue
                row = self.unknown.pop(tx_id, None)
                if row is not None and r.get("state") == "discarded":
                    self._show({**row, "event": "discarded", "checks": r.get("checks", row["checks"]), "answer": "unknown",
                                "status": "discarded", "outcome": "discarded",
                                "message": f"discarded by the broker ({r.get('decided_by')}) after {r.get('checks')} check(s); "
                                           f"`txmq discard replay {ref_argument(tx_id)}` puts it back"})

    async def _check_now(self, client: Any) -> None:
        from txmq.wire import TxmqError

        rows = (await client.request("tx_pending", {"group": self.group, "limit": 10_000_000}))["transactions"]
        sent = 0
        for r in rows:
            try:
                await client.request("tx_check_now", {"tx_id": r["tx_id"]})
                sent += 1
            except TxmqError as e:
                warn(f"check of {r['tx_id']} not sent: {e.message}")
        note(f"asked for check-backs of {sent} pending transaction(s) of {self.group}")

    async def _answer(self, client: Any, push: dict[str, Any]) -> None:
        from txmq.client.message import ReceivedMessage
        from txmq.wire import TxmqError

        from ._messages import message_row

        msg = ReceivedMessage.from_map(push["message"])
        row: dict[str, Any] = {
            "tx_id": push["tx_id"], "group": push.get("group", self.group), "topic": msg.topic, "queue_id": msg.queue_id,
            "half_offset": push["half_offset"], "commit_log_offset": push["commit_log_offset"], "checks": msg.check_times,
        }
        if self.answer is not None:
            state = self.answer
        else:
            doc = {**message_row(msg), "group": row["group"], "half_offset": row["half_offset"],
                   "commit_log_offset": row["commit_log_offset"], "checks": row["checks"]}
            state = await self._run_exec(doc)
        row["answer"] = state
        try:
            r = await client.request("end_transaction", {
                "group": self.group, "tx_id": push["tx_id"], "commit_log_offset": push["commit_log_offset"],
                "half_offset": push["half_offset"], "state": state, "from_check": True,
            })
            row.update(status=r.get("status", "ok"), outcome=r.get("outcome"), message="")
        except TxmqError as e:
            status = {20: "not_found", 24: "conflict"}.get(int(e.code), "error")
            row.update(status=status, outcome=e.fields.get("outcome"), message=e.message)
            warn(f"answer to the check of {push['tx_id']} refused: {e.message}")
        self.answered += 1
        row["event"] = "checked"
        if self.follow and state == "unknown" and row.get("outcome") == "pending":
            self.unknown.pop(row["tx_id"], None)
            self.unknown[row["tx_id"]] = row
            if len(self.unknown) > FOLLOW_MAX:
                del self.unknown[next(iter(self.unknown))]
        else:
            self.unknown.pop(row["tx_id"], None)
        self._show(row)

    async def _run_exec(self, doc: dict[str, Any]) -> str:
        import asyncio
        import os

        assert self.cmd is not None
        env = {**os.environ, "TXMQ_TX_ID": str(doc.get("tx_id") or ""), "TXMQ_GROUP": self.group, "TXMQ_TOPIC": doc["topic"]}
        tx = doc.get("tx_id")
        try:
            proc = await asyncio.create_subprocess_shell(self.cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env)
        except OSError as e:
            warn(f"--exec could not start ({e}); answering unknown for {tx}")
            return "unknown"
        data = json.dumps(to_jsonable(doc), separators=(",", ":"), ensure_ascii=False).encode() + b"\n"

        async def feed() -> None:
            # A command may exit without reading stdin: then the write fails
            # (BrokenPipeError, or RuntimeError from uvloop's closed pipe); that is fine.
            assert proc.stdin is not None
            try:
                proc.stdin.write(data)
                await proc.stdin.drain()
            except (BrokenPipeError, ConnectionResetError, RuntimeError):
                pass
            finally:
                try:
                    proc.stdin.close()
                except (BrokenPipeError, ConnectionResetError, RuntimeError):
                    pass

        async def talk() -> bytes:
            assert proc.stdout is not None
            _, out, _ = await asyncio.gather(feed(), proc.stdout.read(), proc.wait())
            return out

        try:
            stdout = await asyncio.wait_for(talk(), self.exec_timeout_s)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            warn(f"--exec took longer than {self.exec_timeout_s:g}s; answering unknown for {tx}")
            return "unknown"
        text = stdout.decode("utf-8", "replace").strip()
        word = text.split()[0].lower() if text else ""
        if proc.returncode != 0:
            warn(f"--exec exited with status {proc.returncode}; answering unknown for {tx}")
            return "unknown"
        state = _ALIASES.get(word)
        if state is None or len(text.split()) > 1:
            warn(f"--exec printed {text[:80]!r}, not commit, rollback or unknown; answering unknown for {tx}")
            return "unknown"
        return state

    def _show(self, row: dict[str, Any]) -> None:
        self.sink.add(row)


def _print_check(row: dict[str, Any]) -> None:
    if row.get("event") == "discarded":
        out.print(f"[warn]discarded[/warn] {esc(row['tx_id'])} [dim]{esc(row['topic'])} checks={row['checks']}[/dim]: {esc(row['message'])}")
    else:
        colour = {"commit": "ok", "rollback": "warn"}.get(row["answer"], "dim")
        out.print(f"checked {esc(row['tx_id'])} [dim]{esc(row['topic'])} half_offset={row['half_offset']} checks={row['checks']}[/dim] "
                  f"-> [{colour}]{esc(row['answer'])}[/{colour}] ({esc(row['outcome'] or row['status'])})")


def _quiet_client_logs() -> None:
    """The client logs reconnects; show them as one-line warnings on stderr."""
    import logging

    class _ToStderr(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            try:
                from rich.markup import escape

                err.print(f"[warn]{record.levelname.lower()}:[/warn] {escape(record.getMessage())}")
            except Exception:
                pass

    log = logging.getLogger("txmq.client")
    log.handlers[:] = [_ToStderr(level=logging.WARNING)]
    log.propagate = False
