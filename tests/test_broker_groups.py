"""Wire requests for consumer groups, reading by time and message lookups: error replies and bounded cost."""

from __future__ import annotations

import json

import pytest

from conftest import arun
from txmq.broker.testing import running_broker
from txmq.wire import ErrorCode
from wireclient import RawClient


BAD = [
    ("describe_group", {}, ErrorCode.INVALID_FIELD),
    ("describe_group", {"group": "never-seen"}, ErrorCode.NO_SUCH_GROUP),
    ("reset_offsets", {"group": "g", "topic": "t", "to": "yesterday"}, ErrorCode.INVALID_FIELD),
    ("reset_offsets", {"group": "g", "topic": "t", "to": "offset"}, ErrorCode.INVALID_FIELD),
    ("reset_offsets", {"group": "g", "topic": "t", "to": "time", "time_ms": -1}, ErrorCode.INVALID_FIELD),
    ("reset_offsets", {"group": "g", "topic": "t", "to": "earliest", "queue_ids": [2000]}, ErrorCode.INVALID_FIELD),
    ("reset_offsets", {"group": "g", "topic": "t", "to": "earliest", "queue_ids": [9]}, ErrorCode.NO_SUCH_QUEUE),
    ("reset_offsets", {"group": "g", "topic": "no-such-topic", "to": "earliest"}, ErrorCode.NO_SUCH_QUEUE),
    ("offsets_for_time", {"topic": "t"}, ErrorCode.INVALID_FIELD),
    ("get_message", {}, ErrorCode.INVALID_FIELD),
    ("get_message", {"msg_id": "not-an-offset"}, ErrorCode.INVALID_FIELD),
    ("get_message", {"commit_log_offset": 1 << 40}, ErrorCode.NO_SUCH_MESSAGE),
    ("get_message", {"commit_log_offset": 3}, ErrorCode.NO_SUCH_MESSAGE),  # not a record boundary
    ("find_messages", {"key": "k"}, ErrorCode.INVALID_FIELD),
    ("find_messages", {"key": "k", "since_ms": 0, "max_scan": 2_000_000}, ErrorCode.INVALID_FIELD),
    ("find_messages", {"key": "k", "since_ms": 0, "limit": 0}, ErrorCode.INVALID_FIELD),
]


@pytest.mark.parametrize("op,fields,code", BAD)
def test_bad_group_and_lookup_requests_get_error_replies(tmp_path, op, fields, code):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            await c.ok("send", {"topic": "t", "body": b"x", "queue_id": 0})
            got, f = await c.req(op, fields)
            assert got == code, f
            assert (await c.ok("heartbeat"))["time_ms"] > 0
            await c.close()

    arun(go())


@pytest.mark.parametrize("name", ["bad group", "tab\tgroup", "a|b", "line\n", "caf\u00e9", "x" * 121, " lead"])
def test_update_group_refuses_a_name_the_consumer_front_ends_refuse_and_stores_nothing(tmp_path, name):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            got, f = await c.req("update_group", {"group": name, "fifo": True})
            assert got == ErrorCode.INVALID_FIELD and "is not a group name" in f["error"], f
            assert (await c.ok("list_groups", {}))["groups"] == []
            await c.close()
        assert not (tmp_path / "d" / "groups.json").exists()

    arun(go())


def test_update_group_takes_rocketmqs_group_names_up_to_120_characters(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            for name in ("%orders_fifo-9", "G" * 120):
                assert (await c.ok("update_group", {"group": name, "fifo": True}))["fifo"] is True
            await c.close()
        assert sorted(json.loads((tmp_path / "d" / "groups.json").read_text())["groups"]) == ["%orders_fifo-9", "G" * 120]

    arun(go())


def test_groups_file_holding_a_name_now_refused_still_loads_and_that_group_can_still_be_changed(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "groups.json").write_text(json.dumps({"format": 1, "groups": {"old group": {"fifo": True}}}))

    async def go():
        async with running_broker(tmp_path / "d") as b:
            assert b.core.group_config.fifo("old group")
            c = await RawClient.open(b.address)
            rows = (await c.ok("list_groups", {}))["groups"]
            assert [(r["group"], r["fifo"]) for r in rows] == [("old group", True)]
            r = await c.ok("update_group", {"group": "old group", "fifo": False})  # the FIFO mark can be taken off
            assert (r["fifo"], r["changed"]) == (False, True)
            got, _ = await c.req("update_group", {"group": "new group", "fifo": True})
            assert got == ErrorCode.INVALID_FIELD
            await c.close()
        assert json.loads((tmp_path / "d" / "groups.json").read_text())["groups"] == {"old group": {"fifo": False}}

    arun(go())


def test_offset_for_time_binary_search_reads_few_records(tmp_path):
    from txmq.broker import groups

    async def go():
        async with running_broker(tmp_path / "d") as b:
            core = b.core
            c = await RawClient.open(b.address)
            for i in range(2000):
                await c.ok("send", {"topic": "big", "body": b"m%d" % i, "queue_id": 0})
            ts = [core.store.read(e[0]).store_ts for e in core.store.cq_entries("big", 0, 0, 2000)]
            reads = 0
            real = core.store.read

            def counting(off):
                nonlocal reads
                reads += 1
                return real(off)

            core.store.read = counting
            target = ts[1234]
            got = groups.offset_for_time(core, "big", 0, target)
            assert got == ts.index(target) and reads <= 2 * 12
            assert groups.offset_for_time(core, "big", 0, ts[-1] + 1) == 2000  # after every message: the end
            assert groups.offset_for_time(core, "big", 0, 0) == 0
            await c.close()

    arun(go())


def test_find_messages_stops_at_a_reply_a_client_can_take_and_says_so(tmp_path):
    from txmq.broker.groups import FIND_MAX_BYTES

    async def go() -> None:
        async with running_broker(tmp_path / "data") as b:
            c = await RawClient.open(b.address)
            body = b"x" * (4 << 20)
            n = FIND_MAX_BYTES // len(body) + 3
            for _ in range(n):
                await c.ok("send", {"topic": "big", "body": body, "queue_id": 0, "properties": {"KEYS": "k"}})
            r = await c.ok("find_messages", {"key": "k", "since_ms": 0, "limit": 10000})
            assert r["truncated"] and len(r["messages"]) == FIND_MAX_BYTES // len(body), (r["truncated"], len(r["messages"]))
            await c.close()

    arun(go())
