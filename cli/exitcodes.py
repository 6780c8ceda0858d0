"""Stable exit codes of the txmq CLI (documented in docs/cli.md)."""

OK = 0
ERROR = 1  # anything not listed below
USAGE = 2  # bad arguments or bad input (click's own usage errors use 2 as well)
UNREACHABLE = 3  # no broker answers at the address
REFUSED = 4  # the broker refused us: wrong or missing token
NOT_FOUND = 5  # a named transaction, offset or topic does not exist
CONFLICT = 6  # the transaction was already decided the other way / discarded
PARTIAL = 7  # a bulk operation where some items failed
STORE_FULL = 8  # the broker's disk is full
MISSING_DEPENDENCY = 9  # e.g. pyspark or Java for spark-export
DATA_PROBLEM = 10  # `txmq store verify` found problems in the data directory
IN_USE = 11  # the data directory is locked by a running broker (`txmq store repair`)
NOT_TXMQ = 12  # something answers at the address, but not a txmq broker (another service's port)
INTERRUPTED = 130
