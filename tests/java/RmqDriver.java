/*
 * RmqDriver: one scenario through Apache RocketMQ's 4.x Java client against a name server (Apache's RocketMQ, or
 * txmq's --remoting-port), printing its observable outcome as one JSON line: "RESULT {...}".
 *
 * The test suite compiles it against the peer's jars (tests/rocketmq_peer.py) and runs the same scenario against
 * both servers (tests/test_differential_*.py); ids, timestamps and host names are left out of the outcome or
 * compared by shape only.
 *
 *   java -cp "OUT:DIST/lib/*" -Dnamesrv=HOST:PORT -Dtopic=T [-Dk=v ...] RmqDriver SCENARIO
 *
 * SCENARIOS
 *   send      -Dn=3 sync sends with keys k0..k(n-1) and tag -Dtag=TagA; prints each send's result
 *   batch     -Dn=4 messages in one batch send; prints the result and the messages read back
 *   oneway    -Dn=3 oneway sends; reads them back
 *   async     -Dn=3 async sends; prints the callbacks' results; reads them back
 *   tx        TransactionListener: -Dcases=commit,rollback,unknown-commit,unknown-rollback (one message each);
 *             waits for the check-backs (-Dtimeout=60 s), then reads the topic back: which keys are visible
 *   tx-old    the same through TransactionCheckListener + LocalTransactionExecuter (the API before 4.3)
 *   query     -Dn=3 sends with keys, then viewMessage(offset id) and queryMessage(topic, key) for each
 *   errors    sends a broker refuses or changes: a body over its limit, a topic name it does not take, delay levels
 *             99 and -1, a topic that does not exist (-Dmissing); each one's outcome (status or response code)
 *   orderly   -Dorders=3 orders of -Dsteps=4 messages, each order's to one queue (MessageQueueSelector), tags TagA..TagD;
 *             an orderly push consumer subscribed to -Dexpression="TagA || TagC": what each order received, in order
 *   retry     an "ok" and a "fail" message; a push consumer (-DmaxReconsumeTimes=2) fails "fail" every time: its
 *             deliveries (reconsumeTimes of each), then how many messages reached %DLQ%<group>
 *   drain     a consumer of -Dgroup on the topic that starts where the group's committed offsets say (a queue without one:
 *             its end, CONSUME_FROM_LAST_OFFSET): -Dmode=push (an orderly push consumer) or -Dmode=pull
 *             (DefaultMQPullConsumer from fetchConsumeOffset); until -Dexpect messages came and none for -Didle ms
 *             (or -Dtimeout s): every message received, in the order received, and the offsets it started at
 *   models    -Dmodel=CLUSTERING|BROADCASTING: the topic created empty (4 queues), two push consumers of -Dgroup (two
 *             client instances); once each holds its queues, -Dn=8 sends: what each consumer received, from which queues
 *   litepull  -Dn=6 sends, tags TagA/TagB in turn; DefaultLitePullConsumer subscribed to TagA (commitSync, then a second
 *             one of the group finds nothing left), then one assigned every queue: seekToBegin, seek, committed, seekToEnd
 *   restart   -Dn=3 sends, a push consumer of -Dgroup takes them and shuts down; -Dn more sends; the consumer started
 *             again (a new client instance, the same group): what each run received. -Dphase=first runs only the first
 *             half, -Dphase=second only the second (the caller restarts the broker between them)
 *   delays    a message per level -Dlevels=1,2,... (-DdelayTable: the broker's messageDelayLevel); a push consumer: each
 *             level received and whether before its due time; levels over -DwaitBelowMs are not awaited, but viewed
 *   unknown-code  request code -Dcode=9999 to the name server and to the broker through the client's own connection:
 *             each answer's code and remark, then whether a send on the same connection still works
 *   no-topic  a send, a pull consumer's queue lookup and a push consumer's start for a topic that does not exist
 *   sql       12 messages m0..m11 with user properties a=1..10 (m10, m11 without), region eu/us in turn (m11 without),
 *             tag TagS (m0..m5) or TagT; then per case of -Dcases="count|expression;..." a push consumer (a group of its
 *             own) with MessageSelector.bySql(expression): the bodies it received (waiting for count of them), or the
 *             response code its start failed with
 *   hold      a push consumer of -Dgroup on the topic, consuming from the first offset; prints "GOT <body>" for each
 *             message, "READY" once it has -Dexpect of them, then runs until its standard input closes; its RESULT
 *             lists the bodies received
 */

import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Collection;
import java.util.Collections;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.TreeMap;
import java.util.TreeSet;
import java.util.concurrent.Callable;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;

import org.apache.rocketmq.client.QueryResult;
import org.apache.rocketmq.client.consumer.DefaultMQPullConsumer;
import org.apache.rocketmq.client.consumer.DefaultMQPushConsumer;
import org.apache.rocketmq.client.consumer.MessageSelector;
import org.apache.rocketmq.client.consumer.PullResult;
import org.apache.rocketmq.client.consumer.PullStatus;
import org.apache.rocketmq.client.consumer.listener.ConsumeConcurrentlyStatus;
import org.apache.rocketmq.client.consumer.listener.MessageListenerConcurrently;
import org.apache.rocketmq.client.exception.MQClientException;
import org.apache.rocketmq.client.producer.DefaultMQProducer;
import org.apache.rocketmq.client.producer.LocalTransactionExecuter;
import org.apache.rocketmq.client.producer.LocalTransactionState;
import org.apache.rocketmq.client.producer.SendCallback;
import org.apache.rocketmq.client.producer.SendResult;
import org.apache.rocketmq.client.producer.TransactionCheckListener;
import org.apache.rocketmq.client.producer.TransactionListener;
import org.apache.rocketmq.client.producer.TransactionMQProducer;
import org.apache.rocketmq.client.producer.TransactionSendResult;
import org.apache.rocketmq.common.consumer.ConsumeFromWhere;
import org.apache.rocketmq.common.message.Message;
import org.apache.rocketmq.common.message.MessageExt;
import org.apache.rocketmq.common.message.MessageQueue;

@SuppressWarnings("deprecation")
public class RmqDriver {
    static final String NAMESRV = System.getProperty("namesrv", "127.0.0.1:9876");
    static final String TOPIC = System.getProperty("topic", "RmqDriver");
    static final String GROUP = System.getProperty("group", "RmqDriverGroup");
    static final long STAMP = System.currentTimeMillis();

    static long num(String k, long d) { return Long.parseLong(System.getProperty(k, Long.toString(d))); }

