"""Failure classes and their exit codes, brokers that go away, and reading a data directory offline."""

import json
import subprocess
import time

import pytest

from brokerproc import BrokerProcess, free_port
from clihelpers import (
    NOT_FOUND, OK, REFUSED, UNREACHABLE, USAGE, cli_argv, cli_env, err, lines, ok, one, start_broker, txmq,
)


def _one_line_error(r, code, *needles):
    assert r.returncode == code, f"exit {r.returncode}: {err(r)}"
    text = err(r)
    assert text.startswith("error: ") and text.count("\n") == 1 and "Traceback" not in text, text
    for n in needles:
        assert n in text, text


@pytest.mark.parametrize("args", [
    ["topics"], ["inspect", "half"], ["send", "t", "x"], ["resolve", "--commit", "1"], ["config", "get"],
    ["consume", "t", "--group", "g"], ["checker", "--group", "g", "--answer", "commit", "--limit", "1"],
    ["discard", "list"], ["stats"],
])
def test_broker_down_is_unreachable(args):
    r = txmq(*args, broker=f"127.0.0.1:{free_port()}")
    _one_line_error(r, UNREACHABLE, "unreachable")


def test_debug_shows_the_traceback():
    r = txmq("--debug", "topics", broker=f"127.0.0.1:{free_port()}", subprocess_=True)
    assert r.returncode != OK and "Traceback" in err(r)


@pytest.mark.parametrize("args, needle", [
    (["inspect", "half", "--older-than", "10x"], "bad duration '10x'"),
    (["checker", "--group", "g", "--answer", "commit", "--idle-exit", "later"], "bad duration"),
    (["stats", "--watch", "--interval", "fast"], "bad duration"),
    (["resolve", "--commit"], "no REF"),
    (["checker", "--group", "g"], "--answer or --exec"),
    (["discard", "replay"], "--all"),
    (["topics", "--broker", "nowhere"], "HOST:PORT"),
])
def test_bad_input_fails_before_any_connection(args, needle):
    _one_line_error(txmq(*args, broker=f"127.0.0.1:{free_port()}"), USAGE, needle)


@pytest.mark.parametrize("args, said", [
    (["send", "t", "x", "--tx", "--group", "g", "--state", "comit"],
     "Invalid value 'comit' for '--state' (one of commit, rollback, unknown). Did you mean 'commit'?"),
    (["send", "t", "x", "--tx", "--group", "g", "--state=rolback"], "Did you mean 'rollback'?"),
    (["checker", "--group", "g", "--answer", "comit"],
     "Invalid value 'comit' for '--answer' / '-a' (one of commit, rollback, unknown). Did you mean 'commit'?"),
    (["checker", "--group", "g", "-a", "yes"], "Invalid value 'yes' for '--answer' / '-a' (one of commit, rollback, unknown) (see"),
    (["resolve", "--comit", "1"], "No such option: --comit. Did you mean '--commit'?"),
    (["-o", "tabel", "stats"], "Invalid value 'tabel' for '--output' / '-o' (one of table, json, jsonl). Did you mean 'table'?"),
    (["discard", "replay", "1", "--to", "hlf"], "Did you mean 'half'?"),
    (["completion", "fsh"], "Invalid value 'fsh' for 'SHELL' (one of bash, zsh, fish). Did you mean 'fish'"),
    (["bench", "snd"], "Invalid value 'snd' for 'MODE' (one of tx, tx-client, send, consume). Did you mean 'send'?"),
    (["config", "set", "check-intervl", "1s"], "Did you mean 'check-interval'?"),
    (["stast"], "No such command 'stast'. Did you mean 'stats'?"),  # the words the others follow
])
def test_a_mistyped_choice_or_option_gets_the_did_you_mean_of_a_mistyped_command(args, said):
    r = txmq(*args, broker=f"127.0.0.1:{free_port()}")
    _one_line_error(r, USAGE, said)
    assert "Value error" not in err(r) and "Possible options" not in err(r)


def test_token(tmp_path):
    b = start_broker(tmp_path, "--auth-token", "s3cret")
    try:
        _one_line_error(txmq("topics", broker=b.address), REFUSED, "requires an auth token")
        _one_line_error(txmq("topics", "--token", "wrong", broker=b.address), REFUSED, "refused the auth token")
        _one_line_error(txmq("checker", "--group", "g", "--answer", "commit", broker=b.address, env={"TXMQ_AUTH_TOKEN": "nope"}),
                        REFUSED)
        ok(txmq("send", "t-auth", "x", broker=b.address, env={"TXMQ_AUTH_TOKEN": "s3cret"}))
        assert [t["topic"] for t in lines(ok(txmq("topics", "--token", "s3cret", broker=b.address)))] == ["t-auth"]
    finally:
        b.stop()


