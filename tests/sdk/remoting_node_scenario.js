// npm's ali-ons (a pure JavaScript RocketMQ 4 remoting client) against txmq's --remoting-port.
// node remoting_node_scenario.js produce_consume --sdk DIR --namesrv HOST:PORT --topic T --group G
// Prints one JSON line: what was sent and received; "errors" lists what failed.
'use strict';

const path = require('path');
const args = {};
for (let i = 3; i < process.argv.length; i += 2) args[process.argv[i].replace(/^--/, '')] = process.argv[i + 1];
const ons = require(path.join(args.sdk, 'node_modules', 'ali-ons'));
const result = { errors: [], sent: [], received: [] };
const sleep = ms => new Promise(r => setTimeout(r, ms));
const quiet = { info() {}, warn() {}, debug() {}, error(e) { result.errors.push(`logged: ${e && e.message || e}`); } };
const common = { httpclient: {}, nameSrv: args.namesrv, accessKeyId: 'any', accessKeySecret: args.secret || 'any',
  logger: quiet, persistConsumerOffsetInterval: 1000, rebalanceInterval: 2000 };

async function produceConsume() {
  const producer = new ons.Producer(Object.assign({ producerGroup: `${args.group}-p` }, common));
  await producer.ready();
  for (let i = 0; i < 5; i++) {
    const msg = new ons.Message(args.topic, 'node', `node-${i}`);
    msg.keys = [ `nk-${i}` ];
    const r = await producer.send(msg);
    result.sent.push({ body: `node-${i}`, status: r.sendStatus, msgId: r.msgId, queueId: r.messageQueue.queueId });
  }
  const consumer = new ons.Consumer(Object.assign({ consumerGroup: args.group }, common));
  consumer.on('error', e => result.errors.push(`consumer: ${e.message}`));
  const seen = new Set();
  consumer.subscribe(args.topic, '*', async msg => {
    result.received.push({ body: msg.body.toString(), msgId: msg.msgId, tags: msg.tags, keys: msg.keys, queueId: msg.queueId });
    seen.add(msg.body.toString());
  });
  await consumer.ready();
  const deadline = Date.now() + 40000;
  while (Date.now() < deadline && seen.size < 5) await sleep(100);
  // a message sent while the consumer waits (its long poll)
  const late = await producer.send(new ons.Message(args.topic, 'node', 'node-late'));
  result.sent.push({ body: 'node-late', status: late.sendStatus, msgId: late.msgId });
  const t0 = Date.now();
  while (Date.now() < t0 + 20000 && !seen.has('node-late')) await sleep(50);
  result.late_ms = Date.now() - t0;
  await sleep(500);
  await consumer.close();
  await producer.close();
}

(async () => {
  try {
    if (process.argv[2] === 'produce_consume') await produceConsume();
    else result.errors.push(`unknown scenario ${process.argv[2]}`);
  } catch (e) {
    result.errors.push(`${e.name}: ${e.message} ${e.stack}`);
  }
  process.stdout.write(JSON.stringify(result) + '\n');
  process.exit(0);
})();
