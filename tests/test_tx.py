"""Every path of the transaction protocol (docs/transactions.md), against a real in-process broker.

The check service is driven by an injected clock: the background loop is
given a long interval and tests call ``core.check.run_pass()`` after moving
the clock, so nothing sleeps.
"""

from __future__ import annotations

import pytest

from conftest import arun
from txmq.broker.clock import ManualClock
from txmq.broker.testing import running_broker
from txmq.wire import ErrorCode
from wireclient import RawClient

G = "shop"
T = "orders"


def half_fields(body: bytes = b"order-1", **props: str) -> dict:
    p = {"TRAN_MSG": "true", "PGROUP": G, **props}
    return {"topic": T, "body": body, "properties": p}


async def pull_all(c: RawClient, topic: str = T) -> list[dict]:
    out = []
    for q in range(4):
        r = await c.ok("pull", {"topic": topic, "queue_id": q, "offset": 0, "max_count": 1000})
        out.extend(r["messages"])
    return out


def end(h: dict, state: str, from_check: bool = False, group: str = G) -> dict:
    return {"group": group, "tx_id": h["tx_id"], "commit_log_offset": h["commit_log_offset"],
            "half_offset": h["half_offset"], "state": state, "from_check": from_check}


def broker(tmp_path, clock=None, **kw):
    kw.setdefault("check_interval_s", 3600)
    return running_broker(tmp_path / "data", clock=clock, **kw)


def test_commit_is_visible_exactly_once(tmp_path):
    async def go():
        async with broker(tmp_path) as b:
            c = await RawClient.open(b.address)
            h = await c.ok("send", half_fields())
            assert h["topic"] == T and h["half_offset"] == 0 and h["tx_id"]
            assert await pull_all(c) == []  # the half message is invisible
            r = await c.ok("end_transaction", end(h, "commit"))
            assert r["status"] == "ok" and r["outcome"] == "committed"
            msgs = await pull_all(c)
            assert len(msgs) == 1
            m = msgs[0]
            assert m["body"] == b"order-1"
            assert "TRAN_MSG" not in m["properties"]
            assert m["properties"]["UNIQ_KEY"] == h["tx_id"]
            assert m["properties"]["TRAN_PREPARED_QUEUE_OFFSET"] == str(h["half_offset"])
            assert m["prepared_offset"] == h["commit_log_offset"]
            # a repeat answers with the first outcome and writes nothing
            r2 = await c.ok("end_transaction", end(h, "commit"))
            assert r2["status"] == "already"
            assert len(await pull_all(c)) == 1
            ops = await c.ok("pull", {"topic": "RMQ_SYS_TRANS_OP_HALF_TOPIC", "queue_id": 0, "offset": 0})
            assert len(ops["messages"]) == 1
            op = ops["messages"][0]
            assert op["properties"]["TAGS"] == "d" and op["body"] == str(h["half_offset"]).encode()
            await c.close()

    arun(go())


def test_rollback_is_never_visible_and_commit_after_it_conflicts(tmp_path):
    async def go():
        async with broker(tmp_path) as b:
            c = await RawClient.open(b.address)
            h = await c.ok("send", half_fields())
            assert (await c.ok("end_transaction", end(h, "rollback")))["outcome"] == "rolled_back"
            code, f = await c.req("end_transaction", end(h, "commit"))
            assert code == ErrorCode.TX_CONFLICT and "rolled back" in f["error"]
            assert await pull_all(c) == []
            assert (await c.ok("end_transaction", end(h, "rollback")))["status"] == "already"
            await c.close()

    arun(go())


def test_validation_errors_are_distinct(tmp_path):
    async def go():
        async with broker(tmp_path) as b:
            c = await RawClient.open(b.address)
            h = await c.ok("send", half_fields())
            plain = await c.ok("send", {"topic": T, "body": b"x"})
            cases = [
                ({**end(h, "commit"), "commit_log_offset": 10**9}, ErrorCode.TX_NOT_FOUND),
                ({**end(h, "commit"), "commit_log_offset": plain["commit_log_offset"]}, ErrorCode.TX_NOT_HALF),
                ({**end(h, "commit"), "commit_log_offset": h["commit_log_offset"] + 1}, ErrorCode.TX_NOT_FOUND),
                (end(h, "commit", group="other"), ErrorCode.TX_GROUP_MISMATCH),
                ({**end(h, "commit"), "half_offset": 7}, ErrorCode.TX_OFFSET_MISMATCH),
                ({**end(h, "commit"), "tx_id": "nope"}, ErrorCode.TX_ID_MISMATCH),
                ({**end(h, "commit"), "state": "maybe"}, ErrorCode.INVALID_FIELD),
            ]
            for fields, code in cases:
                got, f = await c.req("end_transaction", fields)
                assert got == code, (fields, f)
            # a bad state is refused as such, before the half message is looked for
            got, f = await c.req("end_transaction", {**end(h, "commit"), "state": "maybe", "commit_log_offset": 10**9})
            assert (got, f["error"]) == (ErrorCode.INVALID_FIELD, "field 'state' must be commit, rollback or unknown"), f
            # nothing was decided by the bad requests
            assert (await c.ok("end_transaction", end(h, "commit")))["status"] == "ok"
            await c.close()

    arun(go())


