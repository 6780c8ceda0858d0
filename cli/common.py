"""Options, parsing and broker access shared by every command."""

from __future__ import annotations

import re
from typing import Annotated, Any, Awaitable, TypeVar

import typer

from txmq.constants import DEFAULT_HOST, DEFAULT_PORT

from . import exitcodes
from .console import Output

T = TypeVar("T")

DEFAULT_BROKER = f"{DEFAULT_HOST}:{DEFAULT_PORT}"

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


class CliError(Exception):
    """A failure the CLI reports as one line on stderr with an exit code."""

    def __init__(self, message: str, code: int = exitcodes.ERROR) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


_DUR = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration(text: str) -> float:
    """'500ms', '30s', '10m', '72h', '2d', or a bare number of seconds -> seconds."""
    total = 0.0
    parts = re.findall(r"\d+(?:\.\d+)?\s*(?:ms|s|m|h|d)?", text or "")
    if not parts or "".join(p.replace(" ", "") for p in parts) != (text or "").replace(" ", ""):
        raise CliError(f"bad duration {text!r}: use e.g. 500ms, 30s, 10m, 72h or a number of seconds", exitcodes.USAGE)
    for p in parts:
        m = _DUR.match(p)
        assert m
        total += float(m.group(1)) * _UNITS[m.group(2)]
    return total


def parse_address(addr: str) -> str:
    m = re.match(r"^[\w.\-\[\]:]+:(\d{1,5})$", addr or "")
    if not m or not 0 < int(m.group(1)) < 65536:
        raise CliError(f"bad broker address {addr!r}: expected HOST:PORT", exitcodes.USAGE)
    return addr


def run(coro: Awaitable[T]) -> T:
    """Run a coroutine on uvloop when available (asyncio is imported here, not at start-up)."""
    try:
        import uvloop
    except ImportError:
        import asyncio

        return asyncio.run(coro)  # type: ignore[arg-type]
    return uvloop.run(coro)  # type: ignore[arg-type]


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
