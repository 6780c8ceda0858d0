"""Broker memory, index size, restart time and check pass against the number of decided transactions in its history.

A broker that has decided many transactions must not need more memory,
a longer start or a longer check pass for it: what it keeps per decided
transaction should stay on disk (the log, and the ``txindex.db`` index
file), not in the process. This script grows one data directory in steps
and measures the same things at every step, so that growth shows as a
trend down the table.

The history starts with one old pending transaction that can never be
checked: before the first bulk write, ONE half message of producer group
``stale`` (no producer of that group is ever online) is written with the
same builder as the rest, its producer timestamp an hour in the past so
that it is never immune. It stays pending for good and holds the check
service's half progress at the very start of the half queue, in front of
the whole decided history: neither a start nor a check pass may read that
history because of it.

For each cumulative step of ``--steps`` (default 1,000,000, 3,000,000 and
10,000,000 decided transactions):

1. Bulk write (no broker running): the transactions still missing to reach
   the step (the probes and bursts of earlier steps count) are appended
   with txmq.store.Store directly, in large batches, as the broker writes a
   committed transaction (broker/transactions/service.py; the builder is
   ``restart._transactions``): a half message in the half topic, then the
   committed message in its real topic and the op record in the op topic.
   256-byte bodies, none left pending (but the stale one, written first).
   The store is closed cleanly.
2. First start after the bulk write (``txmq broker start --flush async
   --check-interval 1s``): the broker has to take in every record it has
   never seen, so the time until it accepts a transaction is reported on
   its own as ``ingest_s`` (catching up after an offline write, not the
   steady state). Once it has accepted one, its VmRSS is read, and again
   after ``--settle`` seconds of idling (1 transaction pending: the stale
   one); the larger is ``rss_idle_mb``.
3. Clean restart: SIGTERM, wait for the exit (timed: ``stop_s``), start
   again and time it (``restart_clean_s``), RSS as above. Then the first
   check pass that started after the broker was ready (its
   ``event=broker_ready`` log line) is read from the ``stats`` request
   (``last_check_pass``): ``pass_walked`` (expected: 1, the stale
   transaction, whatever the history), ``pass_s`` and ``pass_no_producer``.
   The same is recorded for every start.
4. Restart after a crash: a burst of real transactions (``--burst``, half +
   commit, ``txmq bench tx`` against the running broker), then SIGKILL, start
   again and time it (``restart_kill_s``), RSS as above. Then a clean stop.
5. Sizes on disk with the broker stopped: every file of the data directory
   whose name starts with ``txindex`` (``index_bytes``) and the commit log
   (``log_bytes``, the ``commitlog/`` files).

"Time until a transaction is accepted" is measured from spawn to the reply
of a real ``end_transaction`` (commit) over the wire protocol, sent after
its ``send`` of a half message was answered; connection refusals and
retriable errors (a broker still starting) are retried until ``--timeout``.
``broker_info`` is sent on the same connection, and when it was first
answered (plain traffic served) is recorded too. The ``event=broker_ready``
line of every start's log is kept with whatever key=values it has.

    .venv/bin/python benchmarks/history.py [--steps 1000000,3000000,10000000] [--dir D] [--burst 5000] [-o json] [--write docs/benchmarks.md]

The default needs about 15 GB free in $TMPDIR (the data directory is
removed at the end unless ``--dir`` is given; a later run with the same
``--dir`` continues from what was bulk-written there). Try it small first:
``--steps 20000,60000``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import report  # noqa: E402
from benchlib import BrokerProc, child_pids, command_line, data_disk_dir, machine_info, proc_status, save_result, txmq_bench  # noqa: E402
from restart import GROUP, TOPIC, TX_BODY, _transactions  # noqa: E402

from txmq import wire  # noqa: E402
from txmq.store import Store  # noqa: E402

BULK_FILE = "bulk.json"  # in the run directory: how many transactions were bulk-written into data/
STALE_GROUP = "stale"  # the old pending transaction's producer group: never online
STALE_AGE_MS = 3600 * 1000  # its producer timestamp is this old: past any transaction timeout, well within retention (72 h)
CHECK_INTERVAL = "1s"
PASS_WAIT_S = 10.0  # how long to wait for a check pass after a start's RSS samples
BYTES_PER_TX = 1600  # commit log + consume queues + index per transaction, with a margin (measured: ~1,350-1,500 B)
_KV = re.compile(r"(\w+)=(\"(?:[^\"\\]|\\.)*\"|\S+)")


# ---- bulk writing --------------------------------------------------------------------------
def bulk_write(data_dir: Path, first: int, count: int, batch: int, stale_key: int | None = None) -> dict[str, Any]:
    """Append transactions first .. first+count-1, all committed, through txmq.store.Store; close cleanly.

    With stale_key, ONE half message of group STALE_GROUP with that key is
    written first and left pending (its producer timestamp STALE_AGE_MS old).
    """
    t0 = last = time.perf_counter()
    body = b"t" * TX_BODY
    done = 0
    with Store(data_dir) as store:
        if stale_key is not None:
            left = _transactions(store, stale_key, 1, 1, body, group=STALE_GROUP, born_ts=int(time.time() * 1000) - STALE_AGE_MS)
            assert left == 1
        while done < count:
            k = min(batch, count - done)
            # pending_every=0: none is left pending (a positive value leaves every
            # transaction whose index is a multiple of it, the first one included).
            _transactions(store, first + done, k, 0, body)
            done += k
            if time.perf_counter() - last > 5:
                last = time.perf_counter()
                rate = done / (last - t0)
                print(f"  {first + done:,} transactions, {store.max_offset / 1e9:.2f} GB "
                      f"({rate:,.0f}/s, {(count - done) / rate:.0f} s to go)", file=sys.stderr, flush=True)
        store.sync()
    took = time.perf_counter() - t0
    return {"written": count, "build_s": round(took, 1), "build_rate": round(count / took) if took else None}


# ---- sizes on disk ---------------------------------------------------------------------------
def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def disk_sizes(data_dir: Path) -> dict[str, Any]:
    """The index (every file or folder whose name starts with txindex) and the commit log, in bytes."""
    index: dict[str, int] = {}
    for p in sorted(data_dir.rglob("txindex*")):
        rel = str(p.relative_to(data_dir))
        index[rel] = _tree_bytes(p) if p.is_dir() else p.stat().st_size
    return {"index_bytes": sum(index.values()), "index_files": index, "log_bytes": _tree_bytes(data_dir / "commitlog"),
            "data_dir_bytes": _tree_bytes(data_dir)}


# ---- the wire probe ------------------------------------------------------------------------
class NotYet(Exception):
    """The broker is up but not ready for this yet (a retriable refusal, or the connection dropped)."""


def _retriable(fields: dict[str, Any]) -> bool:
    name = str(fields.get("name", ""))
    return bool(fields.get("retriable")) or "READY" in name or "UNAVAILABLE" in name


class _Conn:
    """Blocking request/reply on one socket; pushes are skipped."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.dec = wire.FrameDecoder(64 << 20)
        self.frames: list[wire.Frame] = []
        self.next_id = 0

    def send(self, op: str, fields: dict[str, Any]) -> int:
        self.next_id += 1
        self.sock.sendall(wire.request(self.next_id, op, fields))
        return self.next_id

    def reply(self) -> wire.Frame:
        while not self.frames:
            data = self.sock.recv(1 << 16)
            if not data:
                raise NotYet("the broker closed the connection")
            self.frames = [f for f in map(wire.parse_payload, self.dec.feed(data)) if f.kind != wire.PUSH]
        return self.frames.pop(0)


