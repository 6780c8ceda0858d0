"""Where the broker's time goes under a `txmq bench` load: py-spy, summarised.

Starts a broker (``--flush``), attaches ``py-spy record`` to it, runs
``txmq bench MODE`` against it, and prints the functions with the most
samples, by own time (self) and including callees (total). The raw
collapsed stacks are kept (``--raw``) for a flame graph
(https://github.com/brendangregg/FlameGraph, or speedscope).

    .venv/bin/python benchmarks/profile.py tx --flush sync -- -c 32 -n 1
    .venv/bin/python benchmarks/profile.py send -- -c 4 -n 64 --batch 64

Needs py-spy (``.venv/bin/pip install py-spy``) and the right to ptrace
the broker (root, or kernel.yama.ptrace_scope = 0).
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import BrokerProc, data_disk_dir, txmq_bench  # noqa: E402


_PLUMBING = ("(typer/", "(<frozen runpy>)", "(asyncio/runners.py)", "(core/__main__.py)", "(txmq/__main__.py)", "(cli/", "(threading.py)", "_worker (concurrent")


def summarise(raw: Path, top: int) -> str:
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    samples = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        count = int(n)
        samples += count
        frames = [f.split(" (", 1)[0] + " (" + f.split(" (", 1)[1].rsplit(":", 1)[0] + ")" if " (" in f else f for f in stack.split(";")]
        own[frames[-1]] += count
        for f in set(frames):
            total[f] += count
    out = [f"{samples} samples"]
    # the frames every sample of a thread shares (entry point, CLI, event loop runner) say nothing
    total = collections.Counter({f: n for f, n in total.items() if not any(s in f for s in _PLUMBING)})
    for title, c in (("self", own), ("total (with callees)", total)):
        out.append(f"\ntop {top} by {title}:")
        out += [f"  {100 * n / samples:5.1f}%  {name}" for name, n in c.most_common(top)]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["tx", "send"])
    ap.add_argument("--flush", choices=["sync", "async"], default="async")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--raw", type=Path, default=None, help="keep the collapsed stacks here")
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    a = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    a.bench_args = extra
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        sys.exit("py-spy not found: .venv/bin/pip install py-spy")
    tmp = Path(tempfile.mkdtemp(prefix="txmq-profile-", dir=data_disk_dir()))
    raw = a.raw or tmp / "stacks.txt"
    b = BrokerProc(tmp / "data", "--flush", a.flush, "--log-level", "warning", log_path=tmp / "broker.log")
    try:
        b.start()
        rec = subprocess.Popen([spy, "record", "-p", str(b.pid), "-r", str(a.rate), "-d", str(int(a.seconds) + 1), "-f", "raw", "-o", str(raw)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(0.5)
        res = txmq_bench([a.mode, "--broker", b.address, "-d", f"{a.seconds}s", *a.bench_args])  # more `txmq bench` options after --
        rec.wait(60)
        print(f"{a.mode} flush={a.flush} {' '.join(a.bench_args)}: {res['throughput']:,.0f} {res['unit']}, errors {res['errors'] or 'none'}")
        print(summarise(raw, a.top))
        if a.raw:
            print(f"\ncollapsed stacks in {a.raw}")
    finally:
        b.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
