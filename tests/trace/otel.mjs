// The OpenTelemetry side of idemq's tracing test (check_tracing.c):
//   receive PORT OUT   an OTLP/HTTP JSON receiver: every request is checked
//                      against OpenTelemetry's protocol definitions (the
//                      protobufjs code generated from opentelemetry-proto,
//                      shipped in @opentelemetry/otlp-transformer 0.52);
//                      each span is appended to OUT as a JSON line, each
//                      request that fails the check as {"invalid": why}
//   produce URL EXCHANGE ROUTING_KEY BODY
//                      publishes BODY under a PRODUCER span of the SDK, its
//                      context injected by the W3C propagator; prints
//                      {"traceId", "spanId"} of that span
//   enqueue DSN QUEUE BODY
//                      enqueues BODY into a PostgreSQL queue input with
//                      node-postgres under a PRODUCER span, its context
//                      injected by the W3C propagator into the settings
//                      idemq.traceparent and idemq.tracestate of the
//                      enqueuing transaction; prints {"traceId", "spanId"}
//   consume URL QUEUE  takes one message, extracts its context with the W3C
//                      propagator and starts a CONSUMER span under it;
//                      prints {"traceId", "parentSpanId", "spanId"}
import { createRequire } from 'node:module';
import fs from 'node:fs';
import http from 'node:http';
import assert from 'node:assert';
import amqp from 'amqplib';
import pg from 'pg';
import api from '@opentelemetry/api';
import { W3CTraceContextPropagator } from '@opentelemetry/core';
import { BasicTracerProvider, InMemorySpanExporter, SimpleSpanProcessor } from '@opentelemetry/sdk-trace-base';

const require = createRequire(import.meta.url);
const root = require('@opentelemetry/otlp-transformer/build/src/generated/root.js');
const Req = root.opentelemetry.proto.collector.trace.v1.ExportTraceServiceRequest;

const propagator = new W3CTraceContextPropagator();
const getter = { keys: (c) => Object.keys(c), get: (c, k) => (c[k] === undefined ? undefined : String(c[k])) };

function tracer() {
  const exporter = new InMemorySpanExporter();
  const provider = new BasicTracerProvider();
  provider.addSpanProcessor(new SimpleSpanProcessor(exporter));
  return provider.getTracer('idemq-test');
}

// OTLP JSON -> the protobuf JSON mapping protobufjs reads: ids are hex in
// OTLP JSON, base64 for protobuf bytes; everything else is the same.
const ID_FIELDS = new Set(['traceId', 'spanId', 'parentSpanId']);
function toProto(v, key) {
  if (Array.isArray(v)) return v.map((x) => toProto(x));
  if (v && typeof v === 'object') {
    const o = {};
    for (const [k, x] of Object.entries(v)) o[k] = toProto(x, k);
    return o;
  }
  if (ID_FIELDS.has(key)) {
    assert.match(v, /^[0-9a-f]*$/, `${key} is not lowercase hex: ${v}`);
    return Buffer.from(v, 'hex').toString('base64');
  }
  return v;
}
// What protobufjs leaves out of toObject({defaults: false}): default values.
function strip(v) {
  if (Array.isArray(v)) return v.map(strip);
  if (v && typeof v === 'object') {
    const o = {};
    for (const [k, x] of Object.entries(v)) {
      const s = strip(x);
      if (s === 0 || s === '' || s === '0' || s === false) continue;
      o[k] = s;
    }
    return o;
  }
  return v;
}

function check(body) {
  const req = toProto(JSON.parse(body));
  // fromObject reads the JSON mapping (64-bit integers as strings too);
  // verify then checks every field's type against the definitions
  const msg = Req.fromObject(req);
  const err = Req.verify(msg);
  if (err) throw new Error(`not an ExportTraceServiceRequest: ${err}`);
  const back = Req.toObject(Req.decode(Req.encode(msg).finish()),
                            { longs: String, enums: Number, bytes: String, defaults: false });
  // a field the definitions do not have (a misspelt name) is lost on the
  // way through: what came must be what the definitions keep
  assert.deepStrictEqual(back, strip(req));
  return JSON.parse(body);
}

