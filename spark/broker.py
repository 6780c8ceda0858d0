"""Reading the `messages` table through a broker: options, planning, and the executors' pulls.

    spark.read.format("txmq").option("broker", "HOST:PORT").load()

Planning (on the driver) asks the broker for every queue's offsets with one
``queue_offsets`` request; each partition is a (topic, queue, [start, end))
range of queue offsets. An executor pulls its range over the native wire
protocol, two pulls in flight (the broker reads the next while this process
builds Arrow batches from the last), and checks that every queue offset of
the range arrives once: a gap (retention deleted records, a damaged record,
a broker that lost its unflushed tail) is an error unless
``failOnDataLoss=false`` says to skip it. A broker that goes away mid-read
is reconnected to for ``reconnectTimeout`` seconds, then the task fails
saying so; no request waits longer than ``timeout``.

Nothing here imports pyspark: the CLI and the tests use the planning alone.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import struct
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from txmq.constants import DISCARD_TOPIC, HALF_TOPIC, OP_TOPIC, canonical_topic, is_system_topic
from txmq.wire import ErrorCode, TxmqError, parse_payload, request

from .options import parse_time_ms

TX_TOPICS = (HALF_TOPIC, OP_TOPIC, DISCARD_TOPIC)
DEFAULT_PORT = 10911
PULL_COUNT = 10_000  # the most one pull returns
PULL_BYTES = 16 << 20
DEFAULT_MAX_RECORDS_PER_PARTITION = 2_000_000
EARLIEST, LATEST = -2, -1  # as in per-queue JSON offsets (the Kafka source's convention)
_log = logging.getLogger("txmq.spark")
_LEN = struct.Struct(">I")
_DIRECT = 256 << 10  # payloads this much larger than what is buffered are received straight into their own buffer


class BrokerReadError(RuntimeError):
    """A read through the broker that cannot go on; the message says why, for the driver's error."""


class Unreachable(BrokerReadError):
    """No connection to the broker could be opened."""


class DataLossError(BrokerReadError):
    """Records the plan counted on are gone (retention, damage, a broker that lost its tail)."""


