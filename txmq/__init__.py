"""txmq: a RocketMQ-style transactional message broker.

The installed package maps the repository's top-level folders under one
namespace: ``txmq.store`` (store/), ``txmq.broker`` (broker/),
``txmq.client`` (client/), ``txmq.cli`` (cli/), ``txmq.spark`` (spark/).
``txmq.wire`` and ``txmq.constants`` live here because both the broker and
the client need them and neither may import the other.
"""

__version__ = "0.1.0"
