"""Transaction example programs as users copy them from RocketMQ articles, run against RocketMQ 4.9.8 and against txmq.

tests/java/seeds/ holds each article's TransactionMQProducer program with only imports, a class around a bare
``main`` and the name server address (``-Dnamesrv``) added. Each is compiled with javac against the peer's jars and
run unchanged against the real RocketMQ 4.9.8 of the session (tests/rocketmq_peer.py) and against a txmq broker
with the same check-back timing; what the application sees is compared: what a push consumer of the topic receives,
and which check-backs the producer answered how (its own prints, and the client's log, which records every check
answered UNKNOW or ROLLBACK with the message's id).

The programs name fixed topics and producer groups, and two share a group: the tests run in file order, the one whose
check-backs are counted across all of its group's messages first.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from rocketmq_peer import DELAY_LEVELS, TxmqRemoting, result_of

pytestmark = [pytest.mark.rocketmq_peer, pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parent / "java" / "seeds"
SENT_ID = re.compile(r"SendResult \[sendStatus=SEND_OK, msgId=([0-9A-F]+)")
CHECK_ANSWER = re.compile(r"when broker check, client (rollback this transaction|does not know this transaction state), "
                          r"EndTransactionRequestHeader\{.*?msgId='([0-9A-F]+)'")


@pytest.fixture(scope="module")
def compiled(rocketmq_peer):
    """The example programs, compiled into the class path of the peer's ``run.sh java``."""
    sources = sorted(str(p) for p in EXAMPLES.rglob("*.java"))
    r = subprocess.run(["javac", "-encoding", "UTF-8", "-nowarn", "-cp", f"{rocketmq_peer.build_dir}/dist/lib/*",
                        "-d", str(rocketmq_peer.build_dir / "bench"), *sources], capture_output=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr).decode(errors="replace")[-3000:]
    return rocketmq_peer


@pytest.fixture(scope="module")
def broker(tmp_path_factory, compiled):
    # check-backs as on the peer (tests/rocketmq_peer.py: halves older than 1 s, checked every 2 s)
    with TxmqRemoting(tmp_path_factory.mktemp("examples") / "data", "--check-interval", "1s", "--transaction-timeout", "1s",
                      "--message-delay-level", DELAY_LEVELS) as b:
        yield b


class Run:
    """One example program against one name server, and a push consumer of its topic started once the topic exists."""

    def __init__(self, peer, namesrv: str, main_class: str, topic: str, group: str, expect: int, workdir: Path) -> None:
        self.peer, self.namesrv, self.topic, self.group, self.expect = peer, namesrv, topic, group, expect
        workdir.mkdir(parents=True, exist_ok=True)
        self.out, self.err, self.log_root = workdir / "stdout", workdir / "stderr", workdir / "client-log"
        cmd = [str(peer.peer_dir / "run.sh"), "java", f"-Dnamesrv={namesrv}", f"-Drocketmq.client.logRoot={self.log_root}", main_class]
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                         env={**peer.env, "NAMESRV": namesrv})
        self.consumer: subprocess.Popen | None = None
        self.consumer_out = workdir / "consumer"

    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def sent(self) -> list[str]:
        """The message ids of the SendResults the program printed, in order."""
        return SENT_ID.findall(self.stdout())

    def check_answers(self) -> tuple[Counter, Counter]:
        """Check-backs answered UNKNOW (or by an exception) and ROLLBACK, by message id (the client's log)."""
        unknown: Counter = Counter()
        rollback: Counter = Counter()
        for f in self.log_root.glob("*.log"):
            for kind, msg_id in CHECK_ANSWER.findall(f.read_text(errors="replace")):
                (rollback if kind.startswith("rollback") else unknown)[msg_id] += 1
        return unknown, rollback

    def start_consumer(self) -> None:
        cmd = self.peer.java_command(self.namesrv, "hold", topic=self.topic, group=self.group, expect=self.expect, timeout=150)
        with open(self.consumer_out, "wb") as out:
            self.consumer = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.DEVNULL,
                                             env={**self.peer.env, "NAMESRV": self.namesrv})

    def received(self) -> int:
        return sum(line.startswith("GOT ") for line in self.consumer_out.read_text(errors="replace").splitlines())

    def wait(self, done, timeout: float = 150) -> None:
        deadline = time.monotonic() + timeout
        while not done(self):
            if time.monotonic() > deadline:
                raise AssertionError(f"not done in {timeout} s:\n{self.stdout()[-2000:]}\n{self.stderr()[-2000:]}")
            time.sleep(0.2)

    def finish(self, settle: float = 3) -> list[str]:
        """Ends the program (an example that sleeps on) and the consumer, once nothing more arrives: the bodies received."""
        time.sleep(settle)  # a delivery or check-back after the outcome would show in what follows
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        assert self.consumer is not None
        self.consumer.stdin.close()
        self.consumer.wait(60)
        return result_of(self.consumer_out.read_text(errors="replace"))["bodies"]

    def kill(self) -> None:
        """Whatever still runs, ended: an example left behind (it sleeps on) would stay a producer of its group, and a
        broker sends the next run's check-backs to either producer of a group."""
        for proc in (self.proc, self.consumer):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(30)


