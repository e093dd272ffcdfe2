/*
 * Integration tests of tracing, with OpenTelemetry's own parts: a producer
 * instrumented with the JavaScript SDK publishes (its traceparent injected
 * by the W3C propagator); idemq applies the job, whose effect emits a
 * message through the outbox; a downstream consumer, also the SDK,
 * extracts the context of that message. An OTLP/HTTP receiver checks every
 * request idemq exports against OpenTelemetry's protocol definitions
 * (tests/trace/otel.mjs). Asserted end to end: producer -> idemq's process
 * span -> the emitted message -> the downstream consumer. And a collector
 * that is down costs spans (counted), never a job.
 */
#include <check.h>

#include "check_run.h"
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "broker.h"
#include "broker_admin.h"
#include "itest.h"
#include "tprov.h"

#define OTEL_DIR IDEMQ_SOURCE_DIR "/tests/trace"

/* The test effect: emits {key} to the default exchange with the payload's
 * routing key "rk", then records the meta it was given. */
#define EMIT_EFFECT                                                                          \
    "CREATE OR REPLACE FUNCTION idemq_test.trace_emit(p_key text, p_payload jsonb, p_meta "  \
    "jsonb) RETURNS jsonb LANGUAGE plpgsql AS $fn$ DECLARE v_id bigint; BEGIN "               \
    "v_id := idemq.emit('', p_payload->>'rk', jsonb_build_object('key', p_key)::text, NULL, " \
    "NULL, p_key); "                                                                         \
    "INSERT INTO idemq_test.effects (key, payload, meta) VALUES (p_key, p_payload, p_meta); " \
    "RETURN jsonb_build_object('outbox_id', v_id); END $fn$"

static void need_modules(void)
{
    ck_assert_msg(access(OTEL_DIR "/node_modules/@opentelemetry/otlp-transformer", R_OK) == 0,
                  "the tracing test needs tests/trace/node_modules: run scripts/setup");
}

/* Runs `node otel.mjs ARGS` and returns its first output line (JSON), or
 * NULL when it failed. */
static json_t *otel(const char *args)
{
    char cmd[4096], line[1024] = "";
    FILE *p;
    snprintf(cmd, sizeof cmd, "cd '%s' && timeout 60 node otel.mjs %s", OTEL_DIR, args);
    p = popen(cmd, "r");
    ck_assert_ptr_nonnull(p);
    if (!fgets(line, sizeof line, p))
        line[0] = '\0';
    ck_assert_msg(pclose(p) == 0, "node otel.mjs %s failed", args);
    return json_loads(line, 0, NULL);
}

static pid_t start_receiver(int port, const char *out)
{
    char portbuf[16];
    pid_t pid;
    unlink(out);
    snprintf(portbuf, sizeof portbuf, "%d", port);
    pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        if (chdir(OTEL_DIR) != 0)
            _exit(127);
        execlp("node", "node", "otel.mjs", "receive", portbuf, out, (char *)NULL);
        _exit(127);
    }
    /* listening once it has created its output file */
    for (int i = 0; i < itest_ms(15000) / 50 && access(out, F_OK) != 0; i++)
        usleep(50 * 1000);
    ck_assert_msg(access(out, F_OK) == 0, "the OTLP receiver did not start");
    return pid;
}

static void stop_receiver(pid_t pid)
{
    int st;
    kill(pid, SIGTERM);
    st = itest_wait(pid, itest_ms(10000));
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "receiver status 0x%x", st);
}

static const char *attr(json_t *span, const char *key)
{
    size_t i;
    json_t *a;
    json_array_foreach(json_object_get(span, "attributes"), i, a) {
        if (strcmp(json_string_value(json_object_get(a, "key")), key) == 0)
            return json_string_value(json_object_get(json_object_get(a, "value"), "stringValue"));
    }
    return NULL;
}

static json_t *received_spans(const char *out);

/* The span of spans with messaging.operation.type op whose links name the
 * span span_id of trace trace_id, or NULL. */
