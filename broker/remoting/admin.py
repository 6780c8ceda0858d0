"""The operator's request codes on the remoting port: what Apache's ``mqadmin`` (and RocketMQ's dashboard) ask.

Cluster and broker (``clusterList``, ``brokerStatus``, ``getBrokerConfig``,
``updateBrokerConfig``), topics (``topicStatus``, ``deleteTopic``),
consumer groups (``consumerProgress``, ``consumerConnection``,
``resetOffsetByTime``) and messages (``queryMsgByKey``, and what
``queryMsgById`` asks after viewing the message). Each handler reads or
changes the broker through the messaging service (topics, consumer
offsets, queues and stored messages: ``front.messaging``) and the
operator's calls (the check service's settings, the data directory:
``front.operations``), and answers in the layout RocketMQ 4.9.8's broker
and name server write (docs/remoting.md, "Apache's mqadmin").

The bodies are fastjson's: a map keyed by a message queue is written with
the queue object as the key (``{{"brokerName":"txmq","queueId":0,"topic":"T"}:{...}}``),
which is not JSON but what RocketMQ's clients parse (``fj``).

Registered in ``HANDLERS`` (dispatch.py) by importing this module
(handlers.py does, last).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import shutil
import time
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any, NamedTuple

from txmq import __version__
from txmq.constants import PROP_KEYS
from txmq.wire import ErrorCode, TxmqError

from . import protocol as p
from .dispatch import Front, handles, ok, opt_bool, opt_int, req_int, req_str, topic_of
from .messages import encode_maps

if TYPE_CHECKING:
    from ..messaging import Messaging

    from .context import Connection

log = logging.getLogger("txmq.remoting")

# ---- request and response codes (RocketMQ 4.9.8's RequestCode, ResponseCode) ----------------
UPDATE_BROKER_CONFIG = 25
GET_BROKER_CONFIG = 26
GET_BROKER_RUNTIME_INFO = 28
GET_TOPIC_STATS_INFO = 202
GET_CONSUMER_CONNECTION_LIST = 203
GET_CONSUME_STATS = 208
DELETE_TOPIC_IN_BROKER = 215
DELETE_TOPIC_IN_NAMESRV = 216
RESET_CONSUMER_CLIENT_OFFSET = 220  # the broker's request to each consumer of a group being reset
INVOKE_BROKER_TO_RESET_OFFSET = 222
QUERY_TOPIC_CONSUME_BY_WHO = 300
CONSUMER_NOT_ONLINE = 206  # a response code

# RocketMQ's names of the request codes, for the remark of one txmq does not serve.
REQUEST_NAMES = {
    10: "SEND_MESSAGE", 11: "PULL_MESSAGE", 12: "QUERY_MESSAGE", 13: "QUERY_BROKER_OFFSET", 14: "QUERY_CONSUMER_OFFSET",
    15: "UPDATE_CONSUMER_OFFSET", 17: "UPDATE_AND_CREATE_TOPIC", 21: "GET_ALL_TOPIC_CONFIG", 22: "GET_TOPIC_CONFIG_LIST",
    23: "GET_TOPIC_NAME_LIST", 25: "UPDATE_BROKER_CONFIG", 26: "GET_BROKER_CONFIG", 27: "TRIGGER_DELETE_FILES",
    28: "GET_BROKER_RUNTIME_INFO", 29: "SEARCH_OFFSET_BY_TIMESTAMP", 30: "GET_MAX_OFFSET", 31: "GET_MIN_OFFSET",
    32: "GET_EARLIEST_MSG_STORETIME", 33: "VIEW_MESSAGE_BY_ID", 34: "HEART_BEAT", 35: "UNREGISTER_CLIENT",
    36: "CONSUMER_SEND_MSG_BACK", 37: "END_TRANSACTION", 38: "GET_CONSUMER_LIST_BY_GROUP", 39: "CHECK_TRANSACTION_STATE",
    40: "NOTIFY_CONSUMER_IDS_CHANGED", 41: "LOCK_BATCH_MQ", 42: "UNLOCK_BATCH_MQ", 43: "GET_ALL_CONSUMER_OFFSET",
    45: "GET_ALL_DELAY_OFFSET", 46: "CHECK_CLIENT_CONFIG", 50: "UPDATE_AND_CREATE_ACL_CONFIG", 51: "DELETE_ACL_CONFIG",
    52: "GET_BROKER_CLUSTER_ACL_INFO", 53: "UPDATE_GLOBAL_WHITE_ADDRS_CONFIG", 100: "PUT_KV_CONFIG", 101: "GET_KV_CONFIG",
    102: "DELETE_KV_CONFIG", 103: "REGISTER_BROKER", 104: "UNREGISTER_BROKER", 105: "GET_ROUTEINFO_BY_TOPIC",
    106: "GET_BROKER_CLUSTER_INFO", 200: "UPDATE_AND_CREATE_SUBSCRIPTIONGROUP", 201: "GET_ALL_SUBSCRIPTIONGROUP_CONFIG",
    202: "GET_TOPIC_STATS_INFO", 203: "GET_CONSUMER_CONNECTION_LIST", 204: "GET_PRODUCER_CONNECTION_LIST",
    205: "WIPE_WRITE_PERM_OF_BROKER", 206: "GET_ALL_TOPIC_LIST_FROM_NAMESERVER", 207: "DELETE_SUBSCRIPTIONGROUP",
    208: "GET_CONSUME_STATS", 209: "SUSPEND_CONSUMER", 210: "RESUME_CONSUMER", 211: "RESET_CONSUMER_OFFSET_IN_CONSUMER",
    212: "RESET_CONSUMER_OFFSET_IN_BROKER", 213: "ADJUST_CONSUMER_THREAD_POOL", 214: "WHO_CONSUME_THE_MESSAGE",
    215: "DELETE_TOPIC_IN_BROKER", 216: "DELETE_TOPIC_IN_NAMESRV", 219: "GET_KVLIST_BY_NAMESPACE",
    220: "RESET_CONSUMER_CLIENT_OFFSET", 221: "GET_CONSUMER_STATUS_FROM_CLIENT", 222: "INVOKE_BROKER_TO_RESET_OFFSET",
    223: "INVOKE_BROKER_TO_GET_CONSUMER_STATUS", 224: "GET_TOPICS_BY_CLUSTER", 300: "QUERY_TOPIC_CONSUME_BY_WHO",
    301: "REGISTER_FILTER_SERVER", 302: "REGISTER_MESSAGE_FILTER_CLASS", 303: "QUERY_CONSUME_TIME_SPAN",
    304: "GET_SYSTEM_TOPIC_LIST_FROM_NS", 305: "GET_SYSTEM_TOPIC_LIST_FROM_BROKER", 306: "CLEAN_EXPIRED_CONSUMEQUEUE",
    307: "GET_CONSUMER_RUNNING_INFO", 308: "QUERY_CORRECTION_OFFSET", 309: "CONSUME_MESSAGE_DIRECTLY",
    310: "SEND_MESSAGE_V2", 311: "GET_UNIT_TOPIC_LIST", 312: "GET_HAS_UNIT_SUB_TOPIC_LIST",
    313: "GET_HAS_UNIT_SUB_UNUNIT_TOPIC_LIST", 314: "CLONE_GROUP_OFFSET", 315: "VIEW_BROKER_STATS_DATA",
    316: "CLEAN_UNUSED_TOPIC", 317: "GET_BROKER_CONSUME_STATS", 318: "UPDATE_NAMESRV_CONFIG", 319: "GET_NAMESRV_CONFIG",
    320: "SEND_BATCH_MESSAGE", 321: "QUERY_CONSUME_QUEUE", 322: "QUERY_DATA_VERSION", 323: "RESUME_CHECK_HALF_MESSAGE",
    324: "SEND_REPLY_MESSAGE", 326: "PUSH_REPLY_MESSAGE_TO_CLIENT", 327: "ADD_WRITE_PERM_OF_BROKER",
    328: "GET_ALL_PRODUCER_INFO", 329: "DELETE_EXPIRED_COMMITLOG",
}


def not_supported_remark(code: int) -> str:
    """The remark of REQUEST_CODE_NOT_SUPPORTED: the code, by number and by RocketMQ's name."""
    name = REQUEST_NAMES.get(code)
    named = f"{code} ({name})" if name else str(code)
    return f"request code {named} is not supported by txmq's remoting front end (docs/remoting.md)"


