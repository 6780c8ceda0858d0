"""The compiled speed-ups give exactly what the Python code gives.

store/_speedups.pyx and broker/_speedups.pyx replace four per-record hot
paths (codec.valid_header, codec.encode_raw, Store.append's per-record
encoder, checkcopy.patch_properties, checkcopy.check_push). They are
optional, so both versions must agree byte for byte on every input: the
comparisons below run them side by side over arbitrary inputs, and one test
writes the same log with and without them (TXMQ_PURE_PYTHON=1, in a
subprocess) and compares the files.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from txmq.broker.transactions import checkcopy
from txmq.constants import PROP_CHECK_TIMES, PROP_DISCARD_REASON, PROP_ORIGIN_CL_OFFSET, PROP_REPLAYED
from txmq.store import codec

native_store = pytest.mark.skipif(codec.speedups is None, reason="txmq.store._speedups not built on this machine")
native_broker = pytest.mark.skipif(checkcopy.speedups is None, reason="txmq.broker._speedups not built on this machine")

i64 = st.integers(-(1 << 63), (1 << 63) - 1)
SPECIAL = [PROP_CHECK_TIMES, PROP_DISCARD_REASON, PROP_ORIGIN_CL_OFFSET, PROP_REPLAYED, "TAGS"]
texts = st.text(max_size=40)
props_st = st.dictionaries(st.one_of(texts, st.sampled_from(SPECIAL)), texts, max_size=40)


def test_the_speedups_are_built_where_the_machine_can_build_them():
    """With a C compiler and zlib's header here (.ci/run installs them), a silent fallback would hide a broken build."""
    if os.environ.get("TXMQ_PURE_PYTHON"):
        pytest.skip("pure Python asked for")
    if not (shutil.which("cc") or shutil.which("gcc")) or not Path(sysconfig.get_paths()["include"], "Python.h").exists() \
            or not any(Path(d, "zlib.h").exists() for d in ("/usr/include", "/usr/local/include")):
        pytest.skip("no C compiler, Python headers or zlib.h on this machine: the pure-Python code runs")
    assert codec.speedups is not None and checkcopy.speedups is not None


# ---- the record codec ---------------------------------------------------------------
records = st.tuples(
    i64, st.integers(0, 3), st.binary(max_size=300), st.integers(-(1 << 31), (1 << 31) - 1), i64, i64, i64, i64,
    st.binary(max_size=300), st.binary(max_size=2000), st.integers(0, 40),
)


@native_store
@settings(max_examples=500, deadline=None)
@given(records)
def test_encode_raw_matches_python(r):
    pos, tx, tb, qid, q, born, ts, prep, pb, body, start = r
    start = min(start, len(body))
    assert codec.speedups.encode_raw(pos, tx, tb, qid, q, born, ts, prep, pb, body, start) == \
        codec.encode_raw_py(pos, tx, tb, qid, q, born, ts, prep, pb, body, start)


@native_store
@settings(max_examples=500, deadline=None)
@given(records, st.data())
def test_valid_header_matches_python_on_good_torn_and_damaged_records(r, data):
    pos, tx, tb, qid, q, born, ts, prep, pb, body, _ = r
    rec = codec.encode_raw_py(pos, tx, tb, qid, q, born, ts, prep, pb, body, 0)
    pad = data.draw(st.binary(max_size=8))
    buf = bytearray(pad + rec + data.draw(st.binary(max_size=8)))
    how = data.draw(st.sampled_from(["as is", "flip", "cut", "offset", "pos"]))
    at, expected = len(pad), pos
    if how == "flip":
        i = data.draw(st.integers(0, len(rec) - 1))
        buf[len(pad) + i] ^= 1 << data.draw(st.integers(0, 7))
    elif how == "cut":
        buf = buf[: len(pad) + data.draw(st.integers(0, len(rec) - 1))]
    elif how == "offset":
        expected = data.draw(i64)
    elif how == "pos":
        at = data.draw(st.integers(-10, len(buf) + 10))
    b = bytes(buf)
    want = codec.valid_header_py(b, at, expected, None)
    assert codec.speedups.valid_header(b, at, expected, None) == want
    assert codec.speedups.valid_header(memoryview(b), at, expected, memoryview(b)) == want
    if how == "as is":
        assert want is not None and want[0] == len(rec)