# ---- a blocking wire client (executors: no event loop, no threads) ------------
class WireClient:
    """One connection, requests answered in order; every wait bounded by ``timeout``."""

    def __init__(self, address: str, token: str | None = None, timeout: float = 30.0) -> None:
        self.address = address
        self.host, self.port = parse_broker(address)
        self.timeout = timeout
        self._next_id = 1
        try:
            self.sock = socket.create_connection((self.host, self.port), timeout=min(timeout, 10.0))
        except OSError as e:
            raise Unreachable(f"cannot reach the txmq broker at {address}: {e.strerror or e}") from None
        self.sock.settimeout(timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = bytearray()
        try:
            self.info = self.call("hello", {"token": token} if token else {"client_id": "txmq-spark"})
        except TxmqError as e:
            self.close()
            if e.code in (ErrorCode.AUTH_FAILED, ErrorCode.AUTH_REQUIRED):
                why = "the token is wrong" if token else "it needs a token (option token)"
                raise BrokerReadError(f"the txmq broker at {address} refused the connection: {why}") from None
            raise

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def send(self, op: str, fields: dict[str, Any]) -> int:
        rid = self._next_id
        self._next_id += 1
        try:
            self.sock.sendall(request(rid, op, fields))
        except OSError as e:
            raise ConnectionError(f"lost the connection to {self.address}: {e}") from None
        return rid

    def _recv_exact(self, n: int) -> bytes | bytearray:
        buf = self._buf
        if n - len(buf) >= _DIRECT:  # a large payload (a pull's records): received in place, no copies after
            return self._recv_into(n)
        while len(buf) < n:
            try:
                chunk = self.sock.recv(max(n - len(buf), 1 << 20))
            except socket.timeout:
                raise ConnectionError(f"no answer from {self.address} within {self.timeout:g}s") from None
            except OSError as e:
                raise ConnectionError(f"lost the connection to {self.address}: {e}") from None
            if not chunk:
                raise ConnectionError(f"the broker at {self.address} closed the connection")
            buf += chunk
        out = bytes(buf[:n])
        del buf[:n]
        return out

    def _recv_into(self, n: int) -> bytearray:
        out = bytearray(n)
        have = len(self._buf)
        out[:have] = self._buf
        self._buf.clear()
        view = memoryview(out)
        while have < n:
            try:
                got = self.sock.recv_into(view[have:], n - have)
            except socket.timeout:
                raise ConnectionError(f"no answer from {self.address} within {self.timeout:g}s") from None
            except OSError as e:
                raise ConnectionError(f"lost the connection to {self.address}: {e}") from None
            if not got:
                raise ConnectionError(f"the broker at {self.address} closed the connection")
            have += got
        return out

    def receive(self, rid: int) -> dict[str, Any]:
        while True:
            (size,) = _LEN.unpack(self._recv_exact(4))
            payload = self._recv_exact(size)
            try:
                frame = parse_payload(payload)
            except TxmqError:
                raise ConnectionError(f"{self.address} sent something that is not a txmq frame") from None
            if frame.kind != 1 or frame.id != rid:
                if frame.kind == 1 and frame.id == 0 and frame.op != 0:  # the broker closing us, with why
                    raise TxmqError.from_reply(int(frame.op), frame.fields)
                continue  # a push, or a reply to a request we gave up on
            if frame.op != 0:
                raise TxmqError.from_reply(int(frame.op), frame.fields)
            return frame.fields

    def call(self, op: str, fields: dict[str, Any]) -> dict[str, Any]:
        return self.receive(self.send(op, fields))


def parse_broker(address: str) -> tuple[str, int]:
    a = address.strip()
    if not a:
        raise ValueError("option broker is empty: use HOST:PORT")
    m = re.match(r"^\[([^\]]+)\](?::(\d+))?$", a) or re.match(r"^([^:]+)(?::(\d+))?$", a)
    if not m:
        raise ValueError(f"bad broker address {address!r}: use HOST:PORT")
    port = int(m.group(2)) if m.group(2) else DEFAULT_PORT
    if not 0 < port < 65536:
        raise ValueError(f"bad broker port in {address!r}")
    return m.group(1), port


# ---- options -------------------------------------------------------------------
@dataclass(frozen=True)
class BrokerOptions:
    address: str
    token: str | None = None
    topics: tuple[str, ...] | None = None  # None: every user topic (or those matching pattern)
    pattern: str | None = None
    with_transactions: bool = True  # also read the transaction records (half, op, discard) of the chosen topics
    starting: Any = "earliest"  # "earliest" | "latest" | {topic: {queue: offset}} | ("time", ms)
    ending: Any = "latest"
    min_partitions: int = 1
    max_records_per_partition: int = DEFAULT_MAX_RECORDS_PER_PARTITION
    fail_on_data_loss: bool = True
    timeout_s: float = 30.0
    reconnect_s: float = 30.0
    pull_count: int = PULL_COUNT
    pull_bytes: int = PULL_BYTES
    since_ms: int | None = None
    until_ms: int | None = None
    kinds: frozenset[str] | None = None
    max_offsets_per_trigger: int | None = None
    table: str = "messages"  # or "transaction_events"
    raw: bool = True  # ask for raw pulls (records as stored) for the messages table

    @classmethod
    def from_options(cls, options, streaming: bool = False) -> "BrokerOptions":
        o = {str(k).lower(): v for k, v in dict(options).items() if v is not None}
        address, token = str(o.get("broker", "")).strip(), o.get("token") or None
        if o.get("context"):
            address, token = _from_context(str(o["context"]), address, token)
        parse_broker(address)
        topics = tuple(dict.fromkeys(canonical_topic(t.strip()) for t in str(o["topics"]).split(",") if t.strip())) \
            if o.get("topics") else None
        pattern = str(o["topicpattern"]) if o.get("topicpattern") else None
        if topics and pattern:
            raise ValueError("give topics or topicPattern, not both")
        if pattern:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"bad topicPattern {pattern!r}: {e}") from None
        for t in topics or ():
            if is_system_topic(t):
                raise ValueError(f"topics: {t} is a system topic; its records come with the topics they are for")
        table = str(o.get("table", "messages")).lower()
        if table not in ("messages", "transaction_events"):
            raise ValueError("option table must be messages or transaction_events")
        kinds = frozenset(k.strip() for k in str(o["kinds"]).split(",") if k.strip()) if o.get("kinds") else None
        if kinds:
            from .schema import KINDS

            if not kinds <= set(KINDS):
                raise ValueError(f"unknown record kind(s) {sorted(kinds - set(KINDS))}: use {', '.join(KINDS)}")
        default_start = "latest" if streaming else "earliest"
        starting = _offsets_spec(o.get("startingoffsets", default_start), "startingOffsets")
        ending = _offsets_spec(o.get("endingoffsets", "latest"), "endingOffsets")
        if o.get("startingtimestamp") not in (None, ""):
            starting = ("time", parse_time_ms(o["startingtimestamp"]))
        if o.get("endingtimestamp") not in (None, ""):
            ending = ("time", parse_time_ms(o["endingtimestamp"]))
        if streaming and ending != "latest":
            raise ValueError("endingOffsets is for batch reads: a stream reads on as messages arrive")
        mopt = o.get("maxoffsetspertrigger")
        return cls(
            address=address,
            token=str(token) if token else None,
            topics=topics,
            pattern=pattern,
            with_transactions=_bool(o.get("transactionrecords", "true"), "transactionRecords"),
            starting=starting,
            ending=ending,
            min_partitions=_pos_int(o.get("minpartitions", 1), "minPartitions"),
            max_records_per_partition=_pos_int(o.get("maxrecordsperpartition", DEFAULT_MAX_RECORDS_PER_PARTITION),
                                               "maxRecordsPerPartition"),
            fail_on_data_loss=_bool(o.get("failondataloss", "true"), "failOnDataLoss"),
            timeout_s=float(o.get("timeout", 30)),
            reconnect_s=float(o.get("reconnecttimeout", 30)),
            pull_count=min(PULL_COUNT, _pos_int(o.get("pullcount", PULL_COUNT), "pullCount")),
            pull_bytes=min(64 << 20, _pos_int(o.get("pullbytes", PULL_BYTES), "pullBytes")),
            since_ms=parse_time_ms(o.get("since")),
            until_ms=parse_time_ms(o.get("until")),
            kinds=kinds,
            max_offsets_per_trigger=_pos_int(mopt, "maxOffsetsPerTrigger") if mopt not in (None, "") else None,
            table=table,
            raw=table == "messages" and _bool(o.get("rawpull", "true"), "rawPull"),
        )


