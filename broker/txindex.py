"""Moved to broker/transactions/index.py (`txmq.broker.transactions.index`); this name is kept for imports."""

from .transactions.index import *  # noqa: F401,F403
from .transactions.index import _int  # noqa: F401
