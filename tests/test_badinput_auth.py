"""Auth: without the token, or with a wrong one, nothing but the refusal happens.

Every refused connection gets exactly one error reply (AUTH_REQUIRED or
AUTH_FAILED) and is closed; requests pipelined behind the refused one are
never executed. The broker's state is compared before and after: the log's
end, every counter except the refusal counters, registered producer groups,
check settings, consumer offsets, topics, the transaction index, and the
files in the data directory.
"""

from __future__ import annotations

import os
from pathlib import Path


from conftest import arun
from txmq import wire
from txmq.broker.native.operations import HANDLERS
from txmq.broker.testing import running_broker
from txmq.wire import ErrorCode
from wireclient import RawClient

TOKEN = "s3cret-token"
REFUSAL_COUNTERS = {"connections_accepted", "auth_failures", "errors_auth_required", "errors_auth_failed",
                    "errors_malformed_frame", "errors_frame_too_large", "check_passes", "flushes", "flush_seconds_avg", "flush_seconds_max",
                    "checkpoints", "checkpoint_seconds_avg", "checkpoint_seconds_max"}


def state(b) -> dict:
    core = b.core
    files = {}
    for root, _dirs, names in os.walk(core.data_dir):
        for n in names:
            p = Path(root) / n
            if n != "LOCK":
                files[str(p.relative_to(core.data_dir))] = p.stat().st_size
    return {
        "max_offset": core.store.max_offset,
        "counters": {k: v for k, v in core.metrics.snapshot().items() if k not in REFUSAL_COUNTERS and not k.startswith("refused_") and v},
        "groups": core.registry.groups(),
        "settings": core.check.settings,
        "offsets": core.offsets.all(),
        "topics": core.topics.all(),
        "pending": sorted(core.tx.index.pending),
        "decided": sorted(core.tx.index.decided),
        "files": files,
    }


def req(i: int, op: str, fields: dict) -> bytes:
    return wire.request(i, op, fields)


ATTEMPTS = [
    ("send first", req(1, "send", {"topic": "a", "body": b"x"}), ErrorCode.AUTH_REQUIRED),
    ("wrong token", req(1, "hello", {"token": "wrong"}), ErrorCode.AUTH_FAILED),
    ("no token", req(1, "hello", {}), ErrorCode.AUTH_FAILED),
    ("empty token", req(1, "hello", {"token": ""}), ErrorCode.AUTH_FAILED),
    ("prefix of the token", req(1, "hello", {"token": TOKEN[:-1]}), ErrorCode.AUTH_FAILED),
    ("token plus a byte", req(1, "hello", {"token": TOKEN + "x"}), ErrorCode.AUTH_FAILED),
    ("other case", req(1, "hello", {"token": TOKEN.upper()}), ErrorCode.AUTH_FAILED),
    ("token as bytes", req(1, "hello", {"token": TOKEN.encode()}), ErrorCode.AUTH_FAILED),
    ("token as a list", req(1, "hello", {"token": [TOKEN]}), ErrorCode.AUTH_FAILED),
    ("token as a number", req(1, "hello", {"token": 12345}), ErrorCode.AUTH_FAILED),
    ("wrong token registering a producer group", req(1, "hello", {"token": "no", "producer_groups": ["g"]}), ErrorCode.AUTH_FAILED),
    ("wrong hello, then work pipelined", req(1, "hello", {"token": "no"}) + req(2, "send", {"topic": "a", "body": b"x"})
     + req(3, "config_set", {"key": "max_checks", "value": 1}) + req(4, "commit_offset", {"group": "c", "topic": "t", "queue_id": 0, "offset": 9})
     + req(5, "create_topic", {"topic": "made"}), ErrorCode.AUTH_FAILED),
    ("work, then the right hello pipelined", req(1, "create_topic", {"topic": "made"}) + req(2, "hello", {"token": TOKEN})
     + req(3, "send", {"topic": "a", "body": b"x"}), ErrorCode.AUTH_REQUIRED),
    ("unknown op first", req(1, "frobnicate", {}), ErrorCode.AUTH_REQUIRED),
    ("a reply frame first", wire.reply(1, {}) + req(2, "send", {"topic": "a", "body": b"x"}), ErrorCode.AUTH_REQUIRED),
    ("garbage first", b"\x00\x00\x00\x03abc" + req(2, "hello", {"token": TOKEN}), ErrorCode.MALFORMED_FRAME),
    ("huge frame first", b"\xff\xff\xff\xff", ErrorCode.FRAME_TOO_LARGE),
] + [(f"{op} first", req(1, op, {}), ErrorCode.AUTH_REQUIRED) for op in sorted(HANDLERS) if op != "hello"]


def test_without_the_right_token_nothing_but_the_refusal_happens(tmp_path):
    async def go():
        async with running_broker(tmp_path / "data", auth_token=TOKEN, check_interval_s=3600) as b:
            good = await RawClient.open(b.address)
            await good.ok("hello", {"token": TOKEN, "producer_groups": ["g"]})
            await good.ok("send", {"topic": "a", "body": b"before"})
            await good.ok("send", {"topic": "a", "body": b"tx", "properties": {"TRAN_MSG": "true", "PGROUP": "g"}})
            before = state(b)
            failures0 = b.core.metrics.counters["auth_failures"]
            wrong = 0
            for name, data, code in ATTEMPTS:
                c = await RawClient.open(b.address)
                c.send_raw(data)
                f = await c.read_frame()
                assert f is not None and f.kind == wire.REPLY and f.op == code, (name, f)
                assert f.fields["name"] == code.name and f.fields["retriable"] is False
                assert await c.read_frame() is None, f"{name}: the connection stayed open"
                wrong += code == ErrorCode.AUTH_FAILED
            assert state(b) == before
            assert b.core.metrics.counters["auth_failures"] - failures0 == wrong
            # the authenticated connection was never disturbed
            msgs = [m for q in range(4) for m in (await good.ok("pull", {"topic": "a", "queue_id": q, "offset": 0}))["messages"]]
            assert [m["body"] for m in msgs] == [b"before"]
            await good.close()

    arun(go())


def test_an_unauthenticated_connection_gets_no_check_back_pushes(tmp_path):
    async def go():
        async with running_broker(tmp_path / "data", auth_token=TOKEN, check_interval_s=3600, transaction_timeout_s=0) as b:
            good = await RawClient.open(b.address)
            await good.ok("hello", {"token": TOKEN})
            h = await good.ok("send", {"topic": "a", "body": b"tx", "properties": {"TRAN_MSG": "true", "PGROUP": "g"}})
            bad = await RawClient.open(b.address)
            bad.send_raw(req(1, "hello", {"token": "nope", "producer_groups": ["g"]}))
            assert (await bad.read_frame()).op == ErrorCode.AUTH_FAILED
            r = await b.core.check.run_pass()
            assert r["checked"] == 0 and r["no_producer"] == 1  # nobody of group g is registered
            assert (await good.ok("tx_pending"))["transactions"][0]["tx_id"] == h["tx_id"]
            await good.close()

    arun(go())
