"""Disk full: sends get a clear STORE_FULL, reads and consumers keep working, nothing acknowledged is lost,
and writes resume when space returns.

Two ways to run out of space, both against a broker subprocess:

- a small tmpfs the test mounts (needs root and mount(2); skipped otherwise),
  filled with a filler file that is removed to give the space back;
- RLIMIT_FSIZE set in the broker process (SIGXFSZ ignored, so writes past
  the limit fail with EFBIG, which the store treats as full); the test
  raises the limit again with prlimit(2).
"""

from __future__ import annotations

import asyncio
import errno
import resource
import signal
import subprocess
import time
from typing import Callable

import pytest

from brokerproc import BrokerProcess
from conftest import arun
from faultload import PipeClient, queue_records, record
from txmq.store import Store, StoreReader

pytestmark = [pytest.mark.fault, pytest.mark.slow]

T = "full"
TX = {"TRAN_MSG": "true", "PGROUP": "g"}


def scenario(b: BrokerProcess, fill: Callable[[], None], free: Callable[[], None]) -> dict:
    acked: dict[bytes, tuple[int, int]] = {}
    figures: dict = {}

    async def go() -> None:
        c = await PipeClient.open(b.address)
        await c.ok("create_topic", {"topic": T, "queues": 2})

        async def send(body: bytes) -> tuple[int, dict]:
            code, r = await c.req("send", {"topic": T, "body": body})
            if code == 0:
                acked[body] = (r["queue_id"], r["queue_offset"])
            return code, r

        for i in range(100):
            code, r = await send(f"before-{i:03d}".encode() + b"." * 1000)
            assert code == 0, r
        await c.ok("commit_offset", {"group": "readers", "topic": T, "queue_id": 0, "offset": 10})

        fill()
        errors = []
        for i in range(400):  # the space left in the last page may take a few more
            code, r = await send(f"during-{i:03d}".encode() + b"." * 4000)
            if code:
                errors.append(r)
                if len(errors) >= 20:
                    break
        full = [e for e in errors if e["name"] == "STORE_FULL"]
        assert full, errors[:3]
        assert all(e["retriable"] for e in errors) and all(e["name"] in ("STORE_FULL", "STORE_ERROR") for e in errors), errors[:3]
        assert "full" in full[0]["error"]
        figures["store_full_replies"] = len(full)
        code, r = await c.req("send", {"topic": T, "body": b"h" * 4000, "properties": TX})
        assert code and r["name"] in ("STORE_FULL", "STORE_ERROR"), r
        code, r = await c.req("send_batch", {"topic": T, "messages": [{"body": b"b" * 4000}] * 4})
        assert code and r["name"] in ("STORE_FULL", "STORE_ERROR"), r

        await asyncio.sleep(0.4)  # a few checkpoint cycles run (and may fail) while the disk is full
        # reads and consumers keep working
        for q in range(2):
            r = await c.ok("pull", {"topic": T, "queue_id": q, "offset": 0, "max_count": 1000})
            bodies = {m["body"] for m in r["messages"]}
            assert {b for b, (qq, _) in acked.items() if qq == q} <= bodies
        offs = await c.ok("fetch_offsets", {"group": "readers", "topic": T})
        assert offs["offsets"]["0"] == 10
        # committing an offset needs a write: it may be refused, but only with a retriable error
        code, r = await c.req("commit_offset", {"group": "readers", "topic": T, "queue_id": 0, "offset": 15})
        assert code == 0 or (r["retriable"] and r["name"] in ("STORE_FULL", "STORE_ERROR")), r
        figures["commit_offset_while_full"] = r.get("name", "ok")
        # so may a config change; if it is refused it must not take effect either
        before = await c.ok("config_get")
        code, r = await c.req("config_set", {"key": "max_checks", "value": 7})
        after = await c.ok("config_get")
        assert after["max_checks"] == (7 if code == 0 else before["max_checks"]), (code, r, after)
        figures["config_set_while_full"] = r.get("name", "ok")
        await c.ok("list_topics")
        await c.ok("tx_pending")
        counters = (await c.ok("stats"))["counters"]
        assert counters.get("store_full_errors", 0) >= 1
        assert counters.get("errors_internal", 0) == 0

        free()
        deadline = asyncio.get_running_loop().time() + 10
        while True:  # the next send after the space came back is stored
            code, r = await send(b"after-first" + b"." * 4000)
            if code == 0:
                break
            assert r["retriable"], r
            assert asyncio.get_running_loop().time() < deadline, r
            await asyncio.sleep(0.1)
        for i in range(50):
            code, r = await send(f"after-{i:03d}".encode() + b"." * 4000)
            assert code == 0, r
        await c.ok("commit_offset", {"group": "readers", "topic": T, "queue_id": 0, "offset": 20})
        h = await c.ok("send", {"topic": T, "body": b"tx", "properties": TX})
        r = await c.ok("end_transaction", {"group": "g", "tx_id": h["tx_id"], "commit_log_offset": h["commit_log_offset"],
                                           "half_offset": h["half_offset"], "state": "commit"})
        acked[b"tx"] = (r["queue_id"], r["queue_offset"])
        await c.close()

    arun(go())
    assert b.stop() == 0
    # nothing acknowledged was lost, the directory opens clean
    s = Store(b.data_dir)
    report = s.open()
    s.close()
    assert report.dropped_bytes == 0, report
    reader = StoreReader(b.data_dir)
    stored = {r.body: (q, r.queue_offset) for q in range(2) for r in queue_records(reader, T, q)}
    reader.close()
    lost = [k for k, v in acked.items() if stored.get(k) != v]
    assert not lost, lost[:3]
    figures["acked"] = len(acked)
    return figures


