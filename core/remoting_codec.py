"""RocketMQ 4's remoting protocol, both sides: the codes, a command's encoding in JSON or RocketMQ's binary header,
message properties, batch bodies and the fastjson bodies of RocketMQ's name server and broker.

The broker's remoting front end (``txmq.broker.remoting``) and the client that writes to a RocketMQ cluster
(``txmq.client.rocketmq4``) both use it; it imports nothing of txmq.

A frame on the wire (RocketMQ's RemotingCommand.encode, doc/protocol of
rocketmq-client-cpp)::

    int32 length            # of everything after it: 4 + header + body
    int32 header length     # serialize type in the top byte (0 JSON, 1 ROCKETMQ), length in the low 24 bits
    header                  # the command without its body
    body

The JSON header is an object: ``code``, ``language`` (a name: "JAVA",
"CPP"...), ``version``, ``opaque`` (the request's id, echoed by its
response), ``flag`` (bit 0: a response, bit 1: oneway), ``remark``,
``extFields`` (the request or response header: a map of strings; some
clients write numbers and booleans, which are read as their text). The
binary header (RocketMQSerializable) is ``int16 code, int8 language,
int16 version, int32 opaque, int32 flag, int32 remark length + remark,
int32 ext length + (int16 key length, key, int32 value length, value)*``.
A response goes out in the serialize type of its request: the C++ client
reads JSON only.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field

# ---- request codes (RequestCode) ----------------------------------------------------------
SEND_MESSAGE = 10
PULL_MESSAGE = 11
QUERY_MESSAGE = 12
QUERY_CONSUMER_OFFSET = 14
UPDATE_CONSUMER_OFFSET = 15
UPDATE_AND_CREATE_TOPIC = 17
SEARCH_OFFSET_BY_TIMESTAMP = 29
GET_MAX_OFFSET = 30
GET_MIN_OFFSET = 31
GET_EARLIEST_MSG_STORETIME = 32
VIEW_MESSAGE_BY_ID = 33
HEART_BEAT = 34
UNREGISTER_CLIENT = 35
CONSUMER_SEND_MSG_BACK = 36
END_TRANSACTION = 37
GET_CONSUMER_LIST_BY_GROUP = 38
CHECK_TRANSACTION_STATE = 39
NOTIFY_CONSUMER_IDS_CHANGED = 40
LOCK_BATCH_MQ = 41
UNLOCK_BATCH_MQ = 42
CHECK_CLIENT_CONFIG = 46
GET_ROUTEINFO_BY_TOPIC = 105
GET_BROKER_CLUSTER_INFO = 106
GET_ALL_TOPIC_LIST_FROM_NAMESERVER = 206
GET_CONSUMER_RUNNING_INFO = 307
SEND_MESSAGE_V2 = 310
SEND_BATCH_MESSAGE = 320
GET_BROKER_CONFIG = 26

# ---- response codes (RemotingSysResponseCode, ResponseCode) -------------------------------
SUCCESS = 0
SYSTEM_ERROR = 1
SYSTEM_BUSY = 2
REQUEST_CODE_NOT_SUPPORTED = 3
MESSAGE_ILLEGAL = 13
SERVICE_NOT_AVAILABLE = 14
NO_PERMISSION = 16
TOPIC_NOT_EXIST = 17
PULL_NOT_FOUND = 19
PULL_RETRY_IMMEDIATELY = 20
PULL_OFFSET_MOVED = 21
QUERY_NOT_FOUND = 22
SUBSCRIPTION_PARSE_FAILED = 23
INVALID_PARAMETER = 29

# ---- sysFlag bits (MessageSysFlag, PullSysFlag) -----------------------------------------
COMPRESSED_FLAG = 0x1
MULTI_TAGS_FLAG = 0x2
TRANSACTION_PREPARED_TYPE = 0x4
TRANSACTION_COMMIT_TYPE = 0x8
TRANSACTION_ROLLBACK_TYPE = 0xC
TRANSACTION_TYPE_MASK = 0xC
BORNHOST_V6_FLAG = 0x10
STOREHOSTADDRESS_V6_FLAG = 0x20
COMPRESSION_TYPE_MASK = 0x700  # bits 8-10: 0 or 0x100 ZLIB, 0x200 LZ4, 0x300 ZSTD

PULL_COMMIT_OFFSET = 0x1
PULL_SUSPEND = 0x2
PULL_SUBSCRIPTION = 0x4

RESPONSE_FLAG = 0x1
ONEWAY_FLAG = 0x2

JSON_TYPE = 0
ROCKETMQ_TYPE = 1

LANGUAGES = ("JAVA", "CPP", "DOTNET", "PYTHON", "DELPHI", "ERLANG", "RUBY", "OTHER", "HTTP", "GO", "PHP", "OMS", "RUST", "NODE_JS")
BROKER_LANGUAGE = "PYTHON"  # what txmq writes in its own commands (LanguageCode.PYTHON)

MAX_EXT_FIELDS = 256  # entries in one header's extFields
MAX_REMARK = 4096


# What a request's JSON body (a heartbeat, a lock request) may be, checked before it is parsed: json's
# parser recurses once per level (a 200 KB ``[[[...]]]`` raised RecursionError) and builds every value
# (bytes of ``{},`` cost 64 bytes of dict each).
MAX_JSON_BODY = 2 << 20  # bytes
MAX_JSON_DEPTH = 32  # arrays and objects inside one another (a heartbeat nests 5)
MAX_JSON_VALUES = 1 << 18  # arrays, objects and the values in them (10,000 queues of a lock request are 40,000)
JSON_PRESCAN_FROM = 4096  # bytes: a header this short is parsed as it is (its depth is caught as RecursionError)


class FrameError(Exception):
    """A frame that cannot be a RocketMQ command: its connection is closed."""


class BodyError(ValueError):
    """A request's body that cannot be read (not JSON, nested too deeply, too large): the request is refused, the connection goes on."""


