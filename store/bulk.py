"""Bulk reads: whole consume queues, merged in commit-log order, records validated but not decoded.

For a reader that goes through every record of a few queues once and
needs only some fields of each: the broker's transaction index, rebuilt
after a crash from the op, discard and half queues (two million records
for a million transactions). ``get_messages`` decodes every record into a
``Record`` (a properties dict, a copy of the body, an enum) and the
caller then merges the queues with a Python key function; here the merge
is done on consume-queue entries in lists, the log is read in coalesced
preads, and each record is handed over as its validated header and its
place in the buffer, so the caller decodes only what it uses.

Validation is the same as every other read's (``codec.valid_header``:
magic, lengths, own offset, CRC), and a record that fails it raises
``CorruptRecordError`` with the reason ``decode`` gives, as
``get_messages`` would.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from operator import itemgetter
from os import pread

from .codec import HEADER_SIZE, decode, valid_header
from .consumequeue import Entry
from .errors import CorruptRecordError
from .segments import GAP, SPAN, LogView
from .store import Store

_first = itemgetter(0)
ENTRIES_PER_READ = 4096  # consume-queue entries read at once per queue (80 KiB)

# A run of records as raw_record_runs gives it: (buffer, memoryview of it,
# commit-log offset of the buffer's first byte, each record's header fields
# as codec.HEADER unpacks them).
RawRun = tuple[bytes, memoryview, int, list[tuple]]


def merged_entries(reader, queues: Sequence[tuple[str, int, int]], chunk: int | None = None) -> Iterator[list[Entry]]:
    """Consume-queue entries of several queues, each from its start offset to its end, in commit-log order.

    ``queues`` is a sequence of (topic, queue id, first queue offset); the
    starts must be at or after each queue's min offset (``queue_min_offset``),
    where every entry still has its record. ``reader`` is a Store or a
    StoreReader. Yields lists of entries; together they are the entries of
    all the queues sorted by commit-log offset (entries of one queue already
    are: the merge only has to interleave the queues). Each queue is read
    ``chunk`` entries at a time (default ``ENTRIES_PER_READ``), so memory
    stays bounded whatever the queues' length.
    """
    chunk = chunk or ENTRIES_PER_READ
    streams: list[list] = []  # [topic, queue id, next queue offset, loaded entries]
    for topic, qid, start in queues:
        s = [topic, qid, start, []]
        if _refill(reader, s, chunk):
            streams.append(s)
    while streams:
        if len(streams) == 1:  # nothing to interleave: pass the chunks on as they are
            s = streams[0]
            while True:
                yield s[3]
                if not _refill(reader, s, chunk):
                    return
        # Every loaded entry at or below the smallest "last loaded" offset can go:
        # no stream has an unloaded entry below it.
        bound = min(s[3][-1][0] for s in streams)
        out: list[Entry] = []
        for s in streams:
            buf = s[3]
            cut = bisect_right(buf, bound, key=_first)
            if cut == len(buf):
                out += buf
                s[3] = []
            elif cut:
                out += buf[:cut]
                s[3] = buf[cut:]
        out.sort(key=_first)  # stable: equal offsets (the same record) keep the queues' order
        yield out
        streams = [s for s in streams if s[3] or _refill(reader, s, chunk)]


def _refill(reader, s: list, chunk: int) -> bool:
    """Load the stream's next entries; False when it has none left."""
    entries = reader.cq_entries(s[0], s[1], s[2], chunk)
    s[2] += len(entries)
    s[3] = entries
    return bool(entries)


def raw_record_runs(reader, entries: Sequence[Entry], on_damage: Callable[[int, str], None] | None = None) -> Iterator[RawRun]:
    """The records at consume-queue entries sorted by offset, validated, in runs read with one pread each.

    Yields (buf, mv, first, headers): ``buf`` holds the run's bytes from
    commit-log offset ``first`` on, ``mv`` is a memoryview of it (for slices
    without copies) and ``headers`` has each record's header fields as
    ``codec.HEADER`` unpacks them, in order; record ``h`` is
    ``buf[h[H_OFFSET] - first : h[H_OFFSET] - first + h[H_SIZE]]`` (``codec.H_*``). Neighbouring records (holes
    up to ``GAP``, runs up to ``SPAN``) are read together, as
    ``_read_sized`` reads them for ``get_messages``. Headers come in a list
    per run rather than one yield per record: the caller's loop over two
    million records is the cost this module exists to cut.

    A damaged record (or an entry pointing outside the log) raises
    ``CorruptRecordError``; with ``on_damage`` it is reported there as
    (commit-log offset, reason) instead and left out of its run, and the
    records around it are read as usual.
    """
    log: LogView = reader._open_log() if isinstance(reader, Store) else reader
    seg_at = log._seg_at
    n = len(entries)
    i = 0
    while i < n:
        first, size = entries[i][0], entries[i][1]
        seg = seg_at(first) if first >= 0 else None
        if seg is None or size < HEADER_SIZE or first + size > seg.end:
            why = f"no record at {first}: outside the log" if seg is None else f"impossible record size {size} at {first}"
            if on_damage is None:
                raise CorruptRecordError(why)
            on_damage(first, why)
            i += 1
            continue
        seg_end = seg.end
        run_end = first + size
        j = i + 1
        while j < n:
            e = entries[j]
            o, sz = e[0], e[1]
            if o - run_end > GAP or o + sz - first > SPAN or o + sz > seg_end or o < run_end:
                break
            run_end = o + sz
            j += 1
        buf = pread(seg.fd, run_end - first, first - seg.start)
        mv = memoryview(buf)
        headers = [valid_header(buf, e[0] - first, e[0], mv) for e in entries[i:j]]
        if None in headers:
            if on_damage is None:
                o = entries[i + headers.index(None)][0]
                raise CorruptRecordError(_problem(buf, o - first, o, mv))
            for e, h in zip(entries[i:j], headers):
                if h is None:
                    on_damage(e[0], _problem(buf, e[0] - first, e[0], mv))
            headers = [h for h in headers if h is not None]
        if headers:
            yield buf, mv, first, headers
        i = j


def _problem(buf, pos: int, offset: int, mv: memoryview) -> str:
    why = decode(buf, pos, offset, mv)
    return why if type(why) is str else f"invalid record at {offset}"


def raw_queue_runs(
    reader, queues: Sequence[tuple[str, int, int]], chunk: int | None = None, on_damage: Callable[[int, str], None] | None = None
) -> Iterator[RawRun]:
    """``raw_record_runs`` over ``merged_entries``: every record of the queues, in commit-log order."""
    for entries in merged_entries(reader, queues, chunk):
        yield from raw_record_runs(reader, entries, on_damage)