def _from_context(name: str, address: str, token: str | None) -> tuple[str, str | None]:
    """A `txmq context`'s broker and token (the CLI's saved connections); explicit options win."""
    from txmq import contextfile

    doc = contextfile.load()
    ctx = doc.get("contexts", {}).get(name)
    if ctx is None:
        raise ValueError(f"no txmq context named {name!r} (txmq context list)")
    return address or ctx.get("broker") or "", token or ctx.get("token")


def _bool(v, name: str) -> bool:
    s = str(v).strip().lower()
    if s in ("true", "1", "yes"):
        return True
    if s in ("false", "0", "no"):
        return False
    raise ValueError(f"option {name} must be true or false, not {v!r}")


def _pos_int(v, name: str) -> int:
    try:
        n = int(v)
    except (TypeError, ValueError):
        raise ValueError(f"option {name} must be a positive integer, not {v!r}") from None
    if n < 1:
        raise ValueError(f"option {name} must be a positive integer, not {v!r}")
    return n


def _offsets_spec(v, name: str):
    s = str(v).strip()
    if s.lower() in ("earliest", "latest"):
        return s.lower()
    try:
        doc = json.loads(s)
    except ValueError:
        raise ValueError(f"option {name} must be earliest, latest or JSON like "
                         '{"orders": {"0": 42, "1": -2}} (-2 earliest, -1 latest)') from None
    if not isinstance(doc, dict) or not all(
            isinstance(q, dict) and all(str(k).isdigit() and type(x) is int and x >= -2 for k, x in q.items())
            for q in doc.values()):
        raise ValueError(f"option {name}: JSON must map topic -> {{queue id: offset}} with offsets >= -2")
    return {canonical_topic(t): {int(k): x for k, x in q.items()} for t, q in doc.items()}


