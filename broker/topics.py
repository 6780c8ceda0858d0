"""Topic table: queue counts, accepted message types, auto-creation, name rules; persisted in topics.json.

topics.json (docs/store-format.md, "topics.json") maps each topic to its
queue count, as it always did, and keeps two more entries under keys no
topic can be named (a ``:`` is not allowed in a topic name):

- ``txmq:message_types``: the message types of the topics that accept
  other types than the default (normal and transaction);
- ``txmq:deleted``: topics deleted while the store still holds their
  queues, with their queue count, so that the start does not bring them
  back from the log (``merge_from_store``) and creating one again keeps
  its stored queues.

An older broker reads the queue counts and skips both entries.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Any, Iterable

from txmq.constants import (
    DEFAULT_MESSAGE_TYPES,
    DISCARD_TOPIC,
    HALF_TOPIC,
    MESSAGE_TYPES,
    OP_TOPIC,
    TOPIC_RE,
    canonical_topic,
    is_system_topic,
)
from txmq.store import StoreError, atomic_write_json, read_json
from txmq.store.files import move_aside
from txmq.wire import ErrorCode, TxmqError

log = logging.getLogger("txmq.broker")

MAX_QUEUES = 1024
_TYPES_KEY = "txmq:message_types"
_DELETED_KEY = "txmq:deleted"

_valid: dict[str, str] = {}  # names already checked -> canonical name (bounded below)


def check_topic_name(topic: object) -> str:
    name = _valid.get(topic) if isinstance(topic, str) else None
    if name is not None:
        return name
    if not isinstance(topic, str) or not TOPIC_RE.match(topic):
        raise TxmqError(f"invalid topic name {topic!r}: must match ^[%|a-zA-Z0-9_-]{{1,127}}$", ErrorCode.INVALID_TOPIC)
    if len(_valid) < 65536:
        _valid[topic] = canonical_topic(topic)
    return canonical_topic(topic)


def message_types_of(value: object) -> tuple[str, ...]:
    """A list of message type names as a request gives them: checked, without repeats, in MESSAGE_TYPES order."""
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(t, str) for t in value):
        raise TxmqError(f"message types must be a non-empty list of {', '.join(MESSAGE_TYPES)}", ErrorCode.INVALID_FIELD)
    names = {t.strip().lower() for t in value}
    unknown = sorted(names - set(MESSAGE_TYPES))
    if unknown:
        raise TxmqError(f"unknown message type {unknown[0][:40]!r}: one of {', '.join(MESSAGE_TYPES)}", ErrorCode.INVALID_FIELD)
    return tuple(t for t in MESSAGE_TYPES if t in names)


def no_such_topic(topic: str, why: str = "") -> TxmqError:
    """NO_SUCH_TOPIC naming the topic (``topic`` in the error's fields: the RocketMQ front end answers TOPIC_NOT_FOUND with it)."""
    return TxmqError(f"no topic {topic!r}{why}", ErrorCode.NO_SUCH_TOPIC, topic=topic)


class TopicTable:
    """Every topic's queue count and message types, in memory and in topics.json.

    ``auto_create``: a send to a topic not in the table creates it with the
    default queues and types (``pick_queue``); otherwise it is refused with
    NO_SUCH_TOPIC. ``ensure`` creates whatever ``auto_create`` says: the
    broker's own writes (a committed transaction, a dead-letter topic) and
    ``txmq topics create`` go through it.
    """

    def __init__(self, path: Path, default_queues: int, auto_create: bool = True) -> None:
        self.path = path
        self.default_queues = default_queues
        self.auto_create = auto_create
        self._rr = itertools.count()  # pick_queue's round robin, over every topic
        self._queues: dict[str, int] = {HALF_TOPIC: 1, OP_TOPIC: 1, DISCARD_TOPIC: 1}
        self._types: dict[str, tuple[str, ...]] = {}  # topics that accept other types than DEFAULT_MESSAGE_TYPES
        self._deleted: dict[str, int] = {}  # deleted topics -> their queue count then (kept out of merge_from_store)
        try:
            data = read_json(path, {})
        except StoreError as exc:  # not JSON
            data = exc
        if not isinstance(data, dict):
            # The queue counts come back from the store (merge_from_store): every
            # queue holding a message is found again; only topics with no message
            # yet are forgotten (a send creates them again).
            why = f"not JSON ({data.__cause__ or data})" if isinstance(data, Exception) else f"a JSON {type(data).__name__}, not an object"
            try:
                moved = str(move_aside(path))
            except OSError as exc:
                moved = f"not moved ({exc.strerror or exc})"
            log.warning("event=data_file_damaged file=%s why=%r moved_to=%s msg=%s", path, why, moved,
                        "'topics are taken from the log: a topic with no message yet must be created again'")
            data = {}
        for name, n in data.items():
            if isinstance(name, str) and isinstance(n, int) and n > 0:
                self._queues[name] = n
        self._load_extras(data)

    def _load_extras(self, data: dict[str, Any]) -> None:
        """The message types and the deleted topics; an entry that does not read is left out, with a warning."""
        types = data.get(_TYPES_KEY)
        bad: list[str] = []
        if isinstance(types, dict):
            for name, value in types.items():
                try:
                    t = message_types_of(value)
                except TxmqError:
                    bad.append(str(name))
                    continue
                if name in self._queues and not is_system_topic(name) and t != DEFAULT_MESSAGE_TYPES:
                    self._types[name] = t
        elif types is not None:
            bad.append(_TYPES_KEY)
        deleted = data.get(_DELETED_KEY)
        if isinstance(deleted, dict):
            for name, n in deleted.items():
                if isinstance(name, str) and isinstance(n, int) and 0 < n <= MAX_QUEUES and name not in self._queues:
                    self._deleted[name] = n
                else:
                    bad.append(str(name))
        elif deleted is not None:
            bad.append(_DELETED_KEY)
        if bad:
            log.warning("event=topics_entries_ignored file=%s entries=%s msg=%s", self.path, ",".join(bad[:20]),
                        "'those topics accept normal and transaction messages (the default); a deleted one may come back from the log'")

    def merge_from_store(self, queues: dict[str, list[int]]) -> None:
        """Topics present in the store but missing from topics.json (e.g. lost file); deleted ones stay deleted."""
        changed = False
        for name in [n for n in self._deleted if n not in queues]:  # retention emptied them: nothing left to keep out
            del self._deleted[name]
            changed = True
        for name, qids in queues.items():
            if name in self._deleted:
                continue
            need = max(qids) + 1 if qids else 1
            if self._queues.get(name, 0) < need:
                self._queues[name] = max(need, self.default_queues if not is_system_topic(name) else 1)
                changed = True
        if changed:
            try:
                self.save()
            except OSError as exc:  # a full disk: the table is right in memory, and found again at the next start
                log.warning("event=topics_write_failed file=%s error=%r", self.path, exc)

    def save(self) -> None:
        doc: dict[str, Any] = {k: v for k, v in self._queues.items() if not is_system_topic(k)}
        if self._types:
            doc[_TYPES_KEY] = {k: list(v) for k, v in self._types.items()}
        if self._deleted:
            doc[_DELETED_KEY] = dict(self._deleted)
        atomic_write_json(self.path, doc)

    # ---- reading ---------------------------------------------------------
    def queues(self, topic: str) -> int | None:
        return self._queues.get(topic)

    def message_types(self, topic: str) -> tuple[str, ...]:
        """The types a user topic accepts (a topic not in the table: those it would be created with)."""
        return self._types.get(topic, DEFAULT_MESSAGE_TYPES)

    def all(self) -> dict[str, int]:
        return dict(self._queues)

    # ---- creating, changing, deleting --------------------------------------
    def ensure(self, topic: str, queues: int | None = None, message_types: Iterable[str] | None = None) -> tuple[int, bool]:
        """The topic's queue count, creating it if missing. Returns (queues, created).

        A topic deleted while the store still holds its queues comes back
        with at least that many queues (its stored messages are readable
        again until retention deletes them).
        """
        n = self._queues.get(topic)
        if n is not None:
            return n, False
        n = queues or self.default_queues
        if not (1 <= n <= MAX_QUEUES):
            raise TxmqError(f"queues must be between 1 and {MAX_QUEUES}", ErrorCode.INVALID_FIELD)
        types = DEFAULT_MESSAGE_TYPES if message_types is None else tuple(message_types)
        deleted = self._deleted.pop(topic, None)
        self._queues[topic] = max(n, deleted or 0)
        if types != DEFAULT_MESSAGE_TYPES:
            self._types[topic] = types
        try:
            self.save()
        except BaseException:
            del self._queues[topic]
            self._types.pop(topic, None)
            if deleted is not None:
                self._deleted[topic] = deleted
            raise
        return self._queues[topic], True

    def update(self, topic: str, queues: int | None, message_types: tuple[str, ...] | None) -> dict[str, Any]:
        """Change a topic's queue count and message types; the old and new values.

        Whether queues may be removed is the caller's to check
        (``BrokerCore.update_topic``: only queues nothing was written to).
        """
        n = self._queues.get(topic)
        if n is None or is_system_topic(topic):
            raise no_such_topic(topic)
        old = {"queues": n, "message_types": list(self.message_types(topic))}
        new_n = n if queues is None else queues
        if not (1 <= new_n <= MAX_QUEUES):
            raise TxmqError(f"queues must be between 1 and {MAX_QUEUES}", ErrorCode.INVALID_FIELD)
        types = self.message_types(topic) if message_types is None else tuple(message_types)
        old_types = self._types.get(topic)
        self._queues[topic] = new_n
        if types == DEFAULT_MESSAGE_TYPES:
            self._types.pop(topic, None)
        else:
            self._types[topic] = types
        if new_n != n or types != tuple(old["message_types"]):
            try:
                self.save()
            except BaseException:
                self._queues[topic] = n
                if old_types is None:
                    self._types.pop(topic, None)
                else:
                    self._types[topic] = old_types
                raise
        return {"queues": new_n, "message_types": list(types), "old": old}

    def delete(self, topic: str) -> int:
        """Take a topic out of the table (its stored records stay); its queue count."""
        n = self._queues.get(topic)
        if n is None or is_system_topic(topic):
            raise no_such_topic(topic)
        types = self._types.pop(topic, None)
        del self._queues[topic]
        self._deleted[topic] = n
        try:
            self.save()
        except BaseException:
            self._queues[topic] = n
            del self._deleted[topic]
            if types is not None:
                self._types[topic] = types
            raise
        return n

    # ---- sending -----------------------------------------------------------
    def pick_queue(self, topic: str, queue_id: int | None, kind: str = "normal") -> int:
        """The queue a send goes to: queue_id if the topic has it, else the next one round-robin (None or < 0).

        ``kind``: the message's type (normal, transaction), which the topic
        must accept. A topic not in the table is created when ``auto_create``
        is on, else refused (NO_SUCH_TOPIC).
        """
        n = self._queues.get(topic)
        if n is None:
            if not self.auto_create:
                raise no_such_topic(topic, ": this broker creates topics only with `txmq topics create` "
                                           "(it runs with --no-auto-create-topics)")
            n, _ = self.ensure(topic)
        types = self._types.get(topic)
        if types is not None and kind not in types:
            raise TxmqError(f"topic {topic} does not accept {kind} messages: it accepts {', '.join(types)} "
                            f"(txmq topics update {topic} --message-types ...)", ErrorCode.MESSAGE_TYPE_NOT_ACCEPTED,
                            topic=topic, message_type=kind, message_types=list(types))
        if queue_id is None or queue_id < 0:
            return next(self._rr) % n
        if queue_id >= n:
            raise TxmqError(f"queue {queue_id} does not exist: topic {topic} has {n} queues", ErrorCode.NO_SUCH_QUEUE)
        return queue_id
