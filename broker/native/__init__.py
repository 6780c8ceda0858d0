"""txmq's own msgpack protocol (docs/protocol.md) as a front end of the broker, beside broker/rocketmq/.

``server`` (``NativeFrontend``) listens, ``connection`` (``BrokerConnection``)
frames, limits and dispatches, ``operations`` holds the operation table and
the field checks, ``handlers`` and ``grouphandlers`` translate each
operation into the messaging service's calls (``Messaging`` for clients'
operations, ``Operations`` for the operator's: broker/messaging/).
"""

# Whichever module of the package is imported first, the operation table is complete.
from . import grouphandlers, handlers  # noqa: F401
