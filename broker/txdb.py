"""Moved to broker/transactions/indexfile.py (`txmq.broker.transactions.indexfile`); this name is kept for imports."""

from .transactions.indexfile import *  # noqa: F401,F403
