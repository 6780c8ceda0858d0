// Scenarios run with Apache RocketMQ's official Node.js SDK (rocketmq-client-nodejs) against txmq's gRPC front end.
//
// tests/sdkenv.py installs the pinned SDK into a cached directory and runs
//     node node_scenario.js SCENARIO --sdk DIR --endpoint 127.0.0.1:PORT --topic T [--group G] ...
// The last stdout line is one JSON object; the tests assert on it. Every scenario has a deadline and the
// process exits even if an SDK timer or stream would keep it alive.
//
// Scenarios: transactions (commit, rollback, an orphan resolved by the checker through a check-back, then a
// SimpleConsumer receives exactly the committed ones), send, receive, push (a PushConsumer, one failed delivery),
// fifo-send (FIFO messages of --groups message groups), fifo-receive (a SimpleConsumer of a FIFO group that
// processes each group in order; --skip-first BODY, --crash-after N, as tests/sdk/python_scenario.py's),
// delay (DELAY messages, then a SimpleConsumer).
'use strict';

const path = require('node:path');

const RESULT = { errors: [] };
const COMMIT = 1; // apache.rocketmq.v2.TransactionResolution
const ROLLBACK = 2;
const UNKNOWN = 0;

function finish(code) {
  process.stdout.write(JSON.stringify(RESULT) + '\n', () => process.exit(code));
}

function parseArgs(argv) {
  const args = {
    scenario: argv[0], group: 'sdk-consumers', count: 3, expect: 1, awaitDuration: 3000, requestTimeout: 5000,
    checkWait: 30000, receiveWait: 30000, settle: 2000, deadline: 120000, groups: 3, invisible: 2000, crashAfter: 0, slow: 0, batch: 16,
    delayMs: 3000,
  };
  const numeric = new Set([ 'count', 'expect', 'awaitDuration', 'requestTimeout', 'checkWait', 'receiveWait', 'settle', 'deadline',
    'groups', 'invisible', 'crashAfter', 'slow', 'batch', 'delayMs' ]);
  for (let i = 1; i < argv.length; i += 2) {
    const key = argv[i].replace(/^--/, '').replace(/-([a-z])/g, (_, c) => c.toUpperCase());
    args[key] = numeric.has(key) ? Number(argv[i + 1]) : argv[i + 1];
  }
  return args;
}

function credentials(args) {
  return args.secretKey ? { accessKey: args.accessKey || 'txmq', accessSecret: args.secretKey } : undefined;
}

// What every client of a scenario is built with: the broker's endpoint, TLS, the credentials and the request timeout.
function clientOptions(args) {
  return { endpoints: args.endpoint, sslEnabled: args.tls === 'true', namespace: '', sessionCredentials: credentials(args), requestTimeout: args.requestTimeout };
}

function simpleConsumer(sdk, args, topic) {
  return new sdk.SimpleConsumer({
    ...clientOptions(args), consumerGroup: args.group, subscriptions: new Map([[ topic, '*' ]]), awaitDuration: args.awaitDuration,
  });
}

const sleep = ms => new Promise(resolve => setTimeout(resolve, ms));

async function waitUntil(pred, ms) {
  const end = Date.now() + ms;
  while (Date.now() < end) {
    if (pred()) return true;
    await sleep(100);
  }
  return pred();
}

function receipt(r) {
  return { message_id: r.messageId, transaction_id: r.transactionId, offset: r.offset };
}

function view(m) {
  return {
    topic: m.topic, body: m.body.toString('utf8'), message_id: m.messageId, tag: m.tag || null,
    keys: [ ...(m.keys || []) ].sort(), properties: Object.fromEntries(m.properties || new Map()),
    delivery_attempt: m.deliveryAttempt ?? null, corrupted: !!m.corrupted, has_receipt_handle: !!m.receiptHandle,
  };
}

function checker(decisions, checks) {
  return {
    async check(messageView) {
      const body = messageView.body.toString('utf8');
      const answer = decisions[body] ?? UNKNOWN;
      checks.push({
        body, message_id: messageView.messageId, topic: messageView.topic,
        properties: Object.fromEntries(messageView.properties || new Map()), answer,
      });
      return answer;
    },
  };
}

async function receiveUntil(consumer, want, ms, settleMs) {
  const got = [];
  const end = Date.now() + ms;
  let settleEnd = null;
  for (;;) {
    const now = Date.now();
    const bodies = new Set(got.map(m => m.body.toString('utf8')));
    if (settleEnd === null && (want.every(b => bodies.has(b)) || now >= end)) settleEnd = now + settleMs;
    if (settleEnd !== null && now >= settleEnd) return got;
    const messages = await consumer.receive(16, 15000);
    for (const m of messages) {
      got.push(m);
      await consumer.ack(m);
    }
  }
}

