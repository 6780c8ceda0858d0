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


# ---- retry and dead-letter topics --------------------------------------------------------------------------------

def _source_with_retries() -> dict:
    """txmq's side of a plan: a topic, group g's retry topic (g consumed its first retry), group h's retry topic (h never
    committed in it), g's dead-letter topic, and a retry of g's still in the schedule."""
    def q(topic, qid, lo, hi):
        return {"topic": topic, "queue_id": qid, "min_offset": lo, "max_offset": hi}

    topics = {"T": {"topic": "T", "queues": 2, "messages": 10}, "%RETRY%g": {"topic": "%RETRY%g", "queues": 1, "messages": 3},
              "%RETRY%h": {"topic": "%RETRY%h", "queues": 1, "messages": 2}, "%DLQ%g": {"topic": "%DLQ%g", "queues": 1, "messages": 2}}
    queues = {"T": [q("T", 0, 0, 5), q("T", 1, 0, 5)], "%RETRY%g": [q("%RETRY%g", 0, 0, 3)], "%RETRY%h": [q("%RETRY%h", 0, 0, 2)],
              "%DLQ%g": [q("%DLQ%g", 0, 0, 2)]}
    groups = [{"group": "g", "consumers": 0, "queues": [{**q("T", 0, 0, 5), "committed": 5}, {**q("T", 1, 0, 5), "committed": 5},
                                                       {**q("%RETRY%g", 0, 0, 3), "committed": 1},
                                                       {**q("%DLQ%g", 0, 0, 2), "committed": 2}]},  # a replay group's position: not g's
              {"group": "h", "consumers": 0, "queues": [{**q("T", 0, 0, 5), "committed": 4}, {**q("T", 1, 0, 5), "committed": 5}]}]
    scheduled = [{"msg_id": "R1", "topic": "%RETRY%g", "queue_id": 0, "deliver_at_ms": 1_000_000 + 5_000, "commit_log_offset": 77}]
    return {"info": {}, "topics": topics, "queues": queues, "groups": groups, "scheduled": scheduled, "pending": []}


def _target_without_topics() -> dict:
    from txmq.client.rocketmq4 import BrokerInfo

    return {"brokers": {"b": BrokerInfo("b", "C", {0: "tgt:10911"})}, "chosen": "b", "routes": {}, "config": {"messageDelayLevel": "1s 10s"},
            "ends": {}}


def test_the_plan_moves_each_groups_pending_retries_from_its_position_and_dead_letters_whole():
    from txmq.client.migrate.plan import build

    plan = build(_source_with_retries(), _target_without_topics(), "ns:9876", "txmq:10911", follow=False, now_ms=1_000_000)
    topics = {t["topic"]: t for t in plan["topics"]}
    assert {n: (t["kind"], t["queues"], t["action"], t["backlog"]) for n, t in topics.items()} == {
        "T": ("topic", 2, "create", 1), "%RETRY%g": ("retry", 1, "create", 2), "%RETRY%h": ("retry", 1, "create", 2),
        "%DLQ%g": ("dlq", 1, "create", 2)}
    queues = {(q["topic"], q["queue_id"]): q for q in plan["queues"]}
    assert queues[("%RETRY%g", 0)]["start"] == 1 and queues[("%RETRY%g", 0)]["positions"] == {"g": 1}
    assert queues[("%RETRY%h", 0)]["start"] == 0 and queues[("%RETRY%h", 0)]["positions"] == {"h": 0}  # never committed: all waiting
    assert queues[("%DLQ%g", 0)]["start"] == 0 and queues[("%DLQ%g", 0)]["positions"] == {}  # every dead letter, no offsets
    groups = {g["group"]: g for g in plan["groups"]}
    assert groups["g"]["topics"]["%RETRY%g"] == {"backlog": 2, "queues": {"0": 1}} and "%DLQ%g" not in groups["g"]["topics"]
    assert groups["h"]["topics"]["%RETRY%h"] == {"backlog": 2, "queues": {"0": 0}}
    assert [(m["msg_id"], m["kind"], m["level"]) for m in plan["scheduled"]] == [("R1", "retry", 2)]  # 5 s left: the 10 s level
    assert plan["totals"]["retries"] == 4 and plan["totals"]["scheduled_retries"] == 1 and plan["totals"]["dead_letters"] == 2
    assert not [n for n in plan["not_moved"] if "%" in n["what"]] and not plan["problems"]


