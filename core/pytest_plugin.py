"""pytest fixtures for applications that use txmq: a real broker per test, on a free port.

Installed with txmq and loaded by pytest on its own (entry point group
``pytest11``, name ``txmq``)::

    from txmq.client import Message, SyncConsumer

    def test_order_is_published(txmq_broker):
        txmq_broker.client.send("orders", b'{"order": 1}')          # a ready SyncProducer
        with txmq_broker.consumer("audit", "orders") as consumer:    # closed for you anyway
            (msg,) = consumer.poll(timeout=5)
        assert msg.body == b'{"order": 1}'

    @pytest.mark.txmq(rocketmq=True, flush="sync")
    def test_with_an_sdk(txmq_broker):
        endpoints = txmq_broker.rocketmq_address                      # "127.0.0.1:<port>"

    def test_two_brokers(txmq_broker_factory):
        a, b = txmq_broker_factory(), txmq_broker_factory(auth_token="s3cret")

Each broker is the real one (``txmq.broker``), run in the test process on a
thread of its own with its own event loop (uvloop where installed), on
127.0.0.1 and a port the system picked, over a new data directory under
pytest's temporary directory. Starting one takes milliseconds, not the
~0.3 s of a new Python process, and its log lines go to pytest's log
capture. The price is sharing the process: a broker that crashed would take
the test run with it, and it cannot be killed like a process (run
``txmq broker start`` as a subprocess for that). A broker is stopped cleanly
(the same shutdown as SIGTERM) when its test ends; an error the broker hit
fails that test's teardown.

The options are `txmq.broker.config.BrokerConfig`'s fields (``flush``,
``auth_token``, ``auto_create_topics``, ``max_body``, ...) and the check
settings in seconds (``check_interval_s``, ``transaction_timeout_s``,
``max_checks``, ``retention_s``); ``rocketmq=True`` also serves RocketMQ 5's
gRPC service (needs the ``txmq[rocketmq]`` extra) on a free port.

This module imports only pytest and the standard library when pytest loads
it: the broker and the client are imported when a fixture is first used.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from txmq.broker.testing import RunningBroker
    from txmq.client import SyncConsumer, SyncProducer, SyncTransactionProducer

__all__ = ["TxmqBroker", "start_broker"]

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 60.0


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "txmq(rocketmq=False, **options): options of the broker the txmq_broker fixture starts "
        "(BrokerConfig fields such as flush='sync' or auth_token='...', check settings such as check_interval_s=1)",
    )


class TxmqBroker:
    """A broker running on a background thread; `start()` it, `stop()` it (or use it as a context manager).

    ``address`` (``"127.0.0.1:<port>"``), ``host``, ``port`` and
    ``data_dir`` say where it is; ``rocketmq_address`` and ``rocketmq_port``
    where its gRPC service listens (None unless started with
    ``rocketmq=True``). ``client`` is a connected `SyncProducer`;
    `producer()`, `transaction_producer()` and `consumer()` make more
    clients (with the broker's ``auth_token``), all closed by `stop()`.
    """

    def __init__(self, data_dir: str | Path, *, rocketmq: bool = False, **options: Any) -> None:
        self.data_dir = Path(data_dir)
        if rocketmq:
            options.setdefault("rocketmq_port", 0)  # 0: a free port
        self.options = options
        self.token: str | None = options.get("auth_token")
        self.host = "127.0.0.1"
        self.port = 0
        self.address = ""
        self.rocketmq_port: int | None = None
        self.rocketmq_address: str | None = None
        self.running: RunningBroker | None = None  # the broker's own objects (`.broker`, `.core`), for white-box tests
        self._thread: threading.Thread | None = None
        self._loop: Any = None
        self._shutdown: Any = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._clients: list[Any] = []
        self._client: SyncProducer | None = None

    # --- running

    def start(self) -> TxmqBroker:
        """Start the broker and return once it serves (a transaction index loaded, front ends listening)."""
        if self._thread is not None:
            raise RuntimeError("this broker is already started")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._started.clear()
        self._error = None
        self._thread = threading.Thread(target=self._run, name=f"txmq-broker-{self.data_dir.name}", daemon=True)
        self._thread.start()
        if not self._started.wait(START_TIMEOUT_S):
            raise TimeoutError(f"the txmq broker on {self.data_dir} did not start within {START_TIMEOUT_S:g}s")
        if self._error is not None:
            self._thread.join(STOP_TIMEOUT_S)
            self._thread = None
            raise self._error
        return self

    def stop(self) -> None:
        """Close the clients made here, shut the broker down cleanly and raise any error it hit."""
        clients, self._clients, self._client = self._clients, [], None
        for client in reversed(clients):
            with contextlib.suppress(Exception):  # a client the test closed, or whose connection is gone
                client.close()
        thread, self._thread = self._thread, None
        if thread is None:
            return
        if self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop ended on its own (the broker failed)
                self._loop.call_soon_threadsafe(self._shutdown.set)
        thread.join(STOP_TIMEOUT_S)
        if thread.is_alive():
            raise TimeoutError(f"the txmq broker on {self.data_dir} did not stop within {STOP_TIMEOUT_S:g}s")
        self.running = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def restart(self) -> TxmqBroker:
        """Stop and start again on the same data directory (new ports): what survives a clean restart."""
        self.stop()
        return self.start()

    def _run(self) -> None:
        import asyncio

        try:
            import uvloop

            factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
        except ImportError:
            factory = asyncio.new_event_loop
        try:
            with asyncio.Runner(loop_factory=factory) as runner:
                runner.run(self._serve())
        except BaseException as exc:  # reported by start() or stop() in the test's thread
            self._error = self._error or exc
        finally:
            self._started.set()

    async def _serve(self) -> None:
        import asyncio

        from txmq.broker.testing import running_broker

        self._loop = asyncio.get_running_loop()
        self._shutdown = asyncio.Event()
        async with running_broker(self.data_dir, **self.options) as rb:
            self.running = rb
            self.port, self.address = rb.port, rb.address
            self.rocketmq_port, self.rocketmq_address = rb.rocketmq_port, rb.rocketmq_address
            self._started.set()
            await self._shutdown.wait()

    def __enter__(self) -> TxmqBroker:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # --- clients

    @property
    def client(self) -> SyncProducer:
        """A connected `txmq.client.SyncProducer` (also good for admin requests: ``client.request("broker_info")``)."""
        if self._client is None:
            self._client = self.producer()
        return self._client

    def producer(self, **options: Any) -> SyncProducer:
        from txmq.client import SyncProducer

        return self._keep(SyncProducer(self.address, self.token, **options))

    def transaction_producer(self, group: str, listener: Any, **options: Any) -> SyncTransactionProducer:
        from txmq.client import SyncTransactionProducer

        return self._keep(SyncTransactionProducer(group, listener, self.address, self.token, **options))

    def consumer(self, group: str, topic: str, **options: Any) -> SyncConsumer:
        from txmq.client import SyncConsumer

        return self._keep(SyncConsumer(group, topic, self.address, self.token, **options))

    def _keep(self, client: Any) -> Any:
        if self._thread is None:
            client.close()
            raise RuntimeError("the txmq broker is not running")
        self._clients.append(client)
        return client

    def __repr__(self) -> str:
        state = f"on {self.address}" if self._thread is not None else "stopped"
        return f"<TxmqBroker {state} data_dir={str(self.data_dir)!r}>"


@contextlib.contextmanager
def start_broker(data_dir: str | Path, *, rocketmq: bool = False, **options: Any) -> Iterator[TxmqBroker]:
    """``with start_broker(dir, flush="sync") as broker:``: a broker for any scope (a session fixture, a script)."""
    with TxmqBroker(data_dir, rocketmq=rocketmq, **options) as broker:
        yield broker


@pytest.fixture
def txmq_broker_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., TxmqBroker]]:
    """``txmq_broker_factory(rocketmq=False, **options)`` starts a broker on a new data directory; all stop after the test."""
    brokers: list[TxmqBroker] = []

    def factory(*, rocketmq: bool = False, data_dir: str | Path | None = None, **options: Any) -> TxmqBroker:
        broker = TxmqBroker(data_dir or tmp_path_factory.mktemp("txmq-broker"), rocketmq=rocketmq, **options)
        brokers.append(broker)
        return broker.start()

    yield factory
    errors = []
    for broker in reversed(brokers):
        try:
            broker.stop()
        except Exception as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


@pytest.fixture
def txmq_broker(request: pytest.FixtureRequest, txmq_broker_factory: Callable[..., TxmqBroker]) -> TxmqBroker:
    """A running broker for this test; ``@pytest.mark.txmq(rocketmq=True, flush="sync", ...)`` sets its options."""
    marker = request.node.get_closest_marker("txmq")
    if marker is not None and marker.args:
        raise TypeError("@pytest.mark.txmq takes keyword arguments only, e.g. @pytest.mark.txmq(rocketmq=True)")
    return txmq_broker_factory(**(marker.kwargs if marker is not None else {}))
