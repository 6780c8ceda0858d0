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
from clihelpers import ERROR, NOT_FOUND, OK, USAGE, err, lines, out, refused_start, start_broker, txmq

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


@pytest.mark.parametrize("args, needle", [
    (["resolve", "--commit", "9999999999999999999"], "out of range"),
    (["resolve", "--commit", "--commit-log-offset", "4611686018427387905"], "out of range"),
    (["discard", "replay", "9999999999999999999"], "out of range"),
    (["inspect", "tx", "9999999999999999999"], "out of range"),
    (["inspect", "half", "--older-than", "99999999999999999999d"], "out of range"),
    (["inspect", "op", "--from", "99999999999999999999"], "out of range"),
    (["inspect", "half", "--limit", "99999999999999999999"], "Invalid value"),
    (["discard", "list", "--limit", "99999999999999999999"], "Invalid value"),
    (["send", "bi-t", "x", "--queue", str(2 ** 70)], "Invalid value"),
    (["send", "bi-t", "x", "--queue", "1024"], "Invalid value"),
    (["send", "nl\n", "x"], "invalid topic name"),
    (["send", "bi-t", "x", "--key", "order 1"], "bad --key"),
    (["send", "bi-t", "x", "--key", ""], "bad --key"),
    (["read", "bi-t", "--from", "9" * 5000], "out of range"),
    (["consume", "bi-t", "--group", "g", "--queue", str(2 ** 70)], "Invalid value"),
    (["config", "set", "retention", "99999999999999999999d"], "out of range"),
])
def test_numbers_outside_the_wire_range_are_usage_errors_before_contact(broker, args, needle):
    refused_without_contact(broker, args, USAGE, needle)


@pytest.mark.parametrize("address", ["[::1", "[::1]", "::1:10911", "[nonsense]:10911", "127.0.0.1:١٠٩١١", "bad host:10911",
                                     "127.0.0.1:0", "127.0.0.1:+5"])
def test_a_malformed_broker_address_is_a_usage_error(broker, address):
    refused_without_contact(broker, ["topics", "-b", address], USAGE, "bad broker address")
    refused_without_contact(broker, ["send", "bi-t", "x", "-b", address], USAGE, "bad broker address")
    refused_without_contact(broker, ["bench", "send", "-m", "1", "-b", address], USAGE, "bad broker address")


@pytest.mark.parametrize("args, needle", [
    (["send", "\udcff", "x"], "TOPIC is not valid UTF-8"),
    (["send", "bi-t", "\udcffbody"], "BODY is not valid UTF-8"),
    (["send", "bi-t", "x", "--key", "k\udcfe"], "--key is not valid UTF-8"),
    (["send", "bi-t", "x", "--tag", "\udcff"], "--tag is not valid UTF-8"),
    (["send", "bi-t", "x", "--prop", "k=\udcff"], "--prop is not valid UTF-8"),
    (["send", "bi-t", "x", "--tx", "--group", "g\udcff"], "--group is not valid UTF-8"),
    (["inspect", "half", "--group", "\udcff"], "--group is not valid UTF-8"),
    (["consume", "bi-t", "--group", "\udcff"], "--group is not valid UTF-8"),
    (["topics", "--token", "\udcff"], "--token is not valid UTF-8"),
])
def test_arguments_that_are_not_utf8_are_usage_errors_before_contact(broker, args, needle):
    # "\udcff" is how Python hands over the byte 0xff of a command line that is not UTF-8
    refused_without_contact(broker, args, USAGE, needle)


@pytest.mark.parametrize("value", [" 5s", "5s ", "5 s", "\u0663s", "1h30", "1h 30m", "5", "", "1e3s", "inf", "5S", "+5s"])
def test_durations_are_strict_ascii_with_a_unit_on_every_part(broker, value):
    if value in ("5",):  # a bare number of seconds is fine
        r = txmq("inspect", "half", "--older-than", value, broker=broker.address)
        assert r.returncode == OK, err(r)
        return
    refused_without_contact(broker, ["inspect", "half", "--older-than", value], USAGE, "bad duration")
    refused_without_contact(broker, ["config", "set", "check-interval", value], USAGE, "bad duration")
    refused_without_contact(broker, ["stats", "--watch", "--count", "1", "--interval", value], USAGE, "bad duration")


