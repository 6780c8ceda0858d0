"""Pointing the CLI (or the client) at another service's port: one line saying it is not a txmq broker, exit 12."""

import socket
import threading

import pytest

from brokerproc import free_port
from clihelpers import err, start_broker, txmq
from conftest import arun

NOT_TXMQ = 12  # docs/cli.md, "Exit codes"

AMQP_GREETING = b"AMQP\x00\x00\x09\x01"  # what an AMQP 0-9-1 server (RabbitMQ) sends on any bad input
# The server preface of an HTTP/2 server (gRPC): a SETTINGS frame, sent before the client says anything.
HTTP2_SETTINGS = b"\x00\x00\x18\x04\x00\x00\x00\x00\x00\x00\x04\x00@\x00\x00\x00\x05\x00@\x00\x00\x00\x06\x00\x00@\x00\xfe\x03\x00\x00\x00\x01"


class ForeignServer:
    """A TCP server that is not a txmq broker: each connection gets `greeting` (at once, or after the client's
    first bytes with `after_request`), then is closed, as such servers do with a request they cannot read."""

    def __init__(self, greeting: bytes, after_request: bool = False) -> None:
        self.greeting = greeting
        self.after_request = after_request
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            with conn:
                try:
                    conn.settimeout(5)
                    if self.after_request:
                        conn.recv(1 << 16)
                    conn.sendall(self.greeting)
                    conn.recv(1 << 16)  # until the client gives up on it
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def foreign(request):
    servers: list[ForeignServer] = []

    def make(greeting: bytes, after_request: bool = False) -> ForeignServer:
        s = ForeignServer(greeting, after_request)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.close()


def _one_error_line(r, address: str) -> str:
    text = err(r)
    assert r.returncode == NOT_TXMQ, f"exit {r.returncode}: {text}"
    assert text.count("\n") == 1 and text.startswith(f"error: not a txmq broker at {address}: "), text
    assert "FRAME_TOO_LARGE" not in text and "unreachable" not in text and "Traceback" not in text, text
    return text


@pytest.mark.parametrize("command", [["stats"], ["inspect", "half"], ["send", "t", "x"], ["broker", "status"]])
def test_an_amqp_server_is_said_not_to_be_a_txmq_broker(foreign, command):
    s = foreign(AMQP_GREETING)
    text = _one_error_line(txmq("-b", s.address, *command), s.address)
    assert "AMQP 0-9-1" in text


def test_an_http2_server_is_said_not_to_be_a_txmq_broker(foreign):
    s = foreign(HTTP2_SETTINGS)
    text = _one_error_line(txmq("-b", s.address, "stats"), s.address)
    assert "HTTP/2" in text


def test_an_http_server_answering_the_hello_is_said_not_to_be_a_txmq_broker(foreign):
    s = foreign(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n", after_request=True)
    text = _one_error_line(txmq("-b", s.address, "stats"), s.address)
    assert "HTTP/1.1 400 Bad Request" in text


def test_unknown_bytes_are_shown_briefly(foreign):
    s = foreign(b"\x00\x00\x00\x10" + b"not msgpack at all, and long enough to be cut" * 4)
    text = _one_error_line(txmq("-b", s.address, "stats"), s.address)
    assert "first bytes are no txmq reply" in text and len(text) < 200, text


def test_the_bench_checks_the_address_before_it_runs(foreign):
    s = foreign(AMQP_GREETING)
    _one_error_line(txmq("bench", "send", "-b", s.address, "--messages", "10"), s.address)


def test_a_brokers_own_rocketmq_port_is_said_not_to_be_a_txmq_broker(tmp_path):
    pytest.importorskip("grpc", reason="the rocketmq extra (grpcio) is not installed")
    rport = free_port()
    b = start_broker(tmp_path, "--rocketmq-port", str(rport))
    try:
        address = f"127.0.0.1:{rport}"
        text = _one_error_line(txmq("-b", address, "stats"), address)
        assert "rocketmq-port" in text
        assert txmq("-b", b.address, "stats").returncode == 0
    finally:
        b.stop()


def test_the_client_raises_not_a_txmq_broker_and_does_not_retry_it(foreign):
    from txmq.client import Client, NotATxmqBroker

    s = foreign(AMQP_GREETING)

    async def go() -> BaseException:
        c = Client(s.address, reconnect=True, connect_timeout=5)
        try:
            await c.start()
        except Exception as e:  # noqa: BLE001
            return e
        finally:
            await c.close()
        raise AssertionError("connected")

    e = arun(go())
    assert isinstance(e, NotATxmqBroker) and not e.retriable, repr(e)
    assert "AMQP" in e.seen and s.accepted == 1
