"""The check service's byte-level fast path gives exactly what the dict path gives.

broker/transactions/checkcopy.py edits packed properties and builds push frames by
concatenation; these tests hold it to service.half_copy (the dict path) and to
wire.push(..., record_to_map(record)) over arbitrary property maps and
chains of check copies.
"""

from __future__ import annotations

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from txmq import wire
from txmq.broker.transactions.checkcopy import check_push, pack_group, patch_properties
from txmq.broker.records import record_to_map
from txmq.broker.transactions.service import half_copy
from txmq.broker.transactions.index import _int
from txmq.constants import (
    HALF_TOPIC,
    PROP_CHECK_TIMES,
    PROP_DISCARD_REASON,
    PROP_ORIGIN_CL_OFFSET,
    PROP_REPLAYED,
    PROP_UNIQ_KEY,
)
from txmq.store import Record, TxType, encode_record, split_raw
from txmq.store.codec import decode

SPECIAL = [PROP_CHECK_TIMES, PROP_DISCARD_REASON, PROP_ORIGIN_CL_OFFSET, PROP_REPLAYED, "TAGS"]
texts = st.text(max_size=40)
props_st = st.dictionaries(st.one_of(texts, st.sampled_from(SPECIAL)), texts, max_size=20)


def record(props: dict[str, str], cl: int, body: bytes = b"body") -> Record:
    return Record(cl, 0, HALF_TOPIC, 0, 7, TxType.PREPARED, 1234, 5678, -1, props, body)


def index_view(props: dict[str, str], cl: int) -> tuple[int, int]:
    """(checks, origin) as the transaction index reads them (PendingTx)."""
    return _int(props.get(PROP_CHECK_TIMES), 0), _int(props.get(PROP_ORIGIN_CL_OFFSET), cl)


@settings(max_examples=400, deadline=None)
@given(props_st, st.integers(0, 1 << 40), st.integers(1, 40))
def test_patch_matches_the_dict_path_over_a_chain_of_copies(props, cl, rounds):
    rec = record(props, cl)
    raw = msgpack.packb(props)
    for i in range(rounds):
        now, origin = index_view(rec.properties, cl)
        want = half_copy(rec, **{PROP_CHECK_TIMES: str(now + 1)}).properties
        got = patch_properties(raw, rec.commit_log_offset, origin, now, now + 1)
        if got is None:
            raw = msgpack.packb(want)  # the dict path
        else:
            assert msgpack.unpackb(got) == want
            raw = got
        rec = record(msgpack.unpackb(raw), cl + 1000 * (i + 1))


def test_the_common_copies_take_the_fast_path():
    props = {"PGROUP": "g", PROP_UNIQ_KEY: "AB" * 16, "TRAN_MSG": "true", "REAL_TOPIC": "t", "REAL_QID": "1"}
    first = patch_properties(msgpack.packb(props), 500, 500, 0, 1)
    assert first is not None
    assert msgpack.unpackb(first) == {**props, PROP_ORIGIN_CL_OFFSET: "500", PROP_CHECK_TIMES: "1"}
    second = patch_properties(first, 900, 500, 1, 2)
    assert second is not None and msgpack.unpackb(second)[PROP_CHECK_TIMES] == "2"
    # 15 entries and more: the map header grows from fixmap to map16
    big = {f"k{i}": "v" for i in range(14)}
    out = patch_properties(msgpack.packb(big), 1, 1, 0, 1)
    assert out is not None and out[0] == 0xDE and msgpack.unpackb(out) == {**big, PROP_ORIGIN_CL_OFFSET: "1", PROP_CHECK_TIMES: "1"}


def test_what_the_fast_path_declines():
    base = {"PGROUP": "g"}
    for extra in ({"TAGS": "a"}, {PROP_REPLAYED: "1"}, {PROP_DISCARD_REASON: "max-checks"}, {PROP_CHECK_TIMES: "3"}):
        assert patch_properties(msgpack.packb({**base, **extra}), 1, 1, 0, 1) is None, extra
    # a count the index does not hold, or not at the end
    moved = msgpack.packb({PROP_CHECK_TIMES: "1", PROP_ORIGIN_CL_OFFSET: "1", "PGROUP": "g"})
    assert patch_properties(moved, 1, 1, 1, 2) is None
    assert patch_properties(b"\x90", 1, 1, 0, 1) is None  # not a map
    assert patch_properties(b"", 1, 1, 0, 1) is None