def both(compiled, broker, tmp_path, main_class: str, topic: str, expect: int, run_until) -> tuple[dict, dict]:
    outcomes = []
    for name, namesrv in (("rocketmq", compiled.namesrv), ("txmq", broker.namesrv)):
        run = Run(compiled, namesrv, main_class, topic, f"examples-{topic}-{name}", expect, tmp_path / name)
        try:
            outcomes.append(run_until(run))
        finally:
            run.kill()
    return outcomes[0], outcomes[1]


# ---- the API before 4.3: TransactionCheckListener + LocalTransactionExecuter ---------------------------
def test_the_check_listener_example_commits_at_its_fifth_check_back_as_on_rocketmq(compiled, broker, tmp_path):
    """One message, its local transaction UNKNOW; the check listener throws, answers UNKNOW three times, then COMMIT:
    the consumer receives the message once, after exactly five check-backs."""

    def run_until(run: Run) -> dict:
        run.wait(lambda r: len(r.sent()) == 1)
        run.start_consumer()
        run.wait(lambda r: r.received() >= 1)
        bodies = run.finish()
        unknown, rollback = run.check_answers()
        return {"sent": len(run.sent()), "checks": run.stdout().count("server checking TrMsg"),
                "unknownAnswers": sum(unknown.values()), "rollbackAnswers": sum(rollback.values()), "received": bodies}

    theirs, ours = both(compiled, broker, tmp_path, "com.zoo.quickstart.transaction.TransactionProducer", "TopicTest", 1, run_until)
    # the exception of the first check and three UNKNOW are answered "unknown" (4); the fifth commits
    assert ours == {"sent": 1, "checks": 5, "unknownAnswers": 4, "rollbackAnswers": 0, "received": ["Hello RocketMQ 0"]}
    # RocketMQ may check once more when a check races the commit's processing (its sixth answer is ROLLBACK, too late)
    assert theirs["checks"] >= 5 and theirs["unknownAnswers"] == 4 and set(theirs["received"]) == {"Hello RocketMQ 0"}


# ---- TransactionListener -------------------------------------------------------------------------------
def test_the_listener_example_set_after_start_commits_its_message_as_on_rocketmq(compiled, broker, tmp_path):
    """The listener set after start(), COMMIT at once, then shutdown(): the message is delivered, nothing is checked."""

    def run_until(run: Run) -> dict:
        assert run.proc.wait(120) == 0, run.stderr()[-3000:]  # it ends by itself
        run.start_consumer()
        run.wait(lambda r: r.received() >= 1)
        bodies = run.finish()
        err = run.stderr()
        return {"executed": err.count(" executeLocalTransaction"), "checked": err.count(" checkLocalTransaction"), "received": bodies}

    theirs, ours = both(compiled, broker, tmp_path, "TransactionCommitExample", "TopicTest3", 1, run_until)
    assert ours == theirs == {"executed": 1, "checked": 0, "received": ["测试事务消息"]}


def test_apaches_transaction_example_commits_rolls_back_and_keeps_checking_as_on_rocketmq(compiled, broker, tmp_path):
    """Apache's TransactionProducer with its TransactionListenerImpl: ten messages, all UNKNOW at first; on check-back
    KEY1, KEY4, KEY7 commit, KEY2, KEY5, KEY8 roll back, KEY0, KEY3, KEY6, KEY9 stay UNKNOW and are checked again."""
    unknown_keys, rollback_keys = {0, 3, 6, 9}, {2, 5, 8}

    def keyed(run: Run, counts: Counter) -> dict[int, int]:
        index = {msg_id: i for i, msg_id in enumerate(run.sent())}
        return {index[m]: n for m, n in counts.items() if m in index}

    def settled(run: Run) -> bool:
        unknown, rollback = (keyed(run, c) for c in run.check_answers())
        return (run.received() >= 3 and set(rollback) >= rollback_keys
                and all(unknown.get(k, 0) >= 2 for k in unknown_keys))

    def run_until(run: Run) -> dict:
        run.wait(lambda r: len(r.sent()) == 10)
        run.start_consumer()
        run.wait(settled)
        bodies = run.finish()
        unknown, rollback = (keyed(run, c) for c in run.check_answers())
        return {"sent": len(run.sent()), "received": bodies, "rolledBackOnCheck": sorted(rollback),
                "rollbackAnswersEach": set(rollback.values()), "unknownOnCheck": sorted(unknown),
                "checkedAgain": sorted(k for k, n in unknown.items() if n >= 2)}

    theirs, ours = both(compiled, broker, tmp_path, "TransactionProducer", "TopicTest1234", 3, run_until)
    want = {"sent": 10, "received": ["Hello RocketMQ 1", "Hello RocketMQ 4", "Hello RocketMQ 7"],
            "rolledBackOnCheck": [2, 5, 8], "rollbackAnswersEach": {1}, "unknownOnCheck": [0, 3, 6, 9],
            "checkedAgain": [0, 3, 6, 9]}
    assert ours == want
    assert {**theirs, "received": sorted(set(theirs["received"]))} == want
