"""The check-back service (docs/transactions.md, "The check service").

Every check interval it walks the pending transactions in half-queue order
from its progress offset (the index keeps them in that order, so a pass
costs what is pending, not the decided history behind an old pending
one), in batches, yielding to the event loop between batches so sends keep
flowing:

- a transaction decided, or moved to a later copy, since the walk began: skip;
- checked ``max_checks`` times, or stored longer ago than the retention:
  move it to the discard topic;
- stored after the pass began: stop (the walk ends at the queue's max
  offset taken when the pass started);
- younger than its immunity (the transaction timeout, or the message's own
  ``CHECK_IMMUNITY_TIME_IN_SECONDS``): stop here, later passes come back.
  The age runs on the broker's clock from when it stored the transaction's
  first copy, never from the producer's ``born_ts``; a first copy stored
  "after now" (the clock was stepped back) counts as stored now and does
  not stop the pass;
- no live producer of its group: leave it, spending no check, and note
  "no producer online"; the progress cannot move past it;
- otherwise re-append it with ``TRANSACTION_CHECK_TIMES`` + 1 and push a
  ``check_transaction`` to one live connection of the group.

The half progress is the first offset the walk could not leave behind; it
never moves past an undecided transaction. The op progress is the number
of op records written before the half record at the half progress (all of
them name a half copy below it). Both persist in ``txcheck.json``; they
are for people (``txmq inspect offsets``): a start reads the pending
transactions from the index file, not from the half progress.
"""

from __future__ import annotations

import asyncio
import logging
from bisect import bisect_left
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack

from txmq.constants import HALF_TOPIC, OP_TOPIC, PROP_CHECK_TIMES
from txmq.store import RawCopy, Store, StoreError, atomic_write_json, read_json
from txmq.store.files import move_aside
from txmq.store.consumequeue import first_entry_from
from txmq.store.codec import H_BORN_TS, H_PREPARED_OFFSET, H_PROPS_LEN, H_TOPIC_LEN, HEADER_SIZE, TAGS_PROPERTY
from txmq.wire import ErrorCode, TxmqError

from .checkcopy import check_push, pack_group, patch_properties
from ..config import CheckSettings
from ..registry import CheckBack
from .service import TransactionService, copy_properties
from .index import PendingTx

if TYPE_CHECKING:
    from ..appender import Appender
    from ..clock import Clock
    from ..flush import DiskState, Flusher
    from ..metrics import Metrics
    from ..registry import ClientRegistry


def _unpack(packed) -> dict[str, str]:
    """A check copy's packed properties as a dict (for a check-back record: targets other than native connections)."""
    return msgpack.unpackb(packed, raw=False)


log = logging.getLogger("txmq.check")


class CheckProgress:
    """The half and op progress, kept in txcheck.json.

    A damaged file (not JSON, not an object, a progress that is not a whole
    number >= 0) reads as 0 and 0, which is safe: the progress is for
    people, and the next pass moves it forward again. With repair (the
    broker), the file is moved aside as ``txcheck.json.corrupt-<time>`` with
    a warning; without (read-only inspection) it is left as it is.
    """

    def __init__(self, path: Path, repair: bool = False) -> None:
        self.path = path
        self.half = self.op = 0
        try:
            d = read_json(path, {})
        except StoreError as exc:  # not JSON
            why = f"not JSON ({exc.__cause__ or exc})"
        else:
            why = None
            if not isinstance(d, dict):
                why = f"a JSON {type(d).__name__}, not an object"
            else:
                half, op = d.get("half_progress", 0), d.get("op_progress", 0)
                if all(type(v) is int and v >= 0 for v in (half, op)):
                    self.half, self.op = half, op
                else:
                    why = f"half_progress={half!r} op_progress={op!r}"
        if why is not None and repair:
            try:
                moved = str(move_aside(path))
            except OSError as exc:
                moved = f"not moved ({exc.strerror or exc})"
            log.warning("event=data_file_damaged file=%s why=%r moved_to=%s msg=%s", path, why, moved,
                        "'the check progress starts again from 0 (it is for people: pending transactions come from the index)'")
        self._saved: tuple[int, int] | None = None  # what this process last wrote (None: nothing yet)

    def unsaved(self) -> bool:
        """Whether the progress moved since this process last saved it (always, before its first save)."""
        return self._saved != (self.half, self.op)

    def save(self) -> None:
        """Write txcheck.json (a temporary file, its fsync, the rename, the folder's fsync): safe in a worker thread."""
        now = (self.half, self.op)
        atomic_write_json(self.path, {"half_progress": now[0], "op_progress": now[1]})
        self._saved = now


