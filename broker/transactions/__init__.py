"""The transaction subsystem: half messages, end transaction, check-back, discard (docs/transactions.md).

One concept per module, in Apache RocketMQ's vocabulary:

| module | holds |
| --- | --- |
| ``service`` | ``TransactionService`` (RocketMQ's TransactionalMessageService): half messages, end transaction, ``decide``, discard records, start-up commit repair |
| ``admin`` | ``TransactionAdmin``: the operator's operations (resolve, resolve-where, discard list and replay, pending listing, history) |
| ``check`` | ``CheckService`` (TransactionalMessageCheckService) and its progress file ``txcheck.json`` |
| ``checkcopy`` | the check pass's byte-level hot path: check-copy properties and check-back pushes |
| ``keeper`` | ``IndexKeeper``: the index file in a live broker (load or rebuild at start, flushes, close: the life of broker/indexlife.py, shared with the schedule's index) and the gate transactional requests wait at until the index is ready |
| ``index`` | ``TxIndex``: pending transactions in memory, outcomes, the replay of the log |
| ``indexfile`` | ``TxDatabase``: the index file ``txindex.db`` (SQLite), each row with its checksum |
| ``indexcheck`` | the index file's rows checked against the log (a start's last decisions, ``txmq store verify``) |
| ``history`` | one transaction's history, read from the log and the index |

The broker core (broker/core.py) builds them, in ``BrokerCore.open``, each
with what it uses (the appender, the store, the flusher...); none of them
imports the core.
``index``, ``indexfile``, ``indexcheck``, ``history`` and ``check``'s ``CheckProgress`` are
synchronous and also serve the CLI on a data directory offline.
"""