def time_to_transaction(b: BrokerProc, timeout: float) -> dict[str, Any]:
    """From spawn until one transaction (half + commit) is accepted; also when the port and broker_info first answered.

    Retries connection refusals, dropped connections and retriable error
    replies every 20 ms. Fails at once if the broker exits.
    """
    deadline = b.started_at + timeout
    port_at = info_at = None
    end: dict[str, Any] = {}
    refusals: dict[str, int] = {}
    half_fields = {"topic": TOPIC, "body": b"p" * TX_BODY, "properties": {"TRAN_MSG": "true", "PGROUP": GROUP}}
    while True:
        if b.proc is not None and b.proc.poll() is not None:
            raise RuntimeError(f"the broker exited with {b.proc.returncode} while starting:\n{b.log_tail()}")
        if time.perf_counter() > deadline:
            raise TimeoutError(f"no transaction accepted within {timeout} s (refusals: {refusals}):\n{b.log_tail()}")
        try:
            sock = socket.create_connection(("127.0.0.1", b.port), timeout=1)
        except OSError:
            time.sleep(0.005)
            continue
        port_at = port_at or time.perf_counter()
        try:
            with sock:
                sock.settimeout(max(1.0, deadline - time.perf_counter()))
                c = _Conn(sock)
                # Pipelined: hello, broker_info and the half message at once.
                ids = {c.send("hello", {"client_id": "history-bench", "producer_groups": [GROUP]}): "hello"}
                if info_at is None:
                    ids[c.send("broker_info", {})] = "info"
                # A half already answered on a dropped connection is committed
                # now rather than left pending behind a new one.
                if end:
                    ids[c.send("end_transaction", end)] = "commit"
                else:
                    ids[c.send("send", half_fields)] = "half"
                while True:
                    f = c.reply()
                    kind = ids.pop(f.id, None)
                    ok = f.op == 0
                    if not ok and not _retriable(f.fields):
                        raise RuntimeError(f"{kind} refused: {f.fields}")
                    if not ok:
                        name = str(f.fields.get("name", f.op))
                        refusals[name] = refusals.get(name, 0) + 1
                        if time.perf_counter() > deadline:
                            raise NotYet(name)
                        time.sleep(0.02)
                        if kind == "info":
                            ids[c.send("broker_info", {})] = "info"
                        elif kind == "half":
                            ids[c.send("send", half_fields)] = "half"
                        elif kind == "commit":
                            ids[c.send("end_transaction", end)] = "commit"
                        elif kind == "hello":
                            raise NotYet(name)
                        continue
                    if kind == "info" and info_at is None:
                        info_at = time.perf_counter()
                    elif kind == "half":
                        h = f.fields
                        end = {"group": GROUP, "tx_id": h["tx_id"], "commit_log_offset": h["commit_log_offset"],
                               "half_offset": h["half_offset"], "state": "commit"}
                        ids[c.send("end_transaction", end)] = "commit"
                    elif kind == "commit":
                        tx_at = time.perf_counter()
                        break
        except (NotYet, ConnectionError, socket.timeout) as e:
            refusals[type(e).__name__] = refusals.get(type(e).__name__, 0) + 1
            time.sleep(0.02)
            continue
        s = b.started_at
        return {"port_s": round(port_at - s, 3), "serving_s": round(info_at - s, 3) if info_at else None,
                "tx_s": round(tx_at - s, 3), "refusals": refusals}


