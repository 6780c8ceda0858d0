"""Apache RocketMQ 5's gRPC service (apache.rocketmq.v2.MessagingService) as a second front end of the broker.

RocketMQ's official SDKs (Java, Go, Python, Node.js, ...) talk to txmq
through it, unmodified; txmq's own msgpack protocol stays as it is. Every
request is translated into the messaging service's calls (broker/messaging/),
the ones the native handlers make, so one transaction has one outcome
whichever protocol sent or ended it, and the
operator's commands see SDK transactions like native ones. docs/rocketmq.md
describes the RPCs, the id and group mappings and the limits.

Modules: ``pb`` (generated from the .proto files beside it at build time),
``convert`` (stored records <-> RocketMQ ``Message``), ``status`` (txmq
errors -> RocketMQ status codes), ``clients`` (SDK clients, their settings
and Telemetry streams; a stream is a check-back target), ``producer``
(send and end transaction), ``service`` (every RPC), ``limits`` (what one
client may hold open: long polls, Telemetry streams), ``server`` (the
grpc.aio server on the broker's event loop).

This package needs the ``rocketmq`` extra (grpcio, protobuf): nothing here
imports them at import time, so ``missing_dependency()`` can say what is
missing before anything is started.
"""

from __future__ import annotations

EXTRA_HINT = "install txmq with its rocketmq extra: pip install '.[rocketmq]' in a checkout, or 'dist/txmq-...whl[rocketmq]' (README, Install)"


def missing_dependency() -> str | None:
    """Why the RocketMQ front end cannot run here (grpcio, protobuf or the generated modules missing), or None."""
    try:
        import grpc  # noqa: F401
        import grpc.aio  # noqa: F401
        import google.protobuf  # noqa: F401
    except ImportError as exc:
        return f"the RocketMQ gRPC front end needs grpcio and protobuf ({exc}); {EXTRA_HINT}"
    try:
        from .pb import definition_pb2, service_pb2  # noqa: F401
    except ImportError as exc:
        return (f"the RocketMQ gRPC front end's protobuf modules are not built ({exc}); reinstall txmq "
                "(pip install -e . or a wheel: setup.py generates them with grpcio-tools)")
    except Exception as exc:  # e.g. a protobuf runtime older than the generated code
        return f"the RocketMQ gRPC front end's protobuf modules cannot be loaded ({exc}); {EXTRA_HINT}"
    return None
