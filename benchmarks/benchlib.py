"""Helpers shared by the benchmark scripts: processes, machine facts, a lean wire client.

Not part of the txmq package: these scripts measure it from the outside,
through `txmq bench`, `txmq broker start` and the wire protocol.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from txmq import wire

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from brokerproc import free_port  # noqa: E402,F401 - one picker for the suite and the benchmarks: never the same port twice

TXMQ = [sys.executable, "-m", "txmq"]
RESULTS = REPO / "benchmarks" / "results"


# ---- processes ---------------------------------------------------------------
def txmq_bench(args: list[str], timeout: float = 600) -> dict[str, Any]:
    """Run `txmq bench ARGS -o json` in a subprocess and return its summary.

    `txmq bench` exits non-zero when some requests failed but still prints
    the summary; only a run that printed no JSON is an error here.
    """
    cmd = [*TXMQ, "bench", *args, "-o", "json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    try:
        return json.loads(p.stdout)
    except json.JSONDecodeError:
        raise RuntimeError(f"{' '.join(cmd[2:])} failed (exit {p.returncode}): {p.stderr.strip()[-1500:]}") from None


def proc_status(pid: int, key: str) -> float:
    """A kB field of /proc/PID/status (VmRSS, VmHWM) in MiB; 0 if unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def child_pids(pid: int) -> list[int]:
    """Live child processes of pid (/proc/PID/task/*/children; a scan of /proc where the kernel lacks it)."""
    try:
        return sorted({int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()})
    except (OSError, ValueError):
        pass
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """User + system CPU seconds of a process (and its reaped children: none here), or of its thread tid."""
    return sum(cpu_times(pid, tid))


