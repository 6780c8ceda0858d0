"""Apache's mqadmin (RocketMQ 4.9.8's own admin tool) against txmq's --remoting-port: the operators' daily tasks.

Each command runs against a txmq broker and, where it is cheap, against the real RocketMQ 4.9.8 of the session
(tests/rocketmq_peer.py), comparing what is printed: the same columns, the same setting names. The messages and
consumers come from Apache's Java client (tests/java/RmqDriver.java). docs/remoting.md, "Apache's mqadmin",
lists the commands.
"""

from __future__ import annotations

import json
import queue
import re
import threading
import time

import pytest

from clihelpers import out, txmq
from rocketmq_peer import TxmqRemoting

pytestmark = [pytest.mark.rocketmq_peer]


@pytest.fixture(scope="module")
def broker(tmp_path_factory, rocketmq_peer):
    with TxmqRemoting(tmp_path_factory.mktemp("mqadmin") / "data", "--check-interval", "30s", "--max-checks", "9") as b:
        yield b


def clean(text: str) -> str:
    assert "Exception" not in text and "CODE:" not in text, text[-3000:]
    return text


def settings(text: str, sep: str) -> dict[str, str]:
    """``key <sep> value`` lines (getBrokerConfig: "=", brokerStatus: ":")."""
    out_ = {}
    for line in text.splitlines():
        k, s, v = line.partition(sep)
        if s and k.strip() and not k.startswith("="):
            out_[k.strip()] = v.strip()
    return out_


def rows(text: str, first: str) -> list[list[str]]:
    """The whitespace-separated fields of the lines starting with ``first``."""
    return [line.split() for line in text.splitlines() if line.startswith(first)]


def header(text: str, first: str) -> list[str]:
    return next(line.split() for line in text.splitlines() if line.startswith(first))


# ---- cluster and broker --------------------------------------------------------------------------
def test_cluster_list_shows_the_broker_as_rocketmq_shows_its_own(rocketmq_peer, broker):
    ours = clean(rocketmq_peer.mqadmin(broker.namesrv, "clusterList"))
    theirs = clean(rocketmq_peer.mqadmin(rocketmq_peer.namesrv, "clusterList"))
    assert header(ours, "#Cluster Name") == header(theirs, "#Cluster Name")
    [row] = rows(ours, "txmq")
    [peer_row] = rows(theirs, "DefaultCluster")
    assert len(row) == len(peer_row)
    assert row[:4] == ["txmq", "txmq", "0", broker.namesrv] and row[4].startswith("txmq-")
    assert re.fullmatch(r"\d+\.\d\d\(\d+,\d+ms\)", row[5])  # #InTPS(LOAD), as RocketMQ formats it


@pytest.mark.slow
def test_broker_status_and_config_use_rocketmqs_names(rocketmq_peer, broker):
    status = settings(clean(rocketmq_peer.mqadmin(broker.namesrv, "brokerStatus", "-b", broker.namesrv)), ":")
    peer_status = settings(clean(rocketmq_peer.mqadmin(rocketmq_peer.namesrv, "brokerStatus", "-b", rocketmq_peer.broker)), ":")
    read_by_tools = {"putTps", "getTransferedTps", "brokerVersionDesc", "brokerVersion", "earliestMessageTimeStamp", "commitLogDiskRatio",
                     "msgPutTotalTodayNow", "msgGetTotalTodayNow", "msgPutTotalTodayMorning", "bootTimestamp", "runtime",
                     "sendThreadPoolQueueSize", "pullThreadPoolQueueSize", "commitLogMaxOffset", "commitLogDirCapacity"}
    assert read_by_tools <= set(status) and read_by_tools <= set(peer_status)
    assert status["brokerVersion"] == peer_status["brokerVersion"] == "409"
    config = settings(clean(rocketmq_peer.mqadmin(broker.namesrv, "getBrokerConfig", "-b", broker.namesrv)), "=")
    peer_config = settings(clean(rocketmq_peer.mqadmin(rocketmq_peer.namesrv, "getBrokerConfig", "-b", rocketmq_peer.broker)), "=")
    assert set(config) <= set(peer_config), set(config) - set(peer_config)  # every name one RocketMQ's broker has
    assert config["transactionCheckInterval"] == "30000" and config["transactionCheckMax"] == "9"
    assert config["brokerName"] == "txmq" and config["listenPort"] == str(broker.remoting_port)


