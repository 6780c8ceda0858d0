"""One function per request code: read the header fields, call the messaging service, build the response.

A handler takes (front end, connection, command) and returns the response
command, a ``Then`` or an awaitable of it, or None (nothing to answer)
(dispatch.py). Errors are TxmqErrors (or the services' own, which
``Messaging.error_of`` words), which ``error_response`` maps to RocketMQ's
response codes (docs/remoting.md, "Response codes"). The broker is reached
through ``front.messaging`` (``txmq.broker.messaging.Messaging``) and
nothing else: sends and ends of transactions are the calls the other front
ends make, so a transaction has one outcome whichever protocol ended it,
and every message is readable through every front end.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from txmq.constants import (
    PROP_PGROUP,
    PROP_TRAN_MSG,
    is_system_topic,
)
from txmq.wire import ErrorCode, TxmqError

from ..messaging import ROCKETMQ4_RULES, Outgoing, PullResult, PullStatus, SendReceipt, SentBack
from ..topics import MAX_QUEUES

from . import protocol as p

from ..messaging.naming import DLQ_PREFIX, MAX_RECONSUME_TIMES, RETRY_PREFIX
from ..messaging.sqlfilter import Predicate, SqlFilterError, compile_sql

from .clients import INNER_PRODUCER, check_group
from .context import Connection
from .dispatch import (  # noqa: F401  the handler table and its helpers, as handlers.HANDLERS etc. too
    HANDLERS,
    Front,
    Handler,
    Result,
    Then,
    _bad,
    handles,
    json_body,
    ok,
    opt_bool,
    opt_int,
    parse_json_body,
    req_int,
    req_str,
    served_codes,
    topic_of,
)
from .messages import (
    PROP_CLUSTER,
    PROP_FLAG,
    PROP_RECONSUME_TIME,
    PROP_WAIT,
    MessageFormatError,
    decode_batch,
    decode_properties,
    encode_maps,
    encode_record,
    inflate,
    offset_msg_id,
)

if TYPE_CHECKING:
    from ..messaging import Messaging

log = logging.getLogger("txmq.remoting")

MAX_PULL_MESSAGES = 1024
DEFAULT_PULL_BYTES = 4 << 20
MAX_PROPERTIES_COUNT = 256
PERM_READ_WRITE = 6
AUTO_CREATE_TOPIC = "TBW102"  # RocketMQ's template topic: Java producers ask for its route, then send to their own topic

# txmq's error codes -> RocketMQ's response codes (docs/remoting.md, "Response codes").
_CODES = {
    ErrorCode.INVALID_FIELD: p.INVALID_PARAMETER,
    ErrorCode.INVALID_TOPIC: p.INVALID_PARAMETER,
    ErrorCode.INVALID_CONFIG: p.INVALID_PARAMETER,
    ErrorCode.NO_SUCH_QUEUE: p.INVALID_PARAMETER,
    ErrorCode.BODY_TOO_LARGE: p.MESSAGE_ILLEGAL,
    ErrorCode.MESSAGE_TYPE_NOT_ACCEPTED: p.MESSAGE_ILLEGAL,
    ErrorCode.SYSTEM_TOPIC: p.NO_PERMISSION,
    ErrorCode.AUTH_REQUIRED: p.NO_PERMISSION,
    ErrorCode.AUTH_FAILED: p.NO_PERMISSION,
    ErrorCode.NO_SUCH_TOPIC: p.TOPIC_NOT_EXIST,
    ErrorCode.STORE_FULL: p.SERVICE_NOT_AVAILABLE,
    ErrorCode.SHUTTING_DOWN: p.SYSTEM_BUSY,
    ErrorCode.BUSY: p.SYSTEM_BUSY,
}


def rmq_code(code: ErrorCode) -> int:
    return _CODES.get(code, p.SYSTEM_ERROR)


def error_response(messaging: Messaging, cmd: p.Command, exc: BaseException) -> p.Command:
    if isinstance(exc, MessageFormatError):
        messaging.metrics.inc("remoting_errors")
        return p.response(cmd, p.MESSAGE_ILLEGAL, remark=str(exc))
    if isinstance(exc, p.BodyError):  # RocketMQ's broker answers a body it cannot decode SYSTEM_ERROR; clients take both alike
        messaging.metrics.inc("remoting_errors")
        return p.response(cmd, p.INVALID_PARAMETER, remark=f"{ErrorCode.INVALID_FIELD.name}: {exc}")
    err = exc if isinstance(exc, TxmqError) else messaging.error_of(exc)
    messaging.metrics.inc("remoting_errors")
    return p.response(cmd, rmq_code(err.code), remark=f"{err.code.name}: {err.message}")


def known_queue(messaging: Messaging, topic: str, qid: int) -> None:
    n = messaging.topic_queues(topic)
    if n is None:
        raise TxmqError(f"topic {topic} does not exist", ErrorCode.NO_SUCH_TOPIC, topic=topic)
    if not 0 <= qid < n:
        raise TxmqError(f"queue {qid} does not exist: topic {topic} has {n} queues", ErrorCode.NO_SUCH_QUEUE)


# ---- the name server ------------------------------------------------------------------------
@handles(p.GET_ROUTEINFO_BY_TOPIC)
def get_route(front: Front, conn: Connection, cmd: p.Command) -> p.Command:
    """The topic's route: its queues, all on this broker, reached at this port (the address the client connected to).

    A topic the broker does not know is created when it auto-creates
    topics (as a first send would, and as the gRPC front end's routes do);
    otherwise TOPIC_NOT_EXIST, on which clients fall back as they do
    against RocketMQ.
    """
    messaging = front.messaging
    try:
        topic = topic_of(cmd.ext)
    except TxmqError as exc:
        return p.response(cmd, p.TOPIC_NOT_EXIST, remark=f"No topic route info in name server for the topic: {cmd.ext.get('topic', '')[:200]} "
                          f"({exc.message})")
    n = messaging.topic_queues(topic)
    if n is None:
        if not messaging.auto_create_topics:
            return p.response(cmd, p.TOPIC_NOT_EXIST, remark=f"No topic route info in name server for the topic: {topic} (this broker "
                              "creates topics only with `txmq topics create`)")
        if topic == AUTO_CREATE_TOPIC:  # the Java producer's template topic: routed, never created
            n = messaging.config.default_queues
        else:
            # a group's retry and dead-letter topics have one queue, as RocketMQ's broker creates them
            n, _ = messaging.ensure_topic(topic, 1 if topic.startswith((RETRY_PREFIX, DLQ_PREFIX)) else None)
    host = conn.local_host
    addr = f"[{host}]:{front.port}" if ":" in host else f"{host}:{front.port}"
    route = {
        "orderTopicConf": "",
        "queueDatas": [{"brokerName": front.broker_name, "readQueueNums": n, "writeQueueNums": n, "perm": PERM_READ_WRITE,
                        "topicSynFlag": 0, "topicSysFlag": 0}],
        "brokerDatas": [{"cluster": front.cluster_name, "brokerName": front.broker_name, "brokerAddrs": {"0": addr}}],
        "filterServerTable": {},
    }
    return ok(cmd, body=json_body(route))


@handles(p.GET_ALL_TOPIC_LIST_FROM_NAMESERVER)
def topic_list(front: Front, conn: Connection, cmd: p.Command) -> p.Command:
    return ok(cmd, body=json_body({"topicList": sorted(t for t in front.messaging.topics() if not is_system_topic(t))}))


@handles(p.UPDATE_AND_CREATE_TOPIC)
def create_topic(front: Front, conn: Connection, cmd: p.Command) -> p.Command:
    """`txmq topics create` with the larger of the read and write queue counts; for a topic that exists, `txmq topics
    update` to that count (mqadmin's updateTopic; queues that held messages are not removed)."""
    topic = topic_of(cmd.ext)
    queues = max(opt_int(cmd.ext, "writeQueueNums", 0, 0, MAX_QUEUES), opt_int(cmd.ext, "readQueueNums", 0, 0, MAX_QUEUES)) or None
    messaging = front.messaging
    if queues is not None and messaging.topic_queues(topic) is not None:
        messaging.update_topic(topic, queues, None)
    else:
        messaging.create_topic(topic, queues, None)
    return ok(cmd)


# ---- clients --------------------------------------------------------------------------------
@handles(p.HEART_BEAT)
def heartbeat(front: Front, conn: Connection, cmd: p.Command) -> p.Command:
    front.clients.heartbeat(conn, cmd.body)
    conn.client_language, conn.client_version = cmd.language, cmd.version  # GET_CONSUMER_CONNECTION_LIST shows them
    return ok(cmd)


@handles(p.UNREGISTER_CLIENT)
def unregister_client(front: Front, conn: Connection, cmd: p.Command) -> p.Command:
    ext = cmd.ext
    front.clients.unregister(conn, ext.get("clientID", ""), ext.get("producerGroup", ""), ext.get("consumerGroup", ""))
    return ok(cmd)


# ---- sending --------------------------------------------------------------------------------
# SEND_MESSAGE_V2's one-letter header fields (SendMessageRequestHeaderV2) -> SEND_MESSAGE's names.
V2_NAMES = {"a": "producerGroup", "b": "topic", "c": "defaultTopic", "d": "defaultTopicQueueNums", "e": "queueId", "f": "sysFlag",
            "g": "bornTimestamp", "h": "flag", "i": "properties", "j": "reconsumeTimes", "k": "unitMode",
            "l": "maxReconsumeTimes", "m": "batch", "n": "brokerName"}


V1_KEYS = tuple(V2_NAMES.values())
V2_KEYS = tuple(V2_NAMES)


def send_header(cmd: p.Command) -> dict[str, str]:
    """The header of a send by SEND_MESSAGE's field names, whichever of the two forms the request has."""
    ext = cmd.ext
    if cmd.code == p.SEND_MESSAGE_V2 or (cmd.code == p.SEND_BATCH_MESSAGE and "b" in ext):
        get = ext.get
        return {name: v for name, v in zip(V1_KEYS, map(get, V2_KEYS)) if v is not None}
    return ext


def _props(front: Front, text: str) -> dict[str, str]:
    cfg = front.messaging.config
    if len(text) > cfg.max_properties:
        raise MessageFormatError(f"the properties exceed {cfg.max_properties} bytes (--max-properties)")
    return _checked_props(front, decode_properties(text))


def _checked_props(front: Front, props: dict[str, str]) -> dict[str, str]:
    """A message's properties within --max-properties and MAX_PROPERTIES_COUNT (a single send's or each of a batch's)."""
    limit = front.messaging.config.max_properties
    if len(props) > MAX_PROPERTIES_COUNT:
        raise MessageFormatError(f"a message has at most {MAX_PROPERTIES_COUNT} properties")
    if sum(len(k.encode()) + len(v.encode()) for k, v in props.items()) > limit:
        raise MessageFormatError(f"the properties exceed {limit} bytes (--max-properties)")
    return props


def _body(front: Front, body: bytes, sys_flag: int) -> bytes:
    limit = front.messaging.config.max_body
    body = inflate(body, sys_flag, limit)
    if len(body) > limit:
        raise MessageFormatError(f"the body of {len(body)} bytes exceeds the {limit}-byte limit (--max-body)")
    return body


def _with_flags(props: dict[str, str], flag: int, reconsume: int) -> dict[str, str]:
    if flag:
        props[PROP_FLAG] = str(flag)
    if reconsume > 0:
        props[PROP_RECONSUME_TIME] = str(reconsume)
    return props


def _send_ext(msg_id: str, qid: int, qoff: int) -> dict[str, str]:
    # No transactionId: RocketMQ 4.9.8's broker sends none (a client's TransactionSendResult.getTransactionId() is
    # null); the client ends a transaction with the msgId it sent, which txmq's end takes as the transaction id.
    return {"msgId": msg_id, "queueId": str(qid), "queueOffset": str(qoff), "MSG_REGION": "DefaultRegion", "TRACE_ON": "true"}


@handles(p.SEND_MESSAGE, p.SEND_MESSAGE_V2, p.SEND_BATCH_MESSAGE)
def send_message(front: Front, conn: Connection, cmd: p.Command) -> Result:
    messaging = front.messaging
    h = send_header(cmd)
    topic = topic_of(h)
    group = h.get("producerGroup", "")
    qid = opt_int(h, "queueId", -1, -1, MAX_QUEUES)
    sys_flag = opt_int(h, "sysFlag", 0, -(1 << 31), (1 << 31) - 1)
    born = opt_int(h, "bornTimestamp", 0, 0) or messaging.now_ms()
    flag = opt_int(h, "flag", 0, -(1 << 31), (1 << 31) - 1)
    reconsume = opt_int(h, "reconsumeTimes", 0, 0, 1 << 30)
    props = _props(front, h.get("properties", ""))
    if cmd.code == p.SEND_BATCH_MESSAGE or opt_bool(h, "batch"):
        return _send_batch(front, conn, cmd, topic, qid, born, props)
    body = _body(front, cmd.body, sys_flag)
    _with_flags(props, flag, reconsume)
    # As RocketMQ's broker stores a message sent alone: without the client's WAIT=true, with the cluster's name.
    props.pop(PROP_WAIT, None)
    props[PROP_CLUSTER] = front.cluster_name
    if props.get(PROP_TRAN_MSG) == "true" or sys_flag & p.TRANSACTION_TYPE_MASK == p.TRANSACTION_PREPARED_TYPE:
        props[PROP_TRAN_MSG] = "true"
        if not props.get(PROP_PGROUP):
            props[PROP_PGROUP] = group
    fut = messaging.send(topic, [Outgoing(body, props, born)], qid, ROCKETMQ4_RULES)
    addr, port = conn.store_addr, front.port

    def reply(receipts: list[SendReceipt]) -> p.Command:
        # a half message's queueOffset is its half offset (tranStateTableOffset) and its msgId names the half's
        # commit-log offset: RocketMQ's client ends the transaction with those two
        r = receipts[0]
        return ok(cmd, _send_ext(offset_msg_id(addr, port, r.commit_log_offset), r.queue_id, r.queue_offset))

    return Then(fut, reply)


def _send_batch(front: Front, conn: Connection, cmd: p.Command, topic: str, qid: int, born: int,
                header_props: dict[str, str]) -> Result:
    messaging = front.messaging
    items = decode_batch(cmd.body)
    budget = messaging.config.max_frame
    msgs_in = []
    for flag, body, props in items:
        _checked_props(front, props)
        if props.get(PROP_TRAN_MSG) == "true":
            raise MessageFormatError("transactional messages cannot be sent in a batch")
        body = _body(front, body, 0)
        budget -= len(body)
        if budget < 0:
            raise MessageFormatError(f"the bodies of one batch exceed {messaging.config.max_frame} bytes (--max-frame)")
        props[PROP_CLUSTER] = front.cluster_name  # as RocketMQ's broker stores a batch's messages (WAIT kept)
        msgs_in.append((_with_flags(props, flag, 0), body))
    fut = messaging.send(topic, [Outgoing(body, props, born) for props, body in msgs_in], qid, ROCKETMQ4_RULES)
    addr, port = conn.store_addr, front.port

    def reply(receipts: list[SendReceipt]) -> p.Command:
        ids = ",".join(offset_msg_id(addr, port, r.commit_log_offset) for r in receipts)
        return ok(cmd, _send_ext(ids, receipts[0].queue_id, receipts[0].queue_offset))

    return Then(fut, reply)


# ---- transactions ---------------------------------------------------------------------------
_STATES = {p.TRANSACTION_COMMIT_TYPE: "commit", p.TRANSACTION_ROLLBACK_TYPE: "rollback", 0: "unknown"}


@handles(p.END_TRANSACTION)
def end_transaction(front: Front, conn: Connection, cmd: p.Command) -> Result:
    """COMMIT (8), ROLLBACK (12) or UNKNOWN (0), for the half copy the offsets name; usually oneway."""
    ext = cmd.ext
    group = req_str(ext, "producerGroup")
    cl = req_int(ext, "commitLogOffset", 0)
    half = req_int(ext, "tranStateTableOffset", 0)
    kind = req_int(ext, "commitOrRollback", -(1 << 31), (1 << 31) - 1)
    state = _STATES.get(kind)
    if state is None:
        raise _bad(f"commitOrRollback must be 8 (commit), 12 (rollback) or 0 (unknown), not {kind}")
    tx_id = ext.get("transactionId") or ext.get("msgId") or ""
    if not tx_id or len(tx_id) > 255:
        raise _bad("the transaction is not named: transactionId (or msgId) must be 1 to 255 characters")
    source = "check" if opt_bool(ext, "fromTransactionCheck") else "producer"

    fut = front.messaging.end_transaction(group, tx_id, cl, half, state, source)
    return Then(fut, lambda outcome: ok(cmd, remark=outcome.remark()))


# ---- consuming ------------------------------------------------------------------------------
def _tags(expr: str | None) -> frozenset[str] | None:
    if expr is None:
        return None
    expr = expr.strip()
    if not expr or expr == "*":
        return None
    return frozenset(t.strip() for t in expr.split("||") if t.strip())


def _filter_of(expr: str | None, etype: str) -> tuple[frozenset[str] | None, Predicate | None]:
    """A subscription's filter: the tags of a TAG expression, or the predicate of a SQL92 one over the properties."""
    if etype in ("TAG", ""):
        return _tags(expr), None
    if expr is None:
        return None, None
    if etype != "SQL92":
        raise TxmqError(f"expression type {etype[:20]!r} is not supported: txmq filters by TAG or SQL92", ErrorCode.INVALID_FIELD)
    try:
        return None, compile_sql(expr)
    except SqlFilterError as e:
        raise _ParseFailed(f"the SQL92 expression does not compile: {e}") from None


class _ParseFailed(Exception):
    """A subscription's expression that does not compile (SUBSCRIPTION_PARSE_FAILED)."""


@handles(p.CHECK_CLIENT_CONFIG)
def check_client_config(front: Front, conn: Connection, cmd: p.Command) -> p.Command:
    """Whether the broker serves a subscription's expression: a consumer with a SQL92 one asks before it starts."""
    sd = parse_json_body(cmd, "CHECK_CLIENT_CONFIG").get("subscriptionData")
    if isinstance(sd, dict):
        expr, etype = sd.get("subString"), sd.get("expressionType")
        try:  # the same reading a pull makes of it
            _filter_of(expr if isinstance(expr, str) else "", etype if isinstance(etype, str) else "TAG")
        except _ParseFailed as e:
            return p.response(cmd, p.SUBSCRIPTION_PARSE_FAILED, remark=str(e))
        except TxmqError as e:  # an expression type txmq does not filter by
            return p.response(cmd, p.SYSTEM_ERROR, remark=str(e))
    return ok(cmd)


@handles(p.PULL_MESSAGE)
def pull_message(front: Front, conn: Connection, cmd: p.Command) -> Result:
    messaging = front.messaging
    ext = cmd.ext
    group = req_str(ext, "consumerGroup")
    topic = topic_of(ext)
    qid = req_int(ext, "queueId", 0, MAX_QUEUES)
    offset = req_int(ext, "queueOffset", 0)
    count = min(opt_int(ext, "maxMsgNums", 32, 1, 1 << 31), MAX_PULL_MESSAGES)
    sys_flag = opt_int(ext, "sysFlag", 0, 0, (1 << 31) - 1)
    if sys_flag & p.PULL_COMMIT_OFFSET:
        check_group(group, "consumer group")  # the group's offset is written: a name txmq's offsets take
    max_bytes = opt_int(ext, "maxMsgBytes", 0, 0, 1 << 31) or DEFAULT_PULL_BYTES
    max_bytes = min(max_bytes, 64 << 20)
    wait = opt_int(ext, "suspendTimeoutMillis", 0, 0, 1 << 31) if sys_flag & p.PULL_SUSPEND else 0
    if messaging.topic_queues(topic) is None:
        raise TxmqError(f"topic[{topic}] not exist, apply first please!", ErrorCode.NO_SUCH_TOPIC, topic=topic)
    expr = ext.get("subscription") if sys_flag & p.PULL_SUBSCRIPTION else None
    etype = ext.get("expressionType") or "TAG"
    if expr is None:
        registered = front.clients.subscription_typed(group, topic)
        if registered is not None:
            expr, etype = registered
    try:
        tags, match = _filter_of(expr, etype)
    except _ParseFailed as e:
        return p.response(cmd, p.SUBSCRIPTION_PARSE_FAILED, remark=str(e))
    if sys_flag & p.PULL_COMMIT_OFFSET:
        committed = opt_int(ext, "commitOffset", -1, -1)
        n = messaging.topic_queues(topic)
        if committed >= 0 and n is not None and qid < n:
            messaging.set_offset(group, topic, qid, committed)

    async def reply() -> p.Command:
        return pull_response(cmd, await messaging.pull(topic, qid, offset, count, max_bytes, wait), offset, tags, conn.store_addr,
                             front.port, match)

    return reply()


def pull_response(cmd: p.Command, r: PullResult, offset: int, tags: frozenset[str] | None, store_addr: bytes, store_port: int,
                  match: Predicate | None = None) -> p.Command:
    """PULL_MESSAGE's response to a pull from ``offset``: its code, the queue's bounds and where the client pulls next;
    the messages those of ``tags``, or those whose properties ``match`` (a SQL92 subscription)."""
    status = r.status
    head = {"suggestWhichBrokerId": "0", "minOffset": str(r.min_offset), "maxOffset": str(r.max_offset)}
    if status is PullStatus.FOUND:
        msgs = r.messages
        if tags is not None:
            msgs = [m for m in msgs if m["properties"].get("TAGS") in tags]
        elif match is not None:
            msgs = [m for m in msgs if match(m["properties"])]
        head["nextBeginOffset"] = str(r.next_offset)
        if not msgs:  # every message read was filtered out: the client pulls again from past them
            return p.response(cmd, p.PULL_RETRY_IMMEDIATELY, head, remark="no message matched the subscription")
        return ok(cmd, head, encode_maps(msgs, store_addr, store_port))
    if status is PullStatus.OFFSET_TOO_SMALL:
        head["nextBeginOffset"] = str(r.min_offset)
        return p.response(cmd, p.PULL_OFFSET_MOVED, head, remark=f"offset {offset} is below the queue's first, {r.min_offset}")
    if status is PullStatus.OFFSET_OVERFLOW:
        head["nextBeginOffset"] = str(r.max_offset)
        return p.response(cmd, p.PULL_OFFSET_MOVED, head, remark=f"offset {offset} is past the queue's end, {r.max_offset}")
    head["nextBeginOffset"] = str(offset if status is not PullStatus.NO_QUEUE else 0)
    return p.response(cmd, p.PULL_NOT_FOUND, head, remark="no new message")


@handles(p.QUERY_CONSUMER_OFFSET)
def query_consumer_offset(front: Front, conn: Connection, cmd: p.Command) -> p.Command:
    """The group's committed offset; none yet: 0 while the queue still holds its first message (as RocketMQ's broker
    answers for a queue whose start is still in memory), else QUERY_NOT_FOUND (the client's consumeFromWhere decides)."""
    messaging = front.messaging
    group = req_str(cmd.ext, "consumerGroup")
    topic = topic_of(cmd.ext)
    qid = req_int(cmd.ext, "queueId", 0, MAX_QUEUES)
    off = messaging.consumer_offset(group, topic, qid)
    if off is None:
        if opt_bool(cmd.ext, "setZeroIfNotFound") or messaging.queue_bounds(topic, qid)[0] == 0:
            off = 0
        else:
            return p.response(cmd, p.QUERY_NOT_FOUND, remark=f"group {group} has no offset for {topic} queue {qid}")
    return ok(cmd, {"offset": str(off)})


@handles(p.UPDATE_CONSUMER_OFFSET)
def update_consumer_offset(front: Front, conn: Connection, cmd: p.Command) -> Result:
    messaging = front.messaging
    group = check_group(req_str(cmd.ext, "consumerGroup"), "consumer group")
    topic = topic_of(cmd.ext)
    qid = req_int(cmd.ext, "queueId", 0, MAX_QUEUES)
    off = req_int(cmd.ext, "commitOffset", 0)
    known_queue(messaging, topic, qid)
    if cmd.oneway:
        messaging.set_offset(group, topic, qid, off)
        return None

    async def reply() -> p.Command:
        await messaging.commit_offset(group, topic, qid, off)
        return ok(cmd)

    return reply()


@handles(p.GET_CONSUMER_LIST_BY_GROUP)
def consumer_list(front: Front, conn: Connection, cmd: p.Command) -> p.Command:
    group = req_str(cmd.ext, "consumerGroup")
    ids = front.clients.consumer_ids(group)
    if not ids:
        return p.response(cmd, p.SYSTEM_ERROR, remark=f"no consumer for this group, {group}")
    return ok(cmd, body=json_body({"consumerIdList": ids}))


def _mq_set(data: dict, messaging: Messaging | None = None) -> list[tuple[str, int]]:
    """The queues of a lock request; with ``messaging``, only those that exist (a lock is kept per queue)."""
    out = []
    mqs = data.get("mqSet")
    if not isinstance(mqs, list) or len(mqs) > 10_000:
        raise _bad("mqSet must be a list of at most 10000 message queues")
    for mq in mqs:
        if not isinstance(mq, dict) or not isinstance(mq.get("topic"), str) or type(mq.get("queueId")) is not int:
            raise _bad("each message queue of mqSet needs a topic and a queueId")
        if messaging is not None and not 0 <= mq["queueId"] < (messaging.topic_queues(mq["topic"]) or 0):
            continue  # no such queue: not locked, as it is not in the answer
        out.append((mq["topic"], mq["queueId"]))
    return out


@handles(p.LOCK_BATCH_MQ)
def lock_batch(front: Front, conn: Connection, cmd: p.Command) -> p.Command:
    data = parse_json_body(cmd, "LOCK_BATCH_MQ")
    group, client_id = data.get("consumerGroup"), data.get("clientId")
    if not isinstance(group, str) or not isinstance(client_id, str) or not group or not client_id:
        raise _bad("LOCK_BATCH_MQ needs consumerGroup and clientId")
    queues = _mq_set(data, front.messaging)
    # Only a live consumer of the group (its heartbeat came first, as the clients send it) takes locks: the
    # table holds no group or client id that no connection carries, and a client's locks go with its last connection.
    locked = front.clients.lock(group, client_id, queues) if front.clients.is_member(group, client_id) else []
    return ok(cmd, body=json_body({"lockOKMQSet": [{"topic": t, "brokerName": front.broker_name, "queueId": q} for t, q in locked]}))


@handles(p.UNLOCK_BATCH_MQ)
def unlock_batch(front: Front, conn: Connection, cmd: p.Command) -> p.Command:
    data = parse_json_body(cmd, "UNLOCK_BATCH_MQ")
    group, client_id = data.get("consumerGroup"), data.get("clientId")
    if not isinstance(group, str) or not isinstance(client_id, str):
        raise _bad("UNLOCK_BATCH_MQ needs consumerGroup and clientId")
    front.clients.unlock(group, client_id, _mq_set(data))
    return ok(cmd)


@handles(p.CONSUMER_SEND_MSG_BACK)
def send_msg_back(front: Front, conn: Connection, cmd: p.Command) -> Result:
    """A message its consumer failed: again through %RETRY%<group> after its retry delay (level 3 + its retries), or,
    past maxReconsumeTimes (16) or with a negative delay level, into the dead-letter topic %DLQ%<group>
    (``Messaging.send_back``: RocketMQ's rules, one place)."""
    messaging = front.messaging
    ext = cmd.ext
    group = check_group(req_str(ext, "group"), "consumer group")
    cl = req_int(ext, "offset", 0)
    level = opt_int(ext, "delayLevel", 0, -(1 << 31), (1 << 31) - 1)
    max_times = opt_int(ext, "maxReconsumeTimes", MAX_RECONSUME_TIMES, -1, 1 << 20)
    if max_times < 0:
        max_times = MAX_RECONSUME_TIMES
    origin = ext.get("originMsgId") or offset_msg_id(conn.store_addr, front.port, cl)

    def reply(sent: SentBack) -> p.Command:
        messaging.metrics.inc("remoting_dead_lettered" if sent.dead_lettered else "remoting_retried")
        return ok(cmd)

    return Then(messaging.send_back(group, cl, level, max_times, origin), reply)


# ---- offsets and lookups ------------------------------------------------------------------------
def _queue(front: Front, cmd: p.Command) -> tuple[str, int]:
    topic = topic_of(cmd.ext)
    qid = req_int(cmd.ext, "queueId", 0, MAX_QUEUES)
    known_queue(front.messaging, topic, qid)
    return topic, qid


@handles(p.GET_MAX_OFFSET)
def get_max_offset(front: Front, conn: Connection, cmd: p.Command) -> p.Command:
    topic, qid = _queue(front, cmd)
    return ok(cmd, {"offset": str(front.messaging.queue_bounds(topic, qid)[1])})


@handles(p.GET_MIN_OFFSET)
def get_min_offset(front: Front, conn: Connection, cmd: p.Command) -> p.Command:
    topic, qid = _queue(front, cmd)
    return ok(cmd, {"offset": str(front.messaging.queue_bounds(topic, qid)[0])})


@handles(p.GET_EARLIEST_MSG_STORETIME)
def earliest_store_time(front: Front, conn: Connection, cmd: p.Command) -> p.Command:
    topic, qid = _queue(front, cmd)
    messaging = front.messaging
    ts = messaging.store_time_at(topic, qid, messaging.queue_bounds(topic, qid)[0])
    return ok(cmd, {"timestamp": str(-1 if ts is None else ts)})


@handles(p.SEARCH_OFFSET_BY_TIMESTAMP)
def search_offset(front: Front, conn: Connection, cmd: p.Command) -> p.Command:
    topic, qid = _queue(front, cmd)
    ts = req_int(cmd.ext, "timestamp", 0)
    return ok(cmd, {"offset": str(front.messaging.offset_for_time(topic, qid, ts))})


@handles(p.VIEW_MESSAGE_BY_ID)
def view_message(front: Front, conn: Connection, cmd: p.Command) -> p.Command:
    # a delayed message's offset id (its send's receipt) names its scheduled record: shown with its REAL_TOPIC and due
    # time (TIMER_OUT_MS), as RocketMQ shows it in SCHEDULE_TOPIC_XXXX
    rec = front.messaging.read_message(req_int(cmd.ext, "offset", 0), scheduled=True)
    return ok(cmd, body=encode_record(rec, conn.store_addr, front.port))


from . import admin  # noqa: E402,F401  the operator's request codes (mqadmin's) register themselves in HANDLERS (admin.py imports dispatch.py, not this module)

__all__ = ["HANDLERS", "error_response", "served_codes", "INNER_PRODUCER"]
