"""Options, parsing and broker access shared by every command."""

from __future__ import annotations

import re
from typing import Annotated, Any, Awaitable, Callable, Coroutine, Sequence, TypeVar

import typer

from txmq.constants import DEFAULT_ADDRESS

from . import exitcodes
from .console import Output

T = TypeVar("T")

DEFAULT_BROKER = DEFAULT_ADDRESS  # the --broker default of every command

BrokerOpt = Annotated[
    str,
    typer.Option("--broker", "-b", envvar="TXMQ_BROKER", help="Broker address HOST:PORT.", show_default=True, rich_help_panel="Connection"),
]
TokenOpt = Annotated[
    str | None,
    typer.Option("--token", envvar="TXMQ_AUTH_TOKEN", help="Auth token, if the broker requires one.", show_default=False, rich_help_panel="Connection"),
]
OutputOpt = Annotated[
    Output | None,
    typer.Option("--output", "-o", help="table (default on a terminal), json, or jsonl (default in pipes).", show_default=False),
]


def one_of(value: Any, alias_value: Any, name: str, alias: str) -> Any:
    """An option's value, given under its name or (hidden) its older one; both, with different values, is a usage error."""
    if alias_value is None:
        return value
    if value is not None and value != alias_value:
        raise CliError(f"{name} and {alias} are the same option: give it once", exitcodes.USAGE)
    return alias_value


class CliError(Exception):
    """A failure the CLI reports as one line on stderr with an exit code."""

    def __init__(self, message: str, code: int = exitcodes.ERROR) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


# Durations: one number of seconds, or one or more NUMBER+UNIT components
# (1h30m). ASCII digits only, no spaces, no sign; every component of a
# combination has its unit ("1h30" is refused: 30 what?).
_DUR_NUM = r"[0-9]+(?:\.[0-9]+)?"
_DUR_PART = re.compile(rf"({_DUR_NUM})(ms|s|m|h|d)")
_DUR_FULL = re.compile(rf"{_DUR_NUM}|(?:{_DUR_NUM}(?:ms|s|m|h|d))+")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
MAX_DURATION_S = 36500 * 86400.0  # 100 years: longer is a typo, and would not fit the wire's integer fields in ms

# Integers the CLI puts on the wire (offsets, ages in ms) are checked against
# the broker's range for them, so a typo is a usage error before anything is
# sent rather than a refusal of a whole request half-way through a bulk run.
WIRE_INT_MAX = 1 << 62
# A REF names a transaction id (the broker takes ids of at most 255
# characters) or an offset; a stdin line holding one (a JSON object from
# `inspect half -o jsonl`, say) may be longer, up to MAX_REF_LINE bytes.
MAX_REF_CHARS = 255
MAX_REF_LINE = 64 << 10
# A bare run of ASCII digits is an offset only if it could be one: 2^62 has 19
# digits. A longer run is a transaction id: the broker's ids are 32 hex digits,
# and one in a few thousand broker runs draws a random prefix without a letter,
# whose ids are then all digits.
OFFSET_DIGITS = len(str(WIRE_INT_MAX))


def digits_are_offset(text: str) -> bool:
    """Whether a bare token of ASCII digits (an optional leading +) names an offset rather than a transaction id."""
    return len(text.lstrip("+")) <= OFFSET_DIGITS or text.startswith("+")


def choices(*values: str) -> Callable[[str], list[str]]:
    """Tab completion of an option whose value is one of a few words (validated where it is used)."""
    return lambda incomplete: [v for v in values if v.startswith(incomplete)]


def did_you_mean(word: str, candidates: Any) -> str:
    """". Did you mean 'x'?" (or 'x', 'y') for the candidates close to `word`, as a mistyped command gets; "" if none is."""
    from difflib import get_close_matches

    close = get_close_matches(word, list(candidates))
    return (". Did you mean " + ", ".join(repr(c) for c in close) + "?") if close else ""


def invalid_choice(value: str, allowed: Any, label: str) -> str:
    """The one wording of a value outside an option's few: "Invalid value 'comit' for '--state'
    (one of commit, rollback, unknown). Did you mean 'commit'?"."""
    return f"Invalid value {value!r} for {label} (one of {', '.join(allowed)})" + did_you_mean(value, allowed)


def check_choice(value: str, allowed: Sequence[str], label: str) -> str:
    """`value` if it is one of `allowed`, else a usage error in the words of `invalid_choice`."""
    if value not in allowed:
        raise CliError(invalid_choice(value, allowed, label), exitcodes.USAGE)
    return value


NOT_CONFIRMED = "not confirmed: nothing was changed"


