"""What a client writes into a message (its body's bytes, its properties) never becomes more than that message.

A body can hold any bytes, including a valid encoded record whose offset
field names the very place it lands at: reads at an offset a client gives
(end_transaction, get_message, tx_history, resolve by offset) check the
record against its consume-queue entry, which only stored records have.
Properties are strings a producer chose: a check immunity no number can
carry, or an id or group longer than any request takes, must not break
replies or make a transaction nobody can name.
"""

from __future__ import annotations

import time

from conftest import arun
from txmq.broker.testing import running_broker
from txmq.constants import HALF_TOPIC
from txmq.store import Message, TxType
from txmq.store.codec import HEADER_SIZE, encode_record
from txmq.wire import ErrorCode
from wireclient import RawClient


def test_a_half_message_forged_inside_a_body_cannot_decide_another_producers_transaction(tmp_path):
    async def go() -> None:
        async with running_broker(tmp_path / "data") as b:
            victim, evil = await RawClient.open(b.address), await RawClient.open(b.address)
            h = await victim.ok("send", {"topic": "orders", "body": b"real order", "properties": {"TRAN_MSG": "true", "PGROUP": "victim"}})
            tx = h["tx_id"]
            at = (await evil.ok("broker_info", {}))["max_offset"]
            body_start = at + HEADER_SIZE + len(b"t") + 1  # topic "t", empty properties (1 byte)
            forged = encode_record(Message(HALF_TOPIC, 0, TxType.PREPARED, 0,
                                           {"UNIQ_KEY": tx, "PGROUP": "evil", "REAL_TOPIC": "orders", "REAL_QID": "0",
                                            "TRAN_MSG": "true"}, b"FORGED order"),
                                   body_start, h["half_offset"], int(time.time() * 1000))
            assert (await evil.ok("send", {"topic": "t", "body": forged}))["commit_log_offset"] == at
            assert b.core.store.read(body_start).body == b"FORGED order"  # the bytes do validate as a record

            code, e = await evil.req("end_transaction", {"group": "evil", "tx_id": tx, "commit_log_offset": body_start,
                                                         "half_offset": h["half_offset"], "state": "commit"})
            assert code == ErrorCode.TX_NOT_FOUND, (code, e)
            code, e = await evil.req("get_message", {"commit_log_offset": body_start})
            assert code == ErrorCode.NO_SUCH_MESSAGE, (code, e)
            code, e = await evil.req("tx_history", {"commit_log_offset": body_start})
            assert code == ErrorCode.TX_NOT_FOUND, (code, e)
            r = await evil.ok("tx_resolve", {"action": "commit", "refs": [{"commit_log_offset": body_start}]})
            assert [x["status"] for x in r["results"]] == ["not_found"], r

            await victim.ok("end_transaction", {"group": "victim", "tx_id": tx, "commit_log_offset": h["commit_log_offset"],
                                                "half_offset": h["half_offset"], "state": "rollback"})
            assert (await victim.ok("pull", {"topic": "orders", "queue_id": 0, "offset": 0}))["messages"] == []
            await victim.close()
            await evil.close()

    arun(go())


def test_a_check_immunity_no_number_can_carry_leaves_pending_listings_and_history_answering(tmp_path):
    """CHECK_IMMUNITY_TIME_IN_SECONDS is a producer's string: inf, nan or 1e20 seconds must not break replies."""
    async def go() -> None:
        async with running_broker(tmp_path / "data") as b:
            c = await RawClient.open(b.address)
            sent = [await c.ok("send", {"topic": "t", "body": b"x", "properties": {"TRAN_MSG": "true", "PGROUP": "g",
                                                                                   "CHECK_IMMUNITY_TIME_IN_SECONDS": v}})
                    for v in ("inf", "nan", "-inf", "1e308", "1e20", "60")]
            listed = (await c.ok("tx_pending", {}))["transactions"]
            assert sorted(t["tx_id"] for t in listed) == sorted(h["tx_id"] for h in sent)
            assert all(0 < t["next_check_at"] < 2 ** 63 for t in listed), listed
            for h in sent:
                assert (await c.ok("tx_history", {"tx_id": h["tx_id"]}))["state"] == "pending"
            await c.close()

    arun(go())


def test_a_half_message_whose_id_or_group_no_request_could_name_is_refused(tmp_path):
    async def go() -> None:
        async with running_broker(tmp_path / "data") as b:
            c = await RawClient.open(b.address)
            for props in ({"UNIQ_KEY": "k" * 256, "PGROUP": "g"}, {"PGROUP": "g" * 256}):
                code, e = await c.req("send", {"topic": "t", "body": b"x", "properties": {"TRAN_MSG": "true", **props}})
                assert code == ErrorCode.INVALID_FIELD and "longer than 255" in e["error"], (code, e)
            h = await c.ok("send", {"topic": "t", "body": b"x", "properties": {"TRAN_MSG": "true", "PGROUP": "g" * 255,
                                                                               "UNIQ_KEY": "k" * 255}})
            await c.ok("end_transaction", {"group": "g" * 255, "tx_id": h["tx_id"], "commit_log_offset": h["commit_log_offset"],
                                           "half_offset": h["half_offset"], "state": "commit"})
            await c.close()

    arun(go())
