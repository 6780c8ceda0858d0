"""RocketMQ 4 clients as the remoting front end knows them: heartbeats, consumer groups, queue locks, check-backs.

- A HEART_BEAT names the client (``clientID``), its producer groups and
  its consumer groups with their subscriptions. The connection is
  registered with the messaging service as a producer of each producer
  group (check-backs go to it, and "a producer is online" counts it, as
  for the other front ends) and as a consumer of each consumer group
  (`txmq groups` counts it). When a group's set of client ids changes, its other
  consumers get NOTIFY_CONSUMER_IDS_CHANGED (oneway) and rebalance.
- Queue locks (LOCK_BATCH_MQ) for orderly consumers: a queue is held by
  one client id of a group for LOCK_TTL_S after its last lock request, as
  RocketMQ's broker does (REBALANCE_LOCK_MAX_LIVE_TIME); a client whose
  last connection closes releases its locks at once.
- A check-back (a ``CheckBack`` record of the check service's) becomes a
  CHECK_TRANSACTION_STATE request, oneway, with the fields RocketMQ's
  broker writes (AbstractTransactionalMessageCheckListener.sendCheckMessage):
  the copy's ``commitLogOffset`` and ``tranStateTableOffset``, ``msgId`` =
  ``transactionId`` = the transaction's UNIQ_KEY, ``offsetMsgId``; the body
  is the message in the stored-message encoding with its real topic and
  queue.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..messaging.naming import MAX_GROUP, is_group_name, retry_topic
from txmq.wire import ErrorCode, TxmqError

from . import protocol as p
from .messages import TX_PREPARED, encode_stored, offset_msg_id

if TYPE_CHECKING:
    from ..messaging import CheckBack, Messaging

    from .context import Connection, Endpoint

log = logging.getLogger("txmq.remoting")

LOCK_TTL_S = 60.0
MAX_SUBSCRIPTIONS = 1024  # topics one consumer group of one client subscribes to
MAX_CLIENT_IDS_PER_CONN = 64
MAX_TOPIC = 255  # characters of a subscribed topic's name (a longer one is no topic)
MAX_EXPRESSION = 4096  # characters of a subscription's tag expression
INNER_PRODUCER = "CLIENT_INNER_PRODUCER"  # every Java client's own producer group (its sends of retries)


def check_group(group: Any, what: str = "group") -> str:
    if not isinstance(group, str) or not group:
        raise TxmqError(f"{what} is missing", ErrorCode.INVALID_FIELD)
    if not is_group_name(group, bar=True):
        raise TxmqError(f"{what} {group[:80]!r} is not a group name: 1 to {MAX_GROUP} characters of %a-zA-Z0-9_- "
                        "(its retry topic %RETRY%<group> is a topic name)", ErrorCode.INVALID_FIELD)
    return group


@dataclass
class Consumer:
    """One client id's consumer of one group, over one connection."""

    client_id: str
    conn: Connection
    subscriptions: dict[str, str] = field(default_factory=dict)  # topic -> expression ("*", "a || b")
    expression_types: dict[str, str] = field(default_factory=dict)  # topic -> its expression's type, where not TAG ("SQL92")
    clustering: bool = True
    consume_type: str = "CONSUME_PASSIVELY"  # CONSUME_ACTIVELY: a pull consumer (GET_CONSUMER_CONNECTION_LIST shows both)
    consume_from: str = "CONSUME_FROM_LAST_OFFSET"


