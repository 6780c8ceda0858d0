"""Codec tests: bytes <-> Record, no I/O."""

from __future__ import annotations

import zlib

from hypothesis import given, settings
from hypothesis import strategies as st

from txmq.store import HEADER_SIZE, Message, TxType, decode_record, encode_record, record_problem, tag_hash
from txmq.store.checkpoint import Checkpoint, decode_checkpoint, encode_checkpoint
from txmq.store.codec import check_header, check_record

texts = st.text(max_size=20)
messages = st.builds(
    Message,
    topic=st.text(min_size=1, max_size=40),
    queue_id=st.integers(0, 2**31 - 1),
    tx_type=st.sampled_from(TxType),
    born_ts=st.integers(-(2**63), 2**63 - 1),
    properties=st.dictionaries(texts, texts, max_size=5),
    body=st.binary(max_size=300),
    prepared_offset=st.integers(-1, 2**62),
)


@given(messages, st.integers(0, 2**62), st.integers(0, 2**62), st.integers(0, 2**62), st.binary(max_size=8))
def test_encode_decode_round_trip(msg, offset, queue_offset, store_ts, prefix):
    raw = encode_record(msg, offset, queue_offset, store_ts)
    rec = decode_record(prefix + raw + b"trailing", len(prefix), offset)
    assert rec is not None
    assert (rec.topic, rec.queue_id, rec.tx_type, rec.born_ts) == (msg.topic, msg.queue_id, msg.tx_type, msg.born_ts)
    assert (rec.properties, rec.body, rec.prepared_offset) == (msg.properties, msg.body, msg.prepared_offset)
    assert (rec.commit_log_offset, rec.queue_offset, rec.store_ts) == (offset, queue_offset, store_ts)
    assert rec.size == len(raw) == rec.end_offset - offset
    assert isinstance(rec.tx_type, TxType)


@settings(max_examples=300)
@given(st.binary(max_size=400), st.integers(0, 400), st.integers(-5, 1000))
def test_decode_never_raises_on_random_bytes(data, pos, expected):
    assert decode_record(data, pos, expected) is None or pos < len(data)
    record_problem(data, pos, expected)
    check_header(data, pos, expected)


@given(messages, st.data())
def test_any_single_byte_damage_is_detected(msg, data):
    raw = bytearray(encode_record(msg, 1000, 0, 1))
    i = data.draw(st.integers(0, len(raw) - 1))
    raw[i] ^= data.draw(st.integers(1, 255))
    assert decode_record(bytes(raw), 0, 1000) is None


def test_doc_example_is_333_bytes():
    msg = Message("T", 0, TxType.NORMAL, 1, {"TAGS": "a"}, b"x" * 256)
    raw = encode_record(msg, 0, 0, 2)
    assert len(raw) == 333
    assert raw[4:8] == b"TXM1"
    assert raw[HEADER_SIZE + 1 : HEADER_SIZE + 9] == bytes.fromhex("81a454414753a161")
    assert int.from_bytes(raw[8:12], "little") == zlib.crc32(raw[12:])


def test_truncated_record_reports_how_much_is_there():
    raw = encode_record(Message("T", 0, TxType.NORMAL, 1, {"TAGS": "a"}, b"x" * 256), 12345, 0, 2)
    assert record_problem(raw[:40], 0, 12345) == "torn record: 40 of 333 bytes at 12345"
    assert record_problem(raw[:5], 0, 12345) == "torn header: 5 of 68 bytes at 12345"
    assert record_problem(raw, 0, 12345) is None
    assert check_record(raw, 0, 12345) == 333


def test_damage_inside_a_record_reads_as_crc_mismatch():
    raw = bytearray(encode_record(Message("T", 0, TxType.NORMAL, 1, {}, b"body"), 7, 0, 2))
    raw[-1] ^= 0xFF
    assert record_problem(bytes(raw), 0, 7) == "crc mismatch at 7"
    raw[-1] ^= 0xFF
    raw[12] ^= 1  # the own-offset field is CRC-covered too
    assert record_problem(bytes(raw), 0, 7) == "crc mismatch at 7"


def test_record_read_at_the_wrong_offset_is_rejected():
    raw = encode_record(Message("T", 0, TxType.NORMAL, 1, {}, b"body"), 7, 0, 2)
    assert record_problem(raw, 0, 8) == "offset mismatch at 8: record says 7"


def test_bad_magic():
    raw = bytearray(encode_record(Message("T", 0, TxType.NORMAL, 1, {}, b"body"), 0, 0, 2))
    raw[4] = 0
    assert record_problem(bytes(raw), 0, 0) == "bad magic at 0"


def test_tag_hash_is_deterministic():
    assert tag_hash(None) == 0 and tag_hash("") == 0
    assert tag_hash("a") == zlib.crc32(b"a") == tag_hash("a")
    assert tag_hash("a") != tag_hash("b")


def test_checkpoint_codec():
    ckpt = Checkpoint(123, 45)
    data = encode_checkpoint(ckpt)
    assert len(data) == 20 and decode_checkpoint(data) == ckpt
    assert decode_checkpoint(data[:-1]) is None
    assert decode_checkpoint(b"\x01" + data[1:]) is None
