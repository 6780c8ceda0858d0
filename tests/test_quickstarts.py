"""The quick starts of docs/remoting.md (RocketMQ 4 clients) and docs/rocketmq.md (RocketMQ 5 SDKs), run as the docs show them.

Each program is the fenced block after a `<!-- quickstart: NAME -->` line, written to a file and run with the client's
own interpreter against a real broker; the only change is the port (the docs use 9876 and 8081). Skipped only where the
client cannot be installed (tests/sdkenv.py); a program that fails or prints something else fails the test.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from clihelpers import lines, ok, txmq
from sdkenv import (node_sdk_dir, python_sdk_python, remoting_node_dir, remoting_python, remoting_tx_python, start_remoting_broker,
                    start_rocketmq_broker)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

DOCS = Path(__file__).resolve().parent.parent / "docs"


def quickstart(doc: str, name: str) -> str:
    """The fenced block right after the `<!-- quickstart: name -->` line of docs/<doc>."""
    text = (DOCS / doc).read_text()
    m = re.search(rf"^<!-- quickstart: {re.escape(name)} -->\n```[a-z]*\n(.*?)^```$", text, re.M | re.S)
    assert m, f"docs/{doc} has no quick start {name!r}"
    return m.group(1)


def with_address(code: str, documented: str, actual: str) -> str:
    assert code.count(documented) == 1, f"the quick start names {documented} {code.count(documented)} times"
    return code.replace(documented, actual)


def run(argv: list[str], cwd: Path, timeout: float = 120) -> tuple[str, float]:
    """Run a quick start to its end; its stdout and how long it took. It must exit 0 on its own."""
    (cwd / "home").mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "NODE_"))}
    env.update(HOME=str(cwd / "home"), PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    try:
        r = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{argv[-1]} did not end in {timeout}s: stdout {e.stdout!r} stderr {(e.stderr or b'')[-2000:]!r}")
    took = time.monotonic() - t0
    stdout = r.stdout.decode(errors="replace")
    assert r.returncode == 0, f"{argv[-1]} exited {r.returncode}: {stdout}\n{r.stderr.decode(errors='replace')[-3000:]}"
    return stdout, took


def test_rocketmq4_python_quick_start_sends_consumes_and_delays_by_level(tmp_path):
    python = remoting_python()
    b, namesrv = start_remoting_broker(tmp_path / "b")
    try:
        (tmp_path / "quickstart_rocketmq4.py").write_text(
            with_address(quickstart("remoting.md", "remoting-python"), "127.0.0.1:9876", namesrv))
        stdout, _ = run([str(python), "quickstart_rocketmq4.py"], tmp_path)
        assert "created order 42" in stdout and "reminder pay for order 42" in stdout, stdout
        delay = float(re.search(r"([0-9.]+) s after it was sent", stdout).group(1))
        assert delay >= 0.9, stdout  # level 1 of the default --message-delay-level: 1 s
        stored = lines(ok(txmq("read", "orders", "-o", "jsonl", broker=b.address)))
        assert sorted(m["body"] for m in stored) == ["order 42", "pay for order 42"]
    finally:
        b.stop()


def test_rocketmq4_python_transaction_quick_start_delivers_the_committed_order_only(tmp_path):
    python = remoting_tx_python()
    b, namesrv = start_remoting_broker(tmp_path / "b")
    try:
        (tmp_path / "quickstart_rocketmq4_tx.py").write_text(
            with_address(quickstart("remoting.md", "remoting-python-transactions"), "127.0.0.1:9876", namesrv))
        stdout, _ = run([str(python), "quickstart_rocketmq4_tx.py"], tmp_path)
        assert re.search(r"^order-42 \S+ OK committed$", stdout, re.M) and re.search(r"^order-43 \S+ OK rolled back$", stdout, re.M), stdout
        # the clients end a transaction oneway: wait until both ends are in (an upper bound, not a margin)
        deadline = time.monotonic() + 60
        while lines(ok(txmq("inspect", "half", "-o", "jsonl", broker=b.address))) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert lines(ok(txmq("inspect", "half", "-o", "jsonl", broker=b.address))) == []
        stored = lines(ok(txmq("read", "orders", "-o", "jsonl", broker=b.address)))
        assert [(m["body"], m["tags"]) for m in stored] == [("order-42", "payment")]
    finally:
        b.stop()


def test_ali_ons_quick_start_sends_consumes_and_delays_by_level(tmp_path):
    sdk = remoting_node_dir()
    b, namesrv = start_remoting_broker(tmp_path / "b")
    try:
        run_txmq_block("rocketmq.md", "rocketmq5-topic", b)  # RocketMQ 5's clients need the topic to exist
        (tmp_path / "node_modules").symlink_to(sdk / "node_modules")
        (tmp_path / "quickstart_ali_ons.js").write_text(with_address(quickstart("remoting.md", "remoting-node"), "127.0.0.1:9876", namesrv))
        stdout, _ = run([shutil.which("node") or "node", "quickstart_ali_ons.js"], tmp_path)
        assert "SEND_OK" in stdout and "created order 42" in stdout and "reminder pay for order 42" in stdout, stdout
        assert float(re.search(r"([0-9.]+) s after it was sent", stdout).group(1)) >= 0.9, stdout
    finally:
        b.stop()


def run_txmq_block(doc: str, name: str, broker) -> None:
    """Each line of a quick start's shell block, a `txmq` command, against ``broker``."""
    for line in quickstart(doc, name).splitlines():
        argv = shlex.split(line)
        assert argv[0] == "txmq", line
        ok(txmq(*argv[1:], broker=broker.address))