@dataclass(slots=True)
class Command:
    code: int
    opaque: int = 0
    flag: int = 0
    ext: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    remark: str = ""
    version: int = 0
    language: str = BROKER_LANGUAGE
    serialize: int = JSON_TYPE

    @property
    def oneway(self) -> bool:
        return bool(self.flag & ONEWAY_FLAG)

    @property
    def is_response(self) -> bool:
        return bool(self.flag & RESPONSE_FLAG)


_I32 = struct.Struct(">i")
_MIN32, _MAX32 = -(1 << 31), (1 << 31) - 1
_loads = json.JSONDecoder().decode  # a str: json.loads of bytes first guesses their encoding
_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode  # one encoder: json.dumps builds one per call
_HEAD = struct.Struct(">ii")
_BIN_FIXED = struct.Struct(">hbhii")


def _text(v: object) -> str:
    """A header value as RocketMQ's HashMap<String, String> holds it: strings as they are, numbers and booleans as text."""
    if isinstance(v, str):
        return v
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)
    raise FrameError("a header field is not a string, number or boolean")


def decode(payload: bytes) -> Command:
    """A command from one frame's payload (what follows the 4-byte length)."""
    if len(payload) < 4:
        raise FrameError("frame shorter than its header length")
    raw = int.from_bytes(payload[:4], "big")
    kind = raw >> 24
    hlen = raw & 0xFFFFFF
    if hlen > len(payload) - 4:
        raise FrameError(f"header length {hlen} exceeds the frame")
    header = payload[4 : 4 + hlen]
    body = payload[4 + hlen :]
    if kind == JSON_TYPE:
        cmd = _decode_json(header)
    elif kind == ROCKETMQ_TYPE:
        cmd = _decode_binary(header)
    else:
        raise FrameError(f"unknown serialize type {kind}")
    cmd.body = body
    return cmd


