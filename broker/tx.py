"""Moved to broker/transactions/service.py (`txmq.broker.transactions.service`); this name is kept for imports."""

from .transactions.service import *  # noqa: F401,F403