static json_t *linked(json_t *spans, const char *op, const char *trace_id, const char *span_id)
{
    size_t i, k;
    json_t *sp, *l;
    json_array_foreach(spans, i, sp) {
        const char *o = attr(sp, "messaging.operation.type");
        if (!o || strcmp(o, op) != 0)
            continue;
        json_array_foreach(json_object_get(sp, "links"), k, l) {
            if (strcmp(json_string_value(json_object_get(l, "traceId")), trace_id) == 0 &&
                strcmp(json_string_value(json_object_get(l, "spanId")), span_id) == 0)
                return sp;
        }
    }
    return NULL;
}

START_TEST(test_trace_end_to_end)
{
    struct itest t;
    char conf[512], out[256], q[200], args[2048], body[512];
    int port = itest_free_port();
    json_t *prod, *cons, *mine = NULL, *line;
    FILE *f;
    pid_t recv;
    int invalid = 0, spans = 0;

    need_modules();
    snprintf(conf, sizeof conf,
             "outbox: { relay = 1; poll_ms = 200; };\n"
             "tracing: { endpoint = \"http://127.0.0.1:%d/v1/traces\"; flush_ms = 100; "
             "service_name = \"idemq-test\"; };",
             port);
    itest_extra_conf = conf;
    itest_setup(&t, "trace", "idemq_test.trace_emit", "", "emits = true;");
    itest_extra_conf = NULL;
    itest_sql(&t, EMIT_EFFECT);
    {
        struct broker *b;
        char err[512];
        snprintf(q, sizeof q, "%s.out", t.name);
        ck_assert_msg(broker_open(t.conf, "trace test", false, &b, err, sizeof err) == IDEMQ_OK,
                      "%s", err);
        ck_assert(broker_admin_declare_queue(b, q, NULL, false) == IDEMQ_OK);
        ck_assert(broker_admin_purge(b, q) == IDEMQ_OK);
        broker_close(b);
    }
    snprintf(out, sizeof out, "/tmp/%s.otlp.jsonl", t.name);
    recv = start_receiver(port, out);

    /* the producer: the SDK's span, its context in the headers */
    snprintf(body, sizeof body, "{\"job_id\":\"%s:1\",\"rk\":\"%s\"}", t.name, q);
    snprintf(args, sizeof args, "produce '%s' '%s' '%s' '%s'", getenv("IDEMQ_AMQP_URL"), t.name,
             t.name, body);
    prod = otel(args);
    ck_assert_ptr_nonnull(prod);
    itest_run_until_idle(&t, 1);
    /* the downstream consumer of the emitted message */
    snprintf(args, sizeof args, "consume '%s' '%s'", getenv("IDEMQ_AMQP_URL"), q);
    cons = otel(args);
    ck_assert_ptr_nonnull(cons);
    stop_receiver(recv);

    f = fopen(out, "r");
    ck_assert_ptr_nonnull(f);
    {
        char buf[65536];
        while (fgets(buf, sizeof buf, f)) {
            line = json_loads(buf, 0, NULL);
            ck_assert_msg(line != NULL, "receiver line: %s", buf);
            if (json_object_get(line, "invalid")) {
                fprintf(stderr, "invalid OTLP request: %s\n",
                        json_string_value(json_object_get(line, "invalid")));
                invalid++;
                json_decref(line);
                continue;
            }
            spans++;
            if (strcmp(json_string_value(json_object_get(line, "traceId")),
                       json_string_value(json_object_get(prod, "traceId"))) == 0 &&
                !mine)
                mine = line;
            else
                json_decref(line);
        }
    }
    fclose(f);
    ck_assert_int_eq(invalid, 0);
    ck_assert_int_ge(spans, 1);
    ck_assert_msg(mine != NULL, "no span of the producer's trace was exported");
    /* idemq's process span: a child of the producer's, a consumer span */
    ck_assert_str_eq(json_string_value(json_object_get(mine, "parentSpanId")),
                     json_string_value(json_object_get(prod, "spanId")));
    ck_assert_int_eq(json_integer_value(json_object_get(mine, "kind")), 5);
    ck_assert_str_eq(json_string_value(json_object_get(mine, "service")), "idemq-test");
    ck_assert_str_eq(attr(mine, "messaging.system"), "rabbitmq");
    ck_assert_str_eq(attr(mine, "messaging.operation.type"), "process");
    ck_assert_str_eq(attr(mine, "idemq.outcome"), "applied");
    /* the business key and the routing key are left out */
    ck_assert_ptr_null(attr(mine, "messaging.rabbitmq.destination.routing_key"));
    ck_assert_ptr_null(attr(mine, "idemq.key"));
    {
        char *text = json_dumps(mine, JSON_COMPACT);
        ck_assert_ptr_nonnull(text);
        ck_assert_msg(strstr(text, ":1\"") == NULL, "the key is in the span: %s", text);
        free(text);
    }
    /* the effect saw idemq's span as its parent, and so did the downstream
     * consumer, through the message the effect emitted */
    {
        char want[64];
        snprintf(want, sizeof want, "00-%s-%s-01",
                 json_string_value(json_object_get(prod, "traceId")),
                 json_string_value(json_object_get(mine, "spanId")));
        ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq_test.effects WHERE "
                                        "meta->>'traceparent' = $1", want),
                         1);
    }
    ck_assert_str_eq(json_string_value(json_object_get(cons, "traceId")),
                     json_string_value(json_object_get(prod, "traceId")));
    ck_assert_str_eq(json_string_value(json_object_get(cons, "parentSpanId")),
                     json_string_value(json_object_get(mine, "spanId")));
    /* the batch: a receive span and a settle span (kind CLIENT), each
     * linked to the producer's span; the settle span is the receive span's
     * child, in a trace of their own */
    {
        json_t *all = received_spans(out), *rcv, *stl;
        const char *ptid = json_string_value(json_object_get(prod, "traceId"));
        const char *psid = json_string_value(json_object_get(prod, "spanId"));
        rcv = linked(all, "receive", ptid, psid);
        stl = linked(all, "settle", ptid, psid);
        ck_assert_msg(rcv != NULL, "no receive span linked to the producer's");
        ck_assert_msg(stl != NULL, "no settle span linked to the producer's");
        ck_assert_int_eq(json_integer_value(json_object_get(rcv, "kind")), 3);
        ck_assert_int_eq(json_integer_value(json_object_get(stl, "kind")), 3);
        ck_assert_ptr_null(json_object_get(rcv, "parentSpanId"));
        ck_assert_str_ne(json_string_value(json_object_get(rcv, "traceId")), ptid);
        ck_assert_str_eq(json_string_value(json_object_get(stl, "traceId")),
                         json_string_value(json_object_get(rcv, "traceId")));
        ck_assert_str_eq(json_string_value(json_object_get(stl, "parentSpanId")),
                         json_string_value(json_object_get(rcv, "spanId")));
        ck_assert_str_eq(attr(rcv, "messaging.system"), "rabbitmq");
        ck_assert_str_eq(attr(stl, "messaging.operation.name"), "ack");
        ck_assert_str_eq(attr(rcv, "messaging.destination.name"), t.name);
        json_decref(all);
    }
    json_decref(mine);
    json_decref(prod);
    json_decref(cons);
    unlink(out);
    itest_teardown(&t);
}
END_TEST