_BRACKETS = bytes.maketrans(b"{}", b"[]")  # one kind of bracket: whether they match is the parser's to say
_NOT_BRACKET = bytes(c for c in range(256) if c not in b"[]{}")
_TOO_DEEP = re.compile(rb"\[{%d}" % (MAX_JSON_DEPTH + 1))


def json_shape_error(data: bytes, max_bytes: int = MAX_JSON_BODY) -> str | None:
    """Why ``data`` is not JSON that txmq parses (too large, nested deeper than MAX_JSON_DEPTH, more than
    MAX_JSON_VALUES values), or None; checked at C speed before any parsing.

    Strings are cut out (with bytes operations: a regular expression took
    30 ns a byte); of what is left, the brackets alone tell the depth
    (each pass of removing the innermost pairs takes one level off, so
    MAX_JSON_DEPTH passes take off all of a document nested that deep), and
    the commas and brackets the number of values.
    """
    if len(data) > max_bytes:
        return f"{len(data)} bytes, over the {max_bytes}-byte limit"
    if data.count(b'"') > 2 * MAX_JSON_VALUES:
        return f"more than {MAX_JSON_VALUES} values"
    if b"\\" in data:  # escaped backslashes, then escaped quotes: what is left of a string holds no quote
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    skeleton = b"".join(data.split(b'"')[::2])  # outside the strings
    values = skeleton.count(b",") + 1
    skeleton = skeleton.translate(_BRACKETS, _NOT_BRACKET)
    values += len(skeleton) // 2
    if values > MAX_JSON_VALUES:
        return f"more than {MAX_JSON_VALUES} values"
    if _TOO_DEEP.match(skeleton):
        return f"arrays or objects nested deeper than {MAX_JSON_DEPTH} levels"
    for _ in range(MAX_JSON_DEPTH):
        if not skeleton:
            return None
        shorter = skeleton.replace(b"[]", b"")
        if len(shorter) == len(skeleton):
            return "brackets that do not match"
        skeleton = shorter
    return None if not skeleton else f"arrays or objects nested deeper than {MAX_JSON_DEPTH} levels"


def load_json_object(data: bytes, what: str) -> dict:
    """The JSON object a request's body holds (``{}`` when empty); BodyError when it is not one, or its shape is past the limits."""
    if not data:
        return {}
    why = json_shape_error(data)
    if why is not None:
        raise BodyError(f"the body of {what} is not JSON that txmq reads: {why}")
    try:
        obj = _loads(data.decode())
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise BodyError(f"the body of {what} is not JSON") from None
    if type(obj) is not dict:
        raise BodyError(f"the body of {what} is not a JSON object")
    return obj


def _decode_json(header: bytes) -> Command:
    if len(header) > JSON_PRESCAN_FROM:
        why = json_shape_error(header, len(header))  # its size is --max-frame's to bound
        if why is not None:
            raise FrameError(f"header is not a command: {why}")
    try:
        obj = _loads(header.decode())
    except (ValueError, UnicodeDecodeError) as exc:
        raise FrameError(f"header is not JSON: {exc}") from None
    except RecursionError:  # arrays or objects nested deeper than the decoder goes: no command nests at all
        raise FrameError("header is not a command: JSON nested too deeply") from None
    if type(obj) is not dict:
        raise FrameError("header is not a JSON object")
    get = obj.get
    code, opaque, flag, version = get("code"), get("opaque", 0), get("flag", 0), get("version", 0)
    if type(code) is not int or type(opaque) is not int or type(flag) is not int or type(version) is not int:
        raise FrameError("header fields code, opaque, flag and version must be integers")
    if not (_MIN32 <= code <= _MAX32 and _MIN32 <= opaque <= _MAX32 and _MIN32 <= flag <= _MAX32 and _MIN32 <= version <= _MAX32):
        raise FrameError("header fields code, opaque, flag and version must be 32-bit integers")
    ext_raw = get("extFields") or {}
    if type(ext_raw) is not dict or len(ext_raw) > MAX_EXT_FIELDS:
        raise FrameError(f"extFields is not a map of at most {MAX_EXT_FIELDS} entries")
    for v in ext_raw.values():
        if type(v) is not str:  # some clients write numbers and booleans (the C++ client): their text, as Java's map holds it
            ext_raw = {k: _text(v) for k, v in ext_raw.items() if v is not None}
            break
    remark = get("remark") or ""
    language = get("language") or "OTHER"
    return Command(code, opaque, flag, ext_raw, b"", remark if type(remark) is str else "", version,
                   language if type(language) is str else "OTHER", JSON_TYPE)


