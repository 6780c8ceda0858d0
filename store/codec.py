"""Commit-log record codec: bytes <-> Record, no I/O.

A record is a 68-byte header followed by the topic, the properties and the
body. All integers are little-endian (docs/store-format.md, "Record")::

    offset size field
    0      4    total_size        u32, whole record, header included
    4      4    magic             u32, 0x314D5854 (bytes "TXM1")
    8      4    crc32             u32, zlib CRC-32 of bytes [12, total_size)
    12     8    commit_log_offset i64, the record's own offset
    20     1    tx_type           u8, TxType
    21     1    flags             u8, reserved, 0
    22     2    topic_len         u16
    24     4    queue_id          i32
    28     8    queue_offset      i64
    36     8    born_ts           i64, ms, set by the producer
    44     8    store_ts          i64, ms, set by the store
    52     8    prepared_offset   i64, half message resolved, else -1
    60     4    props_len         u32
    64     4    body_len          u32
    68     ..   topic             UTF-8
    ..     ..   properties        msgpack map str -> str (0x80 when empty)
    ..     ..   body

Invalid records are reported, not raised: ``decode_record`` returns None and
``record_problem`` / ``check_record`` say why, as a short text naming the
offset, e.g. ``"crc mismatch at 12345"`` or ``"torn record: 40 of 333 bytes
at 12345"``. Nothing here raises on arbitrary input bytes.
"""

from __future__ import annotations

import importlib
import os
import struct
import warnings
import zlib
from dataclasses import dataclass
from enum import IntEnum

import msgpack

MAGIC = 0x314D5854
HEADER_SIZE = 68
TAGS_PROPERTY = "TAGS"
EMPTY_PROPS = b"\x80"  # msgpack of {}

HEADER = struct.Struct(
    "<"
    "I"  # 0  total_size
    "I"  # 4  magic
    "I"  # 8  crc32 of [12, total_size)
    "q"  # 12 commit_log_offset
    "B"  # 20 tx_type
    "B"  # 21 flags
    "H"  # 22 topic_len
    "i"  # 24 queue_id
    "q"  # 28 queue_offset
    "q"  # 36 born_ts
    "q"  # 44 store_ts
    "q"  # 52 prepared_offset
    "I"  # 60 props_len
    "I"  # 64 body_len
)
# Positions of the fields in a tuple HEADER.unpack_from returns (a record's "header"):
H_SIZE, H_MAGIC, H_CRC, H_OFFSET, H_TX_TYPE, H_FLAGS, H_TOPIC_LEN, H_QUEUE_ID, H_QUEUE_OFFSET, H_BORN_TS, \
    H_STORE_TS, H_PREPARED_OFFSET, H_PROPS_LEN, H_BODY_LEN = range(14)
# The same header in the two pieces the encoder packs: the CRC-covered part
# [12, 68) is packed first, then [0, 12) once its CRC is known.
_HEAD = struct.Struct("<III")  # total_size, magic, crc32
_TAIL = struct.Struct("<qBBHiqqqqII")  # commit_log_offset .. body_len
_SIZE_MAGIC = struct.Struct("<II")
_CRC = struct.Struct("<I")
assert HEADER.size == HEADER_SIZE and _HEAD.size + _TAIL.size == HEADER_SIZE

_HEADER_UNPACK = HEADER.unpack_from
_crc32 = zlib.crc32
_packb = msgpack.packb
_unpackb = msgpack.unpackb


class TxType(IntEnum):
    NORMAL = 0
    PREPARED = 1  # half message
    COMMIT = 2
    ROLLBACK = 3


_TX_TYPES = tuple(TxType)
_N_TX = len(_TX_TYPES)


@dataclass(slots=True)  # not frozen: a frozen init costs 5x, on the hot path (treat as read-only)
class Message:
    """What the broker asks the store to append."""

    topic: str
    queue_id: int
    tx_type: TxType
    born_ts: int  # ms since the epoch
    properties: dict[str, str]
    body: bytes
    prepared_offset: int = -1


@dataclass(slots=True)  # not frozen: a frozen init costs 5x, on the hot path (treat as read-only)
class Record:
    """A decoded commit-log record."""

    commit_log_offset: int
    size: int
    topic: str
    queue_id: int
    queue_offset: int
    tx_type: TxType
    born_ts: int
    store_ts: int
    prepared_offset: int
    properties: dict[str, str]
    body: bytes

    @property
    def end_offset(self) -> int:
        return self.commit_log_offset + self.size

    @property
    def tags(self) -> str | None:
        return self.properties.get(TAGS_PROPERTY)


