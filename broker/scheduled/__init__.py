"""Delayed and timed messages (txmq.broker.scheduled): RocketMQ's timer, over txmq's log.

A send whose properties ask for a later delivery (``DELAY``, ``TIMER_DELIVER_MS``,
``TIMER_DELAY_SEC``, ``TIMER_DELAY_MS``) is stored in the system topic
``RMQ_SYS_TXMQ_TIMER``; when it comes due it is written again to its real
topic (docs/scheduled.md, docs/store-format.md). Split as broker/transactions/ is:

| module | holds |
| --- | --- |
| ``service`` | ``ScheduleService``: the send path, the delivery task, cancels; it builds the keeper and the admin, and is what the broker core holds |
| ``keeper`` | ``TimerKeeper``: ``timers.db`` in a live broker (built or rebuilt at start, replayed from ``applied_to``, flushed, closed, on broker/indexlife.py's life), the rows in memory, the delivery window, damaged rows |
| ``admin`` | ``ScheduleAdmin``: what operators see (listings, gauges) |
| ``indexfile`` | ``TimerDatabase``: the file ``timers.db`` (SQLite), each row with its checksum (broker/sqlitefile.py) |
| ``indexcheck`` | the file checked against the log (a start's meta check, ``txmq store verify``) |
| ``timing`` | the properties that ask for a later time, and the due time they give |

None of them imports the core, a front end or the transaction subsystem.
``indexfile``, ``indexcheck`` and ``timing`` are synchronous and also serve
the CLI on a data directory offline.
"""
