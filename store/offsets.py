"""Consumer-group offsets: {group: {topic: {queue id: next offset}}}, kept in offsets.json.

Commits land in memory; ``persist`` writes the whole map atomically
(write a temp file, fsync, rename, fsync the directory) when it changed.
``persist`` may run in a worker thread while the owner thread commits.

Beside them, acks.json keeps, per group, topic and queue, the ranges of
queue offsets above the committed offset that are acknowledged already
(a consumer acknowledging out of order, RocketMQ's POP), so that a restart
does not deliver them again (docs/store-format.md, "Consumer offsets"). It is
written after offsets.json in the same ``persist``; an entry counts only
while its base is at or below the committed offset offsets.json holds (an
offset moved back from outside, whose acks.json did not follow, leaves it
out). A commit from outside (``commit`` without ``keep_acked``: a
consumer's commit_offset, an operator's reset) forgets the queue's ranges.
"""

from __future__ import annotations

import copy
import json
import os
import threading
from array import array
from typing import Iterable

from .errors import DataFileError, StoreError
from .files import atomic_write_bytes, atomic_write_json, read_json

ACKS_FILE = "acks.json"
ACKS_FORMAT = 1
_MAX_OFFSET = (1 << 63) - 1


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
        # (group, topic, queue id) -> acknowledged ranges above the offset, flat: start0, end0, start1, end1, ... (ends exclusive)
        self._acked: dict[tuple[str, str, int], array] = {}
        self._acks_dirty = False
        self.acks_path = os.path.join(os.path.dirname(self.path), ACKS_FILE)
        self.acks_problem: str | None = None  # why acks.json was not used (its messages are delivered again), for the log
        self.acks_loaded = 0  # queues whose ranges were taken from acks.json
        self._load_acks()

    def _load_acks(self) -> None:
        """Take acks.json's ranges that still apply; a file that does not read is left out whole (at-least-once holds)."""
        try:
            data = read_json(self.acks_path, None)
        except (StoreError, OSError, RecursionError) as exc:
            self.acks_problem = str(exc) or type(exc).__name__
            return
        if data is None:
            return
        if not isinstance(data, dict) or data.get("format") != ACKS_FORMAT or not isinstance(data.get("acked"), dict):
            self.acks_problem = f"{self.acks_path} is not an acks file of format {ACKS_FORMAT}"
            return
        bad = 0
        for group, topics in data["acked"].items():
            for topic, queues in (topics.items() if isinstance(topics, dict) else ()):
                for qid, entry in (queues.items() if isinstance(queues, dict) else ()):
                    ranges = _decode_entry(entry)
                    if ranges is None or not (str(qid).isascii() and str(qid).isdigit()):
                        bad += 1
                        continue
                    base, flat = ranges
                    committed = self.get(group, topic, int(qid))
                    if committed is None or base > committed:  # offsets.json moved back (or lost) since: not this offset's acks
                        continue
                    kept = _clip(flat, committed)
                    if kept:
                        self._acked[(group, topic, int(qid))] = kept
        if bad:
            self.acks_problem = f"{bad} entries of {self.acks_path} do not read as ranges of queue offsets"
        self.acks_loaded = len(self._acked)

    def get(self, group: str, topic: str, queue_id: int) -> int | None:
        return self._offsets.get(group, {}).get(topic, {}).get(queue_id)

    def commit(self, group: str, topic: str, queue_id: int, offset: int, *, keep_acked: bool = False) -> None:
        """Record offset in memory (persist() writes it).

        Without ``keep_acked`` (a commit from outside the owner of the
        queue's acknowledged ranges) the ranges are forgotten: what lies
        past the new offset is delivered again.
        """
        with self._lock:
            queues = self._offsets.setdefault(group, {}).setdefault(topic, {})
            if queues.get(queue_id) != offset:
                queues[queue_id] = offset
                self._dirty = True
            if not keep_acked and self._acked.pop((group, topic, queue_id), None) is not None:
                self._acks_dirty = True

    def acked(self, group: str, topic: str, queue_id: int) -> list[int]:
        """The acknowledged ranges above the queue's offset, flat: [start0, end0, start1, end1, ...], ends exclusive."""
        with self._lock:
            return list(self._acked.get((group, topic, queue_id), ()))

    def set_acked(self, group: str, topic: str, queue_id: int, ranges: Iterable[int]) -> None:
        """Replace the queue's acknowledged ranges (flat, ascending, ends exclusive); persist() writes them."""
        flat = array("q", ranges)
        key = (group, topic, queue_id)
        with self._lock:
            if flat:
                if self._acked.get(key) == flat:
                    return
                self._acked[key] = flat
            elif self._acked.pop(key, None) is None:
                return
            self._acks_dirty = True

    def persist(self) -> None:
        """Write the offsets, then the acknowledged ranges, each if it changed since the last persist."""
        with self._lock:
            snapshot = None
            if self._dirty:
                snapshot = {
                    g: {t: {str(q): o for q, o in qs.items()} for t, qs in ts.items()} for g, ts in self._offsets.items()
                }
                self._dirty = False
            acked = self._acks_snapshot() if self._acks_dirty else None
            self._acks_dirty = False
        acks = None if acked is None else json.dumps(
            {"format": ACKS_FORMAT, "acked": acked}, separators=(",", ":"), sort_keys=True).encode() + b"\n"
        try:
            if snapshot is not None:
                atomic_write_json(self.path, snapshot)
        except BaseException:
            with self._lock:
                self._dirty = True
                self._acks_dirty = self._acks_dirty or acks is not None
            raise
        try:
            if acks is not None:
                atomic_write_bytes(self.acks_path, acks)
        except BaseException:
            with self._lock:
                self._acks_dirty = True
            raise

    def _acks_snapshot(self) -> dict[str, dict[str, dict[str, list[int]]]]:
        """acks.json's entries (under the lock): each queue's ranges above its offset now, as gaps and lengths from it."""
        out: dict[str, dict[str, dict[str, list[int]]]] = {}
        for key in list(self._acked):
            group, topic, qid = key
            base = self.get(group, topic, qid)
            kept = _clip(self._acked[key], base) if base is not None else None
            if not kept:  # the offset passed them all (or is gone): nothing to keep
                del self._acked[key]
                continue
            self._acked[key] = kept
            out.setdefault(group, {}).setdefault(topic, {})[str(qid)] = _encode_entry(base, kept)
        return out

    @property
    def dirty(self) -> bool:
        return self._dirty

    def all(self) -> dict[str, dict[str, dict[int, int]]]:
        """A copy: {group: {topic: {queue id: offset}}}."""
        with self._lock:
            return copy.deepcopy(self._offsets)


