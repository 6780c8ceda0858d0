"""The [y/N] prompts of `resolve`, `discard replay --all`, `groups reset`, `config set` and `store repair`: Ctrl-C there
exits 130, as every Ctrl-C does (docs/cli.md, "Exit codes"); no, an empty answer or the end of the input is exit 1."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import termios
import time

import pytest

from clihelpers import cli_argv, cli_env


class Tty:
    """A command on a pseudo-terminal that is its controlling terminal: what is typed goes through the line
    discipline, so Ctrl-C (\\x03) is SIGINT to its process group and ^D ends the input, as at a shell."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))

        def own_terminal() -> None:
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        env = {**env, "TERM": "xterm", "COLUMNS": "120"}
        self.proc = subprocess.Popen(cli_argv(*args), stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True,
                                     preexec_fn=own_terminal)
        os.close(slave)
        self.text = ""

    def read_until(self, pattern: str, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.text):
            assert time.monotonic() < deadline, f"no {pattern!r} within {timeout} s: {self.text!r}"
            ready, _, _ = select.select([self.master], [], [], 0.1)
            if ready:
                try:
                    data = os.read(self.master, 65536)
                except OSError:
                    break
                self.text += re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", data.decode("utf-8", "replace"))
        return self.text

    def type(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def wait(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            assert time.monotonic() < deadline, f"still running after {timeout} s: {self.text!r}"
            ready, _, _ = select.select([self.master], [], [], 0.1)
            if ready:
                try:
                    self.text += re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", os.read(self.master, 65536).decode("utf-8", "replace"))
                except OSError:
                    pass
        return self.proc.returncode

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        os.close(self.master)


@pytest.fixture
def tty():
    started: list[Tty] = []

    def start(*args: str) -> Tty:
        t = Tty(list(args), cli_env("127.0.0.1:9"))  # no broker: nothing is asked of one before the answer
        started.append(t)
        return t

    yield start
    for t in started:
        t.close()


def test_ctrl_c_at_a_confirmation_prompt_exits_130_and_changes_nothing(tty):
    t = tty("resolve", "--commit", "1", "2")
    t.read_until(r"Commit 2 transactions\? \[y/N\]: ")
    t.type(b"\x03")
    assert t.wait() == 130, t.text
    assert "aborted" not in t.text and "error" not in t.text, t.text


@pytest.mark.parametrize("keys", [b"n\n", b"\n", b"\x04"], ids=["no", "empty", "end-of-input"])
def test_no_at_a_confirmation_prompt_exits_1_with_nothing_changed(tty, keys):
    t = tty("discard", "replay", "1", "2")
    t.read_until(r"Replay 2 transactions\? \[y/N\]: ")
    t.type(keys)
    assert t.wait() == 1, t.text
    assert "error: not confirmed: nothing was changed" in t.text, t.text


def test_an_answer_other_than_yes_or_no_is_asked_again(tty):
    t = tty("resolve", "--rollback", "1", "2")
    t.read_until(r"\[y/N\]: ")
    t.type(b"maybe\n")
    t.read_until(r"answer y or n\s+Roll back 2 transactions\? \[y/N\]: ")
    t.type(b"\x03")
    assert t.wait() == 130, t.text
