import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from rocketmq_peer import rocketmq_peer  # noqa: E402,F401  the session's RocketMQ 4.9.8 (tests marked rocketmq_peer)

REPO = Path(__file__).resolve().parent.parent


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


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`make test` runs the suite on several workers, `--dist loadgroup`), the tests beside one
    heavy shared thing run on one worker: the session's RocketMQ peer (two JVMs) and Spark (its JVM, the class-data
    archive) start once, not once per worker."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        if item.get_closest_marker("rocketmq_peer") is not None:
            item.add_marker(pytest.mark.xdist_group("rocketmq_peer"))
        elif item.get_closest_marker("spark") is not None:
            item.add_marker(pytest.mark.xdist_group("spark"))
