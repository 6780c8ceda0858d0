"""txmq's own msgpack protocol (docs/protocol.md) as a front end of the broker, beside broker/rocketmq/.

Like every front end it translates requests into calls of the broker's
services (the core's append and pull, ``core.tx``, ``core.admin``,
``core.check``, broker/groups.py). Modules: ``connection``
(``BrokerConnection``: framing, limits, dispatch, replies), ``registry``
(the operation table and the field checks), ``handlers`` and
``grouphandlers`` (one function per operation).
"""

# Whichever module of the package is imported first, the operation table is complete.
from . import grouphandlers, handlers  # noqa: F401