BROKER_VERSION = 409  # MQVersion.Version.V4_9_8's ordinal: the protocol level txmq answers at
MAX_QUERY_MESSAGES = 64  # RocketMQ's maxMsgsNumBatch: messages one QUERY_MESSAGE answers at most
QUERY_SCAN = 100_000  # records one QUERY_MESSAGE reads at most (txmq has no key index: groups.find_messages)
MAX_CONFIG_BODY = 64 << 10
MAX_CONFIG_ENTRIES = 64
SAMPLE_EVERY_S = 1.0
SAMPLES = 601  # ten minutes of samples: RocketMQ's TPS over 10 s, 1 min, 10 min


# ---- fastjson's layout ------------------------------------------------------------------------
class MQ(NamedTuple):
    """A message queue as a map key (MessageQueue): fastjson writes it as an object."""

    topic: str
    broker_name: str
    queue_id: int


def fj(obj: Any) -> str:
    """``obj`` as fastjson writes it: standard JSON, except that map keys may be numbers or message queues."""
    if isinstance(obj, dict):
        return "{" + ",".join(f"{_fj_key(k)}:{fj(v)}" for k, v in obj.items()) + "}"
    if isinstance(obj, (list, tuple, set, frozenset)) and not isinstance(obj, MQ):
        return "[" + ",".join(fj(v) for v in obj) + "]"
    if isinstance(obj, MQ):
        return fj({"brokerName": obj.broker_name, "queueId": obj.queue_id, "topic": obj.topic})
    if isinstance(obj, float) and not math.isfinite(obj):
        return "0.0"
    return json.dumps(obj, ensure_ascii=False)