    static String str(String k, String d) { return System.getProperty(k, d); }

    public static void main(String[] args) throws Exception {
        String scenario = args.length > 0 ? args[0] : "send";
        Map<String, Object> out;
        switch (scenario) {
            case "send": out = send(); break;
            case "batch": out = batch(); break;
            case "oneway": out = oneway(); break;
            case "async": out = async(); break;
            case "tx": out = tx(false); break;
            case "tx-old": out = tx(true); break;
            case "query": out = query(); break;
            case "hold": out = hold(); break;
            case "drain": out = drain(); break;
            case "errors": out = errors(); break;
            case "orderly": out = orderly(); break;
            case "retry": out = retry(); break;
            case "models": out = models(); break;
            case "litepull": out = litepull(); break;
            case "restart": out = restart(); break;
            case "delays": out = delays(); break;
            case "unknown-code": out = unknownCode(); break;
            case "no-topic": out = noTopic(); break;
            case "sql": out = sql(); break;
            default: throw new IllegalArgumentException("unknown scenario " + scenario);
        }
        System.out.println("RESULT " + json(out));
        System.out.flush();
        System.exit(0);
    }

    // ---- clients ---------------------------------------------------------------------------------
    static DefaultMQProducer producer() throws MQClientException {
        DefaultMQProducer p = new DefaultMQProducer(GROUP + "-producer");
        p.setNamesrvAddr(NAMESRV);
        p.setInstanceName("driver-" + STAMP);
        // the client's 3 s default counts the first send's route lookup and connection too: on two cores shared with
        // other JVMs that was not always enough (a timeout is no outcome either server chose)
        p.setSendMsgTimeout((int) num("sendTimeoutMs", 15_000));
        p.start();
        return p;
    }

    static Message message(String key, String tag, String body) {
        Message m = new Message(TOPIC, tag, key, body.getBytes(StandardCharsets.UTF_8));
        return m;
    }

    static Map<String, Object> sendResult(SendResult r) {
        Map<String, Object> o = new LinkedHashMap<>();
        o.put("status", r.getSendStatus().name());
        o.put("queueId", r.getMessageQueue().getQueueId());
        o.put("queueOffset", r.getQueueOffset());
        o.put("msgId", r.getMsgId());
        o.put("offsetMsgId", r.getOffsetMsgId());
        return o;
    }

    static Map<String, Object> view(MessageExt m) {
        Map<String, Object> o = new LinkedHashMap<>();
        o.put("topic", m.getTopic());
        o.put("tags", m.getTags());
        o.put("keys", m.getKeys());
        o.put("body", new String(m.getBody(), StandardCharsets.UTF_8));
        o.put("queueId", m.getQueueId());
        o.put("queueOffset", m.getQueueOffset());
        o.put("reconsumeTimes", m.getReconsumeTimes());
        o.put("sysFlag", m.getSysFlag());
        o.put("msgId", m.getMsgId());
        Map<String, String> props = new TreeMap<>(m.getProperties());
        o.put("properties", props);
        return o;
    }

    /** The topic's queues as the name server routes them, sorted. A topic a RocketMQ broker creates at a send is
     *  registered with its name server by a oneway request, so a lookup right after that send can come first and
     *  find no route ("Can not find Message Queue for this topic"): asked again for up to 30 s. txmq's one port
     *  routes a topic as soon as it exists. */
    static List<MessageQueue> routed(Callable<Collection<MessageQueue>> lookup) throws Exception {
        long deadline = System.currentTimeMillis() + 30_000;
        while (true) {
            try {
                List<MessageQueue> mqs = new ArrayList<>(lookup.call());
                Collections.sort(mqs);
                return mqs;
            } catch (MQClientException e) {
                String why = String.valueOf(e.getErrorMessage()) + " " + String.valueOf(e.getMessage());
                if (!why.contains("Can not find Message Queue") || System.currentTimeMillis() > deadline) throw e;
                Thread.sleep(100);
            }
        }
    }

    /** Every message of the topic, each queue from its first offset, in (queue, offset) order. */
    static List<Map<String, Object>> readAll(String topic) throws Exception {
        DefaultMQPullConsumer c = new DefaultMQPullConsumer(GROUP + "-reader");
        c.setNamesrvAddr(NAMESRV);
        c.setInstanceName("reader-" + STAMP);
        c.start();
        try {
            List<Map<String, Object>> out = new ArrayList<>();
            List<MessageQueue> mqs = routed(() -> c.fetchSubscribeMessageQueues(topic));
            for (MessageQueue mq : mqs) {
                long offset = c.minOffset(mq);
                while (true) {
                    PullResult r = c.pull(mq, "*", offset, 32);
                    if (r.getPullStatus() != PullStatus.FOUND) break;
                    for (MessageExt m : r.getMsgFoundList()) out.add(view(m));
                    offset = r.getNextBeginOffset();
                }
            }
            return out;
        } finally {
            c.shutdown();
        }
    }

    // ---- scenarios --------------------------------------------------------------------------------
    static Map<String, Object> send() throws Exception {
        DefaultMQProducer p = producer();
        try {
            List<Object> results = new ArrayList<>();
            for (int i = 0; i < num("n", 3); i++) {
                results.add(sendResult(p.send(message("k" + i, str("tag", "TagA"), "body-" + i))));
            }
            Map<String, Object> o = new LinkedHashMap<>();
            o.put("sends", results);
            o.put("read", readAll(TOPIC));
            return o;
        } finally {
            p.shutdown();
        }
    }

    static Map<String, Object> batch() throws Exception {
        DefaultMQProducer p = producer();
        try {
            List<Message> msgs = new ArrayList<>();
            for (int i = 0; i < num("n", 4); i++) msgs.add(message("b" + i, "TagB", "batch-" + i));
            Map<String, Object> o = new LinkedHashMap<>();
            SendResult r = p.send(msgs);
            Map<String, Object> sr = sendResult(r);
            sr.put("ids", r.getMsgId() == null ? 0 : r.getMsgId().split(",").length);
            sr.put("offsetIds", r.getOffsetMsgId() == null ? 0 : r.getOffsetMsgId().split(",").length);
            o.put("send", sr);
            o.put("read", readAll(TOPIC));
            return o;
        } finally {
            p.shutdown();
        }
    }