def test_unknown_stays_pending(tmp_path):
    async def go():
        async with broker(tmp_path) as b:
            c = await RawClient.open(b.address)
            h = await c.ok("send", half_fields(DELAY="3"))
            r = await c.ok("end_transaction", end(h, "unknown"))
            assert r["status"] == "noop" and r["outcome"] == "pending"
            p = await c.ok("tx_pending", {})
            assert p["total"] == 1
            row = p["transactions"][0]
            assert row["tx_id"] == h["tx_id"] and row["group"] == G and row["topic"] == T and row["checks"] == 0
            off = await c.ok("tx_offsets", {})
            assert off["pending"] == 1 and off["half"]["max"] == 1
            await c.close()

    arun(go())


def test_dead_producer_is_resolved_by_check_back_from_another(tmp_path):
    clock = ManualClock()

    async def go():
        async with broker(tmp_path, clock) as b:
            a = await RawClient.open(b.address)
            await a.ok("hello", {"producer_groups": [G]})
            h = await a.ok("send", half_fields())
            await a.close()  # the producer dies before ending its transaction
            other = await RawClient.open(b.address)
            await other.ok("hello", {"producer_groups": [G]})
            core = b.core
            # younger than the transaction timeout: no check yet
            clock.advance(2)
            r = await core.check.run_pass()
            assert r["checked"] == 0 and other.pushes == []
            clock.advance(5)
            r = await core.check.run_pass()
            assert r["checked"] == 1
            push = await other.wait_push()
            assert push.op == "check_transaction"
            pf = push.fields
            assert pf["tx_id"] == h["tx_id"] and pf["half_offset"] == 1  # the re-appended copy
            assert pf["message"]["properties"]["TRANSACTION_CHECK_TIMES"] == "1"
            r = await other.ok("end_transaction", {"group": G, "tx_id": pf["tx_id"], "commit_log_offset": pf["commit_log_offset"],
                                                   "half_offset": pf["half_offset"], "state": "commit", "from_check": True})
            assert r["status"] == "ok"
            # the late original end (through the first copy) gets the first outcome; the opposite conflicts
            assert (await other.ok("end_transaction", end(h, "commit")))["status"] == "already"
            code, _ = await other.req("end_transaction", end(h, "rollback"))
            assert code == ErrorCode.TX_CONFLICT
            assert len(await pull_all(other)) == 1
            stats = (await other.ok("stats"))["counters"]
            assert stats["checks_sent"] == 1 and stats["checks_answered"] == 1 and stats["committed_check"] == 1
            # the next pass moves the progress past everything decided
            clock.advance(60)
            await core.check.run_pass()
            off = await other.ok("tx_offsets")
            assert off["half"]["progress"] == off["half"]["max"] == 2
            assert off["op"]["progress"] == off["op"]["max"] == 1
            await other.close()

    arun(go())


def test_no_producer_online_spends_no_check_and_holds_progress(tmp_path):
    clock = ManualClock()

    async def go():
        async with broker(tmp_path, clock) as b:
            c = await RawClient.open(b.address)
            h = await c.ok("send", half_fields())
            clock.advance(30)
            for _ in range(3):
                r = await b.core.check.run_pass()
                assert r["no_producer"] == 1 and r["checked"] == 0
            row = (await c.ok("tx_pending"))["transactions"][0]
            assert row["checks"] == 0 and row["last_check_result"] == "no producer online"
            assert (await c.ok("tx_offsets"))["half"]["progress"] == 0
            # a producer of the group comes back: check-backs resume
            p = await RawClient.open(b.address)
            await p.ok("hello", {"producer_groups": [G]})
            r = await b.core.check.run_pass()
            assert r["checked"] == 1
            push = await p.wait_push()
            assert push.fields["tx_id"] == h["tx_id"]
            await p.close()
            await c.close()

    arun(go())


