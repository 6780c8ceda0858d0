"""The txmq command line: the app, its command groups, and the one error handler."""

from __future__ import annotations

import re
import sys
from typing import Any

import typer

from txmq import __version__

from . import exitcodes
from .commands import register_all
from .commands.completion import COMPLETE_VAR, answer_tab
from .common import CliError, did_you_mean, invalid_choice, utf8_arguments
from .globalopts import normalize_args, state

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
    state["debug"] = debug


_BRACKET = re.compile(r"(?<!\\)\[(?=[A-Za-z#/@])")


def _escape_help_brackets(command: Any) -> None:
    """Option help such as "Data directory [default: ~/.local/share/txmq]." is shown as written (rich
    markup would take "[default: ...]" for a style and print "Data directory .")."""
    for param in getattr(command, "params", ()):
        if isinstance(getattr(param, "help", None), str):
            param.help = _BRACKET.sub(r"\\[", param.help)
    for sub in getattr(command, "commands", {}).values():
        _escape_help_brackets(sub)


def _require_utf8(group: typer.Typer) -> None:
    """Every command refuses text arguments that are not valid UTF-8 (exit 2) before doing anything."""
    for cmd in group.registered_commands:
        if cmd.callback is not None:
            cmd.callback = utf8_arguments(cmd.callback)
    own = group.registered_callback  # a group that does something itself (`txmq topics` lists)
    if own is not None and own.callback is not None and group is not app:
        own.callback = utf8_arguments(own.callback)
    for sub in group.registered_groups:
        if sub.typer_instance is not None:
            _require_utf8(sub.typer_instance)


register_all(app)
_require_utf8(app)


def main() -> None:
    """Console-script entry point: run the app, turn failures into one line + exit code."""
    import os

    from typer._click import exceptions as clickx  # Typer carries its own copy of click
    from typer.exceptions import Abort

    if os.environ.get(COMPLETE_VAR):
        # A shell asks for completions (the scripts in completions/ set this);
        # use Typer's completion classes, which those scripts were written for.
        answer_tab()
        app(prog_name="txmq")
        return
    args, context_name, debug_flag = normalize_args(sys.argv[1:])
    state["context"] = context_name
    state["debug"] = debug_flag or os.environ.get("TXMQ_DEBUG", "").lower() in ("1", "true", "yes", "on")
    try:
        command = typer.main.get_command(app)
        _escape_help_brackets(command)
        from . import contexts

        _, ctx = contexts.selected(context_name)
        extra = {"default_map": contexts.default_map(command, ctx)} if ctx else {}
        rv = command.main(args=args, prog_name="txmq", standalone_mode=False, **extra)
        sys.exit(rv if isinstance(rv, int) else exitcodes.OK)
    except CliError as e:
        _debug_traceback()
        _fail(e.message, e.code)
    except clickx.NoArgsIsHelpError as e:
        sys.exit(e.exit_code)  # the help was printed
    except clickx.UsageError as e:
        _debug_traceback()
        _fail(_usage_message(e, args), exitcodes.USAGE)
    except Abort:
        _fail("aborted", exitcodes.ERROR)
    except clickx.ClickException as e:
        _fail(e.format_message(), e.exit_code)
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
        _debug_traceback()
        from txmq.wire import TxmqError

        if isinstance(e, TxmqError):
            from .client_ops import cli_error

            ce = cli_error(e, "broker")
            _fail(ce.message, ce.code)
        _fail(f"{type(e).__name__}: {e}" + ("" if state["debug"] else " (run with --debug for the traceback)"), exitcodes.ERROR)


def _debug_traceback() -> None:
    """With --debug (TXMQ_DEBUG=1) the traceback goes to stderr; the exit code stays the documented one."""
    if state["debug"]:
        import traceback

        traceback.print_exc(file=sys.stderr)


def _usage_message(e: Any, args: list[str]) -> str:
    """click's usage error as one line, with where to find help."""
    from typer._click import exceptions as clickx  # Typer carries its own copy of click

    msg = e.format_message()
    name = getattr(e, "option_name", None) or ""
    if isinstance(e, clickx.NoSuchOption) and len(name) > 1 and name[1:2].isdigit():
        word = next((a for a in args if a.startswith(name)), name)
        msg = (f"{word!r} is read as an option: values have no sign (a duration or a count is never negative); "
               f"a value that must start with '-' goes after '--'")
    elif isinstance(e, clickx.NoSuchOption):
        msg = e.message.rstrip(".") + did_you_mean(name, getattr(e, "possibilities", None) or ())
    elif isinstance(e, clickx.BadParameter) and not isinstance(e, clickx.MissingParameter):
        try:
            msg = _choice_message(e, args) or msg
        except Exception:  # noqa: BLE001  # Typer's own words rather than none
            _debug_traceback()
    for pydantic, plain in _PLAIN_WORDS:
        msg = msg.replace(pydantic, plain)
    ctx = getattr(e, "ctx", None)
    path = ctx.command_path if ctx is not None else "txmq"
    return f"{msg} (see '{path} --help')"


# Typer checks numbers with pydantic, whose words name its own types; an operator reads these instead.
_PLAIN_WORDS = (
    ("Input should be a valid integer, unable to parse string as an integer", "not a whole number"),
    ("Input should be a valid number, unable to parse string as a number", "not a number"),
    ("Input should be greater than or equal to", "must be at least"),
    ("Input should be less than or equal to", "must be at most"),
    ("Input should be greater than", "must be more than"),
    ("Input should be less than", "must be less than"),
)


def _choices(param: Any) -> list[str]:
    """The values an option or argument of an Enum (or Literal) type takes; [] for any other type."""
    import enum
    import typing

    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    while typing.get_origin(annotation) in (list, typing.Union) or type(annotation).__name__ == "UnionType":
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) != 1:
            return []
        annotation = args[0]
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return [str(m.value) for m in annotation]
    if typing.get_origin(annotation) is typing.Literal:
        return [str(v) for v in typing.get_args(annotation)]
    return []


def _choice_message(e: Any, args: list[str]) -> str | None:
    """A value outside an option's choices, in the words a mistyped command gets:
    "Invalid value 'comit' for '--state' (one of commit, rollback, unknown). Did you mean 'commit'?"."""
    param = getattr(e, "param", None)
    choices = _choices(param)
    if not choices:
        return None
    value = _given_value(param, args, choices)
    if value is None:
        return None
    hint = e.param_hint if e.param_hint is not None else param.get_error_hint()
    hint = hint if isinstance(hint, str) else " / ".join(hint)
    return invalid_choice(value, choices, hint)


def _given_value(param: Any, args: list[str], choices: list[str]) -> str | None:
    """The value given to `param` that is not one of `choices` (the first such), from the command line."""
    opts = [*getattr(param, "opts", ()), *getattr(param, "secondary_opts", ())]
    if getattr(param, "param_type_name", "") == "argument":
        words = [a for a in args if not a.startswith("-")]
    else:
        words = []
        for i, a in enumerate(args):
            if a == "--":
                break
            if a in opts and i + 1 < len(args):
                words.append(args[i + 1])
            for o in opts:
                if a.startswith(o + "=") and o.startswith("--"):
                    words.append(a[len(o) + 1:])
                elif not o.startswith("--") and a.startswith(o) and len(a) > len(o):
                    words.append(a[len(o):])  # -ocomit
    return next((w for w in reversed(words) if w not in choices), None)


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
