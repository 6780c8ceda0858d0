"""`config set` of a setting that would discard pending transactions: counted first, confirmed, previewable."""

import time

import pytest

from clihelpers import USAGE, err, lines, ok, one, out, start_broker, txmq, wait_for


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    b = start_broker(tmp_path_factory.mktemp("cli-config-guard"))
    yield b.address
    b.stop()


def run(broker, *args, **kw):
    return txmq(*args, broker=broker, **kw)


def pend(broker, group, n):
    return [one(run(broker, "send", "t-guard", f"b{i}", "--tx", "--group", group, "-o", "json"))["tx_id"] for i in range(n)]


def retention(broker):
    return one(run(broker, "config", "get", "retention", "-o", "json"))["retention_s"]


def test_shorter_retention_counts_pending_and_needs_yes(broker):
    ids = pend(broker, "rg", 3)
    time.sleep(1.5)  # older than the shortest retention (1s)
    before = retention(broker)
    r = run(broker, "config", "set", "retention", "1s")
    assert r.returncode == USAGE, err(r)
    assert "3" in err(r) and "--yes" in err(r) and "discards" in err(r)
    assert retention(broker) == before  # refused: nothing changed

    doc = one(run(broker, "config", "set", "retention", "1s", "--dry-run", "-o", "json"))
    assert doc["dry_run"] is True and doc["old"] == before and doc["new"] == 1.0
    assert doc["would_discard"] == 3 and doc["would_delete_pending"] == 3 and doc["pending"] >= 3
    text = out(ok(run(broker, "config", "set", "retention", "1s", "--dry-run", "-o", "table")))
    assert "3 of" in text and "nothing changed" in text
    assert retention(broker) == before
    # a longer retention discards nothing: no question asked
    assert one(run(broker, "config", "set", "retention", "100d", "-o", "json"))["new"] == 100 * 86400.0

    assert one(run(broker, "config", "set", "retention", "1s", "--yes", "-o", "json"))["new"] == 1.0
    try:
        wait_for(lambda: {x["tx_id"] for x in lines(ok(run(broker, "discard", "list"))) if x["group"] == "rg"} == set(ids),
                 what="the pending transactions discarded by retention")
    finally:
        ok(run(broker, "config", "set", "retention", "72h"))


def test_lower_max_checks_counts_checked_pending_and_needs_yes(broker):
    pend(broker, "mg", 2)
    ok(run(broker, "checker", "--group", "mg", "--answer", "unknown", "--limit", "2", "--idle-exit", "20s", timeout=40))
    r = run(broker, "config", "set", "max-checks", "1")
    assert r.returncode == USAGE and "2 of" in err(r), err(r)
    doc = one(run(broker, "config", "set", "max-checks", "1", "-n", "-o", "json"))
    assert (doc["would_discard"], doc["would_delete_pending"], doc["old"], doc["new"]) == (2, 0, 15, 1)
    assert one(run(broker, "config", "get", "max-checks", "-o", "json")) == {"max_checks": 15}
    # raising it discards nothing
    assert one(run(broker, "config", "set", "max-checks", "20", "-o", "json"))["new"] == 20
    ok(run(broker, "config", "set", "max-checks", "15"))
    for tx in (x["tx_id"] for x in lines(ok(run(broker, "inspect", "half", "--group", "mg")))):
        ok(run(broker, "resolve", "--rollback", tx))


def test_discard_replay_all_fetches_the_discard_list_in_pages(broker, monkeypatch):
    from txmq.cli.commands import _paging
    from txmq.client.connection import Client

    ids = pend(broker, "rp", 3)
    time.sleep(1.5)
    ok(run(broker, "config", "set", "retention", "1s", "--yes"))
    try:
        wait_for(lambda: {x["tx_id"] for x in lines(ok(run(broker, "discard", "list")))} >= set(ids),
                 what="the pending transactions discarded by retention")
    finally:
        ok(run(broker, "config", "set", "retention", "72h"))
    discarded = {x["tx_id"] for x in lines(ok(run(broker, "discard", "list")))}
    assert len(discarded) >= 3

    asked: list[dict] = []
    real = Client.request

    async def spy(self, op, fields=None, *a, **kw):
        if op == "discard_list":
            asked.append(dict(fields or {}))
        return await real(self, op, fields, *a, **kw)

    monkeypatch.setattr(Client, "request", spy)
    monkeypatch.setattr(_paging, "PAGE", 2)
    rows = lines(ok(run(broker, "discard", "replay", "--all", "--yes", "--dry-run")))
    assert {r["tx_id"] for r in rows} == discarded and all(r["status"] == "ok" for r in rows)
    assert len(asked) >= 2 and all(a["limit"] <= 2 for a in asked), asked  # pages, never one unbounded request
    assert "after_discard_offset" in asked[-1]
