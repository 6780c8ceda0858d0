"""Moved to broker/transactions/checkcopy.py (`txmq.broker.transactions.checkcopy`); this name is kept for imports."""

from .transactions.checkcopy import *  # noqa: F401,F403