def check_pass_after(b: BrokerProc, after_ms: int, timeout: float) -> dict[str, Any] | None:
    """The broker's last_check_pass (``stats`` request) once one started later than after_ms (ms since the epoch).

    Polled every 100 ms for up to timeout seconds; None if no such pass came.
    The pass's ``at`` is the wall-clock time it started, in ms.
    """
    deadline = time.perf_counter() + timeout
    with socket.create_connection(("127.0.0.1", b.port), timeout=5) as sock:
        c = _Conn(sock)
        c.send("hello", {"client_id": "history-bench-stats"})
        c.reply()
        while True:
            c.send("stats", {})
            f = c.reply()
            if f.op != 0:
                raise RuntimeError(f"stats refused: {f.fields}")
            gauges = f.fields.get("gauges", {})
            last = gauges.get("last_check_pass") or {}
            if last.get("at", 0) > after_ms:
                return {**last, "check_passes": gauges.get("check_passes"), "pending": gauges.get("pending")}
            if time.perf_counter() > deadline:
                return None
            time.sleep(0.1)


# ---- one broker start --------------------------------------------------------------------------
def _log_ts_ms(ts: str | None) -> int | None:
    """A broker log line's ts (2024-01-02T03:04:05.678Z, UTC) in ms since the epoch."""
    if not ts:
        return None
    try:
        return int(dt.datetime.strptime(ts, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=dt.timezone.utc).timestamp() * 1000)
    except ValueError:
        return None