def test_without_dead_letters_the_plan_leaves_the_dead_letter_topics_and_says_so():
    from txmq.client.migrate.plan import build

    plan = build(_source_with_retries(), _target_without_topics(), "ns:9876", "txmq:10911", follow=False, now_ms=1_000_000,
                 dead_letters=False)
    assert sorted(t["topic"] for t in plan["topics"]) == ["%RETRY%g", "%RETRY%h", "T"]
    assert [(n["what"], n["messages"]) for n in plan["not_moved"]] == [("topic %DLQ%g", 2)]
    assert plan["totals"]["dead_letters"] == 0 and plan["totals"]["retries"] == 4 and plan["dead_letters"] is False


def test_a_retry_carries_its_reconsume_count_in_the_send_header_and_never_reaches_the_limit_there():
    from txmq.client.migrate.mover import reconsume_header

    props = {"RECONSUME_TIME": "16", "MAX_RECONSUME_TIMES": "16", "RETRY_TOPIC": "T", "ORIGIN_MESSAGE_ID": "O"}
    assert reconsume_header("%RETRY%g", props) == (16, 17) and props == {"RETRY_TOPIC": "T", "ORIGIN_MESSAGE_ID": "O"}
    assert reconsume_header("%RETRY%g", {"RECONSUME_TIME": "2"}) == (2, 16)
    assert reconsume_header("%RETRY%g", {"RECONSUME_TIME": "x"}) == (0, 16)
    assert reconsume_header("%DLQ%g", {"RECONSUME_TIME": "3"}) == (3, None)


def _retry_state(tmp_path, topic: str, end: int):
    plan = {"target": {"max_message_size": 4 << 20}, "scheduled": [],
            "topics": [{"topic": topic, "queues": 1, "action": "exists", "broker": "b", "address": "tgt:10911"}],
            "queues": [{"topic": topic, "queue_id": 0, "min": 0, "max": end, "start": 0, "end": end, "positions": {"g": 0}, "target_base": 0}]}
    return State.new(tmp_path / "s.json", {"broker_id": "/d"}, "ns:9876", plan)


class _Retries(_Source):
    async def request(self, op: str, fields: dict) -> dict:
        r = await super().request(op, fields)
        for m in r["messages"]:
            i = m["queue_offset"]
            m["properties"].update({"RETRY_TOPIC": "T", "RECONSUME_TIME": str(i + 1), "MAX_RECONSUME_TIMES": "16", "ORIGIN_MESSAGE_ID": f"O{i}",
                                    "TXMQ_DLQ_REASON": "consumer", "TXMQ_STORED": "x"})
        return r


class _OneByOne(_Target):
    """Single sends (SEND_MESSAGE_V2): each stored at the next offset; a batch send is refused."""

    def __init__(self, failures: list | None = None) -> None:
        super().__init__(failures)
        self.headers: list[tuple[int, int | None]] = []
        self.props: list[dict] = []

    async def send_batch(self, address, topic, queue_id, messages):
        raise AssertionError("a retry or dead-letter topic is sent one message at a time")

    async def send(self, address, topic, queue_id, body, props, flag=0, reconsume_times=0, max_reconsume_times=None):
        from txmq.client.rocketmq4 import SendReceipt

        await asyncio.sleep(0)
        if self.failures:
            f = self.failures.pop(0)
            if f is not None:
                raise f
        self.stored.append(props["UNIQ_KEY"])
        self.headers.append((reconsume_times, max_reconsume_times))
        self.props.append(props)
        return SendReceipt(queue_id, len(self.stored) - 1, [])


def test_retries_are_sent_one_at_a_time_with_their_reconsume_counts(tmp_path):
    from txmq.client.migrate.mover import Mover

    target = _OneByOne()
    st = _retry_state(tmp_path, "%RETRY%g", 3)
    asyncio.run(Mover(_Retries(3), target, st, batch_count=2).copy())
    assert target.stored == ["U0", "U1", "U2"] and target.headers == [(1, 16), (2, 16), (3, 16)]
    assert target.props[0] == {"UNIQ_KEY": "U0", "RETRY_TOPIC": "T", "ORIGIN_MESSAGE_ID": "O0"}
    assert st.data["queues"]["%RETRY%g/0"]["runs"] == [[0, 3, 0]]


def test_a_dead_letter_keeps_why_txmq_gave_it_up(tmp_path):
    from txmq.client.migrate.mover import Mover

    target = _OneByOne()
    asyncio.run(Mover(_Retries(1), target, _retry_state(tmp_path, "%DLQ%g", 1)).copy())
    assert target.headers == [(1, None)]
    assert target.props[0] == {"UNIQ_KEY": "U0", "RETRY_TOPIC": "T", "ORIGIN_MESSAGE_ID": "O0", "TXMQ_DLQ_REASON": "consumer"}


