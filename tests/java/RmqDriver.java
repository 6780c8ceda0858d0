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
 *   hold      a push consumer of -Dgroup on the topic, consuming from the first offset; prints "GOT <body>" for each
 *             message, "READY" once it has -Dexpect of them, then runs until its standard input closes; its RESULT
 *             lists the bodies received
 */

import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Collections;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.TreeMap;
import java.util.TreeSet;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;

import org.apache.rocketmq.client.QueryResult;
import org.apache.rocketmq.client.consumer.DefaultMQPullConsumer;
import org.apache.rocketmq.client.consumer.DefaultMQPushConsumer;
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

    /** Every message of the topic, each queue from its first offset, in (queue, offset) order. */
    static List<Map<String, Object>> readAll(String topic) throws Exception {
        DefaultMQPullConsumer c = new DefaultMQPullConsumer(GROUP + "-reader");
        c.setNamesrvAddr(NAMESRV);
        c.setInstanceName("reader-" + STAMP);
        c.start();
        try {
            List<Map<String, Object>> out = new ArrayList<>();
            List<MessageQueue> mqs = new ArrayList<>(c.fetchSubscribeMessageQueues(topic));
            Collections.sort(mqs);
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
                List<MessageQueue> mqs = new ArrayList<>(c.fetchSubscribeMessageQueues(TOPIC));
                Collections.sort(mqs);
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
            else if (ch < 0x20) b.append(String.format("\\u%04x", (int) ch));
            else b.append(ch);
        }
        return b.append('"').toString();
    }
}
