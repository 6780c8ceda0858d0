"""RocketMQ 4's remoting frames: the codec is shared with the client (``txmq.remoting_codec``, core/remoting_codec.py)."""

from txmq.remoting_codec import *  # noqa: F401,F403