def test_max_checks_discards_and_replay_brings_it_back(tmp_path):
    clock = ManualClock()

    async def go():
        async with broker(tmp_path, clock, max_checks=2) as b:
            p = await RawClient.open(b.address)
            await p.ok("hello", {"producer_groups": [G]})
            h = await p.ok("send", half_fields())
            for _ in range(2):
                clock.advance(10)
                assert (await b.core.check.run_pass())["checked"] == 1
                await p.wait_push()  # never answered: unknown
            clock.advance(10)
            r = await b.core.check.run_pass()
            assert r["discarded"] == 1
            d = (await p.ok("discard_list"))["discarded"]
            assert [x["tx_id"] for x in d] == [h["tx_id"]] and d[0]["checks"] == 2
            code, _ = await p.req("end_transaction", end(h, "commit"))
            assert code == ErrorCode.TX_CONFLICT  # discarded: producers cannot decide it any more
            # the discard topic is readable by its name and by its alias
            for name in ("TRANS_CHECK_MAX_TIME_TOPIC", "TRANS_CHECK_MAXTIME_TOPIC"):
                got = await p.ok("pull", {"topic": name, "queue_id": 0, "offset": 0})
                assert len(got["messages"]) == 1
            res = (await p.ok("discard_replay", {"to": "half", "refs": [{"tx_id": h["tx_id"]}]}))["results"]
            assert res[0]["status"] == "ok"
            row = (await p.ok("tx_pending"))["transactions"][0]
            assert row["tx_id"] == h["tx_id"] and row["checks"] == 0
            clock.advance(10)
            assert (await b.core.check.run_pass())["checked"] == 1
            push = await p.wait_push()
            pf = push.fields
            r = await p.ok("end_transaction", {"group": G, "tx_id": pf["tx_id"], "commit_log_offset": pf["commit_log_offset"],
                                               "half_offset": pf["half_offset"], "state": "commit", "from_check": True})
            assert r["status"] == "ok"
            assert len(await pull_all(p)) == 1
            await p.close()

    arun(go())


def test_discard_replay_to_commit(tmp_path):
    clock = ManualClock()

    async def go():
        async with broker(tmp_path, clock, max_checks=1) as b:
            p = await RawClient.open(b.address)
            await p.ok("hello", {"producer_groups": [G]})
            h = await p.ok("send", half_fields())
            clock.advance(10)
            await b.core.check.run_pass()
            clock.advance(10)
            assert (await b.core.check.run_pass())["discarded"] == 1
            dry = (await p.ok("discard_replay", {"to": "commit", "all": True, "dry_run": True}))["results"]
            assert dry[0]["status"] == "ok" and await pull_all(p) == []
            res = (await p.ok("discard_replay", {"to": "commit", "all": True}))["results"]
            assert res[0]["status"] == "ok" and res[0]["tx_id"] == h["tx_id"]
            assert len(await pull_all(p)) == 1
            assert (await p.ok("discard_list"))["discarded"] == []
            ops = (await p.ok("pull", {"topic": "RMQ_SYS_TRANS_OP_HALF_TOPIC", "queue_id": 0, "offset": 0}))["messages"]
            assert ops[-1]["body"] == str(h["half_offset"]).encode()  # names a half offset, not the discard offset
            assert ops[-1]["properties"]["TXMQ_DECIDED_BY"] == "operator"
            await p.close()

    arun(go())


def test_per_message_immunity_is_respected(tmp_path):
    clock = ManualClock()

    async def go():
        async with broker(tmp_path, clock) as b:
            p = await RawClient.open(b.address)
            await p.ok("hello", {"producer_groups": [G]})
            slow = await p.ok("send", half_fields(CHECK_IMMUNITY_TIME_IN_SECONDS="30"))
            fast = await p.ok("send", half_fields(b"o2"))
            clock.advance(7)
            r = await b.core.check.run_pass()
            assert r["checked"] == 1
            assert (await p.wait_push()).fields["tx_id"] == fast["tx_id"]
            assert (await p.ok("tx_offsets"))["half"]["progress"] == 0  # held by the immune one
            clock.advance(30)
            await b.core.check.run_pass()
            ids = set()
            while p.pushes or len(ids) < 2:
                ids.add((await p.wait_push()).fields["tx_id"])
            assert slow["tx_id"] in ids
            await p.close()

    arun(go())