# ---- planning --------------------------------------------------------------------
@dataclass(frozen=True)
class QueueRange:
    """Queue offsets [start, end) of one queue: what one task reads."""

    topic: str
    queue_id: int
    start: int
    end: int


def connect(opts: BrokerOptions) -> WireClient:
    return WireClient(opts.address, opts.token, opts.timeout_s)


def queue_offsets(client: WireClient, opts: BrokerOptions, time_ms: int | None = None) -> dict[str, list[dict]]:
    """{topic: [{queue_id, min_offset, max_offset, time_offset?}, ...]} of the topics the options choose."""
    fields: dict[str, Any] = {"system": True}
    if opts.table == "transaction_events":
        fields["topics"] = list(TX_TOPICS)
    elif opts.topics is not None:
        fields["topics"] = list(opts.topics) + (list(TX_TOPICS) if opts.with_transactions else [])
    if time_ms is not None:
        fields["time_ms"] = time_ms
    try:
        reply = client.call("queue_offsets", fields)
    except TxmqError as e:
        if e.code == ErrorCode.UNKNOWN_OPERATION:
            raise BrokerReadError(f"the broker at {opts.address} is too old to be read by Spark (no queue_offsets request): "
                                  "upgrade it, or export its data directory") from None
        if e.code == ErrorCode.NO_SUCH_TOPIC:
            raise BrokerReadError(f"{e.message} at {opts.address} (txmq topics list shows them)") from None
        raise BrokerReadError(f"the broker at {opts.address} refused queue_offsets: {e}") from None
    out = {}
    pat = re.compile(opts.pattern) if opts.pattern else None
    for row in reply["topics"]:
        t = row["topic"]
        if row["system"]:
            if t not in TX_TOPICS or not opts.with_transactions:
                continue
        elif opts.table == "transaction_events":
            continue
        elif pat is not None and not pat.fullmatch(t):
            continue
        out[t] = row["queues"]
    return out


def _resolve(spec, topic: str, q: dict, default: str) -> int:
    lo, hi = q["min_offset"], q["max_offset"]
    if spec == "earliest":
        return lo
    if spec == "latest":
        return hi
    if isinstance(spec, tuple):  # ("time", ms): answered by the broker in time_offset
        return q["time_offset"]
    v = spec.get(topic, {}).get(q["queue_id"])
    if v is None:
        return _resolve(default, topic, q, default)
    return lo if v == EARLIEST else hi if v == LATEST else v


def resolve_offsets(offsets: dict[str, list[dict]], spec, default: str) -> dict[str, dict[int, int]]:
    return {t: {q["queue_id"]: _resolve(spec, t, q, default) for q in qs} for t, qs in offsets.items()}


def check_named_queues(spec, offsets: dict[str, list[dict]], name: str) -> None:
    if not isinstance(spec, dict):
        return
    for t, qs in spec.items():
        known = {q["queue_id"] for q in offsets.get(t, [])}
        if t not in offsets:
            raise BrokerReadError(f"{name} names topic {t}, which this read does not cover")
        for qid in qs:
            if qid not in known:
                raise BrokerReadError(f"{name} names queue {qid} of {t}, which has queues 0 to {max(known, default=-1)}")


def plan_batch(opts: BrokerOptions) -> tuple[list[QueueRange], dict[str, Any]]:
    """The ranges of a batch read and what planning learnt ({broker_id, rows, queues}); BrokerReadError when it cannot."""
    client = connect(opts)
    try:
        st, en = opts.starting, opts.ending
        time_ms = st[1] if isinstance(st, tuple) else None
        offsets = queue_offsets(client, opts, time_ms)
        end_offsets = queue_offsets(client, opts, en[1]) if isinstance(en, tuple) else offsets
        check_named_queues(st, offsets, "startingOffsets")
        check_named_queues(en, offsets, "endingOffsets")
        start = resolve_offsets(offsets, st, "earliest")
        end = resolve_offsets(end_offsets, en, "latest")
        ranges = checked_ranges(offsets, start, end, opts)
        info = {"broker_id": client.info.get("broker_id"), "queues": sum(len(q) for q in offsets.values()),
                "topics": list(offsets), "rows": sum(r.end - r.start for r in ranges)}
    finally:
        client.close()
    return split_ranges(ranges, opts.min_partitions, opts.max_records_per_partition), info


