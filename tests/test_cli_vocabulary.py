"""One vocabulary across the CLI: one name for each meaning of a flag (`--limit` for "at most N"), `--all` where a
bulk form makes sense, a group of commands without a command doing its listing, times as times in human output."""

from __future__ import annotations

import json
import os
import re
import time

import pytest

from clihelpers import OK, USAGE, err, lines, ok, one, out, start_broker, txmq


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    b = start_broker(tmp_path_factory.mktemp("cli-vocabulary"), "--transaction-timeout", "60s")
    yield b.address
    b.stop()


def run(broker, *args, **kw):
    return txmq(*args, broker=broker, **kw)


# ---- one name for one meaning -------------------------------------------------------------------

def _visible_options():
    """(command path, long names, short names) of every visible option of every command."""
    from typer.main import get_command

    from txmq.cli.main import app

    def walk(cmd, path):
        for p in cmd.params:
            if p.param_type_name == "option" and not p.hidden:
                names = [*p.opts, *p.secondary_opts]
                yield " ".join(path), [n for n in names if n.startswith("--")], [n for n in names if not n.startswith("--")]
        for name, sub in (getattr(cmd, "commands", None) or {}).items():
            yield from walk(sub, [*path, name])

    return list(walk(get_command(app), ["txmq"]))


# A benchmark's and spark-submit's own vocabulary: wrk's -c connections, -d duration; spark-submit's -c/--conf.
OWN_VOCABULARY = {"txmq bench": {"-c", "-n", "-m", "-d"}, "txmq spark-export": {"-c"}}


def test_each_short_flag_means_one_thing_on_every_command():
    meanings: dict[str, set[str]] = {}
    for path, longs, shorts in _visible_options():
        for short in shorts:
            if short in OWN_VOCABULARY.get(path, ()) or not longs:
                continue
            meanings.setdefault(short, set()).add(longs[0])
    mixed = {s: sorted(m) for s, m in meanings.items() if len(m) > 1}
    assert not mixed, mixed


def test_at_most_n_is_limit_everywhere():
    counts = [(path, longs) for path, longs, _ in _visible_options() if "--count" in longs]
    assert not counts, counts
    limits = {path for path, longs, _ in _visible_options() if "--limit" in longs}
    assert {"txmq read", "txmq consume", "txmq stats", "txmq checker", "txmq message find", "txmq inspect half",
            "txmq discard list", "txmq scheduled list"} <= limits, limits


def test_read_takes_limit_and_still_takes_its_older_count(broker):
    for i in range(3):
        ok(run(broker, "send", "vocab-read", f"m{i}", "--queue", "0"))
    for flag in ("--limit", "-l", "--count", "-c"):
        assert [m["body"] for m in lines(ok(run(broker, "read", "vocab-read", flag, "2")))] == ["m0", "m1"], flag
    r = run(broker, "read", "vocab-read", "--limit", "1", "--count", "2")
    assert r.returncode == USAGE and "--limit and --count are the same option" in err(r)
    help_text = out(ok(run(broker, "read", "--help")))
    assert "--limit" in help_text and "--count" not in help_text


def test_older_short_names_still_work_but_are_not_shown(broker, tmp_path):
    ok(run(broker, "send", "vocab-short", "x", "-t", "old-tag", "--queue", "0"))
    assert lines(ok(run(broker, "read", "vocab-short")))[0]["tags"] == "old-tag"
    assert one(run(broker, "topics", "create", "vocab-queues", "-q", "3", "-o", "json"))["queues"] == 3
    assert lines(ok(run(broker, "stats", "--watch", "-c", "2", "-f", "pending", "--interval", "50ms")))[1]["gauges"]["pending"] >= 0
    env = {"XDG_CONFIG_HOME": str(tmp_path)}
    ok(run(broker, "context", "add", "c1", "--broker", "127.0.0.1:1", env=env))
    ok(run(broker, "context", "add", "c1", "--broker", "127.0.0.1:2", "-f", env=env))
    for command, hidden in ((["send"], " -t "), (["stats"], " -f "), (["topics", "create"], " -q "), (["context", "add"], " -f ")):
        assert hidden not in out(ok(run(broker, *command, "--help"))), command