    static Map<String, Object> oneway() throws Exception {
        DefaultMQProducer p = producer();
        try {
            int n = (int) num("n", 3);
            for (int i = 0; i < n; i++) p.sendOneway(message("o" + i, "TagO", "oneway-" + i));
            List<Map<String, Object>> read = new ArrayList<>();
            long deadline = System.currentTimeMillis() + 30_000;
            while (System.currentTimeMillis() < deadline) {  // oneway: nothing says when they are stored
                read = readAll(TOPIC);
                if (read.size() >= n) break;
                Thread.sleep(200);
            }
            Map<String, Object> o = new LinkedHashMap<>();
            o.put("read", read);
            return o;
        } finally {
            p.shutdown();
        }
    }

    static Map<String, Object> async() throws Exception {
        DefaultMQProducer p = producer();
        try {
            int n = (int) num("n", 3);
            CountDownLatch done = new CountDownLatch(n);
            Map<Integer, Object> results = new ConcurrentHashMap<>();
            for (int i = 0; i < n; i++) {
                final int k = i;
                p.send(message("a" + i, "TagS", "async-" + i), new SendCallback() {
                    public void onSuccess(SendResult r) { results.put(k, sendResult(r)); done.countDown(); }
                    public void onException(Throwable e) { results.put(k, "error: " + e); done.countDown(); }
                });
            }
            done.await(30, TimeUnit.SECONDS);
            Map<String, Object> o = new LinkedHashMap<>();
            o.put("sends", new ArrayList<>(new TreeMap<>(results).values()));
            o.put("read", readAll(TOPIC));
            return o;
        } finally {
            p.shutdown();
        }
    }

    static LocalTransactionState first(String c) {
        if (c.equals("commit")) return LocalTransactionState.COMMIT_MESSAGE;
        if (c.equals("rollback")) return LocalTransactionState.ROLLBACK_MESSAGE;
        return LocalTransactionState.UNKNOW;
    }

    static LocalTransactionState onCheck(String c) {
        return c.endsWith("rollback") ? LocalTransactionState.ROLLBACK_MESSAGE : LocalTransactionState.COMMIT_MESSAGE;
    }

    static Map<String, Object> tx(boolean oldApi) throws Exception {
        String[] cases = str("cases", "commit,rollback,unknown-commit,unknown-rollback").split(",");
        Map<String, AtomicInteger> checks = new ConcurrentHashMap<>();
        Set<String> unknown = new TreeSet<>();
        for (String c : cases) {
            checks.put(c, new AtomicInteger());
            if (c.startsWith("unknown")) unknown.add(c);
        }
        CountDownLatch answered = new CountDownLatch(unknown.size());
        Set<String> answeredKeys = ConcurrentHashMap.newKeySet();
        TransactionMQProducer p = new TransactionMQProducer(GROUP + "-tx");
        p.setNamesrvAddr(NAMESRV);
        p.setInstanceName("tx-" + STAMP);
        if (oldApi) {
            p.setTransactionCheckListener(new TransactionCheckListener() {
                public LocalTransactionState checkLocalTransactionState(MessageExt msg) {
                    String c = msg.getKeys();
                    checks.get(c).incrementAndGet();
                    if (answeredKeys.add(c)) answered.countDown();
                    return onCheck(c);
                }
            });
        } else {
            p.setTransactionListener(new TransactionListener() {
                public LocalTransactionState executeLocalTransaction(Message msg, Object arg) { return first(msg.getKeys()); }

                public LocalTransactionState checkLocalTransaction(MessageExt msg) {
                    String c = msg.getKeys();
                    checks.get(c).incrementAndGet();
                    if (answeredKeys.add(c)) answered.countDown();
                    return onCheck(c);
                }
            });
        }
        p.start();
        Map<String, Object> o = new LinkedHashMap<>();
        try {
            List<Object> sends = new ArrayList<>();
            for (String c : cases) {
                Message m = message(c, "TagT", "tx-" + c);
                TransactionSendResult r;
                if (oldApi) {
                    r = p.sendMessageInTransaction(m, new LocalTransactionExecuter() {
                        public LocalTransactionState executeLocalTransactionBranch(Message msg, Object arg) { return first(msg.getKeys()); }
                    }, null);
                } else {
                    r = p.sendMessageInTransaction(m, null);
                }
                Map<String, Object> s = sendResult(r);
                s.put("case", c);
                s.put("localState", r.getLocalTransactionState().name());
                s.put("transactionId", r.getTransactionId());
                s.put("transactionIdProperty", m.getUserProperty("__transactionId__"));
                sends.add(s);
            }
            o.put("sends", sends);
            boolean all = answered.await(num("timeout", 60), TimeUnit.SECONDS);
            o.put("allUnknownChecked", all);
            Thread.sleep(num("settle", 1500));  // the check answers are oneway: let them reach the broker
            Map<String, Object> checked = new TreeMap<>();
            for (String c : cases) checked.put(c, checks.get(c).get() > 0);
            o.put("checked", checked);
            List<String> visible = new ArrayList<>();
            for (Map<String, Object> m : readAll(TOPIC)) visible.add((String) m.get("keys"));
            Collections.sort(visible);
            o.put("visible", visible);
        } finally {
            p.shutdown();
        }
        return o;
    }

    static Map<String, Object> query() throws Exception {
        DefaultMQProducer p = producer();
        try {
            int n = (int) num("n", 3);
            List<SendResult> sent = new ArrayList<>();
            for (int i = 0; i < n; i++) sent.add(p.send(message("qk" + i + " shared-key", "TagQ", "query-" + i)));
            List<Object> views = new ArrayList<>();
            for (SendResult r : sent) views.add(view(p.viewMessage(r.getOffsetMsgId())));
            Map<String, Object> o = new LinkedHashMap<>();
            o.put("views", views);
            Map<String, Object> byKey = new TreeMap<>();
            long deadline = System.currentTimeMillis() + 20_000;  // RocketMQ builds its key index right after the store
            for (String key : new String[] {"qk0", "shared-key", "no-such-key"}) {
                Object found = null;
                while (true) {
                    try {
                        QueryResult q = p.queryMessage(TOPIC, key, 32, 0, Long.MAX_VALUE);
                        List<String> bodies = new ArrayList<>();
                        for (MessageExt m : q.getMessageList()) bodies.add(new String(m.getBody(), StandardCharsets.UTF_8));
                        Collections.sort(bodies);
                        found = bodies;
                    } catch (MQClientException e) {
                        found = "error " + e.getResponseCode();
                    }
                    boolean want = !key.equals("no-such-key");
                    if (!want || found instanceof List || System.currentTimeMillis() > deadline) break;
                    Thread.sleep(200);
                }
                byKey.put(key, found);
            }
            o.put("byKey", byKey);
            return o;
        } finally {
            p.shutdown();
        }
    }