@pytest.mark.parametrize("value, seconds", [("1h30m", 5400), ("1.5s", 1.5), ("500ms", 0.5), ("2d12h", 216000), ("30", 30)])
def test_well_formed_durations_are_read_as_documented(value, seconds):
    from txmq.cli.common import parse_duration

    assert parse_duration(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", [" 5s", "1h30", "\u0663s"])
def test_broker_start_refuses_a_bad_duration_before_touching_the_data_directory(tmp_path, value):
    assert "bad duration" in refused_start(tmp_path, "--port", "1", "--check-interval", value)


@pytest.mark.parametrize("args, needle", [
    (["--port", "70000"], "Invalid value"),
    (["--port", "0"], "Invalid value"),
    (["--metrics-port", "70000"], "Invalid value"),
    (["--log-level", "bogus"], "--log-level"),
    (["--max-frame", "0"], "Invalid value"),
    (["--max-checks", "99999999999999999999"], "max_checks"),
])
def test_broker_start_with_a_bad_option_is_a_usage_error_and_creates_nothing(tmp_path, args, needle):
    assert needle in refused_start(tmp_path, *args)


def test_a_data_dir_that_is_a_file_is_not_found(tmp_path):
    f = tmp_path / "file"
    f.write_text("not a directory")
    for cmd in (["inspect", "half"], ["inspect", "op"], ["inspect", "offsets"]):
        r = txmq(*cmd, "--data-dir", str(f), broker="127.0.0.1:1")
        assert r.returncode == NOT_FOUND and "not a txmq data directory" in err(r), f"exit {r.returncode}: {err(r)}"
    r = txmq("broker", "start", "--data-dir", str(f), "--port", "1", subprocess_=True)
    assert r.returncode == NOT_FOUND and "not a directory" in err(r), f"exit {r.returncode}: {err(r)}"
    assert f.read_text() == "not a directory"


@pytest.mark.parametrize("stdin, needle", [
    ("{bad json\n", "not valid JSON"),
    ("two tokens\n", "one REF per line"),
    ('{"half": 3}\n', "without a tx_id"),
    ('{"tx_id": 5}\n', "tx_id must be a string"),
    ('{"tx_id": ""}\n', "empty transaction id"),
    ('{"half_offset": "3"}\n', "must be an integer"),
    ('{"half_offset": -3}\n', "out of range"),
    ("-3\n", "out of range"),
    ("9999999999999999999\n", "out of range"),
    ("+99999999999999999999999\n", "out of range"),
    (f'"{"x" * 256}"\n', "at most 255"),
    ("null\n", "expected a transaction id"),
    ('[1, 2]\n', "expected a transaction id"),
])
def test_a_bad_stdin_line_after_good_ones_resolves_nothing(broker, stdin, needle):
    tx = pending_tx(broker.address)
    r = refused_without_contact(broker, ["resolve", "--rollback", "-", "--yes"], USAGE, needle, input=f"{tx}\n\n7\n{stdin}")
    assert "line 4" in err(r)


def test_a_huge_stdin_line_is_a_usage_error_and_resolves_nothing(broker):
    tx = pending_tx(broker.address)
    r = refused_without_contact(broker, ["resolve", "--commit", "-", "--yes"], USAGE, "longer than 64 KiB",
                                input=f"{tx}\n7\n".encode() + b"a" * (20 << 20) + b"\n")
    assert "line 3" in err(r)


def test_a_json_object_names_an_offset_only_under_an_offset_key(broker):
    tx = pending_tx(broker.address)
    (row,) = [r for r in _pending_rows(broker) if r["tx_id"] == tx]
    # a JSON string is a transaction id even when it is all digits: never an offset
    r = txmq("resolve", "--rollback", "-", "--yes", "--dry-run", "-o", "jsonl", broker=broker.address,
             input=f'"{row["half_offset"]}"\n')
    assert r.returncode == NOT_FOUND and lines(r)[0]["status"] == "not_found", out(r) + err(r)
    # an object without tx_id is its half_offset (or offset)
    for obj in ('{"half_offset": %d}', '{"offset": %d}'):
        r = txmq("resolve", "--rollback", "-", "--yes", "--dry-run", "-o", "jsonl", broker=broker.address,
                 input=obj % row["half_offset"] + "\n")
        assert r.returncode == OK and lines(r)[0]["tx_id"] == tx, out(r) + err(r)
    # tx_id wins over the offsets in a line of `inspect half -o jsonl`
    import json

    r = txmq("resolve", "--rollback", "-", "--yes", "-o", "jsonl", broker=broker.address,
             input=json.dumps({**row, "half_offset": 0}) + "\n")
    assert r.returncode == OK and lines(r)[0]["tx_id"] == tx and lines(r)[0]["status"] == "ok", out(r) + err(r)


def _pending_rows(broker) -> list[dict]:
    r = txmq("inspect", "half", "-o", "jsonl", broker=broker.address)
    assert r.returncode == OK, err(r)
    return lines(r)


def test_an_empty_ref_argument_is_a_usage_error(broker):
    refused_without_contact(broker, ["resolve", "--commit", ""], USAGE, "empty REF")


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
