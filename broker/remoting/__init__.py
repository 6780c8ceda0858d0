"""RocketMQ 4's remoting protocol (name server and broker requests on one port): docs/remoting.md.

Attached by the start-up (``txmq.broker.main``, ``txmq.broker.testing``)
with ``--remoting-port``; nothing else of the broker imports this package.
"""
