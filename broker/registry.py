"""Live client connections by producer group, for check-backs."""

from __future__ import annotations

from typing import Protocol


class PushTarget(Protocol):
    conn_id: int

    def writable(self) -> bool: ...

    def push(self, op: str, fields: dict) -> None: ...

    def send_frame(self, frame: bytes) -> None: ...


class ProducerRegistry:
    def __init__(self) -> None:
        self._groups: dict[str, list[PushTarget]] = {}
        self._rr: dict[str, int] = {}

    def register(self, group: str, conn: PushTarget) -> None:
        conns = self._groups.setdefault(group, [])
        if conn not in conns:
            conns.append(conn)

    def unregister_all(self, conn: PushTarget) -> None:
        for group in [g for g, cs in self._groups.items() if conn in cs]:
            self._groups[group].remove(conn)
            if not self._groups[group]:
                del self._groups[group]

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