    /** What a send that the broker (not the client) refuses gives the application: the exception's response code. */
    static Object attempt(DefaultMQProducer p, Message m) {
        try {
            SendResult r = p.send(m);
            return r.getSendStatus().name();
        } catch (MQClientException e) {
            return "client " + e.getResponseCode();
        } catch (org.apache.rocketmq.client.exception.MQBrokerException e) {
            return "broker " + e.getResponseCode();
        } catch (Exception e) {
            return e.getClass().getSimpleName();
        }
    }

    static Map<String, Object> errors() throws Exception {
        DefaultMQProducer p = producer();
        p.setMaxMessageSize(16 << 20);  // the broker's limit decides, not the client's
        p.setRetryTimesWhenSendFailed(0);
        try {
            Map<String, Object> o = new LinkedHashMap<>();
            o.put("warmup", attempt(p, message("w", "TagE", "first")));
            byte[] noise = new byte[(int) num("big", 5 << 20)];
            new java.util.Random(7).nextBytes(noise);  // the client compresses a body over 4 KiB: noise stays this size
            o.put("bodyOverLimit", attempt(p, new Message(TOPIC, "TagE", "big", noise)));
            o.put("compressibleBodyOverLimit", attempt(p, new Message(TOPIC, "TagE", "zeros", new byte[(int) num("big", 5 << 20)])));
            o.put("illegalTopic", attempt(p, new Message("bad topic!", "TagE", "k", "x".getBytes(StandardCharsets.UTF_8))));
            Message late = message("late", "TagE", "delay-99");
            late.setDelayTimeLevel(99);
            o.put("delayLevel99", attempt(p, late));
            Message neg = message("neg", "TagE", "delay-minus-1");
            neg.setDelayTimeLevel(-1);
            o.put("delayLevelMinus1", attempt(p, neg));
            o.put("noSuchTopic", attempt(p, new Message(str("missing", TOPIC + "-missing"), "TagE", "k", "x".getBytes(StandardCharsets.UTF_8))));
            List<String> visible = new ArrayList<>();
            for (Map<String, Object> m : readAll(TOPIC)) visible.add((String) m.get("keys"));
            Collections.sort(visible);
            o.put("visibleNow", visible);  // a delayed message is not, yet
            return o;
        } finally {
            p.shutdown();
        }
    }

    static Map<String, Object> orderly() throws Exception {
        int orders = (int) num("orders", 3), steps = (int) num("steps", 4);
        String[] tags = {"TagA", "TagB", "TagC", "TagD"};
        DefaultMQProducer p = producer();
        Map<String, Object> o = new LinkedHashMap<>();
        try {
            Map<String, Set<Integer>> queuesByOrder = new TreeMap<>();
            for (int step = 0; step < steps; step++) {
                for (int order = 0; order < orders; order++) {
                    Message m = message("order" + order, tags[step % tags.length], "order" + order + "-step" + step);
                    SendResult r = p.send(m, (mqs, msg, arg) -> mqs.get((Integer) arg % mqs.size()), order);
                    queuesByOrder.computeIfAbsent("order" + order, k -> new TreeSet<>()).add(r.getMessageQueue().getQueueId());
                }
            }
            List<Integer> perOrder = new ArrayList<>();
            for (Set<Integer> qs : queuesByOrder.values()) perOrder.add(qs.size());
            o.put("queuesPerOrder", perOrder);  // 1 each: an order's messages in one queue
        } finally {
            p.shutdown();
        }
        String expression = str("expression", "TagA || TagC");
        int expect = 0;
        for (int step = 0; step < steps; step++) if (expression.contains(tags[step % tags.length])) expect += orders;
        CountDownLatch got = new CountDownLatch(expect);
        Map<String, List<String>> byOrder = new ConcurrentHashMap<>();
        DefaultMQPushConsumer c = new DefaultMQPushConsumer(GROUP);
        c.setNamesrvAddr(NAMESRV);
        c.setInstanceName("orderly-" + STAMP);
        c.setConsumeFromWhere(ConsumeFromWhere.CONSUME_FROM_FIRST_OFFSET);
        c.subscribe(TOPIC, expression);
        c.registerMessageListener((org.apache.rocketmq.client.consumer.listener.MessageListenerOrderly) (msgs, ctx) -> {
            for (MessageExt m : msgs) {
                byOrder.computeIfAbsent(m.getKeys(), k -> Collections.synchronizedList(new ArrayList<>()))
                    .add(new String(m.getBody(), StandardCharsets.UTF_8) + ":" + m.getTags());
                got.countDown();
            }
            return org.apache.rocketmq.client.consumer.listener.ConsumeOrderlyStatus.SUCCESS;
        });
        c.start();
        boolean all = got.await(num("timeout", 90), TimeUnit.SECONDS);
        Thread.sleep(num("settle", 1000));  // nothing more arrives: the others were filtered out
        c.shutdown();
        o.put("allReceived", all);
        o.put("byOrder", new TreeMap<>(byOrder));
        return o;
    }

    static Map<String, Object> retry() throws Exception {
        DefaultMQProducer p = producer();
        Map<String, Object> o = new LinkedHashMap<>();
        try {
            p.send(message("ok", "TagR", "ok"));
            p.send(message("fail", "TagR", "fail"));
            int maxTimes = (int) num("maxReconsumeTimes", 2);
            Map<String, List<Integer>> deliveries = new ConcurrentHashMap<>();
            CountDownLatch failed = new CountDownLatch(maxTimes + 1);
            DefaultMQPushConsumer c = new DefaultMQPushConsumer(GROUP);
            c.setNamesrvAddr(NAMESRV);
            c.setInstanceName("retry-" + STAMP);
            c.setConsumeFromWhere(ConsumeFromWhere.CONSUME_FROM_FIRST_OFFSET);
            c.setMaxReconsumeTimes(maxTimes);
            c.subscribe(TOPIC, "*");
            c.registerMessageListener((MessageListenerConcurrently) (msgs, ctx) -> {
                MessageExt m = msgs.get(0);
                String body = new String(m.getBody(), StandardCharsets.UTF_8);
                deliveries.computeIfAbsent(body, k -> Collections.synchronizedList(new ArrayList<>())).add(m.getReconsumeTimes());
                if (body.equals("fail")) {
                    failed.countDown();
                    return ConsumeConcurrentlyStatus.RECONSUME_LATER;
                }
                return ConsumeConcurrentlyStatus.CONSUME_SUCCESS;
            });
            c.start();
            boolean all = failed.await(num("timeout", 120), TimeUnit.SECONDS);
            String dlq = "%DLQ%" + GROUP;
            long inDlq = 0;
            long deadline = System.currentTimeMillis() + 60_000;
            while (System.currentTimeMillis() < deadline) {  // the last failure's move to the dead-letter topic
                inDlq = 0;
                try {
                    for (MessageQueue mq : p.fetchPublishMessageQueues(dlq)) inDlq += p.maxOffset(mq);
                } catch (MQClientException e) {
                    inDlq = 0;
                }
                if (inDlq > 0) break;
                Thread.sleep(300);
            }
            Thread.sleep(num("settle", 2000));  // no delivery after the last allowed one
            c.shutdown();
            Map<String, Object> seen = new TreeMap<>();
            for (Map.Entry<String, List<Integer>> e : deliveries.entrySet()) seen.put(e.getKey(), new ArrayList<>(e.getValue()));
            o.put("allRetried", all);
            o.put("deliveries", seen);  // each delivery's reconsumeTimes
            o.put("deadLettered", inDlq);
        } finally {
            p.shutdown();
        }
        return o;
    }

