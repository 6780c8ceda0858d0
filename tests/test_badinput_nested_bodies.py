"""Request bodies nested too deeply, too large or with too many values: a bad request, a bounded log, the connection goes on.

Remoting: the JSON bodies (HEART_BEAT, LOCK_BATCH_MQ, UNLOCK_BATCH_MQ) are
measured before they are parsed (protocol.json_shape_error) and refused with
INVALID_PARAMETER. Native: msgpack refuses frames nested past 1024 levels
(MALFORMED_FRAME, the connection closed); a field nested deeper than a
handler can take apart is INVALID_FIELD. Each refusal is counted
(refused_<front end>_bad_request) and logged at most once per 10 s; an
unexpected exception is logged with a traceback once per type, then as
throttled lines with a count.
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct

import msgpack
import pytest

from conftest import arun
from remotingwire import GET_ROUTEINFO_BY_TOPIC, HEART_BEAT, LOCK_BATCH_MQ, UNLOCK_BATCH_MQ, RemotingClient, decode
from txmq import wire
from txmq import remoting_codec as p  # the remoting front end's codec (broker/remoting/protocol.py re-exports it)
from txmq.broker.testing import running_broker
from txmq.wire import ErrorCode
from wireclient import RawClient

INVALID_PARAMETER, SYSTEM_ERROR = 29, 1
NESTED_200KB = b"[" * 100_000 + b"]" * 100_000


def txmq_lines(caplog, level: int = logging.INFO) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("txmq") and r.levelno >= level]


# ---- remoting: the flood of the report ----------------------------------------------------------------
def test_300_nested_json_bodies_on_one_remoting_connection_get_invalid_parameter_and_log_under_five_lines(tmp_path, caplog):
    async def main():
        async with running_broker(tmp_path / "data", remoting_port=0, check_interval_s=3600) as b:
            c = await RemotingClient.connect(b.remoting_address)
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="txmq"):
                for i in range(300):
                    code = (HEART_BEAT, LOCK_BATCH_MQ, UNLOCK_BATCH_MQ)[i % 3]
                    r = await c.request(code, {}, NESTED_200KB)
                    assert r.code == INVALID_PARAMETER, (code, r.code, r.remark)
                    assert "nested deeper than 32 levels" in r.remark, r.remark
                lines = txmq_lines(caplog)
            assert len(lines) < 5, [r.getMessage()[:200] for r in lines]
            assert not any(r.exc_info for r in lines)
            assert any("event=refused frontend=remoting kind=bad_request" in r.getMessage() for r in lines)
            counters = b.core.metrics.counters
            assert counters["refused_remoting_bad_request"] == 300
            assert counters.get("internal_errors", 0) == 0
            # the same connection, and the broker, keep serving
            assert (await c.heartbeat("cid-1", consumers={"cg": ["orders"]})).code == 0
            other = await RemotingClient.connect(b.remoting_address)
            assert (await other.request(GET_ROUTEINFO_BY_TOPIC, {"topic": "Unharmed"})).code == 0
            assert not c.closed.is_set()
            await c.close()
            await other.close()

    arun(main())


@pytest.mark.parametrize("body, says", [
    (b'{"clientID":"c",' + b'"a":{' * 40 + b"}" * 40 + b"}", "nested deeper than 32 levels"),
    (b'{"clientID":"' + b"x" * (3 << 20) + b'"}', "over the 2097152-byte limit"),
    (b"[" + b"{}," * 300_000 + b"{}]", "more than 262144 values"),
    (b'{"clientID":"c"', "is not JSON"),
    (b"[1,2]", "not a JSON object"),
    (b'{"clientID":"\xff\xfe"}', "is not JSON"),
])
def test_a_heartbeat_body_past_the_limits_or_not_a_json_object_is_a_bad_request(tmp_path, body, says):
    async def main():
        async with running_broker(tmp_path / "data", remoting_port=0, check_interval_s=3600) as b:
            c = await RemotingClient.connect(b.remoting_address)
            r = await c.request(HEART_BEAT, {}, body)
            assert r.code == INVALID_PARAMETER and says in r.remark, (r.code, r.remark)
            assert b.core.metrics.counters["refused_remoting_bad_request"] == 1
            assert (await c.heartbeat("cid-1", producers=["pg"])).code == 0
            await c.close()

    arun(main())


def test_a_oneway_request_with_a_nested_body_is_counted_as_refused_and_not_answered(tmp_path):
    async def main():
        async with running_broker(tmp_path / "data", remoting_port=0, check_interval_s=3600) as b:
            c = await RemotingClient.connect(b.remoting_address)
            for _ in range(5):
                c.oneway(UNLOCK_BATCH_MQ, {}, NESTED_200KB)
            assert (await c.request(GET_ROUTEINFO_BY_TOPIC, {"topic": "After"})).code == 0  # answered in order, after them
            counters = b.core.metrics.counters
            assert counters["refused_remoting_bad_request"] == 5 and counters["remoting_oneway_failures"] == 5
            assert c.pushed.empty()
            await c.close()

    arun(main())


def test_a_lock_request_for_ten_thousand_queues_is_within_the_limits(tmp_path):
    async def main():
        async with running_broker(tmp_path / "data", remoting_port=0, check_interval_s=3600) as b:
            c = await RemotingClient.connect(b.remoting_address)
            assert (await c.heartbeat("cid-1", consumers={"cg": ["orders"]})).code == 0
            mqs = [{"topic": f"topic-with-a-rather-long-name-{i % 50:03d}", "brokerName": "txmq", "queueId": i} for i in range(10_000)]
            body = json.dumps({"consumerGroup": "cg", "clientId": "cid-1", "mqSet": mqs}).encode()
            r = await c.request(LOCK_BATCH_MQ, {}, body)
            assert r.code == 0, r.remark
            assert b.core.metrics.counters.get("refused_remoting_bad_request", 0) == 0
            await c.close()

    arun(main())


def test_a_json_header_with_too_many_values_is_a_malformed_frame_and_closes_only_its_connection(tmp_path):
    async def main():
        async with running_broker(tmp_path / "data", remoting_port=0, check_interval_s=3600) as b:
            good = await RemotingClient.connect(b.remoting_address)
            header = (b'{"code":105,"language":"JAVA","version":0,"opaque":1,"flag":0,"extFields":{"topic":"T"},"x":['
                      + b"{}," * 300_000 + b"{}]}")
            reader, writer = await asyncio.open_connection("127.0.0.1", b.remoting_port)
            writer.write(struct.pack(">ii", 4 + len(header), len(header)) + header)
            data = await asyncio.wait_for(reader.read(), 10)  # one response saying why, then the close
            (n,) = struct.unpack_from(">i", data)
            resp = decode(data[4 : 4 + n])
            assert resp.code == SYSTEM_ERROR and "more than 262144 values" in resp.remark, resp.remark
            writer.close()
            assert (await good.request(GET_ROUTEINFO_BY_TOPIC, {"topic": "Unharmed"})).code == 0
            counters = b.core.metrics.counters
            assert counters["remoting_malformed_frames"] == 1 and counters["refused_remoting_bad_request"] == 1
            await good.close()

    arun(main())


# ---- the measure taken before parsing -----------------------------------------------------------------
@pytest.mark.parametrize("data, why", [
    (b"[" * 32 + b"]" * 32, None),
    (b"[" * 33 + b"]" * 33, "nested deeper than 32"),
    (b"[{" * 16 + b"}]" * 16, None),
    (b"[{" * 16 + b"[]" + b"}]" * 16, "nested deeper than 32"),
    (b'{"a":"' + b"[" * 5000 + b'"}', None),  # brackets inside a string are text
    (b'{"a":"\\"' + b"[" * 5000 + b'"}', None),  # ... after an escaped quote too
    (b'{"a":"\\\\",' + b'"b":' + b"[" * 40 + b"]" * 40 + b"}", "nested deeper than 32"),  # an escaped backslash ends no string
    (b'["]",' * 40 + b"]" * 40, "nested deeper than 32"),  # closing brackets inside strings do not close anything
    (b'{"k":' * 33 + b"1" + b"}" * 33, "nested deeper than 32"),
    (b"[1]]", "do not match"),
])
def test_the_shape_of_a_json_body_is_measured_outside_its_strings(data, why):
    got = p.json_shape_error(data)
    assert (got is None) if why is None else (got is not None and why in got), got


def test_a_body_nested_too_deeply_is_refused_before_the_json_parser_sees_it(monkeypatch):
    def parser(_text):
        raise AssertionError("parsed")
    monkeypatch.setattr(p, "_loads", parser)
    with pytest.raises(p.BodyError, match="nested deeper than 32 levels"):
        p.load_json_object(NESTED_200KB, "HEART_BEAT")


# ---- native -------------------------------------------------------------------------------------------
def raw_request(id_: int, op: str, fields: bytes) -> bytes:
    """A request frame whose fields map is given packed (msgpack's packer stops at 511 levels)."""
    payload = b"\x94" + msgpack.packb(wire.REQUEST) + msgpack.packb(id_) + msgpack.packb(op) + fields
    return wire.HEADER.pack(len(payload)) + payload


def send_with_nested_topic(id_: int, depth: int) -> bytes:
    """send {topic: {"k": {"k": ... nil}} (depth maps), body: b"x"}"""
    return raw_request(id_, "send", b"\x82" + msgpack.packb("topic") + b"\x81\xa1k" * depth + b"\xc0" + msgpack.packb("body") + msgpack.packb(b"x"))


def test_a_native_field_nested_deeper_than_a_handler_can_read_is_invalid_field_and_the_connection_goes_on(tmp_path, caplog):
    async def main():
        async with running_broker(tmp_path / "data", check_interval_s=3600) as b:
            c = await RawClient.open(b.address)
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="txmq"):
                for i in range(100):
                    c.send_raw(send_with_nested_topic(1000 + i, 1020))
                    f = await c.read_frame(10)
                    assert f is not None and f.id == 1000 + i, f
                    assert f.op == ErrorCode.INVALID_FIELD and "nest more than 32 levels" in f.fields["error"], f
                lines = txmq_lines(caplog)
            assert len(lines) < 5 and not any(r.exc_info for r in lines), [r.getMessage()[:200] for r in lines]
            counters = b.core.metrics.counters
            assert counters["refused_native_bad_request"] == 100 and counters.get("internal_errors", 0) == 0
            code, _ = await c.req("send", {"topic": "t", "body": b"after"})
            assert code == 0
            await c.close()

    arun(main())


