"""The txmq command line: the app, its command groups, and the one error handler."""

from __future__ import annotations

import sys

import typer

from txmq import __version__

from . import exitcodes
from .common import CliError

app = typer.Typer(
    name="txmq",
    help=(
        "Operate a txmq transactional message broker.\n\n"
        "Examples:\n\n"
        "  txmq broker start                      # run a broker on ~/.local/share/txmq\n\n"
        "  txmq send orders '{\"id\": 1}' --tx --group shop --state commit\n\n"
        "  txmq inspect half --older-than 10m -o jsonl | jq -r .tx_id | txmq resolve --rollback - --yes\n\n"
        "  txmq consume orders --group audit --limit 10"
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    # `txmq completion bash|zsh|fish` prints the scripts (completions/ holds copies)
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    rich_markup_mode="rich",
)


def _version(value: bool) -> None:
    if value:
        print(f"txmq {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
    debug: bool = typer.Option(False, "--debug", envvar="TXMQ_DEBUG", help="Show tracebacks on errors."),
) -> None:
    """Operate a txmq transactional message broker."""
    _state["debug"] = debug


_state: dict[str, bool] = {"debug": False}


def _register() -> None:
    from .commands import register_all

    register_all(app)
    _require_utf8(app)


def _require_utf8(group: typer.Typer) -> None:
    """Every command refuses text arguments that are not valid UTF-8 (exit 2) before doing anything."""
    from .common import utf8_arguments

    for cmd in group.registered_commands:
        if cmd.callback is not None:
            cmd.callback = utf8_arguments(cmd.callback)
    for sub in group.registered_groups:
        if sub.typer_instance is not None:
            _require_utf8(sub.typer_instance)


_register()


COMPLETE_VAR = "_TXMQ_COMPLETE"


def main() -> None:
    """Console-script entry point: run the app, turn failures into one line + exit code."""
    import os

    if os.environ.get(COMPLETE_VAR):
        # A shell asks for completions (the scripts in completions/ set this);
        # use Typer's completion classes, which those scripts were written for.
        from typer._completion_classes import completion_init

        completion_init()
    try:
        app(prog_name="txmq")
    except CliError as e:
        if _state["debug"]:
            raise
        _fail(e.message, e.code)
    except SystemExit as e:
        if e.code == 1 and type(sys.stdout).__name__ == "PacifyFlushWrapper":
            # click's answer to EPIPE (stdout closed under us, e.g. `| head`): not an error here
            _quiet_stdout()
            sys.exit(exitcodes.OK)
        raise
    except KeyboardInterrupt:
        sys.exit(exitcodes.INTERRUPTED)
    except BrokenPipeError:
        # the reader of our stdout went away (e.g. `| head`): not an error
        _quiet_stdout()
        sys.exit(exitcodes.OK)
    except Exception as e:
        if _state["debug"]:
            raise
        from txmq.wire import TxmqError

        if isinstance(e, TxmqError):
            from .client_ops import cli_error

            ce = cli_error(e, "broker")
            _fail(ce.message, ce.code)
        _fail(f"{type(e).__name__}: {e} (run with --debug for the traceback)", exitcodes.ERROR)


def _fail(message: str, code: int) -> None:
    from rich.markup import escape

    from .console import err

    try:
        err.print("[err]error:[/err] " + escape(message))
    except BrokenPipeError:
        pass
    sys.exit(code)


def _quiet_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not complain."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
