"""What a person sees at a terminal (run through a pseudo-terminal)."""

import os
import pty
import re
import select
import subprocess
import time

import pytest

from test_cli_support import cli_argv, cli_env, lines, ok, start_broker, txmq


def run_in_pty(args, env, columns=120, timeout=20.0) -> str:
    """Run txmq with stdout and stderr on a pseudo-terminal of `columns` columns; the screen text, colours stripped."""
    master, slave = pty.openpty()
    import fcntl
    import struct
    import termios

    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {**env, "COLUMNS": str(columns), "TERM": "xterm"}
    env.pop("NO_COLOR", None)
    p = subprocess.Popen(cli_argv(*args), stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r, _, _ = select.select([master], [], [], 0.2)
        if r:
            try:
                data = os.read(master, 65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        elif p.poll() is not None:
            break
    p.wait(5)
    os.close(master)
    text = b"".join(chunks).decode("utf-8", "replace")
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text).replace("\r", "")


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    b = start_broker(tmp_path_factory.mktemp("tty"), "--check-interval", "60s", "--transaction-timeout", "60s")
    yield b
    b.stop()


def test_transaction_ids_are_never_wrapped_at_120_columns(broker):
    long_group = "group-with-a-rather-long-name-" + "x" * 40
    sent = [lines(ok(txmq("send", "topic-with-a-long-name-" + "y" * 30, "b", "--tx", "--group", long_group, broker=broker.address)))[0]
            for _ in range(2)]
    screen = run_in_pty(["inspect", "half", "--group", long_group], cli_env(broker.address))
    for s in sent:
        assert s["tx_id"] in screen, screen
        assert str(s["half_offset"]) in screen
