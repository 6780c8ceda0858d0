"""Live client connections by group: producers (check-backs go to them) and consumers (`txmq groups` shows them)."""

from __future__ import annotations

from typing import Protocol

from txmq.wire import ErrorCode, TxmqError


class PushTarget(Protocol):
    conn_id: int

    def writable(self) -> bool: ...

    def push(self, op: str, fields: dict) -> None: ...

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
