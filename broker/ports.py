"""The broker's listening sockets, and holding a port for the front-end worker processes (broker/workers/) while they
listen on it beside the broker."""

from __future__ import annotations

import errno
import socket
from typing import Any, Callable


def listen(host: str, port: int, reuseport: bool = False) -> socket.socket:
    """A non-blocking TCP socket listening on host:port (a host with ':' is IPv6, brackets or not), with SO_REUSEADDR
    (a port in TIME_WAIT is no obstacle) and, with ``reuseport``, SO_REUSEPORT (a front-end worker's, beside the
    broker's hold and the other workers). It is closed again if any step fails; the error is the OS's."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuseport:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(2048)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def hold_port(family: int, address: Any, error: Callable[[str], Exception]) -> socket.socket:
    """A socket bound, not listening, with SO_REUSEPORT and without SO_REUSEADDR: the workers' listeners (SO_REUSEPORT,
    this user) share the port, and every other socket is refused it, even one with SO_REUSEADDR (a bound socket with
    SO_REUSEADDR that does not listen would let such a listener in). A port left in TIME_WAIT by connections of a
    listener without SO_REUSEPORT is held with SO_REUSEADDR as well. ``error(reason)`` is the exception to raise."""
    for reuseaddr in (False, True):
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            if reuseaddr:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(address)
            return sock
        except OSError as exc:
            sock.close()
            if reuseaddr or exc.errno != errno.EADDRINUSE:
                raise error(exc.strerror or str(exc)) from None
    raise AssertionError("unreachable")
