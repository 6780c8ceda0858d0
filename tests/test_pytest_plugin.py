"""The pytest plugin shipped with txmq (txmq.pytest_plugin, entry point `pytest11`): the `txmq_broker` fixtures.

The first tests use the fixtures as an application's tests would, the plugin
loaded by pytest from the installed entry point (this suite has no
conftest for them); the last ones run a user's test session inside this one
(`pytester`) and look at what it leaves behind.
"""

from __future__ import annotations

import socket
import threading

import pytest

from txmq.client import LocalTransactionState, Message, SyncProducer
from txmq.pytest_plugin import TxmqBroker, start_broker
from txmq.wire import ErrorCode, TxmqError

pytest_plugins = ["pytester"]


def _refused(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return False
    except ConnectionRefusedError:
        return True


def test_the_plugin_is_loaded_from_its_entry_point(pytestconfig):
    plugin = pytestconfig.pluginmanager.get_plugin("txmq")
    assert plugin is not None and plugin.__name__ == "txmq.pytest_plugin"


def test_a_message_sent_to_the_fixture_broker_is_consumed(txmq_broker):
    assert isinstance(txmq_broker, TxmqBroker)
    assert txmq_broker.address == f"127.0.0.1:{txmq_broker.port}" and txmq_broker.port > 0
    assert txmq_broker.rocketmq_address is None
    assert txmq_broker.data_dir.is_dir()
    txmq_broker.client.send("orders", b'{"order": 1}', keys=["o-1"])
    with txmq_broker.consumer("audit", "orders") as consumer:
        (msg,) = consumer.poll(timeout=10)
    assert msg.body == b'{"order": 1}' and msg.keys == "o-1"


class _Commit:
    def execute_local_transaction(self, message, arg):
        return LocalTransactionState.COMMIT_MESSAGE

    def check_local_transaction(self, message):
        return LocalTransactionState.COMMIT_MESSAGE


def test_a_transaction_committed_on_the_fixture_broker_is_delivered(txmq_broker):
    producer = txmq_broker.transaction_producer("shop", _Commit())
    result = producer.send_in_transaction(Message("payments", b"paid"), wait_end=True)
    assert result.local_state is LocalTransactionState.COMMIT_MESSAGE
    with txmq_broker.consumer("ledger", "payments") as consumer:
        (msg,) = consumer.poll(timeout=10)
    assert msg.body == b"paid" and msg.tx_id == result.tx_id


@pytest.mark.txmq(flush="sync", auth_token="s3cret", check_interval_s=1)
def test_the_marker_sets_the_broker_options_and_the_clients_use_its_token(txmq_broker):
    config = txmq_broker.running.broker.config
    assert config.flush == "sync" and config.auth_token == "s3cret" and config.check.check_interval_s == 1
    txmq_broker.client.send("orders", b"with the token")  # the fixture's clients present the token
    with pytest.raises(TxmqError) as refused:
        with SyncProducer(txmq_broker.address) as stranger:
            stranger.send("orders", b"without it")
    assert refused.value.code in (ErrorCode.AUTH_REQUIRED, ErrorCode.AUTH_FAILED)


@pytest.mark.txmq(rocketmq=True)
def test_rocketmq_true_serves_the_grpc_service_on_a_free_port(txmq_broker):
    grpc = pytest.importorskip("grpc", reason="the rocketmq extra is not installed")
    assert txmq_broker.rocketmq_address == f"127.0.0.1:{txmq_broker.rocketmq_port}"
    assert txmq_broker.rocketmq_port not in (0, txmq_broker.port)
    with grpc.insecure_channel(txmq_broker.rocketmq_address) as channel:
        grpc.channel_ready_future(channel).result(timeout=10)


def test_the_factory_starts_independent_brokers_and_restarts_keep_the_data(txmq_broker_factory):
    a, b = txmq_broker_factory(), txmq_broker_factory(flush="sync")
    assert a.port != b.port and a.data_dir != b.data_dir
    a.client.send("orders", b"kept")
    old = a.address
    a.restart()
    assert a.address != old and _refused(old)  # a restart binds a new free port
    with a.consumer("audit", "orders") as consumer:
        assert [m.body for m in consumer.poll(timeout=10)] == [b"kept"]
    with b.consumer("audit", "orders") as consumer:
        assert consumer.poll(timeout=0.2) == []


def test_an_unknown_option_fails_the_start_and_leaves_no_thread(txmq_broker_factory):
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(TypeError, match="no_such_option"):
        txmq_broker_factory(no_such_option=1)
    assert {t.name for t in threading.enumerate()} - before == set()


@pytest.fixture(scope="module")
def module_broker(tmp_path_factory):
    with start_broker(tmp_path_factory.mktemp("shared"), flush="sync") as broker:
        yield broker


@pytest.mark.parametrize("n", [1, 2])
def test_start_broker_serves_a_module_scoped_fixture(module_broker, n):
    """One broker for the module: the second test sees what the first sent."""
    module_broker.client.send("shared", b"%d" % n)
    with module_broker.consumer(f"reader-{n}", "shared") as consumer:
        got: list = []
        while len(got) < n and (batch := consumer.poll(timeout=10)):  # a poll returns what has arrived from any queue
            got += batch
    assert sorted(m.body for m in got) == [b"%d" % i for i in range(1, n + 1)]


USER_TESTS = """
import pytest


def note(*addresses):
    with open("addresses.txt", "a") as f:  # the inner session runs in pytester's directory
        f.writelines(a + "\\n" for a in addresses)


def test_send_and_consume(txmq_broker):
    note(txmq_broker.address)
    txmq_broker.client.send("orders", b"hello")
    with txmq_broker.consumer("audit", "orders") as consumer:
        assert [m.body for m in consumer.poll(timeout=10)] == [b"hello"]


@pytest.mark.txmq(rocketmq=True, flush="sync")
def test_marked(txmq_broker):
    note(txmq_broker.address, txmq_broker.rocketmq_address)
    assert txmq_broker.running.broker.config.flush == "sync"


def test_two(txmq_broker_factory):
    a, b = txmq_broker_factory(), txmq_broker_factory()
    note(a.address, b.address)
    b.producer().send("orders", b"left open")  # the fixture closes what the test left open
    b.consumer("audit", "orders")
"""


def test_a_users_session_uses_the_fixtures_and_leaves_no_broker_running(pytester):
    """No conftest: the inner session finds the fixtures and the marker through the entry point."""
    pytester.makepyfile(test_app=USER_TESTS)
    before = {t.name for t in threading.enumerate()}
    result = pytester.runpytest("--strict-markers", "-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=3)
    addresses = (pytester.path / "addresses.txt").read_text().split()
    assert len(addresses) == 5
    for address in addresses:
        assert _refused(address), address
    assert {t.name for t in threading.enumerate()} - before == set()


def test_a_users_session_lists_the_marker(pytester):
    result = pytester.runpytest("--markers", "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["@pytest.mark.txmq(rocketmq=False, **options):*"])