# ---- --all where a bulk form makes sense -------------------------------------------------------

def test_resolve_all_decides_every_pending_transaction_of_every_group(broker):
    sent = [one(run(broker, "send", "vocab-all", f"t{i}", "--tx", "--group", f"vocab-g{i % 3}", "-o", "json")) for i in range(5)]
    other = one(run(broker, "send", "vocab-all-other", "o", "--tx", "--group", "vocab-g0", "-o", "json"))
    r = run(broker, "resolve", "--commit", "--all", "--topic", "vocab-all")
    assert r.returncode == USAGE and "without a terminal to confirm on" in err(r), err(r)
    dry = lines(ok(run(broker, "resolve", "--commit", "--all", "--topic", "vocab-all", "--dry-run")))
    assert sorted(d["tx_id"] for d in dry) == sorted(s["tx_id"] for s in sent)
    assert all(d["status"] == "ok" and d["ref"] == d["tx_id"] for d in dry)
    done = lines(ok(run(broker, "resolve", "--commit", "--all", "--topic", "vocab-all", "--yes")))
    assert sorted(d["tx_id"] for d in done) == sorted(s["tx_id"] for s in sent) and {d["status"] for d in done} == {"ok"}
    pending = {t["tx_id"] for t in lines(ok(run(broker, "inspect", "half")))}
    assert not pending & {s["tx_id"] for s in sent} and other["tx_id"] in pending  # --topic narrowed it
    r = run(broker, "resolve", "--rollback", "--all", "--yes")
    assert [d["tx_id"] for d in lines(ok(r))] == [other["tx_id"]]
    r = run(broker, "resolve", "--rollback", "--all", "--yes")
    assert r.returncode == OK and "nothing to resolve" in err(r)
    for bad in (["--all", "42"], ["--topic", "vocab-all"], ["--older-than", "1m"]):
        r = run(broker, "resolve", "--commit", *bad, "--yes")
        assert r.returncode == USAGE, (bad, err(r))


def test_scheduled_cancel_all_cancels_every_scheduled_message_of_a_topic(broker):
    ids = [one(run(broker, "send", "vocab-later", f"x{i}", "--delay", "1h", "-o", "json"))["msg_id"] for i in range(3)]
    keep = one(run(broker, "send", "vocab-later-kept", "k", "--delay", "1h", "-o", "json"))["msg_id"]
    r = run(broker, "scheduled", "cancel", "--all", "--topic", "vocab-later")
    assert r.returncode == USAGE and "without a terminal to confirm on" in err(r)
    dry = lines(ok(run(broker, "scheduled", "cancel", "--all", "--topic", "vocab-later", "--dry-run")))
    assert sorted(d["msg_id"] for d in dry) == sorted(ids)
    done = lines(ok(run(broker, "scheduled", "cancel", "--all", "--topic", "vocab-later", "--yes")))
    assert sorted(d["msg_id"] for d in done) == sorted(ids) and {d["status"] for d in done} == {"ok"}
    assert all(c["deliver_at"] == c["deliver_at_ms"] for d in done for c in d["cancelled"])
    left = [m["msg_id"] for m in lines(ok(run(broker, "scheduled", "list")))]
    assert keep in left and not set(ids) & set(left)
    r = run(broker, "scheduled", "cancel", "--all", "--topic", "vocab-later", "--yes")
    assert r.returncode == OK and "nothing to cancel" in err(r)
    r = run(broker, "scheduled", "cancel", keep, "--all")
    assert r.returncode == USAGE


# ---- a group of commands without a command ---------------------------------------------------

@pytest.mark.parametrize("group, listing", [(["groups"], ["groups", "list"]), (["discard"], ["discard", "list"]),
                                            (["config"], ["config", "get"]), (["scheduled"], ["scheduled", "list"]),
                                            (["topics"], ["topics"])])