async function transactions(sdk, args) {
  const t = args.topic;
  const commitBody = `commit-${t}`;
  const rollbackBody = `rollback-${t}`;
  const orphanBody = `orphan-${t}`;
  const checks = [];
  const producer = new sdk.Producer({
    ...clientOptions(args), topics: [ t ],
    checker: checker({ [commitBody]: COMMIT, [rollbackBody]: ROLLBACK, [orphanBody]: COMMIT }, checks),
  });
  await producer.startup();
  RESULT.producer_started = true;
  const sent = {};
  let tx = producer.beginTransaction();
  let r = await producer.send({
    topic: t, tag: 'sdk', keys: [ 'k-commit' ], body: Buffer.from(commitBody), properties: new Map([[ 'origin', 'node-sdk' ]]),
  }, tx);
  await tx.commit();
  sent.commit = receipt(r);
  tx = producer.beginTransaction();
  r = await producer.send({ topic: t, tag: 'sdk', body: Buffer.from(rollbackBody) }, tx);
  await tx.rollback();
  sent.rollback = receipt(r);
  tx = producer.beginTransaction();
  r = await producer.send({ topic: t, tag: 'sdk', body: Buffer.from(orphanBody) }, tx); // never ended: UNKNOWN
  sent.orphan = receipt(r);
  RESULT.sent = sent;
  RESULT.orphan_checked = await waitUntil(() => checks.some(c => c.body === orphanBody), args.checkWait);
  await sleep(500); // the checker's EndTransaction(source=SOURCE_SERVER_CHECK) reaches the broker

  const consumer = simpleConsumer(sdk, args, t);
  await consumer.startup();
  RESULT.consumer_started = true;
  const got = await receiveUntil(consumer, [ commitBody, orphanBody ], args.receiveWait, args.settle);
  RESULT.received = got.map(view);
  RESULT.checks = checks;
  await consumer.shutdown();
  await producer.shutdown();
  RESULT.shutdown = true;
}

async function send(sdk, args) {
  const t = args.topic;
  const producer = new sdk.Producer({ ...clientOptions(args), topics: [ t ] });
  await producer.startup();
  const sent = [];
  for (let i = 0; i < args.count; i++) {
    const body = `${args.body || 'node-normal'}-${i}`;
    const r = await producer.send({
      topic: t, tag: 'sdk-tag', keys: [ `key-${i}` ], body: Buffer.from(body),
      properties: new Map([[ 'origin', 'node-sdk' ], [ 'n', String(i) ]]),
    });
    sent.push({ ...receipt(r), body });
  }
  RESULT.sent = sent;
  await producer.shutdown();
  RESULT.shutdown = true;
}

// --count DELAY messages due --delay-ms after their send, then a SimpleConsumer receives --expect of them: each
// with when it arrived and its deliveryTimestamp.
async function delay(sdk, args) {
  const t = args.topic;
  const producer = new sdk.Producer({ ...clientOptions(args), topics: [ t ] });
  await producer.startup();
  const sent = [];
  for (let i = 0; i < args.count; i++) {
    const body = `delayed-${i}`;
    const due = new Date(Date.now() + args.delayMs);
    const r = await producer.send({ topic: t, tag: 'timeout', keys: [ `order-${i}` ], body: Buffer.from(body), deliveryTimestamp: due });
    sent.push({ ...receipt(r), body, due_ms: due.getTime() });
  }
  RESULT.sent = sent;
  await producer.shutdown();
  if (args.expect <= 0) {
    RESULT.shutdown = true;
    return;
  }
  const consumer = simpleConsumer(sdk, args, t);
  await consumer.startup();
  const got = [];
  const end = Date.now() + args.receiveWait;
  while (got.length < args.expect && Date.now() < end) {
    for (const m of await consumer.receive(16, 15000)) {
      got.push({ ...view(m), received_ms: Date.now(), delivery_timestamp: m.deliveryTimestamp ? m.deliveryTimestamp.getTime() : null });
      await consumer.ack(m);
    }
  }
  RESULT.received = got;
  await consumer.shutdown();
  RESULT.shutdown = true;
}

async function receive(sdk, args) {
  const consumer = simpleConsumer(sdk, args, args.topic);
  await consumer.startup();
  const got = [];
  let end = Date.now() + args.receiveWait;
  while (got.length < args.expect && Date.now() < end) {
    for (const m of await consumer.receive(16, 15000)) {
      got.push(m);
      await consumer.ack(m);
    }
  }
  end = Date.now() + args.settle;
  while (Date.now() < end) {
    for (const m of await consumer.receive(16, 15000)) {
      got.push(m);
      await consumer.ack(m);
    }
  }
  RESULT.received = got.map(view);
  await consumer.shutdown();
  RESULT.shutdown = true;
}