def test_rocketmq5_python_quick_start_creates_typed_topics_then_delays_and_keeps_fifo_order(tmp_path):
    python = python_sdk_python()
    b, endpoint = start_rocketmq_broker(tmp_path / "b")
    try:
        run_txmq_block("rocketmq.md", "rocketmq5-typed-topics", b)
        (tmp_path / "delay_fifo.py").write_text(
            with_address(quickstart("rocketmq.md", "rocketmq5-python-delay-fifo"), "127.0.0.1:8081", endpoint))
        stdout, _ = run([str(python), "delay_fifo.py"], tmp_path)
        out = stdout.splitlines()
        assert out[:3] == ["order-42 order 42 created", "order-42 order 42 paid", "order-42 order 42 shipped"], stdout
        due, received = map(int, re.search(r"^pay for order 42 due (\d+) received (\d+)$", stdout, re.M).groups())
        assert received >= due, stdout
    finally:
        b.stop()


def test_rocketmq5_node_quick_start_runs_to_its_end(tmp_path):
    sdk = node_sdk_dir()
    b, endpoint = start_rocketmq_broker(tmp_path / "b")
    try:
        run_txmq_block("rocketmq.md", "rocketmq5-topic", b)  # RocketMQ 5's clients need the topic to exist
        (tmp_path / "node_modules").symlink_to(sdk / "node_modules")
        (tmp_path / "quickstart.js").write_text(with_address(quickstart("rocketmq.md", "rocketmq5-node"), "127.0.0.1:8081", endpoint))
        stdout, took = run([shutil.which("node") or "node", "quickstart.js"], tmp_path, timeout=180)
        out = stdout.splitlines()
        assert re.fullmatch(r"\S+ order 42 1", out[0]) and out[1] == "order 42", stdout  # the SimpleConsumer's, then the push consumer's
        assert lines(ok(txmq("read", "orders", "-o", "jsonl", broker=b.address)))[0]["body"] == "order 42"
        # each of the three clients said it stops (NotifyClientTermination) and the broker ended it
        log = b.log.read_text()
        assert log.count("event=rmq_client_terminated") == 3, log[-3000:]
        print(f"node quick start: {took:.1f} s")
    finally:
        b.stop()