@native_store
@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.integers(-5, 200), i64)
def test_valid_header_never_raises_on_garbage(buf, pos, off):
    assert codec.speedups.valid_header(buf, pos, off, None) == codec.valid_header_py(buf, pos, off, None)


# ---- check copies and pushes -------------------------------------------------------
def _packed_variants(props: dict[str, str]) -> list[bytes]:
    """The map as msgpack packs it, and with a non-canonical (map16 / map32) header."""
    b = msgpack.packb(props)
    n = len(props)
    body = b[1:] if b[0] < 0x90 else b[3:] if b[0] == 0xDE else b[5:]
    return [b, b"\xde" + n.to_bytes(2, "big") + body, b"\xdf" + n.to_bytes(4, "big") + body]


@native_broker
@settings(max_examples=600, deadline=None)
@given(props_st, st.integers(0, 1 << 62), st.integers(0, 1 << 62), st.integers(-3, 200), st.integers(-3, 200), st.booleans())
def test_patch_properties_matches_python(props, cl, origin, now, new, as_copy):
    if as_copy:
        props = {**props, PROP_ORIGIN_CL_OFFSET: str(origin), PROP_CHECK_TIMES: str(now)}  # a check copy's tail
    for raw in _packed_variants(props):
        want = checkcopy.patch_properties_py(raw, cl, origin, now, new)
        assert checkcopy.speedups.patch_properties(raw, cl, origin, now, new) == want
        assert checkcopy.speedups.patch_properties(memoryview(raw), cl, origin, now, new) == want


@native_broker
@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=60), st.integers(0, 1 << 40), st.integers(0, 1 << 40), st.integers(0, 20), st.integers(0, 20))
def test_patch_properties_matches_python_on_garbage(raw, cl, origin, now, new):
    assert checkcopy.speedups.patch_properties(raw, cl, origin, now, new) == checkcopy.patch_properties_py(raw, cl, origin, now, new)


@native_broker
@pytest.mark.parametrize("big", [1 << 63, -(1 << 63) - 1, 10**20])
def test_patch_properties_outside_int64_takes_the_dict_path(big):
    """Never an OverflowError (it would fail the whole check pass): None, i.e. the dict path, which gives the same result."""
    raw = msgpack.packb({"a": "b"})
    for args in ((big, 1, 0, 1), (1, big, 1, 2), (1, 1, big, 2), (1, 1, 1, big)):
        assert checkcopy.speedups.patch_properties(raw, *args) is None


@native_broker
@settings(max_examples=400, deadline=None)
@given(st.text(max_size=40), st.text(max_size=300), i64, i64, i64, i64, i64, i64, st.binary(max_size=300),
       st.sampled_from([0, 1, 31, 32, 255, 256, 300, 65535, 65536, 70000]))
