"""`txmq migrate` onto the real RocketMQ 4.9.8 (tests/rocketmq_peer.py): the plan, the backlog once per group in
per-queue order with its ids and properties, consumer offsets (Apache's Java push and pull consumers start where
each group stopped on txmq), a resume after SIGKILL, pending transactions, and a target that is not there."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time

import pytest
from brokerproc import BrokerProcess, free_port
from clihelpers import cli_argv, cli_env

from txmq.client import Client
from txmq.client.rocketmq4 import RocketMQ4

pytestmark = [pytest.mark.rocketmq_peer]


@pytest.fixture
def source(tmp_path):
    with BrokerProcess(tmp_path / "data", "--flush", "async") as b:
        yield b


def stamp() -> str:
    return str(time.time_ns())[-9:]


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cli_argv(*args), capture_output=True, timeout=timeout, env=cli_env(), stdin=subprocess.DEVNULL)


async def _requests(address: str, calls: list[tuple[str, dict]]) -> list[dict]:
    async with Client(address) as c:
        return [await c.request(op, f) for op, f in calls]


def requests(address: str, *calls: tuple[str, dict]) -> list[dict]:
    return asyncio.run(_requests(address, list(calls)))


def uniq(topic: str, q: int, i: int) -> str:
    return f"{topic}-Q{q}-M{i}"


def fill(address: str, topic: str, queues: int, per_queue: int, types: list[str] | None = None) -> None:
    calls: list[tuple[str, dict]] = [("create_topic", {"topic": topic, "queues": queues, **({"message_types": types} if types else {})})]
    for q in range(queues):
        msgs = [{"body": f"{topic}/{q}/{i}".encode(), "properties": {"KEYS": f"key{i} order{q}", "TAGS": f"Tag{i % 3}", "UNIQ_KEY": uniq(topic, q, i),
                                                                     "user-prop": f"v{i}"}} for i in range(per_queue)]
        calls.append(("send_batch", {"topic": topic, "messages": msgs, "queue_id": q}))
    requests(address, *calls)


def commit(address: str, group: str, topic: str, offsets: dict[int, int]) -> None:
    requests(address, *[("commit_offset", {"group": group, "topic": topic, "queue_id": q, "offset": o}) for q, o in offsets.items()])


def drained(peer, topic: str, group: str, mode: str, expect: int) -> dict:
    return peer.driver(peer.namesrv, "drain", topic=topic, group=group, mode=mode, expect=expect, idle=3000 if mode == "push" else 0,
                       timeout=90)


def by_queue(received: list[dict]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for m in received:
        out.setdefault(m["queueId"], []).append(m["body"])
    return out


def expected(topic: str, positions: dict[int, int], per_queue: int) -> dict[int, list[str]]:
    return {q: [f"{topic}/{q}/{i}" for i in range(p, per_queue)] for q, p in positions.items() if p < per_queue}


def test_the_dry_run_plan_names_topics_backlogs_schedule_pending_and_the_target(rocketmq_peer, source):
    t = f"MigPlan{stamp()}"
    fill(source.address, t, 3, 5, ["normal", "delay", "transaction"])
    commit(source.address, "plan-a", t, {0: 2, 1: 5, 2: 0})
    requests(source.address, ("send", {"topic": t, "body": b"later", "properties": {"TIMER_DELAY_MS": "600000", "UNIQ_KEY": "SCHED-1"}}),
             ("send", {"topic": t, "body": b"tx", "properties": {"TRAN_MSG": "true", "PGROUP": "plan-producers"}}))
    r = run_cli("migrate", "--to", rocketmq_peer.namesrv, "-b", source.address, "--dry-run", "-o", "json")
    assert r.returncode == 0, r.stderr.decode()
    plan = json.loads(r.stdout)["plan"]
    topic = next(x for x in plan["topics"] if x["topic"] == t)
    assert topic["queues"] == 3 and topic["action"] == "create" and "delay" in topic["message_types"]
    assert topic["backlog"] == 3 + 0 + 5
    group = next(g for g in plan["groups"] if g["group"] == "plan-a")
    assert group["topics"][t]["backlog"] == 8 and group["topics"][t]["queues"] == {"0": 2, "1": 5, "2": 0}
    sched = [s for s in plan["scheduled"] if s["topic"] == t]
    assert [s["msg_id"] for s in sched] == ["SCHED-1"]
    assert sched[0]["level"] == 18 and 3_000_000 <= sched[0]["late_ms"] <= 3_000_000 + 60_000  # the peer's levels: 1 s x 17, then 1 h
    assert [p["topic"] for p in plan["pending"]] == [t]
    assert plan["target"]["brokers"] and plan["target"]["broker"] == plan["target"]["brokers"][0]["name"]
    # nothing was created on the target
    assert asyncio.run(_route(rocketmq_peer.namesrv, t)) is None


async def _route(namesrv: str, topic: str):
    target = RocketMQ4(namesrv)
    try:
        return await target.route(topic)
    finally:
        await target.close()


async def _max_offsets(namesrv: str, topic: str, queues: int) -> list[int]:
    target = RocketMQ4(namesrv)
    try:
        brokers = await target.cluster()
        addr = next(b.master for b in brokers.values() if b.master)
        return [await target.max_offset(addr, topic, q) for q in range(queues)]
    finally:
        await target.close()


def test_each_group_receives_exactly_what_it_had_not_consumed_in_queue_order_with_its_ids(rocketmq_peer, source):
    s = stamp()
    plain, ordered = f"MigPlain{s}", f"MigOrdered{s}"
    fill(source.address, plain, 2, 12)
    fill(source.address, ordered, 4, 6)
    g1, g2, g3 = f"mig-g1-{s}", f"mig-g2-{s}", f"mig-g3-{s}"
    commit(source.address, g1, plain, {0: 3, 1: 10})
    commit(source.address, g2, plain, {0: 9, 1: 0})
    commit(source.address, g3, plain, {0: 0, 1: 0})  # consumed nothing
    commit(source.address, g1, ordered, {0: 2, 1: 6, 2: 0, 3: 5})
    commit(source.address, g2, ordered, {0: 4, 1: 1, 2: 3, 3: 6})
    r = run_cli("migrate", "--to", rocketmq_peer.namesrv, "-b", source.address, "--state", str(source.data_dir.parent / "st.json"),
                "-o", "json")
    assert r.returncode == 0, r.stderr.decode()
    summary = json.loads(r.stdout)["summary"]
    assert summary["duplicates_possible"] == 0
    # the union from the lowest position: plain q0 from 0, q1 from 0; ordered q0 from 2, q1 from 1, q2 from 0, q3 from 5
    assert summary["copied_per_topic"] == {plain: 24, ordered: 4 + 5 + 6 + 1}
    assert summary["consumed_not_copied"] == 2 + 1 + 5
    assert summary["per_group"][g1] == {plain: 9 + 2, ordered: 4 + 0 + 6 + 1}
    # Apache's Java consumers on the target: push (orderly) for g1 and g3, pull for g2
    cases = [(g1, plain, {0: 3, 1: 10}, 12, "push"), (g2, plain, {0: 9, 1: 0}, 12, "pull"), (g3, plain, {0: 0, 1: 0}, 12, "pull"),
             (g1, ordered, {0: 2, 1: 6, 2: 0, 3: 5}, 6, "pull"), (g2, ordered, {0: 4, 1: 1, 2: 3, 3: 6}, 6, "push")]
    for group, topic, positions, per_queue, mode in cases:
        want = expected(topic, positions, per_queue)
        got = drained(rocketmq_peer, topic, group, mode, sum(len(v) for v in want.values()))
        assert by_queue(got["received"]) == want, (group, topic, mode)
        for m in got["received"]:
            q, i = int(m["body"].split("/")[1]), int(m["body"].split("/")[2])
            assert m["msgId"] == m["properties"]["UNIQ_KEY"] == uniq(topic, q, i)
            assert m["keys"] == f"key{i} order{q}" and m["tags"] == f"Tag{i % 3}" and m["properties"]["user-prop"] == f"v{i}"
            assert not any(k.startswith("TXMQ_") for k in m["properties"])
    # the committed offsets as the target answers them (pull consumers commit nothing), for the group that consumed nothing too
    assert asyncio.run(_offsets(rocketmq_peer.namesrv, g3, plain, 2)) == [0, 0]
    assert asyncio.run(_offsets(rocketmq_peer.namesrv, g2, plain, 2)) == [9, 0]


async def _offsets(namesrv: str, group: str, topic: str, queues: int) -> list[int | None]:
    target = RocketMQ4(namesrv)
    try:
        brokers = await target.cluster()
        addr = next(b.master for b in brokers.values() if b.master)
        return [await target.query_offset(addr, group, topic, q) for q in range(queues)]
    finally:
        await target.close()


def test_a_run_killed_mid_way_resumes_without_sending_a_confirmed_message_twice(rocketmq_peer, source, tmp_path):
    t = f"MigKill{stamp()}"
    per_queue = 6000
    fill(source.address, t, 4, per_queue)
    group = f"mig-kill-{stamp()}"
    commit(source.address, group, t, {q: 0 for q in range(4)})
    state = tmp_path / "state.json"
    args = ["migrate", "--to", rocketmq_peer.namesrv, "-b", source.address, "--state", str(state), "--batch", "20", "-o", "jsonl"]
    proc = subprocess.Popen(cli_argv(*args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=cli_env(), stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    copied = 0
    while time.monotonic() < deadline:
        try:
            data = json.loads(state.read_text())
            copied = sum(e - s for qs in data["queues"].values() for s, e, _t in qs["runs"])
        except (FileNotFoundError, ValueError):
            copied = 0
        if copied >= 2000 or proc.poll() is not None:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be killed: " + proc.stderr.read().decode()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    killed_at = json.loads(state.read_text())
    confirmed = {k: [list(r) for r in qs["runs"]] for k, qs in killed_at["queues"].items()}
    in_flight = sum(qs["inflight"][1] - qs["inflight"][0] for qs in killed_at["queues"].values() if qs["inflight"])
    r = run_cli("migrate", "--to", rocketmq_peer.namesrv, "-b", source.address, "--state", str(state), "-o", "json")
    assert r.returncode == 0, r.stderr.decode()
    summary = json.loads(r.stdout)["summary"]
    assert summary["copied_per_topic"] == {t: 4 * per_queue}
    assert summary["duplicates_possible"] == in_flight  # exactly what was in flight when it was killed
    done = json.loads(state.read_text())
    for k, runs in confirmed.items():  # what was confirmed before the kill kept its place on the target
        for s, e, tgt in runs:
            for s2, e2, t2 in done["queues"][k]["runs"]:
                if s2 <= s < e2:
                    assert t2 + (s - s2) == tgt and e <= e2
    ends = asyncio.run(_max_offsets(rocketmq_peer.namesrv, t, 4))
    extra = sum(ends) - 4 * per_queue
    assert 0 <= extra <= summary["duplicates_possible"]
    got = drained(rocketmq_peer, t, group, "pull", 0)["received"]
    ids = [m["msgId"] for m in got]
    assert set(ids) == {uniq(t, q, i) for q in range(4) for i in range(per_queue)}
    assert len(ids) == 4 * per_queue + extra  # a group at the start of the range receives the possible duplicates too


def test_pending_transactions_stop_the_run_naming_each_with_its_resolve_command(rocketmq_peer, source):
    t = f"MigPending{stamp()}"
    fill(source.address, t, 1, 3)
    (half,) = requests(source.address, ("send", {"topic": t, "body": b"tx", "properties": {"TRAN_MSG": "true", "PGROUP": "mig-producers"}}))
    r = run_cli("migrate", "--to", rocketmq_peer.namesrv, "-b", source.address, "--state", str(source.data_dir.parent / "st.json"),
                "--wait-pending", "500ms")
    assert r.returncode == 7, r.stderr.decode()
    text = r.stderr.decode()
    assert f"txmq resolve --commit {half['tx_id']}" in text and f"txmq resolve --rollback {half['tx_id']}" in text
    assert "nothing was moved" in text
    assert asyncio.run(_route(rocketmq_peer.namesrv, t)) is None
    assert not (source.data_dir.parent / "st.json").exists()


def test_an_unreachable_target_is_one_clear_line(source):
    port = free_port()
    r = run_cli("migrate", "--to", f"127.0.0.1:{port}", "-b", source.address, "--dry-run")
    assert r.returncode == 3
    lines = r.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "unreachable" in lines[0], lines


def test_a_target_that_is_not_rocketmq_is_one_clear_line(source, tmp_path):
    with BrokerProcess(tmp_path / "other", "--flush", "async") as other:  # txmq's native port: not RocketMQ's protocol
        r = run_cli("migrate", "--to", other.address, "-b", source.address, "--dry-run")
    assert r.returncode == 12
    lines = r.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "not a RocketMQ name server" in lines[0], lines


def test_follow_forwards_scheduled_messages_when_due_and_later_sends_until_idle(rocketmq_peer, source, tmp_path):
    t = f"MigFollow{stamp()}"
    fill(source.address, t, 2, 3, ["normal", "delay", "transaction"])
    group = f"mig-follow-{stamp()}"
    commit(source.address, group, t, {0: 1, 1: 3})
    due = int(time.time() * 1000) + 4000
    requests(source.address, ("send", {"topic": t, "body": f"{t}/0/due".encode(), "queue_id": 0,
                                       "properties": {"TIMER_DELIVER_MS": str(due), "UNIQ_KEY": "FOLLOW-DUE"}}))
    state = tmp_path / "state.json"
    proc = subprocess.Popen(cli_argv("migrate", "--to", rocketmq_peer.namesrv, "-b", source.address, "--state", str(state), "--follow",
                                     "--until-idle", "8s", "-o", "jsonl"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env(),
                            stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the backlog is moved and the offsets committed: producers switch now
        try:
            if json.loads(state.read_text())["offsets_committed"]:
                break
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.05)
    requests(source.address, ("send", {"topic": t, "body": f"{t}/1/late".encode(), "queue_id": 1, "properties": {"UNIQ_KEY": "FOLLOW-LATE"}}))
    out, errs = proc.communicate(timeout=120)
    assert proc.returncode == 0, errs.decode()
    events = [json.loads(x) for x in out.decode().splitlines()]
    summary = events[-1]
    assert summary["event"] == "summary" and summary["forwarded_this_run"] == 2
    got = drained(rocketmq_peer, t, group, "pull", 0)["received"]
    assert by_queue(got) == {0: [f"{t}/0/1", f"{t}/0/2", f"{t}/0/due"], 1: [f"{t}/1/late"]}
    due_msg = next(m for m in got if m["msgId"] == "FOLLOW-DUE")
    assert int(due_msg["properties"]["TIMER_DEQUEUE_MS"]) >= due  # delivered by txmq when due, then forwarded