def _ready_line(log_path: Path) -> str | None:
    """The last event=broker_ready line of a broker log, whole."""
    line = None
    try:
        for ln in log_path.read_text(errors="replace").splitlines():
            if "event=broker_ready" in ln:
                line = ln
    except OSError:
        pass
    return line


def broker_ready(log_path: Path) -> tuple[str | None, dict[str, str]]:
    """The last event=broker_ready line of a broker log, and its key=values (ts, level and logger left out)."""
    line = _ready_line(log_path)
    if line is None:
        return None, {}
    text = line[line.index("event=broker_ready"):]
    return text, {k: v.strip('"') for k, v in _KV.findall(text) if k != "event"}


def broker_ready_ms(log_path: Path) -> int | None:
    """When the broker logged event=broker_ready (its ts), in ms since the epoch."""
    m = re.search(r"\bts=(\S+)", _ready_line(log_path) or "")
    return _log_ts_ms(m.group(1)) if m else None


def start(data_dir: Path, log_path: Path, case: str, timeout: float, settle: float) -> tuple[BrokerProc, dict[str, Any]]:
    """Spawn a broker, time it to the first accepted transaction, then sample its idle RSS; leaves it running."""
    log_path.write_text("")
    b = BrokerProc(data_dir, "--flush", "async", "--check-interval", CHECK_INTERVAL, "--log-level", "info", log_path=log_path)
    b.spawn()
    try:
        res: dict[str, Any] = {"case": case, **time_to_transaction(b, timeout)}
        accepted_ms = int(time.time() * 1000)
        rss_ready = proc_status(b.pid, "VmRSS")
        time.sleep(settle)
        rss_settled = proc_status(b.pid, "VmRSS")
        # The first check pass after the broker was ready (the log line's ts;
        # the accepted transaction's time if the line cannot be read).
        res["ready_ms"] = broker_ready_ms(log_path) or accepted_ms
        res["check_pass"] = check_pass_after(b, res["ready_ms"], PASS_WAIT_S)
        if res["check_pass"] is None:
            print(f"  warning: no check pass started after the broker was ready within {PASS_WAIT_S:.0f} s", file=sys.stderr, flush=True)
    except BaseException:
        b.proc.kill()  # type: ignore[union-attr]
        b.proc.wait()  # type: ignore[union-attr]
        raise
    res.update(rss_ready_mb=round(rss_ready, 1), rss_settled_mb=round(rss_settled, 1), rss_mb=round(max(rss_ready, rss_settled), 1),
               rss_peak_mb=round(proc_status(b.pid, "VmHWM"), 1))
    return b, res


def _running(pid: int) -> bool:
    """Does pid still run? (A zombie does not: an orphan may wait long to be reaped.)"""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def stop_clean(b: BrokerProc, timeout: float) -> float:
    """SIGTERM and wait for the exit; seconds it took. A broker that does not exit in time is killed and that is an error."""
    assert b.proc is not None
    t0 = time.perf_counter()
    b.proc.send_signal(signal.SIGTERM)
    try:
        code = b.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        b.proc.kill()
        b.proc.wait()
        raise RuntimeError(f"the broker did not stop within {timeout} s of SIGTERM:\n{b.log_tail()}") from None
    if code != 0:
        raise RuntimeError(f"the broker exited with {code} after SIGTERM:\n{b.log_tail()}")
    return round(time.perf_counter() - t0, 3)


def kill(b: BrokerProc, timeout: float) -> int:
    """SIGKILL the broker, as a crash; wait for any child it had forked to finish on its own (expected: none).

    The children are left to exit by themselves, as they would after a real
    crash, but the next start is not timed while they still use the CPU.
    Returns how many there were.
    """
    assert b.proc is not None
    kids = child_pids(b.pid)
    b.proc.kill()
    b.proc.wait()
    deadline = time.perf_counter() + timeout
    alive = kids
    while alive and time.perf_counter() < deadline:
        time.sleep(0.05)
        alive = [k for k in alive if _running(k)]
    if alive:
        raise RuntimeError(f"children {alive} of the killed broker still run after {timeout} s")
    return len(kids)


