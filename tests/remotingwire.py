"""A RocketMQ 4 remoting client at the frame level, written from RocketMQ's documented encoding (no code of the broker's).

For the tests of --remoting-port: frames in JSON or RocketMQ's binary header (RemotingCommand,
RocketMQSerializable), requests matched to responses by opaque, and the broker's own requests
(CHECK_TRANSACTION_STATE, NOTIFY_CONSUMER_IDS_CHANGED) kept in ``pushed``. Also the stored-message
decoding (MessageDecoder.decode) and properties strings, to read PULL_MESSAGE bodies and check-backs.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import struct
from dataclasses import dataclass, field

SEND_MESSAGE, PULL_MESSAGE, QUERY_CONSUMER_OFFSET, UPDATE_CONSUMER_OFFSET = 10, 11, 14, 15
SEARCH_OFFSET_BY_TIMESTAMP, GET_MAX_OFFSET, GET_MIN_OFFSET, VIEW_MESSAGE_BY_ID = 29, 30, 31, 33
HEART_BEAT, UNREGISTER_CLIENT, CONSUMER_SEND_MSG_BACK, END_TRANSACTION = 34, 35, 36, 37
GET_CONSUMER_LIST_BY_GROUP, CHECK_TRANSACTION_STATE, NOTIFY_CONSUMER_IDS_CHANGED = 38, 39, 40
LOCK_BATCH_MQ, UNLOCK_BATCH_MQ, GET_ROUTEINFO_BY_TOPIC, SEND_MESSAGE_V2, SEND_BATCH_MESSAGE = 41, 42, 105, 310, 320
COMMIT, ROLLBACK, UNKNOWN = 8, 12, 0
PREPARED_FLAG = 4


@dataclass
class Cmd:
    code: int
    opaque: int = 0
    flag: int = 0
    ext: dict = field(default_factory=dict)
    body: bytes = b""
    remark: str = ""
    serialize: int = 0


def encode(cmd: Cmd) -> bytes:
    if cmd.serialize == 1:
        rb = cmd.remark.encode()
        ext = b"".join(len(k.encode()).to_bytes(2, "big") + k.encode() + struct.pack(">i", len(str(v).encode())) + str(v).encode()
                       for k, v in cmd.ext.items())
        header = struct.pack(">hbhii", cmd.code, 7, 0, cmd.opaque, cmd.flag) + struct.pack(">i", len(rb)) + rb + struct.pack(">i", len(ext)) + ext
    else:
        header = json.dumps({"code": cmd.code, "language": "JAVA", "version": 0, "opaque": cmd.opaque, "flag": cmd.flag,
                             "remark": cmd.remark or None, "extFields": cmd.ext}).encode()
    return struct.pack(">ii", 4 + len(header) + len(cmd.body), (cmd.serialize << 24) | len(header)) + header + cmd.body


def decode(payload: bytes) -> Cmd:
    (raw,) = struct.unpack_from(">i", payload)
    kind, hlen = (raw >> 24) & 0xFF, raw & 0xFFFFFF
    header, body = payload[4 : 4 + hlen], payload[4 + hlen :]
    if kind == 0:
        o = json.loads(header)
        return Cmd(o["code"], o.get("opaque", 0), o.get("flag", 0), o.get("extFields") or {}, body, o.get("remark") or "", 0)
    code, _lang, _ver, opaque, flag = struct.unpack_from(">hbhii", header)
    pos = 13
    (rl,) = struct.unpack_from(">i", header, pos)
    remark = header[pos + 4 : pos + 4 + rl].decode()
    pos += 4 + rl
    (el,) = struct.unpack_from(">i", header, pos)
    pos += 4
    ext, end = {}, pos + el
    while pos < end:
        kl = int.from_bytes(header[pos : pos + 2], "big")
        k = header[pos + 2 : pos + 2 + kl].decode()
        pos += 2 + kl
        (vl,) = struct.unpack_from(">i", header, pos)
        ext[k] = header[pos + 4 : pos + 4 + vl].decode()
        pos += 4 + vl
    return Cmd(code, opaque, flag, ext, body, remark, 1)


def properties(d: dict) -> str:
    return "".join(f"{k}\x01{v}\x02" for k, v in d.items())


def parse_properties(s: str) -> dict:
    return dict(item.split("\x01", 1) for item in s.split("\x02") if "\x01" in item)


def decode_messages(body: bytes) -> list[dict]:
    """MessageDecoder.decodes: stored messages one after the other (IPv4 hosts)."""
    out, pos = [], 0
    while pos < len(body):
        size, magic, crc, qid, flag, qoff, cl, sysflag, born = struct.unpack_from(">iiiiiqqiq", body, pos)
        p = pos + 4 * 5 + 8 * 2 + 4 + 8
        hl = 20 if sysflag & 0x10 else 8
        p += hl
        (store_ts,) = struct.unpack_from(">q", body, p)
        p += 8
        sl = 20 if sysflag & 0x20 else 8
        store_host = body[p : p + sl]
        p += sl
        reconsume, prepared, blen = struct.unpack_from(">iqi", body, p)
        p += 16
        mbody = body[p : p + blen]
        p += blen
        tl = body[p]
        topic = body[p + 1 : p + 1 + tl].decode()
        p += 1 + tl
        pl = int.from_bytes(body[p : p + 2], "big")
        props = parse_properties(body[p + 2 : p + 2 + pl].decode())
        p += 2 + pl
        assert p == pos + size, (p, pos, size)
        offset_id = (store_host + struct.pack(">q", cl)).hex().upper()
        out.append({"size": size, "magic": magic, "crc": crc, "queue_id": qid, "flag": flag, "queue_offset": qoff, "cl_offset": cl,
                    "sys_flag": sysflag, "born_ts": born, "store_ts": store_ts, "reconsume_times": reconsume, "prepared": prepared,
                    "body": mbody, "topic": topic, "properties": props, "offset_msg_id": offset_id})
        pos += size
    return out


def offset_of(offset_msg_id: str) -> int:
    return struct.unpack(">q", bytes.fromhex(offset_msg_id)[-8:])[0]


class RemotingClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, serialize: int = 0) -> None:
        self.reader, self.writer, self.serialize = reader, writer, serialize
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self.pushed: asyncio.Queue[Cmd] = asyncio.Queue()
        self.closed = asyncio.Event()
        self._task = asyncio.ensure_future(self._read())

    @classmethod
    async def connect(cls, address: str, serialize: int = 0) -> "RemotingClient":
        host, port = address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        return cls(reader, writer, serialize)

    async def _read(self) -> None:
        try:
            while True:
                head = await self.reader.readexactly(4)
                (n,) = struct.unpack(">i", head)
                cmd = decode(await self.reader.readexactly(n))
                if cmd.flag & 1:
                    fut = self._waiting.pop(cmd.opaque, None)
                    if fut is not None and not fut.done():
                        fut.set_result(cmd)
                    else:
                        await self.pushed.put(cmd)  # a response nothing asked for (a refusal before closing)
                else:
                    await self.pushed.put(cmd)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed.set()
            for fut in self._waiting.values():
                if not fut.done():
                    fut.set_exception(ConnectionError("connection closed"))

    async def request(self, code: int, ext: dict | None = None, body: bytes = b"", timeout: float = 10) -> Cmd:
        opaque = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._waiting[opaque] = fut
        self.writer.write(encode(Cmd(code, opaque, 0, {k: str(v) for k, v in (ext or {}).items()}, body, serialize=self.serialize)))
        return await asyncio.wait_for(fut, timeout)

    def oneway(self, code: int, ext: dict | None = None, body: bytes = b"") -> None:
        self.writer.write(encode(Cmd(code, next(self._ids), 2, {k: str(v) for k, v in (ext or {}).items()}, body, serialize=self.serialize)))

    async def heartbeat(self, client_id: str, producers=(), consumers: dict | None = None) -> Cmd:
        data = {"clientID": client_id, "producerDataSet": [{"groupName": g} for g in producers],
                "consumerDataSet": [{"groupName": g, "consumeType": "CONSUME_PASSIVELY", "messageModel": "CLUSTERING",
                                     "consumeFromWhere": "CONSUME_FROM_LAST_OFFSET", "unitMode": False,
                                     "subscriptionDataSet": [{"topic": t, "subString": "*", "tagsSet": [], "codeSet": [], "subVersion": 0}
                                                             for t in topics]}
                                    for g, topics in (consumers or {}).items()]}
        return await self.request(HEART_BEAT, {}, json.dumps(data).encode())

    async def send(self, topic: str, body: bytes, group: str = "pg", props: dict | None = None, queue_id: int = -1,
                   sys_flag: int = 0, v2: bool = True) -> Cmd:
        h = {"producerGroup": group, "topic": topic, "defaultTopic": "TBW102", "defaultTopicQueueNums": 4, "queueId": queue_id,
             "sysFlag": sys_flag, "bornTimestamp": 0, "flag": 0, "properties": properties(props or {}), "reconsumeTimes": 0,
             "unitMode": "false", "batch": "false"}
        if v2:
            letters = dict(zip(["producerGroup", "topic", "defaultTopic", "defaultTopicQueueNums", "queueId", "sysFlag", "bornTimestamp",
                                "flag", "properties", "reconsumeTimes", "unitMode", "batch"], "abcdefghijkm"))
            return await self.request(SEND_MESSAGE_V2, {letters[k]: v for k, v in h.items()}, body)
        return await self.request(SEND_MESSAGE, h, body)

    async def send_half(self, topic: str, body: bytes, group: str, uniq: str) -> Cmd:
        return await self.send(topic, body, group, {"TRAN_MSG": "true", "PGROUP": group, "UNIQ_KEY": uniq}, sys_flag=PREPARED_FLAG)

    def end(self, group: str, half: Cmd, state: int, tx_id: str, from_check: bool = False, oneway: bool = True):
        """END_TRANSACTION as the Java client sends it: the half's queue offset and the commit-log offset of its msgId."""
        ext = {"producerGroup": group, "tranStateTableOffset": half.ext["queueOffset"], "commitLogOffset": offset_of(half.ext["msgId"]),
               "commitOrRollback": state, "fromTransactionCheck": str(from_check).lower(), "msgId": tx_id, "transactionId": tx_id}
        if oneway:
            self.oneway(END_TRANSACTION, ext)
            return None
        return self.request(END_TRANSACTION, ext)

    def end_check(self, group: str, check: Cmd, state: int) -> None:
        """The answer to a CHECK_TRANSACTION_STATE, as the Java client's checkTransactionState sends it (oneway)."""
        self.oneway(END_TRANSACTION, {"producerGroup": group, "tranStateTableOffset": check.ext["tranStateTableOffset"],
                                      "commitLogOffset": check.ext["commitLogOffset"], "commitOrRollback": state,
                                      "fromTransactionCheck": "true", "msgId": check.ext["msgId"],
                                      "transactionId": check.ext["transactionId"]})

    async def pull(self, group: str, topic: str, queue_id: int, offset: int, suspend_ms: int = 0, max_nums: int = 32) -> Cmd:
        return await self.request(PULL_MESSAGE, {"consumerGroup": group, "topic": topic, "queueId": queue_id, "queueOffset": offset,
                                                 "maxMsgNums": max_nums, "sysFlag": 2 if suspend_ms else 0, "commitOffset": 0,
                                                 "suspendTimeoutMillis": suspend_ms, "subVersion": 0}, timeout=suspend_ms / 1000 + 10)

    async def next_pushed(self, timeout: float = 10) -> Cmd:
        return await asyncio.wait_for(self.pushed.get(), timeout)

    async def close(self) -> None:
        self.writer.close()
        self._task.cancel()
