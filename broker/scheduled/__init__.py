"""Delayed and timed messages (txmq.broker.scheduled): RocketMQ's timer, over txmq's log.

A send whose properties ask for a later delivery (``DELAY``, ``TIMER_DELIVER_MS``,
``TIMER_DELAY_SEC``, ``TIMER_DELAY_MS``) is stored in the system topic
``RMQ_SYS_TXMQ_TIMER``; when it comes due it is written again to its real
topic. ``timing.py`` reads the properties, ``indexfile.py`` is the on-disk
index (``timers.db``), ``indexcheck.py`` checks it against the log (a
start's meta check, ``txmq store verify``), ``service.py`` the service and
its lifecycle (docs/scheduled.md, docs/store-format.md).
"""
