"""The CLI pointed at RocketMQ (whose broker's default port, 10911, is txmq's too): recognised by its reply to a
remoting request, exit 12; `broker start` on a port something holds says what holds it and which port to take.

RocketMQ closes a connection whose first frame it cannot read without a byte, so "connection lost" said
nothing; the client then asks the port a read-only remoting request (GET_BROKER_CLUSTER_INFO) and RocketMQ's
answer says what it is. Against a real RocketMQ 4.9.8 (tests/rocketmq_peer.py, skipped without Java or the
peer), and against a server that speaks the protocol as RocketMQ does (always run).
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading

import pytest

from brokerproc import free_port
from clihelpers import err, start_broker, txmq

NOT_TXMQ, ERROR = 12, 1


class RemotingServer:
    """Answers RocketMQ remoting requests as a RocketMQ broker does (REQUEST_CODE_NOT_SUPPORTED, its opaque, the
    response flag) and closes, without a byte, a connection whose first frame is not one (a txmq hello)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.requests: list[dict] = []
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(5)
                    head = conn.recv(8, socket.MSG_WAITALL)
                    total, kind, hlen = int.from_bytes(head[:4], "big"), head[4], int.from_bytes(head[5:8], "big")
                    if kind != 0 or hlen > total - 4 or hlen > 4096:
                        continue  # Netty's decoder fails: the channel is closed
                    cmd = json.loads(conn.recv(hlen, socket.MSG_WAITALL))
                    self.requests.append(cmd)
                    header = json.dumps({"code": 3, "flag": 1, "opaque": cmd["opaque"], "language": "JAVA", "version": 395,
                                         "remark": f" request type {cmd['code']} not supported"}).encode()
                    conn.sendall((4 + len(header)).to_bytes(4, "big") + len(header).to_bytes(4, "big") + header)
                except (OSError, ValueError, KeyError):
                    pass

    def close(self) -> None:
        self.sock.close()


def remoting_error(r, address: str) -> str:
    text = err(r)
    assert r.returncode == NOT_TXMQ, f"exit {r.returncode}: {text}"
    assert text.count("\n") == 1 and text.startswith(f"error: not a txmq broker at {address}: "), text
    assert "RocketMQ's remoting protocol" in text and "lost" not in text, text
    return text


@pytest.mark.parametrize("command", [["broker", "status"], ["send", "t", "x"], ["inspect", "half"]])
def test_a_service_speaking_rocketmqs_remoting_protocol_is_said_not_to_be_a_txmq_broker(command):
    s = RemotingServer()
    try:
        address = f"127.0.0.1:{s.port}"
        remoting_error(txmq("-b", address, *command), address)
        assert [r["code"] for r in s.requests] == [106]  # one read-only request: GET_BROKER_CLUSTER_INFO
    finally:
        s.close()


def test_a_txmq_brokers_own_remoting_port_is_said_not_to_be_a_txmq_broker(tmp_path):
    rport = free_port()
    b = start_broker(tmp_path, "--remoting-port", str(rport))
    try:
        address = f"127.0.0.1:{rport}"
        text = remoting_error(txmq("-b", address, "stats"), address)
        assert "--remoting-port" in text
    finally:
        b.stop()


def test_a_peer_that_closes_without_a_byte_and_answers_no_remoting_request_stays_unreachable():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)

    def serve() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        r = txmq("-b", f"127.0.0.1:{sock.getsockname()[1]}", "stats")
        assert r.returncode == 3 and "lost" in err(r), err(r)
    finally:
        sock.close()


def start_on(tmp_path, port: int, *args: str):
    return txmq("broker", "start", "--data-dir", str(tmp_path / "data2"), "--port", str(port), *args, subprocess_=True, timeout=60)


def chosen_port(text: str, option: str = "--port") -> int:
    m = re.search(rf"choose another port with {option} ([0-9]+)", text)
    assert m, text
    return int(m.group(1))


def test_broker_start_on_a_port_a_txmq_broker_holds_names_it_and_a_free_port(tmp_path):
    b = start_broker(tmp_path)
    try:
        r = start_on(tmp_path, b.port)
        text = err(r).strip().splitlines()[-1]
        assert r.returncode == ERROR, text
        assert f"cannot listen on 127.0.0.1:{b.port}: Address already in use" in text
        assert f"held by pid {b.pid}" in text and "a txmq broker (txmq " in text, text
        other = chosen_port(text)
        assert other > b.port and f'make run ARGS="--port {other}"' in text and f"-b 127.0.0.1:{other}" in text, text
    finally:
        b.stop()


def test_broker_start_on_a_port_a_remoting_service_holds_says_it_speaks_rocketmq(tmp_path):
    s = RemotingServer()
    try:
        r = start_on(tmp_path, free_port(), "--remoting-port", str(s.port))
        text = err(r).strip().splitlines()[-1]
        assert r.returncode == ERROR, text
        assert f"(--remoting-port): Address already in use; held by pid {os.getpid()}" in text, text
        assert "RocketMQ's remoting protocol" in text and chosen_port(text, "--remoting-port") > s.port, text
    finally:
        s.close()


@pytest.mark.rocketmq_peer
def test_the_cli_pointed_at_a_real_rocketmq_broker_and_name_server_says_so(rocketmq_peer):
    for address in (rocketmq_peer.broker, rocketmq_peer.namesrv):
        remoting_error(txmq("-b", address, "broker", "status"), address)
        remoting_error(txmq("-b", address, "send", "orders", "x"), address)


@pytest.mark.rocketmq_peer
def test_broker_start_on_a_real_rocketmq_brokers_port_names_its_process_and_a_free_port(rocketmq_peer, tmp_path):
    port = int(rocketmq_peer.broker.rpartition(":")[2])
    r = start_on(tmp_path, port)
    text = err(r).strip().splitlines()[-1]
    assert r.returncode == ERROR, text
    assert f"held by pid {rocketmq_peer.broker_pid} (java org.apache.rocketmq.broker.BrokerStartup)" in text, text
    assert "RocketMQ's remoting protocol" in text and chosen_port(text) != port, text