    static Map<String, Object> drain() throws Exception {
        List<Map<String, Object>> got = Collections.synchronizedList(new ArrayList<>());
        Map<String, Object> o = new LinkedHashMap<>();
        long expect = num("expect", 0), idle = num("idle", 3000);
        long deadline = System.currentTimeMillis() + num("timeout", 60) * 1000;
        if (str("mode", "push").equals("pull")) {
            DefaultMQPullConsumer c = new DefaultMQPullConsumer(GROUP);
            c.setNamesrvAddr(NAMESRV);
            c.setInstanceName("drain-" + STAMP);
            c.start();
            try {
                List<MessageQueue> mqs = routed(() -> c.fetchSubscribeMessageQueues(TOPIC));
                Map<String, Object> starts = new TreeMap<>();
                for (MessageQueue mq : mqs) {
                    long offset = c.fetchConsumeOffset(mq, true);
                    starts.put(Integer.toString(mq.getQueueId()), offset);
                    if (offset < 0) offset = c.maxOffset(mq);
                    while (true) {
                        PullResult r = c.pull(mq, "*", offset, 32);
                        if (r.getPullStatus() != PullStatus.FOUND) break;
                        for (MessageExt m : r.getMsgFoundList()) got.add(view(m));
                        offset = r.getNextBeginOffset();
                    }
                }
                o.put("starts", starts);
            } finally {
                c.shutdown();
            }
        } else {
            DefaultMQPushConsumer c = new DefaultMQPushConsumer(GROUP);
            c.setNamesrvAddr(NAMESRV);
            c.setInstanceName("drain-" + STAMP);
            c.setConsumeFromWhere(ConsumeFromWhere.CONSUME_FROM_LAST_OFFSET);
            c.subscribe(TOPIC, "*");
            final long[] last = {System.currentTimeMillis()};
            c.registerMessageListener((org.apache.rocketmq.client.consumer.listener.MessageListenerOrderly) (msgs, ctx) -> {
                for (MessageExt m : msgs) got.add(view(m));
                last[0] = System.currentTimeMillis();
                return org.apache.rocketmq.client.consumer.listener.ConsumeOrderlyStatus.SUCCESS;
            });
            c.start();
            while (System.currentTimeMillis() < deadline) {
                if (got.size() >= expect && System.currentTimeMillis() - last[0] >= idle) break;
                Thread.sleep(100);
            }
            c.shutdown();
        }
        o.put("received", new ArrayList<>(got));
        return o;
    }

    static Map<String, Object> hold() throws Exception {
        List<String> bodies = Collections.synchronizedList(new ArrayList<>());
        int expect = (int) num("expect", 0);
        CountDownLatch got = new CountDownLatch(expect);
        DefaultMQPushConsumer c = new DefaultMQPushConsumer(GROUP);
        c.setNamesrvAddr(NAMESRV);
        c.setInstanceName("hold-" + STAMP);
        c.setConsumeFromWhere(ConsumeFromWhere.CONSUME_FROM_FIRST_OFFSET);
        c.setPersistConsumerOffsetInterval(500);
        c.subscribe(TOPIC, str("expression", "*"));
        c.registerMessageListener((MessageListenerConcurrently) (msgs, ctx) -> {
            for (MessageExt m : msgs) {
                String body = new String(m.getBody(), StandardCharsets.UTF_8);
                bodies.add(body);
                synchronized (System.out) {
                    System.out.println("GOT " + body);
                    System.out.flush();
                }
                got.countDown();
            }
            return ConsumeConcurrentlyStatus.CONSUME_SUCCESS;
        });
        c.start();
        got.await(num("timeout", 60), TimeUnit.SECONDS);
        synchronized (System.out) {
            System.out.println("READY " + bodies.size());
            System.out.flush();
        }
        while (System.in.read() >= 0) {
            // runs until its standard input closes
        }
        c.shutdown();
        Map<String, Object> o = new LinkedHashMap<>();
        List<String> sorted = new ArrayList<>(bodies);
        Collections.sort(sorted);
        o.put("bodies", sorted);
        return o;
    }

    // ---- consumers: models, lite pull, restarts -----------------------------------------------------
    static DefaultMQPushConsumer pushConsumer(String instance, List<Map<String, Object>> got) throws MQClientException {
        DefaultMQPushConsumer c = new DefaultMQPushConsumer(GROUP);
        c.setNamesrvAddr(NAMESRV);
        c.setInstanceName(instance + "-" + STAMP);
        c.setConsumeFromWhere(ConsumeFromWhere.CONSUME_FROM_FIRST_OFFSET);
        c.setPersistConsumerOffsetInterval(500);
        c.subscribe(TOPIC, str("expression", "*"));
        c.registerMessageListener((MessageListenerConcurrently) (msgs, ctx) -> {
            for (MessageExt m : msgs) {
                Map<String, Object> v = view(m);
                v.put("receivedAt", System.currentTimeMillis());
                v.put("bornTimestamp", m.getBornTimestamp());
                got.add(v);
            }
            return ConsumeConcurrentlyStatus.CONSUME_SUCCESS;
        });
        return c;
    }

    static List<String> bodies(List<Map<String, Object>> got) {
        List<String> out = new ArrayList<>();
        synchronized (got) {
            for (Map<String, Object> m : got) out.add((String) m.get("body"));
        }
        Collections.sort(out);
        return out;
    }

