"""A minimal raw-protocol client for broker tests (no txmq.client involved)."""

from __future__ import annotations

import asyncio
from typing import Any

from txmq import wire


class RawClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.decoder = wire.FrameDecoder(64 << 20)
        self.next_id = 0
        self.pushes: list[wire.Frame] = []
        self.replies: dict[int, wire.Frame] = {}

    @classmethod
    async def open(cls, address: str) -> "RawClient":
        host, port = address.rsplit(":", 1)
        r, w = await asyncio.open_connection(host, int(port))
        return cls(r, w)

    def send_raw(self, data: bytes) -> None:
        self.writer.write(data)

    # The default waits are upper bounds for a loaded machine (a 100,000-ref request took >10 s at load 10), not margins.
    async def read_frame(self, timeout: float = 60.0) -> wire.Frame | None:
        while True:
            for f in self._pending_frames():
                return f
            data = await asyncio.wait_for(self.reader.read(1 << 16), timeout)
            if not data:
                return None
            self._buf_frames = [wire.parse_payload(p) for p in self.decoder.feed(data)]

    def _pending_frames(self):
        frames = getattr(self, "_buf_frames", [])
        while frames:
            yield frames.pop(0)

    async def req(self, op: str, fields: dict[str, Any] | None = None, timeout: float = 60.0) -> tuple[int, dict[str, Any]]:
        """Send one request and wait for its reply; returns (code, fields). Pushes are kept."""
        self.next_id += 1
        rid = self.next_id
        self.writer.write(wire.request(rid, op, fields or {}))
        while rid not in self.replies:
            f = await self.read_frame(timeout)
            if f is None:
                raise ConnectionError("closed by broker")
            if f.kind == wire.PUSH:
                self.pushes.append(f)
            else:
                self.replies[f.id] = f
        f = self.replies.pop(rid)
        return int(f.op), f.fields

    async def ok(self, op: str, fields: dict[str, Any] | None = None) -> dict[str, Any]:
        code, f = await self.req(op, fields)
        assert code == 0, (op, code, f)
        return f

    async def wait_push(self, timeout: float = 60.0) -> wire.Frame:
        while not self.pushes:
            f = await self.read_frame(timeout)
            if f is None:
                raise ConnectionError("closed by broker")
            if f.kind == wire.PUSH:
                self.pushes.append(f)
            else:
                self.replies[f.id] = f
        return self.pushes.pop(0)

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except Exception:
            pass