@dataclass(slots=True)
class RawCopy:
    """For Store.append: a copy of a stored record with new properties.

    ``source`` is the record's bytes as ``read_many(..., raw=True)`` gives
    them (already validated). The copy keeps the source's topic, queue id,
    tx type, born_ts, prepared_offset and body, takes ``props`` (packed
    msgpack) as its properties, and gets its own offsets and store time.
    ``tags`` is the TAGS property of ``props``, for the consume-queue entry.
    ``header`` is the source's unpacked header (``HEADER`` fields) when the
    caller has it, as ``read_many(..., raw=True)`` gives it: the append then
    does not unpack it again. It spares a copy the decode and re-encode of a
    Message (the check service appends one per pending transaction per pass).
    """

    source: memoryview
    props: bytes
    tags: str | None = None
    header: tuple | None = None


def split_raw(raw) -> tuple[memoryview, memoryview, int, int]:
    """(packed properties, body, born_ts, prepared_offset) of a validated raw record."""
    _, _, _, _, _, _, tlen, _, _, born, _, prep, plen, _ = _HEADER_UNPACK(raw)
    p = HEADER_SIZE + tlen
    mv = raw if type(raw) is memoryview else memoryview(raw)
    return mv[p : p + plen], mv[p + plen :], born, prep


def tag_hash(tags: str | None) -> int:
    """Deterministic hash of a TAGS property: CRC-32 of its UTF-8, 0 for None or ''."""
    return _crc32(tags.encode()) if tags else 0


def pack_properties(props: dict[str, str]) -> bytes:
    return _packb(props) if props else EMPTY_PROPS


def encode_parts(
    commit_log_offset: int,
    topic: bytes,
    queue_id: int,
    queue_offset: int,
    tx_type: int,
    born_ts: int,
    store_ts: int,
    prepared_offset: int,
    props: bytes,
    body: bytes,
) -> tuple[bytes, bytes]:
    """The record's header as (bytes [0, 12), bytes [12, 68)); topic, props, body follow."""
    tail = _TAIL.pack(
        commit_log_offset, tx_type, 0, len(topic), queue_id, queue_offset,
        born_ts, store_ts, prepared_offset, len(props), len(body),
    )  # fmt: skip
    crc = _crc32(body, _crc32(props, _crc32(topic, _crc32(tail))))
    return _HEAD.pack(HEADER_SIZE + len(topic) + len(props) + len(body), MAGIC, crc), tail


def encode_raw(pos: int, tx_type: int, topic: bytes, queue_id: int, queue_offset: int, born_ts: int, store_ts: int,
               prepared_offset: int, props: bytes, body, body_start: int) -> bytes:
    """One whole record from its fields, the body being ``body[body_start:]``: Store.append's per-record encoder.

    Replaced by the compiled version when there is one (end of this module).
    """
    b = memoryview(body)[body_start:] if body_start else body
    head, tail = encode_parts(pos, topic, queue_id, queue_offset, tx_type, born_ts, store_ts, prepared_offset, props, b)
    return b"".join((head, tail, topic, props, b))


def encode_record(msg: Message, commit_log_offset: int, queue_offset: int, store_ts: int) -> bytes:
    """One record's bytes (the store batches records itself; this is for tests and tools)."""
    topic = msg.topic.encode()
    props = pack_properties(msg.properties)
    head, tail = encode_parts(
        commit_log_offset, topic, msg.queue_id, queue_offset, msg.tx_type,
        msg.born_ts, store_ts, msg.prepared_offset, props, msg.body,
    )  # fmt: skip
    return b"".join((head, tail, topic, props, msg.body))


def _check_fields(buf, pos: int, expected_offset: int, total: int) -> int | str:
    _, _, _, off, tx, _, tlen, _, _, _, _, _, plen, blen = HEADER.unpack_from(buf, pos)
    if HEADER_SIZE + tlen + plen + blen != total:
        return f"bad lengths at {expected_offset}"
    if off != expected_offset:
        return f"offset mismatch at {expected_offset}: record says {off}"
    if tx >= len(_TX_TYPES):
        return f"bad tx_type {tx} at {expected_offset}"
    return total


def _check_start(buf, pos: int, expected_offset: int, need: int) -> int | str:
    avail = len(buf) - pos
    if avail < 8:
        return f"torn header: {max(avail, 0)} of {HEADER_SIZE} bytes at {expected_offset}"
    total, magic = _SIZE_MAGIC.unpack_from(buf, pos)
    if magic != MAGIC:
        return f"bad magic at {expected_offset}"
    if total < HEADER_SIZE:
        return f"bad size {total} at {expected_offset}"
    if avail < min(need, total) or avail < HEADER_SIZE:
        return f"torn record: {avail} of {total} bytes at {expected_offset}"
    return total


def check_header(buf, pos: int, expected_offset: int) -> int | str:
    """Check what the 68-byte header alone can tell (magic, lengths, own offset, tx_type).

    Returns the record's total size, or why it is invalid. A reader uses it to
    reject garbage before reading a body whose size field may be nonsense.
    """
    total = _check_start(buf, pos, expected_offset, HEADER_SIZE)
    if type(total) is str:
        return total
    return _check_fields(buf, pos, expected_offset, total)


