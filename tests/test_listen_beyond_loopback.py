"""`txmq broker start` on an address beyond loopback without --auth-token says once what that trusts.

Without a token every client that reaches the ports is trusted (RocketMQ's
model without ACLs): the start prints one structured warning line on
stderr, `event=insecure_listen`; with a token, or on loopback, none.
"""

from __future__ import annotations

import re
import time

import pytest

from brokerproc import BrokerProcess
from txmq.broker.main import is_loopback

LINE = re.compile(r"^ts=\S+ level=warning logger=txmq\.broker event=insecure_listen host=(\S+) port=(\d+) rocketmq_port=(\S+) msg=\"(.+)\"$")


@pytest.mark.parametrize("host, token, warned", [("0.0.0.0", None, True), ("0.0.0.0", "s3cret", False), ("127.0.0.1", None, False)])
def test_a_broker_beyond_loopback_without_a_token_prints_one_warning_line(tmp_path, host, token, warned):
    args = ["--host", host] + (["--auth-token", token] if token else [])
    with BrokerProcess(tmp_path / "data", *args) as b:
        deadline = time.monotonic() + 10
        while "event=listening" not in b.log.read_text():  # every start-up line is out
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert b.stop() == 0
    lines = [ln for ln in b.log.read_text().splitlines() if "insecure_listen" in ln]
    if not warned:
        assert lines == []
        return
    assert len(lines) == 1, lines
    m = LINE.match(lines[0])
    assert m, lines[0]
    assert m.group(1) == host and int(m.group(2)) == b.port and m.group(3) == "-"
    msg = m.group(4)
    for says in ("--auth-token", "register as a producer", "half messages", "message id"):
        assert says in msg, (says, msg)


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("10.1.2.3", False), ("broker.example", False),
])
def test_only_loopback_addresses_count_as_loopback(host, loopback):
    assert is_loopback(host) is loopback
