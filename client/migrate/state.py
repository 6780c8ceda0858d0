"""The progress of a migration, kept durably in one JSON file: re-running the same command continues from it.

Written whole each time, to a temporary file beside it that is fsynced, renamed over the old one, and the folder
fsynced: a crash leaves the old file or the new one, never a mix. What it holds:

- ``plan``: the snapshot the run started from (each queue's copy range and each group's position in it), so a
  resumed run copies exactly the same messages and commits the same offsets, whatever happened on txmq since;
- per queue, ``runs``: the confirmed copies, ``[source start, source end, target start]`` (the target's queue
  offset of the first one; a batch's messages are stored one after the other), merged when contiguous;
  ``inflight``: the source range of the batch sent and not yet confirmed (written before the send): a resumed run
  sends it again and counts its messages as possible duplicates;
- ``scheduled``: the scheduled messages sent on (by their commit-log offset on txmq) and those in flight;
- ``offsets_committed``, ``follow``: where forwarding got to, ``duplicates_possible``: the count so far.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

VERSION = 1


class StateError(Exception):
    """The state file cannot be used (damaged, another broker's or another target's)."""


def qkey(topic: str, queue_id: int) -> str:
    return f"{topic}/{queue_id}"


class State:
    def __init__(self, path: Path, data: dict[str, Any]) -> None:
        self.path = path
        self.data = data
        self.writes = 0

    @classmethod
    def load(cls, path: Path) -> "State | None":
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StateError(f"cannot read the state file {path}: {exc.strerror or exc}") from None
        try:
            data = json.loads(text)
        except ValueError:
            raise StateError(f"the state file {path} is not JSON: move it away to start over") from None
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise StateError(f"the state file {path} is not a txmq migrate state (version {VERSION})")
        return cls(path, data)

    @classmethod
    def new(cls, path: Path, source: dict[str, Any], target: str, plan: dict[str, Any]) -> "State":
        queues = {}
        for q in plan["queues"]:
            queues[qkey(q["topic"], q["queue_id"])] = {"next": q["start"], "runs": [], "inflight": None, "skipped": 0}
        data = {"version": VERSION, "created_at_ms": int(time.time() * 1000), "source": source, "target": target, "plan": plan,
                "queues": queues, "scheduled": {"moved": {}, "inflight": []}, "offsets_committed": False, "follow": {},
                "duplicates_possible": 0, "runs": 0}
        return cls(path, data)

    def save(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        payload = json.dumps(self.data, separators=(",", ":")).encode()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        dfd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        self.writes += 1

    # ---- queues ------------------------------------------------------------------------------
    def queue(self, topic: str, queue_id: int) -> dict[str, Any]:
        return self.data["queues"][qkey(topic, queue_id)]

    @staticmethod
    def add_run(qs: dict[str, Any], src_start: int, src_end: int, tgt_start: int) -> None:
        runs = qs["runs"]
        if runs:
            s, e, t = runs[-1]
            if e == src_start and t + (e - s) == tgt_start:
                runs[-1][1] = src_end
                return
        runs.append([src_start, src_end, tgt_start])


def target_offset(runs: list[list[int]], position: int, base: int) -> int:
    """Where a group at source ``position`` starts on the target: the target offset of the first copied message at or
    after it; past every copy, the end of the last one; with no copy at all, ``base`` (the target's end at the plan)."""
    for s, e, t in runs:
        if e > position:
            return t + max(0, position - s)
    if runs:
        s, e, t = runs[-1]
        return t + (e - s)
    return base
