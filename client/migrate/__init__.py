"""`txmq migrate`: a txmq broker's backlog, consumer positions and schedule moved onto a RocketMQ 4 cluster.

``plan`` reads both sides and says what will move; ``state`` keeps the progress durably; ``mover`` moves it.
Reads txmq through the native protocol (``txmq.client.Client``) and writes to RocketMQ through its remoting
protocol (``txmq.client.rocketmq4``). docs/migrate.md is the runbook.
"""
