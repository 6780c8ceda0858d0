"""Moved to client/bench.py (`txmq.client.bench`); this name is kept for imports."""

from txmq.client.bench import *  # noqa: F401,F403
from txmq.client.bench import _Gen, _packb, _unpackb  # noqa: F401
