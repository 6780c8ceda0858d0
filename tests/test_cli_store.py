"""`txmq store verify` finds every kind of damage without touching a file; `txmq store repair` heals what can be healed."""

from __future__ import annotations

import fcntl
import json
import os
import shutil

import pytest

from clihelpers import NOT_FOUND, USAGE, txmq
from test_store_damage import SMALL, flip, msg
from txmq.store import Store

DATA_PROBLEM, IN_USE = 10, 11


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A data directory with two topics and several segments, closed cleanly."""
    d = tmp_path_factory.mktemp("pristine") / "d"
    with Store(d, SMALL) as s:
        results = s.append([msg(i, qid=i % 2) for i in range(120)] + [msg(i, topic="U") for i in range(30)])
    return d, results


@pytest.fixture
def data(pristine, tmp_path):
    d = tmp_path / "d"
    shutil.copytree(pristine[0], d)
    return d, pristine[1]


def snapshot(d) -> dict[str, tuple[int, int]]:
    out = {}
    for root, dirs, files in os.walk(d):
        for name in dirs + files:
            p = os.path.join(root, name)
            st = os.stat(p)
            out[os.path.relpath(p, d)] = (st.st_size if name in files else 0, st.st_mtime_ns)
    return out


def verify(d, *extra: str):
    r = txmq("store", "verify", "--data-dir", str(d), "-o", "json", *extra)
    return r.returncode, json.loads(r.stdout)


def kinds(doc) -> list[str]:
    return [p["kind"] for p in doc["problems"]]


def test_verify_on_a_clean_directory_exits_0_and_lists_nothing(data):
    d, _ = data
    from txmq.broker.transactions.indexfile import TxDatabase

    TxDatabase(d / "txindex.db").close()  # an index that fits the log, read without -wal/-shm files
    before = snapshot(d)
    code, doc = verify(d)
    assert snapshot(d) == before
    assert code == 0
    assert doc["ok"] is True and doc["problems"] == []
    assert doc["records"] == 150 and doc["queues"] == 3 and doc["segments"] > 5
    table = txmq("store", "verify", "-d", str(d), "-o", "table")
    assert table.returncode == 0 and table.stdout == b"" and b"clean" in table.stderr


def test_verify_finds_a_flipped_byte_at_its_offset_and_changes_no_file(data):
    d, results = data
    victim = results[40]
    flip(d, victim.commit_log_offset + victim.size - 20)
    before = snapshot(d)
    code, doc = verify(d)
    assert snapshot(d) == before
    assert code == DATA_PROBLEM and doc["ok"] is False
    (p,) = doc["problems"]
    assert p["kind"] == "damaged_range" and p["offset"] == victim.commit_log_offset
    assert "crc mismatch" in p["detail"] and "1 queue entry leads into it" in p["detail"]
    assert doc["records"] == 149


def test_verify_finds_a_removed_queue(data):
    d, _ = data
    shutil.rmtree(d / "consumequeue" / "T" / "1")
    code, doc = verify(d)
    assert code == DATA_PROBLEM
    (p,) = doc["problems"]
    assert p["kind"] == "queue_missing" and "T/1" in p["detail"]


def test_verify_finds_a_torn_tail(data):
    d, results = data
    last = sorted(os.listdir(d / "commitlog"))[-1]
    with open(d / "commitlog" / last, "ab") as f:
        f.write(b"\x00\x01\x02" * 20)  # a write that did not finish
    code, doc = verify(d)
    assert code == DATA_PROBLEM
    (p,) = doc["problems"]
    assert p["kind"] == "torn_tail" and p["offset"] == results[-1].end_offset and p["length"] == 60


def test_verify_finds_garbage_queue_entries_an_unusable_index_and_bad_json(data):
    d, _ = data
    qdir = d / "consumequeue" / "U" / "0"
    (f,) = os.listdir(qdir)
    with open(qdir / f, "r+b") as fh:
        fh.seek(5 * 20)
        fh.write(b"\x00" * 20 * 3)
    (d / "txindex.db").write_bytes(b"not a database" * 100)
    (d / "offsets.json").write_text("{")
    code, doc = verify(d)
    assert code == DATA_PROBLEM
    assert sorted(kinds(doc)) == ["file", "index", "queue_entries"]
    q = next(p for p in doc["problems"] if p["kind"] == "queue_entries")
    assert "U/0 entries 5-7 (3)" in q["detail"]


def test_verify_finds_an_index_whose_pages_are_damaged_behind_a_good_header(data):
    import sqlite3

    from txmq.broker.transactions.indexfile import TxDatabase

    d, _ = data
    TxDatabase(d / "txindex.db").close()  # fits the log
    db = sqlite3.connect(d / "txindex.db")
    root = db.execute("SELECT rootpage FROM sqlite_master WHERE name = 'tx'").fetchone()[0]
    page = db.execute("PRAGMA page_size").fetchone()[0]
    db.close()
    with open(d / "txindex.db", "r+b") as f:
        f.seek((root - 1) * page)
        f.write(b"\xa5" * page)
    code, doc = verify(d)
    assert code == DATA_PROBLEM and kinds(doc) == ["index"], doc["problems"]


@pytest.mark.parametrize("name, content", [("offsets.json", "[]"), ("config.json", "[]"), ("config.json", '{"max_checks": -5}')])
def test_verify_reports_json_files_the_broker_would_refuse_to_start_with(data, name, content):
    d, _ = data
    (d / name).write_text(content)
    code, doc = verify(d)
    assert code == DATA_PROBLEM and kinds(doc) == ["file"] and name in doc["problems"][0]["detail"], doc["problems"]


def test_repair_dry_run_changes_nothing(data):
    d, _ = data
    shutil.rmtree(d / "consumequeue" / "T" / "1")
    with open(d / "commitlog" / sorted(os.listdir(d / "commitlog"))[-1], "ab") as f:
        f.write(b"\x07" * 33)
    before = snapshot(d)
    r = txmq("store", "repair", "-d", str(d), "--dry-run", "-o", "json")
    assert r.returncode == 0
    doc = json.loads(r.stdout)
    assert snapshot(d) == before
    assert doc["dry_run"] is True and sorted(kinds(doc)) == ["queue_missing", "torn_tail"]
    assert any("quarantine" in step for step in doc["plan"])


def test_repair_heals_so_verify_is_clean_and_quarantine_holds_the_cut_bytes(data):
    d, results = data
    shutil.rmtree(d / "consumequeue" / "T" / "1")
    tail = b"\x07" * 33
    with open(d / "commitlog" / sorted(os.listdir(d / "commitlog"))[-1], "ab") as f:
        f.write(tail)
    (d / "txindex.db").write_bytes(b"not a database")
    assert txmq("store", "repair", "-d", str(d)).returncode == USAGE  # no terminal to confirm on, no --yes
    r = txmq("store", "repair", "-d", str(d), "--yes", "-o", "json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["cut_at"] == results[-1].end_offset and doc["quarantined_bytes"] == len(tail)
    assert doc["index_removed"] is True and not (d / "txindex.db").exists()
    assert doc["remaining"] == []
    (q,) = os.listdir(d / "quarantine")
    assert (d / "quarantine" / q).read_bytes() == tail
    code, after = verify(d)
    assert code == 0 and after["problems"] == [] and after["records"] == 150
    assert after["quarantine"] == [{"name": q, "bytes": len(tail)}]
    with Store(d, SMALL) as s:  # every record is served from the rebuilt queue
        assert s.queue_max_offset("T", 1) == 60


def test_repair_keeps_a_damaged_record_and_says_verify_still_sees_it(data):
    d, results = data
    victim = results[40]
    flip(d, victim.commit_log_offset + 100)
    os.unlink(d / "checkpoint")
    segments = sorted(os.listdir(d / "commitlog"))
    r = txmq("store", "repair", "-d", str(d), "-y", "-o", "json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["damaged_ranges"] == 1 and doc["cut_at"] is None
    assert [p["kind"] for p in doc["remaining"]] == ["damaged_range"]
    assert sorted(os.listdir(d / "commitlog")) == segments and not (d / "quarantine").exists()  # nothing removed


def test_repair_refuses_a_directory_a_broker_holds(data):
    d, _ = data
    shutil.rmtree(d / "consumequeue" / "T" / "1")
    fd = os.open(d / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        before = snapshot(d)
        r = txmq("store", "repair", "-d", str(d), "--yes", subprocess_=True)
        assert r.returncode == IN_USE
        assert b"in use by a running broker" in r.stderr
        assert snapshot(d) == before
        code, doc = verify(d)  # verify still works beside it
        assert code == DATA_PROBLEM and doc["broker_running"] is True
    finally:
        os.close(fd)


def test_a_path_that_is_not_a_data_directory_is_not_found(tmp_path):
    assert txmq("store", "verify", "-d", str(tmp_path / "none")).returncode == NOT_FOUND
    assert txmq("store", "repair", "-d", str(tmp_path), "--dry-run").returncode == NOT_FOUND


def test_offline_inspection_refuses_a_log_without_one_valid_record_and_warns_about_a_torn_tail(tmp_path):
    garbage = tmp_path / "garbage"
    (garbage / "commitlog").mkdir(parents=True)
    (garbage / "commitlog" / f"{0:020d}").write_bytes(bytes(range(256)) * 20)
    r = txmq("inspect", "half", "--data-dir", str(garbage), "-o", "json")
    assert r.returncode == 10 and b"not one valid record" in r.stderr
    torn = tmp_path / "torn"
    with Store(torn, SMALL) as s:
        s.append([msg(i) for i in range(3)])
    with open(torn / "commitlog" / f"{0:020d}", "ab") as f:
        f.write(b"\x07" * 300)
    r = txmq("inspect", "offsets", "--data-dir", str(torn), "-o", "json")
    assert r.returncode == 0 and b"300 bytes after the last valid record" in r.stderr