/* The spans the receiver wrote to out, as a JSON array; fails the test on
 * a request the protocol definitions refused. */
static json_t *received_spans(const char *out)
{
    json_t *all = json_array(), *line;
    char buf[65536];
    FILE *f = fopen(out, "r");
    ck_assert_ptr_nonnull(f);
    while (fgets(buf, sizeof buf, f)) {
        line = json_loads(buf, 0, NULL);
        ck_assert_msg(line != NULL, "receiver line: %s", buf);
        ck_assert_msg(!json_object_get(line, "invalid"), "invalid OTLP request: %s",
                      json_string_value(json_object_get(line, "invalid")));
        json_array_append_new(all, line);
    }
    fclose(f);
    return all;
}

/* The span of spans whose parent is parent_id, or NULL. */
static json_t *child_of(json_t *spans, const char *trace_id, const char *parent_id)
{
    size_t i;
    json_t *sp;
    json_array_foreach(spans, i, sp) {
        const char *tid = json_string_value(json_object_get(sp, "traceId"));
        const char *pid = json_string_value(json_object_get(sp, "parentSpanId"));
        if (tid && pid && strcmp(tid, trace_id) == 0 && strcmp(pid, parent_id) == 0)
            return sp;
    }
    return NULL;
}

/* A PostgreSQL queue input: the producer (the SDK, node-postgres) enqueues
 * with its context in the transaction's settings; idemq's span of the row
 * is a child of the producer's, the effect's meta continues idemq's span,
 * and the job the effect enqueues is a child of that span in turn. */