def _decode_binary(h: bytes) -> Command:
    try:
        code, lang, version, opaque, flag = _BIN_FIXED.unpack_from(h, 0)
        pos = _BIN_FIXED.size
        (rlen,) = _I32.unpack_from(h, pos)
        pos += 4
        if rlen < 0 or pos + rlen > len(h):
            raise FrameError("remark length exceeds the header")
        remark = h[pos : pos + rlen].decode()
        pos += rlen
        (elen,) = _I32.unpack_from(h, pos)
        pos += 4
        if elen < 0 or pos + elen > len(h):
            raise FrameError("extFields length exceeds the header")
        end = pos + elen
        ext: dict[str, str] = {}
        while pos < end:
            klen = int.from_bytes(h[pos : pos + 2], "big")
            pos += 2
            key = h[pos : pos + klen].decode()
            pos += klen
            (vlen,) = _I32.unpack_from(h, pos)
            pos += 4
            if vlen < 0 or pos + vlen > end or pos > end:
                raise FrameError("an extFields entry exceeds the header")
            ext[key] = h[pos : pos + vlen].decode()
            pos += vlen
            if len(ext) > MAX_EXT_FIELDS:
                raise FrameError(f"more than {MAX_EXT_FIELDS} extFields entries")
        if pos != end:
            raise FrameError("extFields entries overrun their length")
    except struct.error:
        raise FrameError("binary header is truncated") from None
    except UnicodeDecodeError:
        raise FrameError("binary header holds text that is not UTF-8") from None
    language = LANGUAGES[lang] if 0 <= lang < len(LANGUAGES) else "OTHER"
    return Command(code=code, opaque=opaque, flag=flag, ext=ext, remark=remark, version=version, language=language,
                   serialize=ROCKETMQ_TYPE)


def encode(cmd: Command) -> bytes:
    """The whole frame, length prefix included."""
    if cmd.serialize == ROCKETMQ_TYPE:
        header = _encode_binary(cmd)
    else:
        # The keys in the order RocketMQ's own fastjson writes them (sorted): the Java client's fastjson reads a
        # header in that order on its generated fast path, and any other order on a slow path of reflective setters
        # that its JIT then compiles (about 40 µs of the client's CPU per transaction over a 4,000-transaction run).
        remark = f'"remark":{_dumps(cmd.remark)},' if cmd.remark else ""
        header = (f'{{"code":{cmd.code},"extFields":{_dumps(cmd.ext)},"flag":{cmd.flag},"language":"{cmd.language}",'
                  f'"opaque":{cmd.opaque},{remark}"serializeTypeCurrentRPC":"JSON","version":{cmd.version}}}').encode()
    body = cmd.body or b""
    return b"".join((_HEAD.pack(4 + len(header) + len(body), (cmd.serialize << 24) | len(header)), header, body))


def _encode_binary(cmd: Command) -> bytes:
    lang = LANGUAGES.index(cmd.language) if cmd.language in LANGUAGES else LANGUAGES.index("OTHER")
    remark = cmd.remark.encode()
    parts = [_BIN_FIXED.pack(cmd.code, lang, cmd.version, cmd.opaque, cmd.flag), _I32.pack(len(remark)), remark]
    ext = []
    for k, v in cmd.ext.items():
        kb, vb = k.encode(), v.encode()
        ext += [len(kb).to_bytes(2, "big"), kb, _I32.pack(len(vb)), vb]
    eb = b"".join(ext)
    parts += [_I32.pack(len(eb)), eb]
    return b"".join(parts)