def test_a_retry_whose_answer_was_lost_is_the_only_possible_duplicate_and_those_before_it_stay_confirmed(tmp_path):
    from txmq.client.migrate.mover import Mover
    from txmq.client.rocketmq4 import TargetUnreachable

    lost = TargetUnreachable("the connection to tgt:10911 was lost (IncompleteReadError)")
    target = _OneByOne([None, lost, None, None])  # U0 stored; U1's answer lost; then U1 (again) and U2
    st = _retry_state(tmp_path, "%RETRY%g", 3)
    events: list[dict] = []
    asyncio.run(Mover(_Retries(3), target, st, batch_count=3, on_event=events.append).copy())
    assert target.stored == ["U0", "U1", "U2"]
    assert st.data["duplicates_possible"] == 1 and [e["may_duplicate"] for e in events if e["event"] == "retrying"] == [1]
    assert st.data["queues"]["%RETRY%g/0"]["runs"] == [[0, 3, 0]] and st.data["queues"]["%RETRY%g/0"]["inflight"] is None


def test_a_run_stopped_after_a_retrys_answer_was_lost_counts_it_when_resumed(tmp_path):
    from txmq.client.migrate.mover import MigrationError, Mover
    from txmq.client.rocketmq4 import TargetUnreachable

    lost = TargetUnreachable("the connection to tgt:10911 was lost (IncompleteReadError)")
    st = _retry_state(tmp_path, "%RETRY%g", 3)
    try:
        asyncio.run(Mover(_Retries(3), _OneByOne([None, lost]), st, batch_count=3, retry_for=0.0, clock=iter(range(0, 100, 5)).__next__).copy())
        raise AssertionError("the run went on past the retry time")
    except MigrationError:
        pass
    saved = json.loads((tmp_path / "s.json").read_text())["queues"]["%RETRY%g/0"]
    assert saved["runs"] == [[0, 1, 0]] and saved["inflight"] == [1, 2]  # U0 confirmed; U1 in doubt
    target = _OneByOne()
    st2 = State.load(tmp_path / "s.json")
    asyncio.run(Mover(_Retries(3), target, st2, batch_count=3).copy())
    assert target.stored == ["U1", "U2"] and st2.data["duplicates_possible"] == 1


def test_a_scheduled_retry_is_sent_to_the_retry_topic_with_its_delay_level_and_reconsume_count(tmp_path):
    import time

    from txmq.client.migrate.mover import Mover

    due = int(time.time() * 1000) + 600_000
    row = {"msg_id": "R1", "topic": "%RETRY%g", "queue_id": 0, "deliver_at_ms": due, "commit_log_offset": 77}

    class Schedule:
        async def request(self, op: str, fields: dict) -> dict:
            assert op == "list_scheduled" and fields["bodies"]
            return {"messages": [{**row, "body": b"r", "properties": {"UNIQ_KEY": "U1", "RETRY_TOPIC": "T", "RECONSUME_TIME": "3",
                                                                       "REAL_TOPIC": "%RETRY%g", "TIMER_DELAY_MS": "600000"}}]}

    st = _retry_state(tmp_path, "%RETRY%g", 0)
    st.data["plan"]["scheduled"] = [row]
    target = _OneByOne()
    moved = asyncio.run(Mover(Schedule(), target, st).move_scheduled([1.0, 60.0, 3600.0]))
    assert moved["moved"] == 1 and moved["left"] == []
    assert target.headers == [(3, 16)] and target.props == [{"UNIQ_KEY": "U1", "RETRY_TOPIC": "T", "DELAY": "3"}]


def test_a_resumed_retry_batch_in_doubt_stays_in_doubt_past_a_second_lost_answer(tmp_path):
    from txmq.client.migrate.mover import Mover
    from txmq.client.rocketmq4 import TargetUnreachable

    lost = TargetUnreachable("the connection to tgt:10911 was lost (IncompleteReadError)")
    st = _retry_state(tmp_path, "%RETRY%g", 3)
    st.data["queues"]["%RETRY%g/0"]["inflight"] = [0, 3]  # the last run stopped with all three sent, unanswered
    target = _OneByOne([None, lost, None, None])  # U0 stored; U1's answer lost; then U1 (again) and U2
    asyncio.run(Mover(_Retries(3), target, st, batch_count=3).copy())
    assert target.stored == ["U0", "U1", "U2"] and st.data["duplicates_possible"] == 3  # each of the three was in doubt once