@pytest.fixture
def tmpfs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_full_tmpfs_refuses_sends_keeps_reads_and_resumes_when_space_returns(tmpfs, tmp_path):
    b = BrokerProcess(tmpfs / "data", "--flush", "sync", "--flush-interval", "300ms")
    b.log = tmp_path / "broker.log"  # not on the full disk
    filler = tmpfs / "filler"
    full_for = {}

    def fill() -> None:
        full_for["t0"] = time.monotonic()
        chunk = b"\0" * (64 << 10)
        with open(filler, "wb", buffering=0) as f:
            try:
                while True:
                    f.write(chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC
        small = b"\0" * 512
        with open(tmpfs / "filler2", "wb", buffering=0) as f:  # the last partial chunk too
            try:
                while True:
                    f.write(small)
            except OSError as e:
                assert e.errno == errno.ENOSPC

    def free() -> None:
        full_for["s"] = time.monotonic() - full_for["t0"]
        filler.unlink()
        (tmpfs / "filler2").unlink()

    b.start()
    try:
        figures = scenario(b, fill, free)
    finally:
        b.kill()
    log = b.log.read_text()
    assert "event=internal_error" not in log, log[-3000:]
    # a failing checkpoint is retried at the flush interval, not in a tight loop
    failed = log.count("event=flush_failed")
    assert failed <= full_for["s"] / 0.3 + 3, (failed, full_for)
    figures["flush_failed_logged"] = failed
    record("disk-full-tmpfs", **figures)


def test_file_size_limit_refuses_sends_keeps_reads_and_resumes_when_raised(tmp_path):
    limit = 256 << 10

    def preexec() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write past the limit -> EFBIG, not death
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    b = BrokerProcess(tmp_path / "data", "--flush", "sync", "--flush-interval", "100ms", preexec=preexec)
    b.start()
    state = {"filled": False}

    def fill() -> None:
        state["filled"] = True  # the limit is in place from the start; the sends run into it

    def free() -> None:
        resource.prlimit(b.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))

    try:
        figures = scenario(b, fill, free)
    finally:
        b.kill()
    seg = sorted((tmp_path / "data" / "commitlog").iterdir())[0]
    assert seg.stat().st_size > limit  # writes went on past the old limit
    record("disk-full-rlimit", **figures)


