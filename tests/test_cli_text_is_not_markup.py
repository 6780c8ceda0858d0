"""Names and ids that look like rich markup (`[/x]`) are printed as they are, in every table and line."""

import pytest

from clihelpers import err, lines, ok, out, start_broker, txmq

GROUP, TX_ID, CONSUMERS = "g[/z]", "x[/y]", "c[/x][bold]"


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    b = start_broker(tmp_path_factory.mktemp("cli-markup"))
    yield b.address
    b.stop()


def run(broker, *args, **kw):
    r = txmq(*args, broker=broker, **kw)
    text = err(r)
    assert "Traceback" not in text and "never retrieved" not in text and "MarkupError" not in text, text
    return r


def test_bracketed_group_names_and_ids_print_in_tables_and_lines(broker):
    r = ok(run(broker, "send", "t-markup", "-", "--tx", "--group", GROUP, "--prop", f"UNIQ_KEY={TX_ID}", "-o", "table",
               input="one\n"))
    assert f"tx_id={TX_ID}" in out(r), out(r)
    assert GROUP in out(ok(run(broker, "stats", "-o", "table")))
    assert TX_ID in out(ok(run(broker, "inspect", "offsets", "-o", "table")))
    shown = out(ok(run(broker, "inspect", "tx", TX_ID, "-o", "table")))
    assert f"transaction {TX_ID}:" in shown and f"group {GROUP}" in shown, shown
    r = ok(run(broker, "checker", "--group", GROUP, "--answer", "rollback", "--limit", "1", "--idle-exit", "20s", "-o", "table",
               timeout=60))
    assert f"checked {TX_ID}" in out(r), out(r)
    assert lines(ok(run(broker, "inspect", "tx", TX_ID, "-o", "jsonl")))[0]["state"] == "rolled_back"


def test_a_bracketed_consumer_group_prints_in_describe_and_reset(broker):
    ok(run(broker, "send", "t-markup2", "m"))
    ok(run(broker, "consume", "t-markup2", "--group", CONSUMERS, "--limit", "1", "-o", "jsonl", timeout=60))
    assert f"group {CONSUMERS}" in out(ok(run(broker, "groups", "describe", CONSUMERS, "-o", "table")))
    r = ok(run(broker, "groups", "reset", CONSUMERS, "--topic", "t-markup2", "--to", "earliest", "--dry-run", "-o", "table"))
    assert f"group {CONSUMERS} on t-markup2" in out(r), out(r)