class ClientTable:
    def __init__(self, front: Endpoint) -> None:
        self.front = front
        # group -> (client id, connection) -> Consumer
        self.consumers: dict[str, dict[tuple[str, int], Consumer]] = {}
        self.locks: dict[tuple[str, str, int], tuple[str, float]] = {}  # (group, topic, queue) -> (client id, expiry)

    @property
    def messaging(self) -> Messaging:
        return self.front.messaging

    # ---- heartbeats --------------------------------------------------------------------------
    def heartbeat(self, conn: Connection, body: bytes) -> None:
        data = p.load_json_object(body, "HEART_BEAT")  # p.BodyError: too large, nested too deeply, not a JSON object
        client_id = data.get("clientID")
        if not isinstance(client_id, str) or not client_id or len(client_id) > 255:
            raise TxmqError("the heartbeat has no clientID (1 to 255 characters)", ErrorCode.INVALID_FIELD)
        if client_id not in conn.client_ids:
            if len(conn.client_ids) >= MAX_CLIENT_IDS_PER_CONN:
                raise TxmqError(f"a connection carries at most {MAX_CLIENT_IDS_PER_CONN} client ids", ErrorCode.INVALID_FIELD)
            conn.client_ids.add(client_id)
        for pd in _list(data.get("producerDataSet")):
            group = pd.get("groupName") if isinstance(pd, dict) else None
            if isinstance(group, str) and group and len(group) <= 255:
                self.messaging.register_producer(group, conn)
        changed = []
        for cd in _list(data.get("consumerDataSet")):
            if not isinstance(cd, dict):
                continue
            group = check_group(cd.get("groupName"), "consumer group")
            subs: dict[str, str] = {}
            types: dict[str, str] = {}
            for sd in _list(cd.get("subscriptionDataSet")):
                if isinstance(sd, dict) and isinstance(sd.get("topic"), str):
                    expr = sd.get("subString")
                    expr = expr if isinstance(expr, str) else "*"
                    if len(sd["topic"]) > MAX_TOPIC or len(expr) > MAX_EXPRESSION:
                        raise TxmqError(f"a subscription names a topic of at most {MAX_TOPIC} characters with an expression of at most "
                                        f"{MAX_EXPRESSION}", ErrorCode.INVALID_FIELD)
                    subs[sd["topic"]] = expr
                    etype = sd.get("expressionType")
                    if isinstance(etype, str) and etype not in ("TAG", ""):
                        types[sd["topic"]] = etype[:20]
                    if len(subs) > MAX_SUBSCRIPTIONS:
                        raise TxmqError(f"a consumer subscribes to at most {MAX_SUBSCRIPTIONS} topics", ErrorCode.INVALID_FIELD)
            clustering = cd.get("messageModel", "CLUSTERING") != "BROADCASTING"
            if clustering:
                # the retry topic, which RocketMQ's broker creates at the first heartbeat whatever auto-creation says
                self.messaging.ensure_topic(retry_topic(group), 1)
            members = self.consumers.setdefault(group, {})
            key = (client_id, conn.conn_id)
            before = {c.client_id for c in members.values()}
            c = members.get(key)
            if c is None:
                self.messaging.register_consumer(group, conn)  # raises past the groups one connection may hold
                c = members[key] = Consumer(client_id, conn)
            c.subscriptions, c.expression_types, c.clustering = subs, types, clustering
            c.consume_type = _one_of(cd.get("consumeType"), CONSUME_TYPES, c.consume_type)
            c.consume_from = _one_of(cd.get("consumeFromWhere"), CONSUME_FROM, c.consume_from)
            if client_id not in before:
                changed.append(group)
        for group in changed:
            self.notify(group)

    def unregister(self, conn: Connection, client_id: str, producer_group: str, consumer_group: str) -> None:
        if producer_group:
            self.messaging.unregister_producer(producer_group, conn)
        if consumer_group:
            members = self.consumers.get(consumer_group)
            if members is not None and members.pop((client_id, conn.conn_id), None) is not None:
                if not any(c.conn is conn for c in members.values()):
                    self.messaging.unregister_consumer(consumer_group, conn)
                if not members:
                    del self.consumers[consumer_group]
                self._release_client(consumer_group, client_id)
                self.notify(consumer_group)

    def connection_closed(self, conn: Connection) -> None:
        for group in list(self.consumers):
            members = self.consumers[group]
            gone = [k for k, c in members.items() if c.conn is conn]
            for k in gone:
                del members[k]
            if not gone:
                continue
            left = {c.client_id for c in members.values()}
            for cid in {k[0] for k in gone} - left:
                self._release_client(group, cid)
            if not members:
                del self.consumers[group]
            else:
                self.notify(group)

    def consumer_ids(self, group: str) -> list[str]:
        return sorted({c.client_id for c in self.consumers.get(group, {}).values()})

    def is_member(self, group: str, client_id: str) -> bool:
        return any(c.client_id == client_id for c in self.consumers.get(group, {}).values())

    def subscription(self, group: str, topic: str) -> str | None:
        for c in self.consumers.get(group, {}).values():
            expr = c.subscriptions.get(topic)
            if expr is not None:
                return expr
        return None

    def subscription_typed(self, group: str, topic: str) -> tuple[str, str] | None:
        """The group's expression for the topic and its type ("TAG", "SQL92"), as its consumers' heartbeats gave them."""
        for c in self.consumers.get(group, {}).values():
            expr = c.subscriptions.get(topic)
            if expr is not None:
                return expr, c.expression_types.get(topic, "TAG")
        return None

    def notify(self, group: str) -> None:
        """NOTIFY_CONSUMER_IDS_CHANGED to one connection of each consumer of the group: they rebalance."""
        seen = set()
        for c in list(self.consumers.get(group, {}).values()):
            if c.conn in seen or not c.conn.writable():
                continue
            seen.add(c.conn)
            c.conn.request(p.request(p.NOTIFY_CONSUMER_IDS_CHANGED, self.front.next_opaque(), {"consumerGroup": group}, oneway=True))
            self.messaging.metrics.inc("remoting_consumer_notifications")

    # ---- queue locks -------------------------------------------------------------------------
    def lock(self, group: str, client_id: str, queues: list[tuple[str, int]]) -> list[tuple[str, int]]:
        now = time.monotonic()
        ok = []
        for topic, qid in queues:
            key = (group, topic, qid)
            held = self.locks.get(key)
            if held is None or held[0] == client_id or held[1] <= now:
                self.locks[key] = (client_id, now + LOCK_TTL_S)
                ok.append((topic, qid))
        return ok

    def unlock(self, group: str, client_id: str, queues: list[tuple[str, int]]) -> None:
        for topic, qid in queues:
            key = (group, topic, qid)
            held = self.locks.get(key)
            if held is not None and held[0] == client_id:
                del self.locks[key]

    def _release_client(self, group: str, client_id: str) -> None:
        for key in [k for k, v in self.locks.items() if k[0] == group and v[0] == client_id]:
            del self.locks[key]

    def expire_locks(self) -> None:
        now = time.monotonic()
        for key in [k for k, v in self.locks.items() if v[1] <= now]:
            del self.locks[key]

    # ---- check-backs ---------------------------------------------------------------------------
    def check_back(self, conn: Connection, cb: CheckBack) -> None:
        """A CHECK_TRANSACTION_STATE request (oneway) for the check-back, with the half message as RocketMQ's broker sends it."""
        topic, qid, cl, half = cb.topic, cb.queue_id, cb.commit_log_offset, cb.half_offset
        body = encode_stored(topic, qid, half, cl, TX_PREPARED, cb.born_ts, cb.store_ts, cb.prepared_offset, cb.properties,
                             cb.body, conn.store_addr, self.front.port)
        ext = {"topic": topic, "commitLogOffset": str(cl), "tranStateTableOffset": str(half), "msgId": cb.tx_id, "transactionId": cb.tx_id,
               "offsetMsgId": offset_msg_id(conn.store_addr, self.front.port, cl), "bname": self.front.broker_name}
        conn.request(p.request(p.CHECK_TRANSACTION_STATE, self.front.next_opaque(), ext, body, oneway=True))
        self.messaging.metrics.inc("remoting_checks_sent")


def _list(v: Any) -> list:
    return v if isinstance(v, list) else []


CONSUME_TYPES = ("CONSUME_ACTIVELY", "CONSUME_PASSIVELY")
CONSUME_FROM = ("CONSUME_FROM_LAST_OFFSET", "CONSUME_FROM_FIRST_OFFSET", "CONSUME_FROM_TIMESTAMP",
                "CONSUME_FROM_LAST_OFFSET_AND_FROM_MIN_WHEN_BOOT_FIRST", "CONSUME_FROM_MIN_OFFSET", "CONSUME_FROM_MAX_OFFSET")


def _one_of(v: Any, names: tuple[str, ...], default: str) -> str:
    """A heartbeat's enum value (ConsumeType, ConsumeFromWhere) when it is one of RocketMQ's names, else ``default``."""
    return v if isinstance(v, str) and v in names else default