def cpu_times(pid: int, tid: int | None = None) -> tuple[float, float]:
    """(user, system) CPU seconds of a process, or of its thread tid; zeros once it is gone."""
    try:
        path = f"/proc/{pid}/task/{tid}/stat" if tid is not None else f"/proc/{pid}/stat"
        parts = Path(path).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0.0
    tck = os.sysconf("SC_CLK_TCK")
    return int(parts[11]) / tck, int(parts[12]) / tck


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds of a process and all its live descendants (RabbitMQ's beam + helpers)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += cpu_seconds(pid)
        todo += children.get(pid, [])
    return total


def wait_port(port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before port {port} opened")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.02)
    raise TimeoutError(f"port {port} did not open within {timeout} s")


# ---- the machine -------------------------------------------------------------
def data_disk_dir() -> Path:
    """Where `txmq bench --embedded` puts its data directory: the temp dir."""
    return Path(tempfile.gettempdir())


def mount_of(path: Path) -> tuple[str, str, str]:
    """(device, mount point, fs type) of the filesystem holding path."""
    path = path.resolve()
    best = ("?", "/", "?")
    for line in Path("/proc/mounts").read_text().splitlines():
        dev, mnt, fstype = line.split()[:3]
        mnt = mnt.replace("\\040", " ")
        if (str(path) == mnt or str(path).startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[1]):
            best = (dev, mnt, fstype)
    return best


def machine_info(data_dir: Path | None = None) -> dict[str, Any]:
    data_dir = data_dir or data_disk_dir()
    mem_kb = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            mem_kb = int(line.split()[1])
    model = "?"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    du = shutil.disk_usage(data_dir)
    dev, mnt, fstype = mount_of(data_dir)
    import msgpack
    import uvloop

    return {
        "cores": os.cpu_count(),
        "cpu_model": model,
        "memory_gib": round(mem_kb / 1024 / 1024, 1),
        "data_dir": str(data_dir),
        "disk": {"device": dev, "mount": mnt, "fs": fstype, "size_gib": round(du.total / 2**30, 1), "free_gib": round(du.free / 2**30, 1)},
        "kernel": platform.release(),
        "python": platform.python_version(),
        "uvloop": uvloop.__version__,
        "msgpack": ".".join(map(str, msgpack.version)),
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def machine_line(m: dict[str, Any]) -> str:
    d = m["disk"]
    return (f"{m['cores']} cores ({m['cpu_model']}), {m['memory_gib']} GiB memory, data dir {m['data_dir']} on {d['device']} "
            f"({d['fs']}, {d['size_gib']} GiB, {d['free_gib']} GiB free), Linux {m['kernel']}, Python {m['python']}, "
            f"uvloop {m['uvloop']}, msgpack {m['msgpack']}; load average at start {m['load_avg_at_start']}")


def percentiles_ms(values) -> dict[str, float | int]:
    """Percentiles of latencies given in seconds, in milliseconds (the same summary as `txmq bench`)."""
    from txmq.client.bench import percentiles

    return percentiles(values)


def install_uvloop() -> None:
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass


# ---- a lean pipelined wire client ---------------------------------------------
Callback = Callable[[int, dict[str, Any]], None]


class WireConn(asyncio.Protocol):
    """Requests with a callback per reply, many in flight; pushes go to on_push.

    Writes made from inside a callback are coalesced into one transport
    write per received chunk, as `txmq bench` does.
    """

    def __init__(self, on_push: Callable[[str, dict[str, Any]], None] | None = None, max_frame: int = 64 << 20) -> None:
        self.dec = wire.FrameDecoder(max_frame)
        self.on_push = on_push
        self.cbs: dict[int, Callback] = {}
        self.next_id = 0
        self.out: list[bytes] = []
        self.transport: asyncio.Transport | None = None
        self.closed = asyncio.get_running_loop().create_future()
        self._in_cb = False

    @classmethod
    async def open(cls, address: str, hello: dict[str, Any] | None = None, **kw: Any) -> "WireConn":
        host, port = address.rsplit(":", 1)
        _, conn = await asyncio.get_running_loop().create_connection(lambda: cls(**kw), host, int(port))
        await conn.call("hello", hello or {"client_id": f"benchmarks-{os.getpid()}"})
        return conn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(exc)
        for cb in self.cbs.values():
            cb(-1, {"error": "connection lost"})
        self.cbs.clear()

    def send(self, op: str, fields: dict[str, Any], cb: Callback) -> None:
        self.next_id = (self.next_id % 0x7FFFFFFF) + 1
        self.cbs[self.next_id] = cb
        self.out.append(wire.request(self.next_id, op, fields))
        if not self._in_cb:
            self.flush()

    def flush(self) -> None:
        if self.out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(self.out))
        self.out = []

    def call(self, op: str, fields: dict[str, Any]) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()

        def done(code: int, f: dict[str, Any]) -> None:
            if fut.done():
                return
            if code == 0:
                fut.set_result(f)
            elif code < 0:
                fut.set_exception(ConnectionError(f.get("error")))
            else:
                fut.set_exception(wire.TxmqError.from_reply(code, f))

        self.send(op, fields, done)
        return fut

    def data_received(self, data: bytes) -> None:
        self._in_cb = True
        try:
            for payload in self.dec.feed(data):
                f = wire.parse_payload(payload)
                if f.kind == wire.PUSH:
                    if self.on_push is not None:
                        self.on_push(str(f.op), f.fields)
                    continue
                cb = self.cbs.pop(f.id, None)
                if cb is not None:
                    cb(int(f.op), f.fields)
        finally:
            self._in_cb = False
        self.flush()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class BrokerProc:
    """`txmq broker start` in a subprocess on a given data directory, logs to a file."""

    def __init__(self, data_dir: Path, *args: str, log_path: Path | None = None) -> None:
        self.data_dir = data_dir
        self.args = list(args)
        self.port = free_port()
        self.log_path = log_path or data_dir.parent / f"broker-{self.port}.log"
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def spawn(self) -> None:
        cmd = [*TXMQ, "broker", "start", "--data-dir", str(self.data_dir), "--port", str(self.port), *self.args]
        self.started_at = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(self.log_path, "ab"))

    def start(self, timeout: float = 120) -> "BrokerProc":
        self.spawn()
        wait_port(self.port, timeout, self.proc)
        return self

    def stop(self, timeout: float = 60) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text()[-n:]
        except OSError:
            return ""


def save_result(name: str, result: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def command_line() -> str:
    """The command that ran this script, as a user would type it from the repo root."""
    script = os.path.relpath(os.path.abspath(sys.argv[0]), REPO)
    return " ".join([".venv/bin/python", script, *sys.argv[1:]])
