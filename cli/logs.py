"""Moved to broker/logs.py (`txmq.broker.logs`); this name is kept for imports."""

from txmq.broker.logs import *  # noqa: F401,F403
from txmq.broker.logs import _KV, _PLAIN, _SPEC, _TOKEN, _fields, _kv_value  # noqa: F401
