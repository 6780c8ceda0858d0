"""Moved to broker/transactions/history.py (`txmq.broker.transactions.history`); this name is kept for imports."""

from .transactions.history import *  # noqa: F401,F403