def _fj_key(k: Any) -> str:
    if isinstance(k, MQ):
        return fj(k)
    if isinstance(k, bool) or not isinstance(k, int):
        return json.dumps(str(k), ensure_ascii=False)
    return str(k)


def fj_body(obj: Any) -> bytes:
    return fj(obj).encode()


def java_hash(s: str) -> int:
    """String.hashCode: a tag's code in SubscriptionData.codeSet."""
    data = s.encode("utf-16-be")
    h = 0
    for i in range(0, len(data), 2):
        h = (31 * h + (data[i] << 8 | data[i + 1])) & 0xFFFFFFFF
    return h - (1 << 32) if h >= 1 << 31 else h


# ---- what the admin requests share --------------------------------------------------------------
def broker_address(front: Front, conn: Connection) -> str:
    """This broker's address as its routes name it: the address the client connected to, the remoting port."""
    host = conn.local_host
    return f"[{host}]:{front.port}" if ":" in host else f"{host}:{front.port}"


def _mq(front: Front, topic: str, qid: int) -> MQ:
    return MQ(topic, front.broker_name, qid)


def _store_ts(messaging: Messaging, topic: str, qid: int, index: int) -> int:
    """The store time of the message at queue offset ``index`` (0 when there is none or it cannot be read)."""
    ts = messaging.store_time_at(topic, qid, index)
    return 0 if ts is None else ts


class Counts:
    """The broker's put and get counters sampled every second while someone asks for them: RocketMQ's TPS figures and
    its message totals since this morning and yesterday morning (BrokerStats), for GET_BROKER_RUNTIME_INFO.

    Sampling starts at the first runtime-info request (a broker no operator's tool asks pays nothing) and stops with
    the front end; it is a timer on the loop, one wake-up a second, ten minutes of samples.
    """

    def __init__(self, front: Front) -> None:
        self._front = weakref.ref(front)  # _COUNTS holds this by the front end, weakly: no strong way back to it
        self.samples: deque[tuple[float, int, int]] = deque(maxlen=SAMPLES)
        self.day = time.localtime().tm_yday
        started_today = time.localtime(front.messaging.started_at).tm_yday == self.day
        put, got = self.totals()
        # Totals at the start of today and of yesterday: 0 for a broker started today, else the first sample's.
        self.today_morning = (0, 0) if started_today else (put, got)
        self.yesterday_morning = self.today_morning
        self._timer: Any = None
        self.sample()

    def totals(self) -> tuple[int, int]:
        front = self._front()
        if front is None:
            return 0, 0
        c = front.messaging.metrics.counters
        return c["messages_sent"] + c["half_stored"], c["messages_pulled"]

    def sample(self) -> None:
        self._timer = None
        front = self._front()
        if front is None or front.stopping:
            return
        put, got = self.totals()
        now = time.monotonic()
        self.samples.append((now, put, got))
        day = time.localtime().tm_yday
        if day != self.day:
            self.day, self.yesterday_morning, self.today_morning = day, self.today_morning, (put, got)
        try:
            self._timer = asyncio.get_running_loop().call_later(SAMPLE_EVERY_S, self.sample)
        except RuntimeError:  # no loop (a test calling a handler directly): one sample per request
            pass

    def tps(self, which: int) -> str:
        """RocketMQ's "<10 s> <1 min> <10 min>" rates of puts (1) or gets (2)."""
        if not self.samples:
            return "0.0 0.0 0.0"
        last = self.samples[-1]
        out = []
        for span in (10, 60, 600):
            first = next((s for s in self.samples if last[0] - s[0] <= span + SAMPLE_EVERY_S / 2), last)
            dt = last[0] - first[0]
            out.append(f"{(last[which] - first[which]) / dt:.1f}" if dt > 0 else "0.0")
        return " ".join(out)


