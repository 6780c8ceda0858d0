"""The gRPC stack's own cost: an empty unary call on a grpc.aio server on uvloop, as the RocketMQ front end runs it.

The bound that benchmarks/rocketmq_sdk.py prints beside an SDK transaction's broker CPU: the front end
cannot cost less per call than the stack it runs on, and an SDK transaction is two calls (SendMessage,
then EndTransaction).

- ``serve`` (txmq's interpreter): uvloop, ``grpc.aio.server`` with the front end's own channel arguments
  and concurrency cap (txmq.broker.rocketmq.server.server_options), one method whose handler returns
  an empty response for any request, without (de)serializers. Prints ``{"port": P}``, serves until its
  stdin closes.
- ``serve --rocketmq``: the same server with RocketMQ's MessagingService instead, each RPC parsed and
  answered at once with what an SDK producer needs (a route, its settings echoed on Telemetry, a receipt
  for each message, OK for everything else): nothing is checked, stored or fsynced. What the gRPC stack
  and protobuf cost under the SDK's own calls, at the SDK's own pace (benchmarks/rocketmq_sdk.py runs
  its SDK load against it: "no-op front end").
- ``load`` (the SDK's interpreter, so the client stack is the SDK's: grpc.aio on its own thread's
  loop): --producers callers, each on a channel of its own with the SDK's channel arguments, each back
  to back: one empty call with the 8 metadata headers the SDK signs every request with, the next when
  it is answered. The protocol with the driver is benchmarks/rocketmq_sdk_load.py's (ready, the
  window, the result), so the driver measures both the same way.

    .venv/bin/python benchmarks/grpc_empty.py serve
    SDK_PYTHON benchmarks/grpc_empty.py load --endpoint 127.0.0.1:P --producers 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
import uuid

METHOD = "/txmq.bench.Empty/Call"
# What the SDK sends with every request (rocketmq/v5/util/signature.py): 8 headers.
SDK_METADATA = (
    ("x-mq-language", "PYTHON"),
    ("x-mq-protocol", "GRPC_V2"),
    ("x-mq-client-version", "5.1.2"),
    ("x-mq-date-time", "20260101T000000Z"),
    ("x-mq-request-id", ""),
    ("x-mq-client-id", ""),
    ("x-mq-namespace", ""),
    ("authorization", "MQv2-HMAC-SHA1 Credential=, SignedHeaders=x-mq-date-time, Signature=" + "0" * 40),
)
# The SDK's channel arguments (rocketmq/v5/client/connection/rpc_channel.py).
SDK_CHANNEL_OPTIONS = [("grpc.enable_retries", 0), ("grpc.max_send_message_length", -1),
                       ("grpc.max_receive_message_length", -1), ("grpc.use_local_subchannel_pool", 1)]


# ---- serve ---------------------------------------------------------------------------------
async def serve(rocketmq: bool) -> None:
    import grpc
    from grpc import aio

    from txmq import defaults
    from txmq.broker.rocketmq.server import MAX_CONCURRENT_RPCS, server_options
    from txmq.broker.rocketmq.settings import MESSAGE_OVERHEAD

    async def call(request: bytes, context: object) -> bytes:
        return b""

    options = server_options(defaults.MAX_BODY + defaults.MAX_PROPERTIES + MESSAGE_OVERHEAD, 4096, None)
    server = aio.server(options=options, maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS)
    handler = grpc.unary_unary_rpc_method_handler(call)  # no (de)serializers: bytes in, bytes out
    port = server.add_insecure_port("127.0.0.1:0")
    if rocketmq:
        server.add_generic_rpc_handlers((rocketmq_noop_handlers(port),))
    else:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("txmq.bench.Empty", {"Call": handler}),))
    await server.start()
    print(json.dumps({"port": port, "pid": os.getpid()}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the driver closes stdin
    await server.stop(0)


def rocketmq_noop_handlers(port: int):  # noqa: ANN201 - a grpc.GenericRpcHandler
    """MessagingService answering every RPC at once, nothing checked or stored (see ``serve --rocketmq``)."""
    import grpc

    from txmq.broker.rocketmq.pb import definition_pb2 as d
    from txmq.broker.rocketmq.pb import service_pb2 as s
    from txmq.broker.rocketmq.server import SERVICE
    from txmq.broker.rocketmq.status import OK_STATUS, status

    here = d.Endpoints(scheme=d.IPv4, addresses=[d.Address(host="127.0.0.1", port=port)])
    kinds = [d.NORMAL, d.FIFO, d.DELAY, d.TRANSACTION]

    async def query_route(req, context):  # noqa: ANN001, ANN202
        mq = d.MessageQueue(id=0, permission=d.READ_WRITE, accept_message_types=kinds)
        mq.topic.name = req.topic.name
        mq.broker.name = "noop"
        mq.broker.endpoints.CopyFrom(here)
        return s.QueryRouteResponse(status=OK_STATUS, message_queues=[mq])

    async def send_message(req, context):  # noqa: ANN001, ANN202
        resp = s.SendMessageResponse(status=OK_STATUS)
        for m in req.messages:
            mid = m.system_properties.message_id
            resp.entries.add(status=OK_STATUS, message_id=mid, transaction_id=mid, offset=0)
        return resp

    async def telemetry(requests, context):  # noqa: ANN001, ANN202
        async for cmd in requests:
            if cmd.WhichOneof("command") == "settings":
                await context.write(s.TelemetryCommand(status=OK_STATUS, settings=cmd.settings))

    def answer(resp_cls):  # noqa: ANN001, ANN202
        async def ok(req, context):  # noqa: ANN001, ANN202
            return resp_cls(status=OK_STATUS)
        return ok

    handlers = {}
    for m in s.DESCRIPTOR.services_by_name["MessagingService"].methods:
        req_cls, resp_cls = getattr(s, m.input_type.name), getattr(s, m.output_type.name)
        if m.name == "Telemetry":
            handlers[m.name] = grpc.stream_stream_rpc_method_handler(
                telemetry, request_deserializer=req_cls.FromString, response_serializer=resp_cls.SerializeToString)
            continue
        if m.server_streaming:  # ReceiveMessage, PullMessage: a producer never calls them
            async def refuse(req, context, resp_cls=resp_cls):  # noqa: ANN001, ANN202
                yield resp_cls(status=status(d.UNSUPPORTED, "no-op front end"))
            handlers[m.name] = grpc.unary_stream_rpc_method_handler(
                refuse, request_deserializer=req_cls.FromString, response_serializer=resp_cls.SerializeToString)
            continue
        impl = {"QueryRoute": query_route, "SendMessage": send_message}.get(m.name) or answer(resp_cls)
        handlers[m.name] = grpc.unary_unary_rpc_method_handler(
            impl, request_deserializer=req_cls.FromString, response_serializer=resp_cls.SerializeToString)
    return grpc.method_handlers_generic_handler(SERVICE, handlers)


# ---- load ----------------------------------------------------------------------------------
def load(endpoint: str, producers: int, warmup: int, max_latencies: int) -> None:
    from grpc import aio

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()  # as the SDK: grpc.aio on a thread of its own

    def run(coro):  # noqa: ANN001, ANN202
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    async def make() -> list:
        out = []
        for _ in range(producers):
            ch = aio.insecure_channel(endpoint, SDK_CHANNEL_OPTIONS)
            out.append((ch, ch.unary_unary(METHOD), str(uuid.uuid4())))
        return out

    callers = run(make())

    def metadata(client_id: str) -> tuple:
        md = dict(SDK_METADATA)
        md["x-mq-request-id"] = str(uuid.uuid4())
        md["x-mq-client-id"] = client_id
        return tuple(md.items())

    async def warm() -> None:
        for _ in range(warmup):
            await asyncio.gather(*(stub(b"", metadata=metadata(cid), timeout=10) for _, stub, cid in callers))

    run(warm())
    print(json.dumps({"ready": True, "producers": producers, "pid": os.getpid()}), flush=True)
    window = json.loads(sys.stdin.readline())
    start, end = float(window["start"]), float(window["end"])
    latencies: list[float] = []
    errors: dict[str, int] = {}
    completed = [0]

    async def caller(stub, client_id: str) -> None:  # noqa: ANN001
        await asyncio.sleep(max(0.0, start - time.time()))
        while True:
            t0 = time.time()
            if t0 >= end:
                return
            try:
                await stub(b"", metadata=metadata(client_id), timeout=10)
            except Exception as e:  # noqa: BLE001 - counted and reported
                errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
                continue
            completed[0] += 1
            if len(latencies) < max_latencies:
                latencies.append((time.time() - t0) * 1000.0)

    async def all_callers() -> None:
        await asyncio.gather(*(caller(stub, cid) for _, stub, cid in callers))

    cpu0 = time.process_time()
    run(all_callers())
    cpu = time.process_time() - cpu0
    print(json.dumps({"completed": completed[0], "latency_ms": [round(x, 3) for x in latencies], "errors": errors,
                      "cpu_s": round(cpu, 3), "producers": producers}), flush=True)

    async def close() -> None:
        for ch, _, _ in callers:
            await ch.close()

    run(close())
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("serve", help="the server (txmq's interpreter)")
    sp.add_argument("--rocketmq", action="store_true", help="RocketMQ's MessagingService answering at once, not an empty call")
    lp = sub.add_parser("load", help="the callers (the SDK's interpreter)")
    lp.add_argument("--endpoint", required=True)
    lp.add_argument("--producers", type=int, default=1)
    lp.add_argument("--warmup", type=int, default=20, help="calls per caller before ready")
    lp.add_argument("--max-latencies", type=int, default=200_000)
    for ignored in ("--topic", "--size"):  # the SDK loader's arguments, which the driver passes to both
        lp.add_argument(ignored, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.cmd == "serve":
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
        asyncio.run(serve(a.rocketmq))
    else:
        load(a.endpoint, a.producers, a.warmup, a.max_latencies)


if __name__ == "__main__":
    main()
