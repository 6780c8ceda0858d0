"""docs/remoting.md's Java quick start, run as written: Apache's 4.9.8 client jars, javac, a producer and a consumer.

The two programs are tests/java/quickstart/*.java, shown verbatim in the page; the class path is the RocketMQ 4.9.8
peer's (tests/rocketmq_peer.py), as the page says.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from rocketmq_peer import TxmqRemoting

pytestmark = [pytest.mark.rocketmq_peer]

REPO = Path(__file__).resolve().parent.parent
PROGRAMS = sorted((REPO / "tests" / "java" / "quickstart").glob("*.java"))


def test_the_page_shows_the_programs_the_test_runs():
    page = (REPO / "docs" / "remoting.md").read_text()
    assert [p.name for p in PROGRAMS] == ["QuickStartConsumer.java", "QuickStartProducer.java"]
    for program in PROGRAMS:
        assert program.read_text() in page, f"docs/remoting.md does not show {program.name} as it is"


def test_the_java_quick_start_sends_and_receives_through_txmq(rocketmq_peer, tmp_path):
    classpath = f"{rocketmq_peer.build_dir}/dist/lib/*"
    out = tmp_path / "out"

    def run(*args: str, timeout: float = 180) -> str:
        r = subprocess.run(list(args), capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL)
        assert r.returncode == 0, (r.stdout + r.stderr).decode(errors="replace")[-3000:]
        return r.stdout.decode(errors="replace")

    run("javac", "-d", str(out), "-cp", classpath, *map(str, PROGRAMS))
    with TxmqRemoting(tmp_path / "data") as broker:
        # the page's commands, with the test's port and a home of its own for the client's log
        java = ["java", f"-Dnamesrv={broker.namesrv}", f"-Duser.home={tmp_path}", "-cp", f"{out}:{classpath}"]
        sent = run(*java, "QuickStartProducer")
        received = run(*java, "QuickStartConsumer")
    assert [line.split()[0] for line in sent.splitlines() if line.startswith("SEND_")] == ["SEND_OK"] * 3
    assert sorted(line for line in received.splitlines() if line.startswith("Received ")) == [
        "Received Hello txmq 0", "Received Hello txmq 1", "Received Hello txmq 2"]