// A PushConsumer (QueryAssignment, long-polling receives, ack; a FAILURE is a ChangeInvisibleDuration) consumes
// --expect messages; the first delivery of --fail-first fails, so it must come again with a higher delivery attempt.
async function push(sdk, args) {
  const deliveries = [];
  const consumer = new sdk.PushConsumer({
    ...clientOptions(args), consumerGroup: args.group, subscriptions: new Map([[ args.topic, '*' ]]),
    messageListener: {
      async consume(messageView) {
        if (args.slow) await sleep(args.slow);
        const v = view(messageView);
        const first = !deliveries.some(d => d.body === v.body);
        v.result = v.body === args.failFirst && first ? 'FAILURE' : 'SUCCESS';
        deliveries.push(v);
        return v.result === 'FAILURE' ? sdk.ConsumeResult.FAILURE : sdk.ConsumeResult.SUCCESS;
      },
    },
  });
  await consumer.startup();
  RESULT.consumer_started = true;
  const succeeded = () => new Set(deliveries.filter(d => d.result === 'SUCCESS').map(d => d.body)).size;
  RESULT.all_consumed = await waitUntil(() => succeeded() >= args.expect, args.receiveWait);
  await sleep(args.settle);
  RESULT.deliveries = deliveries;
  await consumer.shutdown();
  RESULT.shutdown = true;
}

// FIFO: --count messages to each of --groups message groups, one send at a time, interleaved (BODYg0:0, BODYg1:0, ...).
async function fifoSend(sdk, args) {
  const t = args.topic;
  const producer = new sdk.Producer({ ...clientOptions(args), topics: [ t ] });
  await producer.startup();
  const sent = [];
  for (let i = 0; i < args.count; i++) {
    for (let k = 0; k < args.groups; k++) {
      const group = `g${k}`;
      const body = `${args.body || ''}g${k}:${i}`;
      const r = await producer.send({ topic: t, body: Buffer.from(body), messageGroup: group });
      sent.push({ ...receipt(r), body, group });
    }
  }
  RESULT.sent = sent;
  await producer.shutdown();
  RESULT.shutdown = true;
}

// A SimpleConsumer of a FIFO group processing each message group in order (see python_scenario.py's fifo-receive).
async function fifoReceive(sdk, args) {
  const consumer = simpleConsumer(sdk, args, args.topic);
  await consumer.startup();
  RESULT.consumer_started = true;
  const events = [];
  RESULT.events = events;
  const done = new Set((args.already || '').split(',').filter(Boolean)); // processed by an earlier consumer
  let skipped = false;
  const end = Date.now() + args.receiveWait;
  while (done.size < args.expect && Date.now() < end) {
    const stopped = new Set();
    const batch = await consumer.receive(args.batch, args.invisible);
    for (let n = 0; n < batch.length; n++) {
      const m = batch[n];
      const e = { body: m.body.toString('utf8'), attempt: m.deliveryAttempt, group: m.messageGroup };
      events.push(e);
      if (args.crashAfter && events.filter(x => x.event === 'processed').length >= args.crashAfter) {
        e.event = 'crash-held';
        continue;
      }
      const later = batch.slice(n + 1).some(x => x.messageGroup === e.group);
      if (stopped.has(e.group)) {
        e.event = 'held';
      } else if (!skipped && (e.body === args.skipFirst || (args.skipFirst === 'auto' && later && !done.has(e.body)))) {
        skipped = true;
        stopped.add(e.group);
        e.event = 'skipped';
      } else {
        await consumer.ack(m);
        done.add(e.body);
        e.event = 'processed';
      }
    }
    if (args.crashAfter && events.some(x => x.event === 'crash-held')) {
      RESULT.crashed = true;
      finish(0);
      return new Promise(() => {});
    }
  }
  await consumer.shutdown();
  RESULT.shutdown = true;
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  RESULT.scenario = args.scenario;
  setTimeout(() => {
    RESULT.errors.push(`scenario deadline of ${args.deadline}ms passed`);
    RESULT.timed_out = true;
    finish(3);
  }, args.deadline).unref();
  const sdk = require(path.join(args.sdk, 'node_modules', 'rocketmq-client-nodejs'));
  const scenarios = { transactions, send, receive, push, delay, 'fifo-send': fifoSend, 'fifo-receive': fifoReceive };
  if (!scenarios[args.scenario]) throw new Error(`unknown scenario ${args.scenario}`);
  await scenarios[args.scenario](sdk, args);
}

process.on('unhandledRejection', err => {
  RESULT.errors.push(`unhandled rejection: ${err && err.stack || err}`);
});
process.on('uncaughtException', err => {
  RESULT.errors.push(`uncaught exception: ${err && err.stack || err}`);
  finish(1);
});

main().then(() => finish(RESULT.errors.length ? 1 : 0), err => {
  RESULT.errors.push(`${err && err.stack || err}`);
  finish(1);
});
