"""How clients name a transaction: its id, or the id with its half copy's offsets (the form txmq gave SDKs before).

A transaction's id is its half message's ``UNIQ_KEY``: for a RocketMQ SDK
producer the message id it sent, which is also what RocketMQ hands out as
the transaction id (docs/rocketmq.md, "Ids"). Until RocketMQ's form was
adopted, txmq's gRPC front end handed SDK producers
``<tx_id>:<commit-log offset>:<half offset>`` instead; SDKs and logs may
still hold that form, so the gRPC EndTransaction and the operator's
requests that name a transaction by id (``tx_resolve``, ``tx_history``,
``discard_replay``: ``txmq resolve``, ``txmq inspect tx``, ``txmq discard
replay``) still take it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .index import IndexRowDamaged

if TYPE_CHECKING:
    from .index import TxIndex

OFFSET_LIMIT = 1 << 62  # no offset reaches it (the wire's integers)


def split_with_offsets(text: str) -> tuple[str, int, int] | None:
    """(tx_id, commit-log offset, half offset) of ``<tx_id>:<commit-log offset>:<half offset>``, else None."""
    parts = text.rsplit(":", 2)
    if len(parts) != 3 or not parts[0]:
        return None
    cl, half = parts[1], parts[2]
    if not (cl.isascii() and cl.isdigit() and half.isascii() and half.isdigit()) or len(cl) > 19 or len(half) > 19:
        return None
    c, h = int(cl), int(half)
    if c >= OFFSET_LIMIT or h >= OFFSET_LIMIT:
        return None
    return parts[0], c, h


def known(index: TxIndex, tx_id: str) -> bool:
    """A transaction has this id: pending, or decided and still on record (a damaged row counts: it holds the id)."""
    if tx_id in index.pending:
        return True
    try:
        return index.lookup(tx_id) is not None
    except IndexRowDamaged:
        return True


def canonical(index: TxIndex, text: str) -> str:
    """The transaction id ``text`` names: itself when a transaction has that id, else the id of the form with offsets.

    An id is never taken apart when a transaction has it as a whole (a
    native producer may choose ids with colons); otherwise the text is
    returned as it is, for the caller's "not found".
    """
    if text in index.pending:
        return text
    parts = split_with_offsets(text)
    if parts is None or known(index, text):
        return text
    return parts[0]
