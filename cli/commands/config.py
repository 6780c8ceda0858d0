"""txmq config get|set: the check settings, changed while the broker runs (persisted in config.json)."""

import re
from typing import Annotated, Any, Optional

import typer

from .. import exitcodes
from ..common import DEFAULT_BROKER, BrokerOpt, CliError, choices, did_you_mean, OutputOpt, TokenOpt, parse_duration
from ..console import emit_document, fmt_duration, fmt_ts, fmt_when, new_table, out, print_table, resolve_output

app = typer.Typer(help="Read and change the check settings of a running broker (without a command: show them).",
                  no_args_is_help=False, invoke_without_command=True)

# CLI name -> wire key; durations are seconds on the wire.
KEYS: dict[str, str] = {
    "check-interval": "check_interval_s",
    "transaction-timeout": "transaction_timeout_s",
    "timeout": "transaction_timeout_s",
    "max-checks": "max_checks",
    "retention": "retention_s",
    "outcomes-known-since": "outcomes_known_since",
}
# outcomes_known_since is read-only: when the oldest record still in the log
# was stored. Transactions stored since then have their outcome on record
# (a late end or resolve answers "already" / "conflict"); older ones were
# deleted by retention, records and outcome both (docs/transactions.md).
READ_ONLY = ("outcomes_known_since",)
WIRE_ORDER = ("check_interval_s", "transaction_timeout_s", "max_checks", "retention_s", "outcomes_known_since")
CLI_NAME = {"check_interval_s": "check-interval", "transaction_timeout_s": "transaction-timeout",
            "max_checks": "max-checks", "retention_s": "retention", "outcomes_known_since": "outcomes-known-since"}


def wire_key(name: str) -> str:
    k = name.strip().lower().replace("_", "-")
    if k in KEYS:
        return KEYS[k]
    if name in WIRE_ORDER:
        return name
    raise CliError(f"unknown setting {name!r}: one of check-interval, transaction-timeout (timeout), max-checks, retention"
                   " (and outcomes-known-since, read-only)" + did_you_mean(k, KEYS), exitcodes.USAGE)