# ---- one step --------------------------------------------------------------------------------
def measure(run_dir: Path, step: int, a: argparse.Namespace) -> dict[str, Any]:
    """Steps 2-5 of the docstring on a stopped broker's data directory holding `step` decided transactions.

    The broker is stopped again at the end.
    """
    data, logs = run_dir / "data", run_dir / "logs"
    logs.mkdir(exist_ok=True)
    res: dict[str, Any] = {"decided": step, "pending": 1}
    starts: dict[str, dict[str, Any]] = {}
    log_of = {name: logs / f"{step}-{name}.log" for name in ("first", "clean", "kill")}

    b: BrokerProc | None = None
    try:
        print("  first start after the bulk write ...", file=sys.stderr, flush=True)
        b, starts["first"] = start(data, log_of["first"], "first start after the bulk write", a.timeout, a.settle)
        starts["first"]["stop_s"] = stop_clean(b, a.timeout)

        print("  restart after a clean shutdown ...", file=sys.stderr, flush=True)
        b, starts["clean"] = start(data, log_of["clean"], "after a clean shutdown", a.timeout, a.settle)
        burst = txmq_bench(["tx", "-b", b.address, "-m", str(a.burst), "-c", "4", "-n", "64", "--size", str(TX_BODY)], timeout=a.timeout)
        res["burst"] = {"completed": burst.get("completed"), "per_s": burst.get("throughput"), "errors": burst.get("errors")}
        children_waited = kill(b, a.timeout)

        print("  restart after SIGKILL ...", file=sys.stderr, flush=True)
        b, starts["kill"] = start(data, log_of["kill"], f"after SIGKILL, {a.burst:,} transactions after the clean start", a.timeout, a.settle)
        starts["kill"]["children_waited"] = children_waited
        starts["kill"]["stop_s"] = stop_clean(b, a.timeout)
    except BaseException:
        if b is not None and b.proc is not None and b.proc.poll() is None:  # never leave a broker behind
            b.proc.kill()
            b.proc.wait()
        raise

    for name, s in starts.items():
        s["broker_ready_line"], s["broker_ready"] = broker_ready(log_of[name])
    res["starts"] = starts
    res["decided_after"] = step + len(starts) + (res["burst"]["completed"] or 0)  # one probe transaction per start
    res.update(disk_sizes(data))
    res.update(ingest_s=starts["first"]["tx_s"], restart_clean_s=starts["clean"]["tx_s"], restart_kill_s=starts["kill"]["tx_s"],
               rss_idle_mb=starts["first"]["rss_mb"], rss_clean_mb=starts["clean"]["rss_mb"], rss_kill_mb=starts["kill"]["rss_mb"])
    cp = starts["clean"].get("check_pass") or {}
    res.update(pass_walked=cp.get("walked"), pass_s=cp.get("took_s"), pass_no_producer=cp.get("no_producer"),
               pass_immune=cp.get("immune"))
    return res


# ---- output ----------------------------------------------------------------------------------
COLUMNS = ["decided transactions", "log GB", "index MB", "RSS MiB idle (1 pending)", "RSS MiB after restart",
           "first start after bulk write s", "restart clean s", "restart after SIGKILL s", "pass walked", "pass s"]


def _opt(v: Any, fmt: str = "") -> str:
    return "—" if v is None else format(v, fmt)


def rows(res: dict[str, Any]) -> list[list[str]]:
    return [[f"{s['decided']:,}", f"{s['log_bytes'] / 1e9:.2f}", f"{s['index_bytes'] / 1e6:.1f}", f"{s['rss_idle_mb']:.0f}",
             f"{s['rss_clean_mb']:.0f}", f"{s['ingest_s']:.2f}", f"{s['restart_clean_s']:.2f}", f"{s['restart_kill_s']:.2f}",
             _opt(s.get("pass_walked"), ","), _opt(s.get("pass_s"), ".4f")]
            for s in res["steps"]]


