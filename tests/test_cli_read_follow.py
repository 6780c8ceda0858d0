"""`txmq read --follow`: keeps printing what is sent after it started, stops cleanly on Ctrl-C, commits nothing."""

import json
import signal
import subprocess

import pytest

from clihelpers import cli_argv, cli_env, lines, ok, one, start_broker, txmq


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    b = start_broker(tmp_path_factory.mktemp("cli-read-follow"))
    yield b.address
    b.stop()


def test_read_follow_prints_messages_sent_after_it_started_and_stops_on_ctrl_c(broker):
    ok(txmq("send", "t-follow", "before", broker=broker))
    groups_before = lines(ok(txmq("groups", "list", broker=broker)))
    p = subprocess.Popen(cli_argv("read", "t-follow", "--from", "earliest", "--follow", "-o", "jsonl"),
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env(broker))
    try:
        first = json.loads(p.stdout.readline())  # it runs: what was there before
        assert first["body"] == "before"
        sent = [one(txmq("send", "t-follow", f"after-{i}", "-o", "json", broker=broker)) for i in range(2)]
        got = [json.loads(p.stdout.readline()) for _ in sent]
        assert sorted(m["body"] for m in got) == ["after-0", "after-1"]
        assert {m["msg_id"] for m in got} == {s["msg_id"] for s in sent}
        assert p.poll() is None  # still following
        p.send_signal(signal.SIGINT)
        code = p.wait(15)
        stderr = p.stderr.read().decode()
    finally:
        if p.poll() is None:
            p.kill()
    assert code in (0, 130), stderr
    assert "Traceback" not in stderr, stderr
    assert lines(ok(txmq("groups", "list", broker=broker))) == groups_before  # no group, no committed offset


def test_read_follow_as_json_streams_one_list_that_is_complete_after_ctrl_c(broker):
    sent = [one(txmq("send", "t-follow-json", f"m-{i}", "-o", "json", broker=broker)) for i in range(3)]
    p = subprocess.Popen(cli_argv("read", "t-follow-json", "--from", "earliest", "--follow", "-o", "json"),
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env(broker))
    try:
        head = p.stdout.readline()
        assert head == b"[\n"  # printed as the messages come, not held until the end
        while head.count(b'"msg_id"') < len(sent):
            head += p.stdout.readline()
        p.send_signal(signal.SIGINT)
        code = p.wait(15)
        doc = json.loads(head + p.stdout.read())
        stderr = p.stderr.read().decode()
    finally:
        if p.poll() is None:
            p.kill()
    assert code in (0, 130), stderr
    assert sorted(m["msg_id"] for m in doc) == sorted(s["msg_id"] for s in sent)
