// The Node.js side of scripts/bench-sqs (modules from BENCH_SQS_MODULES via
// NODE_PATH: @aws-sdk/client-sqs, sqs-consumer, pg). Credentials and region
// from the AWS environment variables.
//   node bench_sqs.cjs create ENDPOINT NAME          -> prints the queue URL
//   node bench_sqs.cjs fill ENDPOINT URL N RUN       -> N jobs, 10 % duplicate keys,
//        in SendMessageBatch calls of 10 (8 in parallel)
//   node bench_sqs.cjs ceiling ENDPOINT URL N        -> receive + delete with nothing
//        else (8 loops, 10 a receive) until N messages; prints "seconds N"
//   node bench_sqs.cjs consume ENDPOINT URL N DSN    -> sqs-consumer (batchSize 10)
//        whose handler claims the key and inserts the effect row in one
//        PostgreSQL transaction (pg, a pool of 10); stops once N messages were
//        handled; prints "seconds N"
"use strict";
const {
  SQSClient, CreateQueueCommand, SendMessageBatchCommand, ReceiveMessageCommand,
  DeleteMessageBatchCommand,
} = require("@aws-sdk/client-sqs");

const [cmd, endpoint, a, b, c] = process.argv.slice(2);
const sqs = new SQSClient({ endpoint, region: process.env.AWS_REGION || "us-east-1" });

async function fill(url, n, run) {
  const unique = Math.floor((n * 9) / 10);
  const bodies = [];
  for (let i = 0; i < n; i++) {
    const k = i < unique ? i : (i * 7) % unique;
    bodies.push(JSON.stringify({ job_id: `sqsb:${run}:${k}`, account_id: `acct-${k % 97}`,
      amount_minor: 100 + k, currency: "EUR" }));
  }
  const batches = [];
  for (let i = 0; i < n; i += 10)
    batches.push(bodies.slice(i, i + 10));
  let next = 0;
  async function lane() {
    while (next < batches.length) {
      const mine = batches[next++];
      const Entries = mine.map((MessageBody, i) => ({ Id: String(i), MessageBody }));
      const r = await sqs.send(new SendMessageBatchCommand({ QueueUrl: url, Entries }));
      if (r.Failed && r.Failed.length) throw new Error(`send failed: ${JSON.stringify(r.Failed)}`);
    }
  }
  await Promise.all(Array.from({ length: 8 }, lane));
  console.log(n);
}

async function ceiling(url, n) {
  let done = 0;
  const t0 = process.hrtime.bigint();
  async function lane() {
    while (done < n) {
      const r = await sqs.send(new ReceiveMessageCommand({ QueueUrl: url, MaxNumberOfMessages: 10,
        WaitTimeSeconds: 1 }));
      const m = r.Messages || [];
      if (!m.length) continue;
      await sqs.send(new DeleteMessageBatchCommand({ QueueUrl: url,
        Entries: m.map((x, i) => ({ Id: String(i), ReceiptHandle: x.ReceiptHandle })) }));
      done += m.length;
    }
  }
  await Promise.all(Array.from({ length: 8 }, lane));
  console.log(`${Number(process.hrtime.bigint() - t0) / 1e9} ${done}`);
}

async function consume(url, n, dsn) {
  const { Consumer } = require("sqs-consumer");
  const { Pool } = require("pg");
  // a libpq key=value DSN (host=... port=... dbname=... user=...)
  const kv = Object.fromEntries(dsn.trim().split(/\s+/).map((p) => p.split("=", 2)));
  const pool = new Pool({ host: kv.host, port: kv.port ? parseInt(kv.port, 10) : undefined,
    database: kv.dbname, user: kv.user, password: kv.password, max: 10 });
  let handled = 0;
  let t0 = null;
  await new Promise((resolve, reject) => {
    const app = Consumer.create({
      queueUrl: url,
      sqs,
      batchSize: 10,
      waitTimeSeconds: 1,
      handleMessage: async (m) => {
        if (t0 === null) t0 = process.hrtime.bigint();
        const job = JSON.parse(m.Body);
        const db = await pool.connect();
        try {
          await db.query("BEGIN");
          const r = await db.query(
            "INSERT INTO sqsb.keys (key) VALUES ($1) ON CONFLICT DO NOTHING RETURNING key",
            [job.job_id]);
          if (r.rowCount === 1)
            await db.query("INSERT INTO sqsb.effects (key, payload, who) VALUES ($1, $2, 'sqs-consumer')",
              [job.job_id, m.Body]);
          await db.query("COMMIT");
        } catch (e) {
          await db.query("ROLLBACK").catch(() => {});
          throw e;
        } finally {
          db.release();
        }
        if (++handled >= n) {
          app.stop();
          setTimeout(resolve, 1500); // its last deletes
        }
        return m; // acknowledged: sqs-consumer deletes it
      },
    });
    app.on("error", (e) => reject(e));
    app.on("processing_error", (e) => reject(e));
    app.start();
  });
  console.log(`${Number(process.hrtime.bigint() - t0) / 1e9} ${handled}`);
  await pool.end();
}

(async () => {
  if (cmd === "create") {
    const r = await sqs.send(new CreateQueueCommand({ QueueName: a }));
    console.log(r.QueueUrl);
  } else if (cmd === "fill") {
    await fill(a, parseInt(b, 10), c);
  } else if (cmd === "ceiling") {
    await ceiling(a, parseInt(b, 10));
  } else if (cmd === "consume") {
    await consume(a, parseInt(b, 10), c);
  } else {
    console.error("usage: bench_sqs.cjs create|fill|ceiling|consume ...");
    process.exit(2);
  }
})().catch((e) => {
  console.error(e);
  process.exit(1);
});