START_TEST(test_trace_pg_queue)
{
    struct itest t;
    char conf[512], cfg[300], out[256], args[2048], body[512], want[64];
    int port = itest_free_port();
    json_t *prod, *spans, *a, *b;
    pid_t recv;
    FILE *f;

    need_modules();
    itest_setup(&t, "trace_pg", "idemq_test.record", "", "");
    itest_sql(&t, "CREATE OR REPLACE FUNCTION idemq_test.trace_chain(p_key text, p_payload "
                  "jsonb, p_meta jsonb) RETURNS jsonb LANGUAGE plpgsql AS $fn$ BEGIN "
                  "IF p_payload ? 'next' THEN PERFORM idemq.enqueue(p_payload->>'queue', "
                  "jsonb_build_object('job_id', p_payload->>'next')); END IF; "
                  "RETURN idemq_test.record(p_key, p_payload, p_meta); END $fn$");
    snprintf(conf, sizeof conf,
             "tracing: { endpoint = \"http://127.0.0.1:%d/v1/traces\"; flush_ms = 100; "
             "service_name = \"idemq-test\"; };",
             port);
    snprintf(cfg, sizeof cfg, "/tmp/%s.pg.cfg", t.name);
    f = fopen(cfg, "w");
    ck_assert_ptr_nonnull(f);
    fprintf(f,
            "%s\nconsumer: { id = \"%s\"; };\nlog: { level = \"info\"; };\n"
            "inputs = ( { name = \"%s\"; transport = \"postgres\"; queue = \"%s\";\n"
            "  effect_function = \"idemq_test.trace_chain\"; } );\n",
            conf, t.name, t.name, t.name);
    fclose(f);
    snprintf(out, sizeof out, "/tmp/%s.otlp.jsonl", t.name);
    recv = start_receiver(port, out);

    snprintf(body, sizeof body, "{\"job_id\":\"%s:a\",\"next\":\"%s:b\",\"queue\":\"%s\"}",
             t.name, t.name, t.name);
    snprintf(args, sizeof args, "enqueue '%s' '%s' '%s'", getenv("IDEMQ_PG_DSN"), t.name, body);
    prod = otel(args);
    ck_assert_ptr_nonnull(prod);
    {
        pid_t pid = itest_spawn(NULL, cfg, 1, NULL);
        int st = itest_wait(pid, itest_ms(60000));
        ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "idemq run: 0x%x", st);
    }
    stop_receiver(recv);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq_test.effects WHERE key LIKE "
                                    "$1 || ':%'", t.name),
                     2);
    spans = received_spans(out);
    a = child_of(spans, json_string_value(json_object_get(prod, "traceId")),
                 json_string_value(json_object_get(prod, "spanId")));
    ck_assert_msg(a != NULL, "no span of the enqueued row under the producer's (%zu spans)",
                  json_array_size(spans));
    ck_assert_int_eq(json_integer_value(json_object_get(a, "kind")), 5);
    ck_assert_str_eq(attr(a, "messaging.system"), "postgresql");
    ck_assert_str_eq(attr(a, "messaging.destination.name"), t.name);
    ck_assert_str_eq(attr(a, "idemq.outcome"), "applied");
    /* the effect ran under idemq's span */
    snprintf(want, sizeof want, "00-%s-%s-01", json_string_value(json_object_get(prod, "traceId")),
             json_string_value(json_object_get(a, "spanId")));
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq_test.effects WHERE "
                                    "meta->>'traceparent' = $1", want),
                     1);
    /* the job the effect enqueued continues the trace */
    b = child_of(spans, json_string_value(json_object_get(prod, "traceId")),
                 json_string_value(json_object_get(a, "spanId")));
    ck_assert_msg(b != NULL, "no span of the chained row under idemq's first span");
    ck_assert_str_eq(attr(b, "idemq.outcome"), "applied");
    {
        /* the take: a receive span and a settle span ("delete": the row
         * leaves the table), kind CLIENT, linked to the producer's span;
         * the settle span is the receive span's child */
        const char *ptid = json_string_value(json_object_get(prod, "traceId"));
        const char *psid = json_string_value(json_object_get(prod, "spanId"));
        json_t *rcv = linked(spans, "receive", ptid, psid);
        json_t *stl = linked(spans, "settle", ptid, psid);
        ck_assert_msg(rcv != NULL, "no receive span linked to the producer's");
        ck_assert_msg(stl != NULL, "no settle span linked to the producer's");
        ck_assert_int_eq(json_integer_value(json_object_get(rcv, "kind")), 3);
        ck_assert_str_eq(attr(rcv, "messaging.system"), "postgresql");
        ck_assert_str_eq(attr(rcv, "messaging.destination.name"), t.name);
        ck_assert_str_eq(attr(stl, "messaging.operation.name"), "delete");
        ck_assert_str_eq(json_string_value(json_object_get(stl, "parentSpanId")),
                         json_string_value(json_object_get(rcv, "spanId")));
    }
    {
        /* jobs show names the key's trace (a plain apply: from its batch row) */
        char cmd[300], shown[16384], want_tr[64];
        snprintf(cmd, sizeof cmd, "jobs show '%s:a'", t.name);
        ck_assert_int_eq(itest_idemq(&t, cmd, shown, sizeof shown), 0);
        snprintf(want_tr, sizeof want_tr, "trace %s",
                 json_string_value(json_object_get(prod, "traceId")));
        ck_assert_msg(strstr(shown, want_tr) != NULL, "no %s in: %s", want_tr, shown);
    }
    json_decref(spans);
    json_decref(prod);
    unlink(out);
    unlink(cfg);
    itest_teardown(&t);
}
END_TEST