def test_inspect_reads_the_data_directory_when_the_broker_is_down(tmp_path):
    b = start_broker(tmp_path)
    try:
        pending = one(txmq("send", "t-off", "p", "--tx", "--group", "off", "-o", "json", broker=b.address))
        done = one(txmq("send", "t-off", "c", "--tx", "--group", "off", "--state", "commit", "-o", "json", broker=b.address))
        online = lines(ok(txmq("inspect", "half", "--group", "off", broker=b.address)))
        live_offline = lines(ok(txmq("inspect", "half", "--data-dir", str(b.data_dir))))  # beside a running broker
    finally:
        b.stop()
    _one_line_error(txmq("inspect", "half", broker=b.address), UNREACHABLE)
    rows = lines(ok(txmq("inspect", "half", "--data-dir", str(b.data_dir))))
    assert [r["tx_id"] for r in rows] == [r["tx_id"] for r in live_offline] == [r["tx_id"] for r in online] == [pending["tx_id"]]
    off, on = rows[0], online[0]
    for key in ("half_offset", "commit_log_offset", "topic", "queue_id", "group", "born_at", "checks"):
        assert off[key] == on[key], key
    assert off["next_check_at"] is None and off["last_check_at"] is None
    assert lines(ok(txmq("inspect", "half", "-d", str(b.data_dir), "--group", "other"))) == []
    offsets = one(txmq("inspect", "offsets", "--data-dir", str(b.data_dir), "-o", "json"))
    assert offsets["pending"] == 1 and offsets["half"]["max"] == 2 and offsets["op"]["max"] == 1
    (op,) = lines(ok(txmq("inspect", "op", "--data-dir", str(b.data_dir))))
    assert op["tx_id"] == done["tx_id"] and op["action"] == "commit" and op["half_offset"] == done["half_offset"]
    _one_line_error(txmq("inspect", "half", "--data-dir", str(tmp_path / "nothing-here")), NOT_FOUND, "not a txmq data directory")


def test_send_output_is_an_exact_record_when_the_broker_dies(tmp_path):
    """Lines printed are acknowledged messages; after the broker dies the command says so and exits 3."""
    b = start_broker(tmp_path)
    p = subprocess.Popen(cli_argv("send", "t-die"), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=cli_env(b.address))
    printed = []
    try:
        for i in range(20):
            p.stdin.write(f"m{i}\n".encode())
            p.stdin.flush()
        while len(printed) < 20:
            printed.append(p.stdout.readline())
        b.kill()
        try:
            for i in range(20, 40):
                p.stdin.write(f"m{i}\n".encode())
                p.stdin.flush()
                time.sleep(0.01)
        except BrokenPipeError:
            pass
        try:
            p.stdin.close()
        except BrokenPipeError:  # the command exited with lines still buffered: close() fails but closes
            pass
        p.stdin = None  # communicate() must not flush the closed pipe again (ValueError)
        rest, stderr = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == UNREACHABLE, stderr
    assert b"acknowledged" in stderr and b"Traceback" not in stderr
    acked = [ln for ln in [*printed, *rest.splitlines(keepends=True)] if ln.strip()]
    acked_lines = {json.loads(ln)["line"] for ln in acked}
    assert set(range(1, 21)) <= acked_lines
    again = BrokerProcess(b.data_dir, "--check-interval", "1s", port=free_port()).start()
    try:
        stored = {m["body"] for m in lines(ok(txmq("consume", "t-die", "--group", "check", broker=again.address)))}
    finally:
        again.stop()
    assert {f"m{n - 1}" for n in acked_lines} <= stored


def test_checker_now_does_not_wait_for_the_check_interval(tmp_path):
    b = start_broker(tmp_path, "--check-interval", "1h")
    try:
        sent = one(txmq("send", "t-now", "x", "--tx", "--group", "now", "-o", "json", broker=b.address))
        t0 = time.monotonic()
        r = ok(txmq("checker", "--group", "now", "--answer", "commit", "--now", "--limit", "1", "--idle-exit", "20s",
                    broker=b.address))
        assert time.monotonic() - t0 < 15
        assert [(x["tx_id"], x["outcome"]) for x in lines(r)] == [(sent["tx_id"], "committed")]
        assert "asked for check-backs of 1" in err(r)
    finally:
        b.stop()



def test_a_number_out_of_range_or_not_a_number_is_said_in_plain_words():
    import subprocess
    import sys

    for args, words in ((["bench", "tx", "-c", "abc"], "'--connections' / '-c': not a whole number"),
                        (["topics", "create", "t", "--queues", "0"], "'--queues': must be at least 1")):
        r = subprocess.run([sys.executable, "-m", "txmq", *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and words in r.stderr and "Input should" not in r.stderr, r.stderr