def test_operator_resolve_by_every_ref_kind(tmp_path):
    async def go():
        async with broker(tmp_path) as b:
            c = await RawClient.open(b.address)
            hs = [await c.ok("send", half_fields(f"o{i}".encode())) for i in range(4)]
            refs = [{"tx_id": hs[0]["tx_id"]}, {"half_offset": hs[1]["half_offset"]}, {"commit_log_offset": hs[2]["commit_log_offset"]}, {"tx_id": "missing"}]
            res = (await c.ok("tx_resolve", {"action": "commit", "refs": refs}))["results"]
            assert [r["status"] for r in res] == ["ok", "ok", "ok", "not_found"]
            res = (await c.ok("tx_resolve", {"action": "rollback", "refs": [{"tx_id": hs[0]["tx_id"]}, {"tx_id": hs[3]["tx_id"]}]}))["results"]
            assert [r["status"] for r in res] == ["conflict", "ok"]
            res = (await c.ok("tx_resolve", {"action": "commit", "refs": [{"tx_id": hs[0]["tx_id"]}]}))["results"]
            assert res[0]["status"] == "already"
            assert len(await pull_all(c)) == 3
            assert (await c.ok("stats"))["counters"]["committed_operator"] == 3
            await c.close()

    arun(go())


def test_index_and_progress_survive_restart(tmp_path):
    clock = ManualClock()

    async def go():
        async with broker(tmp_path, clock) as b:
            c = await RawClient.open(b.address)
            await c.ok("hello", {"producer_groups": [G]})
            done = await c.ok("send", half_fields(b"a"))
            await c.ok("end_transaction", end(done, "commit"))
            pending = await c.ok("send", half_fields(b"b"))
            clock.advance(10)
            await b.core.check.run_pass()
            await c.wait_push()
            before = await c.ok("tx_offsets")
            await c.close()
        assert before["half"]["progress"] == 2  # past the decided one and the superseded copy
        async with broker(tmp_path, clock) as b:
            c = await RawClient.open(b.address)
            after = await c.ok("tx_offsets")
            # held_by names the same transaction; its age and the reason's timing move with the clock
            held_keys = ("tx_id", "group", "topic", "half_offset", "checks")
            assert {k: after["held_by"][k] for k in held_keys} == {k: before["held_by"][k] for k in held_keys}
            assert {k: v for k, v in after.items() if k != "held_by"} == {k: v for k, v in before.items() if k != "held_by"}
            row = (await c.ok("tx_pending"))["transactions"][0]
            assert row["tx_id"] == pending["tx_id"] and row["checks"] == 1
            assert (await c.ok("end_transaction", end(done, "commit")))["status"] == "already"
            code, _ = await c.req("end_transaction", end(done, "rollback"))
            assert code == ErrorCode.TX_CONFLICT
            await c.close()

    arun(go())


def test_config_set_persists_and_validates(tmp_path):
    async def go():
        async with broker(tmp_path) as b:
            c = await RawClient.open(b.address)
            r = await c.ok("config_set", {"key": "max_checks", "value": 3})
            assert r == {"key": "max_checks", "old": 15, "new": 3}
            code, _ = await c.req("config_set", {"key": "max_checks", "value": 0})
            assert code == ErrorCode.INVALID_CONFIG
            code, _ = await c.req("config_set", {"key": "bogus", "value": 1})
            assert code == ErrorCode.INVALID_CONFIG
            await c.close()
        async with running_broker(tmp_path / "data") as b:
            c = await RawClient.open(b.address)
            assert (await c.ok("config_get"))["max_checks"] == 3
            await c.close()

    arun(go())


@pytest.mark.parametrize("topic", ["RMQ_SYS_TRANS_HALF_TOPIC", "TRANS_CHECK_MAXTIME_TOPIC", "TRANS_CHECK_MAX_TIME_TOPIC", "RMQ_SYS_X"])
def test_system_topics_cannot_be_sent_to(tmp_path, topic):
    async def go():
        async with broker(tmp_path) as b:
            c = await RawClient.open(b.address)
            code, _ = await c.req("send", {"topic": topic, "body": b"x"})
            assert code == ErrorCode.SYSTEM_TOPIC
            await c.close()

    arun(go())


def test_a_producer_clock_ahead_does_not_hold_the_check_pass(tmp_path):
    clock = ManualClock()

    async def go():
        async with broker(tmp_path, clock) as b:
            p = await RawClient.open(b.address)
            await p.ok("hello", {"producer_groups": [G]})
            ahead = await p.ok("send", {**half_fields(), "born_ts": int((clock() + 86400) * 1000)})
            other = await p.ok("send", half_fields(b"o2"))
            clock.advance(10)
            r = await b.core.check.run_pass()
            assert r["checked"] == 2, r  # immunity counts from the store's time when the producer's is later
            ids = {(await p.wait_push()).fields["tx_id"] for _ in range(2)}
            assert ids == {ahead["tx_id"], other["tx_id"]}
            await p.close()

    arun(go())