def confirm(question: str) -> bool:
    """Ask `question [y/N]` on stderr and read the answer from stdin (a terminal): y or yes is True.

    Ctrl-C at the prompt raises KeyboardInterrupt, so the command exits 130
    as every Ctrl-C does (click's prompt turned it into "aborted", exit 1);
    the end of the input (Ctrl-D) and an empty answer are no. Anything else
    asks again.
    """
    import signal
    import sys
    import threading

    from rich.markup import escape

    from .console import err

    # Ctrl-C is KeyboardInterrupt here even in a process started with SIGINT ignored (a background job of a script).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler) if threading.current_thread() is threading.main_thread() else None
    try:
        while True:
            err.print(escape(f"{question} [y/N]: "), end="")
            try:
                line = sys.stdin.readline()
            except KeyboardInterrupt:
                err.print()  # the shell's prompt on a line of its own
                raise
            if not line:  # end of input
                err.print()
                return False
            answer = line.strip().lower()
            if answer in ("y", "yes"):
                return True
            if answer in ("", "n", "no"):
                return False
            err.print("[warn]answer y or n[/warn]")
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def parse_duration(text: str) -> float:
    """'500ms', '30s', '10m', '72h', '2d', combinations ('1h30m'), or a bare number of seconds -> seconds."""
    t = text or ""
    if not _DUR_FULL.fullmatch(t):
        raise CliError(f"bad duration {t!r}: use e.g. 500ms, 30s, 10m, 72h, 2d, 1h30m or a number of seconds "
                       "(ASCII digits, no spaces, a unit on every part of a combination)", exitcodes.USAGE)
    parts = _DUR_PART.findall(t)
    total = sum(float(n) * _UNITS[u] for n, u in parts) if parts else float(t)
    if total > MAX_DURATION_S:
        raise CliError(f"duration {t!r} is out of range: at most 36500d (100 years)", exitcodes.USAGE)
    return total


def parse_address(addr: str) -> str:
    """The broker address as given, once the client's `parse_address` accepts it
    (HOST:PORT or [IPV6]:PORT, a port from 1 to 65535); anything else is a usage error."""
    from txmq.client.connection import parse_address as split_address

    try:
        split_address(addr, default_port=None)
    except ValueError as exc:
        raise CliError(str(exc), exitcodes.USAGE) from None
    return addr


def check_utf8(value: Any, what: str) -> None:
    """Refuse an argument that is not valid UTF-8 (Python hands such bytes over as lone surrogates)."""
    values = value if isinstance(value, (list, tuple)) else (value,)
    for v in values:
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise CliError(f"{what} is not valid UTF-8: {v.encode('utf-8', 'surrogateescape')[:60]!r}", exitcodes.USAGE) from None


def utf8_arguments(func: Callable[..., T]) -> Callable[..., T]:
    """Wrap a command so that every text argument it gets must be valid UTF-8 (paths are exempt: they stay bytes-safe)."""
    import functools

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        for name, value in kwargs.items():
            try:
                check_utf8(value, "")
            except CliError as e:
                raise CliError(_param_label(func, name) + e.message, e.code) from None
        return func(*args, **kwargs)

    return wrapper


def _param_label(func: Callable[..., Any], name: str) -> str:
    """How the user wrote parameter `name` of a command: its --option or its ARGUMENT metavar."""
    import inspect

    param = inspect.signature(func, eval_str=True).parameters[name]
    for info in (*getattr(param.annotation, "__metadata__", ()), param.default):
        decls = getattr(info, "param_decls", None)
        if type(info).__name__ == "ArgumentInfo":
            return getattr(info, "metavar", None) or name.upper()
        if type(info).__name__ == "OptionInfo":
            longs = [d for d in decls or () if d.startswith("--")]
            return longs[0] if longs else "--" + name.rstrip("_").replace("_", "-")
    return name


def run(coro: Awaitable[T]) -> T:
    """Run a coroutine on uvloop when available (asyncio is imported here, not at start-up)."""
    try:
        import uvloop
    except ImportError:
        import asyncio

        return asyncio.run(coro)  # type: ignore[arg-type]
    return uvloop.run(coro)  # type: ignore[arg-type]


# After Ctrl-C, how long a command may spend closing its broker connection before it exits anyway.
INTERRUPT_GRACE_S = 1.5


