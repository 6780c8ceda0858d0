"""The check service's hot path at the byte level: check-copy properties and check-back pushes.

One check pass re-appends every pending transaction's half message with its
check count + 1 and pushes a ``check_transaction`` for the copy
(docs/transactions.md); with a million pending transactions that is a million of each. Decoding
the properties into a dict, editing it, packing it for the record and again
for the push cost more than everything else a check does, so the common case
works on the packed bytes instead:

- ``patch_properties`` turns a half record's packed properties into its
  check copy's (what ``service.half_copy`` does to the dict) by editing the
  msgpack map: on a first copy append the origin offset and the count; on a
  check copy (which ends with exactly those two entries) replace the count,
  the last entry. Anything else (a discard reason, a replay mark, TAGS, a
  count or origin elsewhere) returns None and the caller takes the dict
  path, so the result is always what the dict path gives.
- ``check_push`` builds the push frame by concatenation, with the record's
  packed properties spliced in as they are. The frame decodes to the same
  fields as ``wire.push("check_transaction", ...)`` with ``record_to_map``.

tests/test_checkcopy.py holds both to their dict-path equivalents.
"""

from __future__ import annotations

import struct

import msgpack

from txmq import wire
from txmq.constants import (
    HALF_TOPIC,
    PROP_CHECK_TIMES,
    PROP_DISCARD_REASON,
    PROP_ORIGIN_CL_OFFSET,
    PROP_REPLAYED,
)
from txmq.store.codec import TAGS_PROPERTY, TxType, optional_speedups

_pack = msgpack.Packer(use_bin_type=True).pack
_pack_map_header = msgpack.Packer(use_bin_type=True).pack_map_header

_K_CHECK = _pack(PROP_CHECK_TIMES)
_K_ORIGIN = _pack(PROP_ORIGIN_CL_OFFSET)
_K_TAGS = _pack(TAGS_PROPERTY)  # its value goes into the consume-queue entry: the dict path finds it
# What a first copy must not find (a copy drops the first two and writes the others itself).
_FIRST_COPY_SLOW = tuple(_pack(k) for k in (PROP_DISCARD_REASON, PROP_REPLAYED, PROP_CHECK_TIMES, PROP_ORIGIN_CL_OFFSET))
_CHECK_ENTRIES = [_K_CHECK + _pack(str(i)) for i in range(64)]


def _check_entry(n: int) -> bytes:
    return _CHECK_ENTRIES[n] if 0 <= n < 64 else _K_CHECK + _pack(str(n))


def _map_header(b: bytes) -> tuple[int, int] | None:
    """(entries, header length) of the packed map b, or None if b is no map."""
    lead = b[0] if b else -1
    if 0x80 <= lead <= 0x8F:
        return lead & 0x0F, 1
    if lead == 0xDE and len(b) >= 3:
        return int.from_bytes(b[1:3], "big"), 3
    if lead == 0xDF and len(b) >= 5:
        return int.from_bytes(b[1:5], "big"), 5
    return None


def patch_properties(raw, cl_offset: int, origin: int, checks_now: int, checks_new: int) -> bytes | None:
    """The packed properties of the check copy of a half record, or None for the dict path.

    raw: the record's packed properties; cl_offset: its commit-log offset;
    origin: the transaction's first half record (PendingTx.origin_cl_offset);
    checks_now: its TRANSACTION_CHECK_TIMES (0 when absent).
    """
    b = bytes(raw)
    if b.find(_K_TAGS) >= 0:  # not `in`: bytes.__contains__ tries the key as an int first and pays for a TypeError
        return None
    entries = _CHECK_ENTRIES
    if checks_now > 0:
        # A check copy ends with the origin and then the count (both paths put
        # them there) and holds no discard reason (both paths drop it). A
        # replay mark, which copies keep, stays where it is on both paths
        # (usually last, which sends the copy to the dict path). Property
        # values are valid UTF-8: this suffix cannot be the end of a value.
        # The map keeps its size, so its header stays as it is when canonical
        # (what both paths write; a one-byte fixmap in the common case).
        # Inlined list lookups instead of _check_entry: this runs per check-back.
        now = entries[checks_now] if checks_now < 64 else _check_entry(checks_now)
        cut = len(b) - len(now)
        if b.endswith(now) and b.endswith(_K_ORIGIN + _pack(str(origin)), 0, cut):
            new = entries[checks_new] if 0 <= checks_new < 64 else _check_entry(checks_new)
            if 0x80 <= b[0] <= 0x8F:
                return b[:cut] + new
            head = _map_header(b)
            return None if head is None else _pack_map_header(head[0]) + b[head[1]:cut] + new
    head = _map_header(b)
    if head is None:
        return None
    n, start = head
    for k in _FIRST_COPY_SLOW:
        if b.find(k) >= 0:
            return None
    return _pack_map_header(n + 2) + b[start:] + _K_ORIGIN + _pack(str(cl_offset)) + _check_entry(checks_new)


