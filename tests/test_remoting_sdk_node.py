"""npm's ali-ons (a pure JavaScript RocketMQ 4 remoting client) against txmq's remoting front end.

ali-ons is installed once under .cache/sdk-venvs/ (tests/sdkenv.py) and runs with `node` in a subprocess
(tests/sdk/remoting_node_scenario.js); the broker is a real `txmq broker start --remoting-port` process.
Skipped when node/npm are missing or the package cannot be installed.
"""

from __future__ import annotations

import pytest

from clihelpers import lines, ok, txmq
from sdkenv import remoting_node_dir, remoting_node_scenario, start_remoting_broker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_ali_ons_producer_and_push_consumer_exchange_messages_through_the_remoting_port(tmp_path):
    sdk = remoting_node_dir()
    b, namesrv = start_remoting_broker(tmp_path / "b")
    try:
        r = remoting_node_scenario(sdk, "produce_consume", tmp_path / "home", "--namesrv", namesrv, "--topic", "NodeOns",
                                   "--group", "node-ons")
        assert [s["status"] for s in r["sent"]] == ["SEND_OK"] * 6
        bodies = sorted(m["body"] for m in r["received"])
        assert bodies == sorted(s["body"] for s in r["sent"]), r["received"]
        by_body = {m["body"]: m for m in r["received"]}
        # ali-ons sets no UNIQ_KEY: the id it is given is the broker's offset message id, the same on both sides
        for s in r["sent"]:
            assert by_body[s["body"]]["msgId"] == s["msgId"] and len(s["msgId"]) == 32
        assert by_body["node-0"]["tags"] == "node" and by_body["node-0"]["keys"] == "nk-0"
        assert r["late_ms"] < 5000  # a message sent while the consumer long-polls reaches it at once
        assert sorted(m["body"] for m in lines(ok(txmq("read", "NodeOns", "-o", "jsonl", broker=b.address)))) == bodies
    finally:
        b.stop()
