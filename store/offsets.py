"""Consumer-group offsets: {group: {topic: {queue id: next offset}}}, kept in offsets.json.

Commits land in memory; ``persist`` writes the whole map atomically
(write a temp file, fsync, rename, fsync the directory) when it changed.
``persist`` may run in a worker thread while the owner thread commits.
"""

from __future__ import annotations

import copy
import os
import threading

from .errors import DataFileError, StoreError
from .files import atomic_write_json, read_json


class ConsumerOffsets:
    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self._lock = threading.Lock()
        self._offsets: dict[str, dict[str, dict[int, int]]] = {}
        self._dirty = False
        try:
            data = read_json(self.path, {})
        except StoreError as exc:  # not JSON
            data = exc
        if not isinstance(data, dict):
            # Starting without them would move every group to where its
            # consumers' "from" setting says, past messages never read with
            # "latest": a person decides.
            why = f"not JSON ({data.__cause__ or data})" if isinstance(data, Exception) else f"a JSON {type(data).__name__}, not an object"
            raise DataFileError(
                f"{self.path} (the committed offsets of consumer groups) is damaged: {why}. Restore it from a backup, "
                "or move it away to start without committed offsets (each group then starts where its consumers' "
                "--from says: earliest reads again from the first message, latest skips to the end)")
        for group, topics in data.items():
            if not isinstance(topics, dict):
                continue
            for topic, queues in topics.items():
                if not isinstance(queues, dict):
                    continue
                for qid, offset in queues.items():
                    if str(qid).isascii() and str(qid).isdigit() and isinstance(offset, int):
                        self._offsets.setdefault(group, {}).setdefault(topic, {})[int(qid)] = offset

    def get(self, group: str, topic: str, queue_id: int) -> int | None:
        return self._offsets.get(group, {}).get(topic, {}).get(queue_id)

    def commit(self, group: str, topic: str, queue_id: int, offset: int) -> None:
        """Record offset in memory (persist() writes it)."""
        with self._lock:
            queues = self._offsets.setdefault(group, {}).setdefault(topic, {})
            if queues.get(queue_id) != offset:
                queues[queue_id] = offset
                self._dirty = True

    def persist(self) -> None:
        """Write the offsets if they changed since the last persist."""
        with self._lock:
            if not self._dirty:
                return
            snapshot = {
                g: {t: {str(q): o for q, o in qs.items()} for t, qs in ts.items()} for g, ts in self._offsets.items()
            }
            self._dirty = False
        try:
            atomic_write_json(self.path, snapshot)
        except BaseException:
            with self._lock:
                self._dirty = True
            raise

    @property
    def dirty(self) -> bool:
        return self._dirty

    def all(self) -> dict[str, dict[str, dict[int, int]]]:
        """A copy: {group: {topic: {queue id: offset}}}."""
        with self._lock:
            return copy.deepcopy(self._offsets)
