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
