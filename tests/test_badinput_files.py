"""Damaged files in the data directory: a clear message naming the file and what to do, never a traceback.

What the broker does with each file it reads at start:

- config.json (check settings): refuses to start (exit 1) and leaves the file
  as it is; the defaults could shorten a transaction timeout an operator set;
- offsets.json (consumer offsets): refuses to start (exit 1); without them
  groups would move to where their consumers' --from says;
- txcheck.json (check progress, for people): moved aside, progress from 0;
- topics.json (queue counts): moved aside, topics taken from the log;
- checkpoint: ignored with a warning, the whole log is checked.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from brokerproc import free_port
from conftest import arun
from clihelpers import ok, one, txmq
from txhelpers import G, half_fields
from txmq.broker.clock import ManualClock
from txmq.broker.testing import running_broker
from wireclient import RawClient


def start_cli(data, *args: str, timeout: float = 20) -> subprocess.CompletedProcess:
    """`txmq broker start` on data, expected to stop by itself (a refused start)."""
    cmd = [sys.executable, "-m", "txmq", "broker", "start", "--data-dir", str(data), "--port", str(free_port()), *args]
    return subprocess.run(cmd, capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL)


def seed(data) -> None:
    """A data directory with a topic, a message and a consumer offset."""

    async def go():
        async with running_broker(data) as b:
            c = await RawClient.open(b.address)
            await c.ok("create_topic", {"topic": "orders", "queues": 2})
            await c.ok("send", {"topic": "orders", "queue_id": 1, "body": b"one"})
            await c.ok("commit_offset", {"group": "readers", "topic": "orders", "queue_id": 1, "offset": 1})
            await c.close()

    arun(go())


@pytest.mark.parametrize("content", ["[1,2]", "{", "", '{"max_checks": "many"}', '{"transaction_timeout_s": -1}', '"60s"'])
def test_damaged_config_json_refuses_the_start_naming_the_file(tmp_path, content):
    data = tmp_path / "data"
    data.mkdir()
    (data / "config.json").write_text(content)
    r = start_cli(data)
    stderr = r.stderr.decode()
    assert r.returncode == 1, stderr
    assert "Traceback" not in stderr, stderr
    assert f"{data / 'config.json'}" in stderr and "move it away" in stderr, stderr
    assert (data / "config.json").read_text() == content  # left for a person to look at
    assert not (data / "commitlog").exists() or not any((data / "commitlog").iterdir())  # refused before the store opened


def test_a_start_option_replaces_a_bad_stored_setting_and_unknown_keys_are_ignored(tmp_path, caplog):
    data = tmp_path / "data"
    data.mkdir()
    (data / "config.json").write_text('{"max_checks": "many", "check_interval_s": 5, "colour": "blue"}')
    caplog.set_level(logging.INFO)

    async def go():
        async with running_broker(data, max_checks=7) as b:
            return b.core.check.settings

    s = arun(go())
    assert (s.max_checks, s.check_interval_s) == (7, 5.0)
    # a start option is for that run: the file keeps what it held
    assert (data / "config.json").read_text() == '{"max_checks": "many", "check_interval_s": 5, "colour": "blue"}'
    assert any("event=config_unknown_key" in r.getMessage() and "colour" in r.getMessage() for r in caplog.records)


def test_start_options_apply_to_one_start_and_are_not_stored(tmp_path):
    data = tmp_path / "data"
    data.mkdir()

    async def go(live: dict | None = None, **kw):
        async with running_broker(data, **kw) as b:
            for k, v in (live or {}).items():
                b.core.check.set(k, v)
            return b.core.check.settings, None

    path = data / "config.json"
    arun(go())
    assert not path.exists()  # a start writes nothing
    s, _ = arun(go(max_checks=3))
    assert s.max_checks == 3 and not path.exists()
    s, _ = arun(go())
    assert s.max_checks == 15  # the next plain start is back on the defaults
    path.write_text('{"max_checks": 4}')
    before = path.stat().st_mtime_ns, path.stat().st_ino
    s, _ = arun(go(max_checks=2, retention_s=3600))
    assert (s.max_checks, s.retention_s) == (2, 3600) and (path.stat().st_mtime_ns, path.stat().st_ino) == before
    s, _ = arun(go())
    assert s.max_checks == 4
    # a live change (`config set`) is stored, without the start options beside it
    s, _ = arun(go({"check_interval_s": 9}, max_checks=2))
    assert (s.max_checks, s.check_interval_s) == (2, 9) and json.loads(path.read_text()) == {"max_checks": 4, "check_interval_s": 9}


@pytest.mark.parametrize("content", ["{", "[1,2]", "null"])
def test_damaged_offsets_json_refuses_the_start_and_releases_the_directory(tmp_path, content):
    data = tmp_path / "data"
    seed(data)
    (data / "offsets.json").write_text(content)
    r = start_cli(data)
    stderr = r.stderr.decode()
    assert r.returncode == 1 and "Traceback" not in stderr, stderr
    assert str(data / "offsets.json") in stderr and "Restore it from a backup" in stderr, stderr

    async def refused_then_fixed():
        from txmq.store.errors import DataFileError

        with pytest.raises(DataFileError, match="offsets.json"):
            async with running_broker(data):
                pass
        (data / "offsets.json").rename(data / "offsets.json.bad")
        async with running_broker(data) as b:  # the refused start released the directory
            c = await RawClient.open(b.address)
            r = await c.ok("pull", {"topic": "orders", "queue_id": 1, "offset": 0, "max_count": 10})
            await c.close()
            return [m["body"] for m in r["messages"]]

    assert arun(refused_then_fixed()) == [b"one"]


@pytest.mark.parametrize("content", ["garbage", "[1,2]", '{"half_progress": "x"}', '{"half_progress": -1, "op_progress": 0}'])
def test_damaged_check_progress_is_moved_aside_and_checks_go_on(tmp_path, caplog, content):
    data = tmp_path / "data"
    seed(data)
    (data / "txcheck.json").write_text(content)
    # read-only inspection leaves it alone and reads 0
    offsets = one(txmq("inspect", "offsets", "--data-dir", str(data), "-o", "json"))
    assert offsets["half"]["progress"] == 0
    assert (data / "txcheck.json").read_text() == content
    caplog.set_level(logging.INFO)
    clock = ManualClock()

    async def go():
        async with running_broker(data, clock=clock, check_interval_s=3600) as b:
            c = await RawClient.open(b.address)
            await c.ok("hello", {"producer_groups": [G]})
            h = await c.ok("send", half_fields())
            clock.advance(10)
            r = await b.core.check.run_pass()
            push = await c.wait_push()
            await c.close()
            return h, r, push.fields

    h, r, push = arun(go())
    assert r["checked"] == 1 and push["tx_id"] == h["tx_id"]
    moved = list(data.glob("txcheck.json.corrupt-*"))
    assert len(moved) == 1 and moved[0].read_text() == content
    assert json.loads((data / "txcheck.json").read_text())["half_progress"] >= 0
    warned = [r.getMessage() for r in caplog.records if "event=data_file_damaged" in r.getMessage()]
    assert len(warned) == 1 and "txcheck.json" in warned[0], warned
    assert not [r for r in caplog.records if r.exc_info]


def test_damaged_topics_json_is_moved_aside_and_topics_come_back_from_the_log(tmp_path, caplog):
    data = tmp_path / "data"
    seed(data)
    (data / "topics.json").write_text("[1,2]")
    caplog.set_level(logging.INFO)

    async def go():
        async with running_broker(data) as b:
            c = await RawClient.open(b.address)
            topics = await c.ok("list_topics")
            r = await c.ok("pull", {"topic": "orders", "queue_id": 1, "offset": 0, "max_count": 10})
            offs = await c.ok("fetch_offsets", {"group": "readers", "topic": "orders"})
            await c.close()
            return topics, [m["body"] for m in r["messages"]], offs

    topics, bodies, offs = arun(go())
    assert bodies == [b"one"] and offs["offsets"]["1"] == 1
    assert "orders" in json.dumps(topics)
    assert len(list(data.glob("topics.json.corrupt-*"))) == 1
    assert any("event=data_file_damaged" in r.getMessage() and "topics.json" in r.getMessage() for r in caplog.records)


def test_damaged_checkpoint_is_ignored_with_a_warning(tmp_path, caplog):
    data = tmp_path / "data"
    seed(data)
    (data / "checkpoint").write_bytes(b"not a checkpoint")
    caplog.set_level(logging.INFO)

    async def go():
        async with running_broker(data) as b:
            c = await RawClient.open(b.address)
            r = await c.ok("pull", {"topic": "orders", "queue_id": 1, "offset": 0, "max_count": 10})
            await c.close()
            return [m["body"] for m in r["messages"]]

    assert arun(go()) == [b"one"]
    assert any("event=checkpoint_damaged" in r.getMessage() for r in caplog.records)
    ok(txmq("inspect", "offsets", "--data-dir", str(data)))