@pytest.mark.slow
def test_update_broker_config_changes_the_transaction_checks_live_as_on_rocketmq(rocketmq_peer, broker):
    for key, value in (("transactionCheckInterval", "5000"), ("transactionTimeOut", "7000"), ("transactionCheckMax", "4")):
        text = clean(rocketmq_peer.mqadmin(broker.namesrv, "updateBrokerConfig", "-c", "txmq", "-k", key, "-v", value))
        assert f"update broker config success, {broker.namesrv}" in text
    got = json.loads(out(txmq("config", "get", "-o", "json", broker=broker.address, subprocess_=True)))
    assert (got["check_interval_s"], got["transaction_timeout_s"], got["max_checks"]) == (5.0, 7.0, 4)
    config = settings(rocketmq_peer.mqadmin(broker.namesrv, "getBrokerConfig", "-b", broker.namesrv), "=")
    assert (config["transactionCheckInterval"], config["transactionTimeOut"], config["transactionCheckMax"]) == ("5000", "7000", "4")
    # a setting txmq does not change at run time is refused, naming the ones it does
    text = rocketmq_peer.mqadmin(broker.namesrv, "updateBrokerConfig", "-b", broker.namesrv, "-k", "brokerPermission", "-v", "4")
    assert "CODE: 29" in text and "transactionCheckInterval" in text
    # RocketMQ's broker takes the same name and shows it changed
    peer = rocketmq_peer.namesrv
    try:
        clean(rocketmq_peer.mqadmin(peer, "updateBrokerConfig", "-b", rocketmq_peer.broker, "-k", "transactionCheckMax", "-v", "4"))
        assert settings(rocketmq_peer.mqadmin(peer, "getBrokerConfig", "-b", rocketmq_peer.broker), "=")["transactionCheckMax"] == "4"
    finally:
        rocketmq_peer.mqadmin(peer, "updateBrokerConfig", "-b", rocketmq_peer.broker, "-k", "transactionCheckMax", "-v", "15")


# ---- topics ----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_topics_are_created_updated_listed_routed_shown_and_deleted(rocketmq_peer, broker):
    ns = broker.namesrv
    text = clean(rocketmq_peer.mqadmin(ns, "updateTopic", "-c", "txmq", "-t", "AdminTopic", "-r", "3", "-w", "3"))
    assert f"create topic to {ns} success." in text
    text = clean(rocketmq_peer.mqadmin(ns, "topicRoute", "-t", "AdminTopic"))
    route = json.loads(re.sub(r"\{(\d+):", r'{"\1":', text[text.index("{"):text.rindex("}") + 1]))  # fastjson's {0:"..."}
    assert route["queueDatas"][0]["readQueueNums"] == 3 and route["brokerDatas"][0]["brokerAddrs"] == {"0": ns}
    clean(rocketmq_peer.mqadmin(ns, "updateTopic", "-b", ns, "-t", "AdminTopic", "-r", "5", "-w", "5"))  # an update
    rocketmq_peer.driver(ns, "send", topic="AdminTopic", n=3, group="admin-topics")
    status = clean(rocketmq_peer.mqadmin(ns, "topicStatus", "-t", "AdminTopic"))
    peer_status = rocketmq_peer.mqadmin(rocketmq_peer.namesrv, "topicStatus", "-t", "TBW102")
    assert header(status, "#Broker Name") == header(peer_status, "#Broker Name")
    queues = rows(status, "txmq")
    assert [int(r[1]) for r in queues] == [0, 1, 2, 3, 4] and sum(int(r[3]) for r in queues) == 3
    assert "AdminTopic" in clean(rocketmq_peer.mqadmin(ns, "topicList")).split()
    text = clean(rocketmq_peer.mqadmin(ns, "deleteTopic", "-c", "txmq", "-t", "AdminTopic"))
    assert "delete topic [AdminTopic] from cluster [txmq] success." in text and "delete topic [AdminTopic] from NameServer success." in text
    assert "AdminTopic" not in clean(rocketmq_peer.mqadmin(ns, "topicList")).split()