def human(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key == "outcomes_known_since":
        return f"{fmt_ts(value)} ({fmt_when(value)})"
    return str(value) if key == "max_checks" else fmt_duration(float(value))


_SETTABLE = ("check-interval", "transaction-timeout", "max-checks", "retention")
_complete_key = choices(*_SETTABLE, "outcomes-known-since")  # get: every key; set: outcomes-known-since is read-only
_complete_settable = choices(*_SETTABLE)


@app.callback(epilog="""Examples:

  txmq config                 # the same as txmq config get

  txmq config -o json""")
def config(ctx: typer.Context, broker: BrokerOpt = DEFAULT_BROKER, token: TokenOpt = None, output: OutputOpt = None) -> None:
    """Read and change the check settings of a running broker (without a command: show them)."""
    if ctx.invoked_subcommand is None:
        get(None, broker, token, output)


@app.command(epilog="""Examples:

  txmq config get

  txmq config get check-interval

  txmq config get -o json | jq .max_checks

Keys: check_interval_s, transaction_timeout_s, max_checks, retention_s, and
outcomes_known_since (read-only, ms since the epoch: the oldest record
still in the log; transactions stored before it were deleted by retention).""")
def get(
    key: Annotated[Optional[str], typer.Argument(metavar="KEY", help="One setting (check-interval, transaction-timeout, max-checks, retention).",
                                                 show_default=False, autocompletion=_complete_key)] = None,
    broker: BrokerOpt = DEFAULT_BROKER,
    token: TokenOpt = None,
    output: OutputOpt = None,
) -> None:
    """Show the check settings."""
    from ..client_ops import call

    wk = wire_key(key) if key is not None else None
    doc = call(broker, token, "config_get", {})
    doc = {k: doc.get(k) for k in WIRE_ORDER if wk is None or k == wk}
    out_fmt = resolve_output(output)
    if emit_document(doc, out_fmt):
        return
    if wk is not None:
        out.print(human(wk, doc[wk]))
    else:
        t = new_table()
        t.add_column("SETTING", style="key")
        t.add_column("VALUE")
        t.add_column("KEY", style="dim")
        for k, v in doc.items():
            t.add_row(CLI_NAME[k], human(k, v), k)
        print_table(t)


@app.command("set", epilog="""Examples:

  txmq config set check-interval 30s

  txmq config set timeout 10s

  txmq config set max-checks 5

  txmq config set retention 72h

  txmq config set retention 1h --dry-run

Durations: 500ms, 30s, 10m, 72h, 2d, or a bare number of seconds. Prints the old and new values
(keys: key, old, new; durations in seconds).

retention applies to the commit log's segments: a segment whose records are
all older than it is deleted, and with it the pending halves and the known
outcomes older than it (pending transactions stored longer ago are discarded
first). A change that would discard pending transactions (a shorter
retention, or max-checks below their check count) says how many and asks on
a terminal; without one it is refused unless --yes (exit 2). --dry-run shows
the effect and changes nothing (keys: key, old, new, dry_run, pending,
would_discard, would_delete_pending).""")
def set_(
    key: Annotated[str, typer.Argument(metavar="KEY", help="check-interval, transaction-timeout (alias timeout), max-checks or retention.",
                                       show_default=False, autocompletion=_complete_settable)],
    value: Annotated[str, typer.Argument(metavar="VALUE", help="The new value: a duration, or a count for max-checks.", show_default=False)],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Apply a change that discards pending transactions without asking.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", "-n", help="Show what the change would discard; change nothing.")] = False,
    broker: BrokerOpt = DEFAULT_BROKER,
    token: TokenOpt = None,
    output: OutputOpt = None,
) -> None:
    """Change one check setting; effective at once and persisted.

    retention applies to the commit log's segments: older ones are deleted,
    and with them the pending halves and known outcomes older than it.
    """

    wk = wire_key(key)
    if wk in READ_ONLY:
        raise CliError(f"{CLI_NAME[wk]} is read-only: it follows the retention setting and the log", exitcodes.USAGE)
    number: float | int
    if wk == "max_checks":
        if not re.fullmatch(r"-?[0-9]+", value):  # ASCII digits only, no spaces (int() would take ' 5', '1_0', '٣')
            raise CliError(f"max-checks must be a whole number, not {value!r}", exitcodes.USAGE)
        if len(value) > 19 or not -(1 << 63) <= int(value) < 1 << 63:  # the broker range-checks the rest; this cannot even be sent
            raise CliError(f"max-checks {value[:40]} is out of range (1 to 1000000)", exitcodes.USAGE)
        number = int(value)
    else:
        number = parse_duration(value)
    r = _preview_then_set(broker, token, wk, number, yes, dry_run)
    out_fmt = resolve_output(output)
    if dry_run:
        doc = {k: r.get(k) for k in ("key", "old", "new", "dry_run", "pending", "would_discard", "would_delete_pending")}
        if not emit_document(doc, out_fmt):
            out.print(f"{CLI_NAME.get(wk, wk)}: {human(wk, doc['old'])} -> {human(wk, doc['new'])} (dry run: nothing changed)")
            out.print(_effect(wk, r))
        return
    doc = {"key": r.get("key", wk), "old": r.get("old"), "new": r.get("new")}
    if not emit_document(doc, out_fmt):
        out.print(f"{CLI_NAME.get(wk, wk)}: {human(wk, doc['old'])} -> [ok]{human(wk, doc['new'])}[/ok]")


def _effect(wk: str, r: dict[str, Any]) -> str:
    n, deleted = r.get("would_discard") or 0, r.get("would_delete_pending") or 0
    if not n:
        return f"discards no pending transaction ({r.get('pending', 0)} pending)"
    why = (f"stored longer ago than {human(wk, r.get('new'))}: their log segments are then deleted with them" if deleted
           else f"checked {r.get('new')} times or more")
    return f"the next check pass discards {n:,} of {r.get('pending', 0):,} pending transaction{'s' if n != 1 else ''} ({why})"


def _preview_then_set(broker: str, token: str | None, wk: str, number: float | int, yes: bool, dry_run: bool) -> dict[str, Any]:
    """Preview the change (config_set dry_run); confirm when it discards pending transactions; apply it.

    The question is asked with no connection open and no event loop running
    (a Ctrl-C there exits 130 at once); the change goes on a connection of
    its own.
    """
    import sys

    from ..client_ops import connect
    from ..common import NOT_CONFIRMED, confirm, run
    from ..console import err

    async def preview() -> tuple[dict[str, Any], bool]:
        """(the preview, or the reply of a change an older broker applied at once; whether that was the change)."""
        async with connect(broker, token) as c:
            features = c.hello.get("features") or []
            if "config_set_dry_run" not in features:  # an older broker would apply a dry_run request
                if dry_run:
                    raise CliError(f"broker at {broker} cannot preview a change (it runs an older txmq): nothing was changed",
                                   exitcodes.ERROR)
                if wk in ("max_checks", "retention_s"):
                    err.print("[warn]warning: the broker runs an older txmq and cannot say what this change discards[/warn]")
                return await c.request("config_set", {"key": wk, "value": number}), True
            return await c.request("config_set", {"key": wk, "value": number, "dry_run": True}), False

    async def apply() -> dict[str, Any]:
        async with connect(broker, token) as c:
            return await c.request("config_set", {"key": wk, "value": number})

    first, applied = run(preview())
    if applied or dry_run:
        return first
    n = first.get("would_discard") or 0
    if n and not yes:
        effect = _effect(wk, first)
        if not (sys.stdin.isatty() and err.is_terminal):
            raise CliError(f"refusing to set {CLI_NAME.get(wk, wk)}: {effect}; no terminal to confirm on: pass --yes"
                           " (or --dry-run to preview)", exitcodes.USAGE)
        err.print(f"[warn]{CLI_NAME.get(wk, wk)} {human(wk, first.get('old'))} -> {human(wk, first.get('new'))}: {effect}[/warn]")
        if not confirm("Apply it?"):
            raise CliError(NOT_CONFIRMED, exitcodes.ERROR)
    return run(apply())
