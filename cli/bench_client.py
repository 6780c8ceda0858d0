"""Moved to client/bench_client.py (`txmq.client.bench_client`); this name is kept for imports."""

from txmq.client.bench_client import *  # noqa: F401,F403