def growth(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Last step over first step, for each measure (1.0: no growth at all)."""
    if len(steps) < 2:
        return {}
    first, last = steps[0], steps[-1]
    keys = ["index_bytes", "rss_idle_mb", "rss_clean_mb", "rss_kill_mb", "restart_clean_s", "restart_kill_s", "ingest_s", "log_bytes",
            "pass_walked", "pass_s"]
    out: dict[str, Any] = {"decided": round(last["decided"] / first["decided"], 2)}
    for k in keys:
        out[k] = round(last[k] / first[k], 2) if first.get(k) else None
    return out


def text_table(res: dict[str, Any]) -> str:
    body = rows(res)
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(COLUMNS)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(COLUMNS, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in body]
    for s in res["steps"]:
        for name in ("first", "clean", "kill"):
            st = s["starts"][name]
            cp = st.get("check_pass")
            pass_text = (f"check pass walked {cp.get('walked')} (no producer {cp.get('no_producer')}, immune {cp.get('immune')}) "
                         f"in {cp.get('took_s')} s" if cp else "no check pass after ready")
            lines.append(f"{s['decided']:>12,} {name:>5}: serving {st['serving_s']} s, transaction {st['tx_s']} s, "
                         f"RSS {st['rss_mb']:.0f} MiB (peak {st['rss_peak_mb']:.0f}), {pass_text}; "
                         f"{st['broker_ready_line'] or 'no broker_ready line'}")
    g = res.get("growth")
    if g:
        lines.append(f"last step / first step: decided {g['decided']}x; index {g['index_bytes']}x, RSS idle {g['rss_idle_mb']}x, "
                     f"RSS after restart {g['rss_clean_mb']}x, restart clean {g['restart_clean_s']}x, after SIGKILL "
                     f"{g['restart_kill_s']}x, first start after bulk write {g['ingest_s']}x, check pass walked "
                     f"{g.get('pass_walked')}x and took {g.get('pass_s')}x")
    return "\n".join(lines)


NOTES = ("Every step adds transactions to the same data directory, written offline as the broker writes a committed transaction "
         "(half message, committed message, op record; 256-byte bodies; none pending). In front of the whole history, before the "
         "first bulk write, ONE half message of producer group `stale` was written and never ended: no producer of that group is "
         "ever online, so the check service can never check it, it stays pending (1 pending transaction at every start) and it holds "
         "the check service's half progress at the start of the half queue. The first start after each bulk write has to "
         "take in records it has never seen, so its time is reported apart from the restarts. A start's time runs from spawn to the "
         "reply of a real `end_transaction` (commit) over the wire, sent after its half message was answered; serving is the first "
         "`broker_info` reply. RSS is VmRSS once the transaction was accepted and again after a few idle seconds, the larger of the "
         "two; the index is every file in the data directory whose name starts with `txindex` (`txindex.db` and its `-wal`, `-shm`). "
         "Pass walked and pass s are the broker's `last_check_pass` (`stats` request) for the first check pass that started after "
         "the clean restart's `broker_ready` (check interval 1 s): the pending transactions it walked (the stale one: 1) and how "
         "long it took. The restart after SIGKILL follows a burst of transactions run through the broker (`txmq bench tx`). Page "
         "cache warm throughout; async flush.")


# ---- main ----------------------------------------------------------------------------------
def _count(s: str) -> int:
    s = s.strip().replace("_", "").lower()
    mult = {"k": 1_000, "m": 1_000_000}.get(s[-1:], 1)
    return int(float(s[:-1]) * mult) if mult > 1 else int(s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", default="1000000,3000000,10000000",
                    help="cumulative decided transactions to measure at, comma-separated (1M and 20k also read); default 1M,3M,10M")
    ap.add_argument("--dir", type=Path, default=None,
                    help="run here and keep it (a later run continues from the transactions already bulk-written) "
                         "instead of in a temporary directory that is removed")
    ap.add_argument("--batch", type=int, default=50_000, help="transactions per bulk-write batch (default 50,000)")
    ap.add_argument("--burst", type=int, default=5_000, help="transactions run through the broker before the SIGKILL (default 5,000)")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds of idling between the two RSS samples of a start (default 3)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds a start (or a stop) may take before the run fails")
    ap.add_argument("--write", type=Path, metavar="DOC", help="save the result and write it into this Markdown file")
    ap.add_argument("-o", "--output", choices=["text", "json"], default="text")
    a = ap.parse_args()
    steps = [_count(x) for x in a.steps.split(",") if x.strip()]
    if not steps or steps != sorted(set(steps)) or steps[0] <= 0:
        sys.exit("--steps must be increasing positive counts")

    base = a.dir or data_disk_dir()
    base.mkdir(parents=True, exist_ok=True)
    run_dir = a.dir or Path(tempfile.mkdtemp(prefix="txmq-history-", dir=base))
    # What the data directory holds: the bulk writer's next transaction key
    # (keys are never reused), the decided transactions, its own and those
    # run through the broker by the starts and bursts of earlier steps, and
    # the stale pending transaction (written once, first; it is not decided).
    bulk_file = run_dir / BULK_FILE
    if (run_dir / "data").exists() and not bulk_file.exists():
        sys.exit(f"{run_dir / 'data'} exists but was not written by this script ({BULK_FILE} missing)")
    held = json.loads(bulk_file.read_text()) if bulk_file.exists() else {"next_key": 0, "decided": 0, "stale": 0}
    if held["decided"] and not held.get("stale"):
        sys.exit(f"{run_dir} was written without the stale pending transaction in front of the history: use a new --dir")
    need = (steps[-1] - held["decided"]) * BYTES_PER_TX
    if shutil.disk_usage(base).free < need:
        sys.exit(f"not enough free disk under {base}: need about {need / 1e9:.1f} GB")

    out_steps: list[dict[str, Any]] = []
    try:
        for step in steps:
            add = step - held["decided"]
            if add < 0:
                print(f"skipping {step:,}: {run_dir} already holds {held['decided']:,} decided transactions", file=sys.stderr)
                continue
            # Topped up to exactly `step` decided transactions.
            stale = not held.get("stale")  # the first bulk write of the run directory: the stale half first
            first_key = held["next_key"] + (1 if stale else 0)
            print(f"step {step:,}: bulk-writing {'1 stale pending + ' if stale else ''}{add:,} transactions in {run_dir / 'data'} ...",
                  file=sys.stderr, flush=True)
            built = bulk_write(run_dir / "data", first_key, add, a.batch, stale_key=held["next_key"] if stale else None)
            held = {"next_key": first_key + add, "decided": step, "stale": 1}
            bulk_file.write_text(json.dumps(held))
            print(f"  {add:,} in {built['build_s']} s", file=sys.stderr, flush=True)
            res = measure(run_dir, step, a)
            res.update(built)
            held["decided"] = res["decided_after"]
            bulk_file.write_text(json.dumps(held))
            out_steps.append(res)
            print(f"  transaction accepted after: first start {res['ingest_s']} s, clean restart {res['restart_clean_s']} s, "
                  f"after SIGKILL {res['restart_kill_s']} s; RSS idle {res['rss_idle_mb']:.0f} MiB; index {res['index_bytes'] / 1e6:.1f} MB; "
                  f"check pass after the clean restart walked {res['pass_walked']} in {res['pass_s']} s",
                  file=sys.stderr, flush=True)
    finally:
        if a.dir is None:
            shutil.rmtree(run_dir, ignore_errors=True)

    res = {"kind": "history", "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"), "command": command_line(),
           "machine": machine_info(base), "body": TX_BODY, "flush": "async", "check_interval": CHECK_INTERVAL, "stale_pending": 1,
           "burst": a.burst, "settle_s": a.settle,
           "steps": out_steps, "growth": growth(out_steps), "notes": NOTES}
    if a.write:
        save_result("history", res)
        report.write_doc(a.write)
    if out_steps:
        print(text_table(res), file=sys.stderr if a.output == "json" else sys.stdout)
    if a.output == "json":
        print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