def _fill(mnt) -> None:
    """Take every byte of the tmpfs at mnt (filler files, removed by _free)."""
    for name, size in (("filler", 64 << 10), ("filler2", 512)):
        chunk = b"\0" * size
        with open(mnt / name, "ab", buffering=0) as f:
            try:
                while True:
                    f.write(chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC


def _free(mnt) -> None:
    for name in ("filler", "filler2"):
        (mnt / name).unlink(missing_ok=True)


def started_on(tmpfs, tmp_path, *args: str) -> BrokerProcess:
    """A broker on the tmpfs, its log beside the test (not on the disk that fills)."""
    b = BrokerProcess(tmpfs / "data", *args)
    b.log = tmp_path / "broker.log"
    b.start()
    return b


def assert_no_traceback(b: BrokerProcess) -> None:
    log = b.log.read_text()
    assert "Traceback" not in log, log[-3000:]


def _wait_log(b: BrokerProcess, text: str, count: int = 1, timeout: float = 60.0) -> None:  # an upper bound: writers retry every second
    deadline = time.monotonic() + timeout
    while b.log.read_text().count(text) < count:
        assert time.monotonic() < deadline, (text, count, b.log.read_text()[-3000:])
        time.sleep(0.05)


def test_broker_starts_on_a_full_disk_serves_reads_and_stops_cleanly(tmpfs, tmp_path):
    b = started_on(tmpfs, tmp_path, "--flush", "sync")
    sent: list[bytes] = []

    async def before() -> str:
        c = await PipeClient.open(b.address)
        await c.ok("create_topic", {"topic": T, "queues": 2})
        for i in range(20):
            body = f"m-{i:02d}".encode()
            await c.ok("send", {"topic": T, "queue_id": 0, "body": body})
            sent.append(body)
        await c.ok("commit_offset", {"group": "readers", "topic": T, "queue_id": 0, "offset": 5})
        h = await c.ok("send", {"topic": T, "body": b"pending", "properties": TX})
        await c.close()
        return h["tx_id"]

    try:
        tx_id = arun(before())
        assert b.stop() == 0
        _fill(tmpfs)
        b.start()  # on the full disk

        async def while_full() -> None:
            c = await PipeClient.open(b.address)
            r = await c.ok("pull", {"topic": T, "queue_id": 0, "offset": 0, "max_count": 100})
            assert [m["body"] for m in r["messages"]] == sent
            assert (await c.ok("fetch_offsets", {"group": "readers", "topic": T}))["offsets"]["0"] == 5
            code, r = await c.req("send", {"topic": T, "body": b"x" * 4000})
            assert code and r["name"] in ("STORE_FULL", "STORE_ERROR") and r["retriable"], r
            await c.close()

        arun(while_full())
        assert b.stop() == 0
        _free(tmpfs)
        b.start()

        async def after() -> None:
            c = await PipeClient.open(b.address)
            r = await c.ok("pull", {"topic": T, "queue_id": 0, "offset": 0, "max_count": 100})
            assert [m["body"] for m in r["messages"]] == sent
            assert [t["tx_id"] for t in (await c.ok("tx_pending"))["transactions"]] == [tx_id]
            await c.ok("send", {"topic": T, "body": b"after"})
            await c.close()

        arun(after())
        assert b.stop() == 0
    finally:
        b.kill()
        _free(tmpfs)
    assert_no_traceback(b)


def test_sigterm_on_a_full_disk_exits_cleanly_and_keeps_what_was_acknowledged(tmpfs, tmp_path):
    b = started_on(tmpfs, tmp_path, "--flush", "sync", "--flush-interval", "100ms")
    acked: dict[bytes, int] = {}

    async def go() -> None:
        c = await PipeClient.open(b.address)
        await c.ok("create_topic", {"topic": T, "queues": 1})
        for i in range(30):
            r = await c.ok("send", {"topic": T, "body": f"before-{i:02d}".encode()})
            acked[f"before-{i:02d}".encode()] = r["queue_offset"]
        _fill(tmpfs)
        refused = 0
        for i in range(400):
            body = f"during-{i:03d}".encode() + b"." * 4000
            code, r = await c.req("send", {"topic": T, "body": body})
            if code == 0:
                acked[body] = r["queue_offset"]
            else:
                refused += 1
                if refused >= 5:
                    break
        assert refused, "the disk never filled"
        await asyncio.sleep(0.3)  # a few flush cycles fail meanwhile
        await c.close()

    try:
        arun(go())
        assert b.stop() == 0  # SIGTERM with the disk still full
        log = b.log.read_text()
        assert "Traceback" not in log, log[-3000:]
        assert "event=shutdown_done" in log
        _free(tmpfs)
        # what could not be written at the stop (consume-queue entries, the checkpoint) comes back from the log
        s = Store(b.data_dir)
        s.open()
        s.close()
        reader = StoreReader(b.data_dir)
        stored = {r.body: r.queue_offset for r in queue_records(reader, T, 0)}
        reader.close()
        lost = [k for k, v in acked.items() if stored.get(k) != v]
        assert not lost, lost[:3]
    finally:
        b.kill()
        _free(tmpfs)


def test_full_disk_is_logged_once_per_change_of_state(tmpfs, tmp_path):
    b = started_on(tmpfs, tmp_path, "--check-interval", "100ms", "--flush-interval", "100ms")

    async def go() -> None:
        c = await PipeClient.open(b.address)
        await c.ok("send", {"topic": T, "body": b"before"})
        await c.ok("send", {"topic": T, "body": b"pending", "properties": TX})
        for spell in (1, 2):
            _fill(tmpfs)
            _wait_log(b, "event=disk_full", spell)
            await asyncio.sleep(1.0)  # about ten check passes and flush cycles meet the full disk
            r = await c.ok("pull", {"topic": T, "queue_id": 0, "offset": 0, "max_count": 10})
            assert r is not None
            _free(tmpfs)
            _wait_log(b, "event=disk_ok", spell)
        await c.ok("send", {"topic": T, "body": b"after"})
        await c.close()

    try:
        arun(go())
        assert b.stop() == 0
    finally:
        b.kill()
        _free(tmpfs)
    log = b.log.read_text()
    assert log.count("event=disk_full") == 2 and log.count("event=disk_ok") == 2, log[-3000:]
    assert "event=check_pass_failed" not in log and "event=flush_failed" not in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


def test_broker_killed_then_started_on_a_full_disk_holds_the_rebuilt_queue_entries_until_space_returns(tmpfs, tmp_path):
    """Recovery must index the records the killed broker had not checkpointed; with no space it keeps them in memory."""
    b = started_on(tmpfs, tmp_path, "--flush", "sync", "--flush-interval", "1h")  # no checkpoint after the sends
    sent: list[bytes] = []

    async def before() -> None:
        c = await PipeClient.open(b.address)
        await c.ok("create_topic", {"topic": T, "queues": 1})
        for i in range(200):
            body = f"m-{i:03d}".encode() + b"." * 200
            await c.ok("send", {"topic": T, "body": body})  # fsynced before the reply: durable
            sent.append(body)
        await c.close()

    async def pull_all() -> list[bytes]:
        c = await PipeClient.open(b.address)
        r = await c.ok("pull", {"topic": T, "queue_id": 0, "offset": 0, "max_count": 1000})
        code, refused = await c.req("send", {"topic": T, "body": b"x" * 4000}) if full else (0, None)
        if full:
            assert code and refused["retriable"], refused
        await c.close()
        return [m["body"] for m in r["messages"]]

    try:
        arun(before())
        b.kill()
        _fill(tmpfs)
        b.args[-1] = "100ms"  # checkpoints retry often from here on
        b.start()  # the queue entries of the 200 records cannot be written: held in memory
        full = True
        assert arun(pull_all()) == sent
        _wait_log(b, "event=consume_queue_entries_held")
        _free(tmpfs)
        full = False
        _wait_log(b, "event=consume_queue_entries_written")  # the next checkpoint cycle wrote them
        b.kill()  # and they are on disk: the next start has nothing to index again
        b.start()
        assert arun(pull_all()) == sent
        assert "redispatched=0" in b.log.read_text().rsplit("event=store_opened", 1)[1].split("\n", 1)[0]
        assert b.stop() == 0
    finally:
        b.kill()
        _free(tmpfs)
    assert_no_traceback(b)
