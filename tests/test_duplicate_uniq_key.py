"""A half message whose UNIQ_KEY is already in use is refused, even by a send still being written.

The index learns of a half only in `shape`, after the batch is written;
send_half also checks the transaction ids submitted but not yet written
(TransactionService._sending), so two concurrent halves with the same
UNIQ_KEY cannot both be stored (one would replace the other in the index,
and ending one would answer the other "already")."""
import asyncio

from txhelpers import G, T, arun, pull_all
from txmq.broker.testing import running_broker
from txmq.wire import TxmqError
from wireclient import RawClient


def test_a_concurrent_half_with_the_same_uniq_key_is_refused(tmp_path):
    async def go():
        async with running_broker(tmp_path / "data", check_interval_s=3600) as b:
            core = b.core
            c = await RawClient.open(b.address)
            props = {"TRAN_MSG": "true", "PGROUP": G, "UNIQ_KEY": "ORDER-42"}
            f1 = core.tx.send_half(T, 0, b"first", props, 1)
            try:
                f2 = core.tx.send_half(T, 0, b"second", props, 1)
            except TxmqError as e:
                return "refused", str(e)
            h1, h2 = await asyncio.gather(f1, f2)
            e1 = {"group": G, "tx_id": h1["tx_id"], "commit_log_offset": h1["commit_log_offset"], "half_offset": h1["half_offset"], "state": "commit"}
            e2 = {**e1, "commit_log_offset": h2["commit_log_offset"], "half_offset": h2["half_offset"]}
            r1 = await c.ok("end_transaction", e1)
            r2 = await c.ok("end_transaction", e2)
            bodies = [m["body"] for m in await pull_all(c)]
            await c.close()
            return "stored both", (r1, r2, bodies)

    what, detail = arun(go())
    assert what == "refused", f"both halves stored with one tx id: {detail}"