    static boolean waitFor(java.util.function.BooleanSupplier done, long timeoutMs) throws InterruptedException {
        long deadline = System.currentTimeMillis() + timeoutMs;
        while (!done.getAsBoolean()) {
            if (System.currentTimeMillis() > deadline) return false;
            Thread.sleep(100);
        }
        return true;
    }

    static int held(DefaultMQPushConsumer c) {
        int n = 0;  // queues of the topic (a clustering consumer also holds its group's %RETRY% queue)
        for (MessageQueue mq : c.getDefaultMQPushConsumerImpl().getRebalanceImpl().getProcessQueueTable().keySet()) {
            if (mq.getTopic().equals(TOPIC)) n++;
        }
        return n;
    }

    static Map<String, Object> models() throws Exception {
        String model = str("model", "CLUSTERING");
        int n = (int) num("n", 8);
        DefaultMQProducer p = producer();
        Map<String, Object> o = new LinkedHashMap<>();
        try {
            p.createTopic("TBW102", TOPIC, 4);  // the topic exists, empty, before the consumers ask its route
            final int[] found = {0};
            waitFor(() -> {
                try {
                    found[0] = p.fetchPublishMessageQueues(TOPIC).size();
                } catch (MQClientException e) {
                    found[0] = 0;
                }
                return found[0] > 0;
            }, 30_000);
            int queues = found[0];
            List<Map<String, Object>> got1 = Collections.synchronizedList(new ArrayList<>());
            List<Map<String, Object>> got2 = Collections.synchronizedList(new ArrayList<>());
            DefaultMQPushConsumer c1 = pushConsumer("model1", got1), c2 = pushConsumer("model2", got2);
            org.apache.rocketmq.common.protocol.heartbeat.MessageModel mm =
                org.apache.rocketmq.common.protocol.heartbeat.MessageModel.valueOf(model);
            c1.setMessageModel(mm);
            c2.setMessageModel(mm);
            c1.start();
            c2.start();
            boolean broadcasting = model.equals("BROADCASTING");
            // clustering: settled once each holds half the queues (the one that held them all has let half go)
            boolean balanced = waitFor(() -> broadcasting ? held(c1) == queues && held(c2) == queues
                                                          : held(c1) == queues / 2 && held(c2) == queues - queues / 2, 90_000);
            List<Integer> split = new ArrayList<>(List.of(held(c1), held(c2)));
            Collections.sort(split);
            for (int i = 0; i < n; i++) p.send(message("m" + i, "TagM", "model-" + i));
            waitFor(() -> broadcasting ? got1.size() >= n && got2.size() >= n : got1.size() + got2.size() >= n, 60_000);
            Thread.sleep(num("settle", 2000));  // nothing more arrives
            c1.shutdown();
            c2.shutdown();
            o.put("queues", queues);
            o.put("balanced", balanced);
            o.put("queuesHeld", split);
            List<String> all = new ArrayList<>(bodies(got1));
            all.addAll(bodies(got2));
            Collections.sort(all);
            o.put("all", all);  // every delivery, both consumers
            Set<Integer> q1 = new TreeSet<>(), q2 = new TreeSet<>();
            for (Map<String, Object> m : new ArrayList<>(got1)) q1.add((Integer) m.get("queueId"));
            for (Map<String, Object> m : new ArrayList<>(got2)) q2.add((Integer) m.get("queueId"));
            Set<Integer> both = new TreeSet<>(q1);
            both.retainAll(q2);
            o.put("bothReceived", !got1.isEmpty() && !got2.isEmpty());
            o.put("queuesReadByBoth", both.size());
            o.put("eachReceivedAll", bodies(got1).equals(bodies(got2)) && got1.size() == n);
        } finally {
            p.shutdown();
        }
        return o;
    }

    static org.apache.rocketmq.client.consumer.DefaultLitePullConsumer litePull(String group, String instance) {
        org.apache.rocketmq.client.consumer.DefaultLitePullConsumer c = new org.apache.rocketmq.client.consumer.DefaultLitePullConsumer(group);
        c.setNamesrvAddr(NAMESRV);
        c.setInstanceName(instance + "-" + STAMP);
        c.setAutoCommit(false);
        c.setPollTimeoutMillis(1000);
        return c;
    }

    /** poll() until -expect messages came (or none more for 2 s past that / the timeout): their bodies, sorted. */
    static List<String> pollBodies(org.apache.rocketmq.client.consumer.DefaultLitePullConsumer c, int expect) {
        List<String> out = new ArrayList<>();
        long deadline = System.currentTimeMillis() + 30_000;
        long quietUntil = 0;
        while (System.currentTimeMillis() < deadline) {
            List<MessageExt> got = c.poll(500);
            for (MessageExt m : got) out.add(new String(m.getBody(), StandardCharsets.UTF_8));
            if (out.size() >= expect) {
                if (quietUntil == 0) quietUntil = System.currentTimeMillis() + 2000;
                if (!got.isEmpty()) quietUntil = System.currentTimeMillis() + 2000;
                if (System.currentTimeMillis() >= quietUntil) break;
            }
        }
        Collections.sort(out);
        return out;
    }

    static Map<String, Object> litepull() throws Exception {
        int n = (int) num("n", 6);
        DefaultMQProducer p = producer();
        Map<String, Object> o = new LinkedHashMap<>();
        try {
            for (int i = 0; i < n; i++) p.send(message("l" + i, i % 2 == 0 ? "TagA" : "TagB", "lite-" + i));
        } finally {
            p.shutdown();
        }
        org.apache.rocketmq.client.consumer.DefaultLitePullConsumer s = litePull(GROUP, "lite1");
        s.subscribe(TOPIC, "TagA");
        s.start();
        o.put("subscribed", pollBodies(s, (n + 1) / 2));
        s.commitSync();
        s.shutdown();
        org.apache.rocketmq.client.consumer.DefaultLitePullConsumer again = litePull(GROUP, "lite2");
        again.subscribe(TOPIC, "TagA");
        again.start();
        o.put("subscribedAgainAfterCommit", pollBodies(again, 0));
        again.shutdown();

        org.apache.rocketmq.client.consumer.DefaultLitePullConsumer a = litePull(GROUP + "-assign", "lite3");
        a.start();
        try {
            List<MessageQueue> mqs = new ArrayList<>(a.fetchMessageQueues(TOPIC));
            Collections.sort(mqs);
            a.assign(mqs);
            for (MessageQueue mq : mqs) a.seekToBegin(mq);
            o.put("assignedFromBegin", pollBodies(a, n));
            a.commitSync();
            Map<String, Object> committed = new TreeMap<>();
            long total = 0;
            for (MessageQueue mq : mqs) total += a.committed(mq);
            committed.put("sum", total);  // every queue's committed offset: its end
            o.put("committedAfterCommit", committed);
            MessageQueue first = null;
            for (MessageQueue mq : mqs) if (first == null && a.committed(mq) >= 2) first = mq;
            if (first != null) {
                a.seek(first, 1);
                List<String> reread = pollBodies(a, (int) (a.committed(first) - 1));
                o.put("afterSeekTo1", reread.size() + " of the queue's " + a.committed(first));
            }
            for (MessageQueue mq : mqs) a.seekToEnd(mq);
            o.put("afterSeekToEnd", pollBodies(a, 0));
        } finally {
            a.shutdown();
        }
        return o;
    }

