"""txmq context add|list|use|remove|show: named broker profiles (address and token)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from .. import exitcodes
from ..common import CliError, OutputOpt, parse_address
from ..console import Output, emit_json, emit_line, note, out, render, resolve_output
from ..globalopts import state

app = typer.Typer(
    help="Named broker profiles (address, token), chosen with --context NAME or TXMQ_CONTEXT (without a command: list them).",
    no_args_is_help=False,
    invoke_without_command=True,
    epilog="""Examples:

  txmq context add prod --broker 10.0.0.5:10911 --token s3cret --use

  txmq context list

  txmq --context staging inspect half

  TXMQ_CONTEXT=staging txmq topics

Stored in $XDG_CONFIG_HOME/txmq/contexts.json (~/.config/txmq/contexts.json), mode 0600.
An option (--broker, --token) wins over the environment (TXMQ_BROKER, TXMQ_AUTH_TOKEN),
which wins over the context, which wins over the default.""",
)


def complete_name(incomplete: str) -> list[str]:
    from .. import contexts

    try:
        return [n for n in sorted(contexts.load()["contexts"]) if n.startswith(incomplete)]
    except CliError:
        return []


NameArg = Annotated[str, typer.Argument(metavar="NAME", help="The context's name.", show_default=False, autocompletion=complete_name)]


def _row(name: str, ctx: dict, current: str | None, show_token: bool = False) -> dict:
    token = ctx.get("token")
    return {"name": name, "broker": ctx.get("broker"), "token": (token if show_token else ("set" if token else None)),
            "current": name == current}


@app.callback()
def context(ctx: typer.Context, output: OutputOpt = None) -> None:
    """Named broker profiles (address, token), chosen with --context NAME or TXMQ_CONTEXT (without a command: list them)."""
    if ctx.invoked_subcommand is None:
        list_(output)


@app.command(epilog="Examples:\n\n  txmq context add prod --broker 10.0.0.5:10911 --token s3cret\n\n"
             "  txmq context add local --broker 127.0.0.1:10911 --use")
def add(
    name: NameArg,
    broker: Annotated[str, typer.Option("--broker", "-b", help="Broker address HOST:PORT.", show_default=False)],
    token: Annotated[Optional[str], typer.Option("--token", help="Auth token for this broker.", show_default=False)] = None,
    use: Annotated[bool, typer.Option("--use", help="Make it the current context.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace a context of that name.")] = False,
    force_short: Annotated[bool, typer.Option("-f", hidden=True)] = False,  # --force's older short name (-f is --follow elsewhere)
) -> None:
    """Add (or with --force replace) a named context."""
    from .. import contexts

    force = force or force_short

    contexts.check_name(name)
    parse_address(broker)
    doc = contexts.load()
    if name in doc["contexts"] and not force:
        raise CliError(f"context {name!r} exists: --force replaces it", exitcodes.USAGE)
    doc["contexts"][name] = {k: v for k, v in (("broker", broker), ("token", token)) if v}
    if use or not doc.get("current"):
        doc["current"] = name
    contexts.save(doc)
    note(f"context {name!r} saved in {contexts.path()}" + (" (current)" if doc["current"] == name else ""))


@app.command("list", epilog="Examples:\n\n  txmq context list\n\n  txmq context list -o json\n\n"
             "Keys: name, broker, token (\"set\" or null; `context show --token` prints it), current.")
def list_(output: OutputOpt = None) -> None:
    """List the contexts; the current one is marked."""
    from .. import contexts

    doc = contexts.load()
    rows = [_row(n, c, doc.get("current")) for n, c in sorted(doc["contexts"].items())]
    render(rows, resolve_output(output), columns=[("current", ""), ("name", "NAME"), ("broker", "BROKER"), ("token", "TOKEN")],
           formatters={"current": lambda v: "*" if v else ""},
           empty="no contexts yet: txmq context add NAME --broker HOST:PORT")


@app.command(epilog="Examples:\n\n  txmq context use prod\n\n  txmq context use --none     # back to TXMQ_BROKER / the default")
def use(
    name: Annotated[Optional[str], typer.Argument(metavar="NAME", help="The context to use.", show_default=False,
                                                  autocompletion=complete_name)] = None,
    none: Annotated[bool, typer.Option("--none", help="Use no context.")] = False,
) -> None:
    """Make a context the current one (used when neither --context nor TXMQ_CONTEXT is given)."""
    from .. import contexts

    if (name is None) == (not none):
        raise CliError("give a NAME or --none", exitcodes.USAGE)
    doc = contexts.load()
    if name is not None and name not in doc["contexts"]:
        raise CliError(f"no context named {name!r}; see `txmq context list`", exitcodes.NOT_FOUND)
    doc["current"] = name
    contexts.save(doc)
    note(f"current context: {name}" if name else "no current context")


@app.command(epilog="Examples:\n\n  txmq context remove staging")
def remove(name: NameArg) -> None:
    """Remove a context."""
    from .. import contexts

    doc = contexts.load()
    if name not in doc["contexts"]:
        raise CliError(f"no context named {name!r}; see `txmq context list`", exitcodes.NOT_FOUND)
    del doc["contexts"][name]
    if doc.get("current") == name:
        doc["current"] = None
    contexts.save(doc)
    note(f"context {name!r} removed")


@app.command(epilog="Examples:\n\n  txmq context show\n\n  txmq context show prod -o json\n\n"
             "Keys: name, broker, token (\"set\" or null; with --token the token itself), current, file.")
def show(
    name: Annotated[Optional[str], typer.Argument(metavar="NAME", help="A context [default: the one commands would use now].",
                                                  show_default=False, autocompletion=complete_name)] = None,
    show_token: Annotated[bool, typer.Option("--token", help="Print the token itself.")] = False,
    output: OutputOpt = None,
) -> None:
    """Show a context, by default the one commands would use now (--context, TXMQ_CONTEXT, or the current one)."""
    from .. import contexts
    from ..console import kv_table

    doc = contexts.load()
    if name is None:
        name, _ = contexts.selected(state["context"])
        if name is None:
            fmt = resolve_output(output)
            if fmt is Output.table:
                out.print("no context: commands use --broker, TXMQ_BROKER or 127.0.0.1:10911")
            else:
                (emit_json if fmt is Output.json else emit_line)({"name": None, "file": str(contexts.path())})
            return
    if name not in doc["contexts"]:
        raise CliError(f"no context named {name!r}; see `txmq context list`", exitcodes.NOT_FOUND)
    row = {**_row(name, doc["contexts"][name], doc.get("current"), show_token), "file": str(contexts.path())}
    kv_table(row, resolve_output(output), title=f"context {name}")