_COUNTS: weakref.WeakKeyDictionary[Front, Counts] = weakref.WeakKeyDictionary()


def _counts(front: Front) -> Counts:
    counts = _COUNTS.get(front)
    if counts is None:
        counts = _COUNTS[front] = Counts(front)
    return counts


def _bytes_human(n: float) -> str:
    """MixAll.humanReadableByteCount(n, false): binary units."""
    if n < 1024:
        return f"{int(n)} B"
    exp = min(int(math.log(n, 1024)), 6)
    return f"{n / 1024 ** exp:.1f} {'KMGTPE'[exp - 1]}iB"


# ---- the name server -------------------------------------------------------------------------
@handles(p.GET_BROKER_CLUSTER_INFO)
def cluster_info(front: Front, conn: Connection, cmd: p.Command) -> p.Command:
    """ClusterInfo: one cluster of one broker, master (id 0) at this port."""
    name, cluster = front.broker_name, front.cluster_name
    return ok(cmd, body=fj_body({"brokerAddrTable": {name: {"brokerAddrs": {0: broker_address(front, conn)}, "brokerName": name,
                                                            "cluster": cluster}},
                                 "clusterAddrTable": {cluster: [name]}}))


@handles(DELETE_TOPIC_IN_BROKER, DELETE_TOPIC_IN_NAMESRV)
def delete_topic(front: Front, conn: Connection, cmd: p.Command) -> p.Command:
    """`txmq topics delete` (refused while transactions sent to the topic are pending). The name server's half of
    mqadmin's deleteTopic finds it gone: a topic that does not exist is deleted already, as RocketMQ answers."""
    messaging = front.messaging
    topic = topic_of(cmd.ext)
    if messaging.topic_queues(topic) is None:
        return ok(cmd, remark=f"topic {topic} does not exist")
    r = messaging.delete_topic(topic, force=False)
    return ok(cmd, remark=f"topic {topic} deleted ({r['queues']} queues, {r['messages']} messages kept until retention)")


# ---- the broker's state ------------------------------------------------------------------------
@handles(GET_BROKER_RUNTIME_INFO)
def runtime_info(front: Front, conn: Connection, cmd: p.Command) -> p.Command:
    """KVTable of RocketMQ's runtime figures, from txmq's counters and store (brokerStatus, clusterList)."""
    messaging, operations = front.messaging, front.operations
    log_min, log_max = messaging.log_bounds()
    counts = _counts(front)
    put, got = counts.totals()
    earliest = messaging.first_store_time()
    if earliest is None:  # an empty log (RocketMQ's getEarliestMessageTime: -1)
        earliest = -1
    try:
        disk = shutil.disk_usage(operations.data_dir)
        ratio = f"{(disk.total - disk.free) / disk.total:.4f}" if disk.total else "0.0"
        capacity = f"Total : {_bytes_human(disk.total)}, Free : {_bytes_human(disk.free)}."
    except OSError:
        ratio, capacity = "0.0", "Total : 0 B, Free : 0 B."
    started_at = messaging.started_at
    up = max(0, int(time.time() - started_at))
    inflight = len(front.inflight)
    table = {
        "brokerVersionDesc": f"txmq-{__version__}",
        "brokerVersion": str(BROKER_VERSION),
        "bootTimestamp": str(int(started_at * 1000)),
        "runtime": f"[ {up // 86400} days, {up // 3600 % 24} hours, {up // 60 % 60} minutes, {up % 60} seconds ]",
        "msgPutTotalYesterdayMorning": str(counts.yesterday_morning[0]),
        "msgPutTotalTodayMorning": str(counts.today_morning[0]),
        "msgPutTotalTodayNow": str(put),
        "msgGetTotalYesterdayMorning": str(counts.yesterday_morning[1]),
        "msgGetTotalTodayMorning": str(counts.today_morning[1]),
        "msgGetTotalTodayNow": str(got),
        "putTps": counts.tps(1),
        "getTransferedTps": counts.tps(2),
        "putMessageTimesTotal": str(put),
        "sendThreadPoolQueueSize": str(inflight),
        "sendThreadPoolQueueCapacity": str(messaging.config.max_inflight_per_conn),
        "pullThreadPoolQueueSize": "0",
        "pullThreadPoolQueueCapacity": "0",
        "queryThreadPoolQueueSize": "0",
        "queryThreadPoolQueueCapacity": "0",
        "EndTransactionQueueSize": "0",
        "EndTransactionThreadPoolQueueCapacity": "0",
        "sendThreadPoolQueueHeadWaitTimeMills": "0",
        "pullThreadPoolQueueHeadWaitTimeMills": "0",
        "queryThreadPoolQueueHeadWaitTimeMills": "0",
        "pageCacheLockTimeMills": "0",
        "dispatchBehindBytes": "0",
        "commitLogMinOffset": str(log_min),
        "commitLogMaxOffset": str(log_max),
        "remainHowManyDataToFlush": _bytes_human(operations.unflushed_bytes()),
        "earliestMessageTimeStamp": str(earliest),
        "startAcceptSendRequestTimeStamp": "0",
        "commitLogDiskRatio": ratio,
        "commitLogDirCapacity": capacity,
        # txmq's own figures (RocketMQ's tools print every key they are given)
        "txmqPendingTransactions": str(operations.pending_transactions()),
        "txmqRemotingConnections": str(len(front.connections)),
    }
    return ok(cmd, body=fj_body({"table": table}))