    static Map<String, Object> restart() throws Exception {
        int n = (int) num("n", 3);
        String phase = str("phase", "both");  // first | second | both (first, then second, in one run)
        DefaultMQProducer p = producer();
        Map<String, Object> o = new LinkedHashMap<>();
        try {
            if (!phase.equals("second")) {
                for (int i = 0; i < n; i++) p.send(message("r" + i, "TagR", "before-" + i));
                List<Map<String, Object>> got1 = Collections.synchronizedList(new ArrayList<>());
                DefaultMQPushConsumer c1 = pushConsumer("restart1", got1);
                c1.start();
                waitFor(() -> got1.size() >= n, 60_000);
                Thread.sleep(num("settle", 1500));
                c1.shutdown();  // persists its offsets
                o.put("firstRun", bodies(got1));
            }
            if (!phase.equals("first")) {
                for (int i = 0; i < n; i++) p.send(message("r" + (n + i), "TagR", "after-" + i));
                List<Map<String, Object>> got2 = Collections.synchronizedList(new ArrayList<>());
                DefaultMQPushConsumer c2 = pushConsumer("restart2", got2);
                c2.start();
                waitFor(() -> got2.size() >= n, 60_000);
                Thread.sleep(num("settle", 1500));
                c2.shutdown();
                o.put("secondRun", bodies(got2));
            }
        } finally {
            p.shutdown();
        }
        return o;
    }

    static Map<String, Object> delays() throws Exception {
        String[] table = str("delayTable", "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h").trim().split("\\s+");
        long waitBelow = num("waitBelowMs", 60_000);
        List<Integer> levels = new ArrayList<>();
        for (String l : str("levels", "1,2,3").split(",")) levels.add(Integer.parseInt(l.trim()));
        DefaultMQProducer p = producer();
        Map<String, Object> o = new LinkedHashMap<>();
        try {
            p.send(message("w", "TagD", "warmup"));
            List<Map<String, Object>> got = Collections.synchronizedList(new ArrayList<>());
            DefaultMQPushConsumer c = pushConsumer("delays", got);
            c.start();
            waitFor(() -> got.size() >= 1, 60_000);
            Map<Integer, String> offsetIds = new TreeMap<>();
            Set<String> awaited = new TreeSet<>();
            for (int level : levels) {
                Message m = message("L" + level, "TagD", "level-" + level);
                m.setDelayTimeLevel(level);
                offsetIds.put(level, p.send(m).getOffsetMsgId());
                if (delayMs(table[level - 1]) < waitBelow) awaited.add("level-" + level);
            }
            boolean all = waitFor(() -> bodies(got).containsAll(awaited), 60_000 + waitBelow);
            Thread.sleep(num("settle", 1500));
            c.shutdown();
            Map<String, Object> received = new TreeMap<>();
            List<String> early = new ArrayList<>();
            for (Map<String, Object> m : new ArrayList<>(got)) {
                String body = (String) m.get("body");
                if (!body.startsWith("level-")) continue;
                int level = Integer.parseInt(body.substring(6));
                long waited = (Long) m.get("receivedAt") - (Long) m.get("bornTimestamp");
                if (waited < delayMs(table[level - 1])) early.add(body + " after " + waited + " ms");
                Map<String, Object> v = new LinkedHashMap<>(m);
                v.remove("receivedAt");
                v.remove("bornTimestamp");
                received.put(body, v);
            }
            o.put("allAwaitedReceived", all);
            o.put("received", received);
            o.put("early", early);
            Map<String, Object> pending = new TreeMap<>();
            for (int level : levels) {
                if (delayMs(table[level - 1]) < waitBelow) continue;
                MessageExt v = p.viewMessage(offsetIds.get(level));
                Map<String, Object> pv = view(v);
                pv.put("storeTimestamp", v.getStoreTimestamp());
                pv.put("bornTimestamp", v.getBornTimestamp());
                pv.put("offsetMsgId", offsetIds.get(level));
                pending.put("level-" + level, pv);
            }
            o.put("pending", pending);  // not due within the run: as stored
        } finally {
            p.shutdown();
        }
        return o;
    }

    static long delayMs(String d) {
        long unit = d.endsWith("ms") ? 1 : d.endsWith("s") ? 1000 : d.endsWith("m") ? 60_000 : d.endsWith("h") ? 3_600_000 : 86_400_000;
        return Long.parseLong(d.replaceAll("[a-z]+$", "")) * unit;
    }

    // ---- errors -------------------------------------------------------------------------------------
    static Map<String, Object> unknownCode() throws Exception {
        int code = (int) num("code", 9999);
        DefaultMQProducer p = producer();
        Map<String, Object> o = new LinkedHashMap<>();
        try {
            o.put("warmup", attempt(p, message("u", "TagU", "before")));
            org.apache.rocketmq.client.impl.factory.MQClientInstance f = p.getDefaultMQProducerImpl().getMqClientFactory();
            org.apache.rocketmq.remoting.RemotingClient rc = f.getMQClientAPIImpl().getRemotingClient();
            String broker = f.findBrokerAddressInPublish(routed(() -> p.fetchPublishMessageQueues(TOPIC)).get(0).getBrokerName());
            for (String[] target : new String[][] {{"nameServer", NAMESRV}, {"broker", broker}}) {
                org.apache.rocketmq.remoting.protocol.RemotingCommand req =
                    org.apache.rocketmq.remoting.protocol.RemotingCommand.createRequestCommand(code, null);
                Map<String, Object> a = new LinkedHashMap<>();
                try {
                    org.apache.rocketmq.remoting.protocol.RemotingCommand r = rc.invokeSync(target[1], req, num("callTimeout", 3000));
                    a.put("code", r.getCode());
                    a.put("remarkNamesCode", r.getRemark() != null && r.getRemark().contains(Integer.toString(code)));
                    a.put("remark", r.getRemark());
                } catch (Exception e) {  // no answer
                    a.put("error", e.getClass().getSimpleName());
                }
                o.put(target[0], a);
            }
            o.put("sendAfterwards", attempt(p, message("u2", "TagU", "after")));
        } finally {
            p.shutdown();
        }
        return o;
    }