@dataclass
class _Walk:
    """Where one check pass is: the steps of CheckService._pass share it."""

    settings: CheckSettings  # as the pass began: a change takes effect at the next pass
    now_ms: int  # the broker's clock as the pass began
    started: float  # the loop's clock as the pass began
    offs: list[int]  # the pending transactions' latest copies as the pass began, by half offset
    i: int  # the next of offs to look at
    last: int  # the first of offs the walk does not reach (copies stored after the pass began)
    end_at: int  # the first half offset the walk did not pass: the queue's end, or where it stopped
    blocked: int | None = None  # the first half offset the progress cannot pass
    stopped: bool = False  # met a transaction still immune: the ones after it were stored later
    stats: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("walked", "checked", "discarded", "no_producer", "immune", "unreadable"), 0))


class CheckService:
    def __init__(self, tx: TransactionService, appender: Appender, store: Store, flusher: Flusher, metrics: Metrics, clock: Clock,
                 producers: ClientRegistry, disk: DiskState, progress: CheckProgress, settings_path: Path, settings: CheckSettings,
                 batch: int, stored: dict[str, Any] | None = None) -> None:
        self.tx = tx
        self.appender = appender
        self.store = store
        self.flusher = flusher
        self.metrics = metrics
        self.clock = clock
        self.producers = producers  # check-backs go to them
        self.disk = disk  # a full disk is logged once, broker-wide
        self.batch = max(1, batch)  # pending transactions walked between two turns of the loop
        # What config.json holds (`config set` changes): start options are in
        # `settings` for this run only and are never written there.
        self.stored: dict[str, Any] = dict(stored if stored is not None else settings.to_dict())
        self.progress = progress
        self.settings_path = settings_path
        self.settings = settings
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False
        self.passes = 0
        self.last_pass: dict[str, Any] = {}
        self._next_pass_mono: float | None = None  # when the next pass runs, on the loop's monotonic clock
        self._pass_lock = asyncio.Lock()
        self._pack = msgpack.Packer(use_bin_type=True).pack  # check copies' properties
        self._stuck: list[int] = []  # half offsets of pending halves this batch could not read
        self._failing: set[str] = set()  # kinds of error logged since the last pass that succeeded

    # ---- settings ---------------------------------------------------------
    def set(self, key: str, value: Any) -> tuple[Any, Any]:
        new_settings = self.settings.with_value(key, value)  # KeyError / ValueError first
        old = getattr(self.settings, key)
        stored = {**self.stored, key: getattr(new_settings, key)}
        atomic_write_json(self.settings_path, stored)  # persisted first: a refused change changes nothing
        self.stored = stored
        self.settings = new_settings
        log.info("event=config_set key=%s old=%s new=%s", key, old, getattr(self.settings, key))
        self._wake.set()  # a shorter interval takes effect now
        return old, getattr(self.settings, key)

    def preview(self, key: str, value: Any) -> dict[str, Any]:
        """What `set(key, value)` would do to pending transactions, without doing it (config_set dry_run).

        would_discard: pending transactions the next check pass discards
        under the new value but not under the current one (checked at least
        max_checks times; or stored longer ago than the retention, whose log
        segments retention then deletes: would_delete_pending counts those).
        """
        new_settings = self.settings.with_value(key, value)  # KeyError / ValueError as set() raises them
        old = getattr(self.settings, key)
        s, n = self.settings, new_settings
        now_ms = int(self.clock() * 1000)
        pending = self.tx.index.pending.values()
        by_checks = by_age = 0
        if key == "max_checks" and n.max_checks < s.max_checks:
            by_checks = sum(1 for p in pending if n.max_checks <= p.checks < s.max_checks)
        elif key == "retention_s" and n.retention_s < s.retention_s:
            new_ms, old_ms = n.retention_s * 1000, s.retention_s * 1000
            by_age = sum(1 for p in pending
                         if new_ms < now_ms - p.first_stored_ts <= old_ms and p.checks < s.max_checks)
        return {"key": key, "old": old, "new": getattr(n, key), "dry_run": True, "applied": False,
                "pending": len(self.tx.index.pending), "would_discard": by_checks + by_age,
                "would_delete_pending": by_age}

    # ---- background loop --------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="txmq-check")

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    async def _run(self) -> None:
        """A pass every check interval, timed from the start of the previous one.

        Intervals run on the event loop's monotonic clock: a step of the
        broker's clock neither hurries nor holds back a pass.

        A settings change wakes the loop, which recomputes the deadline: a
        shorter interval that is already overdue runs a pass at once, and a
        change of another setting does not postpone the next pass.
        """
        loop = asyncio.get_running_loop()
        started = loop.time()
        while not self._stopping:
            remaining = started + self.settings.check_interval_s - loop.time()
            self._next_pass_mono = started + self.settings.check_interval_s
            if remaining > 0:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), remaining)
                except asyncio.TimeoutError:
                    pass
                if self._stopping:
                    return
                if loop.time() < started + self.settings.check_interval_s:
                    continue  # woken by a settings change before the deadline
            started = loop.time()
            try:
                await self.run_pass()
            except Exception as exc:
                self._pass_failed(exc)
            else:
                self._pass_ok()

    def _pass_failed(self, exc: Exception) -> None:
        """Log a failed pass once per kind of failure; the next interval retries it.

        A full disk is the broker-wide ``event=disk_full``; an OS or store
        error (too many open files, an I/O error, a failed flush) is one
        line without a traceback; only an unexpected error carries one. A
        failure already logged since the last pass that succeeded is not
        logged again.
        """
        disk = self.disk
        if disk.failed("check", exc) or (disk.full and isinstance(exc, TxmqError)):
            return  # a full disk (or the flush this pass waited for, failed by it): logged once, broker-wide
        kind = f"{type(exc).__name__}:{getattr(exc, 'errno', None) or getattr(exc, 'code', None)}"
        if kind in self._failing:
            return
        self._failing.add(kind)
        expected = isinstance(exc, (OSError, StoreError, TxmqError))
        log.error("event=check_pass_failed error=%r msg=%s", exc, "'retried at the next check interval; logged once until a pass succeeds'",
                  exc_info=None if expected else exc)

    def _pass_ok(self) -> None:
        self.disk.ok("check")
        if self._failing:
            log.info("event=check_pass_recovered")
            self._failing.clear()

    # ---- one pass ---------------------------------------------------------
    async def run_pass(self) -> dict[str, Any]:
        async with self._pass_lock:
            return await self._pass()

    async def _pass(self) -> dict[str, Any]:
        """Walk the pending transactions a batch at a time, act on each batch, then move and save the progress."""
        walk = self._begin()
        while walk.i < walk.last and not walk.stopped:
            to_check, to_discard = self._triage(walk)
            await self._act(walk, to_check, to_discard)
            await asyncio.sleep(0)  # let sends through between batches
        return await self._finish(walk)

    def _begin(self) -> _Walk:
        """What the pass walks: the pending transactions' latest copies from the half progress to the half queue's end now."""
        idx, store = self.tx.index, self.store
        now_ms = int(self.clock() * 1000)
        started = asyncio.get_running_loop().time()
        half_max = store.queue_max_offset(HALF_TOPIC, 0)
        start = max(self.progress.half, store.queue_min_offset(HALF_TOPIC, 0))
        self._stuck.clear()  # left by a check_now between passes: that one is seen again below
        # In half-queue order (by_half is kept in that order; the sort only
        # checks it). Copies written by this pass are past half_max.
        offs = list(idx.by_half)
        offs.sort()
        return _Walk(self.settings, now_ms, started, offs, bisect_left(offs, start), bisect_left(offs, half_max), half_max)

    def _triage(self, walk: _Walk) -> tuple[list[tuple[PendingTx, Any]], list[tuple[PendingTx, str]]]:
        """The next batch of the walk: the transactions to check (each with the connection to ask) and to discard.

        Moves the walk past the batch, or to the first transaction still
        immune (the walk stops there), and notes what holds the progress back.
        """
        idx, s, now_ms, stats, offs = self.tx.index, walk.settings, walk.now_ms, walk.stats, walk.offs
        # Hoisted out of the loop, which visits every pending transaction.
        by_half_get, pending, deciding = idx.by_half.get, idx.pending, self.tx.deciding
        targets = self.producers.targets
        max_checks, retention_ms = s.max_checks, s.retention_s * 1000
        timeout_s = s.transaction_timeout_s
        timeout_ms = timeout_s * 1000
        blocked = walk.blocked
        i = walk.i
        end = min(walk.last, i + self.batch)
        to_check: list[tuple[PendingTx, Any]] = []
        to_discard: list[tuple[PendingTx, str]] = []
        # A group's writable connections, once per batch; the batch's
        # check-backs go round-robin over them.
        group_conns: dict[str, list] = {}
        for k in range(i, end):
            off = offs[k]
            tx_id = by_half_get(off)
            if tx_id is None:
                continue
            p = pending[tx_id]
            if tx_id in deciding:  # its outcome is being written right now: leave it to that
                if blocked is None:
                    blocked = off
                continue
            if p.checks >= max_checks:
                to_discard.append((p, "max-checks"))
                continue
            # Ages are the broker's: from when it stored the first copy, by its
            # clock. The producer's born_ts plays no part (a producer clock
            # running behind would cut the timeout short, one running ahead
            # would hide its transactions).
            first = p.first_stored_ts
            ahead = first > now_ms
            if ahead:
                # Stored "later than now": the broker's clock was stepped back
                # since. It counts as stored now, and does not stop this pass:
                # the halves behind it were stored before the step or after it.
                p.first_stored_ts = first = now_ms
            if now_ms - first > retention_ms:
                to_discard.append((p, "retention"))
                continue
            imm = p.immunity_s
            if now_ms - first < (timeout_ms if imm is None else imm * 1000):
                stats["immune"] += 1
                if blocked is None:
                    blocked = off
                if (imm is None or imm <= timeout_s) and not ahead:
                    walk.stopped = True
                    end, walk.end_at = k, off
                    break
                continue  # a longer per-message immunity: skip it, keep walking
            conns = group_conns.get(p.group)
            if conns is None:
                conns = group_conns[p.group] = targets(p.group)
            if not conns:
                p.last_check_result = "no producer online"
                p.last_check_at = now_ms
                stats["no_producer"] += 1
                if blocked is None:
                    blocked = off
                continue
            to_check.append((p, conns[len(to_check) % len(conns)]))
        stats["walked"] += end - i
        walk.i, walk.blocked = end, blocked
        return to_check, to_discard

    async def _act(self, walk: _Walk, to_check: list[tuple[PendingTx, Any]], to_discard: list[tuple[PendingTx, str]]) -> None:
        """Discard and check a batch; what could not be read stays pending and holds the progress back."""
        stats = walk.stats
        if to_discard:
            await self._discard(to_discard)
            stats["discarded"] += len(to_discard)
        if to_check:
            unread = len(self._stuck)
            await self._check(to_check, walk.now_ms)
            stats["checked"] += len(to_check) - (len(self._stuck) - unread)
        if self._stuck:  # records _read or _check could not use: still pending
            first_stuck = min(self._stuck)
            walk.blocked = first_stuck if walk.blocked is None else min(walk.blocked, first_stuck)
            stats["unreadable"] += len(self._stuck)
            self._stuck.clear()

    async def _finish(self, walk: _Walk) -> dict[str, Any]:
        """Move the progress to what the walk could not leave behind, once the log is durable; save it; report the pass."""
        new_half = walk.blocked if walk.blocked is not None else walk.end_at
        # The progress is persisted only once everything it skips past (the
        # decisions, check copies and discards behind it) is on disk: a
        # rebuild after a power cut reads the half queue from it.
        waiter = self.flusher.wait_synced(self.store.max_offset)
        if waiter is not None:
            await waiter
        if new_half > self.progress.half:
            self.progress.half = new_half
        self._advance_op()
        if self.progress.unsaved():
            # two fsyncs: in a worker thread, not on the event loop every front end shares; a pass that moved
            # nothing writes nothing
            await asyncio.to_thread(self.progress.save)
        self.passes += 1
        took = asyncio.get_running_loop().time() - walk.started
        stats = walk.stats
        self.last_pass = {**stats, "took_s": round(took, 4), "half_progress": self.progress.half, "op_progress": self.progress.op,
                          "at": walk.now_ms}
        self.metrics.inc("check_passes")
        if stats["checked"] or stats["discarded"]:
            log.info("event=check_pass %s", " ".join(f"{k}={v}" for k, v in self.last_pass.items()))
        return self.last_pass

    def _advance_op(self) -> None:
        """Move the op progress to the op records written before the half record at the half progress.

        Each of them decided a half copy that existed when it was written,
        so one below the half progress. A binary search over the op queue's
        entries by commit-log offset: no list of op records is kept.
        """
        store = self.store
        half = self.progress.half
        hi = store.queue_max_offset(OP_TOPIC, 0)
        entry = store.cq_entries(HALF_TOPIC, 0, half, 1) if half < store.queue_max_offset(HALF_TOPIC, 0) else None
        if entry:
            hi = first_entry_from(store, OP_TOPIC, 0, entry[0][0])
        if hi > self.progress.op:
            self.progress.op = hi

    def _read(self, items: list, raw: bool = False) -> list:
        """The half records of items, skipping any that can no longer be read (logged)."""
        store = self.store
        offsets = [it[0].cl_offset for it in items]
        try:
            return list(zip(items, store.read_many(offsets, raw)))
        except Exception:
            out = []
            for it in items:
                try:
                    out.append((it, store.read_many([it[0].cl_offset], raw)[0]))
                except Exception as exc:
                    self._unreadable(it[0], exc)
            return out

    def _unreadable(self, p: PendingTx, exc: BaseException) -> None:
        """p's half record could not be read or decoded: log it, show it, and hold the progress before it.

        The transaction is still pending; moving the half progress past it
        would make a rebuild after a crash forget it.
        """
        log.error("event=check_read_failed tx_id=%s cl_offset=%d error=%r", p.tx_id, p.cl_offset, exc)
        p.last_check_result = f"unreadable: {exc!r}"[:200]
        self._stuck.append(p.half_offset)

    async def _check(self, items: list[tuple[PendingTx, Any]], now_ms: int) -> None:
        """Re-append each half with its check count + 1, then push a check-back for the copy.

        This runs once per pending transaction per pass (a million of them
        in the benchmark), so it is written for speed: the copy is appended
        from the half record's bytes and header as read (RawCopy: no decode
        and re-encode of the message, no second header unpack), the index
        entry is moved to it directly, and the pushes are built without a
        Record and handed to each connection as one write per batch. Check
        copies are not put in the half cache: the answer to a check-back
        reads its copy back.
        """
        idx = self.tx.index
        todo: list[tuple[PendingTx, Any, int, bytes, memoryview, tuple, int]] = []
        copies: list[RawCopy] = []
        for (p, conn), (raw, head) in self._read(items, raw=True):
            ps = HEADER_SIZE + head[H_TOPIC_LEN]
            pe = ps + head[H_PROPS_LEN]
            checks = p.checks + 1
            pb = patch_properties(raw[ps:pe], p.cl_offset, p.origin_cl_offset, p.checks, checks)
            if pb is None:  # the dict path: what patch_properties does not handle
                try:
                    props = msgpack.unpackb(raw[ps:pe], raw=False)
                    if type(props) is not dict:
                        raise ValueError("properties are not a map")
                except Exception as exc:
                    self._unreadable(p, exc)
                    continue
                copy_properties(props, p.cl_offset)
                props[PROP_CHECK_TIMES] = str(checks)
                pb = self._pack(props)
                copies.append(RawCopy(raw, pb, props.get(TAGS_PROPERTY), head))
            else:
                copies.append(RawCopy(raw, pb, None, head))
            todo.append((p, conn, checks, pb, raw, head, pe))

        def shape(results) -> None:
            move = idx.move_to_copy
            frames: dict[Any, list[bytes]] = {}
            group_packed: dict[str, bytes] = {}
            sent = 0
            for (p, conn, checks, pb, raw, head, pe), res in zip(todo, results):
                qoff, cl = res.queue_offset, res.commit_log_offset
                # A copy of a transaction decided meanwhile is stale and changes nothing.
                # The count is the one written in the copy, whatever ran since.
                if not move(p, qoff, cl, res.store_ts, checks):
                    continue
                p.last_check_at = now_ms
                p.last_check_result = "sent"
                sent += 1
                if not conn.takes_frames:  # a RocketMQ client's: a record it words in its own protocol
                    conn.check_back(CheckBack(p.group, p.tx_id, cl, qoff, head[H_BORN_TS], res.store_ts, head[H_PREPARED_OFFSET],
                                              _unpack(pb), bytes(raw[pe:])))
                    continue
                out = frames.get(conn)
                if out is None:
                    out = frames[conn] = []
                gp = group_packed.get(p.group)
                if gp is None:
                    gp = group_packed[p.group] = pack_group(p.group)
                out.append(check_push(gp, p.tx_id, cl, qoff, res.size, head[H_BORN_TS], res.store_ts, head[H_PREPARED_OFFSET], pb, raw[pe:]))
            for conn, out in frames.items():
                conn.send_frame(b"".join(out))
            self.metrics.counters["checks_sent"] += sent

        if copies:
            await self.appender.submit(copies, shape, durable=False)

    async def _discard(self, items: list[tuple[PendingTx, str]]) -> None:
        pairs = self._read(items)
        if pairs:
            await self.tx.discard([(p, reason, rec) for (p, reason), rec in pairs])

    # ---- for listings ------------------------------------------------------
    @property
    def next_pass_at(self) -> float:
        """When the next pass runs, in seconds by the broker's clock (0.0 before the loop started).

        Kept as a monotonic deadline and turned into clock time when asked:
        a step of the broker's clock does not move it.
        """
        if self._next_pass_mono is None:
            return 0.0
        return self.clock() + max(0.0, self._next_pass_mono - asyncio.get_running_loop().time())

    def next_check_at(self, p: PendingTx) -> int | None:
        s = self.settings
        immunity = p.immunity_s if p.immunity_s is not None else s.transaction_timeout_s
        now = self.clock()
        eligible = min(p.first_stored_ts / 1000.0, now) + immunity  # stored ahead of the clock: counts from now
        at = max(eligible, self.next_pass_at or now)
        return int(at * 1000)

    async def check_now(self, tx_id: str) -> dict[str, Any]:
        p = self.tx.index.pending.get(tx_id)
        if p is None:
            raise TxmqError(f"no pending transaction {tx_id}", ErrorCode.TX_NOT_FOUND)
        conn = self.producers.pick(p.group)
        if conn is None:
            p.last_check_result = "no producer online"
            raise TxmqError(f"no producer of group {p.group!r} is online", ErrorCode.NO_PRODUCER)
        stuck = len(self._stuck)
        await self._check([(p, conn)], int(self.clock() * 1000))
        if len(self._stuck) > stuck:
            raise TxmqError(f"the half message of {tx_id} could not be read ({p.last_check_result})", ErrorCode.STORE_ERROR)
        log.info("event=operator_check_now tx_id=%s group=%s checks=%d", tx_id, p.group, p.checks)
        return {"sent": True, "message": f"check-back sent to a producer of {p.group}"}

