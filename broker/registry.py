"""Live client connections by group: producers (check-backs go to them) and consumers (`txmq groups` shows them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from txmq.constants import PROP_REAL_QID, PROP_REAL_TOPIC
from txmq.wire import ErrorCode, TxmqError


@dataclass(frozen=True, slots=True)
class CheckBack:
    """One check-back: the producer group holding the transaction is asked for its outcome (docs/transactions.md).

    The fields are those of the check copy the check service just wrote
    (its offsets are the ones an end of the transaction names); the
    properties hold the real topic and queue (``REAL_TOPIC``, ``REAL_QID``)
    the message goes to when committed.
    """

    group: str
    tx_id: str
    commit_log_offset: int
    half_offset: int
    born_ts: int
    store_ts: int
    prepared_offset: int
    properties: dict[str, str]
    body: bytes

    @property
    def topic(self) -> str:
        return self.properties.get(PROP_REAL_TOPIC, "")

    @property
    def queue_id(self) -> int:
        try:
            return int(self.properties.get(PROP_REAL_QID) or 0)
        except ValueError:
            return 0


class PushTarget(Protocol):
    """A producer's connection check-backs go to, whatever its protocol.

    ``takes_frames``: the native protocol's connections take the check
    service's pushes as encoded frames (``send_frame``: the check pass
    splices them from the stored bytes, its fast path); every other target
    takes ``CheckBack`` records and words them in its own protocol.
    """

    conn_id: int
    takes_frames: bool

    def writable(self) -> bool: ...

    def check_back(self, cb: CheckBack) -> None: ...

    def send_frame(self, frame: bytes) -> None: ...


# Groups one connection may be registered under: a hello names at most 64 of each kind, a
# RocketMQ producer stream one per topic it declares. Bounds what one client can make every
# broker_info reply, Prometheus scrape and connection close carry.
MAX_GROUPS_PER_CONN = 1024


class ClientRegistry:
    """The connections registered under each group, one registry per kind of client."""

    def __init__(self) -> None:
        self._groups: dict[str, list[PushTarget]] = {}
        self._rr: dict[str, int] = {}
        self._by_conn: dict[PushTarget, set[str]] = {}

    def register(self, group: str, conn: PushTarget) -> None:
        mine = self._by_conn.setdefault(conn, set())
        if group in mine:
            return
        if len(mine) >= MAX_GROUPS_PER_CONN:
            raise TxmqError(f"a connection may be registered under at most {MAX_GROUPS_PER_CONN} groups", ErrorCode.INVALID_FIELD)
        mine.add(group)
        self._groups.setdefault(group, []).append(conn)

    def unregister(self, group: str, conn: PushTarget) -> None:
        """Take the connection out of one group (a RocketMQ 4 client's UNREGISTER_CLIENT)."""
        mine = self._by_conn.get(conn)
        if mine is None or group not in mine:
            return
        mine.discard(group)
        if not mine:
            del self._by_conn[conn]
        self._leave(group, conn)

    def unregister_all(self, conn: PushTarget) -> None:
        for group in self._by_conn.pop(conn, ()):
            self._leave(group, conn)

    def _leave(self, group: str, conn: PushTarget) -> None:
        conns = self._groups.get(group)
        if conns is not None and conn in conns:
            conns.remove(conn)
            if not conns:
                del self._groups[group]
                self._rr.pop(group, None)

    def pick(self, group: str) -> PushTarget | None:
        """Round-robin over the group's connections, skipping ones not writable."""
        conns = self._groups.get(group)
        if not conns:
            return None
        n = len(conns)
        start = self._rr.get(group, 0)
        for i in range(n):
            conn = conns[(start + i) % n]
            if conn.writable():
                self._rr[group] = (start + i + 1) % n
                return conn
        return None

    def targets(self, group: str) -> list[PushTarget]:
        """The group's writable connections, starting one further each call (round-robin).

        The check service takes them once per batch of check-backs and
        spreads the batch over them, instead of a ``pick`` per check-back.
        """
        conns = [c for c in self._groups.get(group, ()) if c.writable()]
        if len(conns) > 1:
            start = self._rr.get(group, 0) % len(conns)
            self._rr[group] = start + 1
            conns = conns[start:] + conns[:start]
        return conns

    def online(self, group: str) -> int:
        return len(self._groups.get(group, ()))

    def groups(self) -> dict[str, int]:
        return {g: len(cs) for g, cs in self._groups.items()}
