import asyncio
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from rocketmq_peer import rocketmq_peer  # noqa: E402,F401  the session's RocketMQ 4.9.8 (tests marked rocketmq_peer)

REPO = Path(__file__).resolve().parent.parent

# `make test-workers`: the RocketMQ 5 and 4 suites again, their ports served by front-end worker processes. The
# subprocess brokers get --frontend-processes from tests/sdkenv.py; the in-process ones from here.
_FRONTEND_PROCESSES = os.environ.get("TXMQ_TEST_FRONTEND_PROCESSES")
# `broker start`'s default (auto) depends on the machine's cores: the suite is the same on every machine
os.environ["TXMQ_FRONTEND_PROCESSES"] = _FRONTEND_PROCESSES or "0"
if _FRONTEND_PROCESSES:
    import txmq.broker.testing as _testing

    _running_broker = _testing.running_broker

    def _running_broker_through_workers(data_dir, clock=None, **overrides):
        if overrides.get("rocketmq_port") is not None or overrides.get("remoting_port") is not None:
            overrides.setdefault("frontend_processes", int(_FRONTEND_PROCESSES))
        return _running_broker(data_dir, clock, **overrides)

    _testing.running_broker = _running_broker_through_workers


def arun(coro):
    """Run a coroutine to completion on a fresh event loop (pytest-asyncio is not used)."""
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


async def eventually(pred, timeout: float = 30.0, what: str = "condition", every: float = 0.02):
    """Wait until pred() (or its awaited result) is true; timeout is an upper bound for a loaded machine, never a margin."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        v = pred()
        if asyncio.iscoroutine(v):
            v = await v
        if v:
            return v
        assert loop.time() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        await asyncio.sleep(every)


@pytest.fixture
def data_dir(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    return d


# Tests that build the single executable, the zipapp, the wheel or the image share build/ and dist/: where the suite
# runs on several workers (`make test TEST_WORKERS=3`: pytest-xdist, each test file on one worker), one at a time.
BUILDS = {"test_binary.py", "test_single_binary.py", "test_install_layout.py", "test_build_targets.py", "test_container_image.py",
          "test_binary_cache_trust.py"}


@pytest.fixture(autouse=True)
def _one_build_at_a_time(request):
    if request.node.path.name not in BUILDS:
        yield
        return
    import fcntl

    lock_dir = REPO / "build"
    lock_dir.mkdir(exist_ok=True)
    with open(lock_dir / ".tests-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


@pytest.fixture(scope="session")
def spark_session():
    """One local SparkSession (local[2], txmq's data source registered) for every test module that reads through Spark:
    a driver JVM started once, not once per module. Tests that change a session setting set it back."""
    from txmq.spark.session import missing_dependency, missing_java

    problem = missing_dependency() or missing_java()
    if problem:
        pytest.skip(problem)
    from txmq.spark import session as sess
    from txmq.spark.source import TxmqDataSource

    s = sess.start("local[2]", {"spark.sql.shuffle.partitions": "2"})
    s.spark.dataSource.register(TxmqDataSource)
    yield s.spark
    s.stop()
    sess.cleanup(s)


@pytest.fixture
def spark(spark_session):
    """The session's one SparkSession (spark_session), under the name the Spark tests use."""
    return spark_session
