"""Moved to broker/transactions/check.py (`txmq.broker.transactions.check`); this name is kept for imports."""

from .transactions.check import *  # noqa: F401,F403
