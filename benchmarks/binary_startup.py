"""Start-up of txmq's packagings: size, `txmq --version`, `broker start` until its ports accept, compiled modules loaded.

Each packaging is given as LABEL=COMMAND (the command that stands for `txmq`, split on spaces), e.g.

    python benchmarks/binary_startup.py venv=.venv/bin/txmq exe=dist/txmq-linux-x86_64 \
        "zipapp=python3 dist/txmq.pyz" onefile=build/pyinstaller-onefile/txmq

and prints a Markdown table (docs/binary.md holds the last one). For each: the file's size; the first
`--version` with an empty cache (TXMQ_CACHE_DIR and SHIV_ROOT pointed at a new directory; what a new
user's first start costs), then the median of 9 warm ones; the median of 5 `broker start --rocketmq-port
--flush sync --busy-poll 1ms` runs, from exec until both the native and the RocketMQ port accept a
connection; which compiled modules the broker process has mapped (/proc/PID/maps): txmq's four
speed-ups, uvloop, msgpack's C extension, gRPC's core; and how much a start unpacked into a new directory
in /tmp (PyInstaller's one-file mode and Nuitka's default one-file mode unpack into a new directory on
every start: /tmp/_MEIxxxxxx, /tmp/onefile_PID_TIME).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMPILED = {"txmq.store._speedups": "store/_speedups", "txmq.broker._speedups": "broker/_speedups", "txmq.broker._fsyncer": "_fsyncer",
            "txmq._busypoll": "_busypoll", "uvloop": "uvloop/loop", "msgpack": "_cmsgpack", "grpcio": "cygrpc"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


def version_s(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    r = subprocess.run([*cmd, "--version"], capture_output=True, text=True, env=env, timeout=120)
    elapsed = time.perf_counter() - t0
    if r.returncode != 0 or "txmq" not in r.stdout:
        raise SystemExit(f"{' '.join(cmd)} --version failed: {r.stderr[-1000:]}")
    return elapsed


def broker_start(cmd: list[str], env: dict[str, str], work: Path) -> tuple[float, set[str], float]:
    port, rmq = free_port(), free_port()
    data = Path(tempfile.mkdtemp(dir=work))
    before = tmp_dirs()
    t0 = time.perf_counter()
    proc = subprocess.Popen([*cmd, "broker", "start", "--data-dir", str(data), "--port", str(port), "--rocketmq-port", str(rmq),
                             "--flush", "sync", "--busy-poll", "1ms", "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        while not (accepts(port) and accepts(rmq)):
            if proc.poll() is not None:
                raise SystemExit(f"{' '.join(cmd)} broker start exited: {proc.stderr.read().decode()[-2000:]}")
            if time.perf_counter() - t0 > 60:
                raise SystemExit(f"{' '.join(cmd)}: no broker after 60 s")
            time.sleep(0.005)
        elapsed = time.perf_counter() - t0
        time.sleep(0.3)
        maps = "".join(_maps(proc.pid))
        loaded = {name for name, needle in COMPILED.items() if re.search(re.escape(needle) + r"[^/\s]*\.so", maps)}
        base = Path(os.environ.get("TMPDIR", "/tmp"))
        per_start = sum(p.stat().st_size for d in tmp_dirs() - before for p in (base / d).rglob("*") if p.is_file() and not p.is_symlink())
        return elapsed, loaded, per_start / 1e6
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(data, ignore_errors=True)


def _maps(pid: int) -> list[str]:
    """The maps of the process and of its children (a launcher that forks, such as a one-file bootloader)."""
    out = [Path(f"/proc/{pid}/maps").read_text()]
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        out += _maps(int(child))
    return out


def size_mb(cmd: list[str]) -> float:
    f = next((Path(a) for a in cmd if Path(a).is_file() and not a.startswith("/usr/") and "python" not in Path(a).name), None)
    if f is None:
        return float("nan")
    if f.parent.name == "bin" and (f.parent.parent / "pyvenv.cfg").exists():  # a virtual environment: not one file
        return float("nan")
    return f.stat().st_size / 1e6


def tmp_dirs() -> set[str]:
    base = Path(os.environ.get("TMPDIR", "/tmp"))
    return {p.name for p in base.glob("_MEI*")} | {p.name for p in base.glob("onefile_*")}


def measure(label: str, cmd: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="txmq-startup-") as d:
        work = Path(d)
        env = {**os.environ, "TXMQ_CACHE_DIR": str(work / "cache"), "SHIV_ROOT": str(work / "shiv")}
        first = version_s(cmd, env)
        warm = statistics.median(version_s(cmd, env) for _ in range(9))
        runs = [broker_start(cmd, env, work) for _ in range(5)]
        cache = sum(p.stat().st_size for p in work.rglob("*") if p.is_file() and (work / "cache" in p.parents or work / "shiv" in p.parents))
    return {"label": label, "size": size_mb(cmd), "first": first, "warm": warm, "broker": statistics.median(r[0] for r in runs),
            "loaded": set.intersection(*(r[1] for r in runs)), "cache": cache / 1e6,
            "per_start": statistics.median(r[2] for r in runs)}


def main() -> None:
    rows = []
    for arg in sys.argv[1:]:
        label, _, command = arg.partition("=")
        rows.append(measure(label, command.split()))
        print(f"measured {label}", file=sys.stderr)
    print("| packaging | size (MB) | first `--version` (s) | warm `--version` (s) | `broker start` to ports (s) | unpacked once (MB) | unpacked into /tmp on every start (MB) | compiled modules loaded |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        missing = [m for m in COMPILED if m not in r["loaded"]]
        loaded = "all 7" if not missing else "missing: " + ", ".join(missing)
        size = "n/a" if r["size"] != r["size"] else f"{r['size']:.1f}"
        print(f"| {r['label']} | {size} | {r['first']:.2f} | {r['warm']:.2f} | {r['broker']:.2f} | {r['cache']:.0f} | {r['per_start']:.0f} | {loaded} |")


if __name__ == "__main__":
    main()