def test_check_push_matches_python(group, tx_id, cl, qoff, size, born, ts, prep, props, blen):
    gp = checkcopy.pack_group(group)
    body = memoryview(bytes(range(256)) * (blen // 256 + 1))[:blen]
    assert checkcopy.speedups.check_push(gp, tx_id, cl, qoff, size, born, ts, prep, props, body) == \
        checkcopy.check_push_py(gp, tx_id, cl, qoff, size, born, ts, prep, props, body)


# ---- a raw pull's gather: one compiled call per pull ---------------------------------
@pytest.fixture(scope="module")
def raw_log(tmp_path_factory):
    """A log of two topics, two queues each, records interleaved (sizes 68 bytes up to ~9 KB)."""
    from txmq.store import Message, Store, TxType

    with Store(tmp_path_factory.mktemp("rawlog")) as s:
        s.append([Message(f"t{i % 2}", (i // 2) % 2, TxType.NORMAL, i, {"K": "v" * (i % 7)} if i % 3 else {},
                          bytes([i % 256]) * ((i * 997) % 9000)) for i in range(400)])
        yield s


@native_store
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_read_queue_raw_matches_python(raw_log, data):
    """The compiled gather and its Python twin give the same records, or both decline, for any entries: the queue's
    own (any start, max_bytes, gap, span), another queue's, edited ones (size, offset), and a damaged byte."""
    from txmq.store.consumequeue import ENTRY

    store, log = raw_log, raw_log._log
    topic, qid = data.draw(st.sampled_from(["t0", "t1"])), data.draw(st.integers(0, 1))
    cq = store._queues[(topic, qid)]
    first = data.draw(st.integers(0, cq.next - 1))
    entries = bytearray(cq.read_raw(first, min(cq.next, first + data.draw(st.integers(1, 120)))))
    how = data.draw(st.sampled_from(["as is", "size", "offset", "garbage size", "other queue", "flip"]))
    k = data.draw(st.integers(0, len(entries) // 20 - 1))
    flipped = None
    if how == "size":
        ENTRY.pack_into(entries, 20 * k, ENTRY.unpack_from(entries, 20 * k)[0], data.draw(st.integers(0, 20000)), 0)
    elif how == "offset":
        ENTRY.pack_into(entries, 20 * k, data.draw(st.integers(-10, log.end + 10)), ENTRY.unpack_from(entries, 20 * k)[1], 0)
    elif how == "garbage size":
        ENTRY.pack_into(entries, 20 * k, ENTRY.unpack_from(entries, 20 * k)[0], data.draw(st.integers(1 << 31, (1 << 32) - 1)), 0)
    elif how == "other queue":
        qid ^= 1
    elif how == "flip":
        off, size, _ = ENTRY.unpack_from(entries, 20 * k)
        flipped = off + data.draw(st.integers(0, size - 1))
        seg = log._seg_at(flipped)
        b = os.pread(seg.fd, 1, flipped - seg.start)
        os.pwrite(seg.fd, bytes([b[0] ^ (1 << data.draw(st.integers(0, 7)))]), flipped - seg.start)
    max_bytes = data.draw(st.sampled_from([1, 100, 5000, 40000, 1 << 20]))
    max_record = data.draw(st.sampled_from([5000, 16 << 20]))
    gap, span = data.draw(st.sampled_from([0, 64, 8192, 1 << 20])), data.draw(st.sampled_from([68, 10000, 1 << 20]))
    segs = [(sg.start, sg.end, sg.fd) for sg in log._segs]
    try:
        got = codec.speedups.read_queue_raw(bytes(entries), max_bytes, max_record, segs, log.end, topic.encode(), qid, first,
                                            gap, span)
        want = log.read_queue_raw_py(bytes(entries), max_bytes, max_record, topic.encode(), qid, first, gap, span)
    finally:
        if flipped is not None:
            os.pwrite(seg.fd, b, flipped - seg.start)
    assert got == want
    if how == "as is" and max_record > 9000:
        assert got is not None and got[1] >= 1
        assert got[1] == 1 or len(got[0]) <= max_bytes  # bounded by max_bytes, at least one record
    if how == "flip" and got is not None:  # the damaged record was past what max_bytes let in
        assert got[1] <= k


# ---- the same log with and without them -------------------------------------------
_WRITE_LOG = textwrap.dedent("""
    import json, sys
    from txmq.store import Message, RawCopy, Store, TxType
    from txmq.store import codec
    d = sys.argv[1]
    with Store(d, clock=lambda: 1700000000.123) as s:
        r = s.append([Message("t", q % 3, TxType.PREPARED, 1000 + q, {"k": "v" * q, "TAGS": "a"} if q % 2 else {}, b"x" * (q * 37))
                      for q in range(40)])
        raws = s.read_many([x.commit_log_offset for x in r], raw=True)
        s.append([RawCopy(src, b"\\x81\\xa1a\\xa1b", None, head) for src, head in raws]
                 + [RawCopy(src, b"\\x80", "t2") for src, _ in raws[:5]])
        s.checkpoint()
    print(json.dumps({"native": codec.speedups is not None}))
""")


@native_store
def test_store_append_writes_the_same_bytes_with_and_without_speedups(tmp_path: Path):
    out = {}
    for mode in ("native", "pure"):
        env = dict(os.environ)
        env.pop("TXMQ_PURE_PYTHON", None)
        if mode == "pure":
            env["TXMQ_PURE_PYTHON"] = "1"
        d = tmp_path / mode
        res = subprocess.run([sys.executable, "-c", _WRITE_LOG, str(d)], env=env, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["native"] is (mode == "native")
        out[mode] = {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file() and p.name != "LOCK"
                     and not p.name.startswith("checkpoint")}
    assert out["native"].keys() == out["pure"].keys()
    assert any(k.startswith("commitlog") for k in out["native"]), out["native"].keys()
    for k in out["native"]:
        assert out["native"][k] == out["pure"][k], k