/* A provider input: each call to the provider is a CLIENT span under
 * idemq's span of the job, with its HTTP status; the job's span is a
 * child of the producer's. */
START_TEST(test_trace_provider_call)
{
    struct itest t;
    struct tprov p;
    char conf[512], input[1024], out[256], body[256];
    const char *tid = "4bf92f3577b34da6a3ce929d0e0e4736", *psid = "00f067aa0ba902b7";
    char tp[64];
    int port = itest_free_port();
    json_t *spans, *job, *call, *h;
    pid_t recv;

    need_modules();
    tprov_start(&p, NULL);
    snprintf(conf, sizeof conf,
             "tracing: { endpoint = \"http://127.0.0.1:%d/v1/traces\"; flush_ms = 100; };",
             port);
    snprintf(input, sizeof input,
             "provider: { url = \"%s\"; path = \"/charges\"; timeout_ms = %d; };", p.url,
             itest_ms(3000));
    itest_extra_conf = conf;
    itest_setup(&t, "trace_prov", "idemq_test.record", "", input);
    itest_extra_conf = NULL;
    snprintf(out, sizeof out, "/tmp/%s.otlp.jsonl", t.name);
    recv = start_receiver(port, out);
    snprintf(tp, sizeof tp, "00-%s-%s-01", tid, psid);
    h = json_pack("{s:s}", "traceparent", tp);
    snprintf(body, sizeof body, "{\"job_id\":\"%s-k1\",\"amount_minor\":500}", t.name);
    itest_publish_to(&t, t.conf->inputs[0].exchange, t.conf->inputs[0].routing_key, body, h,
                     NULL);
    json_decref(h);
    itest_run_until_idle(&t, 3);
    stop_receiver(recv);
    spans = received_spans(out);
    job = child_of(spans, tid, psid);
    ck_assert_msg(job != NULL, "no span of the job under the producer's (%zu spans)",
                  json_array_size(spans));
    ck_assert_str_eq(attr(job, "idemq.outcome"), "applied");
    call = child_of(spans, tid, json_string_value(json_object_get(job, "spanId")));
    ck_assert_msg(call != NULL, "no span of the provider call under the job's");
    ck_assert_int_eq(json_integer_value(json_object_get(call, "kind")), 3);
    ck_assert_str_eq(json_string_value(json_object_get(call, "name")), "POST");
    ck_assert_str_eq(attr(call, "http.request.method"), "POST");
    ck_assert_str_eq(attr(call, "idemq.provider.operation"), "call");
    ck_assert_str_eq(attr(call, "idemq.provider.class"), "success");
    {
        size_t i;
        json_t *a;
        const char *status = NULL;
        json_array_foreach(json_object_get(call, "attributes"), i, a) {
            if (strcmp(json_string_value(json_object_get(a, "key")),
                       "http.response.status_code") == 0)
                status = json_string_value(
                    json_object_get(json_object_get(a, "value"), "intValue"));
        }
        ck_assert_msg(status && (strcmp(status, "200") == 0 || strcmp(status, "201") == 0),
                      "status %s", status ? status : "(none)");
    }
    ck_assert_ptr_null(json_object_get(call, "status"));
    json_decref(spans);
    unlink(out);
    itest_teardown(&t);
    tprov_stop(&p);
}
END_TEST