def run_interruptible(coro: Coroutine[Any, Any, T], grace: float = INTERRUPT_GRACE_S) -> T:
    """Run a coroutine like `run`; Ctrl-C (SIGINT) raises KeyboardInterrupt within `grace` seconds.

    The first SIGINT cancels the coroutine, which may then clean up (close
    its connection); KeyboardInterrupt is raised when it has ended, when
    `grace` runs out, or at a second SIGINT, whichever comes first. What is
    still running then is left with the event loop, not awaited, so a broker
    connection whose close never completes cannot hold the command up.

    Its own handler takes SIGINT, so this holds whatever SIGINT's disposition
    was when the process started: Python's KeyboardInterrupt, or ignored (a
    background job of a script), in which case asyncio.run would not see it
    at all.
    """
    import threading

    if threading.current_thread() is not threading.main_thread():
        return run(coro)  # only the main thread takes signals
    return _Interruptible(grace).run(coro)


class _Interruptible:
    """The event loop of `run_interruptible`: its SIGINT handler, and a clean-up that never waits past a deadline.

    SIGINT goes to a Python handler that hands it to the loop
    (call_soon_threadsafe), not to loop.add_signal_handler: uvloop's handler
    only notes the signal, and acts on it when its wake-up pipe has data,
    which it is given only while the loop runs, so a SIGINT just before the
    loop started was never acted on (the command went on waiting on stdin).
    A Python handler runs in the main thread wherever the signal lands; while
    the loop waits, its wake-up pipe or the interrupted poll runs it at once.
    """

    def __init__(self, grace: float) -> None:
        import asyncio

        try:
            import uvloop
        except ImportError:
            self.loop = asyncio.new_event_loop()
        else:
            self.loop = uvloop.new_event_loop()
        self.grace = grace
        self.interrupts = 0
        self.task: Any = None  # the command's coroutine, as a task
        self.cut: Any = None  # a future: done when nothing more is to be awaited (grace over, or a second Ctrl-C)

    def on_signal(self, _signum: int, _frame: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.on_sigint)
        except RuntimeError:  # the loop is closed: the command is over
            pass

    def on_sigint(self) -> None:
        self.interrupts += 1
        if self.interrupts == 1 and self.task is not None and not self.task.done():
            self.task.cancel()
            self.loop.call_later(self.grace, self.stop_waiting)
        else:
            self.stop_waiting()

    def stop_waiting(self) -> None:
        if self.cut is not None and not self.cut.done():
            self.cut.set_result(None)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        import asyncio
        import signal

        loop = self.loop
        previous = signal.getsignal(signal.SIGINT)
        try:
            signal.signal(signal.SIGINT, self.on_signal)
        except (OSError, ValueError):  # no SIGINT handler here
            loop.close()
            return run(coro)
        finished = False
        try:
            asyncio.set_event_loop(loop)
            self.cut = loop.create_future()
            self.task = loop.create_task(coro)
            loop.run_until_complete(asyncio.wait((self.task, self.cut), return_when=asyncio.FIRST_COMPLETED))
            if not self.task.done():  # its clean-up outlasted the grace, or a second Ctrl-C
                raise KeyboardInterrupt
            finished = self._finish()
            if self.interrupts and self.task.cancelled():
                raise KeyboardInterrupt
            return self.task.result()
        finally:
            signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
            if not finished:  # tasks left pending are not worth a message each as they are collected
                loop.set_exception_handler(lambda _loop, _context: None)
            asyncio.set_event_loop(None)
            loop.close()

    def _finish(self) -> bool:
        """What asyncio.run does after the coroutine (cancel the tasks left, close async generators, the
        default executor), none of it waited for past the deadline; True if all of it ended."""
        import asyncio

        loop = self.loop
        if self.cut.done():
            return False
        loop.call_later(self.grace, self.stop_waiting)

        def bounded(aw: Any) -> bool:
            step = asyncio.ensure_future(aw, loop=loop)
            loop.run_until_complete(asyncio.wait((step, self.cut), return_when=asyncio.FIRST_COMPLETED))
            return step.done()

        left = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for t in left:
            t.cancel()
        if left and not bounded(asyncio.wait(left)):
            return False
        for t in left:
            if not t.cancelled() and t.exception() is not None:
                loop.call_exception_handler({"message": "unhandled exception during shutdown", "exception": t.exception(), "task": t})
        return bounded(loop.shutdown_asyncgens()) and bounded(loop.shutdown_default_executor())


def stop_event(signals: tuple[str, ...] = ("SIGINT", "SIGTERM")) -> Any:
    """An asyncio.Event set on SIGINT/SIGTERM, for commands that stop cleanly (call inside the loop)."""
    import asyncio
    import signal

    ev = asyncio.Event()
    loop = asyncio.get_running_loop()
    for name in signals:
        try:
            loop.add_signal_handler(getattr(signal, name), ev.set)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
            pass
    return ev
