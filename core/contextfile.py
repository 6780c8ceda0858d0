"""The saved broker profiles ("contexts") file: where it is and how it reads.

Stored in $XDG_CONFIG_HOME/txmq/contexts.json (~/.config/txmq/contexts.json):

    {"current": "prod", "contexts": {"prod": {"broker": "10.0.0.5:10911", "token": "..."}}}

Here, below both readers, because the CLI (``txmq context``, ``--context``)
and the Spark source (option ``context``) read it and the Spark package may
not import the CLI. The CLI writes it (``txmq.cli.contexts``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class ContextFileError(ValueError):
    """The file cannot be read, or is not a JSON object of contexts; the message names it."""


def path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "txmq" / "contexts.json"


def load(p: Path | None = None) -> dict[str, Any]:
    """The file's document, with "contexts" and "current" present; no file reads as no contexts."""
    p = path() if p is None else p
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {"current": None, "contexts": {}}
    except OSError as e:
        raise ContextFileError(f"cannot read {p}: {e.strerror or e}") from None
    try:
        doc = json.loads(text)
        ok = isinstance(doc, dict) and isinstance(doc.get("contexts", {}), dict) and all(
            isinstance(v, dict) for v in doc.get("contexts", {}).values())
    except ValueError:
        ok = False
    if not ok:
        raise ContextFileError(f"{p} is damaged (not a JSON object of contexts): fix it, or move it away and add the contexts again")
    doc.setdefault("contexts", {})
    doc.setdefault("current", None)
    return doc
