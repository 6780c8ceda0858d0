"""The helpers that start broker processes for the suite (tests/brokerproc.py, tests/sdkenv.py, tests/rocketmq_peer.py).

A port picked free is free only when picked: another process can bind it before the broker does. The helpers
never hand out a port twice, count a broker as started only when the ports it was given are its own, and pick
the port again when it was taken.
"""

from __future__ import annotations

import socket

import pytest

import brokerproc
from brokerproc import BrokerProcess, free_port


@pytest.fixture
def held_port():
    """A port another process's socket listens on (this test process's, standing in for it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_free_port_never_hands_out_the_same_port_twice():
    # the kernel picks a bound port at random among ~14,000: 3,000 picks would repeat one hundreds of times
    ports = [free_port() for _ in range(3000)]
    assert len(set(ports)) == len(ports)


def test_a_broker_whose_remoting_port_another_process_holds_does_not_count_as_started(tmp_path, held_port):
    b = BrokerProcess(tmp_path / "data", "--remoting-port", str(held_port))
    try:
        with pytest.raises(RuntimeError, match=rf"cannot listen on 127.0.0.1:{held_port} \(--remoting-port\)"):
            b.start()  # its native port answers before it finds the remoting port taken and exits
    finally:
        b.stop()


def test_a_broker_counts_as_started_once_its_native_remoting_and_metrics_ports_are_its_own(tmp_path):
    rport, mport = free_port(), free_port()
    b = BrokerProcess(tmp_path / "data", f"--remoting-port={rport}", "--metrics-port", str(mport), "--frontend-processes", "1")
    try:
        b.start()
        assert brokerproc.listens_on(b.pid, [b.port, rport, mport])  # the remoting port: through its worker
    finally:
        assert b.stop() == 0


def _first_pick(monkeypatch, port: int) -> None:
    real, picks = brokerproc.free_port, []

    def pick() -> int:
        picks.append(1)
        return port if len(picks) == 1 else real()

    monkeypatch.setattr(brokerproc, "free_port", pick)


def test_a_remoting_port_taken_before_the_broker_binds_it_is_picked_again(tmp_path, held_port, monkeypatch):
    from sdkenv import start_remoting_broker

    _first_pick(monkeypatch, held_port)
    b, namesrv = start_remoting_broker(tmp_path)
    try:
        assert namesrv != f"127.0.0.1:{held_port}"
        assert brokerproc.listens_on(b.pid, [int(namesrv.rsplit(":", 1)[1])])
    finally:
        assert b.stop() == 0


def test_the_rocketmq_peers_txmq_picks_its_ports_again_when_one_was_taken(tmp_path, held_port, monkeypatch):
    from rocketmq_peer import TxmqRemoting

    _first_pick(monkeypatch, held_port)
    with TxmqRemoting(tmp_path / "data") as b:
        assert b.remoting_port != held_port
        assert brokerproc.listens_on(b.proc.pid, [b.remoting_port, b.proc.port])
