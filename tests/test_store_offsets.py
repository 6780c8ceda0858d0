"""ConsumerOffsets and the atomic JSON helpers."""

from __future__ import annotations

import json
import os

import pytest

from txmq.store import ConsumerOffsets, StoreError, atomic_write_json, read_json
from txmq.store import offsets as offsets_module


def test_consumer_offsets_persist_and_reload(tmp_path):
    path = tmp_path / "offsets.json"
    co = ConsumerOffsets(path)
    assert co.get("g", "T", 0) is None and co.all() == {}
    co.commit("g", "T", 0, 5)
    co.commit("g", "T", 3, 7)
    co.commit("h", "U", 1, 1)
    assert not path.exists()  # memory only until persist
    co.persist()
    again = ConsumerOffsets(path)
    assert again.get("g", "T", 0) == 5 and again.get("g", "T", 3) == 7
    assert again.all() == {"g": {"T": {0: 5, 3: 7}}, "h": {"U": {1: 1}}}
    assert json.loads(path.read_text()) == {"g": {"T": {"0": 5, "3": 7}}, "h": {"U": {"1": 1}}}


def test_persist_writes_only_when_dirty(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(offsets_module, "atomic_write_json", lambda p, o: calls.append(o))
    co = ConsumerOffsets(tmp_path / "offsets.json")
    co.persist()
    co.commit("g", "T", 0, 1)
    co.persist()
    co.persist()
    co.commit("g", "T", 0, 1)  # same value: still clean
    co.persist()
    assert len(calls) == 1


def test_failed_persist_stays_dirty(tmp_path, monkeypatch):
    co = ConsumerOffsets(tmp_path / "offsets.json")
    co.commit("g", "T", 0, 1)

    def boom(p, o):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(offsets_module, "atomic_write_json", boom)
    with pytest.raises(OSError):
        co.persist()
    monkeypatch.undo()
    co.persist()
    assert ConsumerOffsets(tmp_path / "offsets.json").get("g", "T", 0) == 1


def test_all_returns_a_copy(tmp_path):
    co = ConsumerOffsets(tmp_path / "o.json")
    co.commit("g", "T", 0, 1)
    co.all()["g"]["T"][0] = 99
    assert co.get("g", "T", 0) == 1


def test_atomic_write_json_replaces_and_leaves_no_temp_files(tmp_path):
    path = tmp_path / "config.json"
    atomic_write_json(path, {"a": 1})
    atomic_write_json(path, {"a": 2, "b": [1, 2]})
    assert read_json(path) == {"a": 2, "b": [1, 2]}
    assert os.listdir(tmp_path) == ["config.json"]


def test_read_json_default_and_corruption(tmp_path):
    assert read_json(tmp_path / "missing.json") is None
    assert read_json(tmp_path / "missing.json", {}) == {}
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(StoreError):
        read_json(bad)


def test_acknowledged_ranges_are_written_after_the_offsets_and_reload_above_them(tmp_path):
    co = ConsumerOffsets(tmp_path / "offsets.json")
    co.commit("g", "T", 0, 10, keep_acked=True)
    co.set_acked("g", "T", 0, [12, 15, 20, 21])
    co.commit("g", "T", 1, 3)
    co.persist()
    # offsets.json keeps its format (a broker without acks.json reads it as before)
    assert json.loads((tmp_path / "offsets.json").read_text()) == {"g": {"T": {"0": 10, "1": 3}}}
    assert json.loads((tmp_path / "acks.json").read_text()) == {"format": 1, "acked": {"g": {"T": {"0": [10, 2, 3, 5, 1]}}}}
    again = ConsumerOffsets(tmp_path / "offsets.json")
    assert again.acked("g", "T", 0) == [12, 15, 20, 21] and again.acked("g", "T", 1) == []
    assert again.acks_loaded == 1 and again.acks_problem is None
    # the offset moved on into the ranges: what it passed is dropped, in memory and on disk
    again.commit("g", "T", 0, 14, keep_acked=True)
    again.set_acked("g", "T", 0, [12, 15, 20, 22])
    again.persist()
    assert json.loads((tmp_path / "acks.json").read_text())["acked"] == {"g": {"T": {"0": [14, 0, 1, 5, 2]}}}
    again.commit("g", "T", 0, 30, keep_acked=True)
    again.set_acked("g", "T", 0, [31, 32])
    again.set_acked("g", "T", 0, [12, 15, 20, 21])  # stale: all below the offset
    again.persist()
    assert json.loads((tmp_path / "acks.json").read_text())["acked"] == {} and again.acked("g", "T", 0) == []


def test_a_commit_from_outside_forgets_the_acknowledged_ranges(tmp_path):
    co = ConsumerOffsets(tmp_path / "offsets.json")
    co.commit("g", "T", 0, 10, keep_acked=True)
    co.set_acked("g", "T", 0, [12, 15])
    co.commit("g", "T", 0, 11, keep_acked=True)  # the owner of the ranges moving the offset keeps them
    assert co.acked("g", "T", 0) == [12, 15]
    co.persist()
    co.commit("g", "T", 0, 4)  # an operator's reset, a consumer's commit_offset
    assert co.acked("g", "T", 0) == []
    co.persist()
    assert json.loads((tmp_path / "acks.json").read_text())["acked"] == {}
    assert ConsumerOffsets(tmp_path / "offsets.json").acked("g", "T", 0) == []


def test_ranges_of_an_offset_that_moved_back_are_left_out(tmp_path):
    # offsets.json moved back (a reset) and acks.json did not follow (a crash between the two files)
    (tmp_path / "offsets.json").write_text(json.dumps({"g": {"T": {"0": 5, "1": 7}}}))
    (tmp_path / "acks.json").write_text(json.dumps({"format": 1, "acked": {"g": {"T": {"0": [10, 2, 3], "1": [6, 0, 3]}},
                                                                           "h": {"T": {"0": [0, 1, 1]}}}}))
    co = ConsumerOffsets(tmp_path / "offsets.json")
    assert co.acked("g", "T", 0) == []  # base 10 is past the offset 5
    assert co.acked("g", "T", 1) == [7, 9]  # base 6 is below 7: the ranges above 7 hold
    assert co.acked("h", "T", 0) == []  # no offset for it at all
    assert co.acks_problem is None


@pytest.mark.parametrize("content", [b"{not json", b"[]", b'{"format": 2, "acked": {}}',
                                     b'{"format": 1, "acked": {"g": {"T": {"0": [1, -1, 2], "1": [1, 1], "x": [1]}}}}'])
def test_an_unusable_acks_file_is_left_out_and_said_why(tmp_path, content):
    (tmp_path / "offsets.json").write_text(json.dumps({"g": {"T": {"0": 1, "1": 1}}}))
    (tmp_path / "acks.json").write_bytes(content)
    co = ConsumerOffsets(tmp_path / "offsets.json")  # the start goes on: those messages are delivered again
    assert co.get("g", "T", 0) == 1 and co.acked("g", "T", 0) == [] and co.acked("g", "T", 1) == []
    assert co.acks_problem


def test_a_data_directory_without_an_acks_file_loads_as_before(tmp_path):
    (tmp_path / "offsets.json").write_text(json.dumps({"g": {"T": {"0": 3}}}))
    co = ConsumerOffsets(tmp_path / "offsets.json")
    assert co.get("g", "T", 0) == 3 and co.acked("g", "T", 0) == [] and co.acks_problem is None
    co.commit("g", "T", 0, 4)
    co.persist()
    assert not (tmp_path / "acks.json").exists()  # nothing acknowledged out of order: no file
