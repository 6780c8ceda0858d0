"""The CLI on bad arguments and bad stdin: a clear one-line error, the documented exit code, and nothing sent.

tests/test_cli_errors.py and tests/test_cli_messages.py check messages and
exit codes; this module adds what they leave out: that a refused command
never reached the broker at all, proved with the broker's own counters
(``connections_accepted`` does not move, nothing is appended, decided or
reconfigured), including input read from stdin where a bad line comes after
good ones, and input that cannot be encoded (non-UTF-8 stdin, integers too
large for the wire).
"""

from __future__ import annotations

import pytest

from conftest import arun
from faultload import PipeClient
from test_cli_support import ERROR, OK, USAGE, err, start_broker, txmq

WATCHED = ("connections_accepted", "records_appended", "bytes_appended", "messages_sent", "half_stored", "committed_operator",
           "rolled_back_operator", "replayed")


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    b = start_broker(tmp_path_factory.mktemp("badinput-cli"))
    yield b
    b.stop()


class Watch:
    """The broker's counters, config and pending transactions, read over one long-lived connection."""

    def __init__(self, address: str) -> None:
        self.address = address

    def snapshot(self) -> dict:
        async def go():
            c = await PipeClient.open(self.address)
            try:
                counters = (await c.ok("stats"))["counters"]
                return {
                    "counters": {k: counters.get(k, 0) for k in WATCHED},
                    "config": await c.ok("config_get"),
                    "pending": sorted(t["tx_id"] for t in (await c.ok("tx_pending"))["transactions"]),
                    "topics": (await c.ok("list_topics"))["topics"],
                }
            finally:
                await c.close()

        snap = arun(go())
        snap["counters"]["connections_accepted"] -= 1  # this snapshot's own connection
        return snap


def pending_tx(address: str) -> str:
    async def go():
        c = await PipeClient.open(address)
        h = await c.ok("send", {"topic": "bi-t", "body": b"pending", "properties": {"TRAN_MSG": "true", "PGROUP": "bi"}})
        await c.close()
        return h["tx_id"]

    return arun(go())


def refused_without_contact(broker, args, code=USAGE, needle=None, input=None):
    w = Watch(broker.address)
    before = w.snapshot()
    r = txmq(*args, broker=broker.address, input=input)
    after = w.snapshot()
    text = err(r)
    assert r.returncode == code, f"exit {r.returncode}: {text}"
    assert "Traceback" not in text and "never retrieved" not in text, text
    if needle is not None:
        assert needle in text, text
    after["counters"]["connections_accepted"] -= 1  # the `before` snapshot's connection
    assert after == before, "the broker saw something"
    return r


@pytest.mark.parametrize("args, needle", [
    (["nosuch"], "No such command"),
    (["send"], "Missing argument"),
    (["send", "bi-t", "x", "--frob"], "No such option"),
    (["send", "bi-t", "x", "--queue", "-1"], "Invalid value"),
    (["inspect", "half", "--limit", "-1"], "Invalid value"),
    (["resolve", "--commit", "--rollback", "1"], "exactly one"),
    (["send", "bi-t", "x", "--tx"], "--group"),
    (["send", "bi-t", "x", "--prop", "=v"], "KEY=VALUE"),
    (["config", "set", "check-interval", "-5s"], None),
    (["config", "set", "timeout", "soon"], "bad duration"),
    (["send", "bi-t", "x", "--broker", "127.0.0.1:99999"], "HOST:PORT"),
    (["topics", "--broker", "127.0.0.1:"], "HOST:PORT"),
])
def test_bad_arguments_never_reach_the_broker(broker, args, needle):
    refused_without_contact(broker, args, USAGE, needle)


def test_an_integer_too_large_for_the_wire_is_a_usage_error_and_changes_nothing(broker):
    refused_without_contact(broker, ["config", "set", "max-checks", "99999999999999999999"], USAGE, "out of range")


@pytest.mark.parametrize("stdin, needle", [
    ("{bad json\n", "not valid JSON"),
    ("two tokens\n", "one REF per line"),
    ('{"half_offset": 3}\n', "without a tx_id"),
    ("null\n", "expected a transaction id"),
    ('[1, 2]\n', "expected a transaction id"),
])
def test_a_bad_stdin_line_after_good_ones_resolves_nothing(broker, stdin, needle):
    tx = pending_tx(broker.address)
    r = refused_without_contact(broker, ["resolve", "--rollback", "-", "--yes"], USAGE, needle, input=f"{tx}\n\n7\n{stdin}")
    assert "line 4" in err(r)


def test_non_utf8_stdin_is_a_usage_error_and_resolves_nothing(broker):
    tx = pending_tx(broker.address)
    refused_without_contact(broker, ["resolve", "--commit", "-", "--yes"], USAGE, "UTF-8", input=tx.encode() + b"\n\xff\xfe\n")


def test_discard_replay_with_a_bad_stdin_line_replays_nothing(broker):
    refused_without_contact(broker, ["discard", "replay", "--to", "half", "-", "--yes"], USAGE, "without a tx_id", input='{"x": 1}\n')


def test_empty_stdin_sends_nothing(broker):
    refused_without_contact(broker, ["resolve", "--commit", "-", "--yes"], OK, input="")
    refused_without_contact(broker, ["resolve", "--commit", "-", "--yes"], OK, input="\n  \n")


def test_several_refs_without_a_terminal_to_confirm_are_refused_before_connecting(broker):
    tx = pending_tx(broker.address)
    refused_without_contact(broker, ["resolve", "--rollback", tx, "12"], USAGE, "--yes")
    refused_without_contact(broker, ["resolve", "--rollback", "-"], USAGE, "--yes", input=f"{tx}\n12\n")


def test_every_exit_code_in_use_is_documented():
    from txmq.cli import exitcodes

    documented = {v for k, v in vars(exitcodes).items() if k.isupper()}
    assert {OK, ERROR, USAGE} <= documented