def response(req: Command, code: int, ext: dict[str, str] | None = None, body: bytes = b"", remark: str = "") -> Command:
    """The response to ``req``: its opaque, the response flag, its serialize type."""
    return Command(code=code, opaque=req.opaque, flag=RESPONSE_FLAG, ext=ext or {}, body=body, remark=remark[:MAX_REMARK],
                   version=req.version, serialize=req.serialize)


def request(code: int, opaque: int, ext: dict[str, str], body: bytes = b"", oneway: bool = False, serialize: int = JSON_TYPE) -> Command:
    """A request from the broker to a client (CHECK_TRANSACTION_STATE, NOTIFY_CONSUMER_IDS_CHANGED)."""
    return Command(code=code, opaque=opaque, flag=ONEWAY_FLAG if oneway else 0, ext=ext, body=body, serialize=serialize)


# ---- message properties (MessageDecoder.messageProperties2String / string2messageProperties) ------------------
NAME_VALUE_SEPARATOR = "\x01"
PROPERTY_SEPARATOR = "\x02"


def decode_properties(text: str) -> dict[str, str]:
    props: dict[str, str] = {}
    if not text:
        return props
    for item in text.split(PROPERTY_SEPARATOR):
        if not item:
            continue
        k, sep, v = item.partition(NAME_VALUE_SEPARATOR)
        if not sep or not k:
            continue  # as RocketMQ's string2messageProperties: an item without a separator is skipped
        props[k] = v
    return props


def encode_properties(props: dict[str, str]) -> str:
    return "".join(f"{k}{NAME_VALUE_SEPARATOR}{v}{PROPERTY_SEPARATOR}" for k, v in props.items()
                   if NAME_VALUE_SEPARATOR not in k and PROPERTY_SEPARATOR not in k
                   and NAME_VALUE_SEPARATOR not in v and PROPERTY_SEPARATOR not in v)


# ---- batch bodies (MessageDecoder.encodeMessages) --------------------------------------------------------------
_BATCH_ITEM = struct.Struct(">iiiii")
MAX_PROPERTIES_BYTES = 0x7FFF  # a Java short: the length field of a message's properties


def encode_batch_message(body: bytes, props: dict[str, str], flag: int = 0) -> bytes:
    """One message of a SEND_BATCH_MESSAGE body, as MessageDecoder.encodeMessage writes it: int32 total size,
    int32 magic (0), int32 body CRC (0), int32 flag, int32 body length + body, int16 properties length + properties."""
    pb = encode_properties(props).encode()
    if len(pb) > MAX_PROPERTIES_BYTES:
        raise ValueError(f"a message's properties take {len(pb)} bytes: RocketMQ takes at most {MAX_PROPERTIES_BYTES}")
    size = _BATCH_ITEM.size + len(body) + 2 + len(pb)
    return b"".join((_BATCH_ITEM.pack(size, 0, 0, flag, len(body)), body, len(pb).to_bytes(2, "big"), pb))


def encode_batch(messages: list[tuple[bytes, dict[str, str], int]]) -> bytes:
    """A batch body: (body, properties, flag) of each message, one after the other (MessageDecoder.encodeMessages)."""
    return b"".join(encode_batch_message(b, p, f) for b, p, f in messages)


# ---- fastjson bodies -------------------------------------------------------------------------------------------
_BARE_INT_KEY = re.compile(r"([{,]\s*)(-?[0-9]+)(\s*:)")


def load_fastjson(data: bytes) -> object:
    """A body RocketMQ's name server or broker wrote with fastjson: JSON, but a map's integer keys unquoted
    (``"brokerAddrs":{0:"127.0.0.1:10911"}``); those are quoted first, outside strings only."""
    text = data.decode()
    parts = re.split(r'("(?:[^"\\]|\\.)*")', text)  # strings at the odd indexes
    for i in range(0, len(parts), 2):
        parts[i] = _BARE_INT_KEY.sub(r'\1"\2"\3', parts[i])
    return json.loads("".join(parts))