async function receive(port, out) {
  const server = http.createServer((q, r) => {
    const chunks = [];
    q.on('data', (c) => chunks.push(c));
    q.on('end', () => {
      let lines = '';
      try {
        if (q.method !== 'POST' || q.url !== '/v1/traces') throw new Error(`${q.method} ${q.url}`);
        if (!/^application\/json/.test(q.headers['content-type'] || ''))
          throw new Error(`content-type ${q.headers['content-type']}`);
        const req = check(Buffer.concat(chunks).toString('utf8'));
        for (const rs of req.resourceSpans)
          for (const ss of rs.scopeSpans)
            for (const sp of ss.spans)
              lines += JSON.stringify({ service: rs.resource.attributes.find((a) => a.key === 'service.name')?.value?.stringValue, ...sp }) + '\n';
      } catch (e) {
        lines = JSON.stringify({ invalid: String(e.message || e).slice(0, 2000) }) + '\n';
      }
      fs.appendFileSync(out, lines);
      r.writeHead(200, { 'Content-Type': 'application/json' });
      r.end('{}');
    });
  });
  server.listen(port, '127.0.0.1', () => fs.appendFileSync(out, ''));
  process.on('SIGTERM', () => server.close(() => process.exit(0)));
}

async function produce(url, exchange, rk, body) {
  const t = tracer();
  const span = t.startSpan(`publish ${exchange}`, { kind: api.SpanKind.PRODUCER });
  const headers = {};
  propagator.inject(api.trace.setSpan(api.context.active(), span), headers, api.defaultTextMapSetter);
  const conn = await amqp.connect(url);
  const ch = await conn.createConfirmChannel();
  ch.publish(exchange, rk, Buffer.from(body), { headers, persistent: true, contentType: 'application/json' });
  await ch.waitForConfirms();
  span.end();
  await conn.close();
  const c = span.spanContext();
  console.log(JSON.stringify({ traceId: c.traceId, spanId: c.spanId }));
}

// libpq's "key=value ..." (values without spaces or quotes) as node-postgres's config
function pgConfig(dsn) {
  const kv = Object.fromEntries(dsn.trim().split(/\s+/).map((p) => {
    const i = p.indexOf('=');
    return [p.slice(0, i), p.slice(i + 1)];
  }));
  return { host: kv.host, port: Number(kv.port || 5432), database: kv.dbname, user: kv.user, password: kv.password };
}

async function enqueue(dsn, queue, body) {
  const t = tracer();
  const span = t.startSpan(`publish ${queue}`, { kind: api.SpanKind.PRODUCER });
  const carrier = {};
  propagator.inject(api.trace.setSpan(api.context.active(), span), carrier, api.defaultTextMapSetter);
  assert.ok(carrier.traceparent, 'the propagator injected no traceparent');
  const db = new pg.Client(pgConfig(dsn));
  await db.connect();
  await db.query('BEGIN');
  await db.query("SELECT set_config('idemq.traceparent', $1, true), set_config('idemq.tracestate', $2, true)",
                 [carrier.traceparent, carrier.tracestate || '']);
  await db.query('SELECT idemq.enqueue($1, $2::jsonb)', [queue, body]);
  await db.query('COMMIT');
  await db.end();
  span.end();
  const c = span.spanContext();
  console.log(JSON.stringify({ traceId: c.traceId, spanId: c.spanId }));
}

async function consume(url, queue) {
  const conn = await amqp.connect(url);
  const ch = await conn.createChannel();
  const m = await ch.get(queue, { noAck: true });
  await conn.close();
  if (!m) throw new Error(`no message on ${queue}`);
  const ctx = propagator.extract(api.context.active(), m.properties.headers || {}, getter);
  const parent = api.trace.getSpanContext(ctx);
  const span = tracer().startSpan(`consume ${queue}`, { kind: api.SpanKind.CONSUMER }, ctx);
  span.end();
  const c = span.spanContext();
  console.log(JSON.stringify({ traceId: c.traceId, parentSpanId: parent ? parent.spanId : '', spanId: c.spanId }));
}

const [cmd, ...args] = process.argv.slice(2);
const run = { receive: () => receive(Number(args[0]), args[1]), produce: () => produce(...args), enqueue: () => enqueue(...args), consume: () => consume(...args) }[cmd];
if (!run) {
  console.error('usage: otel.mjs receive PORT OUT | produce URL EXCHANGE RK BODY | enqueue DSN QUEUE BODY | consume URL QUEUE');
  process.exit(2);
}
run().catch((e) => { console.error(String(e.stack || e)); process.exit(1); });
