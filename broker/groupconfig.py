"""Consumer groups' settings, kept in groups.json: today whether a group consumes in order (FIFO).

RocketMQ keeps a subscription group's settings in its broker
(SubscriptionGroupConfig; ``consumeMessageOrderly`` is what its proxy
answers a consumer's settings with as ``subscription.fifo``). txmq keeps
them in the data directory's groups.json (docs/store-format.md,
"groups.json"), written atomically (temporary file, fsync, rename, fsync
of the directory) before a change is answered:

    {"format": 1, "groups": {"orders-fifo": {"fifo": true}}}

A data directory without it (older brokers wrote none) has no group
marked: every group consumes concurrently, as before. A file that does not
read refuses the start, as a damaged offsets.json does: starting without
it would hand a FIFO group's messages out of order, so a person decides
(restore it, or move it away). An entry that does not read is left out
with a warning. Unknown keys of an entry are kept, so that a newer
broker's settings survive an older one.

A group given a setting must have a name every consumer front end takes
(``GROUP_NAME_RE``): RocketMQ's rule for a group (TopicValidator.validateGroup,
which its broker applies when a subscription group is created or updated:
at most 120 characters of %|a-zA-Z0-9_-), without ``|``, which txmq's gRPC
consumers refuse (broker/messaging/naming.py). An older broker took any name of
1 to 255 characters: such an entry of groups.json still loads and can still
be changed (to take a FIFO mark off), but no new one is added.
"""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path
from typing import Any

from txmq.store import StoreError, atomic_write_json, read_json
from txmq.store.errors import DataFileError
from txmq.wire import ErrorCode, TxmqError

log = logging.getLogger("txmq.broker")

GROUPS_FILE = "groups.json"
FORMAT = 1
MAX_GROUPS = 100_000
MAX_GROUP_NAME = 255  # what an entry of groups.json may hold (an older broker's names)
MAX_NEW_GROUP_NAME = 120  # RocketMQ's GROUP_MAX_LENGTH: %RETRY%<group> is a topic name (127 characters)
GROUP_NAME_RE = re.compile(rf"^[%a-zA-Z0-9_-]{{1,{MAX_NEW_GROUP_NAME}}}\Z")  # \Z: `$` would let a trailing newline through


def group_name_problem(group: object) -> str | None:
    """Why ``group`` cannot be given a setting, or None when it can."""
    if isinstance(group, str) and GROUP_NAME_RE.match(group):
        return None
    return (f"consumer group {str(group)[:80]!r} is not a group name: 1 to {MAX_NEW_GROUP_NAME} characters of "
            "a-z A-Z 0-9 % _ - (RocketMQ's rule for a group; no white space)")


class GroupConfigTable:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._groups: dict[str, dict[str, Any]] = {}
        try:
            data = read_json(self.path, None)
        except StoreError as exc:
            data = exc
        if data is None:
            return
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("groups"), dict):
            why = f"not JSON ({data.__cause__ or data})" if isinstance(data, Exception) else f"not a groups file of format {FORMAT}"
            raise DataFileError(
                f"{self.path} (the consumer groups' settings: which consume in order) is damaged: {why}. Restore it from "
                "a backup, or move it away to start with every group consuming concurrently (mark the FIFO groups again: "
                "txmq groups update GROUP --fifo)")
        bad = []
        for name, entry in data["groups"].items():
            if isinstance(name, str) and 0 < len(name) <= MAX_GROUP_NAME and isinstance(entry, dict) \
                    and isinstance(entry.get("fifo", False), bool):
                self._groups[name] = dict(entry)
            else:
                bad.append(str(name)[:80])
        if bad:
            log.warning("event=groups_entries_ignored file=%s entries=%s msg=%s", self.path, ",".join(bad[:20]),
                        "'those groups consume concurrently (not FIFO) until updated'")

    def fifo(self, group: str) -> bool:
        entry = self._groups.get(group)
        return bool(entry is not None and entry.get("fifo"))

    def get(self, group: str) -> dict[str, Any]:
        """A group's settings, with the defaults for what it never set."""
        return {"fifo": self.fifo(group)}

    def configured(self) -> list[str]:
        return sorted(self._groups)

    def update(self, group: str, *, fifo: bool | None = None) -> dict[str, Any]:
        """Change a group's settings and write groups.json; {group, fifo, old: {fifo}, changed}."""
        with self._lock:
            # a name an older broker stored stays changeable; a new one must be a group name
            problem = None if isinstance(group, str) and group in self._groups else group_name_problem(group)
            if problem:
                raise TxmqError(problem, ErrorCode.INVALID_FIELD)
            old = self.get(group)
            entry = dict(self._groups.get(group, {}))
            if fifo is not None:
                entry["fifo"] = fifo
            changed = entry != self._groups.get(group, {})
            if changed:
                if group not in self._groups and len(self._groups) >= MAX_GROUPS:
                    raise TxmqError(f"{MAX_GROUPS} consumer groups have settings already: the limit", ErrorCode.INVALID_FIELD)
                before = self._groups.get(group)
                self._groups[group] = entry
                try:
                    self._save()
                except BaseException:
                    if before is None:
                        del self._groups[group]
                    else:
                        self._groups[group] = before
                    raise
            return {"group": group, **self.get(group), "old": old, "changed": changed}

    def _save(self) -> None:
        atomic_write_json(self.path, {"format": FORMAT, "groups": self._groups})
