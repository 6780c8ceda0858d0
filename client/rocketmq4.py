"""A client of a RocketMQ 4 cluster through its remoting protocol: the name server for routes and brokers, the
brokers for topics, sends and consumer offsets. What `txmq migrate` writes to the target with.

Frames, properties and batch bodies are ``txmq.remoting_codec`` (the broker's remoting front end reads them with
the same code). One connection per address, requests pipelined on it (``opaque`` ties a response to its request).
The request and response fields are RocketMQ 4.9.8's (``SendMessageRequestHeaderV2``: the one-letter names;
``CreateTopicRequestHeader``, ``UpdateConsumerOffsetRequestHeader``, ...). Bodies that RocketMQ's name server and
broker write with fastjson (routes, the cluster) are read with ``load_fastjson``.

Errors: `TargetUnreachable` (nothing listens, or the connection dropped), `NotRocketMQ` (something answers, but not
RocketMQ's protocol), `RemotingError` (RocketMQ answered a request with an error code: its code and remark).
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from txmq import remoting_codec as rc

DEFAULT_TIMEOUT_S = 10.0
MAX_RESPONSE = 64 << 20  # a response frame larger than this is not RocketMQ's
PRODUCER_GROUP = "txmq-migrate"
TEMPLATE_TOPIC = "TBW102"  # RocketMQ's default topic, which a send names for auto-creation
PERM_READ_WRITE = 6


class RemotingError(Exception):
    """RocketMQ answered a request with an error: ``code`` (RocketMQ's ResponseCode) and its remark."""

    def __init__(self, message: str, code: int = rc.SYSTEM_ERROR, address: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.address = address


class TargetUnreachable(RemotingError):
    """Nothing answers at the address, or the connection dropped (a request in flight may or may not have been done).

    ``sent`` is False when the request never left (no connection could be opened): it was certainly not done."""

    def __init__(self, message: str, code: int = rc.SYSTEM_ERROR, address: str = "", sent: bool = True) -> None:
        super().__init__(message, code, address)
        self.sent = sent


class NotRocketMQ(RemotingError):
    """Something answers at the address, but not in RocketMQ's remoting protocol."""


def split_address(addr: str) -> tuple[str, int]:
    host, sep, port = addr.strip().rpartition(":")
    if not sep or not port.isdigit() or not host or not 0 < int(port) < 65536:
        raise ValueError(f"bad RocketMQ address {addr!r}: use HOST:PORT (name servers: HOST:PORT;HOST:PORT)")
    return host.strip("[]"), int(port)


class RemotingConnection:
    """One TCP connection speaking RocketMQ's remoting protocol, requests pipelined."""

    def __init__(self, address: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.address = address
        self._reader, self._writer = reader, writer
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[rc.Command]] = {}
        self._error: RemotingError | None = None
        self._task = asyncio.get_running_loop().create_task(self._read_loop())

    @classmethod
    async def open(cls, address: str, timeout: float = DEFAULT_TIMEOUT_S) -> "RemotingConnection":
        host, port = split_address(address)
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=1 << 20), timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            why = "no answer" if isinstance(exc, asyncio.TimeoutError) else (exc.strerror or str(exc))
            raise TargetUnreachable(f"cannot connect to {address}: {why}", address=address, sent=False) from None
        sock = writer.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        return cls(address, reader, writer)

    @property
    def closed(self) -> bool:
        return self._error is not None

    async def _read_loop(self) -> None:
        try:
            while True:
                head = await self._reader.readexactly(4)
                n = int.from_bytes(head, "big")
                if not 4 <= n <= MAX_RESPONSE:
                    raise NotRocketMQ(f"{self.address} does not speak RocketMQ's remoting protocol (a frame of {n} bytes; "
                                      f"first bytes {head!r})", address=self.address)
                payload = await self._reader.readexactly(n)
                try:
                    cmd = rc.decode(payload)
                except rc.FrameError as exc:
                    raise NotRocketMQ(f"{self.address} does not speak RocketMQ's remoting protocol ({exc})", address=self.address) from None
                if not cmd.is_response:
                    continue  # the broker's own requests (none is expected by a producer that registered nothing)
                fut = self._waiting.pop(cmd.opaque, None)
                if fut is not None and not fut.done():
                    fut.set_result(cmd)
        except RemotingError as exc:
            self._fail(exc)
        except (asyncio.IncompleteReadError, OSError) as exc:
            self._fail(TargetUnreachable(f"the connection to {self.address} was lost ({type(exc).__name__})", address=self.address))
        except asyncio.CancelledError:
            self._fail(TargetUnreachable(f"the connection to {self.address} was closed", address=self.address))
            raise

    def _fail(self, exc: RemotingError) -> None:
        if self._error is None:
            self._error = exc
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(self._error)
        self._waiting.clear()
        self._writer.close()

    async def request(self, code: int, ext: dict[str, Any], body: bytes = b"", timeout: float = DEFAULT_TIMEOUT_S) -> rc.Command:
        if isinstance(self._error, TargetUnreachable):  # the request does not leave
            raise TargetUnreachable(str(self._error), self._error.code, self.address, sent=False)
        if self._error is not None:
            raise self._error
        opaque = next(self._ids) & 0x7FFFFFFF
        fut: asyncio.Future[rc.Command] = asyncio.get_running_loop().create_future()
        self._waiting[opaque] = fut
        cmd = rc.Command(code=code, opaque=opaque, ext={k: str(v) for k, v in ext.items()}, body=body, language="PYTHON")
        self._writer.write(rc.encode(cmd))
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            self._waiting.pop(opaque, None)
            raise TargetUnreachable(f"{self.address} did not answer request {code} within {timeout:g} s", address=self.address) from None

    async def close(self) -> None:
        self._task.cancel()
        try:
            await self._task
        except (asyncio.CancelledError, Exception):
            pass
        self._writer.close()


def _check(resp: rc.Command, what: str, address: str) -> rc.Command:
    if resp.code != rc.SUCCESS:
        raise RemotingError(f"{what}: {address} answered code {resp.code}" + (f" ({resp.remark})" if resp.remark else ""),
                            resp.code, address)
    return resp


@dataclass
class BrokerInfo:
    name: str
    cluster: str
    addresses: dict[int, str]  # broker id (0: the master) -> address

    @property
    def master(self) -> str | None:
        return self.addresses.get(0)


@dataclass
class TopicRoute:
    topic: str
    queues: dict[str, int]  # broker name -> write queue count
    read_queues: dict[str, int] = field(default_factory=dict)
    brokers: dict[str, BrokerInfo] = field(default_factory=dict)


@dataclass
class SendReceipt:
    queue_id: int
    queue_offset: int  # of the first message (a batch's messages are stored one after the other)
    msg_ids: list[str]


class RocketMQ4:
    """A RocketMQ 4 cluster, reached through its name server(s) (``host:port;host:port``)."""

    def __init__(self, namesrv: str, timeout: float = DEFAULT_TIMEOUT_S, producer_group: str = PRODUCER_GROUP) -> None:
        self.namesrvs = [a.strip() for a in namesrv.split(";") if a.strip()]
        if not self.namesrvs:
            raise ValueError("no name server address")
        for a in self.namesrvs:
            split_address(a)
        self.timeout = timeout
        self.producer_group = producer_group
        self._conns: dict[str, RemotingConnection] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def conn(self, address: str) -> RemotingConnection:
        c = self._conns.get(address)
        if c is not None and not c.closed:
            return c
        lock = self._locks.setdefault(address, asyncio.Lock())
        async with lock:
            c = self._conns.get(address)
            if c is None or c.closed:
                c = await RemotingConnection.open(address, self.timeout)
                self._conns[address] = c
            return c

    async def close(self) -> None:
        for c in list(self._conns.values()):
            await c.close()
        self._conns.clear()

    async def _namesrv(self, code: int, ext: dict[str, Any]) -> rc.Command:
        last: RemotingError | None = None
        for addr in self.namesrvs:
            try:
                c = await self.conn(addr)
                return await c.request(code, ext, timeout=self.timeout)
            except NotRocketMQ:
                raise
            except TargetUnreachable as exc:
                last = exc
        assert last is not None
        raise last

    # ---- the name server ---------------------------------------------------------------------
    async def cluster(self) -> dict[str, BrokerInfo]:
        """Every broker the name server knows (GET_BROKER_CLUSTER_INFO): name -> BrokerInfo."""
        resp = await self._namesrv(rc.GET_BROKER_CLUSTER_INFO, {})
        addr = self.namesrvs[0]
        _check(resp, "the cluster's brokers", addr)
        try:
            info = rc.load_fastjson(resp.body) if resp.body else {}
            table = info.get("brokerAddrTable") or {}
            return {name: BrokerInfo(name, b.get("cluster", ""), {int(k): v for k, v in (b.get("brokerAddrs") or {}).items()})
                    for name, b in sorted(table.items())}
        except (ValueError, AttributeError, TypeError) as exc:
            raise NotRocketMQ(f"{addr} answered GET_BROKER_CLUSTER_INFO with a body that is not RocketMQ's cluster info ({exc})",
                              address=addr) from None

    async def route(self, topic: str) -> TopicRoute | None:
        """The topic's route (GET_ROUTEINFO_BY_TOPIC), or None when the name server knows no such topic."""
        resp = await self._namesrv(rc.GET_ROUTEINFO_BY_TOPIC, {"topic": topic})
        if resp.code == rc.TOPIC_NOT_EXIST:
            return None
        _check(resp, f"the route of {topic}", self.namesrvs[0])
        data = rc.load_fastjson(resp.body)
        route = TopicRoute(topic, {q["brokerName"]: int(q.get("writeQueueNums", 0)) for q in data.get("queueDatas") or []},
                           {q["brokerName"]: int(q.get("readQueueNums", 0)) for q in data.get("queueDatas") or []})
        for b in data.get("brokerDatas") or []:
            route.brokers[b["brokerName"]] = BrokerInfo(b["brokerName"], b.get("cluster", ""),
                                                         {int(k): v for k, v in (b.get("brokerAddrs") or {}).items()})
        return route

    # ---- a broker ----------------------------------------------------------------------------
    async def _broker(self, address: str, code: int, ext: dict[str, Any], body: bytes = b"", what: str = "") -> rc.Command:
        c = await self.conn(address)
        return _check(await c.request(code, ext, body, timeout=self.timeout), what or f"request {code}", address)

    async def broker_config(self, address: str) -> dict[str, str]:
        """The broker's settings (GET_BROKER_CONFIG: ``key=value`` lines)."""
        resp = await self._broker(address, rc.GET_BROKER_CONFIG, {}, what="the broker's configuration")
        out = {}
        for line in resp.body.decode(errors="replace").splitlines():
            k, sep, v = line.partition("=")
            if sep:
                out[k.strip()] = v.strip()
        return out

    async def create_topic(self, address: str, topic: str, queues: int, order: bool = False) -> None:
        """UPDATE_AND_CREATE_TOPIC on one broker: read and write queues both ``queues``."""
        await self._broker(address, rc.UPDATE_AND_CREATE_TOPIC, {
            "topic": topic, "defaultTopic": TEMPLATE_TOPIC, "readQueueNums": queues, "writeQueueNums": queues,
            "perm": PERM_READ_WRITE, "topicFilterType": "SINGLE_TAG", "topicSysFlag": 0, "order": "true" if order else "false",
        }, what=f"creating topic {topic}")

    def _send_header(self, topic: str, queue_id: int, props: str, batch: bool, flag: int = 0, reconsume_times: int = 0,
                     max_reconsume_times: int | None = None) -> dict[str, Any]:
        h = {"a": self.producer_group, "b": topic, "c": TEMPLATE_TOPIC, "d": 4, "e": queue_id, "f": 0,
             "g": int(time.time() * 1000), "h": flag, "i": props, "j": reconsume_times, "k": "false", "m": "true" if batch else "false"}
        if max_reconsume_times is not None:
            h["l"] = max_reconsume_times
        return h

    async def send_batch(self, address: str, topic: str, queue_id: int, messages: list[tuple[bytes, dict[str, str], int]]) -> SendReceipt:
        """SEND_BATCH_MESSAGE: (body, properties, flag) of each message, stored one after the other in the queue."""
        body = rc.encode_batch(messages)
        resp = await self._broker(address, rc.SEND_BATCH_MESSAGE, self._send_header(topic, queue_id, "", True), body,
                                  what=f"a batch send to {topic} queue {queue_id}")
        return _receipt(resp, queue_id)

    async def send(self, address: str, topic: str, queue_id: int, body: bytes, props: dict[str, str], flag: int = 0,
                   reconsume_times: int = 0, max_reconsume_times: int | None = None) -> SendReceipt:
        """SEND_MESSAGE_V2: one message (a ``DELAY`` level in its properties is honoured by the broker). ``reconsume_times``
        is stored as the message's reconsume count (a 4.x consumer's ``getReconsumeTimes()``); to a ``%RETRY%`` topic,
        the broker moves a message whose count reaches ``max_reconsume_times`` (default: the group's, 16) to the
        group's dead-letter topic, as it does a Java producer's."""
        header = self._send_header(topic, queue_id, rc.encode_properties(props), False, flag, reconsume_times, max_reconsume_times)
        resp = await self._broker(address, rc.SEND_MESSAGE_V2, header, body, what=f"a send to {topic} queue {queue_id}")
        return _receipt(resp, queue_id)

    async def update_offset(self, address: str, group: str, topic: str, queue_id: int, offset: int) -> None:
        await self._broker(address, rc.UPDATE_CONSUMER_OFFSET, {"consumerGroup": group, "topic": topic, "queueId": queue_id,
                                                                "commitOffset": offset}, what=f"committing {group}'s offset")

    async def query_offset(self, address: str, group: str, topic: str, queue_id: int) -> int | None:
        c = await self.conn(address)
        resp = await c.request(rc.QUERY_CONSUMER_OFFSET, {"consumerGroup": group, "topic": topic, "queueId": queue_id}, timeout=self.timeout)
        if resp.code == rc.QUERY_NOT_FOUND:
            return None
        _check(resp, f"{group}'s offset", address)
        return int(resp.ext.get("offset", "-1"))

    async def max_offset(self, address: str, topic: str, queue_id: int) -> int:
        resp = await self._broker(address, rc.GET_MAX_OFFSET, {"topic": topic, "queueId": queue_id}, what=f"the end of {topic} queue {queue_id}")
        return int(resp.ext.get("offset", "0"))


def _receipt(resp: rc.Command, queue_id: int) -> SendReceipt:
    ext = resp.ext
    ids = [i for i in (ext.get("msgId") or "").split(",") if i]
    return SendReceipt(int(ext.get("queueId", queue_id)), int(ext.get("queueOffset", "-1")), ids)


def delay_levels(config: dict[str, str]) -> list[float]:
    """The broker's ``messageDelayLevel`` table in seconds (level 1 first); RocketMQ's default when it names none."""
    text = config.get("messageDelayLevel") or "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h"
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    out = []
    for part in text.split():
        try:
            out.append(float(part[:-1]) * units[part[-1]])
        except (KeyError, ValueError):
            continue
    return out