# RocketMQ's broker settings txmq has, and where each comes from; the three transaction ones change live.
LIVE_SETTINGS = {  # RocketMQ's name -> (the check setting, its unit in ms: 1000 for a duration, None for a count)
    "transactionCheckInterval": ("check_interval_s", 1000),
    "transactionTimeOut": ("transaction_timeout_s", 1000),
    "transactionCheckMax": ("max_checks", None),
}


def broker_config(front: Front, conn: Connection) -> dict[str, str]:
    """RocketMQ's names of the broker settings txmq has, with txmq's values."""
    messaging = front.messaging
    cfg = messaging.config
    s = front.operations.check_settings
    levels = " ".join(_level(ms) for ms in cfg.message_delay_levels_ms)
    return {
        "brokerClusterName": front.cluster_name,
        "brokerName": front.broker_name,
        "brokerId": "0",
        "brokerIP1": conn.local_host,
        "listenPort": str(front.port),
        "namesrvAddr": broker_address(front, conn),
        "brokerRole": "ASYNC_MASTER",
        "brokerPermission": "6",
        "storePathRootDir": str(front.operations.data_dir),
        "flushDiskType": "SYNC_FLUSH" if cfg.flush == "sync" else "ASYNC_FLUSH",
        "flushIntervalCommitLog": str(round(cfg.flush_interval_s * 1000)),
        "autoCreateTopicEnable": "true" if messaging.auto_create_topics else "false",
        "defaultTopicQueueNums": str(cfg.default_queues),
        "maxMessageSize": str(cfg.max_body),
        "messageDelayLevel": levels,
        "fileReservedTime": f"{s.retention_s / 3600:g}",
        "aclEnable": "true" if cfg.auth_token else "false",
        "transactionCheckInterval": str(round(s.check_interval_s * 1000)),
        "transactionTimeOut": str(round(s.transaction_timeout_s * 1000)),
        "transactionCheckMax": str(s.max_checks),
    }


def _level(ms: int) -> str:
    for unit, n in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms and ms % n == 0:
            return f"{ms // n}{unit}"
    return f"{ms}ms"


def _properties_text(props: dict[str, str]) -> str:
    """MixAll.properties2String, with the escapes java.util.Properties.load undoes."""
    def esc(s: str) -> str:
        return s.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")

    return "".join(f"{esc(k)}={esc(v)}\n" for k, v in props.items())


def parse_properties(text: str) -> dict[str, str]:
    """What java.util.Properties.load reads from MixAll.properties2String's text: ``key=value`` (or ``key:value``,
    ``key value``) lines, ``#`` and ``!`` comments, backslash escapes."""
    out: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#!":
            continue
        key, value, i = [], "", 0
        while i < len(line):
            ch = line[i]
            if ch == "\\" and i + 1 < len(line):
                key.append(_unescape(line[i + 1]))
                i += 2
                continue
            if ch in "=: \t":
                rest = line[i:].lstrip(" \t")
                if rest[:1] in ("=", ":") and ch in " \t":
                    rest = rest[1:]
                elif ch in "=:":
                    rest = line[i + 1:]
                value = _unescape_all(rest.lstrip(" \t"))
                break
            key.append(ch)
            i += 1
        out["".join(key)] = value
        if len(out) > MAX_CONFIG_ENTRIES:
            raise TxmqError(f"UPDATE_BROKER_CONFIG takes at most {MAX_CONFIG_ENTRIES} settings", ErrorCode.INVALID_CONFIG)
    return out


def _unescape(ch: str) -> str:
    return {"n": "\n", "r": "\r", "t": "\t", "f": "\f"}.get(ch, ch)