@settings(max_examples=200, deadline=None)
@given(props_st, st.binary(max_size=70_000), st.integers(0, 1 << 50), st.integers(0, 1 << 40), st.sampled_from([-1, 0, 1 << 33]))
def test_check_push_decodes_like_the_dict_push(props, body, cl, qoff, prep):
    props = {**props, PROP_UNIQ_KEY: "TX" + str(cl)}
    raw = encode_record_at(props, body, cl, qoff, prep)
    rec = decode(raw, 0, cl)
    assert not isinstance(rec, str)
    props_raw, body_mv, born, prep2 = split_raw(memoryview(raw))
    frame = check_push(pack_group("grp"), rec.properties[PROP_UNIQ_KEY], cl, qoff, rec.size, born, rec.store_ts, prep2, bytes(props_raw), body_mv)
    want = wire.push("check_transaction", {
        "group": "grp", "tx_id": rec.properties[PROP_UNIQ_KEY], "commit_log_offset": cl, "half_offset": qoff,
        "message": record_to_map(rec),
    })
    got_frame = wire.parse_payload(frame[4:])
    want_frame = wire.parse_payload(want[4:])
    assert wire.HEADER.unpack(frame[:4])[0] == len(frame) - 4
    assert (got_frame.kind, got_frame.id, got_frame.op) == (want_frame.kind, want_frame.id, want_frame.op)
    assert got_frame.fields == want_frame.fields


def encode_record_at(props: dict[str, str], body: bytes, cl: int, qoff: int, prep: int) -> bytes:
    from txmq.store import Message

    return encode_record(Message(HALF_TOPIC, 0, TxType.PREPARED, 1700000000000, props, body, prep), cl, qoff, 1700000000123)


def test_two_checks_of_one_transaction_in_flight_keep_the_index_equal_to_the_log(tmp_path):
    """An operator's check_now and a pass batch both reading the same half: the
    index's check count is always the one written in its latest copy."""
    import asyncio

    from conftest import arun

    from txmq.broker.clock import ManualClock
    from txmq.broker.testing import running_broker

    class Dropping:
        conn_id = -1

        takes_frames = True

        def writable(self) -> bool:
            return True

        def push(self, op, fields) -> None:
            pass

        def send_frame(self, frame) -> None:
            pass

    async def go():
        clock = ManualClock()
        async with running_broker(tmp_path / "data", clock=clock, check_interval_s=3600) as b:
            core = b.core
            await core.tx.send_half("t", None, b"x", {"PGROUP": "g"}, int(clock() * 1000))
            (p,) = core.tx.index.pending.values()
            conn = Dropping()
            now = int(clock() * 1000)
            await asyncio.gather(core.check._check([(p, conn)], now), core.check._check([(p, conn)], now))
            rec = core.store.read(p.cl_offset)
            assert p.checks == int(rec.properties[PROP_CHECK_TIMES]) == 1

    arun(go())


# ---- producer-set numbers that are no int64 ------------------------------------------
import pytest  # noqa: E402

from conftest import arun  # noqa: E402
from txhelpers import G, half_fields  # noqa: E402
from txmq.broker.clock import ManualClock  # noqa: E402
from txmq.broker.testing import running_broker  # noqa: E402
from wireclient import RawClient  # noqa: E402


@pytest.mark.parametrize("props", [{PROP_ORIGIN_CL_OFFSET: "1" + "0" * 20}, {PROP_CHECK_TIMES: "-1" + "0" * 20}])
def test_a_huge_number_in_a_half_message_does_not_stop_the_check_pass(tmp_path, props):
    """A producer may write any string in these properties; the pass checks that transaction and the next one."""
    clock = ManualClock()

    async def go():
        async with running_broker(tmp_path / "data", clock=clock, check_interval_s=3600) as b:
            c = await RawClient.open(b.address)
            await c.ok("hello", {"producer_groups": [G]})
            await c.ok("send", half_fields(**props))
            await c.ok("send", half_fields(body=b"innocent"))
            clock.advance(100)
            r = await b.core.check.run_pass()
            await c.close()
            return r

    r = arun(go())
    assert r["checked"] == 2 and r["unreadable"] == 0, r
