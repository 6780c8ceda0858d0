from pathlib import Path

from txmq.store import StoreReader
from txmq.store.checkpoint import Checkpoint, write_checkpoint

G = "shop"
T = "orders"


def arun(coro):
    import uvloop
    return uvloop.run(coro)


def half_fields(body=b"order-1", **props):
    return {"topic": T, "body": body, "properties": {"TRAN_MSG": "true", "PGROUP": G, **props}}


def end(h, state, from_check=False):
    return {"group": G, "tx_id": h["tx_id"], "commit_log_offset": h["commit_log_offset"],
            "half_offset": h["half_offset"], "state": state, "from_check": from_check}


async def pull_all(c, topic=T):
    out = []
    for q in range(4):
        r = await c.ok("pull", {"topic": topic, "queue_id": q, "offset": 0, "max_count": 1000})
        out.extend(r["messages"])
    return out


def power_cut(data: Path, durable: int) -> None:
    """What a power loss leaves: the log cut at the last fsynced offset, checkpoint no later."""
    reader = StoreReader(data)
    try:
        seg_start, path, _ = reader.segments()[-1]
    finally:
        reader.close()
    import os
    os.truncate(path, durable - seg_start)
    write_checkpoint(data / "checkpoint", Checkpoint(durable, durable))
