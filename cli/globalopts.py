"""The global options of `txmq`: where they may stand on the command line, and what they were set to.

`--debug` and `--context NAME` may come before or after the command;
-b/--broker, --token and -o/--output, which every broker command takes,
may also come before the command name. main.py takes them out of the
arguments (`normalize_args`) and records them in `state`; the shell
completion skips them (`split_globals`); `txmq context show` reads the
context given.
"""

from __future__ import annotations

from typing import Any

# What the global options were set to in this run: --debug (or TXMQ_DEBUG), --context NAME.
state: dict[str, Any] = {"debug": False, "context": None}

# The flags that may stand anywhere (the shell completion offers them after any command).
FLAGS = ("--context", "--debug")

# Options every broker command takes, accepted before the command name too
# (`txmq -b HOST:PORT topics`, `txmq -o json topics`): moved after it.
_BEFORE_COMMAND = ("-b", "--broker", "--token", "-o", "--output")


def normalize_args(args: list[str]) -> tuple[list[str], str | None, bool]:
    """Global options anywhere: returns (args for click, --context NAME, --debug given).

    `--debug` and `--context NAME` may come before or after the command
    (they are taken out here); -b/--broker, --token, -o/--output given
    before the command name are moved after it. Nothing after `--` is touched.
    """
    rest, moved, tail, context, debug = split_globals(args)
    return (["--debug"] if debug else []) + rest + moved + tail, context, debug


def split_globals(args: list[str]) -> tuple[list[str], list[str], list[str], str | None, bool]:
    """(the command's words, the global options given before it, what follows `--`, --context NAME, --debug given)."""
    cut = args.index("--") if "--" in args else len(args)
    head, tail = args[:cut], args[cut:]
    rest: list[str] = []
    moved: list[str] = []
    context: str | None = None
    debug = False
    in_command = False
    i = 0
    while i < len(head):
        a = head[i]
        if a == "--debug":
            debug = True
        elif a == "--context" and i + 1 < len(head):
            context = head[i + 1]
            i += 1
        elif a.startswith("--context="):
            context = a.partition("=")[2]
        elif not in_command and a in _BEFORE_COMMAND and i + 1 < len(head):
            moved += [a, head[i + 1]]
            i += 1
        elif not in_command and (a.startswith(("--broker=", "--token=", "--output="))
                                 or (a[:2] in ("-b", "-o") and len(a) > 2)):
            moved.append(a)
        else:
            if not a.startswith("-"):
                in_command = True
            rest.append(a)
        i += 1
    return rest, moved, tail, context, debug