    static Map<String, Object> noTopic() throws Exception {
        DefaultMQProducer p = producer();
        p.setRetryTimesWhenSendFailed(0);
        Map<String, Object> o = new LinkedHashMap<>();
        try {
            o.put("send", attempt(p, message("x", "TagX", "to-nowhere")));
        } finally {
            p.shutdown();
        }
        DefaultMQPullConsumer pull = new DefaultMQPullConsumer(GROUP + "-pull");
        pull.setNamesrvAddr(NAMESRV);
        pull.setInstanceName("notopic-" + STAMP);
        pull.start();
        try {
            pull.fetchSubscribeMessageQueues(TOPIC);
            o.put("pullQueues", "found");
        } catch (MQClientException e) {
            o.put("pullQueues", "client " + e.getResponseCode());
        } finally {
            pull.shutdown();
        }
        DefaultMQPushConsumer c = new DefaultMQPushConsumer(GROUP);
        c.setNamesrvAddr(NAMESRV);
        c.setInstanceName("notopic-push-" + STAMP);
        c.subscribe(TOPIC, "*");
        c.registerMessageListener((MessageListenerConcurrently) (msgs, ctx) -> ConsumeConcurrentlyStatus.CONSUME_SUCCESS);
        try {
            c.start();
            o.put("pushStart", "started");
        } catch (MQClientException e) {
            o.put("pushStart", "client " + e.getResponseCode());
        } finally {
            c.shutdown();
        }
        return o;
    }

    static Map<String, Object> sql() throws Exception {
        DefaultMQProducer p = producer();
        try {
            for (int i = 0; i < 12; i++) {
                Message m = message("k" + i, i < 6 ? "TagS" : "TagT", "m" + i);
                if (i < 10) m.putUserProperty("a", Integer.toString(i + 1));
                if (i < 11) m.putUserProperty("region", i % 2 == 0 ? "eu" : "us");
                p.send(m);
            }
        } finally {
            p.shutdown();
        }
        String[] cases = str("cases", "4|a BETWEEN 3 AND 6").split(";");
        List<Map<String, Object>> results = new ArrayList<>();
        List<DefaultMQPushConsumer> consumers = new ArrayList<>();
        List<CountDownLatch> latches = new ArrayList<>();
        List<Set<String>> received = new ArrayList<>();
        for (int k = 0; k < cases.length; k++) {
            String[] c = cases[k].split("\\|", 2);
            Map<String, Object> r = new LinkedHashMap<>();
            r.put("expression", c[1]);
            results.add(r);
            CountDownLatch got = new CountDownLatch(Integer.parseInt(c[0]));
            Set<String> bodies = Collections.synchronizedSet(new TreeSet<>());
            DefaultMQPushConsumer consumer = new DefaultMQPushConsumer(GROUP + "-" + k);
            consumer.setNamesrvAddr(NAMESRV);
            consumer.setInstanceName("sql-" + k + "-" + STAMP);
            consumer.setConsumeFromWhere(ConsumeFromWhere.CONSUME_FROM_FIRST_OFFSET);
            consumer.subscribe(TOPIC, MessageSelector.bySql(c[1]));
            consumer.registerMessageListener((MessageListenerConcurrently) (msgs, ctx) -> {
                for (MessageExt m : msgs) {
                    if (bodies.add(new String(m.getBody(), StandardCharsets.UTF_8))) got.countDown();
                }
                return ConsumeConcurrentlyStatus.CONSUME_SUCCESS;
            });
            try {
                consumer.start();
                consumers.add(consumer);
                latches.add(got);
                received.add(bodies);
            } catch (MQClientException e) {
                r.put("startError", e.getResponseCode());
                consumer.shutdown();
                consumers.add(null);
                latches.add(null);
                received.add(null);
            }
        }
        long deadline = System.currentTimeMillis() + num("timeout", 90) * 1000;
        for (int k = 0; k < cases.length; k++) {
            if (latches.get(k) == null) continue;
            boolean all = latches.get(k).await(Math.max(0, deadline - System.currentTimeMillis()), TimeUnit.MILLISECONDS);
            results.get(k).put("allReceived", all);
        }
        Thread.sleep(num("settle", 1000));  // nothing more arrives: the others were filtered out
        for (int k = 0; k < cases.length; k++) {
            if (consumers.get(k) == null) continue;
            consumers.get(k).shutdown();
            results.get(k).put("received", new ArrayList<>(received.get(k)));
        }
        Map<String, Object> o = new LinkedHashMap<>();
        o.put("cases", results);
        return o;
    }

    // ---- output ---------------------------------------------------------------------------------
    static String json(Object v) {
        if (v == null) return "null";
        if (v instanceof String) return quote((String) v);
        if (v instanceof Number || v instanceof Boolean) return v.toString();
        if (v instanceof Map) {
            StringBuilder b = new StringBuilder("{");
            for (Map.Entry<?, ?> e : ((Map<?, ?>) v).entrySet()) {
                if (b.length() > 1) b.append(',');
                b.append(quote(String.valueOf(e.getKey()))).append(':').append(json(e.getValue()));
            }
            return b.append('}').toString();
        }
        if (v instanceof Iterable) {
            StringBuilder b = new StringBuilder("[");
            for (Object x : (Iterable<?>) v) {
                if (b.length() > 1) b.append(',');
                b.append(json(x));
            }
            return b.append(']').toString();
        }
        return quote(v.toString());
    }

    static String quote(String s) {
        StringBuilder b = new StringBuilder("\"");
        for (char ch : s.toCharArray()) {
            if (ch == '"' || ch == '\\') b.append('\\').append(ch);
            else if (ch < 0x20 || ch > 0x7e) b.append(String.format("\\u%04x", (int) ch));  // ASCII out, whatever the locale
            else b.append(ch);
        }
        return b.append('"').toString();
    }
}
