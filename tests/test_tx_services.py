"""The transaction services on their own: a real Store in a temporary directory, a clock the test moves, no sockets.

The services are built by tests/txservices.py as BrokerCore.open builds
them. The races are set up within one turn of the event loop, where the
broker meets them: a request arriving between a write being submitted to
the Appender and the Appender writing it (the next turn). Every answer a
test expects is docs/transactions.md's ("One outcome per transaction",
"The check service").
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from conftest import arun
from txmq.broker.clock import ManualClock
from txmq.broker.transactions import keeper as keeper_module
from txmq.broker.transactions.index import Outcome
from txmq.broker.transactions.indexfile import DB_FILE, TxDatabase, remove_db
from txmq.constants import (
    DISCARD_TOPIC,
    HALF_TOPIC,
    OP_TOPIC,
    PROP_CHECK_TIMES,
    PROP_DECIDED_BY,
    PROP_ORIGIN_CL_OFFSET,
    PROP_PREPARED_QUEUE_OFFSET,
    PROP_REAL_QID,
    PROP_TRAN_MSG,
    PROP_UNIQ_KEY,
)
from txmq.store import TxType
from txmq.wire import ErrorCode, TxmqError
from txservices import G, T, FakeProducer, TxServices, agreed, tx_services

TIMEOUT_S = 6  # the default transaction timeout: a pass checks a transaction stored longer ago than this


async def conflict(fut: asyncio.Future) -> TxmqError:
    with pytest.raises(TxmqError) as info:
        await fut
    assert info.value.code == ErrorCode.TX_CONFLICT, info.value
    return info.value


async def checked_once(svc: TxServices, producer: FakeProducer) -> dict:
    """Move the clock past the timeout and run a pass: the one pending transaction gets its check-back."""
    svc.clock.advance(TIMEOUT_S + 1)
    r = await svc.check.run_pass()
    assert r["checked"] == 1, r
    (pushed,) = producer.check_backs()
    return pushed


# ---- the life of a transaction --------------------------------------------------------------


def test_a_committed_half_becomes_visible_in_its_real_topics_consume_queue(tmp_path):
    async def go():
        async with tx_services(tmp_path / "data", ManualClock()) as svc:
            h = await svc.send_half(b"order-1")
            assert svc.visible() == []  # the half message is in the half topic only
            assert [r.properties[PROP_UNIQ_KEY] for r in svc.queue(HALF_TOPIC)] == [h["tx_id"]]
            assert svc.label(h["tx_id"]) == "pending"

            reply = await svc.end(h, "commit")
            assert reply["status"] == "ok" and reply["outcome"] == "committed"
            (m,) = svc.visible()
            assert (m.topic, m.queue_id, m.body) == (T, h["queue_id"], b"order-1")
            assert (reply["topic"], reply["queue_id"], reply["commit_log_offset"]) == (T, m.queue_id, m.commit_log_offset)
            assert m.tx_type == TxType.COMMIT and m.prepared_offset == h["commit_log_offset"]
            assert PROP_TRAN_MSG not in m.properties and m.properties[PROP_UNIQ_KEY] == h["tx_id"]
            assert m.properties[PROP_PREPARED_QUEUE_OFFSET] == str(h["half_offset"])
            assert int(m.properties[PROP_REAL_QID]) == m.queue_id
            (op,) = svc.queue(OP_TOPIC)
            assert op.tx_type == TxType.COMMIT and op.properties[PROP_DECIDED_BY] == "producer"
            assert svc.tx.index.pending == {} and svc.tx.index.by_half == {}
            d = await agreed(svc, h["tx_id"])
            assert (d.outcome, d.decided_by, d.half_offset) == (Outcome.COMMITTED, "producer", h["half_offset"])

    arun(go())


def test_a_rolled_back_half_never_reaches_its_real_topic(tmp_path):
    async def go():
        async with tx_services(tmp_path / "data", ManualClock()) as svc:
            h = await svc.send_half()
            reply = await svc.end(h, "rollback")
            assert reply == {"status": "ok", "outcome": "rolled_back"}
            assert svc.visible() == []
            (op,) = svc.queue(OP_TOPIC)
            assert op.tx_type == TxType.ROLLBACK and op.body == str(h["half_offset"]).encode()
            d = await agreed(svc, h["tx_id"])
            assert (d.outcome, d.decided_by) == (Outcome.ROLLED_BACK, "producer")
            err = await conflict(svc.end(h, "commit"))  # read from the index file now
            assert err.fields["outcome"] == "rolled_back"
            assert svc.visible() == [] and len(svc.queue(OP_TOPIC)) == 1

    arun(go())


def test_an_unknown_end_writes_nothing_and_leaves_the_transaction_pending(tmp_path):
    async def go():
        async with tx_services(tmp_path / "data", ManualClock()) as svc:
            h = await svc.send_half()
            end_of_log = svc.store.max_offset
            assert await svc.end(h, "unknown") == {"status": "noop", "outcome": "pending"}
            assert svc.store.max_offset == end_of_log
            assert svc.label(h["tx_id"]) == "pending" and svc.tx.index.by_half == {h["half_offset"]: h["tx_id"]}
            assert svc.metrics.counters["unknown_answers"] == 1
            assert svc.tx.index.pending[h["tx_id"]].last_check_result is None  # a producer's unknown is not a check result
            assert await svc.end(h, "unknown", source="check") == {"status": "noop", "outcome": "pending"}
            assert svc.tx.index.pending[h["tx_id"]].last_check_result == "unknown"
            assert svc.visible() == [] and svc.queue(OP_TOPIC) == []
            # and it can still be decided
            assert (await svc.end(h, "commit"))["outcome"] == "committed"
            assert len(svc.visible()) == 1

    arun(go())


def test_a_check_pass_with_no_producer_online_spends_no_check(tmp_path):
    async def go():
        async with tx_services(tmp_path / "data", ManualClock(), max_checks=3) as svc:
            h = await svc.send_half()
            svc.clock.advance(TIMEOUT_S - 1)
            r = await svc.check.run_pass()
            assert (r["immune"], r["checked"], r["no_producer"]) == (1, 0, 0), r

            # A connection that cannot be written to is no producer online either.
            svc.producers.register(G, FakeProducer(writable=False))
            for _ in range(5):  # more passes than max_checks: none of them counts
                svc.clock.advance(TIMEOUT_S + 1)
                r = await svc.check.run_pass()
                assert (r["checked"], r["no_producer"], r["discarded"]) == (0, 1, 0), r
            p = svc.tx.index.pending[h["tx_id"]]
            assert p.checks == 0 and p.half_offset == h["half_offset"], p.as_dict(0)
            assert p.last_check_result == "no producer online"
            assert len(svc.queue(HALF_TOPIC)) == 1  # no check copy
            assert svc.metrics.counters["checks_sent"] == 0
            assert svc.check.progress.half == h["half_offset"]  # the progress waits on it

    arun(go())


def test_a_check_pass_pushes_a_check_back_to_an_online_producer(tmp_path):
    async def go():
        async with tx_services(tmp_path / "data", ManualClock()) as svc:
            producer = FakeProducer()
            svc.producers.register(G, producer)
            h = await svc.send_half(b"order-9")
            svc.clock.advance(TIMEOUT_S - 1)
            assert (await svc.check.run_pass())["checked"] == 0 and producer.check_backs() == []  # still immune

            pushed = await checked_once(svc, producer)
            copy = svc.queue(HALF_TOPIC)[-1]
            assert (pushed["group"], pushed["tx_id"]) == (G, h["tx_id"])
            assert (
                (pushed["commit_log_offset"], pushed["half_offset"])
                == (copy.commit_log_offset, copy.queue_offset)
                == (pushed["message"]["commit_log_offset"], 1)
            )
            props = pushed["message"]["properties"]
            assert props[PROP_CHECK_TIMES] == "1" and props[PROP_ORIGIN_CL_OFFSET] == str(h["commit_log_offset"])
            assert pushed["message"]["body"] == b"order-9"
            p = svc.tx.index.pending[h["tx_id"]]
            assert (p.checks, p.half_offset, p.cl_offset, p.last_check_result) == (1, 1, copy.commit_log_offset, "sent")
            assert svc.tx.index.by_half == {1: h["tx_id"]}
            assert svc.metrics.counters["checks_sent"] == 1

            # The producer's answer names the copy.
            reply = await svc.end(pushed, "commit", source="check")
            assert reply["outcome"] == "committed"
            assert [m.body for m in svc.visible()] == [b"order-9"]
            d = await agreed(svc, h["tx_id"])
            assert (d.decided_by, d.half_offset, d.checks) == ("check", 1, 1)
            assert svc.metrics.counters["checks_answered"] == 1

    arun(go())


# ---- a discard by the check pass racing a decision ------------------------------------------


@pytest.mark.parametrize("state", ["commit", "rollback"])
@pytest.mark.parametrize("first", ["decision", "discard"])
def test_a_discard_and_a_decision_racing_leave_exactly_one_outcome(tmp_path, monkeypatch, first, state):
    """The producer's answer to its last allowed check-back, and the pass that discards the transaction for max-checks.

    ``decision``: the answer is being written when the pass looks at the
    transaction: the pass leaves it alone (``deciding``), no discard record.
    ``discard``: the pass has submitted the discard record and the answer
    arrives before it is written: the discard record goes first in the log
    and the decision after it, which wins, in memory as in a rebuild from
    the log (as a replay's commit after a discard does). Either way the
    answer's outcome is the transaction's only one, and the answers to
    later attempts say so.
    """
    want = Outcome.COMMITTED if state == "commit" else Outcome.ROLLED_BACK
    other = "rollback" if state == "commit" else "commit"

    async def go():
        async with tx_services(tmp_path / "data", ManualClock(), max_checks=1) as svc:
            producer = FakeProducer()
            svc.producers.register(G, producer)
            h = await svc.send_half()
            pushed = await checked_once(svc, producer)  # checks == max_checks: the next pass discards it
            svc.clock.advance(TIMEOUT_S + 1)
            answers: list[asyncio.Future] = []
            if first == "decision":
                answers.append(svc.end(pushed, state, source="check"))
                assert h["tx_id"] in svc.tx.deciding
            else:
                real_discard = svc.tx.discard

                def discard_then_answer(items):
                    fut = real_discard(items)  # submitted to the Appender, written at its next turn
                    assert [p.tx_id for p, _, _ in items] == [h["tx_id"]]
                    answers.append(svc.end(pushed, state, source="check"))
                    return fut

                monkeypatch.setattr(svc.tx, "discard", discard_then_answer)
            r = await svc.check.run_pass()
            (answer,) = answers
            reply = await answer
            assert reply["status"] == "ok" and reply["outcome"] == want.label

            discards = svc.queue(DISCARD_TOPIC)
            (op,) = svc.queue(OP_TOPIC)
            if first == "decision":
                assert r["discarded"] == 0 and discards == [], r
            else:
                (rec,) = discards
                assert rec.commit_log_offset < op.commit_log_offset  # the log applies the discard, then the decision
            assert svc.tx.index.discarded == 0 and svc.admin.discarded(100) == []
            d = await agreed(svc, h["tx_id"])
            assert (d.outcome, d.decided_by) == (want, "check")
            assert len(svc.visible()) == (1 if state == "commit" else 0)

            # A second attempt gets that outcome, and writes nothing.
            end_of_log = svc.store.max_offset
            assert await svc.end(pushed, state, source="check") == {"status": "already", "outcome": want.label, "decided_by": "check"}
            assert (await conflict(svc.end(h, other))).fields["outcome"] == want.label
            (row,) = await svc.admin.replay("commit", [{"tx_id": h["tx_id"]}], False, False)
            assert row["status"] == "conflict", row
            assert svc.store.max_offset == end_of_log
            assert len(svc.visible()) == (1 if state == "commit" else 0)

    arun(go())


# ---- a check answer and the producer's own late end -----------------------------------------


@pytest.mark.parametrize("flush", ["async", "sync"])
@pytest.mark.parametrize("late_state", ["commit", "rollback"])
@pytest.mark.parametrize("first", ["check", "producer"])
def test_a_check_answer_and_a_late_end_arriving_together_decide_once(tmp_path, first, late_state, flush):
    """The check answer (naming the check copy) commits; the producer's own end (naming the first copy) says late_state.

    Both arrive in one turn of the loop, ``first`` ahead: it decides; the
    other waits for that write and gets ``already`` (same outcome, with the
    first one's decided_by) or TX_CONFLICT (the opposite one).
    """
    states = {"check": "commit", "producer": late_state}
    second = "producer" if first == "check" else "check"

    async def go():
        async with tx_services(tmp_path / "data", ManualClock(), flush=flush) as svc:
            producer = FakeProducer()
            svc.producers.register(G, producer)
            h = await svc.send_half()
            pushed = await checked_once(svc, producer)
            names = {"check": pushed, "producer": h}
            end_of_log = svc.store.max_offset
            a = svc.end(names[first], states[first], source=first)
            b = svc.end(names[second], states[second], source=second)
            assert not a.done() and not b.done()
            want = "committed" if states[first] == "commit" else "rolled_back"
            won = await a
            assert won["status"] == "ok" and won["outcome"] == want
            if states[second] == states[first]:
                assert await b == {"status": "already", "outcome": want, "decided_by": first}
            else:
                assert (await conflict(b)).fields["outcome"] == want

            (op,) = svc.queue(OP_TOPIC)
            assert op.properties[PROP_DECIDED_BY] == first
            assert len(svc.visible()) == (1 if want == "committed" else 0)
            assert svc.metrics.counters[f"{want}_{first}"] == 1 and svc.metrics.counters[f"{want}_{second}"] == 0
            d = await agreed(svc, h["tx_id"])
            assert (d.outcome.label, d.decided_by) == (want, first)
            # Later repeats, through either copy, are answered from the index file.
            assert await svc.end(names[second], states[first], source=second) == {"status": "already", "outcome": want, "decided_by": first}
            written = svc.store.max_offset - end_of_log
            assert written == op.size + sum(m.size for m in svc.visible())  # the decision's records, nothing for the others

    arun(go())


# ---- the operator's resolve against the producer's end -----------------------------------------


@pytest.mark.parametrize(
    "first,action,end_state,resolve_status,end_answer",
    [
        ("resolve", "commit", "rollback", "ok", "conflict"),
        ("resolve", "commit", "commit", "ok", "already"),
        ("resolve", "rollback", "commit", "ok", "conflict"),
        ("end", "commit", "commit", "already", "ok"),
        ("end", "commit", "rollback", "conflict", "ok"),
        ("end", "rollback", "rollback", "already", "ok"),
    ],
)
def test_an_operators_resolve_and_a_producers_end_racing_decide_once(tmp_path, first, action, end_state, resolve_status, end_answer):
    """``txmq resolve`` (tx_resolve) and the producer's end_transaction for one pending transaction, in one turn of the loop."""
    winner_state = action if first == "resolve" else end_state
    want = "committed" if winner_state == "commit" else "rolled_back"
    decided_by = "operator" if first == "resolve" else "producer"

    async def go():
        async with tx_services(tmp_path / "data", ManualClock()) as svc:
            h = await svc.send_half()

            async def resolve():
                return await svc.admin.resolve(action, [{"tx_id": h["tx_id"]}], dry_run=False)

            async def end():
                return await svc.end(h, end_state)

            calls = (resolve(), end()) if first == "resolve" else (end(), resolve())
            results = await asyncio.gather(*calls, return_exceptions=True)
            rows, answer = (results[0], results[1]) if first == "resolve" else (results[1], results[0])
            (row,) = rows
            assert row["status"] == resolve_status and row["tx_id"] == h["tx_id"], row
            if end_answer == "conflict":
                assert isinstance(answer, TxmqError) and answer.code == ErrorCode.TX_CONFLICT, answer
                assert answer.fields["outcome"] == want
            else:
                assert not isinstance(answer, BaseException), answer
                assert answer["status"] == end_answer and answer["outcome"] == want
                if end_answer == "already":
                    assert answer["decided_by"] == decided_by

            (op,) = svc.queue(OP_TOPIC)
            assert op.properties[PROP_DECIDED_BY] == decided_by
            assert len(svc.visible()) == (1 if want == "committed" else 0)
            d = await agreed(svc, h["tx_id"])
            assert (d.outcome.label, d.decided_by) == (want, decided_by)
            # Resolving it again is told how it ended, from the index file.
            (again,) = await svc.admin.resolve(action, [{"tx_id": h["tx_id"]}], dry_run=False)
            assert again["status"] == ("already" if action == winner_state else "conflict"), again
            assert len(svc.queue(OP_TOPIC)) == 1

    arun(go())


# ---- a restart after a crash in the middle of an index flush -----------------------------------


class CrashingMeta:
    """TxDatabase._write_meta that, once ``crashed``, dies between a flush's rows and its meta: the SQLite transaction is never committed."""

    def __init__(self) -> None:
        self.real = TxDatabase._write_meta
        self.crashed = False

    def __call__(self, conn, meta) -> None:
        if self.crashed:
            raise OSError("the broker was killed between the rows and the meta of an index flush")
        self.real(conn, meta)


@pytest.mark.parametrize("index_file", ["stale", "missing"])
def test_an_index_flush_interrupted_by_a_crash_loses_no_outcome_the_log_holds(tmp_path, monkeypatch, caplog, index_file):
    """Decisions and a discard written to the log after the last index flush, then a crash in the middle of the next flush.

    The index file (``stale``) still says what the last flush wrote: those
    transactions pending, the last one missing. A restart loads it and
    replays the log after it; with no file (``missing``) it rebuilds the
    index from the log. Either way every outcome is the one the log holds,
    as before the crash, and the answers to later attempts follow from it.
    """
    monkeypatch.setattr(keeper_module, "INDEX_FLUSH_S", 3600.0)  # the keeper flushes when the test says so
    meta = CrashingMeta()
    monkeypatch.setattr(TxDatabase, "_write_meta", staticmethod(meta))
    caplog.set_level(logging.INFO, logger="txmq.broker")
    clock = ManualClock()
    data = tmp_path / "data"
    names = ("committed_before", "rolled_back_before", "committed_after", "rolled_back_after", "discarded_after", "pending")

    async def before_the_crash() -> tuple[dict, dict]:
        async with tx_services(data, clock, max_checks=1) as svc:
            h = {n: await svc.send_half(n.encode()) for n in names[:5]}
            await svc.end(h["committed_before"], "commit")
            await svc.end(h["rolled_back_before"], "rollback")
            await svc.keeper.flush()  # the last flush that completes
            await svc.end(h["committed_after"], "commit")
            await svc.end(h["rolled_back_after"], "rollback")
            producer = FakeProducer()
            svc.producers.register(G, producer)
            svc.clock.advance(TIMEOUT_S + 1)
            assert (await svc.check.run_pass())["checked"] == 1  # discarded_after, checked once: max_checks
            svc.clock.advance(TIMEOUT_S + 1)
            assert (await svc.check.run_pass())["discarded"] == 1
            h["pending"] = await svc.send_half(b"pending")
            outcomes = {n: svc.label(h[n]["tx_id"]) for n in names}
            assert outcomes == {
                "committed_before": "committed",
                "rolled_back_before": "rolled_back",
                "committed_after": "committed",
                "rolled_back_after": "rolled_back",
                "discarded_after": "discarded",
                "pending": "pending",
            }
            meta.crashed = True
            await svc.keeper.flush()  # its rows are written, its meta and its commit never
            assert svc.metrics.counters["index_flush_errors"] == 1
            return h, outcomes  # and the keeper's last flush, as tx_services stops, dies the same way

    h, outcomes = arun(before_the_crash())
    meta.crashed = False
    ids = {n: h[n]["tx_id"] for n in names}

    db = TxDatabase(data / DB_FILE, readonly=True)
    try:
        state = {n: (row[2] if (row := db.by_tx_id(ids[n])) is not None else None) for n in names}
    finally:
        db.close()
    # The file as the last completed flush left it: the log holds more.
    assert state == {
        "committed_before": int(Outcome.COMMITTED),
        "rolled_back_before": int(Outcome.ROLLED_BACK),
        "committed_after": 0,
        "rolled_back_after": 0,
        "discarded_after": 0,
        "pending": None,
    }, state
    if index_file == "missing":
        remove_db(data)
    caplog.clear()

    async def after_the_restart():
        async with tx_services(data, clock, max_checks=1) as svc:
            ready = [r.getMessage() for r in caplog.records if "event=broker_ready" in r.getMessage()]
            assert len(ready) == 1 and ("index=loaded" if index_file == "stale" else "index=rebuilt") in ready[0], ready
            assert {n: svc.label(ids[n]) for n in names} == outcomes
            rebuilt = svc.rebuilt()
            assert {n: rebuilt.outcome(ids[n]).label for n in names} == outcomes
            assert list(svc.tx.index.pending) == [ids["pending"]] and svc.tx.index.discarded == 1
            assert sorted(m.body for m in svc.visible()) == [b"committed_after", b"committed_before"]

            assert await svc.end(h["committed_after"], "commit") == {"status": "already", "outcome": "committed", "decided_by": "producer"}
            assert (await conflict(svc.end(h["rolled_back_after"], "commit"))).fields["outcome"] == "rolled_back"
            assert (await conflict(svc.end(h["discarded_after"], "commit"))).fields["outcome"] == "discarded"
            assert [r["tx_id"] for r in svc.admin.discarded(100)] == [ids["discarded_after"]]

            # Only the pending one is checked; answering it commits it once.
            producer = FakeProducer()
            svc.producers.register(G, producer)
            pushed = await checked_once(svc, producer)
            assert pushed["tx_id"] == ids["pending"]
            assert (await svc.end(pushed, "commit", source="check"))["outcome"] == "committed"
            assert sorted(m.body for m in svc.visible()) == [b"committed_after", b"committed_before", b"pending"]

    arun(after_the_restart())
