"""txmq migrate --to NAMESRV: move a broker's backlog, consumer positions and schedule onto a RocketMQ 4 cluster.

docs/migrate.md is the runbook. The work is txmq.client.migrate (plan, state, mover); this module is the command:
options, the plan's and the summary's rendering, the progress bars and events, the exit codes.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from .. import exitcodes
from ..common import DEFAULT_BROKER, BrokerOpt, CliError, OutputOpt, TokenOpt, parse_duration

EPILOG = """Examples:

  txmq migrate --to 10.0.0.5:9876 --dry-run          # the plan: topics, backlog per group, schedule, pending, target

  txmq migrate --to 10.0.0.5:9876                    # move the backlog and the offsets; scheduled by delay level

  txmq migrate --to 10.0.0.5:9876 --follow --until-idle 5m   # then keep forwarding until txmq is quiet

Stop the consumers on txmq first (their groups' positions are what the migration carries over). Progress is kept
in the state file (--state; the plan prints where): running the same command again continues, and never sends a
message the target confirmed again. Exit codes: 0 done; 2 bad input; 3 txmq or the target unreachable, or gone for
longer than --retry-for mid-way (progress kept); 4 txmq refused the token; 6 the target or txmq is not ready for it
(a topic with fewer queues on the target, live consumers on txmq, a state file of another migration); 7 stopped with
work left (pending transactions: nothing moved; scheduled messages past the target's delay levels); 12 not a txmq
broker / not a RocketMQ name server; 130 interrupted (progress kept). See docs/migrate.md."""

ToOpt = Annotated[str, typer.Option("--to", help="The target's name server(s), HOST:PORT[;HOST:PORT].", show_default=False)]


def register(app: typer.Typer) -> None:
    app.command("migrate", epilog=EPILOG)(migrate)


def migrate(
    to: ToOpt,
    dry_run: Annotated[bool, typer.Option("--dry-run", "-n", help="Print the plan; change nothing.")] = False,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="After the backlog, keep forwarding what arrives on txmq (scheduled "
                                         "messages as they come due, later commits, producers not yet switched).")] = False,
    until_idle: Annotated[Optional[str], typer.Option("--until-idle", help="With --follow: stop once nothing arrived for this "
                                                      "long (e.g. 5m) [default: until Ctrl-C].", show_default=False)] = None,
    wait_pending: Annotated[str, typer.Option("--wait-pending", help="How long to wait for pending transactions to be decided "
                                              "before stopping (without --follow).")] = "0s",
    state: Annotated[Optional[Path], typer.Option("--state", help="The progress file [default: <data dir>.migrate.json beside the "
                                                  "broker's data directory when it is on this machine, else txmq-migrate-<address>.json "
                                                  "here].", show_default=False)] = None,
    target_broker: Annotated[Optional[str], typer.Option("--target-broker", help="The target broker topics are created on "
                                                         "[default: the first by name].", show_default=False)] = None,
    batch: Annotated[int, typer.Option("--batch", help="Messages per batch send.", min=1, max=10_000)] = 512,
    force: Annotated[bool, typer.Option("--force", help="Go on although groups have live consumers on txmq.")] = False,
    dead_letters: Annotated[bool, typer.Option("--dead-letters/--no-dead-letters", help="Copy the groups' dead-letter topics "
                                               "(%DLQ%<group>) whole.")] = True,
    retry_for: Annotated[str, typer.Option("--retry-for", help="How long txmq or the target may stay unreachable before the run "
                                           "stops (exit 3, progress kept).")] = "60s",
    broker: BrokerOpt = DEFAULT_BROKER,
    token: TokenOpt = None,
    output: OutputOpt = None,
) -> None:
    """Move this broker's backlog, consumer positions and schedule onto a RocketMQ 4 cluster."""
    from ..common import parse_address, run_interruptible
    from ..console import resolve_output

    parse_address(broker)
    idle = parse_duration(until_idle) if until_idle is not None else None
    if idle is not None and not follow:
        raise CliError("--until-idle goes with --follow", exitcodes.USAGE)
    wait = parse_duration(wait_pending)
    retry = parse_duration(retry_for)
    try:
        from txmq.client.rocketmq4 import split_address

        for a in to.split(";"):
            split_address(a)
    except ValueError as exc:
        raise CliError(str(exc), exitcodes.USAGE) from None
    out_fmt = resolve_output(output)
    view = _View(out_fmt)
    try:
        code = run_interruptible(_main(to, dry_run, follow, idle, wait, state, target_broker, batch, force, broker, token, view, retry,
                                       dead_letters), grace=5.0)
    except KeyboardInterrupt:
        view.close()
        raise CliError(f"interrupted: progress kept in {view.state_path or 'the state file'}; run the same command to go on",
                       exitcodes.INTERRUPTED) from None
    view.close()
    if code:
        raise typer.Exit(code)


async def _main(to: str, dry_run: bool, follow: bool, idle: float | None, wait: float, state_path: Path | None,
                target_broker: str | None, batch: int, force: bool, address: str, token: str | None, view: "_View",
                retry: float = 60.0, dead_letters: bool = True) -> int:
    import asyncio

    from txmq.client.connection import Client
    from txmq.client.migrate import plan as planner
    from txmq.client.migrate.mover import MigrationError, Mover
    from txmq.client.migrate.state import State, StateError
    from txmq.client.rocketmq4 import NotRocketMQ, RemotingError, RocketMQ4, TargetUnreachable, delay_levels
    from txmq.wire import TxmqError

    from ..client_ops import cli_error

    # txmq going away mid-way (restarted, or SIGKILLed): requests wait up to `retry` for it to come back, then the run
    # stops with exit 3; what the target confirmed is in the state file, and running the same command goes on from it
    source = Client(address, token=token or None, reconnect=True, reconnect_wait=retry, connect_timeout=5.0,
                    request_timeout=max(60.0, retry + 30.0))
    target = RocketMQ4(to)
    client_log = _ClientLog(view)
    logging.getLogger("txmq.client").addHandler(client_log)
    try:
        try:
            await source.start()
        except (TxmqError, TimeoutError) as e:
            raise cli_error(e, address, bool(token)) from None
        info = await source.request("broker_info", {})
        broker_id = info.get("data_dir") or address  # the broker's id changes at each start; its data directory does not
        path = state_path or _default_state(info.get("data_dir") or "", address)
        view.state_path = path
        try:
            st = State.load(path)
        except StateError as exc:
            raise CliError(str(exc), exitcodes.CONFLICT) from None
        if st is not None and not dry_run and (st.data["source"].get("broker_id") != broker_id or st.data["target"] != to):
            raise CliError(f"the state file {path} belongs to another migration (from broker {st.data['source'].get('broker_id')} to "
                           f"{st.data['target']}): pass another --state, or move it away to start over", exitcodes.CONFLICT)

        async def make_plan() -> dict[str, Any]:
            src = await planner.read_source(source)
            tgt = await planner.read_target(target, sorted(src["topics"]), target_broker)
            return planner.build(src, tgt, to, address, follow, dead_letters=dead_letters)

        try:
            if st is None or dry_run:
                plan = await make_plan()
                if not follow and plan["pending"] and not dry_run and wait > 0:
                    deadline = time.monotonic() + wait
                    view.note(f"{len(plan['pending'])} pending transaction(s): waiting up to {wait:g} s for them to be decided")
                    while time.monotonic() < deadline and (await source.request("tx_pending", {"limit": 1}))["total"]:
                        await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
                    plan = await make_plan()
            else:
                plan = st.data["plan"]
                view.note(f"resuming from {path} (plan of {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(plan['made_at_ms'] / 1000))})")
        except TargetUnreachable as exc:
            raise CliError(f"target unreachable: {exc}", exitcodes.UNREACHABLE) from None
        except NotRocketMQ as exc:
            raise CliError(f"not a RocketMQ name server at {to}: {exc}", exitcodes.NOT_TXMQ) from None
        except RemotingError as exc:
            raise CliError(f"the target refused: {exc}", exitcodes.ERROR) from None
        except ValueError as exc:
            raise CliError(str(exc), exitcodes.USAGE) from None
        except (TxmqError, TimeoutError) as e:
            raise cli_error(e, address, bool(token)) from None
        view.plan(plan, path, resumed=st is not None and not dry_run)
        if dry_run:
            view.document({"plan": plan, "state_file": str(path)})
            return exitcodes.OK
        if st is None:
            blocking = [p for p in plan["problems"] if "fewer than" in p or "no broker" in p or ("live consumer" in p and not force)]
            if blocking:
                raise CliError(blocking[0] + (f" (and {len(blocking) - 1} more problem(s) above)" if len(blocking) > 1 else ""),
                               exitcodes.CONFLICT)
            if plan["pending"] and not follow:
                view.pending(plan["pending"])
                view.document({"plan": plan, "state_file": str(path), "stopped": "pending_transactions"})
                return exitcodes.PARTIAL
            st = State.new(path, {"broker_id": broker_id, "address": address}, to, plan)
            st.save()
        st.data["runs"] = st.data.get("runs", 0) + 1
        stop = asyncio.Event()
        mover = Mover(source, target, st, batch_count=batch, on_event=view.event, stop=stop, retry_for=retry)
        view.start_progress(plan, st)
        scheduled: dict[str, Any] = {"moved": 0, "left": [], "gone": []}
        stopped_by_user = False
        try:
            await mover.create_topics()
            await mover.copy()
            if not st.data["offsets_committed"]:
                await mover.commit_offsets()
            if not follow:
                scheduled = await mover.move_scheduled(delay_levels({"messageDelayLevel": " ".join(f"{s:g}s" for s in plan["target"]["delay_levels_s"])}))
            else:
                view.note("backlog moved and offsets committed: switch producers and consumers to the target now; forwarding "
                          + (f"until idle for {idle:g} s" if idle else "until Ctrl-C"))
                quiet_since = time.monotonic()
                try:
                    while True:
                        if await mover.copy(follow=True):
                            quiet_since = time.monotonic()
                        elif idle is not None and time.monotonic() - quiet_since >= idle:
                            break
                        await asyncio.sleep(0.2)
                except asyncio.CancelledError:
                    stopped_by_user = True
        except MigrationError as exc:
            st.save()
            raise CliError(f"stopped: {exc}; progress kept in {path}, run the same command to go on", exitcodes.UNREACHABLE) from None
        except TargetUnreachable as exc:
            st.save()
            raise CliError(f"target unreachable: {exc}; progress kept in {path}", exitcodes.UNREACHABLE) from None
        except (TxmqError, TimeoutError) as e:
            st.save()
            err = cli_error(e, address, bool(token))
            raise CliError(f"{err.message}; progress kept in {path}, run the same command to go on", err.code) from None
        pending_now = [] if not follow else await planner.read_pending(source)
        summary = {"state_file": str(path), **mover.totals(), "per_group": mover.per_group(),
                   "offsets": st.data.get("committed", []), "scheduled_moved": len(st.data["scheduled"]["moved"]),
                   "scheduled_left": scheduled["left"], "scheduled_gone": scheduled["gone"], "pending_left": len(pending_now),
                   "followed": follow, "runs": st.data["runs"]}
        st.data["summary"] = summary
        st.save()
        view.summary(summary, plan)
        if stopped_by_user:  # Ctrl-C is how forwarding ends
            return exitcodes.OK
        return exitcodes.PARTIAL if scheduled["left"] else exitcodes.OK
    finally:
        logging.getLogger("txmq.client").removeHandler(client_log)
        await target.close()
        await source.close()


class _ClientLog(logging.Handler):
    """What txmq's client says while it reconnects: a ``retrying`` event with -o jsonl, else nothing, so that a txmq
    that does not come back ends the run with its one error line (and not Python's bare log lines before it)."""

    def __init__(self, view: "_View") -> None:
        super().__init__(logging.WARNING)
        self.view = view

    def emit(self, record: logging.LogRecord) -> None:
        if self.view.jsonl:
            self.view.event({"event": "retrying", "ts_ms": int(record.created * 1000), "what": "txmq", "reason": record.getMessage()})


def _default_state(data_dir: str, address: str) -> Path:
    """Beside the broker's data directory when it is on this machine (``<data dir>.migrate.json``), else in the
    current folder, named after the broker's address."""
    import os
    import re

    d = Path(data_dir) if data_dir else None
    if d is not None and d.is_dir() and os.access(d.parent, os.W_OK):
        return d.parent / (d.name + ".migrate.json")
    return Path("txmq-migrate-" + re.sub(r"[^A-Za-z0-9_.-]", "_", address) + ".json")


class _View:
    """What the operator sees: tables and progress bars on a terminal, one JSON document with -o json, events with -o jsonl."""

    def __init__(self, output: Any) -> None:
        from ..console import Output, interactive

        self.output = output
        self.jsonl = output is Output.jsonl
        self.json = output is Output.json
        self.progress: Any = None
        self.tasks: dict[str, Any] = {}
        self.state_path: Path | None = None
        self.live = interactive() and output is Output.table
        self.base: dict[str, int] = {}

    def note(self, text: str) -> None:
        from ..console import emit_line, note

        if self.jsonl:
            emit_line({"event": "note", "message": text})
        else:
            note(text)

    def event(self, e: dict[str, Any]) -> None:
        from ..console import emit_line

        if self.jsonl:
            emit_line(e)
        if self.progress is not None and e["event"] == "progress":
            for topic, n in e["moved"].items():
                task = self.tasks.get(topic)
                if task is not None:
                    self.progress.update(task, completed=self.base.get(topic, 0) + n)

    def plan(self, plan: dict[str, Any], path: Path, resumed: bool) -> None:
        from ..console import emit_line, err, fmt_ts, new_table, print_table

        if self.jsonl:
            emit_line({"event": "plan", "state_file": str(path), **plan})
            return
        if self.json:
            return
        t = new_table("Topics")
        for c in ("topic", "queues", "types", "target", "backlog", "consumed by"):
            t.add_column(c)
        kinds = {"retry": "retries of ", "dlq": "dead letters of "}
        for r in plan["topics"]:
            target = {"create": "create", "created": "created", "exists": f"exists ({r['target_queues']} queues)",
                      "too_few_queues": f"ONLY {r['target_queues']} QUEUES"}.get(r["action"], r["action"])
            kind = r.get("kind", "topic")
            types = ",".join(r["message_types"] or []) if kind == "topic" else kinds[kind] + r["topic"].split("%", 2)[2]
            t.add_row(r["topic"], str(r["queues"]), types, f"{target} on {r['broker']}", str(r["backlog"]), ", ".join(r["consumed_by"]) or "-")
        print_table(t)
        g = new_table("Consumer groups (backlog: messages not consumed)")
        for c in ("group", "topic", "backlog", "live consumers"):
            g.add_column(c)
        for r in plan["groups"]:
            for topic, v in sorted(r["topics"].items()) or [("-", {"backlog": 0})]:
                g.add_row(r["group"], topic, str(v["backlog"]), str(r["consumers"]))
        print_table(g)
        if plan["scheduled"]:
            s = new_table(f"Scheduled messages ({len(plan['scheduled'])})")
            for c in ("msg_id", "topic", "due", "delay level", "late by"):
                s.add_column(c)
            for r in plan["scheduled"][:50]:
                level = "follow" if plan["follow"] else ("past the last level" if r["level"] is None else str(r["level"]))
                s.add_row(r["msg_id"], r["topic"], fmt_ts(r["deliver_at_ms"]), level, f"{r['late_ms'] / 1000:.1f} s")
            print_table(s)
        tg = plan["target"]
        err.print(f"target {tg['namesrv']}: brokers " + ", ".join(f"{b['name']} ({b['cluster']}) {b['addresses'].get('0', '-')}"
                                                                for b in tg["brokers"]) + f"; topics go to {tg['broker']}")
        totals = plan["totals"]
        err.print(f"retries waiting: {totals.get('retries', 0)} (and {totals.get('scheduled_retries', 0)} scheduled); dead letters: "
                  f"{totals.get('dead_letters', 0)}" + ("" if plan.get("dead_letters", True) else " (not moved: --no-dead-letters)"))
        err.print(f"pending transactions: {len(plan['pending'])}; state file: {path}")
        for n in plan["not_moved"]:
            err.print(f"[warn]not moved:[/warn] {n['what']}: {n['why']}")
        for p in plan["problems"]:
            err.print(f"[warn]problem:[/warn] {p}")

    def pending(self, rows: list[dict[str, Any]]) -> None:
        from ..console import emit_line, err

        for r in rows:  # on stderr whatever the output: the operator acts on it
            if self.jsonl:
                emit_line({"event": "pending", **r, "resolve": [f"txmq resolve --commit {r['tx_id']}", f"txmq resolve --rollback {r['tx_id']}"]})
            err.print(f"pending transaction {r['tx_id']} (group {r['group']}, topic {r['topic']}, {r.get('age_s') or 0:.0f} s old): "
                      f"decide it with `txmq resolve --commit {r['tx_id']}` or `txmq resolve --rollback {r['tx_id']}`", markup=False)
        err.print(f"[warn]stopped: {len(rows)} pending transaction(s) on txmq; nothing was moved.[/warn] Let their producers decide them "
                      "(or --wait-pending 5m), resolve them as above, or run with --follow to move them once committed.")

    def start_progress(self, plan: dict[str, Any], st: Any) -> None:
        if not self.live:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

        from ..console import err

        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TransferSpeedColumn(),
                                 TimeRemainingColumn(), console=err, transient=False)
        for t in plan["topics"]:
            done = sum(e - s for k, qs in st.data["queues"].items() if k.rsplit("/", 1)[0] == t["topic"] for s, e, _t in qs["runs"])
            self.base[t["topic"]] = done
            self.tasks[t["topic"]] = self.progress.add_task(t["topic"], total=max(t["backlog"], done), completed=done)
        self.progress.start()

    def summary(self, s: dict[str, Any], plan: dict[str, Any]) -> None:
        from ..console import emit_line, err

        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        if self.jsonl:
            emit_line({"event": "summary", **s})
            return
        if self.json:
            self.document({"plan": plan, "summary": s})
            return
        err.print("[ok]migration done[/ok]" + (" (forwarding stopped)" if s["followed"] else ""))
        for topic, n in sorted(s["copied_per_topic"].items()):
            err.print(f"  {topic}: {n} message(s) on the target")
        for g, per in sorted(s["per_group"].items()):
            err.print(f"  group {g}: " + ", ".join(f"{t} {n}" for t, n in sorted(per.items())) + " to consume on the target")
        err.print(f"  consumed by every group, not copied: {s['consumed_not_copied']}; scheduled moved: {s['scheduled_moved']}; "
                  f"pending left: {s['pending_left']}; duplicates possible: {s['duplicates_possible']}")
        for m in s["scheduled_left"]:
            err.print(f"[warn]  scheduled message {m['msg_id']} ({m['topic']}) not moved: {m['why']}[/warn]")
        err.print(f"  state: {s['state_file']}")

    def document(self, doc: dict[str, Any]) -> None:
        from ..console import emit_json

        if self.json:
            emit_json(doc)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
