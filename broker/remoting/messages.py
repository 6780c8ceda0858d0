"""Messages as RocketMQ 4 writes them: properties strings, offset message ids, batch bodies, the stored-message encoding.

- Properties travel as one string: ``key \\x01 value \\x02`` per property
  (MessageDecoder.messageProperties2String).
- A message id as the broker gives it (the "offset message id"): the
  store host's address (4 or 16 bytes), its port (int32) and the record's
  commit-log offset (int64), in upper-case hex: 32 characters for IPv4
  (MessageDecoder.createMessageId). The client's own id is the message's
  ``UNIQ_KEY`` property (MessageClientIDSetter), which the broker stores as
  it is and answers as the transaction id.
- A batch body (SEND_BATCH_MESSAGE) is the messages one after the other:
  int32 total size, int32 magic, int32 body CRC, int32 flag, int32 body
  length + body, int16 properties length + properties
  (MessageDecoder.encodeMessage).
- A pulled or viewed message is encoded as the broker stores it
  (MessageDecoder.encode): the 17 fields below, big-endian.
"""

from __future__ import annotations

import socket
import struct
import zlib
from typing import Iterable, Protocol

from txmq.remoting_codec import NAME_VALUE_SEPARATOR, PROPERTY_SEPARATOR, decode_properties, encode_properties  # noqa: F401
from ..messaging.naming import PROP_MAX_RECONSUME_TIMES, PROP_ORIGIN_MESSAGE_ID, PROP_RECONSUME_TIME, PROP_RETRY_TOPIC  # noqa: F401
from .protocol import (
    BORNHOST_V6_FLAG,
    COMPRESSED_FLAG,
    COMPRESSION_TYPE_MASK,
    STOREHOSTADDRESS_V6_FLAG,
    TRANSACTION_COMMIT_TYPE,
    TRANSACTION_PREPARED_TYPE,
)

MESSAGE_MAGIC_CODE = -626843481  # daa320a7: stored messages, topic length in one byte
# RocketMQ's own property names that the remoting front end reads or writes (and, from naming.py, those of a
# message sent back for another delivery).
PROP_WAIT = "WAIT"  # the client's "wait for the store" flag: RocketMQ's broker does not store it with a single message
PROP_CLUSTER = "CLUSTER"  # the cluster a message was stored in, which RocketMQ's broker adds
PROP_FLAG = "TXMQ_RMQ_FLAG"  # a message's non-zero int32 flag (Message.setFlag), kept for its consumers
MAX_MESSAGES_IN_BATCH = 10_000
# A stored message's transaction type, as the messaging service's records and pulled messages carry it (the store's
# TxType: fixed by its record format).
TX_NORMAL, TX_PREPARED, TX_COMMIT = 0, 1, 2


class MessageFormatError(ValueError):
    """A message the client sent cannot be read; the request is refused (MESSAGE_ILLEGAL)."""


# ---- addresses and ids ---------------------------------------------------------------------
def address_bytes(host: str) -> bytes:
    """4 bytes for an IPv4 address (an IPv4-mapped IPv6 one too), 16 for IPv6."""
    h = host.strip("[]")
    if h.startswith("::ffff:") and "." in h:
        h = h[7:]
    try:
        return socket.inet_pton(socket.AF_INET, h)
    except OSError:
        pass
    try:
        return socket.inet_pton(socket.AF_INET6, h)
    except OSError:
        return b"\x00\x00\x00\x00"


def offset_msg_id(addr: bytes, port: int, cl_offset: int) -> str:
    return (addr + struct.pack(">iq", port, cl_offset)).hex().upper()


# ---- bodies --------------------------------------------------------------------------------
def inflate(body: bytes, sys_flag: int, limit: int) -> bytes:
    """A compressed body (sysFlag COMPRESSED_FLAG) inflated, to at most ``limit`` bytes; zlib only."""
    if not sys_flag & COMPRESSED_FLAG:
        return body
    kind = sys_flag & COMPRESSION_TYPE_MASK
    if kind not in (0, 0x100):
        raise MessageFormatError("the body is compressed with LZ4 or ZSTD: this broker inflates zlib only "
                                 "(the client's default); send it uncompressed or with zlib")
    d = zlib.decompressobj()
    try:
        out = d.decompress(body, limit + 1)
    except zlib.error as exc:
        raise MessageFormatError(f"the body is flagged compressed but is not zlib data: {exc}") from None
    if len(out) > limit or d.unconsumed_tail:
        raise MessageFormatError(f"the body inflates to more than {limit} bytes (--max-body)")
    if not d.eof:
        raise MessageFormatError("the compressed body is cut short: its zlib stream does not end")
    return out


_BATCH_HEAD = struct.Struct(">iiiii")