def _unescape_all(s: str) -> str:
    out, i = [], 0
    while i < len(s):
        if s[i] == "\\" and i + 1 < len(s):
            out.append(_unescape(s[i + 1]))
            i += 2
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


class _ConfigVersion:
    """GET_BROKER_CONFIG's DataVersion: changed by every UPDATE_BROKER_CONFIG that changed something."""

    def __init__(self) -> None:
        self.counter = 0
        self.timestamp = int(time.time() * 1000)

    def bump(self) -> None:
        self.counter += 1
        self.timestamp = int(time.time() * 1000)


_VERSIONS: weakref.WeakKeyDictionary[Front, _ConfigVersion] = weakref.WeakKeyDictionary()


def _version(front: Front) -> _ConfigVersion:
    v = _VERSIONS.get(front)
    if v is None:
        v = _VERSIONS[front] = _ConfigVersion()
    return v


@handles(GET_BROKER_CONFIG)
def get_broker_config(front: Front, conn: Connection, cmd: p.Command) -> p.Command:
    v = _version(front)
    return ok(cmd, {"version": fj({"counter": v.counter, "timestamp": v.timestamp})},
              body=_properties_text(broker_config(front, conn)).encode())


@handles(UPDATE_BROKER_CONFIG)
def update_broker_config(front: Front, conn: Connection, cmd: p.Command) -> p.Command:
    """transactionCheckInterval, transactionTimeOut (ms) and transactionCheckMax: `txmq config set`'s check-interval,
    transaction-timeout and max-checks, live and persisted in config.json. Every setting of the request is checked
    before any is changed; another setting is refused, naming the ones that change."""
    operations = front.operations
    if len(cmd.body) > MAX_CONFIG_BODY:
        raise TxmqError(f"the body of UPDATE_BROKER_CONFIG is over {MAX_CONFIG_BODY} bytes", ErrorCode.INVALID_CONFIG)
    try:
        props = parse_properties(cmd.body.decode())
    except UnicodeDecodeError:
        raise TxmqError("the body of UPDATE_BROKER_CONFIG is not UTF-8 text", ErrorCode.INVALID_CONFIG) from None
    unknown = [k for k in props if k not in LIVE_SETTINGS]
    if unknown:
        shown = ", ".join(k[:60] for k in unknown[:5])
        raise TxmqError(f"txmq cannot change {shown} at run time: UPDATE_BROKER_CONFIG changes "
                        f"{', '.join(LIVE_SETTINGS)} (the others are `txmq broker start` options)", ErrorCode.INVALID_CONFIG)
    changes = []
    settings = operations.check_settings
    for name, text in props.items():
        key, unit = LIVE_SETTINGS[name]
        try:
            n = int(text.strip())
        except ValueError:
            raise TxmqError(f"{name} must be a whole number{' of milliseconds' if unit else ''}, not {text[:40]!r}",
                            ErrorCode.INVALID_CONFIG) from None
        value: float | int = n / unit if unit else n
        try:
            settings = settings.with_value(key, value)  # every value checked before anything changes
        except (KeyError, ValueError) as exc:
            raise TxmqError(f"{name}: {exc}", ErrorCode.INVALID_CONFIG) from None
        changes.append((name, key, value))
    done = []
    for name, key, value in changes:
        old, new = operations.set_setting(key, value)
        done.append(f"{name} ({key}) {old} -> {new}")
    if done:
        _version(front).bump()
        log.info("event=remoting_broker_config_updated peer=%s changes=%r", conn.peer, "; ".join(done))
    return ok(cmd, remark="; ".join(done))


# ---- topics -------------------------------------------------------------------------------------
@handles(GET_TOPIC_STATS_INFO)
def topic_stats(front: Front, conn: Connection, cmd: p.Command) -> p.Command:
    """TopicStatsTable: each queue's min and max offsets and the store time of its last message (topicStatus)."""
    messaging = front.messaging
    topic = topic_of(cmd.ext, system_ok=True)
    n = messaging.topic_queues(topic)
    if n is None:
        return p.response(cmd, p.TOPIC_NOT_EXIST, remark=f"topic[{topic}] not exist")
    table = {}
    for q in range(n):
        lo, hi = messaging.queue_bounds(topic, q)
        table[_mq(front, topic, q)] = {"lastUpdateTimestamp": _store_ts(messaging, topic, q, hi - 1) if hi > 0 else 0,
                                       "maxOffset": hi, "minOffset": lo}
    return ok(cmd, body=fj_body({"offsetTable": table}))


