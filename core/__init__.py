"""txmq: a RocketMQ-style transactional message broker.

The installed package maps the repository's top-level folders under one
namespace: ``txmq`` itself (core/, this folder), ``txmq.store`` (store/),
``txmq.broker`` (broker/), ``txmq.client`` (client/), ``txmq.cli`` (cli/),
``txmq.spark`` (spark/). ``txmq.wire`` and ``txmq.constants`` live here
because both the broker and the client need them and neither may import the
other. This folder is not called ``txmq/`` on purpose: Python puts the
working directory first on ``sys.path`` (``python -m``, ``python -c``,
Spark's Python workers), so such a folder would hide the installed package
for anyone working in the repository root.
"""

__version__ = "0.1.0"
