"""txmq resolve --commit|--rollback REF...: an operator decides pending transactions."""

from typing import Annotated, Any, Optional

import typer

from .. import exitcodes
from ..common import DEFAULT_BROKER, BrokerOpt, CliError, OutputOpt, TokenOpt
from ..console import emit_json, note, resolve_output
from . import _bulk

EPILOG = """Examples:

  txmq resolve --commit 42                      # half offset 42, as printed by inspect half

  txmq resolve --rollback 7F3A...E1             # a transaction id

  txmq resolve --commit --commit-log-offset 123456

  txmq inspect half --older-than 10m -o jsonl | txmq resolve --rollback - --yes

  txmq inspect half --group shop -o jsonl | jq -r .tx_id | txmq resolve --commit - --yes --dry-run

Per REF: ref, tx_id, status (ok | already | conflict | not_found), message.
Exit codes: 0 all ok or already; 5 not found / 6 conflict when the only REF failed;
7 when some of several REFs failed."""


def register(app: typer.Typer) -> None:
    app.command("resolve", epilog=EPILOG)(resolve)


def resolve(
    refs: Annotated[Optional[list[str]], typer.Argument(metavar="REF", help="Half offsets, transaction ids, or '-' to read them from stdin (one per line, or JSON lines with tx_id).", show_default=False)] = None,
    commit: Annotated[bool, typer.Option("--commit", help="Commit: deliver the messages to their topics.")] = False,
    rollback: Annotated[bool, typer.Option("--rollback", help="Roll back: drop the messages.")] = False,
    commit_log_offset: Annotated[bool, typer.Option("--commit-log-offset", help="Bare integers are commit-log offsets, not half offsets.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation (required for several REFs without a terminal).")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", "-n", help="Show what would happen; change nothing.")] = False,
    broker: BrokerOpt = DEFAULT_BROKER,
    token: TokenOpt = None,
    output: OutputOpt = None,
) -> None:
    """Force pending transactions to commit or roll back.

    A bare integer REF is a half offset (as printed by `txmq inspect half`),
    or a commit-log offset with --commit-log-offset; anything else is a
    transaction id. Each REF gets its own outcome: done (ok), already decided
    the same way (already), decided the other way or discarded (conflict),
    or not found (not_found).
    """
    if commit == rollback:
        raise CliError("give exactly one of --commit or --rollback", exitcodes.USAGE)
    if not refs:
        raise CliError("no REF given: name transactions by half offset or id, or '-' to read them from stdin", exitcodes.USAGE)
    action = "commit" if commit else "rollback"
    refs_ = _bulk.collect_refs(refs, "commit_log_offset" if commit_log_offset else "half_offset", ("half_offset", "commit_log_offset"))
    out_fmt = resolve_output(output)
    if not refs_:
        note("no REFs on stdin: nothing to resolve")
        if out_fmt.value == "json":
            emit_json([])
        return
    texts = [t for t, _ in refs_]
    items = [w for _, w in refs_]
    _bulk.confirm(len(items), "commit" if commit else "roll back", yes, dry_run)

    def build(part: list[dict[str, Any]]) -> dict[str, Any]:
        return {"action": action, "refs": part, "dry_run": dry_run}

    label = ("committing" if commit else "rolling back") + (" (dry run)" if dry_run else "")
    rows = _bulk.run_bulk(broker, token, "tx_resolve", build, items, texts, out_fmt, label)
    _bulk.finish(rows, out_fmt, ("would be " if dry_run else "") + ("committed" if commit else "rolled back"))
