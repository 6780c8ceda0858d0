"""Topic table: queue counts, auto-creation, name rules; persisted in topics.json."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

from txmq.constants import DISCARD_TOPIC, HALF_TOPIC, OP_TOPIC, TOPIC_RE, canonical_topic, is_system_topic
from txmq.store import StoreError, atomic_write_json, read_json
from txmq.store.files import move_aside
from txmq.wire import ErrorCode, TxmqError

log = logging.getLogger("txmq.broker")


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


class TopicTable:
    def __init__(self, path: Path, default_queues: int) -> None:
        self.path = path
        self.default_queues = default_queues
        self._rr = itertools.count()  # pick_queue's round robin, over every topic
        self._queues: dict[str, int] = {HALF_TOPIC: 1, OP_TOPIC: 1, DISCARD_TOPIC: 1}
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

    def merge_from_store(self, queues: dict[str, list[int]]) -> None:
        """Topics present in the store but missing from topics.json (e.g. lost file)."""
        changed = False
        for name, qids in queues.items():
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
        atomic_write_json(self.path, {k: v for k, v in self._queues.items() if not is_system_topic(k)})

    def queues(self, topic: str) -> int | None:
        return self._queues.get(topic)

    def ensure(self, topic: str, queues: int | None = None) -> tuple[int, bool]:
        """The topic's queue count, creating it if missing. Returns (queues, created)."""
        n = self._queues.get(topic)
        if n is not None:
            return n, False
        n = queues or self.default_queues
        if not (1 <= n <= 1024):
            raise TxmqError("queues must be between 1 and 1024", ErrorCode.INVALID_FIELD)
        self._queues[topic] = n
        self.save()
        return n, True

    def pick_queue(self, topic: str, queue_id: int | None) -> int:
        """The queue a send goes to: queue_id if the topic has it, else the next one round-robin (None or < 0)."""
        n, _ = self.ensure(topic)
        if queue_id is None or queue_id < 0:
            return next(self._rr) % n
        if queue_id >= n:
            raise TxmqError(f"queue {queue_id} does not exist: topic {topic} has {n} queues", ErrorCode.NO_SUCH_QUEUE)
        return queue_id

    def all(self) -> dict[str, int]:
        return dict(self._queues)