def checked_ranges(offsets: dict[str, list[dict]], start: dict[str, dict[int, int]], end: dict[str, dict[int, int]],
                   opts: BrokerOptions, streaming: bool = False) -> list[QueueRange]:
    """Ranges from start to end of each queue; offsets before a queue's first stored one are data loss."""
    out = []
    for t, qs in offsets.items():
        for q in qs:
            qid, lo, hi = q["queue_id"], q["min_offset"], q["max_offset"]
            s, e = start.get(t, {}).get(qid, lo), end.get(t, {}).get(qid, hi)
            if s < lo and e > s:
                if opts.fail_on_data_loss:
                    raise DataLossError(
                        f"{t} queue {qid}: offsets {s} to {min(e, lo) - 1} are no longer stored (the queue starts at {lo}: "
                        "retention deleted them); set failOnDataLoss=false to read from what is left")
                _log.warning("event=data_loss topic=%s queue_id=%d from=%d to=%d", t, qid, s, min(e, lo))
                s = min(lo, e)
            if e > hi:
                raise BrokerReadError(f"{t} queue {qid}: offset {e} is past the queue's end ({hi})")
            if s > hi:
                raise BrokerReadError(f"{t} queue {qid}: starting offset {s} is past the queue's end ({hi})")
            if e < s and not streaming:
                raise BrokerReadError(f"{t} queue {qid}: ending offset {e} is before the starting offset {s}")
            if e > s:
                out.append(QueueRange(t, qid, s, e))
    return out


