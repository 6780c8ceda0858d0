"""RocketMQ 5's protobuf messages and gRPC service (package ``apache.rocketmq.v2``), generated at build time.

``definition.proto`` and ``service.proto`` here hold the messages txmq uses,
with the names and field numbers of apache/rocketmq-apis; setup.py
(build_py) turns them into ``definition_pb2``, ``service_pb2`` and
``service_pb2_grpc`` with grpcio-tools. The generated modules are not kept
in git.

They register ``apache.rocketmq.v2.*`` in protobuf's default descriptor
pool, as RocketMQ's Python SDK does with its own copy: the two cannot be
loaded into one process.
"""
