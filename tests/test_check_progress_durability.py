"""The check progress is saved only once the records it moves past are durable.

A pass appends check copies without waiting for an fsync and moves
the half progress past the old copies. A rebuild after a power cut reads
the half queue from the progress, so saving it before the copies (or the
decisions it passes) are fsynced would lose the transaction: neither
pending nor decided, never checked again, the producer's own
end_transaction refused with TX_NOT_FOUND. CheckService._finish waits for
the flusher before saving txcheck.json.
"""
import asyncio
import json

from txhelpers import G, arun, end, half_fields, power_cut
from txmq.broker.clock import ManualClock
from txmq.broker.testing import running_broker
from wireclient import RawClient


def test_a_power_cut_after_a_check_pass_keeps_the_pending_transaction(tmp_path):
    data = tmp_path / "data"
    clock = ManualClock()
    kw = dict(clock=clock, check_interval_s=3600, flush="sync", flush_interval_s=3600)

    async def first():
        async with running_broker(data, **kw) as b:
            core = b.core
            c = await RawClient.open(b.address)
            await c.ok("hello", {"producer_groups": [G]})
            h = await c.ok("send", half_fields())  # acknowledged: durable
            clock.advance(10)
            r = await core.check.run_pass()
            assert r["checked"] == 1 and r["half_progress"] == 1
            durable, end_ = core.store.durable_offset, core.store.max_offset
            await c.close()
            return h, durable, end_

    h, durable, end_ = arun(first())
    assert durable == end_, "the progress was saved before what it skips past was fsynced"
    assert durable > h["commit_log_offset"]  # the acknowledged half message survives the cut
    power_cut(data, durable)

    async def second():
        async with running_broker(data, **kw) as b:
            c = await RawClient.open(b.address)
            offs = await c.ok("tx_offsets")
            code, f = await c.req("end_transaction", end(h, "commit"))
            await c.close()
            return offs, code, f

    offs, code, f = arun(second())
    assert offs["pending"] == 1, f"the undecided transaction vanished: {offs}; producer's commit got {f}"


def test_an_async_power_cut_after_a_pass_keeps_the_decision_it_moved_past(tmp_path):
    """Async flush: a decision the progress moves past is fsynced first, so it survives a power cut.

    (A torn op record with no pass behind it leaves the transaction pending:
    test_fault_torn.)"""
    data = tmp_path / "data"
    clock = ManualClock()
    kw = dict(clock=clock, check_interval_s=3600, flush="async", flush_interval_s=3600)

    async def first():
        async with running_broker(data, **kw) as b:
            core = b.core
            c = await RawClient.open(b.address)
            h = await c.ok("send", half_fields())
            await asyncio.get_running_loop().run_in_executor(None, core.store.sync)  # a flush cycle
            await c.ok("end_transaction", end(h, "rollback"))  # written, not yet fsynced (async mode)
            r = await core.check.run_pass()  # progress moves past the (decided) half; txcheck.json fsynced
            assert r["half_progress"] == 1
            durable = core.store.durable_offset
            await c.close()
            return h, durable

    h, durable = arun(first())
    power_cut(data, durable)

    async def second():
        async with running_broker(data, **kw) as b:
            c = await RawClient.open(b.address)
            offs = await c.ok("tx_offsets")
            code, f = await c.req("end_transaction", end(h, "rollback"))
            await c.close()
            return offs, code, f

    offs, code, f = arun(second())
    # the pass fsynced the rollback before saving its progress: the outcome survives the cut
    assert offs["pending"] == 0 and code == 0 and f["status"] == "already" and f["outcome"] == "rolled_back", (offs, f)


def test_a_pass_saves_the_progress_off_the_event_loop_and_only_when_it_moved(tmp_path, monkeypatch):
    """Saving txcheck.json costs two fsyncs: done in a worker thread, so the front ends sharing the event loop are not
    held up by the disk, and skipped by a pass that moved nothing."""
    import threading

    from txmq.broker.transactions import check

    writes: list[str] = []
    real = check.atomic_write_json

    def recording(path, doc):
        writes.append(threading.current_thread().name)
        real(path, doc)

    monkeypatch.setattr(check, "atomic_write_json", recording)
    clock = ManualClock()

    async def go():
        async with running_broker(tmp_path / "data", clock=clock, check_interval_s=3600, flush="sync") as b:
            loop_thread = threading.current_thread().name
            c = await RawClient.open(b.address)
            await c.ok("hello", {"producer_groups": [G]})
            h = await c.ok("send", half_fields())
            await c.ok("end_transaction", end(h, "commit"))  # decided: the passes move past it and then stay
            clock.advance(10)
            passes = [await b.core.check.run_pass()]
            while len(passes) < 10 and (len(passes) < 2 or passes[-1]["half_progress"] != passes[-2]["half_progress"]):
                passes.append(await b.core.check.run_pass())  # the check copy written is passed over in turn
            before_idle = len(writes)
            idle = await b.core.check.run_pass()  # nothing moved: nothing written
            await c.close()
            return loop_thread, passes, before_idle, idle

    loop_thread, passes, before_idle, idle = arun(go())
    assert idle["half_progress"] == passes[-1]["half_progress"] >= 1
    assert before_idle >= 1 and len(writes) == before_idle, writes
    assert loop_thread not in writes, writes
    saved = json.loads((tmp_path / "data" / "txcheck.json").read_text())
    assert saved["half_progress"] == idle["half_progress"] and saved["op_progress"] == idle["op_progress"]