def split_ranges(ranges: list[QueueRange], min_partitions: int, max_records: int) -> list[QueueRange]:
    """Cut ranges to at most max_records each, then the largest in halves until there are min_partitions."""
    out = []
    for r in ranges:
        n = -(-(r.end - r.start) // max_records)
        step = -(-(r.end - r.start) // n)
        out.extend(QueueRange(r.topic, r.queue_id, s, min(s + step, r.end)) for s in range(r.start, r.end, step))
    while 0 < len(out) < min_partitions:
        big = max(out, key=lambda r: r.end - r.start)
        if big.end - big.start < 2:
            break
        mid = (big.start + big.end) // 2
        i = out.index(big)
        out[i : i + 1] = [replace(big, end=mid), replace(big, start=mid)]
    return sorted(out, key=lambda r: (r.topic, r.queue_id, r.start))


# ---- reading (executors) -----------------------------------------------------------
def pull_range(opts: BrokerOptions, r: QueueRange) -> Iterator[list[dict] | RawRecords]:
    """The records of queue offsets [r.start, r.end), in pulls of up to pull_count, each offset once: message maps,
    or RawRecords when the broker answers a raw pull.

    Two pulls are in flight: the broker reads the next while the caller
    works on this one. A lost connection is reopened (for reconnect_s) and
    the read goes on at the first offset not yet returned.
    """
    offset, end = r.start, r.end
    client: WireClient | None = None
    lost_since: float | None = None
    pending: deque[tuple[int, int]] = deque()  # (offset asked from, request id)
    try:
        while offset < end:
            try:
                if client is None:
                    client = connect(opts)
                    pending.clear()
                if not pending:
                    pending.append((offset, client.send("pull", _pull_fields(opts, r, offset, end))))
                if len(pending) == 1:  # the next pull, from where this one ends if it returns all it was asked for
                    ahead = min(pending[0][0] + opts.pull_count, end)
                    if ahead < end:
                        pending.append((ahead, client.send("pull", _pull_fields(opts, r, ahead, end))))
                asked, rid = pending.popleft()
                reply = client.receive(rid)
                lost_since = None
                if asked != offset:  # sent ahead from an offset the last pull did not reach: dropped
                    continue
                msgs, offset = _take(opts, r, offset, end, reply)
                if msgs:
                    yield msgs
            except (ConnectionError, Unreachable) as e:
                if client is not None:
                    client.close()
                    client = None
                now = time.monotonic()
                lost_since = lost_since or now
                if now - lost_since >= opts.reconnect_s:
                    raise BrokerReadError(
                        f"the broker at {opts.address} went away while reading {r.topic} queue {r.queue_id} at offset "
                        f"{offset} (range {r.start} to {r.end}) and did not come back within {opts.reconnect_s:g}s: {e}"
                    ) from None
                _log.warning("event=broker_reconnect address=%s topic=%s queue_id=%d offset=%d why=%r",
                             opts.address, r.topic, r.queue_id, offset, str(e))
                time.sleep(0.5)
            except TxmqError as e:
                if client is not None:
                    client.close()
                    client = None
                if e.retriable:  # busy, shutting down, store error: again, within reconnect_s
                    lost_since = lost_since or time.monotonic()
                    if time.monotonic() - lost_since < opts.reconnect_s:
                        time.sleep(0.5)
                        continue
                raise BrokerReadError(f"the broker at {opts.address} refused a pull of {r.topic} queue {r.queue_id} "
                                      f"at offset {offset}: {e}") from None
    finally:
        if client is not None:
            client.close()


def _pull_fields(opts: BrokerOptions, r: QueueRange, offset: int, end: int) -> dict[str, Any]:
    fields = {"topic": r.topic, "queue_id": r.queue_id, "offset": offset,
              "max_count": min(opts.pull_count, end - offset), "max_bytes": opts.pull_bytes}
    if opts.raw:  # records as stored, when the broker can (an older one ignores it and sends message maps)
        fields["raw"] = True
    return fields


class RawRecords:
    """Records of a raw pull: stored bytes, back to back, for queue offsets [first, first + count)."""

    __slots__ = ("data", "first", "count")

    def __init__(self, data: bytes, first: int, count: int) -> None:
        self.data, self.first, self.count = data, first, count

    def __len__(self) -> int:
        return self.count


def _take(opts: BrokerOptions, r: QueueRange, offset: int, end: int, reply: dict) -> tuple[list[dict], int]:
    """The messages of a pull reply that belong to [offset, end), and where the next pull starts; gaps are data loss."""
    status = reply["status"]
    where = f"{r.topic} queue {r.queue_id}"
    if status == "found" and "records" in reply:  # raw: the broker checked each record's queue and offset
        count, nxt = reply["count"], reply["next_offset"]
        if nxt != offset + count or count < 1:
            raise BrokerReadError(f"{where}: a raw pull at offset {offset} answered {count} records up to {nxt}")
        if nxt > end:  # never asked for: cut to the range (records are variable length: decode and slice later)
            raise BrokerReadError(f"{where}: a raw pull at offset {offset} went past the range's end {end}")
        return RawRecords(reply["records"], offset, count), nxt  # type: ignore[return-value]
    if status == "found":
        msgs = reply["messages"]
        nxt = min(reply["next_offset"], end)
        if msgs and msgs[-1]["queue_offset"] >= end:
            msgs = [m for m in msgs if m["queue_offset"] < end]
        got = len(msgs)
        if got != nxt - offset:  # entries the broker skipped (damaged records)
            have = {m["queue_offset"] for m in msgs}
            missing = [q for q in range(offset, nxt) if q not in have]
            _lost(opts, where, missing[0], missing[-1] + 1, f"{len(missing)} damaged record(s) the broker skipped")
        if nxt <= offset:
            raise BrokerReadError(f"{where}: the broker's pull at offset {offset} made no progress")
        return msgs, nxt
    if status == "offset_too_small":
        lo = reply["min_offset"]
        _lost(opts, where, offset, min(lo, end), f"the queue now starts at {lo}: retention deleted them")
        return [], min(lo, end)
    if status in ("no_message", "offset_overflow"):
        raise DataLossError(
            f"{where} ends at offset {reply['max_offset']} now, before {end} where the read was planned to end: "
            "the broker lost records it had (a restart after an unflushed crash?) or is not the broker planned on")
    if status == "no_queue":
        raise BrokerReadError(f"{where} no longer exists on the broker at {opts.address} (topic deleted or queues removed)")
    raise BrokerReadError(f"{where}: unexpected pull status {status!r}")


def _lost(opts: BrokerOptions, where: str, first: int, stop: int, why: str) -> None:
    if opts.fail_on_data_loss:
        raise DataLossError(f"{where}: offsets {first} to {stop - 1} cannot be read ({why}); "
                            "set failOnDataLoss=false to skip them")
    _log.warning("event=data_loss where=%r from=%d to=%d why=%r", where, first, stop, why)
