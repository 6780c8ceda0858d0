"""What the messaging service answers its front ends: frozen records and status enums, never dicts.

A front end words these in its own protocol (a native reply map, a
RocketMQ 4 response's header fields, a RocketMQ 5 protobuf entry); what
they mean is decided once, in broker/messaging/service.py.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..registry import CheckBack, PushTarget
from ..transactions.service import MAX_NAME
from txmq.store import Record, StoreError

# Re-exported: a front end takes them from here (it imports neither the registry, the transaction subsystem nor the
# store). MAX_NAME: the longest transaction id and producer group a transaction can have; Record: a stored message.
__all__ = ["CheckBack", "PushTarget", "StoreError", "Record", "MAX_NAME"]


class MessageKind(str, enum.Enum):
    """A message's type as a topic accepts it (``txmq topics create --message-types``): the send planner's verdict."""

    NORMAL = "normal"
    TRANSACTION = "transaction"
    DELAY = "delay"
    FIFO = "fifo"


@dataclass(frozen=True, slots=True)
class SendRules:
    """What a protocol can express, so that one planner serves every front end.

    ``message_types``: check each message's type against the types its topic
    accepts (RocketMQ 5 and the native protocol have topic message types;
    RocketMQ 4 has none, and every 4.x send is taken as a normal one).
    ``message_groups``: a ``__SHARDINGKEY`` property is a FIFO message group
    that chooses the queue (RocketMQ 4's clients choose the queue themselves).
    """

    message_types: bool = True
    message_groups: bool = True


NATIVE_RULES = SendRules()
ROCKETMQ5_RULES = SendRules()
ROCKETMQ4_RULES = SendRules(message_types=False, message_groups=False)


class Outgoing(NamedTuple):
    """A message as a front end hands it over: the planner chooses its type and queue from its properties (one per
    message on the hot path: a NamedTuple)."""

    body: bytes
    properties: dict[str, str]
    born_ts: int


_new = tuple.__new__


class SendReceipt(NamedTuple):
    """One stored message: where it went, and for a scheduled or a half message, what that adds.

    Immutable, as every answer here; a NamedTuple rather than a frozen
    dataclass because one is built per message on the hottest path (a
    frozen dataclass costs several times as much to build).

    ``queue_offset`` is -1 for a scheduled message (it reaches its queue when
    due, at ``deliver_at_ms``); a half message's ``half_offset`` is its place
    in the half queue and ``msg_id`` its transaction id. ``resent``: the
    client sent a half message again under an id still pending in the same
    topic and group (its first answer did not come in time): this is the
    first one's receipt, and nothing was written.
    """

    msg_id: str
    topic: str
    queue_id: int
    queue_offset: int
    commit_log_offset: int
    deliver_at_ms: int | None = None
    half_offset: int | None = None
    resent: bool = False

    @property
    def transactional(self) -> bool:
        return self.half_offset is not None

    @property
    def scheduled(self) -> bool:
        return self.deliver_at_ms is not None

    @classmethod
    def of_row(cls, row: dict[str, Any]) -> SendReceipt:
        """The receipt of a row as the core's, the schedule's and the transaction service's appends shape it."""
        half = row.get("half_offset")
        # tuple.__new__: every field given, without the generated __new__'s keyword handling (once per message)
        return _new(cls, (row["msg_id"], row["topic"], row["queue_id"], row.get("queue_offset", -1) if half is None else half,
                          row["commit_log_offset"], row.get("deliver_at_ms"), half, False))


class EndStatus(str, enum.Enum):
    """What an end of a transaction did."""

    DECIDED = "ok"  # this request committed or rolled it back
    ALREADY = "already"  # it had that outcome already (a repeated end, or a check-back answered twice)
    UNCHANGED = "noop"  # UNKNOWN: it stays as it is (pending, usually)


_END_STATUS = {s.value: s for s in EndStatus}


class EndOutcome(NamedTuple):
    """The one answer to an end of a transaction, whichever protocol ended it (a NamedTuple: one per transaction)."""

    tx_id: str
    status: EndStatus
    outcome: str  # committed, rolled_back, pending, discarded
    decided_by: str | None = None  # for ALREADY: producer, check, operator, ...
    committed: SendReceipt | None = None  # for a commit this request decided: where the message now is

    @classmethod
    def of_reply(cls, tx_id: str, reply: dict[str, Any]) -> EndOutcome:
        committed = None
        if "commit_log_offset" in reply:
            committed = SendReceipt(tx_id, reply["topic"], reply["queue_id"], reply["queue_offset"], reply["commit_log_offset"])
        return cls(tx_id, _END_STATUS[reply.get("status", "ok")], reply.get("outcome", "pending"), reply.get("decided_by"), committed)

    def remark(self) -> str:
        """The outcome in words, as RocketMQ 4 responses carry it in their remark and RocketMQ 5's in the status message."""
        if self.status is EndStatus.ALREADY:
            return f"transaction {self.tx_id} was already {self.outcome} (by {self.decided_by})"
        if self.status is EndStatus.UNCHANGED:
            return f"transaction {self.tx_id} stays {self.outcome}: the resolution is neither COMMIT nor ROLLBACK"
        return f"transaction {self.tx_id} {self.outcome}"


@dataclass(frozen=True, slots=True)
class TxRef:
    """The half copy an end of a transaction names: the transaction's id and the copy's two offsets."""

    tx_id: str
    commit_log_offset: int
    half_offset: int


class PullStatus(str, enum.Enum):
    FOUND = "found"
    NO_MESSAGE = "no_message"  # nothing new (after the wait)
    OFFSET_TOO_SMALL = "offset_too_small"  # below the queue's first message (retention deleted it)
    OFFSET_OVERFLOW = "offset_overflow"  # past the queue's end
    NO_QUEUE = "no_queue"  # no such topic or queue


@dataclass(frozen=True, slots=True)
class PullResult:
    status: PullStatus
    messages: list[dict[str, Any]]  # record_to_map's maps (broker/records.py)
    next_offset: int
    min_offset: int
    max_offset: int

    @classmethod
    def of_reply(cls, r: dict[str, Any]) -> PullResult:
        return cls(PullStatus(r["status"]), r["messages"], r["next_offset"], r["min_offset"], r["max_offset"])


@dataclass(frozen=True, slots=True)
class SentBack:
    """A message its consumer failed, stored again: in its group's retry topic (delayed), or its dead-letter topic."""

    receipt: SendReceipt
    dead_lettered: bool
