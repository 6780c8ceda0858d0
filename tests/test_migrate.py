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


def progress(state) -> tuple[int, int]:
    """(messages confirmed, messages in flight) in the progress file, (0, 0) before it is written."""
    try:
        data = json.loads(state.read_text())
    except (FileNotFoundError, ValueError):
        return 0, 0
    confirmed = sum(e - s for qs in data["queues"].values() for s, e, _t in qs["runs"])
    in_flight = sum(qs["inflight"][1] - qs["inflight"][0] for qs in data["queues"].values() if qs["inflight"])
    return confirmed, in_flight


def start_migration(state, *args: str) -> subprocess.Popen:
    out = open(state.parent / (state.name + ".events"), "wb")
    try:
        return subprocess.Popen(cli_argv("migrate", "--state", str(state), "-o", "jsonl", *args), stdout=out, stderr=subprocess.PIPE,
                                env=cli_env(), stdin=subprocess.DEVNULL)
    finally:
        out.close()


def wait_mid_way(proc: subprocess.Popen, state, confirmed_at_least: int) -> None:
    """Until the progress file shows that many messages confirmed and a batch in flight (the run still going)."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        confirmed, in_flight = progress(state)
        if confirmed >= confirmed_at_least and in_flight:
            return
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before it could be interrupted: " + proc.stderr.read().decode()
    raise AssertionError(f"no progress to interrupt at: {progress(state)}")


def confirmed_runs(state) -> dict[str, list[list[int]]]:
    return {k: [list(r) for r in qs["runs"]] for k, qs in json.loads(state.read_text())["queues"].items()}


def assert_kept_their_place(before: dict[str, list[list[int]]], state) -> None:
    """What was confirmed before an interruption is where it was on the target: it was not sent again."""
    after = confirmed_runs(state)
    for k, runs in before.items():
        for s, e, tgt in runs:
            assert any(s2 <= s and e <= e2 and t2 + (s - s2) == tgt for s2, e2, t2 in after[k]), (k, [s, e, tgt], after[k])


def test_txmq_killed_mid_way_stops_the_run_in_one_line_and_a_rerun_after_its_restart_sends_each_message_once(rocketmq_peer, tmp_path):
    t, group = f"MigSrcKill{stamp()}", f"mig-srckill-{stamp()}"
    queues, per_queue = 4, 3000
    with BrokerProcess(tmp_path / "data", "--flush", "sync") as src:
        fill(src.address, t, queues, per_queue)
        commit(src.address, group, t, {q: 0 for q in range(queues)})
        state = tmp_path / "state.json"
        args = ["--to", rocketmq_peer.namesrv, "-b", src.address, "--batch", "20", "--retry-for", "2s"]
        proc = start_migration(state, *args)
        try:
            wait_mid_way(proc, state, 1000)
            src.kill()  # SIGKILL of txmq while batches are out to the target and the next ones are being read
            code = proc.wait(timeout=120)  # an upper bound: the run gives txmq 2 s to come back
        finally:
            if proc.poll() is None:
                proc.kill()
        lines = proc.stderr.read().decode().strip().splitlines()
        assert code == 3, lines
        assert len(lines) == 1 and "unreachable" in lines[0] and src.address in lines[0] and str(state) in lines[0], lines
        confirmed, in_flight = progress(state)
        assert 1000 <= confirmed < queues * per_queue
        assert in_flight == 0  # the target answered every batch sent: none is left uncertain
        before = confirmed_runs(state)
        src.start()  # the same data directory and port
        r = run_cli("migrate", *args, "--state", str(state), "-o", "json")
    assert r.returncode == 0, r.stderr.decode()
    summary = json.loads(r.stdout)["summary"]
    assert summary["copied_per_topic"] == {t: queues * per_queue} and summary["duplicates_possible"] == 0
    assert summary["moved_this_run"] == queues * per_queue - confirmed
    assert_kept_their_place(before, state)
    assert sum(asyncio.run(_max_offsets(rocketmq_peer.namesrv, t, queues))) == queues * per_queue  # each stored once
    got = drained(rocketmq_peer, t, group, "pull", 0)["received"]
    assert sorted(m["msgId"] for m in got) == sorted(uniq(t, q, i) for q in range(queues) for i in range(per_queue))
    assert by_queue(got) == expected(t, {q: 0 for q in range(queues)}, per_queue)


class TargetBroker:
    """The broker of a RocketMQ 4.9.8 instance this test owns (a second one from the session's build, its own run dir):
    SIGKILLed, then started again with the same command line, store and port."""

    def __init__(self, peer, run_dir) -> None:
        self.peer, self.run_dir = peer, run_dir
        self.argv = open(f"/proc/{peer.broker_pid}/cmdline", "rb").read().rstrip(b"\0").split(b"\0")
        self.cwd = os.readlink(f"/proc/{peer.broker_pid}/cwd")
        self.proc: subprocess.Popen | None = None

    def kill(self) -> None:
        os.kill(self.peer.broker_pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and os.path.exists(f"/proc/{self.peer.broker_pid}/cmdline"):
            if self.proc is not None and self.proc.poll() is not None:
                break
            try:
                with open(f"/proc/{self.peer.broker_pid}/stat") as f:
                    if f.read().split(") ")[-1].startswith("Z"):
                        break
            except FileNotFoundError:
                break
            time.sleep(0.05)

    def start(self) -> None:
        out = self.run_dir / "broker.out"
        mark = out.stat().st_size
        with open(out, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.cwd,
                                         env={**os.environ, **self.peer.env})
        self.peer.broker_pid = self.proc.pid
        (self.run_dir / "broker.pid").write_text(str(self.proc.pid))
        deadline = time.monotonic() + 240
        while b"boot success" not in out.read_bytes()[mark:]:
            assert self.proc.poll() is None and time.monotonic() < deadline, out.read_bytes()[mark:][-2000:].decode(errors="replace")
            time.sleep(0.1)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def own_target(rocketmq_peer, tmp_path):
    """A RocketMQ 4.9.8 that this test may take down: not the session's, which other tests use."""
    from rocketmq_peer import RocketMQPeer

    run_dir = tmp_path / "target"
    peer = RocketMQPeer(rocketmq_peer.build_dir, run_dir=run_dir)
    peer.start()
    broker = TargetBroker(peer, run_dir)
    try:
        yield peer, broker
    finally:
        broker.close()
        peer.stop()


@pytest.mark.slow
def test_the_target_going_away_mid_way_stops_the_run_and_a_rerun_counts_exactly_what_may_be_twice_on_it(own_target, source, tmp_path):
    peer, target_broker = own_target
    t, group = f"MigTgtKill{stamp()}", f"mig-tgtkill-{stamp()}"
    queues, per_queue = 4, 3000
    fill(source.address, t, queues, per_queue)
    commit(source.address, group, t, {q: 0 for q in range(queues)})
    state = tmp_path / "state.json"
    args = ["--to", peer.namesrv, "-b", source.address, "--batch", "20"]
    proc = start_migration(state, *args, "--retry-for", "2s")
    try:
        wait_mid_way(proc, state, 1000)
        target_broker.kill()  # SIGKILL of the target's broker while batches are out to it
        code = proc.wait(timeout=120)  # an upper bound: the run gives the target 2 s to come back
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = proc.stderr.read().decode().strip().splitlines()
    assert code == 3, lines
    assert len(lines) == 1 and "target stayed unavailable for 2 s" in lines[0] and str(state) in lines[0], lines
    events = [json.loads(x) for x in (tmp_path / "state.json.events").read_text().splitlines()]
    assert any(e["event"] == "retrying" for e in events)
    confirmed, in_flight = progress(state)
    assert 1000 <= confirmed < queues * per_queue and 0 < in_flight <= queues * 20
    before = confirmed_runs(state)
    at_stop = {k: tuple(qs["inflight"]) for k, qs in json.loads(state.read_text())["queues"].items() if qs["inflight"]}
    target_broker.start()  # the same store and port: what it had confirmed is still there
    r = run_cli("migrate", *args, "--state", str(state), "-o", "json")
    assert r.returncode == 0, r.stderr.decode()
    summary = json.loads(r.stdout)["summary"]
    assert summary["copied_per_topic"] == {t: queues * per_queue}
    assert summary["duplicates_possible"] == in_flight  # exactly the batches out when the target went away
    assert_kept_their_place(before, state)
    extra = sum(asyncio.run(_max_offsets(peer.namesrv, t, queues))) - queues * per_queue
    assert 0 <= extra <= in_flight
    got = peer.driver(peer.namesrv, "drain", topic=t, group=group, mode="pull", expect=0, idle=0, timeout=90)["received"]
    ids = [m["msgId"] for m in got]
    assert set(ids) == {uniq(t, q, i) for q in range(queues) for i in range(per_queue)} and len(ids) == queues * per_queue + extra
    twice = {i for i in ids if ids.count(i) > 1} if extra else set()
    allowed = {uniq(t, int(k.rsplit("/", 1)[1]), i) for k, (s, e) in at_stop.items() for i in range(s, e)}
    assert twice <= allowed  # only what was in flight may be there twice
    for bodies in by_queue(got).values():  # and in queue order: a copy sent again follows the first
        assert sorted(set(bodies), key=lambda b: int(b.rsplit("/", 1)[1])) == list(dict.fromkeys(bodies))


async def _produce_on_txmq(address: str, s: str) -> dict:
    """The applications' producers on txmq (txmq.client): plain, ordered, FIFO-group, delayed and transactional messages.
    Returns where each landed: (topic, queue) -> [body, ...] in queue order, and what is still to come."""
    from txmq.client import Message, Producer, TransactionProducer

    names = {k: f"Rb{k}{s}" for k in ("Plain", "Ordered", "Fifo", "Delay", "Tx")}
    types = {"Plain": ["normal"], "Ordered": ["normal"], "Fifo": ["normal", "fifo"], "Delay": ["normal", "delay"], "Tx": ["normal", "transaction"]}
    queues = {"Plain": 2, "Ordered": 2, "Fifo": 2, "Delay": 1, "Tx": 1}
    placed: dict[tuple[str, int], list[tuple[int, str]]] = {}
    ids: dict[str, str] = {}  # body -> the message id the producer was given
    async with Client(address) as c:
        for k, t in names.items():
            await c.request("create_topic", {"topic": t, "queues": queues[k], "message_types": types[k]})

    def record(r, body: str) -> None:
        placed.setdefault((r.topic, r.queue_id), []).append((r.queue_offset, body))
        ids[body] = r.msg_id

    async with Producer(address) as p:
        for q in range(2):
            for i in range(8):
                body = f"{names['Plain']}/{q}/{i}"
                record(await p.send(names["Plain"], body, tags=f"Tag{i % 3}", keys=[f"k{i}"], queue_id=q), body)
        for step in range(4):
            for order in range(4):  # an order's messages in one queue, in order
                body = f"{names['Ordered']}/order{order}/step{step}"
                record(await p.send(names["Ordered"], body, keys=[f"order{order}"], queue_id=order % 2), body)
        for step in range(3):
            for g in range(4):
                body = f"{names['Fifo']}/g{g}/step{step}"
                record(await p.send(Message(names["Fifo"], body, message_group=f"g{g}")), body)
        for i in range(2):
            body = f"{names['Delay']}/now{i}"
            record(await p.send(names["Delay"], body), body)
        delayed = await p.send(names["Delay"], f"{names['Delay']}/delayed", delay=4)
        ids[f"{names['Delay']}/delayed"] = delayed.msg_id

    class Decide:
        def execute_local_transaction(self, message, arg):
            return arg

        def check_local_transaction(self, message):
            return "unknown"

    async with TransactionProducer(f"rb-tx-{s}", Decide(), address) as tp:
        committed = await tp.send_in_transaction(Message(names["Tx"], f"{names['Tx']}/committed"), arg="commit", wait_end=True)
        await tp.send_in_transaction(Message(names["Tx"], f"{names['Tx']}/rolled-back"), arg="rollback", wait_end=True)
        later = await tp.send_in_transaction(Message(names["Tx"], f"{names['Tx']}/committed-later"), arg="unknown", wait_end=True)
    placed[(names["Tx"], 0)] = [(0, f"{names['Tx']}/committed")]
    ids[f"{names['Tx']}/committed"], ids[f"{names['Tx']}/committed-later"] = committed.msg_id, later.msg_id
    assert committed.outcome == "committed"
    return {"names": names, "placed": placed, "ids": ids, "delayed_due_ms": delayed.deliver_at_ms, "pending_tx": later.tx_id}


async def _consume_to(address: str, group: str, topic: str, positions: dict[int, int]) -> None:
    """A consumer group on txmq that read its topic and stopped at these positions (its consumers then stop: runbook step 2)."""
    from txmq.client import Consumer

    async with Consumer(group, topic, address, from_="earliest", auto_commit=False, stop_when_caught_up=True) as c:
        async for _m in c:
            pass
        for q, p in positions.items():
            await c.commit((q, p))


async def _send_late_on_txmq(address: str, names: dict, ids: dict) -> list[tuple[str, int, str]]:
    """A producer not yet switched: what it sends to txmq during --follow."""
    from txmq.client import Message, Producer

    async with Producer(address) as p:
        a = await p.send(names["Plain"], f"{names['Plain']}/0/late", queue_id=0)
        b = await p.send(Message(names["Fifo"], f"{names['Fifo']}/g1/late", message_group="g1"))
    ids[f"{names['Plain']}/0/late"], ids[f"{names['Fifo']}/g1/late"] = a.msg_id, b.msg_id
    return [(a.topic, a.queue_id, f"{names['Plain']}/0/late"), (b.topic, b.queue_id, f"{names['Fifo']}/g1/late")]


@pytest.mark.slow
def test_the_whole_runbook_producers_switched_during_follow_and_each_group_receives_exactly_its_messages_on_the_target(
        rocketmq_peer, source, tmp_path):
    from collections import Counter

    from rocketmq_peer import DELAY_LEVELS

    s = stamp()
    made = asyncio.run(_produce_on_txmq(source.address, s))
    names, placed = made["names"], made["placed"]
    P, OR, F, D, T = (names[k] for k in ("Plain", "Ordered", "Fifo", "Delay", "Tx"))
    # a group per topic, as the Java consumers below each drain one topic (RocketMQ's broker may drop the offsets of a
    # group for topics its online consumers do not subscribe)
    gA, gA2, gB, gB2, gD, gD2 = (f"rb-{x}-{s}" for x in ("a", "a2", "b", "b2", "d", "d2"))
    fifo_len = {q: len(placed.get((F, q), [])) for q in range(2)}
    positions = {(gA, P): {0: 3, 1: 8}, (gA2, OR): {0: 2, 1: 5}, (gB, P): {0: 0, 1: 6},
                 (gB2, F): {0: min(1, fifo_len[0]), 1: min(2, fifo_len[1])}, (gD, D): {0: 2}, (gD2, T): {0: 1}}
    for (g, t), pos in positions.items():
        asyncio.run(_consume_to(source.address, g, t, pos))

    # 1. the plan: the pending transaction and the scheduled message are named, nothing stops a --follow run
    r = run_cli("migrate", "--to", rocketmq_peer.namesrv, "-b", source.address, "--follow", "--dry-run", "-o", "json")
    assert r.returncode == 0, r.stderr.decode()
    plan = json.loads(r.stdout)["plan"]
    assert [p["tx_id"] for p in plan["pending"] if p["topic"] == T] == [made["pending_tx"]] and not plan["problems"]
    # 3. run it with --follow
    state = tmp_path / "state.json"
    proc = start_migration(state, "--to", rocketmq_peer.namesrv, "-b", source.address, "--follow")
    try:
        deadline = time.monotonic() + 180
        while not json.loads(state.read_text() if state.exists() else '{"offsets_committed": false}').get("offsets_committed"):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()
            time.sleep(0.05)
        # 4. the producers switch: Apache's Java producers now send to the target ...
        java = f"rb-java-{s}"
        sent = rocketmq_peer.driver(rocketmq_peer.namesrv, "send", topic=P, group=java, n=3, timeout=120)
        assert [x["status"] for x in sent["sends"]] == ["SEND_OK"] * 3
        ordered = rocketmq_peer.driver(rocketmq_peer.namesrv, "orderly", topic=OR, group=java + "-o", orders=2, steps=2,
                                       expression="TagA || TagB", timeout=120)
        assert ordered["queuesPerOrder"] == [1, 1]
        tx = rocketmq_peer.driver(rocketmq_peer.namesrv, "tx", topic=T, group=java + "-t", cases="commit,rollback", timeout=120)
        assert tx["visible"].count("commit") == 1 and "rollback" not in tx["visible"]
        delays = rocketmq_peer.driver(rocketmq_peer.namesrv, "delays", topic=D, group=java + "-d", levels="1", delayTable=DELAY_LEVELS,
                                      timeout=180)
        assert delays["allAwaitedReceived"] and not delays["early"]
        # ... while one not yet switched still sends to txmq, the pending transaction is decided there, and the
        # scheduled message comes due there: all three are forwarded
        late = asyncio.run(_send_late_on_txmq(source.address, names, made["ids"]))
        r = run_cli("resolve", "--commit", made["pending_tx"], "-b", source.address, "-y")
        assert r.returncode == 0, r.stderr.decode()

        def txmq_ends() -> dict[str, int]:
            (offs,) = requests(source.address, ("queue_offsets", {"topics": list(names.values())}))
            return {f"{x['topic']}/{q['queue_id']}": q["max_offset"] for x in offs["topics"] for q in x["queues"]}

        deadline = time.monotonic() + 180
        while True:  # forwarded: every queue's copy reaches txmq's end, the scheduled message delivered included
            ends = txmq_ends()
            nexts = {k: qs["next"] for k, qs in json.loads(state.read_text())["queues"].items()}
            if ends[f"{D}/0"] == 3 and ends[f"{T}/0"] == 2 and all(nexts.get(k, v) >= v for k, v in ends.items()):
                break
            assert proc.poll() is None and time.monotonic() < deadline, (ends, nexts, proc.stderr.read().decode() if proc.poll() is not None else "")
            time.sleep(0.2)
        # 6. stop forwarding (Ctrl-C ends --follow): exit 0 and the summary
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    errs = proc.stderr.read().decode()
    assert code == 0, errs
    events = [json.loads(x) for x in (tmp_path / "state.json.events").read_text().splitlines()]
    summary = events[-1]
    assert summary["event"] == "summary" and summary["forwarded_this_run"] == 4 and summary["pending_left"] == 0
    assert summary["duplicates_possible"] == 0

    # what each group must receive on the target: its unconsumed messages on txmq, what was forwarded, what the
    # switched producers sent there; nothing it had consumed, nothing twice, nothing rolled back
    for topic, q, body in late:
        placed[(topic, q)].append((len(placed[(topic, q)]), body))
    placed[(D, 0)].append((2, f"{D}/delayed"))
    placed[(T, 0)].append((1, f"{T}/committed-later"))
    on_target = {P: [f"body-{i}" for i in range(3)], OR: [f"order{o}-step{k}" for o in range(2) for k in range(2)], F: [],
                 D: ["warmup", "level-1"], T: ["tx-commit"]}
    # 5. the consumers switch: each group starts at the offsets the migration committed
    for row in summary["offsets"]:
        assert asyncio.run(_offsets(rocketmq_peer.namesrv, row["group"], row["topic"], row["queue_id"] + 1))[-1] == row["target_offset"], row
    assert {(r["group"], r["topic"]) for r in summary["offsets"]} == set(positions)
    cases = [(gA, P, "push"), (gA2, OR, "pull"), (gB, P, "pull"), (gB2, F, "push"), (gD, D, "pull"), (gD2, T, "push")]
    for group, topic, mode in cases:
        pos = positions[(group, topic)]
        from_txmq = {q: [b for off, b in sorted(placed.get((topic, q), [])) if off >= pos[q]] for q in pos}
        want = Counter([b for bs in from_txmq.values() for b in bs] + on_target[topic])
        got = drained(rocketmq_peer, topic, group, mode, sum(want.values()))["received"]
        assert Counter(m["body"] for m in got) == want, (group, topic, mode)
        txmq_bodies = {b for bs in from_txmq.values() for b in bs}
        for m in got:
            if m["body"] == f"{D}/delayed":  # delivered by txmq when due, then forwarded: not earlier
                assert int(m["properties"]["TIMER_DEQUEUE_MS"]) >= int(made["delayed_due_ms"])
            if m["body"] in txmq_bodies:  # the id its producer was given on txmq
                assert m["msgId"] == made["ids"][m["body"]] and not any(k.startswith("TXMQ_") for k in m["properties"]), m
        for q, bodies in by_queue(got).items():  # in each queue, txmq's messages in txmq's order
            assert [b for b in bodies if b in txmq_bodies] == from_txmq.get(q, []), (group, topic, q)


@pytest.mark.slow
def test_the_target_back_within_the_retry_time_the_same_run_goes_on_and_counts_what_it_sent_again(own_target, source, tmp_path):
    peer, target_broker = own_target
    t, group = f"MigTgtBack{stamp()}", f"mig-tgtback-{stamp()}"
    queues, per_queue = 4, 3000
    fill(source.address, t, queues, per_queue)
    commit(source.address, group, t, {q: 0 for q in range(queues)})
    state = tmp_path / "state.json"
    events_file = tmp_path / "state.json.events"
    proc = start_migration(state, "--to", peer.namesrv, "-b", source.address, "--batch", "20", "--retry-for", "10m")
    try:
        wait_mid_way(proc, state, 1000)
        before = confirmed_runs(state)
        target_broker.kill()
        deadline = time.monotonic() + 120
        while b'"event":"retrying"' not in events_file.read_bytes():  # the run waits for the target
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode() if proc.poll() is not None else "no retrying"
            time.sleep(0.05)
        target_broker.start()
        code = proc.wait(timeout=600)  # an upper bound
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, proc.stderr.read().decode()
    events = [json.loads(x) for x in events_file.read_text().splitlines()]
    summary = events[-1]
    assert summary["event"] == "summary" and summary["copied_per_topic"] == {t: queues * per_queue}
    may_duplicate = max(e["may_duplicate"] for e in events if e["event"] == "retrying")
    assert summary["duplicates_possible"] == may_duplicate <= queues * 20  # the batches out when the target went away
    assert_kept_their_place(before, state)
    extra = sum(asyncio.run(_max_offsets(peer.namesrv, t, queues))) - queues * per_queue
    assert 0 <= extra <= may_duplicate
    got = peer.driver(peer.namesrv, "drain", topic=t, group=group, mode="pull", expect=0, idle=0, timeout=90)["received"]
    ids = [m["msgId"] for m in got]
    assert set(ids) == {uniq(t, q, i) for q in range(queues) for i in range(per_queue)} and len(ids) == queues * per_queue + extra


# ---- what consumers failed: retries and dead letters ------------------------------------------------------------

async def _send_back(namesrv: str, group: str, commit_log_offset: int, msg_id: str, topic: str, level: int) -> None:
    """What a RocketMQ 4 consumer sends when it fails a message (CONSUMER_SEND_MSG_BACK, as the Java client does)."""
    from txmq.client.rocketmq4 import RemotingConnection
    from txmq.remoting_codec import CONSUMER_SEND_MSG_BACK

    c = await RemotingConnection.open(namesrv)
    try:
        resp = await c.request(CONSUMER_SEND_MSG_BACK, {"offset": commit_log_offset, "group": group, "delayLevel": level,
                                                        "originMsgId": msg_id, "originTopic": topic, "unitMode": "false",
                                                        "maxReconsumeTimes": 16})
        assert resp.code == 0, resp.remark
    finally:
        await c.close()


def _queue_ends(address: str, topic: str) -> dict[int, int]:
    (offs,) = requests(address, ("queue_offsets", {"topics": [topic]}))
    return {q["queue_id"]: q["max_offset"] for t in offs["topics"] for q in t["queues"]}


def _wait_for(check, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout:g} s"
        time.sleep(0.1)


def test_pending_retries_reach_the_groups_java_consumer_once_and_dead_letters_are_copied_whole(rocketmq_peer, tmp_path):
    from rocketmq_peer import DELAY_LEVELS, TxmqRemoting

    s = stamp()
    t, group = f"MigRetry{s}", f"mig-retry-{s}"
    retry, dlq = f"%RETRY%{group}", f"%DLQ%{group}"
    levels = " ".join(["1s", "6s", *DELAY_LEVELS.split()[2:]])  # level 2: 6 s, so that a retry is still scheduled for a while
    with TxmqRemoting(tmp_path / "data", "--flush", "async", "--message-delay-level", levels) as src:
        requests(src.address, ("create_topic", {"topic": t, "queues": 2}))
        # Apache's push consumer fails "fail" twice (maxReconsumeTimes 1): once through the retry topic, then to the dead letters
        failed = rocketmq_peer.driver(src.namesrv, "retry", topic=t, group=group, maxReconsumeTimes=1, settle=500)
        assert failed["deliveries"] == {"fail": [0, 1], "ok": [0]} and failed["deadLettered"] == 1
        # three more messages the group consumed and failed: one's retry is due already, two are still scheduled
        sent = requests(src.address, *[("send", {"topic": t, "queue_id": 0, "body": f"r{i}".encode(),
                                                 "properties": {"UNIQ_KEY": f"RETRY-{s}-{i}", "KEYS": f"k{i}"}}) for i in (1, 2, 3)])
        commit(src.address, group, t, _queue_ends(src.address, t))
        commit(src.address, group, retry, _queue_ends(src.address, retry))  # the first retry above was consumed
        consumed = _queue_ends(src.address, retry)[0]
        asyncio.run(_send_back(src.namesrv, group, sent[0]["commit_log_offset"], f"RETRY-{s}-1", t, 1))  # due in 1 s
        _wait_for(lambda: _queue_ends(src.address, retry)[0] == consumed + 1, "the first retry's delivery into the retry topic")
        asyncio.run(_send_back(src.namesrv, group, sent[1]["commit_log_offset"], f"RETRY-{s}-2", t, 2))  # due in 6 s
        asyncio.run(_send_back(src.namesrv, group, sent[2]["commit_log_offset"], f"RETRY-{s}-3", t, 18))  # due in 1 h

        r = run_cli("migrate", "--to", rocketmq_peer.namesrv, "-b", src.address, "--dry-run", "-o", "json")
        assert r.returncode == 0, r.stderr.decode()
        plan = json.loads(r.stdout)["plan"]
        topics = {x["topic"]: x for x in plan["topics"]}
        assert topics[retry]["kind"] == "retry" and topics[retry]["queues"] == 1 and topics[retry]["action"] == "create"
        assert topics[dlq]["kind"] == "dlq" and topics[dlq]["backlog"] == 1
        queue = next(q for q in plan["queues"] if q["topic"] == retry)
        assert queue["positions"] == {group: consumed} and queue["start"] == consumed
        assert [(m["kind"], m["level"]) for m in plan["scheduled"] if m["msg_id"] == f"RETRY-{s}-3"] == [("retry", 18)]
        # the 6 s retry is in the schedule or, already due, in the retry topic: either way counted once
        assert plan["totals"]["retries"] + plan["totals"]["scheduled_retries"] == 3 and plan["totals"]["dead_letters"] == 1
        r = run_cli("migrate", "--to", rocketmq_peer.namesrv, "-b", src.address, "--dry-run", "--no-dead-letters", "-o", "json")
        assert r.returncode == 0, r.stderr.decode()
        plan = json.loads(r.stdout)["plan"]
        assert dlq not in {x["topic"] for x in plan["topics"]} and [n["messages"] for n in plan["not_moved"] if n["what"] == f"topic {dlq}"] == [1]

        # --follow: the retry due in 6 s is forwarded when txmq delivers it; Ctrl-C once both pending retries are on the target
        state = tmp_path / "state.json"
        proc = subprocess.Popen(cli_argv("migrate", "--to", rocketmq_peer.namesrv, "-b", src.address, "--state", str(state), "--follow",
                                         "-o", "jsonl"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env(), stdin=subprocess.DEVNULL)

        def copied_retries() -> int:
            try:
                st = json.loads(state.read_text())
            except (FileNotFoundError, ValueError):
                return 0
            return sum(e - b for b, e, _t in st["queues"][f"{retry}/0"]["runs"]) if st["offsets_committed"] else 0

        try:
            _wait_for(lambda: copied_retries() >= 2 or proc.poll() is not None, "forwarding the second retry")
        finally:
            proc.send_signal(signal.SIGINT)
            out, errs = proc.communicate(timeout=120)
        assert proc.returncode == 0, errs.decode()
        summary = [json.loads(x) for x in out.decode().splitlines()][-1]
        assert summary["event"] == "summary" and summary["copied_per_topic"][retry] == 2 and summary["copied_per_topic"][dlq] == 1
        assert {(o["topic"], o["source_offset"]) for o in summary["offsets"] if o["group"] == group and o["topic"] == retry} == {(retry, consumed)}

    # the group's Java push consumer on the target (it subscribes to its retry topic by itself): each pending retry once
    got = drained(rocketmq_peer, t, group, "push", 2)["received"]
    assert sorted(m["body"] for m in got) == ["r1", "r2"]
    for m in got:
        i = m["body"][1]
        assert m["topic"] == t and m["msgId"] == f"RETRY-{s}-{i}" and m["reconsumeTimes"] == 1 and m["keys"] == f"k{i}"
        assert m["properties"]["RETRY_TOPIC"] == t and m["properties"]["ORIGIN_MESSAGE_ID"] == f"RETRY-{s}-{i}"
        assert "RECONSUME_TIME" not in m["properties"] and not [k for k in m["properties"] if k.startswith("TXMQ_")]
    # the dead letters: on a dead-letter topic as RocketMQ creates one (1 queue, read and write), every message as it was
    route = rocketmq_peer.mqadmin(rocketmq_peer.namesrv, "topicRoute", "-t", dlq)
    assert '"perm":6' in route.replace(" ", "") and '"readQueueNums":1' in route.replace(" ", ""), route
    read = rocketmq_peer.driver(rocketmq_peer.namesrv, "send", topic=dlq, group=f"mig-dlq-reader-{s}", n=0)["read"]
    assert [(m["body"], m["reconsumeTimes"], m["properties"]["RETRY_TOPIC"]) for m in read] == [("fail", 2, t)]
