"""Regression (review, now fixed): if _build_index raises, tx_ready is never set: every transactional request
waits forever in _when_ready (no error, no timeout) and the check service never starts,
while the broker keeps serving plain traffic and looks healthy."""
import asyncio

from txhelpers import T, arun, end, half_fields
from txmq.broker.txdb import remove_db
from txmq.broker.config import BrokerConfig, CheckSettings
from txmq.broker.server import Broker, bind
from txmq.broker.testing import running_broker
from txmq.store import StoreReader
from wireclient import RawClient


def test_corrupt_op_record_before_the_checkpoint_hangs_all_tx_requests(tmp_path):
    data = tmp_path / "data"

    async def first():
        async with running_broker(data, check_interval_s=3600) as b:
            c = await RawClient.open(b.address)
            h = await c.ok("send", half_fields())
            await c.ok("end_transaction", end(h, "rollback"))
            await c.ok("send", {"topic": T, "body": b"after"})  # so the op is not the tail
            await c.close()
            return h

    h = arun(first())
    remove_db(data)  # the index rebuilt from the log alone, which reads the damaged record
    reader = StoreReader(data)
    op = [r for r in reader.scan() if r.topic == "RMQ_SYS_TRANS_OP_HALF_TOPIC"][0]
    seg_start, path, _ = reader.segments()[-1]
    reader.close()
    with open(path, "r+b") as f:  # one flipped bit in the op record's body (bit rot)
        pos = op.commit_log_offset - seg_start + op.size - 1
        f.seek(pos); b_ = f.read(1); f.seek(pos); f.write(bytes([b_[0] ^ 1]))

    async def second():
        cfg = BrokerConfig(data_dir=data, host="127.0.0.1", port=0, check=CheckSettings(check_interval_s=3600))
        sock = bind("127.0.0.1", 0)
        broker = Broker(cfg)
        shutdown = asyncio.Event()
        task = asyncio.create_task(broker.serve(sock, shutdown))
        await broker.ready.wait()
        c = await RawClient.open(f"127.0.0.1:{sock.getsockname()[1]}")
        plain = await c.ok("send", {"topic": T, "body": b"plain works"})
        try:
            code, f = await c.req("end_transaction", end(h, "rollback"), timeout=3)
            outcome = ("answered", code, f)
        except asyncio.TimeoutError:
            outcome = ("no answer after 3 s", broker._indexer.done() and repr(broker._indexer.exception()))
        await c.close()
        shutdown.set()
        await task
        return outcome

    outcome = arun(second())
    assert outcome[0] == "answered", outcome