def check_record(buf, pos: int, expected_offset: int, mv: memoryview | None = None) -> int | str:
    """Validate the record at buf[pos:] without decoding it: its size, or why it is invalid.

    The CRC is checked before the header fields, so damage anywhere inside a
    complete record reads as "crc mismatch".
    """
    h = valid_header(buf, pos, expected_offset, mv)
    return h[H_SIZE] if h is not None else _check_record_slow(buf, pos, expected_offset, mv)


def valid_header(buf, pos: int, expected_offset: int, mv: memoryview | None) -> tuple | None:
    """The unpacked header if buf[pos:] holds a valid record (CRC included), else None.

    The common case in one header unpack; ``check_record`` names the
    problem when there is one. Readers that go on to use the header's fields
    (``read_many(..., raw=True)`` for RawCopy) keep the tuple. Replaced by
    the compiled version when there is one (end of this module).
    """
    try:
        h = _HEADER_UNPACK(buf, pos)
    except struct.error:
        return None
    total, magic, crc, off, tx, _, tlen, _, _, _, _, _, plen, blen = h
    if (magic != MAGIC or off != expected_offset or tx >= _N_TX or total != HEADER_SIZE + tlen + plen + blen
            or len(buf) - pos < total or pos < 0):
        return None
    if mv is None:
        mv = memoryview(buf)
    return h if _crc32(mv[pos + 12 : pos + total]) == crc else None


def _check_record_slow(buf, pos: int, expected_offset: int, mv: memoryview | None) -> int | str:
    total = _check_start(buf, pos, expected_offset, 1 << 62)
    if type(total) is str:
        return total
    if mv is None:
        mv = memoryview(buf)
    if _crc32(mv[pos + 12 : pos + total]) != _CRC.unpack_from(buf, pos + 8)[0]:
        return f"crc mismatch at {expected_offset}"
    return _check_fields(buf, pos, expected_offset, total)


def decode(buf, pos: int, expected_offset: int, mv: memoryview | None = None) -> Record | str:
    """The record at buf[pos:], or the reason it is invalid (a str).

    The common case (a valid record) unpacks the header once; anything that
    looks wrong goes through ``_check_record_slow``, which names the problem.
    """
    h = valid_header(buf, pos, expected_offset, mv)
    if h is None:
        why = _check_record_slow(buf, pos, expected_offset, mv)
        return why if type(why) is str else f"invalid record at {expected_offset}"
    total, _, _, off, tx, _, tlen, qid, qoff, born, store, prep, plen, blen = h
    if mv is None:
        mv = memoryview(buf)
    p = pos + HEADER_SIZE
    try:
        topic = str(buf[p : p + tlen], "utf-8")
    except UnicodeDecodeError:
        return f"bad topic at {expected_offset}"
    p += tlen
    if plen == 1 and buf[p] == 0x80:
        props = {}
    else:
        try:
            props = _unpackb(mv[p : p + plen], raw=False)
        except Exception:  # msgpack raises several unrelated types on bad input
            props = None
        if type(props) is not dict:
            return f"bad properties at {expected_offset}"
    p += plen
    return Record(off, total, topic, qid, qoff, _TX_TYPES[tx], born, store, prep, props, bytes(buf[p : p + blen]))


def decode_record(buf, pos: int, expected_offset: int) -> Record | None:
    """The record at buf[pos:] if it is valid, else None (``record_problem`` says why)."""
    rec = decode(buf, pos, expected_offset)
    return None if type(rec) is str else rec


def record_problem(buf, pos: int, expected_offset: int) -> str | None:
    """Why the record at buf[pos:] is invalid, or None when it is valid."""
    rec = decode(buf, pos, expected_offset)
    return rec if type(rec) is str else None


# ---- compiled speed-ups ---------------------------------------------------------------
def optional_speedups(name: str, *config):
    """The compiled module ``name`` configured with ``config`` (README "Compiled speed-ups"), or None.

    None when it was not built on this machine (setup.py builds it when it
    can), when TXMQ_PURE_PYTHON is set, or when it does not load or accept
    its configuration (a stale build from older sources): the caller's
    Python versions of the same functions then serve, giving the same
    results.
    """
    if os.environ.get("TXMQ_PURE_PYTHON"):
        return None
    try:
        mod = importlib.import_module(name)
    except ImportError:
        return None
    try:
        mod.configure(*config)
    except Exception as exc:
        warnings.warn(f"{name} is out of date ({exc!r}); using the Python code. Rebuild: pip install -e .", RuntimeWarning,
                      stacklevel=2)
        return None
    return mod


# store/_speedups.pyx holds compiled versions of valid_header and encode_raw
# (tests/test_speedups.py holds them equal to these).
valid_header_py, encode_raw_py = valid_header, encode_raw
speedups = optional_speedups(__package__ + "._speedups", _N_TX)
if speedups is not None:
    valid_header = speedups.valid_header  # noqa: F811
    encode_raw = speedups.encode_raw  # noqa: F811
