"""The pieces of `txmq migrate` that need no RocketMQ: the batch encoding (read back by txmq's own remoting front
end), fastjson bodies, the progress file and the offset mapping, and the scheduled listing with bodies."""

from __future__ import annotations

import asyncio
import json
import os

from txmq.broker.remoting.messages import decode_batch
from txmq.client.migrate.mover import for_target
from txmq.client.migrate.state import State, target_offset
from txmq.remoting_codec import encode_batch, load_fastjson


def test_a_batch_body_is_read_back_by_the_remoting_front_end_message_by_message():
    msgs = [(b"a" * 300, {"KEYS": "k1 k2", "TAGS": "T", "UNIQ_KEY": "U1", "p": "ü"}, 0), (b"", {}, 7), (b"\x00\x01", {"UNIQ_KEY": "U3"}, -1)]
    assert decode_batch(encode_batch(msgs)) == [(f, b, p) for b, p, f in msgs]


def test_fastjson_integer_keys_are_read_outside_strings_only():
    body = b'{"brokerAddrTable":{"b":{"brokerAddrs":{0:"127.0.0.1:10911",1:"x,2:y"},"cluster":"C"}}}'
    assert load_fastjson(body) == {"brokerAddrTable": {"b": {"brokerAddrs": {"0": "127.0.0.1:10911", "1": "x,2:y"}, "cluster": "C"}}}


def test_what_txmq_adds_is_not_carried_to_the_target_and_the_flag_is():
    props, flag = for_target({"UNIQ_KEY": "U", "KEYS": "k", "TXMQ_RMQ_FLAG": "5", "TXMQ_SCHEDULED_FROM": "9", "TRAN_MSG": "true",
                              "REAL_TOPIC": "x", "TIMER_DELIVER_MS": "1", "TIMER_ENQUEUE_MS": "2", "user": "v"})
    assert props == {"UNIQ_KEY": "U", "KEYS": "k", "TIMER_ENQUEUE_MS": "2", "user": "v"} and flag == 5


def test_a_group_starts_at_the_copy_of_its_first_unconsumed_message():
    qs = {"runs": []}
    for src, tgt in [(0, 100), (1, 101), (2, 102), (4, 103), (5, 107)]:  # 3 not copied; another producer's messages at 104-106
        State.add_run(qs, src, src + 1, tgt)
    assert qs["runs"] == [[0, 3, 100], [4, 5, 103], [5, 6, 107]]
    assert [target_offset(qs["runs"], p, 50) for p in (0, 2, 3, 4, 5, 6, 9)] == [100, 102, 103, 103, 107, 108, 108]
    assert target_offset([], 7, 50) == 50


def test_the_progress_file_is_replaced_whole(tmp_path):
    path = tmp_path / "s.json"
    plan = {"queues": [{"topic": "t", "queue_id": 0, "start": 3}]}
    st = State.new(path, {"broker_id": "/d"}, "ns:9876", plan)
    st.save()
    st.data["queues"]["t/0"]["next"] = 10
    st.save()
    assert json.loads(path.read_text())["queues"]["t/0"]["next"] == 10
    assert State.load(path).data["queues"]["t/0"]["next"] == 10
    assert os.listdir(tmp_path) == ["s.json"]


def test_the_scheduled_listing_gives_bodies_and_properties_when_asked(tmp_path):
    from txmq.broker.testing import running_broker
    from txmq.client import Client

    async def main():
        async with running_broker(tmp_path / "data") as b:
            async with Client(b.address) as c:
                await c.request("create_topic", {"topic": "s", "message_types": ["normal", "delay"]})
                await c.request("send", {"topic": "s", "body": b"later", "properties": {"TIMER_DELAY_MS": "600000", "KEYS": "k"}})
                plain = await c.request("list_scheduled", {})
                full = await c.request("list_scheduled", {"bodies": True})
                return c.hello["features"], plain["messages"][0], full["messages"][0]

    features, plain, full = asyncio.run(main())
    assert "scheduled_bodies" in features
    assert "body" not in plain and "properties" not in plain
    assert full["body"] == b"later" and full["properties"]["KEYS"] == "k" and full["properties"]["REAL_TOPIC"] == "s"


# ---- the mover against stand-ins for txmq and the target: what an interruption leaves in the progress file ----------

def _one_queue_state(tmp_path, end: int):
    plan = {"target": {"max_message_size": 4 << 20}, "scheduled": [],
            "topics": [{"topic": "t", "queues": 1, "action": "exists", "broker": "b", "address": "tgt:10911"}],
            "queues": [{"topic": "t", "queue_id": 0, "min": 0, "max": end, "start": 0, "end": end, "positions": {"g": 0}, "target_base": 0}]}
    return State.new(tmp_path / "s.json", {"broker_id": "/d"}, "ns:9876", plan)