# ---- consumer groups -------------------------------------------------------------------------------
class Held:
    """A push consumer (RmqDriver hold) running in the background; its GOT lines in ``got``."""

    def __init__(self, proc) -> None:
        self.proc = proc
        self.lines: queue.Queue[str] = queue.Queue()
        self.got: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            self.lines.put(raw.decode(errors="replace").rstrip("\n"))

    def wait_for(self, n: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while len(self.got) < n:
            line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line.startswith("GOT "):
                self.got.append(line[4:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except Exception:
                self.proc.kill()
                self.proc.wait(10)


def committed(rocketmq_peer, ns: str, group: str) -> list[list[str]]:
    return rows(rocketmq_peer.mqadmin(ns, "consumerProgress", "-g", group), "GroupTopic")


@pytest.mark.slow
def test_a_groups_connections_progress_and_reset_by_time(rocketmq_peer, broker):
    ns = broker.namesrv
    rocketmq_peer.driver(ns, "send", topic="GroupTopic", n=3, group="admin-groups")
    held = Held(rocketmq_peer.popen(ns, "hold", topic="GroupTopic", group="cg-admin", expect=3))
    try:
        held.wait_for(3)
        text = clean(rocketmq_peer.mqadmin(ns, "consumerConnection", "-g", "cg-admin"))
        [conn] = [r for r in rows(text, "") if len(r) == 4 and r[2] == "JAVA"]
        assert conn[3] == "V4_9_8" and conn[1].startswith("127.0.0.1:")
        assert "ConsumeType: CONSUME_PASSIVELY" in text and "MessageModel: CLUSTERING" in text
        assert "ConsumeFromWhere: CONSUME_FROM_FIRST_OFFSET" in text
        assert ["GroupTopic", "*"] in rows(text, "GroupTopic") and ["%RETRY%cg-admin", "*"] in rows(text, "%RETRY%")
        # the consumer commits its offsets on its own schedule (every 500 ms here, the first after ~10 s)
        deadline = time.monotonic() + 120
        while True:
            progress = committed(rocketmq_peer, ns, "cg-admin")
            if sum(int(r[4]) for r in progress) == 3 or time.monotonic() > deadline:
                break
        assert len(progress) == 4 and all(r[3] == r[4] and r[5] == "0" for r in progress), progress
        listing = rows(clean(rocketmq_peer.mqadmin(ns, "consumerProgress")), "cg-admin")
        assert listing == [["cg-admin", "1", "V4_9_8", "PUSH", "CLUSTERING", "0", "0"]]
        # back to the start, told to the live consumer: it receives the three again
        text = clean(rocketmq_peer.mqadmin(ns, "resetOffsetByTime", "-g", "cg-admin", "-t", "GroupTopic", "-s", "0"))
        assert "rollback consumer offset by specified group[cg-admin], topic[GroupTopic], force[true]" in text
        assert sorted(int(r[2]) for r in rows(text, "txmq")) == [0, 0, 0, 0]
        held.wait_for(6)
        assert sorted(held.got) == sorted(["body-0", "body-1", "body-2"] * 2)
    finally:
        held.stop()
    # no consumer online: mqadmin resets offset by offset (resetOffsetByTimeOld), as against RocketMQ
    text = clean(rocketmq_peer.mqadmin(ns, "resetOffsetByTime", "-g", "cg-admin", "-t", "GroupTopic", "-s", "0"))
    assert "#rollbackOffset" in text and len(rows(text, "txmq")) == 4


# ---- messages --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_message_is_found_by_its_id_and_by_its_key_as_on_rocketmq(rocketmq_peer, broker):
    seen = {}
    for name, ns in (("txmq", broker.namesrv), ("rocketmq", rocketmq_peer.namesrv)):
        sent = rocketmq_peer.driver(ns, "send", topic="QueryTopic", n=2, group="admin-query")["sends"]
        by_id = clean(rocketmq_peer.mqadmin(ns, "queryMsgById", "-i", sent[1]["offsetMsgId"]))
        fields = settings(by_id.split("\n\n")[0], ": ")
        assert fields["Topic"] == "QueryTopic" and fields["Keys"] == "[k1]" and fields["Tags"] == "[TagA]"
        assert fields["OffsetID"] == sent[1]["offsetMsgId"] and fields["Queue ID"] == str(sent[1]["queueId"])
        assert "No Consumer" in by_id or "MessageTrack" in by_id
        by_key = clean(rocketmq_peer.mqadmin(ns, "queryMsgByKey", "-t", "QueryTopic", "-k", "k1"))
        assert rows(by_key, sent[1]["msgId"]) == [[sent[1]["msgId"], str(sent[1]["queueId"]), str(sent[1]["queueOffset"])]]
        seen[name] = sorted(fields)
    assert seen["txmq"] == seen["rocketmq"]


def test_a_request_code_txmq_does_not_serve_is_named_in_the_answer(rocketmq_peer, broker):
    text = rocketmq_peer.mqadmin(broker.namesrv, "getConsumerConfig", "-g", "any-group")
    assert "CODE: 3" in text and "201 (GET_ALL_SUBSCRIPTIONGROUP_CONFIG) is not supported" in text