def _clip(flat: Iterable[int], floor: int) -> array:
    """The ranges (flat, ascending) above floor, a range across it cut at it."""
    out = array("q")
    it = iter(flat)
    for start, end in zip(it, it):
        if end <= floor:
            continue
        out.append(max(start, floor))
        out.append(end)
    return out


def _encode_entry(base: int, flat: array) -> list[int]:
    """[base, gap0, length0, gap1, length1, ...]: each range's start is the previous end (first: base) plus its gap."""
    entry = [base]
    prev = base
    it = iter(flat)
    for start, end in zip(it, it):
        entry.append(start - prev)
        entry.append(end - start)
        prev = end
    return entry


def _decode_entry(entry: object) -> tuple[int, array] | None:
    """(base, flat ranges) of an acks.json entry, or None when it is not one (never raises)."""
    if not isinstance(entry, list) or len(entry) % 2 != 1 or not all(type(x) is int for x in entry):
        return None
    base = entry[0]
    if not 0 <= base <= _MAX_OFFSET:
        return None
    flat = array("q")
    prev = base
    for i in range(1, len(entry), 2):
        gap, length = entry[i], entry[i + 1]
        if gap < 0 or length < 1 or prev + gap + length > _MAX_OFFSET:
            return None
        flat.append(prev + gap)
        prev += gap + length
        flat.append(prev)
    return base, flat
