"""Property-based tests (hypothesis) of the frame codec and of every operation's fields.

Codec (txmq.wire in core/wire.py, no I/O): any bytes, split anywhere, either give the
payloads that were framed or FRAME_TOO_LARGE; any payload either parses to a
well-formed frame or raises FrameError -- never another exception.

Operations: for every op in broker/native/operations.py's HANDLERS, random, mistyped,
oversized and missing field values go through the real connection code
(BrokerConnection.data_received on a fake transport) into a real broker core
running in a background thread. Each request gets a reply with a known
error code or a success, or the connection is closed cleanly; the broker's
``errors_internal`` counter stays 0 and nothing is logged with a traceback.
TXMQ_FAULT_LONG=1 runs ten times as many examples.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import threading
import time
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from txmq import wire
from txmq.broker.native.connection import BrokerConnection
from txmq.broker.native.operations import HANDLERS
from txmq.broker.testing import running_broker
from txmq.wire import ErrorCode, FrameDecoder, FrameError, TxmqError, parse_payload

pytestmark = pytest.mark.fault  # so `make fault-long` runs the long version too

LONG = os.environ.get("TXMQ_FAULT_LONG") == "1"
N = 10 if LONG else 1
CODES = {int(c) for c in ErrorCode}

# ---- value strategies ----------------------------------------------------------
INT_EDGES = [0, 1, -1, 2, 3, 4, 1023, 1024, 10_000, 1 << 20, (1 << 31) - 1, 1 << 31, 1 << 32, (1 << 62), (1 << 62) + 1,
             (1 << 63) - 1, -(1 << 63), (1 << 64) - 1]
ints = st.one_of(st.sampled_from(INT_EDGES), st.integers(-(1 << 63), (1 << 64) - 1))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1e-9, 0.5, 1e308, float("nan"), float("inf")]))
texts = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", " ", "t", "orders", "RMQ_SYS_TRANS_HALF_TOPIC", "RMQ_SYS_TRANS_OP_HALF_TOPIC", "TRANS_CHECK_MAX_TIME_TOPIC",
                     "TRANS_CHECK_MAXTIME_TOPIC", "RMQ_SYS_X", "bad topic", "a/b", "..", "\x00", "%RETRY%g", "x" * 127, "x" * 128,
                     "é" * 200, "x" * 300, "true", "commit", "rollback", "unknown", "half", "g", "0", "-1"]),
)
binaries = st.one_of(st.binary(max_size=64), st.sampled_from([b"", b"\x00" * 1000, b"\xff" * 70]))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts, binaries)
wild = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(texts, inner, max_size=5)), max_leaves=12)

props = st.one_of(
    st.dictionaries(st.sampled_from(["TRAN_MSG", "PGROUP", "UNIQ_KEY", "TAGS", "KEYS", "DELAY", "REAL_TOPIC", "REAL_QID",
                                     "CHECK_IMMUNITY_TIME_IN_SECONDS", "TRANSACTION_CHECK_TIMES", "__SHARDINGKEY", "TIMER_DELIVER_MS",
                                     "TIMER_DELAY_SEC", "TIMER_DELAY_MS", "x"]),
                    st.one_of(st.sampled_from(["true", "false", "g", "", "1", "-5", "nan", "1e999", "x" * 300]), wild), max_size=6),
    wild,
)
refs = st.one_of(
    st.lists(st.dictionaries(st.sampled_from(["tx_id", "half_offset", "commit_log_offset", "discard_offset", "x"]), wild, max_size=3), max_size=4),
    st.lists(st.fixed_dictionaries({}, optional={"tx_id": texts, "half_offset": ints, "commit_log_offset": ints, "discard_offset": ints}), max_size=4),
    wild,
)
messages = st.one_of(st.lists(st.fixed_dictionaries({}, optional={"body": st.one_of(binaries, wild), "properties": props, "born_ts": ints}), max_size=4), wild)
groups = st.one_of(st.lists(texts, max_size=4), wild)

# Plausible values per field name (mixed with anything at all), so generated requests reach past the first check.
FIELD = {
    "topic": texts, "body": st.one_of(binaries, texts), "properties": props, "queue_id": ints, "born_ts": ints,
    "messages": messages, "group": texts, "tx_id": texts, "commit_log_offset": ints, "half_offset": ints,
    "state": st.sampled_from(["commit", "rollback", "unknown", "COMMIT_MESSAGE", ""]), "from_check": st.booleans(),
    "offset": ints, "max_count": ints, "max_bytes": ints, "wait_ms": ints, "queues": ints, "system": st.booleans(),
    "min_age_ms": ints, "limit": ints, "action": st.sampled_from(["commit", "rollback", "delete"]), "refs": refs,
    "dry_run": st.booleans(), "to": st.sampled_from(["half", "commit", "topic"]), "all": st.booleans(),
    "key": st.sampled_from(["check_interval_s", "transaction_timeout_s", "max_checks", "retention_s", "nope"]),
    "after_half_offset": ints, "after_discard_offset": ints, "max_scan": ints, "summary": st.booleans(), "force": st.booleans(),
    "time_ms": ints, "since_ms": ints, "until_ms": ints, "msg_id": texts, "queue_ids": st.one_of(ints, st.lists(ints, max_size=3)),
    "value": st.one_of(ints, floats), "token": texts, "client_id": texts, "producer_groups": groups, "consumer_groups": groups,
    "message_types": st.one_of(st.lists(st.sampled_from(["normal", "fifo", "delay", "transaction", "NORMAL", "x", ""]), max_size=5), wild),
    "fifo": st.one_of(st.booleans(), wild),
    "after": st.one_of(st.lists(ints, max_size=3), wild),
    "topics": st.one_of(st.lists(texts, max_size=3), wild), "raw": st.one_of(st.booleans(), wild),
}
# Values that pass validation, so a request with one field broken reaches deep into the handler.
small = st.integers(0, 64)
VALID = {
    "topic": st.sampled_from(["orders", "t", "fz-a"]), "body": st.binary(max_size=64),
    "properties": st.sampled_from([{}, {"TAGS": "a"}, {"TRAN_MSG": "true", "PGROUP": "g"}, {"TRAN_MSG": "true", "PGROUP": "g", "DELAY": "3"},
                                   {"__SHARDINGKEY": "order-1"}, {"TIMER_DELAY_SEC": "5"}, {"__SHARDINGKEY": "order-1", "DELAY": "2"}]),
    "queue_id": st.integers(-1, 3), "born_ts": st.integers(0, 1 << 41),
    "messages": st.lists(st.fixed_dictionaries({"body": st.binary(max_size=32)}, optional={"properties": st.just({"TAGS": "b"})}), min_size=1, max_size=3),
    "group": st.sampled_from(["g", "fz"]), "tx_id": st.sampled_from(["SEEDED", "nope"]), "commit_log_offset": st.integers(0, 20_000),
    "half_offset": small, "state": st.sampled_from(["commit", "rollback", "unknown"]), "from_check": st.booleans(),
    "offset": small, "max_count": st.integers(1, 100), "max_bytes": st.integers(1, 1 << 20), "wait_ms": st.sampled_from([0, 0, 0, 1, 20]),
    "queues": st.integers(1, 8), "system": st.booleans(), "min_age_ms": st.integers(0, 1000), "limit": st.integers(1, 100),
    "action": st.sampled_from(["commit", "rollback"]),
    "refs": st.lists(st.one_of(st.fixed_dictionaries({"tx_id": st.sampled_from(["SEEDED", "nope"])}), st.fixed_dictionaries({"half_offset": small}),
                               st.fixed_dictionaries({"commit_log_offset": st.integers(0, 20_000)}), st.fixed_dictionaries({"discard_offset": small})),
                     min_size=1, max_size=3),
    "dry_run": st.booleans(), "to": st.sampled_from(["half", "commit"]), "all": st.booleans(),
    "key": st.sampled_from(["check_interval_s", "transaction_timeout_s", "max_checks", "retention_s"]),
    "after_half_offset": small, "after_discard_offset": small, "max_scan": st.integers(1, 1000), "summary": st.booleans(),
    "force": st.booleans(), "time_ms": st.integers(0, 1 << 41), "since_ms": st.integers(0, 1 << 41), "until_ms": st.integers(0, 1 << 41),
    "msg_id": st.sampled_from(["0000000000000000", "nope"]), "queue_ids": st.sampled_from([[0], [0, 1]]),
    "value": st.sampled_from([1, 2, 5, 60, 0.5, 3600]), "token": texts, "client_id": texts,
    "producer_groups": st.sampled_from([[], ["g"], ["fz"]]), "consumer_groups": st.sampled_from([[], ["c"]]),
    "message_types": st.lists(st.sampled_from(["normal", "fifo", "delay", "transaction"]), min_size=1, max_size=4),
    "fifo": st.booleans(),
    "after": st.sampled_from([[0, 0], [1 << 41, 20_000]]),
    "topics": st.sampled_from([["orders"], ["orders", "t"], ["nope"]]), "raw": st.booleans(),
}
OPS = {
    "hello": ["token", "client_id", "producer_groups", "consumer_groups"],
    "heartbeat": [],
    "broker_info": [],
    "send": ["topic", "body", "properties", "queue_id", "born_ts"],
    "send_batch": ["topic", "messages", "queue_id"],
    "end_transaction": ["group", "tx_id", "commit_log_offset", "half_offset", "state", "from_check"],
    "pull": ["topic", "queue_id", "offset", "max_count", "max_bytes", "wait_ms", "raw"],
    "commit_offset": ["group", "topic", "queue_id", "offset"],
    "fetch_offsets": ["group", "topic"],
    "create_topic": ["topic", "queues", "message_types"],
    "update_topic": ["topic", "queues", "message_types"],
    "delete_topic": ["topic", "force"],
    "describe_topic": ["topic"],
    "list_topics": ["system"],
    "tx_pending": ["group", "topic", "min_age_ms", "limit", "after_half_offset"],
    "tx_offsets": [],
    "tx_resolve": ["action", "refs", "dry_run"],
    "tx_check_now": ["tx_id"],
    "discard_list": ["limit", "after_discard_offset"],
    "discard_replay": ["to", "refs", "all", "dry_run"],
    "config_get": [],
    "config_set": ["key", "value", "dry_run"],
    "stats": [],
    "tx_resolve_where": ["action", "group", "topic", "min_age_ms", "limit", "after_half_offset", "dry_run"],
    "tx_history": ["tx_id", "half_offset", "commit_log_offset", "max_scan", "summary"],
    "list_groups": [],
    "describe_group": ["group", "topic"],
    "update_group": ["group", "fifo"],
    "reset_offsets": ["group", "topic", "to", "offset", "time_ms", "queue_ids", "dry_run", "force"],
    "offsets_for_time": ["topic", "time_ms", "queue_ids"],
    "get_message": ["msg_id", "commit_log_offset"],
    "find_messages": ["key", "topic", "since_ms", "until_ms", "limit", "max_scan"],
    "cancel_scheduled": ["msg_id", "topic"],
    "list_scheduled": ["topic", "limit", "after"],
    "queue_offsets": ["topics", "time_ms", "system"],
}


@st.composite
def op_fields(draw, op: str) -> dict[str, Any]:
    """All fields valid; or valid but one broken; or each field anything."""
    keys = OPS[op]
    mode = draw(st.sampled_from(["valid", "one-bad", "one-bad", "random"]))
    if mode != "random":
        fields = {k: draw(VALID[k]) for k in keys if draw(st.booleans()) or k in ("topic", "group", "state", "action", "to", "key", "value")}
        if mode == "one-bad" and keys:
            k = draw(st.sampled_from(keys))
            if draw(st.booleans()):
                fields[k] = draw(wild)
            else:
                fields.pop(k, None)
        return fields
    fields: dict[str, Any] = {}
    for key in keys:
        how = draw(st.sampled_from(["plausible", "plausible", "wild", "missing"]))
        if how == "plausible":
            fields[key] = draw(FIELD[key])
        elif how == "wild":
            fields[key] = draw(wild)
    fields.update(draw(st.dictionaries(texts, wild, max_size=2)))  # unknown extra fields are ignored
    return fields


def packable(obj: Any) -> bool:
    try:
        msgpack.packb(obj, use_bin_type=True)
        return True
    except (OverflowError, ValueError, TypeError):
        return False


def test_every_handler_has_a_field_table():
    assert set(OPS) == set(HANDLERS), "a new operation needs its fields listed here"


# ---- the codec -------------------------------------------------------------------
def frame_bytes(obj: Any) -> bytes:
    payload = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(payload)) + payload


@settings(max_examples=300 * N, deadline=None)
@given(kind=st.sampled_from([0, 1, 2]), id_=st.integers(0, (1 << 32) - 1), op=texts, code=st.sampled_from(sorted(CODES)),
       fields=st.dictionaries(texts, wild, max_size=4))
def test_encode_then_parse_round_trips(kind, id_, op, code, fields):
    assume(packable(fields))
    data = wire.encode(kind, id_, code if kind == wire.REPLY else op, fields)
    payloads = FrameDecoder().feed(data)
    assert len(payloads) == 1
    f = parse_payload(payloads[0])
    assert (f.kind, f.id, f.op) == (kind, id_, code if kind == wire.REPLY else op)
    assert msgpack.packb(f.fields, use_bin_type=True) == msgpack.packb(fields, use_bin_type=True)


@settings(max_examples=300 * N, deadline=None)
@given(payloads=st.lists(st.binary(max_size=300), max_size=8), cuts=st.lists(st.integers(0, 3000), max_size=12))
def test_decoder_gives_the_same_payloads_however_the_stream_is_split(payloads, cuts):
    stream = b"".join(struct.pack(">I", len(p)) + p for p in payloads)
    dec = FrameDecoder(1024)
    got: list[bytes] = []
    pos = 0
    for cut in sorted(c % (len(stream) + 1) for c in cuts) + [len(stream)]:
        got += dec.feed(stream[pos:cut])
        pos = max(pos, cut)
    assert got == payloads and dec.buffered == 0


@settings(max_examples=500 * N, deadline=None)
@given(data=st.binary(max_size=2000), chunk=st.integers(1, 64), limit=st.integers(0, 4096))
def test_decoder_on_any_bytes_yields_payloads_or_frame_too_large(data, chunk, limit):
    dec = FrameDecoder(limit)
    try:
        for i in range(0, len(data), chunk):
            for p in dec.feed(data[i:i + chunk]):
                assert len(p) <= limit
    except TxmqError as e:
        assert e.code == ErrorCode.FRAME_TOO_LARGE
    else:
        assert dec.buffered < 4 + limit


@settings(max_examples=200 * N, deadline=None)
@given(length=st.integers(9, (1 << 32) - 1))
def test_an_oversized_length_is_refused_before_the_payload_arrives(length):
    dec = FrameDecoder(8)
    with pytest.raises(TxmqError) as ei:
        dec.feed(struct.pack(">I", length))  # the payload is never sent: refused on the prefix alone
    assert ei.value.code == ErrorCode.FRAME_TOO_LARGE


@settings(max_examples=300 * N, deadline=None)
@given(obj=st.one_of(wild, st.lists(wild, min_size=4, max_size=4), st.tuples(st.sampled_from([0, 1, 2, 3, -1, "0", None, True]), wild, wild, wild)))
def test_parse_payload_of_any_msgpack_is_a_frame_or_frame_error(obj):
    assume(packable(obj))
    try:
        f = parse_payload(msgpack.packb(obj, use_bin_type=True))
    except FrameError:
        return
    assert f.kind in (0, 1, 2) and type(f.id) is int and 0 <= f.id < 1 << 32 and isinstance(f.fields, dict)
    assert isinstance(f.op, int if f.kind == wire.REPLY else str)


@settings(max_examples=500 * N, deadline=None)
@given(data=st.binary(max_size=200))
def test_parse_payload_of_any_bytes_is_a_frame_or_frame_error(data):
    try:
        parse_payload(data)
    except FrameError:
        pass


@settings(max_examples=200 * N, deadline=None)
@given(fields=st.dictionaries(texts, wild, max_size=4), cut=st.integers(0, 10_000))
def test_a_truncated_frame_waits_for_the_rest(fields, cut):
    assume(packable(fields))
    data = wire.request(7, "send", fields)
    cut %= len(data)
    dec = FrameDecoder()
    assert dec.feed(data[:cut]) == []
    assert [parse_payload(p).fields.keys() for p in dec.feed(data[cut:])] == [fields.keys()]


# ---- operations, through the connection code, against a real core ------------------------
class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closed = False

    def write(self, data) -> None:
        assert not self.closed, "write after close"
        self.out += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name, default=None):
        return ("203.0.113.9", 4242) if name == "peername" else default

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class Problems(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or "internal_error" in record.getMessage():
            self.records.append(record)


class LiveCore:
    """A broker running on its own event loop in a thread; examples talk to its core."""

    def __init__(self, data, **overrides) -> None:
        try:
            import uvloop

            self.loop = uvloop.new_event_loop()
        except ImportError:
            self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.cm = running_broker(data, check_interval_s=0.5, transaction_timeout_s=0, **overrides)
        self.rb = self.call(self.cm.__aenter__())
        self.core = self.rb.core
        self.problems = Problems()
        logging.getLogger("txmq").addHandler(self.problems)
        logging.getLogger("asyncio").addHandler(self.problems)

    def call(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        logging.getLogger("txmq").removeHandler(self.problems)
        logging.getLogger("asyncio").removeHandler(self.problems)
        self.call(self.cm.__aexit__(None, None, None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def exchange(self, data: bytes, expect: set[int], wait: float = 2.0) -> tuple[list[wire.Frame], bool]:
        """Feed data to a fresh connection; wait for replies to the ids in expect (or a close)."""
        conn = BrokerConnection(self.rb.broker.native, self.rb.broker.native.state)
        t = FakeTransport()
        conn.connection_made(t)
        try:
            conn.data_received(data)  # an exception escaping here is a bug
            loop = asyncio.get_running_loop()
            deadline = loop.time() + wait
            while True:
                await asyncio.sleep(0)
                frames = [parse_payload(p) for p in FrameDecoder(1 << 30).feed(bytes(t.out))]
                if t.closed or expect <= {f.id for f in frames} or loop.time() > deadline:
                    return frames, t.closed
                await asyncio.sleep(0.002)
        finally:
            conn.connection_lost(None)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    lc = LiveCore(tmp_path_factory.mktemp("props") / "data")
    # something to find: a pending transaction, a decided one, a discarded one, a plain message
    async def seed():
        core = lc.core
        h = await core.tx.send_half("orders", None, b"pending", {"TRAN_MSG": "true", "PGROUP": "g"}, 1)
        h2 = await core.tx.send_half("orders", None, b"decided", {"TRAN_MSG": "true", "PGROUP": "g"}, 1)
        await core.tx.end_transaction("g", h2["tx_id"], h2["commit_log_offset"], h2["half_offset"], "commit", "producer")
        return h

    lc.seeded = lc.call(seed())
    yield lc
    counters = lc.core.metrics.snapshot()
    print("\nproperty-test broker counters:", {k: v for k, v in sorted(counters.items()) if v})
    lc.close()
    assert counters.get("errors_internal", 0) == 0


def check_answers(live: LiveCore, frames: list[wire.Frame], closed: bool, sent: list[int], may_wait: set[int]) -> None:
    assert all(f.kind == wire.REPLY for f in frames), frames
    for f in frames:
        assert f.op in CODES, f
        if f.op:
            assert set(f.fields) >= {"error", "name", "retriable"} and f.fields["name"] == ErrorCode(f.op).name, f
            assert ErrorCode(f.op) != ErrorCode.INTERNAL, f.fields
    got = {f.id for f in frames}
    if closed:
        assert frames and frames[-1].op in {int(c) for c in wire.FATAL}, frames
    else:
        missing = set(sent) - got - may_wait
        assert not missing, f"no reply to {missing}"
    assert live.core.metrics.counters.get("errors_internal", 0) == 0
    assert not live.problems.records, [r.getMessage() for r in live.problems.records]


@pytest.mark.parametrize("op", sorted(OPS))
def test_every_operation_answers_any_fields_with_a_reply(live, op):
    @settings(max_examples=60 * N, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(fields=op_fields(op), use_seed=st.booleans())
    def prop(fields, use_seed):
        h = live.seeded
        if fields.get("tx_id") == "SEEDED":
            fields["tx_id"] = h["tx_id"]
        for r in fields.get("refs") if isinstance(fields.get("refs"), list) else []:
            if isinstance(r, dict) and r.get("tx_id") == "SEEDED":
                r["tx_id"] = h["tx_id"]
        if use_seed and op in ("end_transaction", "tx_check_now"):
            fields.setdefault("tx_id", h["tx_id"])  # aim at a real transaction with the other fields random
            fields.setdefault("commit_log_offset", h["commit_log_offset"])
        assume(packable(fields))
        data = wire.request(1, op, fields) + wire.request(2, "heartbeat", {})
        may_wait = {1} if op == "pull" and type(fields.get("wait_ms")) is int and fields["wait_ms"] > 0 else set()
        frames, closed = live.call(live.exchange(data, {1, 2} - may_wait))
        check_answers(live, frames, closed, [1, 2], may_wait)
        assert not closed, frames  # field errors never close the connection
        assert [f for f in frames if f.id == 2][0].op == 0  # the connection still works after it

    prop()


@settings(max_examples=300 * N, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=st.lists(st.one_of(
    st.binary(max_size=80).map(lambda b: struct.pack(">I", len(b)) + b),  # framed garbage
    st.binary(max_size=40),  # unframed garbage
    st.one_of(wild, st.tuples(st.sampled_from([0, 1, 2, 5]), ints, st.one_of(st.sampled_from(sorted(OPS)), wild), wild))
    .filter(packable).map(frame_bytes),  # msgpack of the wrong shape
), min_size=1, max_size=6))
def test_any_byte_stream_gets_replies_or_a_clean_close(live, frames):
    data = b"".join(frames)
    out, closed = live.call(live.exchange(data, set(), wait=0.05))
    check_answers(live, out, closed, [], set())


def test_no_internal_errors_overall(live):
    time.sleep(0.1)
    assert live.core.metrics.counters.get("errors_internal", 0) == 0
