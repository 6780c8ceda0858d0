"""The checkpoint file: how far the commit log is fsynced and indexed.

Layout (20 bytes, little-endian)::

    0  8  log_offset  u64, commit log fsynced up to here
    8  8  cq_offset   u64, consume-queue entries of every record below this are on disk
    16 4  crc32       u32, zlib CRC-32 of bytes [0, 16)

Both offsets are record boundaries. The file is replaced atomically (write a
temp file, fsync, rename, fsync the directory).
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from dataclasses import dataclass

from .files import atomic_write_bytes

log = logging.getLogger("txmq.store")

CHECKPOINT = struct.Struct(
    "<"
    "Q"  # 0  log_offset
    "Q"  # 8  cq_offset
    "I"  # 16 crc32 of [0, 16)
)
_OFFSETS = struct.Struct("<QQ")


@dataclass(frozen=True, slots=True)
class Checkpoint:
    log_offset: int
    cq_offset: int


def encode_checkpoint(ckpt: Checkpoint) -> bytes:
    head = _OFFSETS.pack(ckpt.log_offset, ckpt.cq_offset)
    return head + struct.pack("<I", zlib.crc32(head))


def decode_checkpoint(data: bytes) -> Checkpoint | None:
    """The checkpoint in data, or None when it is short or its CRC does not match."""
    if len(data) != CHECKPOINT.size:
        return None
    log_offset, cq_offset, crc = CHECKPOINT.unpack(data)
    if zlib.crc32(data[:16]) != crc:
        return None
    return Checkpoint(log_offset, cq_offset)


def read_checkpoint(path: str | os.PathLike) -> Checkpoint | None:
    """The checkpoint at path; None when missing or corrupt (recovery then scans the whole log)."""
    try:
        with open(path, "rb") as f:
            data = f.read(CHECKPOINT.size + 1)
    except FileNotFoundError:
        return None
    ckpt = decode_checkpoint(data)
    if ckpt is None:  # safe, only slower: nothing is trusted without it
        log.warning("event=checkpoint_damaged file=%s size=%d msg=%s", os.fspath(path), len(data),
                    "'ignored: recovery checks the whole log; the next checkpoint replaces it'")
    return ckpt


def write_checkpoint(path: str | os.PathLike, ckpt: Checkpoint) -> None:
    atomic_write_bytes(path, encode_checkpoint(ckpt))