/* A job parked with a producer's context and then redriven (`idemq
 * redrive`, and `idemq parked redrive` for a group): the span of its
 * applied run continues the producer's trace, a child of the producer's
 * span like the span of the run that parked it. */
START_TEST(test_trace_redrive)
{
    struct itest t;
    char conf[512], out[256], body[256], key[2][160], tp[2][64], args[512], shown[8192];
    const char *tid[2] = {"5bf92f3577b34da6a3ce929d0e0e4736", "6bf92f3577b34da6a3ce929d0e0e4736"};
    const char *psid = "00f067aa0ba902b7";
    int port = itest_free_port();
    json_t *spans, *h, *sp;
    pid_t recv;
    size_t i;

    need_modules();
    snprintf(conf, sizeof conf,
             "tracing: { endpoint = \"http://127.0.0.1:%d/v1/traces\"; flush_ms = 100; };",
             port);
    itest_extra_conf = conf;
    itest_setup(&t, "trace_redrive", "idemq_test.trace_flaky", "", "");
    itest_extra_conf = NULL;
    itest_sql(&t, "CREATE TABLE IF NOT EXISTS idemq_test.trace_broken (test text PRIMARY KEY);"
                  "CREATE OR REPLACE FUNCTION idemq_test.trace_flaky(p_key text, p_payload jsonb,"
                  " p_meta jsonb) RETURNS jsonb LANGUAGE plpgsql AS $fn$ BEGIN"
                  " IF EXISTS (SELECT 1 FROM idemq_test.trace_broken b WHERE b.test ="
                  " p_payload->>'test') THEN RAISE EXCEPTION 'broken' USING ERRCODE = '22023';"
                  " END IF; RETURN idemq_test.record(p_key, p_payload, p_meta); END $fn$;");
    snprintf(args, sizeof args, "INSERT INTO idemq_test.trace_broken VALUES ('%s')", t.name);
    itest_sql(&t, args);
    snprintf(out, sizeof out, "/tmp/%s.otlp.jsonl", t.name);
    recv = start_receiver(port, out);
    for (int k = 0; k < 2; k++) {
        snprintf(key[k], sizeof key[k], "%s:%d", t.name, k);
        snprintf(tp[k], sizeof tp[k], "00-%s-%s-01", tid[k], psid);
        h = json_pack("{s:s}", "traceparent", tp[k]);
        snprintf(body, sizeof body, "{\"job_id\":\"%s\",\"test\":\"%s\"}", key[k], t.name);
        itest_publish_to(&t, t.conf->inputs[0].exchange, t.conf->inputs[0].routing_key, body, h,
                         NULL);
        json_decref(h);
    }
    itest_run_until_idle(&t, 2);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key LIKE $1 || ':%'",
                                t.name),
                     2);
    /* the cause fixed: one key redriven by key, the other by its group */
    snprintf(args, sizeof args, "DELETE FROM idemq_test.trace_broken WHERE test = '%s'", t.name);
    itest_sql(&t, args);
    snprintf(args, sizeof args, "redrive --key '%s'", key[0]);
    ck_assert_msg(itest_idemq(&t, args, shown, sizeof shown) == 0, "%s", shown);
    {
        char grp[16];
        itest_text(&t,
                   "SELECT idemq.park_group(source_queue, error_class, error_code, sqlstate,"
                   " reason, key) FROM idemq.parked WHERE key = $1",
                   key[1], grp, sizeof grp);
        snprintf(args, sizeof args, "parked redrive --group %s --reason fixed", grp);
        ck_assert_msg(itest_idemq(&t, args, shown, sizeof shown) == 0, "%s", shown);
    }
    itest_run_until_idle(&t, 2);
    for (int k = 0; k < 2; k++)
        ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq_test.effects WHERE key = $1",
                                    key[k]),
                         1);
    stop_receiver(recv);
    spans = received_spans(out);
    for (int k = 0; k < 2; k++) {
        int parked = 0, applied = 0;
        json_array_foreach(spans, i, sp) {
            const char *o = attr(sp, "idemq.outcome");
            const char *pid = json_string_value(json_object_get(sp, "parentSpanId"));
            if (strcmp(json_string_value(json_object_get(sp, "traceId")), tid[k]) != 0 || !o)
                continue;
            ck_assert_msg(pid && strcmp(pid, psid) == 0, "a span of %s not under the producer's",
                          key[k]);
            parked += strcmp(o, "parked") == 0;
            applied += strcmp(o, "applied") == 0;
        }
        ck_assert_msg(parked == 1 && applied == 1, "%s: %d parked and %d applied spans (%zu spans)",
                      key[k], parked, applied, json_array_size(spans));
    }
    /* the effect of the redriven run saw the producer's trace */
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq_test.effects WHERE key LIKE $1 ||"
                                    " ':%' AND substr(meta->>'traceparent', 4, 32) IN"
                                    " ('5bf92f3577b34da6a3ce929d0e0e4736',"
                                    " '6bf92f3577b34da6a3ce929d0e0e4736')",
                                t.name),
                     2);
    json_decref(spans);
    unlink(out);
    itest_teardown(&t);
}
END_TEST