@handles(QUERY_TOPIC_CONSUME_BY_WHO)
def topic_consumers(front: Front, conn: Connection, cmd: p.Command) -> p.Command:
    """GroupList: the groups with a live consumer subscribed to the topic and those with an offset in it."""
    topic = topic_of(cmd.ext, system_ok=True)
    groups = {g for g, members in front.clients.consumers.items() if any(topic in c.subscriptions for c in members.values())}
    groups |= {g for g, topics in front.messaging.consumer_offsets().items() if topic in topics}
    return ok(cmd, body=fj_body({"groupList": sorted(groups)}))


# ---- consumer groups --------------------------------------------------------------------------
def _subscribed(front: Front, group: str) -> set[str] | None:
    """The topics the group's live consumers subscribe to; None when it has none online."""
    members = front.clients.consumers.get(group)
    if not members:
        return None
    return {t for c in members.values() for t in c.subscriptions}


@handles(GET_CONSUME_STATS)
def consume_stats(front: Front, conn: Connection, cmd: p.Command) -> p.Command:
    """ConsumeStats: per queue of each topic the group has offsets in (or the one asked), the queue's end, the group's
    offset and the store time of the last message it consumed (consumerProgress); a topic its live consumers no
    longer subscribe to is left out, as RocketMQ's broker does."""
    messaging = front.messaging
    group = req_str(cmd.ext, "consumerGroup")
    asked = topic_of(cmd.ext, system_ok=True) if cmd.ext.get("topic") else None
    by_topic = messaging.consumer_offsets().get(group, {})
    topics = [asked] if asked else sorted(by_topic)
    subscribed = _subscribed(front, group)
    table = {}
    for topic in topics:
        n = messaging.topic_queues(topic)
        if n is None or (subscribed is not None and topic not in subscribed):
            continue
        committed = by_topic.get(topic, {})
        for q in range(n):
            broker_offset = messaging.queue_bounds(topic, q)[1]
            consumer_offset = max(committed.get(q, 0), 0)
            last = _store_ts(messaging, topic, q, consumer_offset - 1) if consumer_offset > 0 else 0
            table[_mq(front, topic, q)] = {"brokerOffset": broker_offset, "consumerOffset": consumer_offset, "lastTimestamp": last}
    return ok(cmd, body=fj_body({"consumeTps": 0.0, "offsetTable": table}))


@handles(GET_CONSUMER_CONNECTION_LIST)
def consumer_connections(front: Front, conn: Connection, cmd: p.Command) -> p.Command:
    """ConsumerConnection: the group's live clients (id, address, language, version) and their subscriptions."""
    group = req_str(cmd.ext, "consumerGroup")
    members = list(front.clients.consumers.get(group, {}).values())
    if not members:
        return p.response(cmd, CONSUMER_NOT_ONLINE, remark=f"the consumer group[{group}] not online")
    connections = [{"clientAddr": c.conn.peer, "clientId": c.client_id, "language": c.conn.client_language,
                    "version": c.conn.client_version} for c in members]
    subscriptions: dict[str, dict[str, Any]] = {}
    for c in members:
        for topic, expr in c.subscriptions.items():
            subscriptions.setdefault(topic, _subscription_data(topic, expr, c.expression_types.get(topic, "TAG")))
    first = members[-1]
    body = {"connectionSet": connections,
            "consumeFromWhere": first.consume_from,
            "consumeType": first.consume_type,
            "messageModel": "CLUSTERING" if first.clustering else "BROADCASTING",
            "subscriptionTable": subscriptions}
    return ok(cmd, body=fj_body(body))


def _subscription_data(topic: str, expr: str, etype: str = "TAG") -> dict[str, Any]:
    """SubscriptionData of a tag expression, as FilterAPI.buildSubscriptionData builds it; of a SQL92 one, as
    FilterAPI.build does (no tags)."""
    if etype != "TAG":
        return {"classFilterMode": False, "codeSet": [], "expressionType": etype, "subString": expr, "subVersion": 0,
                "tagsSet": [], "topic": topic}
    tags = [] if expr.strip() in ("", "*") else [t.strip() for t in expr.split("||") if t.strip()]
    return {"classFilterMode": False, "codeSet": [java_hash(t) for t in tags], "expressionType": "TAG",
            "subString": expr if tags else "*", "subVersion": 0, "tagsSet": tags, "topic": topic}


