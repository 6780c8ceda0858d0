"""Named broker profiles ("contexts"): an address and a token under a name.

Stored in $XDG_CONFIG_HOME/txmq/contexts.json (~/.config/txmq/contexts.json),
mode 0600 because it holds tokens; read with ``txmq.contextfile``, which the
Spark source (option ``context``) uses too:

    {"current": "prod", "contexts": {"prod": {"broker": "10.0.0.5:10911", "token": "..."}}}

A command's --broker/--token come from, in order: the option, the
environment (TXMQ_BROKER, TXMQ_AUTH_TOKEN), the selected context
(--context NAME, else TXMQ_CONTEXT, else the current one), the default.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from txmq import contextfile

from . import exitcodes
from .common import CliError

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]{0,63}")


def path() -> Path:
    return contextfile.path()


def check_name(name: str) -> str:
    if not NAME.fullmatch(name or ""):
        raise CliError(f"bad context name {name!r}: letters, digits, '.', '_' and '-', at most 64, starting with a letter or digit",
                       exitcodes.USAGE)
    return name


def load() -> dict[str, Any]:
    try:
        return contextfile.load(path())
    except contextfile.ContextFileError as e:
        raise CliError(str(e)) from None


def save(doc: dict[str, Any]) -> None:
    """Write the file atomically, readable by its owner only (it holds tokens)."""
    p = path()
    p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = p.with_name(p.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    os.replace(tmp, p)


def selected(flag: str | None) -> tuple[str | None, dict[str, Any] | None]:
    """The context a command runs in: --context, else TXMQ_CONTEXT, else the current one (or none)."""
    name = flag if flag is not None else (os.environ.get("TXMQ_CONTEXT") or None)
    explicit = name is not None
    if name is None and not path().exists():
        return None, None
    doc = load()
    if name is None:
        name = doc.get("current")
        if not name:
            return None, None
    ctx = doc["contexts"].get(name)
    if ctx is None:
        where = "--context" if flag is not None else ("TXMQ_CONTEXT" if explicit else f"the current context in {path()}")
        raise CliError(f"no context named {name!r} ({where}); see `txmq context list`", exitcodes.USAGE)
    return name, ctx


def default_map(command: Any, ctx: dict[str, Any], top: bool = True) -> dict[str, Any]:
    """click's default_map giving every command's --broker/--token the context's values.

    click reads the command line, then the environment variable, then the
    default map, then the default: exactly the documented precedence.
    """
    values = {k: v for k, v in (("broker", ctx.get("broker")), ("token", ctx.get("token"))) if v}
    dm: dict[str, Any] = {}
    for name, sub in getattr(command, "commands", {}).items():
        if top and name == "context":
            continue  # `context add --broker/--token` define a context: nothing comes from one
        params = {p.name: p for p in getattr(sub, "params", ())}
        mine = {k: v for k, v in values.items()
                if k in params and f"--{k}" in getattr(params[k], "opts", ())}
        if getattr(sub, "commands", None):
            # a group's own options (`txmq topics` lists with --broker) beside its commands' maps
            inner = {**default_map(sub, ctx, top=False), **mine}
            if inner:
                dm[name] = inner
            continue
        if mine:
            dm[name] = mine
    return dm