class _Source:
    """txmq's pulls; from pull number ``fail_at`` on, the broker is gone."""

    def __init__(self, end: int, fail_at: int | None = None) -> None:
        self.end, self.fail_at, self.pulls = end, fail_at, 0

    async def request(self, op: str, fields: dict) -> dict:
        from txmq.client.connection import ConnectionLost

        assert op == "pull"
        self.pulls += 1
        await asyncio.sleep(0)
        if self.fail_at is not None and self.pulls >= self.fail_at:
            raise ConnectionLost("broker 127.0.0.1:1 unreachable for 3 s")
        start = fields["offset"]
        stop = min(self.end, start + fields["max_count"])
        msgs = [{"queue_offset": i, "body": f"m{i}".encode(), "properties": {"UNIQ_KEY": f"U{i}"}, "msg_id": f"U{i}"} for i in range(start, stop)]
        return {"status": "found" if msgs else "no_new_msg", "messages": msgs, "next_offset": stop}


class _Target:
    """The target's batch sends; ``failures`` says what each send does in turn (an exception to raise, or None: store it)."""

    def __init__(self, failures: list | None = None) -> None:
        self.failures = list(failures or [])
        self.stored: list[str] = []

    async def send_batch(self, address, topic, queue_id, messages):
        from txmq.client.rocketmq4 import SendReceipt

        await asyncio.sleep(0)
        if self.failures:
            f = self.failures.pop(0)
            if f is not None:
                raise f
        first = len(self.stored)
        self.stored += [p["UNIQ_KEY"] for _b, p, _f in messages]
        return SendReceipt(queue_id, first, [])


def test_txmq_going_away_during_the_read_ahead_keeps_the_batches_the_target_confirmed(tmp_path):
    from txmq.client.connection import ConnectionLost
    from txmq.client.migrate.mover import Mover

    st = _one_queue_state(tmp_path, 10)
    target = _Target()
    mover = Mover(_Source(10, fail_at=2), target, st, batch_count=2)  # pull 1: the first batch; pull 2, the read-ahead: txmq is gone
    try:
        asyncio.run(mover.copy())
        raise AssertionError("copy went on without txmq")
    except ConnectionLost:
        pass
    saved = json.loads((tmp_path / "s.json").read_text())["queues"]["t/0"]
    assert target.stored == ["U0", "U1"]
    assert saved["inflight"] is None and saved["runs"] == [[0, 2, 0]] and saved["next"] == 2  # confirmed, not to be sent again
    st2 = State.load(tmp_path / "s.json")
    target2 = _Target()
    resumed = Mover(_Source(10), target2, st2, batch_count=2)
    asyncio.run(resumed.copy())
    assert target2.stored == [f"U{i}" for i in range(2, 10)] and st2.data["duplicates_possible"] == 0


def test_a_send_that_never_left_is_not_counted_as_a_possible_duplicate_and_one_that_did_is(tmp_path):
    from txmq.client.migrate.mover import Mover
    from txmq.client.rocketmq4 import TargetUnreachable

    refused = TargetUnreachable("cannot connect to tgt:10911: Connection refused", sent=False)
    lost = TargetUnreachable("the connection to tgt:10911 was lost (IncompleteReadError)")
    st = _one_queue_state(tmp_path, 6)
    target = _Target([None, refused, None, lost, refused, None])
    events: list[dict] = []
    mover = Mover(_Source(6), target, st, batch_count=2, on_event=events.append)
    asyncio.run(mover.copy())
    assert target.stored == ["U0", "U1", "U2", "U3", "U4", "U5"]
    assert st.data["duplicates_possible"] == 2  # the batch sent when the connection dropped; not the sends that found no connection
    assert [e["may_duplicate"] for e in events if e["event"] == "retrying"] == [0, 2, 2]


def test_each_outage_of_the_target_gets_the_whole_retry_time(tmp_path):
    from txmq.client.migrate.mover import Mover
    from txmq.client.rocketmq4 import TargetUnreachable

    now = [0.0]
    down = TargetUnreachable("cannot connect to tgt:10911: Connection refused", sent=False)

    class Clock:
        def __call__(self) -> float:
            now[0] += 0.4  # each look at the clock: 0.4 s later
            return now[0]

    st = _one_queue_state(tmp_path, 8)
    target = _Target([down, None, down, None, down, None, None])
    mover = Mover(_Source(8), target, st, batch_count=2, retry_for=1.0, clock=Clock())
    asyncio.run(mover.copy())  # three outages of 0.4 s each by the clock, 1.2 s and more in all: each within the 1 s allowed
    assert target.stored == [f"U{i}" for i in range(8)]


def test_a_message_sent_without_a_client_id_keeps_the_id_txmq_gave_it(tmp_path):
    from txmq.client.migrate.mover import Mover

    class NoIds(_Source):
        async def request(self, op: str, fields: dict) -> dict:
            r = await super().request(op, fields)
            for m in r["messages"]:
                m["properties"], m["msg_id"] = {"KEYS": "k"}, f"{m['queue_offset']:016X}"
            return r

    target = _Target()
    asyncio.run(Mover(NoIds(3), target, _one_queue_state(tmp_path, 3), batch_count=2).copy())
    assert target.stored == ["0000000000000000", "0000000000000001", "0000000000000002"]