def decode_batch(body: bytes) -> list[tuple[int, bytes, dict[str, str]]]:
    """(flag, body, properties) of each message of a SEND_BATCH_MESSAGE body."""
    out = []
    pos, n = 0, len(body)
    mv = memoryview(body)
    while pos < n:
        if n - pos < _BATCH_HEAD.size + 2:
            raise MessageFormatError("a batch body ends inside a message")
        total, _magic, _crc, flag, blen = _BATCH_HEAD.unpack_from(mv, pos)
        if total < _BATCH_HEAD.size + 2 or blen < 0 or pos + total > n:
            raise MessageFormatError("a message of the batch body has a size that does not fit it")
        p = pos + _BATCH_HEAD.size
        if p + blen + 2 > pos + total:
            raise MessageFormatError("a message's body overruns its size in the batch body")
        mbody = bytes(mv[p : p + blen])
        p += blen
        plen = int.from_bytes(mv[p : p + 2], "big")
        p += 2
        if p + plen != pos + total:
            raise MessageFormatError("a message's properties do not end where its size says in the batch body")
        try:
            props = decode_properties(str(mv[p : p + plen], "utf-8"))
        except UnicodeDecodeError:
            raise MessageFormatError("a message's properties in the batch body are not UTF-8") from None
        out.append((flag, mbody, props))
        if len(out) > MAX_MESSAGES_IN_BATCH:
            raise MessageFormatError(f"a batch holds at most {MAX_MESSAGES_IN_BATCH} messages")
        pos += total
    if not out:
        raise MessageFormatError("the batch body holds no message")
    return out


# ---- the stored-message encoding -----------------------------------------------------------
_FIXED = struct.Struct(">iiiiiqqiq")  # size, magic, body crc, queue id, flag, queue offset, cl offset, sys flag, born ts


def sys_flag_of(tx_type: int, v6_store: bool) -> int:
    flag = STOREHOSTADDRESS_V6_FLAG | BORNHOST_V6_FLAG if v6_store else 0
    if tx_type == TX_COMMIT:
        flag |= TRANSACTION_COMMIT_TYPE
    elif tx_type == TX_PREPARED:
        flag |= TRANSACTION_PREPARED_TYPE
    return flag


def encode_stored(topic: str, queue_id: int, queue_offset: int, cl_offset: int, tx_type: int, born_ts: int, store_ts: int,
                  prepared_offset: int, props: dict[str, str], body: bytes, store_addr: bytes, store_port: int) -> bytes:
    """One message as MessageDecoder.decode reads it; the born host is not kept by txmq and goes as the zero address."""
    v6 = len(store_addr) == 16
    topic_b = topic.encode()
    props_b = encode_properties(props).encode()
    if len(props_b) > 0x7FFF:  # a Java short: RocketMQ's limit on a message's properties
        props_b = encode_properties({k: v for k, v in props.items() if not k.startswith("TXMQ_")}).encode()[:0x7FFF]
    try:
        reconsume = int(props.get(PROP_RECONSUME_TIME, "0"))
    except ValueError:
        reconsume = 0
    try:
        flag = int(props.get(PROP_FLAG, "0"))
    except ValueError:
        flag = 0
    if not -(1 << 31) <= flag < (1 << 31):
        flag = 0
    host_len = len(store_addr) + 4
    size = _FIXED.size + host_len + 8 + host_len + 4 + 8 + 4 + len(body) + 1 + len(topic_b) + 2 + len(props_b)
    zero_host = b"\x00" * host_len
    return b"".join((
        _FIXED.pack(size, MESSAGE_MAGIC_CODE, zlib.crc32(body) & 0x7FFFFFFF, queue_id, flag, queue_offset, cl_offset, sys_flag_of(tx_type, v6), born_ts),
        zero_host,
        struct.pack(">q", store_ts), store_addr, struct.pack(">i", store_port),
        struct.pack(">iqi", reconsume, max(prepared_offset, 0), len(body)), body,
        bytes((len(topic_b),)), topic_b,
        len(props_b).to_bytes(2, "big"), props_b,
    ))


class StoredMessage(Protocol):
    """A message as the messaging service reads it (``Messaging.read_message``): what the stored-message encoding writes."""

    topic: str
    queue_id: int
    queue_offset: int
    commit_log_offset: int
    tx_type: int
    born_ts: int
    store_ts: int
    prepared_offset: int
    properties: dict[str, str]
    body: bytes


def encode_record(rec: StoredMessage, store_addr: bytes, store_port: int, topic: str | None = None, queue_id: int | None = None) -> bytes:
    return encode_stored(topic or rec.topic, rec.queue_id if queue_id is None else queue_id, rec.queue_offset, rec.commit_log_offset,
                         int(rec.tx_type), rec.born_ts, rec.store_ts, rec.prepared_offset, rec.properties, rec.body, store_addr, store_port)


def encode_maps(messages: Iterable[dict], store_addr: bytes, store_port: int) -> bytes:
    """Messages as ``BrokerCore.pull`` gives them (records.record_to_map), one after the other."""
    return b"".join(encode_stored(m["topic"], m["queue_id"], m["queue_offset"], m["commit_log_offset"], m["tx_type"], m["born_ts"],
                                  m["store_ts"], m["prepared_offset"], m["properties"], m["body"], store_addr, store_port)
                    for m in messages)