def test_a_native_frame_nested_past_the_unpackers_limit_is_malformed_and_closes_only_that_connection(tmp_path):
    async def main():
        async with running_broker(tmp_path / "data", check_interval_s=3600) as b:
            good = await RawClient.open(b.address)
            await good.ok("heartbeat")
            bad = await RawClient.open(b.address)
            bad.send_raw(send_with_nested_topic(1, 2000))
            f = await bad.read_frame(5)
            assert f is not None and f.op == ErrorCode.MALFORMED_FRAME
            assert await bad.read_frame(5) is None  # closed
            await good.ok("heartbeat")
            assert b.core.metrics.counters["refused_native_bad_request"] == 1
            await good.close()

    arun(main())


# ---- internal errors: one traceback per type, then a count ----------------------------------------------
def test_an_unexpected_exception_in_a_remoting_handler_logs_one_traceback_then_a_count(tmp_path, caplog, monkeypatch):
    from txmq.broker.remoting import handlers

    def broken(front, conn, cmd):
        raise RuntimeError("a bug")

    monkeypatch.setitem(handlers.HANDLERS, GET_ROUTEINFO_BY_TOPIC, broken)

    async def main():
        async with running_broker(tmp_path / "data", remoting_port=0, check_interval_s=3600) as b:
            c = await RemotingClient.connect(b.remoting_address)
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="txmq"):
                for _ in range(300):
                    r = await c.request(GET_ROUTEINFO_BY_TOPIC, {"topic": "t"})
                    assert r.code == SYSTEM_ERROR and "RuntimeError" in r.remark
                lines = txmq_lines(caplog)
            assert len(lines) < 5, [r.getMessage()[:200] for r in lines]
            assert sum(1 for r in lines if r.exc_info) == 1
            assert "event=internal_error" in lines[0].getMessage() and "RuntimeError('a bug')" in lines[0].getMessage()
            assert b.core.metrics.counters["internal_errors"] == 300
            await c.close()

    arun(main())


def test_an_unexpected_exception_in_a_native_handler_logs_one_traceback_then_a_count(tmp_path, caplog, monkeypatch):
    from txmq.broker.native.operations import HANDLERS

    def broken(core, conn, fields):
        raise KeyError("a bug")

    monkeypatch.setitem(HANDLERS, "heartbeat", broken)

    async def main():
        async with running_broker(tmp_path / "data", check_interval_s=3600) as b:
            c = await RawClient.open(b.address)
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="txmq"):
                results = [await c.req("heartbeat") for _ in range(300)]
                lines = txmq_lines(caplog)
            assert all(code == ErrorCode.INTERNAL for code, _ in results)
            assert len(lines) < 5 and sum(1 for r in lines if r.exc_info) == 1, [r.getMessage()[:200] for r in lines]
            assert b.core.metrics.counters["internal_errors"] == 300
            await c.close()

    arun(main())
