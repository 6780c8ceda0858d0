"""Every line the broker writes to stderr is one structured line, also when an error reaches no handler of its own.

- SDK producers whose Telemetry streams go away while check-backs are being
  written to them: the writes that fail on the dead streams are handled
  (broker/rocketmq/clients.py, ``write_command``), so nothing reaches
  asyncio's "Task exception was never retrieved" report;
- anything that still would (a task or callback whose exception nobody
  retrieves) is one ``event=loop_exception`` line through the loop's
  exception handler that ``txmq broker start`` installs (broker/logs.py,
  broker/main.py), in either log format.
"""

from __future__ import annotations

import asyncio
import gc
import io
import json
import logging
import subprocess
import sys
import textwrap

import pytest

from brokerproc import BrokerProcess, free_port
from conftest import arun
from sdkenv import create_topics, wait_for_port
from txmq.broker import logs

KV_LINE = r"^ts=\S+ level=\w+ logger=\S+ "


def assert_structured(text: str, fmt: str = "kv") -> list[str]:
    lines = text.splitlines()
    for line in lines:
        if fmt == "json":
            obj = json.loads(line)
            assert {"ts", "level", "logger"} <= obj.keys(), line
        else:
            assert line.startswith("ts=") and " level=" in line and " logger=" in line, f"not a key=value line: {line!r}"
    return lines


@pytest.mark.slow
def test_telemetry_streams_gone_with_check_backs_being_written_leave_no_traceback(tmp_path):
    grpc = pytest.importorskip("grpc", reason="the rocketmq extra (grpcio) is not installed")
    from txmq.broker.rocketmq import missing_dependency

    if missing_dependency():
        pytest.skip(missing_dependency())
    from txmq.broker.rocketmq.pb import definition_pb2 as d
    from txmq.broker.rocketmq.pb import service_pb2 as s
    from txmq.broker.rocketmq.pb import service_pb2_grpc as sg

    rport = free_port()
    address = f"127.0.0.1:{rport}"
    broker = BrokerProcess(tmp_path / "data", "--rocketmq-port", str(rport), "--check-interval", "100ms",
                           "--transaction-timeout", "0s", "--max-checks", "1000")

    def half(i: int) -> d.Message:
        m = d.Message(body=b"x" * 8000)  # many check-backs of this size fill a stream that is not read
        m.topic.name = "orders"
        sp = m.system_properties
        sp.message_id, sp.message_type, sp.body_encoding = f"TXGONE{i:06d}", d.TRANSACTION, d.IDENTITY
        sp.born_timestamp.FromMilliseconds(1_700_000_000_000)
        return m

    def settings() -> s.TelemetryCommand:
        cmd = s.TelemetryCommand()
        cmd.settings.client_type = d.PRODUCER
        cmd.settings.user_agent.language = d.PYTHON
        cmd.settings.publishing.topics.add(name="orders")
        return cmd

    async def commands():
        yield settings()
        await asyncio.sleep(3600)  # the stream stays open from the client's side until its channel goes

    async def go() -> int:
        async with grpc.aio.insecure_channel(address) as ch:
            stub = sg.MessagingServiceStub(ch)
            for i in range(300):
                r = await stub.SendMessage(s.SendMessageRequest(messages=[half(i)]), metadata=(("x-mq-client-id", "sender@1"),))
                assert r.status.code == d.Code.OK, r.status
        received = 0
        for rnd in range(3):
            channels = []
            for k in range(4):
                ch = grpc.aio.insecure_channel(address)
                call = sg.MessagingServiceStub(ch).Telemetry(commands(), metadata=(("x-mq-client-id", f"gone-{rnd}-{k}@1"),))
                assert (await asyncio.wait_for(call.read(), 10)).status.code == d.Code.OK  # the settings answer
                cmd = await asyncio.wait_for(call.read(), 10)
                received += cmd.HasField("recover_orphaned_transaction_command")
                channels.append(ch)
            await asyncio.sleep(1.0)  # check-backs keep coming; nobody reads them
            for ch in channels:
                await ch.close()  # the clients go away with writes in flight
            await asyncio.sleep(0.3)
        return received

    with broker:
        wait_for_port(rport)  # the native port listens from before the start, the gRPC port once the broker serves
        create_topics(broker, "orders")
        received = arun(go())
    assert received == 12  # each stream was sent check-backs
    text = broker.log.read_text()
    lines = assert_structured(text)
    assert "Traceback" not in text and "never retrieved" not in text
    assert not [ln for ln in lines if "event=loop_exception" in ln], "a failed write reached the loop's exception handler"
    assert any("event=shutdown_done" in ln for ln in lines)


@pytest.mark.parametrize("fmt", ["kv", "json"])
def test_an_exception_nobody_retrieves_is_one_structured_line(fmt):
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs.JsonFormatter() if fmt == "json" else logs.KeyValueFormatter())
    logger = logging.getLogger("txmq.broker")
    saved = logger.handlers[:], logger.propagate, logger.level
    logger.handlers[:], logger.propagate = [handler], False
    logger.setLevel(logging.INFO)

    async def boom() -> None:
        raise RuntimeError("written to a stream\nthat is gone")

    async def go() -> None:
        asyncio.get_running_loop().set_exception_handler(logs.loop_exception_handler)
        task = asyncio.ensure_future(boom())
        await asyncio.sleep(0.01)
        del task  # finished with an exception nobody asked for
        gc.collect()
        asyncio.get_running_loop().call_soon(lambda: 1 / 0)  # a callback that raises
        await asyncio.sleep(0.01)

    try:
        arun(go())
    finally:
        logger.handlers[:], logger.propagate = saved[0], saved[1]
        logger.setLevel(saved[2])
    lines = assert_structured(out.getvalue(), fmt)
    assert len(lines) == 2, lines
    if fmt == "json":
        first, second = (json.loads(ln) for ln in lines)
        assert first["event"] == "loop_exception" and first["level"] == "error"
        assert "never retrieved" in first["msg"] and "RuntimeError" in first["error"] and "Traceback" in first["exc"]
        assert second["event"] == "loop_exception" and "ZeroDivisionError" in second["error"]
    else:
        assert "event=loop_exception" in lines[0] and "never retrieved" in lines[0] and "RuntimeError" in lines[0]
        assert " exc=" in lines[0] and "ZeroDivisionError" in lines[1]


def test_broker_start_installs_the_loop_exception_handler(tmp_path):
    script = textwrap.dedent(f"""
        import asyncio, gc
        from txmq.broker import logs, main
        from txmq.broker.config import BrokerConfig

        async def serve(self, sock, shutdown=None):
            async def boom():
                raise RuntimeError("nobody awaits this")
            task = asyncio.ensure_future(boom())
            await asyncio.sleep(0.01)
            del task
            gc.collect()
            await asyncio.sleep(0.01)

        logs.setup("kv", "info")
        main.Broker.serve = serve  # the start-up path of `txmq broker start`, without serving
        main.run(BrokerConfig(data_dir={str(tmp_path / "data")!r}, host="127.0.0.1", port=0))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = assert_structured(r.stderr)
    (line,) = [ln for ln in lines if "event=loop_exception" in ln]
    assert "never retrieved" in line and "RuntimeError" in line
    assert "Traceback" not in "\n".join(ln for ln in lines if ln is not line)