@handles(INVOKE_BROKER_TO_RESET_OFFSET)
def reset_offset(front: Front, conn: Connection, cmd: p.Command) -> Any:
    """resetOffsetByTime: each queue's offset at the time (-1: the queue's end), or the group's own when it is lower
    and the reset is not forced; committed to txmq's offsets, and sent to the group's live consumers
    (RESET_CONSUMER_CLIENT_OFFSET), which drop what they hold and start there. With no consumer online the answer is
    CONSUMER_NOT_ONLINE, on which mqadmin resets through the offset requests (resetOffsetByTimeOld), as against
    RocketMQ."""
    messaging = front.messaging
    ext = cmd.ext
    topic = topic_of(ext)
    group = req_str(ext, "group")
    timestamp = req_int(ext, "timestamp")
    force = opt_bool(ext, "isForce")
    n = messaging.topic_queues(topic)
    if n is None:
        return p.response(cmd, p.SYSTEM_ERROR, remark=f"[reset-offset] reset offset failed, no topic in this broker. topic={topic}")
    plan: dict[MQ, int] = {}
    for q in range(n):
        current = messaging.consumer_offset(group, topic, q)
        if current is None:
            return p.response(cmd, p.SYSTEM_ERROR, remark=f"THe consumer group <{group}> not exist")
        at = messaging.queue_bounds(topic, q)[1] if timestamp == -1 else messaging.offset_for_time(topic, q, timestamp)
        plan[_mq(front, topic, q)] = at if force or at < current else current
    members = [c for c in front.clients.consumers.get(group, {}).values() if c.conn.writable()]
    if not members:
        return p.response(cmd, CONSUMER_NOT_ONLINE, remark=f"Consumer not online, so can not reset offset, Group: {group} "
                                                           f"Topic: {topic} Timestamp: {timestamp}")
    for mq, off in plan.items():
        messaging.set_offset(group, topic, mq.queue_id, off)
    if cmd.language == "CPP":
        body = fj_body({"offsetTable": [{"brokerName": mq.broker_name, "offset": off, "queueId": mq.queue_id, "topic": mq.topic}
                                        for mq, off in plan.items()]})
    else:
        body = fj_body({"offsetTable": plan})
    head = {"topic": topic, "group": group, "timestamp": str(timestamp), "isForce": "true" if force else "false"}
    seen = set()
    for c in members:
        if id(c.conn) not in seen:
            seen.add(id(c.conn))
            c.conn.request(p.request(RESET_CONSUMER_CLIENT_OFFSET, front.next_opaque(), dict(head), body, oneway=True))
    log.info("event=remoting_offsets_reset peer=%s group=%s topic=%s timestamp=%d force=%s consumers=%d", conn.peer, group, topic,
             timestamp, force, len(seen))

    async def reply() -> p.Command:
        await front.operations.persist_offsets()
        return ok(cmd, body=fj_body({"offsetTable": plan}))

    return reply()


# ---- messages -----------------------------------------------------------------------------------
@handles(p.QUERY_MESSAGE)
def query_message(front: Front, conn: Connection, cmd: p.Command) -> Any:
    """Messages of the topic whose KEYS hold the key (or whose UNIQ_KEY is it, with _UNIQUE_KEY_QUERY), stored in
    [beginTimestamp, endTimestamp): `txmq message find`, reading at most QUERY_SCAN records (txmq keeps no key
    index); at most 64 messages, in the stored-message encoding."""
    messaging = front.messaging
    ext = cmd.ext
    topic = topic_of(ext)
    key = req_str(ext, "key", 4096)
    limit = min(opt_int(ext, "maxNum", MAX_QUERY_MESSAGES, 1, 1 << 31), MAX_QUERY_MESSAGES)
    begin = opt_int(ext, "beginTimestamp", 0)
    end = opt_int(ext, "endTimestamp", (1 << 63) - 1)
    unique = opt_bool(ext, "_UNIQUE_KEY_QUERY")
    head = {"indexLastUpdateTimestamp": str(int(time.time() * 1000)), "indexLastUpdatePhyoffset": str(messaging.log_bounds()[1])}

    async def reply() -> p.Command:
        if messaging.topic_queues(topic) is None:
            found: list[dict] = []
        else:
            found = await messaging.find_messages(key, topic, max(begin, 0), end, limit, QUERY_SCAN)
            if not unique:  # a key query: the key among the message's KEYS (find also matches a UNIQ_KEY)
                found = [m for m in found if key in (m["properties"].get(PROP_KEYS) or "").split(" ")]
        if not found:
            return p.response(cmd, p.QUERY_NOT_FOUND, head, remark="can not find message, maybe time range not correct")
        return ok(cmd, head, encode_maps(found, conn.store_addr, front.port))

    return reply()


__all__ = ["fj", "MQ", "not_supported_remark", "parse_properties", "broker_config", "LIVE_SETTINGS"]
