"""Who holds a port `broker start` cannot listen on, and which port to take instead.

Linux only (/proc): the listening socket's inode in /proc/net/tcp{,6}, the
process whose descriptors hold it (all of them for root, one's own
otherwise), and what answers on the port: a txmq broker (its hello), or
another service (the client's NotATxmqBroker, RocketMQ's remoting protocol
included).
"""

from __future__ import annotations

import os
import re
import socket
from typing import NamedTuple

IN_USE = re.compile(r"cannot listen on (?P<host>\[[^\]]*\]|[^\s:]+):(?P<port>[0-9]+)(?: \((?P<option>--[a-z-]+)\))?: "
                    r"Address already in use")
_LISTEN = "0A"
MAX_PROCS = 100_000  # /proc entries looked at, at most
PROBE_TIMEOUT_S = 2.0


class Holder(NamedTuple):
    pid: int | None  # None: the socket was found but not its process (another user's, without root)
    command: str


def holder(port: int) -> Holder | None:
    """The process listening on TCP `port` (any address), if /proc says; None when no listening socket is found."""
    inodes = set()
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/net/{name}", encoding="ascii", errors="replace") as f:
                next(f, None)
                for line in f:
                    cols = line.split()
                    if len(cols) > 9 and cols[3] == _LISTEN and int(cols[1].rpartition(":")[2], 16) == port:
                        inodes.add(cols[9])
        except (OSError, ValueError):
            continue
    inodes.discard("0")
    if not inodes:
        return None
    wanted = {f"socket:[{i}]" for i in inodes}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()][:MAX_PROCS]
    except OSError:
        return Holder(None, "")
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                    return Holder(pid, _command(pid))
            except OSError:
                continue
    return Holder(None, "")


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode("utf-8", "replace") for a in f.read(64 << 10).split(b"\0") if a]
    except OSError:
        return ""
    if not argv:
        return ""
    if "__frontend-worker" in argv[:4]:  # a front-end worker holds its broker's --rocketmq-port or --remoting-port: name the broker
        ppid = _parent(pid)
        broker = _command(ppid) if ppid else ""
        return f"a front-end worker of the txmq broker pid {ppid}" + (f": {broker}" if broker else "")
    main = next((a for a in argv[1:] if a.startswith("org.apache.rocketmq.")), None)  # a JVM: its main class says more
    words = [os.path.basename(argv[0]), *([main] if main else [os.path.basename(a) if "/" in a and i == 0 else a
                                                               for i, a in enumerate(argv[1:])])]
    text = " ".join(words)
    return text if len(text) <= 100 else text[:99] + "\u2026"


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def what_answers(host: str, port: int) -> str | None:
    """What answers at host:port, briefly: a txmq broker, another service (RocketMQ, ...), or None (nothing, or no telling)."""
    from txmq.client.connection import REMOTING_WHAT, Client, NotATxmqBroker
    from txmq.wire import TxmqError

    from ..common import run

    target = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host.strip("[]")
    address = f"[{target}]:{port}" if ":" in target else f"{target}:{port}"

    async def go() -> str | None:
        client = Client(address, reconnect=False, connect_timeout=PROBE_TIMEOUT_S, request_timeout=PROBE_TIMEOUT_S)
        try:
            await client.start()
        except NotATxmqBroker as e:
            return "not a txmq broker: " + (REMOTING_WHAT if e.seen.startswith(REMOTING_WHAT) else e.seen)
        except TxmqError as e:
            if e.code.name in ("AUTH_REQUIRED", "AUTH_FAILED"):
                return "a txmq broker (started with an auth token)"
            return None
        except (OSError, TimeoutError):
            return None
        try:
            version = client.hello.get("version")
            return f"a txmq broker{f' (txmq {version})' if version else ''}: another `txmq broker start` runs there"
        finally:
            await client.close()

    try:
        return run(go())
    except Exception:  # noqa: BLE001  # a description, never a second error
        return None


def free_port(host: str, after: int, tries: int = 50) -> int | None:
    """The first port above `after` that host can listen on now (None if none of the next `tries` can)."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    for port in range(after + 1, min(after + 1 + tries, 65536)):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host.strip("[]"), port))
            except OSError:
                continue
            return port
    return None


def explain_in_use(message: str) -> str | None:
    """`broker start`'s "cannot listen on HOST:PORT (--opt): Address already in use", with who holds the port and
    which port to choose instead (None when the message is not that)."""
    m = IN_USE.search(message)
    if m is None:
        return None
    host, port, option = m.group("host"), int(m.group("port")), m.group("option") or "--port"
    parts = [message.rstrip(".")]
    held = holder(port)
    if held is not None and held.pid is not None:
        parts.append(f"held by pid {held.pid}" + (f" ({held.command})" if held.command else ""))
    elif held is not None:
        parts.append("held by another user's process (`ss -ltnp` as root names it)")
    answers = what_answers(host, port)
    if answers:
        parts.append(answers)
    other = free_port(host, port)
    choose = f"choose another port with {option} {other if other is not None else 'PORT'}"
    if option == "--port":
        choose += (f" (`make run ARGS=\"--port {other or 'PORT'}\"`), and give clients "
                   f"-b {host}:{other or 'PORT'} (or TXMQ_BROKER)")
    parts.append(choose)
    return "; ".join(parts)