def test_a_group_of_commands_without_a_command_does_its_listing(broker, group, listing):
    ok(run(broker, "consume", "vocab-read", "--group", "vocab-readers", "--limit", "1"))
    r = run(broker, *group, "-o", "json")
    assert r.returncode == OK, err(r)
    assert json.loads(out(r)) == json.loads(out(ok(run(broker, *listing, "-o", "json"))))


def test_context_without_a_command_lists_the_contexts(broker, tmp_path):
    env = {"XDG_CONFIG_HOME": str(tmp_path)}
    ok(run(broker, "context", "add", "here", "--broker", broker, env=env))
    assert [c["name"] for c in lines(ok(run(broker, "context", env=env)))] == ["here"]


# ---- times as times --------------------------------------------------------------------------

ISO = r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{3}Z"


def test_a_delayed_send_shows_its_due_time_and_no_queue_offset_it_does_not_have(broker):
    table = out(ok(run(broker, "send", "vocab-delay", "x", "--delay", "10m", "-o", "table")))
    assert re.search(rf"^deliver_at\s+{ISO} \(in (9m5[0-9]s|10m00s)\)$", table, re.M), table
    assert "queue_offset" not in table and not re.search(r"\s-1$", table, re.M) and "deliver_at_ms" not in table, table
    doc = one(run(broker, "send", "vocab-delay", "y", "--delay", "10m", "-o", "json"))
    assert doc["queue_offset"] == -1 and doc["deliver_at_ms"] == doc["deliver_at"] > time.time() * 1000  # the keys stay
    lines_out = out(ok(run(broker, "send", "vocab-delay", "-", "--delay", "1m", "-o", "table", input="a\nb\n")))
    assert re.search(rf"deliver_at={ISO}", lines_out) and "deliver_at_ms" not in lines_out, lines_out


def test_inspect_scheduled_with_nothing_scheduled_says_so_once(broker):
    r = ok(run(broker, "inspect", "scheduled", "--topic", "vocab-nothing", "-o", "table"))
    assert err(r).strip().splitlines() == ["no scheduled messages for topic vocab-nothing"], err(r)
    ok(run(broker, "send", "vocab-one", "x", "--delay", "1h"))
    r = ok(run(broker, "inspect", "scheduled", "--topic", "vocab-one", "-o", "table"))
    assert err(r).strip().splitlines() == ["1 scheduled message(s) for topic vocab-one"], err(r)
    r = ok(run(broker, "inspect", "scheduled", "--topic", "vocab-one", "--limit", "1", "-o", "table"))
    assert len(err(r).strip().splitlines()) == 1, err(r)


def test_broker_status_shows_durations_as_typed_and_json_keeps_seconds(broker):
    table = out(ok(run(broker, "broker", "status", "-o", "table")))
    assert re.search(r"^transaction_timeout\s+1m$", table, re.M) and re.search(r"^retention\s+72h$", table, re.M), table
    assert re.search(r"^uptime\s+[0-9.]+(ms|s)|^uptime\s+[0-9]+m[0-9]{2}s", table, re.M) and "_s " not in table, table
    doc = one(run(broker, "broker", "status", "-o", "json"))
    assert doc["transaction_timeout_s"] == 60 and doc["retention_s"] == 259200


def test_a_position_without_a_zone_is_local_time_as_every_time_the_cli_reads():
    from txmq.cli.commands._positions import parse_position
    from txmq.cli.commands.send import parse_deliver_at

    saved = os.environ.get("TZ")
    os.environ["TZ"] = "Asia/Tokyo"
    time.tzset()
    try:
        pos = parse_position("2026-01-31T12:00:00")
        assert pos.time_ms == parse_deliver_at("2026-01-31T12:00:00") == parse_position("2026-01-31T03:00:00Z").time_ms
    finally:
        if saved is None:
            os.environ.pop("TZ", None)
        else:
            os.environ["TZ"] = saved
        time.tzset()