# ---- the push frame ---------------------------------------------------------
# [PUSH, 0, "check_transaction", {group, tx_id, commit_log_offset, half_offset,
#  message: {queue_offset, commit_log_offset, size, born_ts, store_ts,
#  prepared_offset, topic, queue_id, tx_type, msg_id, properties, body}}]
# Integers are written as int64 (0xd3), which every msgpack decoder reads as
# the same int as the shortest form; map order carries no meaning.
_PREFIX = (
    b"\x94" + _pack(wire.PUSH) + _pack(0) + _pack("check_transaction")  # fixarray of 4: kind, id, op, fields
    + _pack_map_header(5) + _pack("group")
)
_K_TX_ID = _pack("tx_id")
_INT_KEYS = ("commit_log_offset", "half_offset", "message", "queue_offset", "commit_log_offset", "size", "born_ts", "store_ts",
             "prepared_offset")
_INTS = struct.Struct(
    ">" + "".join(f"{len(_pack(k))}sBq" if k != "message" else f"{len(_pack(k))}sB" for k in _INT_KEYS)
)
_KEY_BYTES = [_pack(k) for k in _INT_KEYS]
_CONST_TAIL = (
    _pack("topic") + _pack(HALF_TOPIC) + _pack("queue_id") + _pack(0) + _pack("tx_type") + _pack(int(TxType.PREPARED))
    + _pack("msg_id")
)
_K_PROPS = _pack("properties")
_K_BODY = _pack("body")
_I64 = 0xD3
_MSG_MAP12 = 0x8C


def _bin_header(n: int) -> bytes:
    if n < 0x100:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 0x10000:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


def check_push(group_packed: bytes, tx_id: str, cl: int, qoff: int, size: int, born: int, store_ts: int, prep: int,
               props_raw: bytes, body) -> bytes:
    """The whole ``check_transaction`` push frame (length prefix included) for one check copy.

    group_packed is the group name as msgpack (``pack_group``): the check
    service packs it once per batch.
    """
    k = _KEY_BYTES
    tx = _pack(tx_id)
    blen = len(body)
    bh = b"\xc5" + blen.to_bytes(2, "big") if 0x100 <= blen < 0x10000 else _bin_header(blen)
    n = _FIXED + len(group_packed) + 2 * len(tx) + len(props_raw) + len(bh) + blen
    return b"".join((
        wire.HEADER.pack(n), _PREFIX, group_packed, _K_TX_ID, tx,
        _INTS.pack(k[0], _I64, cl, k[1], _I64, qoff, k[2], _MSG_MAP12, k[3], _I64, qoff, k[4], _I64, cl,
                   k[5], _I64, size, k[6], _I64, born, k[7], _I64, store_ts, k[8], _I64, prep),
        _CONST_TAIL, tx, _K_PROPS, props_raw, _K_BODY, bh, body,
    ))


pack_group = _pack
# Bytes of every frame whatever its fields: prefix, keys, the packed integers.
_FIXED = len(_PREFIX) + len(_K_TX_ID) + _INTS.size + len(_CONST_TAIL) + len(_K_PROPS) + len(_K_BODY)


# ---- compiled speed-ups ---------------------------------------------------------------
# broker/_speedups.pyx (txmq.broker._speedups) holds compiled versions of patch_properties and
# check_push; they take every byte constant from here and give the same
# bytes (tests/test_speedups.py).
patch_properties_py, check_push_py = patch_properties, check_push
speedups = optional_speedups("txmq.broker._speedups", _K_TAGS, _K_CHECK, _K_ORIGIN, _FIRST_COPY_SLOW, _PREFIX, _K_TX_ID,
                             _KEY_BYTES, _INT_KEYS.index("message"), _CONST_TAIL, _K_PROPS, _K_BODY)
if speedups is not None:
    patch_properties = speedups.patch_properties  # noqa: F811
    check_push = speedups.check_push  # noqa: F811
