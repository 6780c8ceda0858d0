"""A received message as a CLI row (consume output, the checker's --exec input)."""

from __future__ import annotations

import base64
from typing import Any

from rich.markup import escape

HIDDEN_PROPS = ("TAGS", "KEYS")


def message_row(m: Any) -> dict[str, Any]:
    """Keys: topic, queue_id, queue_offset, commit_log_offset, msg_id, tx_id (transactional only),
    tags, keys, properties (all but TAGS and KEYS), body or body_base64, born_at, stored_at."""
    row: dict[str, Any] = {
        "topic": m.topic, "queue_id": m.queue_id, "queue_offset": m.queue_offset,
        "commit_log_offset": m.commit_log_offset, "msg_id": m.msg_id,
    }
    if m.tx_id:
        row["tx_id"] = m.tx_id
    row["tags"] = m.tags
    row["keys"] = m.keys
    row["properties"] = {k: v for k, v in (m.properties or {}).items() if k not in HIDDEN_PROPS}
    body = bytes(m.body or b"")
    try:
        row["body"] = body.decode("utf-8")
    except UnicodeDecodeError:
        row["body_base64"] = base64.b64encode(body).decode("ascii")
    row["born_at"] = m.born_ts or None
    row["stored_at"] = m.store_ts or None
    return row


def message_line(row: dict[str, Any]) -> str:
    """One rich-markup line for a terminal."""
    head = f"[key]{escape(row['topic'])}[/key][dim][{row['queue_id']}]@{row['queue_offset']}[/dim]"
    bits = []
    if row.get("tx_id"):
        bits.append(f"[dim]tx[/dim]={row['tx_id']}")
    if row.get("tags"):
        bits.append(f"[dim]tags[/dim]={escape(row['tags'])}")
    if row.get("keys"):
        bits.append(f"[dim]keys[/dim]={escape(row['keys'])}")
    body = row["body"] if "body" in row else f"(base64) {row['body_base64']}"
    return " ".join([head, *bits, escape(body)])