/* A collector that is down: every job is applied, the spans are counted as
 * failed, and the run ends on time. */
START_TEST(test_collector_down)
{
    struct itest t;
    char conf[300], log[300], body[20][128];
    const char *bodies[20];
    int port = itest_free_port(), st;
    snprintf(conf, sizeof conf,
             "tracing: { endpoint = \"http://127.0.0.1:%d/v1/traces\"; flush_ms = 50; "
             "timeout_ms = 200; batch_max = 4; };",
             port);
    itest_extra_conf = conf;
    itest_setup(&t, "trace_down", "idemq_test.record", "", "");
    itest_extra_conf = NULL;
    for (int i = 0; i < 20; i++) {
        snprintf(body[i], sizeof body[i], "{\"job_id\":\"%s:%d\"}", t.name, i);
        bodies[i] = body[i];
    }
    itest_publish(&t, bodies, 20);
    snprintf(log, sizeof log, "/tmp/%s.log", t.name);
    st = itest_wait(itest_spawn_log(t.cfg_path, 1, NULL, log), itest_ms(30000));
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "status 0x%x (log %s)", st,
                  log);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq_test.effects WHERE key LIKE "
                                    "$1 || ':%'", t.name),
                     20);
    /* 20 process spans, and a receive and a settle span per batch */
    {
        char line[512] = "";
        FILE *f = fopen(log, "r");
        long failed = -1;
        const char *p;
        ck_assert_ptr_nonnull(f);
        while (fgets(line, sizeof line, f))
            if ((p = strstr(line, "tracing: spans exported 0, dropped 0 (queue full), failed ")))
                failed = atol(p + strlen("tracing: spans exported 0, dropped 0 (queue full), "
                                         "failed "));
        fclose(f);
        ck_assert_msg(failed >= 22 && failed <= 60 && failed % 2 == 0,
                      "span summary: %ld failed (log %s)", failed, log);
    }
    ck_assert_msg(itest_count_lines(log, "the collector did not take") == 1, "log %s", log);
    unlink(log);
    itest_teardown(&t);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("tracing");
    TCase *tc = tcase_create("tracing");
    tcase_set_timeout(tc, itest_ms(180));
    tcase_add_test(tc, test_trace_end_to_end);
    tcase_add_test(tc, test_trace_pg_queue);
    tcase_add_test(tc, test_trace_provider_call);
    tcase_add_test(tc, test_trace_redrive);
    tcase_add_test(tc, test_collector_down);
    suite_add_tcase(s, tc);
    return check_run(s);
}
