/*
 * Integration tests of the transactional outbox: rows written by
 * idemq.emit in an effect or in an application's own transaction are
 * relayed once they committed (right after the commit, or by the recovery
 * poll), with a deterministic message_id, per order key in commit order;
 * unroutable rows are parked; a rolled-back transaction emits nothing; a
 * crash between commit and publish is made good by the recovery poll. Real
 * RabbitMQ and PostgreSQL (see itest.h).
 */
#include <check.h>

#include "check_run.h"
#include <libpq-fe.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "broker.h"
#include "broker_admin.h"
#include "itest.h"
#include "job.h"

/* The test effect: emits {key, payload} to the payload's exchange "ex" (the
 * default exchange without it) with the payload's routing key "rk" (and
 * order key "ok"), then obeys the test
 * switches (a raise rolls the emit back with the job's subtransaction). */
#define EMIT_EFFECT                                                                          \
    "CREATE OR REPLACE FUNCTION idemq_test.emit_one(p_key text, p_payload jsonb, p_meta "    \
    "jsonb) RETURNS jsonb LANGUAGE plpgsql AS $fn$ DECLARE v_id bigint; BEGIN "               \
    "v_id := idemq.emit(coalesce(p_payload->>'ex', ''), p_payload->>'rk', jsonb_build_object('key', p_key)::text, "      \
    "jsonb_build_object('x-test', 'yes'), p_payload->>'ok', p_key); "                        \
    "PERFORM idemq_test.switches(p_key, p_payload, p_meta); "                                \
    "RETURN jsonb_build_object('outbox_id', v_id); END $fn$"

/* Every outbox row, sent (moved to idemq.outbox_sent, migration 0017) or
 * not (idemq.outbox). */
#define OB_ALL                                                                               \
    "(SELECT id, key, routing_key, order_key, body, commit_seq, 'sent'::text AS state, "     \
    "sent_at FROM idemq.outbox_sent UNION ALL SELECT id, key, routing_key, order_key, body, " \
    "commit_seq, state, sent_at FROM idemq.outbox)"
#define OUTBOX_CONF "outbox: { relay = 1; poll_ms = 200; max_attempts = 2; };"

static void setup(struct itest *t, const char *tag, const char *extra_input)
{
    itest_extra_conf = OUTBOX_CONF;
    itest_setup(t, tag, "idemq_test.emit_one", "", extra_input);
    itest_extra_conf = NULL;
    itest_sql(t, EMIT_EFFECT);
}

/* Where the tests that also run as the deployment's roles emit: "" (the
 * default exchange), or in least-privilege mode a direct exchange
 * <name>.ex bound to <name>.out, which the run user may write (it may not
 * write amq.default). Set by declare_out. */
static char out_ex[200];

/* A fresh durable queue <name>.out (the default exchange routes to it). */
static void declare_out(struct itest *t, char *q, size_t len)
{
    struct broker *b;
    char err[512];
    snprintf(q, len, "%s.out", t->name);
    ck_assert_msg(broker_open(t->conf, "outbox test", false, &b, err, sizeof err) == IDEMQ_OK,
                  "%s", err);
    ck_assert(broker_admin_declare_queue(b, q, NULL, false) == IDEMQ_OK);
    ck_assert(broker_admin_purge(b, q) == IDEMQ_OK);
    out_ex[0] = '\0';
    if (itest_lp()) {
        snprintf(out_ex, sizeof out_ex, "%s.ex", t->name);
        ck_assert(broker_admin_declare_exchange(b, out_ex, "direct", false, NULL) == IDEMQ_OK);
        ck_assert(broker_admin_bind(b, q, out_ex, q, NULL) == IDEMQ_OK);
        itest_lp_permit_emit(out_ex);
    }
    broker_close(b);
}

/* Takes every message of queue q (auto-ack) into bodies/ids (at most max). */
static int drain(struct itest *t, const char *q, char bodies[][256], char ids[][64],
                 char keys[][128], int max)
{
    struct broker *b;
    struct job j;
    char err[512];
    int n = 0;
    ck_assert_msg(broker_open(t->conf, "outbox test", false, &b, err, sizeof err) == IDEMQ_OK,
                  "%s", err);
    job_init(&j);
    while (n < max && broker_get(b, q, &j, true) == IDEMQ_OK) {
        json_t *k = json_object_get(j.headers, "x-idemq-key");
        snprintf(bodies[n], 256, "%.*s", (int)j.body_len, (const char *)j.body);
        snprintf(ids[n], 64, "%s", j.has_message_id ? j.message_id : "");
        snprintf(keys[n], 128, "%s", json_is_string(k) ? json_string_value(k) : "");
        n++;
        job_reset(&j);
    }
    job_destroy(&j);
    broker_close(b);
    return n;
}

/* Polls until sql (one text param) returns want, for up to ms. */
static void wait_long(struct itest *t, const char *sql, const char *p, long want, int ms)
{
    for (int i = 0; i < itest_ms(ms) / 50; i++) {
        if (itest_long(t, sql, p) == want)
            return;
        usleep(50000);
    }
    ck_abort_msg("%s (%s) did not reach %ld", sql, p, want);
}

static PGconn *connect_db_dsn(const char *dsn)
{
    PGconn *db = PQconnectdb(dsn);
    ck_assert_msg(PQstatus(db) == CONNECTION_OK, "%s", PQerrorMessage(db));
    return db;
}

static PGconn *connect_db(void)
{
    return connect_db_dsn(getenv("IDEMQ_PG_DSN"));
}

static void exec_ok(PGconn *db, const char *sql)
{
    PGresult *r = PQexec(db, sql);
    ck_assert_msg(PQresultStatus(r) == PGRES_COMMAND_OK || PQresultStatus(r) == PGRES_TUPLES_OK,
                  "%s: %s", sql, PQerrorMessage(db));
    PQclear(r);
}

/* An effect that emits: the message arrives once (a duplicate delivery of
 * the key emits nothing more) with message_id outbox:<id> and the key in
 * x-idemq-key; a job whose effect fails after emitting emits nothing. */
START_TEST(test_effect_emits_once)
{
    struct itest t;
    char q[200], b[3][512], bodies[4][256], ids[4][64], keys[4][128], want[64], key[128];
    const char *bs[3] = {b[0], b[1], b[2]};
    int n;

    setup(&t, "obemit", "emits = true;");
    declare_out(&t, q, sizeof q);
    snprintf(key, sizeof key, "%s:a", t.name);
    snprintf(b[0], sizeof b[0], "{\"job_id\":\"%s\",\"rk\":\"%s\",\"ex\":\"%s\"}", key, q,
             out_ex);
    snprintf(b[1], sizeof b[1], "{\"job_id\":\"%s\",\"rk\":\"%s\",\"ex\":\"%s\"}", key, q,
             out_ex);
    snprintf(b[2], sizeof b[2],
             "{\"job_id\":\"%s:bad\",\"rk\":\"%s\",\"ex\":\"%s\",\"raise\":\"IP001\"}", t.name, q,
             out_ex);
    itest_publish(&t, bs, 3);
    itest_run_until_idle(&t, 1);

    n = drain(&t, q, bodies, ids, keys, 4);
    ck_assert_int_eq(n, 1);
    snprintf(want, sizeof want, "outbox:%ld",
             itest_long(&t, "SELECT id FROM " OB_ALL " o WHERE key = $1", key));
    ck_assert_str_eq(ids[0], want);
    ck_assert_str_eq(keys[0], key);
    ck_assert_ptr_nonnull(strstr(bodies[0], key));
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM " OB_ALL " o WHERE key = $1 AND "
                                    "state = 'sent' AND sent_at IS NOT NULL",
                                key),
                     1);
    /* the failed job's emit rolled back with it */
    snprintf(key, sizeof key, "%s:bad", t.name);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1", key), 1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM " OB_ALL " o WHERE key = $1", key), 0);
    itest_teardown(&t);
}
END_TEST

/* The producer's W3C trace context continues downstream: a job published
 * with a valid traceparent (and tracestate) emits a message carrying the
 * same; in the same batch, a job with a malformed traceparent (upper-case
 * hex) and one with none emit messages with no trace context (the first
 * job's does not leak into them), and all three apply. */
START_TEST(test_trace_context_continues)
{
    struct itest t;
    struct broker *b;
    struct job j;
    char q[200], body[512], key[3][128], err[512];
    const char *tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    const char *bad = "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01";
    int n = 0, traced = 0, plain = 0;

    setup(&t, "obtrace", "emits = true;");
    declare_out(&t, q, sizeof q);
    for (int i = 0; i < 3; i++) {
        json_t *h = i == 0   ? json_pack("{s:s, s:s}", "traceparent", tp, "tracestate", "rojo=1")
                    : i == 1 ? json_pack("{s:s}", "traceparent", bad)
                             : NULL;
        snprintf(key[i], sizeof key[i], "%s:%d", t.name, i);
        snprintf(body, sizeof body, "{\"job_id\":\"%s\",\"rk\":\"%s\",\"ex\":\"%s\"}",
                 key[i], q, out_ex);
        itest_publish_to(&t, t.name, t.name, body, h, NULL);
        json_decref(h);
    }
    itest_run_until_idle(&t, 1);

    ck_assert_msg(broker_open(t.conf, "outbox test", false, &b, err, sizeof err) == IDEMQ_OK,
                  "%s", err);
    job_init(&j);
    while (n < 4 && broker_get(b, q, &j, true) == IDEMQ_OK) {
        json_t *k = json_object_get(j.headers, "x-idemq-key");
        json_t *p = json_object_get(j.headers, "traceparent");
        json_t *st = json_object_get(j.headers, "tracestate");
        ck_assert(json_is_string(k));
        if (strcmp(json_string_value(k), key[0]) == 0) {
            ck_assert_msg(json_is_string(p) && strcmp(json_string_value(p), tp) == 0 &&
                              json_is_string(st) && strcmp(json_string_value(st), "rojo=1") == 0,
                          "the first job's message lost its trace context");
            traced++;
        } else {
            ck_assert_msg(!p && !st, "%s carries a trace context", json_string_value(k));
            plain++;
        }
        n++;
        job_reset(&j);
    }
    job_destroy(&j);
    broker_close(b);
    ck_assert_int_eq(traced, 1);
    ck_assert_int_eq(plain, 2);
    itest_teardown(&t);
}
END_TEST

/* A rolled-back application transaction emits nothing; a committed one
 * (plain SQL, no idemq effect) is relayed by the recovery poll. */
START_TEST(test_application_emit)
{
    struct itest t;
    char q[200], sql[512], bodies[4][256], ids[4][64], keys[4][128];

    setup(&t, "obapp", "");
    declare_out(&t, q, sizeof q);
    snprintf(sql, sizeof sql,
             "BEGIN; SELECT idemq.emit('%s', '%s', 'rolled back'); ROLLBACK; "
             "BEGIN; SELECT idemq.emit('%s', '%s', 'committed', NULL, NULL, '%s:app'); COMMIT",
             out_ex, q, out_ex, q, t.name);
    itest_sql(&t, sql);
    itest_run_until_idle(&t, 1);
    ck_assert_int_eq(drain(&t, q, bodies, ids, keys, 4), 1);
    ck_assert_str_eq(bodies[0], "committed");
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM " OB_ALL " o WHERE routing_key = $1 "
                                    "AND state = 'sent'",
                                q),
                     1);
    itest_teardown(&t);
}
END_TEST

/* Commit order per order key: transaction A emits first (smaller id) but
 * commits after B; a relay that is running meanwhile publishes B while A
 * is still open (no stall behind it) and A after it commits: B, A, then C.
 * Nothing skipped. */
START_TEST(test_commit_order)
{
    struct itest t;
    char q[200], sql[512], ok[128], bodies[4][256], ids[4][64], keys[4][128];
    PGconn *a, *bconn;
    pid_t pid;
    int st;

    setup(&t, "oborder", "");
    declare_out(&t, q, sizeof q);
    a = connect_db();
    bconn = connect_db();
    /* first both commit (B, then A) before any relay runs: order by commit */
    snprintf(ok, sizeof ok, "%s:first", t.name);
    exec_ok(a, "BEGIN");
    snprintf(sql, sizeof sql, "SELECT idemq.emit('', '%s', 'A0', NULL, '%s')", q, ok);
    exec_ok(a, sql);
    snprintf(sql, sizeof sql, "SELECT idemq.emit('', '%s', 'B0', NULL, '%s')", q, ok);
    exec_ok(bconn, sql);
    exec_ok(a, "COMMIT");
    itest_run_until_idle(&t, 1);
    ck_assert_int_eq(drain(&t, q, bodies, ids, keys, 4), 2);
    ck_assert_str_eq(bodies[0], "B0");
    ck_assert_str_eq(bodies[1], "A0");
    /* then with the relay running */
    snprintf(ok, sizeof ok, "%s:k", t.name);
    pid = itest_spawn(&t, t.cfg_path, 4, NULL);
    exec_ok(a, "BEGIN");
    snprintf(sql, sizeof sql, "SELECT idemq.emit('', '%s', 'A', NULL, '%s')", q, ok);
    exec_ok(a, sql);
    exec_ok(bconn, "BEGIN");
    snprintf(sql, sizeof sql, "SELECT idemq.emit('', '%s', 'B', NULL, '%s')", q, ok);
    exec_ok(bconn, sql);
    exec_ok(bconn, "COMMIT");
    /* B is relayed while A is still open */
    wait_long(&t, "SELECT count(*) FROM " OB_ALL " o WHERE order_key = $1 AND state = 'sent'",
              ok, 1, 3000);
    exec_ok(a, "COMMIT");
    snprintf(sql, sizeof sql, "SELECT idemq.emit('', '%s', 'C', NULL, '%s')", q, ok);
    exec_ok(bconn, sql);
    wait_long(&t, "SELECT count(*) FROM " OB_ALL " o WHERE order_key = $1 AND state = 'sent'",
              ok, 3, 3000);
    PQfinish(a);
    PQfinish(bconn);
    st = itest_wait(pid, itest_ms(30000));
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "status 0x%x", st);
    ck_assert_int_eq(drain(&t, q, bodies, ids, keys, 4), 3);
    ck_assert_str_eq(bodies[0], "B");
    ck_assert_str_eq(bodies[1], "A");
    ck_assert_str_eq(bodies[2], "C");
    /* A has the smaller id: an "id > last seen" relay would have lost or reordered it */
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM " OB_ALL " a, " OB_ALL " b "
                                    "WHERE a.order_key = $1 AND b.order_key = $1 AND "
                                    "convert_from(a.body, 'UTF8') = 'A' AND "
                                    "convert_from(b.body, 'UTF8') = 'B' AND a.id < b.id AND "
                                    "a.commit_seq > b.commit_seq",
                                ok),
                     1);
    itest_teardown(&t);
}
END_TEST

/* Unroutable (mandatory, no queue) -> parked at once with its story; a
 * missing exchange -> parked after outbox.max_attempts; the next row of
 * the same order key is not held behind a parked one. */
START_TEST(test_unroutable_parked)
{
    struct itest t;
    char q[200], sql[768], ok[128], bodies[4][256], ids[4][64], keys[4][128];

    setup(&t, "obpark", "");
    declare_out(&t, q, sizeof q);
    snprintf(ok, sizeof ok, "%s:k", t.name);
    snprintf(sql, sizeof sql,
             "SELECT idemq.emit('', '%s.nowhere', 'lost', NULL, '%s', '%s:lost'); "
             "SELECT idemq.emit('%s.noexchange', 'x', 'nox', NULL, NULL, '%s:nox'); "
             "SELECT idemq.emit('', '%s', 'next', NULL, '%s')",
             t.name, ok, t.name, t.name, t.name, q, ok);
    itest_sql(&t, sql);
    itest_run_until_idle(&t, 3);
    ck_assert_int_eq(drain(&t, q, bodies, ids, keys, 4), 1);
    ck_assert_str_eq(bodies[0], "next");
    snprintf(sql, sizeof sql, "%s:lost", t.name);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.outbox WHERE key = $1 AND "
                                    "state = 'parked' AND attempts = 1 AND "
                                    "last_error LIKE '%returned as unroutable%'",
                                sql),
                     1);
    snprintf(sql, sizeof sql, "%s:nox", t.name);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.outbox WHERE key = $1 AND "
                                    "state = 'parked' AND attempts = 2 AND "
                                    "last_error LIKE '%NOT_FOUND%'",
                                sql),
                     1);
    /* the story: in `jobs show` of the emitting key and in `parked list` */
    {
        char args[300], out[16384];
        snprintf(args, sizeof args, "jobs show %s:lost", t.name);
        ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 0);
        ck_assert_msg(strstr(out, "outbox") && strstr(out, " parked: ") &&
                          strstr(out, "returned as unroutable"),
                      "%s", out);
        snprintf(args, sizeof args, "parked list --key %s:nox", t.name);
        ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 0);
        ck_assert_msg(strstr(out, "outbox rows parked") && strstr(out, "NOT_FOUND") &&
                          strstr(out, " outbox=1"),
                      "%s", out);
        /* and in `parked groups`, by exchange and reason */
        snprintf(args, sizeof args, "parked groups --key %s:nox", t.name);
        ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 0);
        ck_assert_msg(strstr(out, "outbox exchange ") && strstr(out, ": 1 row parked\n") &&
                          strstr(out, "NOT_FOUND") && strstr(out, "1 outbox row parked"),
                      "%s", out);
    }
    itest_teardown(&t);
}
END_TEST

/* One claimed batch with a returned row and a nacked row in the middle
 * (rows of four order keys and one without, one transaction): the batch's
 * publishes are confirmed together, the returned row is parked at once,
 * the nacked one (a full queue with x-overflow=reject-publish) after
 * outbox.max_attempts, every other row is sent; the row after each
 * refused one in its order key is sent only once that one is parked, and
 * a key's two rows arrive in commit order. */
START_TEST(test_batch_refused_middle)
{
    struct itest t;
    char q[200], full[220], sql[2048], k[4][160], bodies[8][256], ids[8][64], keys[8][128];
    struct broker *b;
    char err[512];
    json_t *args;
    int n, pos_a1 = -1, pos_a2 = -1;

    setup(&t, "obbatch", "");
    declare_out(&t, q, sizeof q);
    snprintf(full, sizeof full, "%s.full", t.name);
    ck_assert_msg(broker_open(t.conf, "outbox test", true, &b, err, sizeof err) == IDEMQ_OK,
                  "%s", err);
    args = json_pack("{s:i, s:s}", "x-max-length", 1, "x-overflow", "reject-publish");
    ck_assert(broker_admin_declare_queue(b, full, args, false) == IDEMQ_OK);
    json_decref(args);
    ck_assert(broker_admin_purge(b, full) == IDEMQ_OK);
    ck_assert(broker_publish(b, "", full, "filler", 6, NULL) == IDEMQ_OK);
    ck_assert_msg(broker_wait_confirms(b, 5000) == IDEMQ_OK, "%s", broker_error(b));
    broker_close(b);
    for (int i = 0; i < 4; i++)
        snprintf(k[i], sizeof k[i], "%s:k%d", t.name, i);
    snprintf(sql, sizeof sql,
             "BEGIN; "
             "SELECT idemq.emit('', '%s', 'A1', NULL, '%s'); "        /* k0 */
             "SELECT idemq.emit('', '%s.nowhere', 'R', NULL, '%s'); " /* k1: returned */
             "SELECT idemq.emit('', '%s', 'N', NULL, '%s'); "         /* k2: nacked */
             "SELECT idemq.emit('', '%s', 'B'); "                     /* no order key */
             "SELECT idemq.emit('', '%s', 'D1', NULL, '%s'); "        /* k3 */
             "SELECT idemq.emit('', '%s', 'R2', NULL, '%s'); "        /* k1, after R */
             "SELECT idemq.emit('', '%s', 'N2', NULL, '%s'); "        /* k2, after N */
             "SELECT idemq.emit('', '%s', 'A2', NULL, '%s'); "        /* k0, after A1 */
             "COMMIT",
             q, k[0], t.name, k[1], full, k[2], q, q, k[3], q, k[1], q, k[2], q, k[0]);
    itest_sql(&t, sql);
    itest_run_until_idle(&t, 3);

    n = drain(&t, q, bodies, ids, keys, 8);
    ck_assert_int_eq(n, 6);
    for (int i = 0; i < n; i++) {
        if (strcmp(bodies[i], "A1") == 0)
            pos_a1 = i;
        if (strcmp(bodies[i], "A2") == 0)
            pos_a2 = i;
    }
    ck_assert_msg(pos_a1 >= 0 && pos_a2 > pos_a1, "A1 at %d, A2 at %d", pos_a1, pos_a2);
    ck_assert_int_eq(itest_queue_ready(&t, full), 1); /* the filler only: N was refused */
    /* the returned row: parked at once; the nacked one after max_attempts (2) */
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.outbox WHERE order_key = $1 "
                                    "AND state = 'parked' AND attempts = 1 AND "
                                    "last_error LIKE '%returned as unroutable%' AND "
                                    "convert_from(body, 'UTF8') = 'R'",
                                k[1]),
                     1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.outbox WHERE order_key = $1 "
                                    "AND state = 'parked' AND attempts = 2 AND "
                                    "last_error LIKE '%nacked%' AND "
                                    "convert_from(body, 'UTF8') = 'N'",
                                k[2]),
                     1);
    /* everything else sent, nothing left pending */
    snprintf(sql, sizeof sql, "%s:%%", t.name);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.outbox_sent WHERE routing_key = "
                                    "$1",
                                q),
                     6);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.outbox WHERE state = 'pending' "
                                    "AND (order_key LIKE $1 OR order_key IS NULL)",
                                sql),
                     0);
    /* the next row of a refused row's key went only after it was parked */
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.outbox p "
                                    "JOIN idemq.outbox_sent s ON s.order_key = p.order_key "
                                    "WHERE p.order_key LIKE $1 AND p.state = 'parked' AND "
                                    "s.commit_seq > p.commit_seq AND s.sent_at > p.parked_at",
                                sql),
                     2);
    itest_teardown(&t);
}
END_TEST

/* SIGKILL after the effect transaction committed, before the relay
 * published: the next run's recovery poll relays the row once (the
 * redelivered job is a duplicate and emits nothing). */
START_TEST(test_crash_after_commit)
{
    struct itest t;
    char q[200], b[512], key[128], bodies[4][256], ids[4][64], keys[4][128];
    const char *bs[1] = {b};
    const char *env[] = {"IDEMQ_TEST_CRASH=after_commit", NULL};
    int st;

    setup(&t, "obcrash", "emits = true;");
    declare_out(&t, q, sizeof q);
    snprintf(key, sizeof key, "%s:c", t.name);
    snprintf(b, sizeof b, "{\"job_id\":\"%s\",\"rk\":\"%s\"}", key, q);
    itest_publish(&t, bs, 1);
    st = itest_wait(itest_spawn(&t, t.cfg_path, 5, env), itest_ms(30000));
    ck_assert_msg(st != -1 && WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL, "status 0x%x", st);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.outbox WHERE key = $1 AND "
                                    "state = 'pending'",
                                key),
                     1);
    ck_assert_int_eq(itest_queue_ready(&t, q), 0);
    itest_run_until_idle(&t, 1);
    ck_assert_int_eq(drain(&t, q, bodies, ids, keys, 4), 1);
    ck_assert_str_eq(keys[0], key);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM " OB_ALL " o WHERE key = $1", key), 1);
    itest_teardown(&t);
}
END_TEST

/* SIGKILL after the broker confirmed a row, before it was marked sent:
 * once the dead relay's lease passed (made to pass here), the row is
 * published again with the same message_id (at least once; a consumer
 * keyed on message_id sees a duplicate) and then marked sent. */
START_TEST(test_crash_after_confirm)
{
    struct itest t;
    char q[200], sql[512], bodies[4][256], ids[4][64], keys[4][128], want[64];
    const char *env[] = {"IDEMQ_TEST_CRASH=outbox_after_confirm", NULL};
    int st;

    setup(&t, "obdup", "");
    declare_out(&t, q, sizeof q);
    snprintf(sql, sizeof sql, "SELECT idemq.emit('', '%s', 'twice', NULL, NULL, '%s:dup')", q,
             t.name);
    itest_sql(&t, sql);
    st = itest_wait(itest_spawn(&t, t.cfg_path, 5, env), itest_ms(30000));
    ck_assert_msg(st != -1 && WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL, "status 0x%x", st);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.outbox WHERE routing_key = $1 "
                                    "AND state = 'pending' AND lease_until > now()",
                                q),
                     1); /* still leased by the dead relay */
    itest_sql(&t, "UPDATE idemq.outbox SET lease_until = now() - interval '1 second' "
                  "WHERE state = 'pending' AND lease_holder IS NOT NULL");
    itest_run_until_idle(&t, 1);
    ck_assert_int_eq(drain(&t, q, bodies, ids, keys, 4), 2);
    snprintf(want, sizeof want, "outbox:%ld",
             itest_long(&t, "SELECT id FROM " OB_ALL " o WHERE routing_key = $1", q));
    ck_assert_str_eq(ids[0], want);
    ck_assert_str_eq(ids[1], want);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM " OB_ALL " o WHERE routing_key = $1 "
                                    "AND state = 'sent'",
                                q),
                     1);
    itest_teardown(&t);
}
END_TEST

/* ---- sealed at rest ---- */

/* The stored copy of key's row (pending or sent) is sealed with k1: its
 * body holds no byte run of the plaintext the effect emitted, is as long as
 * it plus the nonce and tag, and names key k1. */
static void assert_sealed(struct itest *t, const char *key, const char *table)
{
    char sql[600];
    snprintf(sql, sizeof sql,
             "SELECT count(*) FROM %s o WHERE o.key = $1 AND o.body_key = 'k1' "
             "AND position(convert_to(jsonb_build_object('key', o.key)::text, 'UTF8') "
             "IN o.body) = 0 AND position(convert_to(o.key, 'UTF8') IN o.body) = 0 "
             "AND octet_length(o.body) = octet_length(jsonb_build_object('key', o.key)::text) "
             "+ 28",
             table);
    ck_assert_int_eq(itest_long(t, sql, key), 1);
}

/* Outbox bodies sealed at rest: with protection.active the row an effect
 * emits is stored sealed (before its transaction commits) under the
 * active key, in idemq.outbox and then idemq.outbox_sent, and the consumer
 * downstream receives the exact bytes the effect emitted, whether the
 * worker publishes the row right after its commit or a relay claims it
 * later (here: after a SIGKILL between the commit and the publish), and
 * also when the replica that ran the effect does not relay. A row
 * whose key is not listed, or whose body is no copy its key sealed
 * (altered), is never published (not empty, not garbled) and never
 * dropped: it is logged with its key id and row id and stays
 * pending. A row an application emits in its own transaction is stored as
 * sent (no key in PostgreSQL). */
START_TEST(test_outbox_sealed)
{
    struct itest t;
    char q[200], b[512], key[128], want[256], k1[128], extra[600], sql[600], log[300];
    char bodies[4][256], ids[4][64], keys[4][128];
    const char *bs[1] = {b};
    const char *env[] = {"IDEMQ_TEST_CRASH=after_commit", NULL};
    int st;

    itest_key_file(k1, sizeof k1, "outbox-k1", 0x30);
    snprintf(extra, sizeof extra,
             OUTBOX_CONF " protection: { keys = [ \"k1=%s\" ]; active = \"k1\"; };", k1);
    itest_extra_conf = extra;
    itest_setup(&t, "obseal", "idemq_test.emit_one", "", "emits = true;");
    itest_extra_conf = NULL;
    itest_sql(&t, EMIT_EFFECT);
    declare_out(&t, q, sizeof q);

    /* published by the worker right after its commit */
    snprintf(key, sizeof key, "%s:a", t.name);
    snprintf(b, sizeof b, "{\"job_id\":\"%s\",\"rk\":\"%s\",\"ex\":\"%s\"}", key, q, out_ex);
    itest_publish(&t, bs, 1);
    itest_run_until_idle(&t, 1);
    ck_assert_int_eq(drain(&t, q, bodies, ids, keys, 4), 1);
    snprintf(want, sizeof want, "{\"key\": \"%s\"}", key);
    ck_assert_str_eq(bodies[0], want);
    assert_sealed(&t, key, "idemq.outbox_sent");

    /* killed between the commit and the publish: a claim publishes it */
    snprintf(key, sizeof key, "%s:b", t.name);
    snprintf(b, sizeof b, "{\"job_id\":\"%s\",\"rk\":\"%s\",\"ex\":\"%s\"}", key, q, out_ex);
    itest_publish(&t, bs, 1);
    st = itest_wait(itest_spawn(&t, t.cfg_path, 5, env), itest_ms(30000));
    ck_assert_msg(st != -1 && WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL, "status 0x%x", st);
    assert_sealed(&t, key, "idemq.outbox");
    ck_assert_int_eq(itest_queue_ready(&t, q), 0);
    itest_run_until_idle(&t, 1);
    ck_assert_int_eq(drain(&t, q, bodies, ids, keys, 4), 1);
    snprintf(want, sizeof want, "{\"key\": \"%s\"}", key);
    ck_assert_str_eq(bodies[0], want);
    ck_assert_str_eq(keys[0], key);
    assert_sealed(&t, key, "idemq.outbox_sent");

    /* sealed also by a replica that does not relay (outbox.relay = 0); a
     * relay publishes it later */
    {
        static char text[1 << 16];
        char cfg0[300], *at;
        FILE *f;
        size_t n;
        ck_assert_ptr_nonnull(f = fopen(t.cfg_path, "r"));
        n = fread(text, 1, sizeof text - 1, f);
        text[n] = '\0';
        fclose(f);
        ck_assert_ptr_nonnull(at = strstr(text, "relay = 1;"));
        at[8] = '0';
        snprintf(cfg0, sizeof cfg0, "%s.norelay", t.cfg_path);
        ck_assert_ptr_nonnull(f = fopen(cfg0, "w"));
        fputs(text, f);
        fclose(f);
        snprintf(key, sizeof key, "%s:c", t.name);
        snprintf(b, sizeof b, "{\"job_id\":\"%s\",\"rk\":\"%s\",\"ex\":\"%s\"}", key, q,
                 out_ex);
        itest_publish(&t, bs, 1);
        st = itest_wait(itest_spawn(&t, cfg0, 1, NULL), itest_ms(30000));
        ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "idemq: 0x%x", st);
        unlink(cfg0);
        assert_sealed(&t, key, "idemq.outbox");
        ck_assert_int_eq(itest_queue_ready(&t, q), 0);
        itest_run_until_idle(&t, 1);
        ck_assert_int_eq(drain(&t, q, bodies, ids, keys, 4), 1);
        snprintf(want, sizeof want, "{\"key\": \"%s\"}", key);
        ck_assert_str_eq(bodies[0], want);
        assert_sealed(&t, key, "idemq.outbox_sent");
    }

    /* an application's own emit is stored as sent; made to name a key no
     * replica lists, it is reported and left, never published */
    snprintf(key, sizeof key, "%s:u", t.name);
    snprintf(sql, sizeof sql, "SELECT idemq.emit('%s', '%s', 'app body', NULL, NULL, '%s')",
             out_ex, q, key);
    itest_sql(&t, sql);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.outbox WHERE key = $1 AND "
                                    "body_key IS NULL AND body = 'app body'::bytea", key), 1);
    snprintf(sql, sizeof sql, "UPDATE idemq.outbox SET body_key = 'k9' WHERE key = '%s'", key);
    itest_sql(&t, sql);
    /* and one that names the listed key but is no copy it sealed (altered) */
    snprintf(sql, sizeof sql,
             "SELECT idemq.emit('%s', '%s', 'altered body', NULL, NULL, '%s:v'); "
             "UPDATE idemq.outbox SET body_key = 'k1' WHERE key = '%s:v'",
             out_ex, q, t.name, t.name);
    itest_sql(&t, sql);
    snprintf(log, sizeof log, "/tmp/%s.sealed.log", t.name);
    unlink(log);
    st = itest_wait(itest_spawn_log(t.cfg_path, 3, NULL, log), itest_ms(60000));
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "idemq: 0x%x", st);
    snprintf(want, sizeof want, "row %ld (key %s) is sealed with key \"k9\" and cannot be opened",
             itest_long(&t, "SELECT id FROM idemq.outbox WHERE key = $1", key), key);
    ck_assert_int_ge(itest_count_lines(log, want), 1);
    ck_assert_int_eq(itest_queue_ready(&t, q), 0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.outbox WHERE key = $1 AND "
                                    "state = 'pending' AND body_key = 'k9' AND attempts = 0",
                                key),
                     1);
    { /* and idemq parked list counts it, by its key */
        static char out[1 << 16];
        snprintf(sql, sizeof sql, "parked list --key '%s'", key);
        ck_assert_int_eq(itest_idemq(&t, sql, out, sizeof out), 0);
        ck_assert_msg(strstr(out, "outbox rows sealed with a key protection.keys does not list "
                                  "(not published until it is listed again): 1"),
                      "%s", out);
    }
    snprintf(sql, sizeof sql, "%s:v", t.name);
    snprintf(want, sizeof want, "row %ld (key %s) is sealed with key \"k1\" and cannot be opened",
             itest_long(&t, "SELECT id FROM idemq.outbox WHERE key = $1", sql), sql);
    ck_assert_int_ge(itest_count_lines(log, want), 1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.outbox WHERE key = $1 AND "
                                    "state = 'pending' AND body_key = 'k1' AND attempts = 0",
                                sql),
                     1);
    /* the rows would stay pending for good: other tests count pending rows */
    snprintf(sql, sizeof sql, "DELETE FROM idemq.outbox WHERE key IN ('%s', '%s:v')", key,
             t.name);
    itest_sql(&t, sql);
    unlink(log);
    unlink(k1);
    itest_teardown(&t);
}
END_TEST

/* ---- refusals: every refusal ends in a defined state ---- */

/* Runs `scripts/services ctl ARGS` (rabbitmqctl on the test node). */
static void ctl(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void ctl(const char *fmt, ...)
{
    char args[900], what[1000];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    snprintf(what, sizeof what, "ctl %s", args);
    ck_assert_msg(itest_services(what) == 0, "scripts/services %s failed", what);
}

/* RabbitMQ 3.x's max_message_size (read by each channel when it opens);
 * 0 puts back its default, 128 MiB. */
static void set_max_message_size(long bytes)
{
    ctl("eval 'application:set_env(rabbit, max_message_size, %ld).'",
        bytes ? bytes : 134217728L);
}

/* Connections the broker let in for the workers of consumer id `cid`
 * ("idemq <cid> worker N", the connection name idemq gives them), from the
 * node's log under $IDEMQ_STATE_DIR (written as they come, unlike the
 * management API's counters). */
static long worker_connections(const char *cid)
{
    char cmd[600], out[64] = "";
    FILE *p;
    snprintf(cmd, sizeof cmd,
             "cat \"$IDEMQ_STATE_DIR\"/rabbit*/log/*@localhost.log | grep 'granted access' | "
             "grep -c -F -- '- idemq %s worker '",
             cid);
    p = popen(cmd, "r");
    ck_assert_ptr_nonnull(p);
    if (!fgets(out, sizeof out, p))
        out[0] = '\0';
    pclose(p);
    return atol(out);
}

/* Three relays (three idemq processes) relay one outbox while rows keep
 * being emitted (ten per transaction, five order keys interleaved) and
 * one relay after the other is SIGKILLed every ~0.4 s and started again.
 * Every row is published; per order key the messages arrive in commit
 * order, a re-publish (a relay killed between a publish and its sent
 * mark) only repeating the row just before, with the same message_id, so
 * a consumer deduplicating on message_id applies each row once. One row
 * per 100 is poisoned, in the order key of the rows around it: to an
 * exchange that does not exist (404), or with a 300-byte routing key
 * (written directly: idemq.emit refuses it); each is parked with its
 * reason, holds only its key until then, and the relays open no more
 * connections than their starts need (no reconnect per refusal). A killed
 * relay's leases are made to pass 0.3 s after it died (outbox.lease_s is
 * at least 15 s; the pause lets the broker take in what the dead
 * connection still had on the wire). IDEMQ_OUTBOX_KILL_S sets the kill
 * loop's length (12 s here; ctest's check_outbox_kill_long: 120 s). */
enum { KILL_KEYS = 5, KILL_MAX = 40000, KILL_TX = 10 };
static char kb[KILL_MAX][256], kid[KILL_MAX][64], kkey[KILL_MAX][128];

/* True once pid has a handler for SIGTERM (SigCgt in /proc/PID/status). */
static bool catches_sigterm(pid_t pid)
{
    char path[64], line[256];
    unsigned long long mask = 0;
    bool found = false;
    FILE *f;
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    if (!(f = fopen(path, "r")))
        return false;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "SigCgt: %llx", &mask) == 1) {
            found = true;
            break;
        }
    fclose(f);
    return found && ((mask >> (SIGTERM - 1)) & 1);
}

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int kill_secs(void)
{
    const char *v = getenv("IDEMQ_OUTBOX_KILL_S");
    return v && atoi(v) > 0 ? atoi(v) : 12;
}

START_TEST(test_relays_kill_loop)
{
    struct itest t;
    char q[200], sql[768], like[160];
    static int last[KILL_KEYS], seen_id[KILL_KEYS];
    static char first_id[KILL_KEYS][64];
    static char jb[KILL_TX][384];
    const char *jbs[KILL_TX];
    PGconn *em;
    PGresult *seqs;
    pid_t pids[3];
    long long t0, next_kill, now;
    long long jlast[KILL_KEYS];
    int rows = 0, jobs = 0, kills = 0, victim = 0, n, dups = 0, jmsgs = 0, jdups = 0, rate;
    int poisoned = 0;
    long conns;
    struct broker *pb;
    char err[512];

    /* the payouts input's effect emits too (relayed right after its
     * commit, leased before it): jobs "<name>:j<n>" with order keys
     * "<name>:e<n % KILL_KEYS>" */
    setup(&t, "obkill", "emits = true;");
    declare_out(&t, q, sizeof q);
    snprintf(like, sizeof like, "%s:%%", t.name);
    em = connect_db();
    /* one publisher connection for the jobs */
    ck_assert_msg(broker_open(t.conf, "kill loop publisher", true, &pb, err, sizeof err) ==
                      IDEMQ_OK,
                  "%s", err);
    conns = worker_connections(t.conf->consumer_id);
    for (int i = 0; i < 3; i++)
        pids[i] = itest_spawn(&t, t.cfg_path, 600, NULL);
    t0 = now_ms();
    next_kill = t0 + 1000;
    /* rows at up to 600/s (fewer in a long loop: at most KILL_MAX / 2 in
     * all), KILL_TX per transaction: rows of a transaction get its commit
     * position in id order */
    rate = 600 < KILL_MAX / 2 / kill_secs() ? 600 : KILL_MAX / 2 / kill_secs();
    while ((now = now_ms()) - t0 < kill_secs() * 1000LL) {
        if (rows + KILL_TX <= KILL_MAX / 2 && rows < (now - t0) * rate / 1000) {
            snprintf(sql, sizeof sql,
                     "SELECT idemq.emit('', '%s', ((%d + g) %% %d) || ' ' || ((%d + g) / %d), "
                     "NULL, '%s:' || ((%d + g) %% %d)) FROM generate_series(0, %d) g ORDER BY g",
                     q, rows, KILL_KEYS, rows, KILL_KEYS, t.name, rows, KILL_KEYS, KILL_TX - 1);
            exec_ok(em, sql);
            if ((rows / KILL_TX) % 10 == 9) { /* the 100th: poisoned, in the next row's key */
                char okx[160];
                snprintf(okx, sizeof okx, "'%s:%d'", t.name, (rows + KILL_TX) % KILL_KEYS);
                if (poisoned % 2 == 0)
                    snprintf(sql, sizeof sql,
                             "SELECT idemq.emit('%s.gone', 'x', 'poison', NULL, %s, '%s:p%d')",
                             t.name, okx, t.name, poisoned);
                else
                    snprintf(sql, sizeof sql,
                             "INSERT INTO idemq.outbox (key, exchange, routing_key, body, "
                             "order_key) VALUES ('%s:p%d', '', repeat('r', 300), 'poison', %s)",
                             t.name, poisoned, okx);
                exec_ok(em, sql);
                poisoned++;
            }
            rows += KILL_TX;
        }
        if (jobs + KILL_TX <= KILL_MAX / 8 && jobs < (now - t0) * (rate / 3) / 1000) {
            for (int g = 0; g < KILL_TX; g++) {
                snprintf(jb[g], sizeof jb[g],
                         "{\"job_id\":\"%s:j%d\",\"rk\":\"%s\",\"ok\":\"%s:e%d\"}", t.name,
                         jobs + g, q, t.name, (jobs + g) % KILL_KEYS);
                jbs[g] = jb[g];
            }
            for (int g = 0; g < KILL_TX; g++)
                ck_assert_msg(broker_publish(pb, t.conf->inputs[0].exchange,
                                             t.conf->inputs[0].routing_key, jbs[g],
                                             strlen(jbs[g]), NULL) == IDEMQ_OK,
                              "%s", broker_error(pb));
            ck_assert_msg(broker_wait_confirms(pb, itest_ms(10000)) == IDEMQ_OK, "%s",
                          broker_error(pb));
            jobs += KILL_TX;
        }
        if (now >= next_kill) {
            pid_t dead = pids[victim];
            int st;
            kill(dead, SIGKILL);
            st = itest_wait(dead, itest_ms(10000));
            ck_assert_msg(st != -1 && WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL,
                          "relay %d: status 0x%x (it died before it was killed)", (int)dead,
                          st);
            /* its leases end with its database sessions (lease_pid), no
             * waiting for outbox.lease_s: the drain below would outlast
             * its deadline otherwise */
            pids[victim] = itest_spawn(&t, t.cfg_path, 600, NULL);
            victim = (victim + 1) % 3;
            kills++;
            next_kill = now_ms() + 400;
        }
        usleep(2000);
    }
    /* no more kills: the three drain what is left */
    snprintf(sql, sizeof sql, "%s:j%%", t.name);
    wait_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key LIKE $1 AND state = 'applied'",
              sql, jobs, 60000);
    wait_long(&t, "SELECT count(*) FROM idemq.outbox WHERE order_key LIKE $1 AND "
                  "state = 'pending'",
              like, 0, 60000);
    for (int i = 0; i < 3; i++) {
        int st;
        /* a SIGTERM before idemq installed its handler kills it instead of
         * draining: wait until it catches SIGTERM (a relay started last may
         * still be starting) */
        long long until = now_ms() + itest_ms(20000);
        while (!catches_sigterm(pids[i]) && now_ms() < until)
            usleep(20000);
        ck_assert_msg(catches_sigterm(pids[i]), "relay %d never installed its SIGTERM handler",
                      (int)pids[i]);
        kill(pids[i], SIGTERM);
        st = itest_wait(pids[i], itest_ms(30000));
        ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "status 0x%x", st);
    }
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.outbox_sent WHERE order_key "
                                "LIKE $1",
                                like),
                     rows + jobs);
    /* every poisoned row parked with its reason, nothing else parked */
    ck_assert_int_ge(poisoned, kill_secs() / 3);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.outbox WHERE order_key LIKE $1",
                                like),
                     poisoned);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.outbox WHERE order_key LIKE $1 "
                                    "AND state = 'parked' AND convert_from(body, 'UTF8') = "
                                    "'poison' AND (last_error LIKE '%404 NOT_FOUND%' OR "
                                    "last_error LIKE '%routing key is 300 bytes%')",
                                like),
                     poisoned);
    /* no reconnect storm: each relay start opens its few connections, a
     * refusal none (the old relay reconnected on every one) */
    broker_close(pb);
    conns = worker_connections(t.conf->consumer_id) - conns;
    ck_assert_msg(conns >= 3 && conns <= kills + 3 + 3,
                  "%ld worker connections for %d relay starts", conns, kills + 3);
    /* one row per job, whatever its deliveries */
    ck_assert_int_eq(itest_long(&t, "SELECT count(DISTINCT key) FROM idemq.outbox_sent WHERE "
                                    "key LIKE $1",
                                sql),
                     jobs);
    snprintf(sql, sizeof sql,
             "SELECT message_id, substring(order_key FROM '[0-9]+$')::integer, commit_seq "
             "FROM idemq.outbox_sent WHERE order_key LIKE '%s:e%%'",
             t.name);
    seqs = PQexec(em, sql);
    ck_assert_msg(PQresultStatus(seqs) == PGRES_TUPLES_OK, "%s", PQerrorMessage(em));
    PQfinish(em);
    n = drain(&t, q, kb, kid, kkey, KILL_MAX);
    ck_assert_msg(n >= rows + jobs && n < KILL_MAX, "%d messages for %d rows and %d jobs", n,
                  rows, jobs);
    for (int k = 0; k < KILL_KEYS; k++)
        last[k] = -1, seen_id[k] = 0, jlast[k] = -1;
    for (int i = 0; i < n; i++) {
        int k = -1, seq = -1;
        if (kb[i][0] == '{') { /* an effect's row: in commit order (commit_seq) per order key */
            int r = 0;
            long long cs;
            while (r < PQntuples(seqs) && strcmp(PQgetvalue(seqs, r, 0), kid[i]) != 0)
                r++;
            ck_assert_msg(r < PQntuples(seqs), "message %s of no sent row", kid[i]);
            k = atoi(PQgetvalue(seqs, r, 1));
            cs = atoll(PQgetvalue(seqs, r, 2));
            ck_assert(k >= 0 && k < KILL_KEYS);
            jmsgs++;
            if (cs == jlast[k]) { /* a re-publish of the row just before */
                jdups++;
                continue;
            }
            ck_assert_msg(cs > jlast[k], "order key e%d: commit_seq %lld after %lld (overtaken)",
                          k, cs, jlast[k]);
            jlast[k] = cs;
            continue;
        }
        ck_assert_int_eq(sscanf(kb[i], "%d %d", &k, &seq), 2);
        ck_assert_msg(k >= 0 && k < KILL_KEYS, "%s", kb[i]);
        if (seq == last[k]) { /* a re-publish of the row just before: same message_id */
            ck_assert_str_eq(kid[i], first_id[k]);
            dups++;
            continue;
        }
        ck_assert_msg(seq == last[k] + 1,
                      "key %d: %d after %d (a row overtaken, skipped or repeated late)", k, seq,
                      last[k]);
        last[k] = seq;
        snprintf(first_id[k], sizeof first_id[k], "%s", kid[i]);
        seen_id[k]++;
    }
    for (int k = 0; k < KILL_KEYS; k++)
        ck_assert_int_eq(last[k] + 1, rows / KILL_KEYS + (k < rows % KILL_KEYS));
    ck_assert_int_eq(n - jmsgs - dups, rows); /* once each, counting a message_id once */
    ck_assert_int_eq(jmsgs - jdups, jobs);
    PQclear(seqs);
    ck_assert_int_ge(kills, kill_secs() - 1);
    fprintf(stderr,
            "kill loop: %d rows, %d jobs' rows, %d poisoned, %d kills, %d messages (%d and %d "
            "re-published), %ld connections\n",
            rows, jobs, poisoned, kills, n, dups, jdups, conns);
    itest_teardown(&t);
}
END_TEST

/* The broker goes away: rows emitted meanwhile are held, then drained
 * once it is back. */
START_TEST(test_broker_down)
{
    struct itest t;
    char q[200], sql[512], bodies[4][256], ids[4][64], keys[4][128];
    pid_t pid;
    int st;

    setup(&t, "obdown", "");
    declare_out(&t, q, sizeof q);
    pid = itest_spawn(&t, t.cfg_path, 3, NULL);
    for (int i = 0; i < itest_ms(200) && itest_queue_consumers(&t, t.conf->inputs[0].queue) < 1;
         i++)
        usleep(50000); /* idemq is up and consuming */
    ck_assert_int_eq(itest_queue_consumers(&t, t.conf->inputs[0].queue), 1);
    ck_assert_int_eq(itest_services("rabbit-stop"), 0);
    snprintf(sql, sizeof sql, "SELECT idemq.emit('', '%s', 'held', NULL, NULL, '%s:held')", q,
             t.name);
    itest_sql(&t, sql);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.outbox WHERE routing_key = $1 "
                                    "AND state = 'pending'",
                                q),
                     1);
    ck_assert_int_eq(itest_services("rabbit-start"), 0);
    wait_long(&t, "SELECT count(*) FROM " OB_ALL " o WHERE routing_key = $1 AND state = 'sent'",
              q, 1, 30000);
    st = itest_wait(pid, itest_ms(60000));
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "status 0x%x", st);
    ck_assert_int_eq(drain(&t, q, bodies, ids, keys, 4), 1);
    ck_assert_str_eq(bodies[0], "held");
    itest_teardown(&t);
}
END_TEST

/* Two replicas relay at once: every row is published exactly once (no
 * crash, so no duplicate either) and per order key in commit order. */
START_TEST(test_two_relays)
{
    enum { ROWS = 120, KEYS = 4 };
    struct itest t;
    char q[200], sql[512], ok[128];
    static char bodies[ROWS + 1][256], ids[ROWS + 1][64], keys[ROWS + 1][128];
    int last[KEYS], n, st1, st2;
    pid_t p1, p2;

    setup(&t, "obtwo", "");
    declare_out(&t, q, sizeof q);
    /* one transaction per row, keys interleaved */
    for (int i = 0; i < ROWS; i++) {
        snprintf(ok, sizeof ok, "%s:%d", t.name, i % KEYS);
        snprintf(sql, sizeof sql, "SELECT idemq.emit('', '%s', '%d %d', NULL, '%s')", q,
                 i % KEYS, i / KEYS, ok);
        itest_sql(&t, sql);
    }
    p1 = itest_spawn(&t, t.cfg_path, 2, NULL);
    p2 = itest_spawn(&t, t.cfg_path, 2, NULL);
    st1 = itest_wait(p1, itest_ms(60000));
    st2 = itest_wait(p2, itest_ms(60000));
    ck_assert_msg(st1 != -1 && WIFEXITED(st1) && WEXITSTATUS(st1) == 0, "status 0x%x", st1);
    ck_assert_msg(st2 != -1 && WIFEXITED(st2) && WEXITSTATUS(st2) == 0, "status 0x%x", st2);
    n = drain(&t, q, bodies, ids, keys, ROWS + 1);
    ck_assert_int_eq(n, ROWS);
    for (int k = 0; k < KEYS; k++)
        last[k] = -1;
    for (int i = 0; i < n; i++) {
        int k = -1, seq = -1;
        ck_assert_int_eq(sscanf(bodies[i], "%d %d", &k, &seq), 2);
        ck_assert_msg(k >= 0 && k < KEYS && seq == last[k] + 1,
                      "key %d: %d after %d (a row overtaken, skipped or repeated)", k, seq,
                      k >= 0 && k < KEYS ? last[k] : -2);
        last[k] = seq;
    }
    for (int k = 0; k < KEYS; k++)
        ck_assert_int_eq(last[k], ROWS / KEYS - 1);
    snprintf(ok, sizeof ok, "%s:%%", t.name);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.outbox WHERE order_key LIKE $1",
                                ok),
                     0); /* every row moved to idemq.outbox_sent when it was sent */
    itest_teardown(&t);
}
END_TEST

/* Text of the first column of sql's only row ("" when NULL), into out. */
static void query_text(PGconn *db, const char *sql, char *out, size_t len)
{
    PGresult *r = PQexec(db, sql);
    ck_assert_msg(PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1, "%s: %s", sql,
                  PQerrorMessage(db));
    snprintf(out, len, "%s", PQgetvalue(r, 0, 0));
    PQclear(r);
}

/* The lease before COMMIT (idemq.outbox_take, the batch transaction's last
 * statement): it stamps every row of the transaction in id order and
 * leases only what a claim could take once committed (a row without an
 * order key; of an order key its first row, and that only when no
 * committed row of the key is pending), to the holder and its session. */
START_TEST(test_take_before_commit)
{
    struct itest t;
    char sql[1024], k1[128], k2[128], out[512];
    PGconn *db, *app;

    setup(&t, "obtake", "");
    db = connect_db();
    app = connect_db();
    snprintf(k1, sizeof k1, "%s:k1", t.name);
    snprintf(k2, sizeof k2, "%s:k2", t.name);
    /* a committed row of k2, pending (no relay runs) */
    snprintf(sql, sizeof sql, "SELECT idemq.emit('', 'nowhere', 'k2 before', NULL, '%s')", k2);
    exec_ok(app, sql);
    exec_ok(db, "BEGIN");
    snprintf(sql, sizeof sql,
             "SELECT idemq.emit('', 'nowhere', 'k1 a', NULL, '%s'), "
             "idemq.emit('', 'nowhere', 'k1 b', NULL, '%s'), "
             "idemq.emit('', 'nowhere', 'free', NULL, NULL, '%s:free'), "
             "idemq.emit('', 'nowhere', 'k2 after', NULL, '%s')",
             k1, k1, t.name, k2);
    exec_ok(db, sql);
    query_text(db,
               "SELECT string_agg(convert_from(r_body, 'UTF8') || '/' || r_emitted, ',' "
               "ORDER BY r_id) FROM idemq.outbox_take('test-holder', 100, 600000)",
               out, sizeof out);
    ck_assert_str_eq(out, "k1 a/4,free/4");
    exec_ok(db, "COMMIT");
    snprintf(sql, sizeof sql,
             "SELECT string_agg(convert_from(body, 'UTF8') || '/' || coalesce(lease_holder, '-') "
             "|| '/' || (lease_pid IS NOT DISTINCT FROM %d)::text, ',' ORDER BY commit_seq) "
             "FROM idemq.outbox WHERE order_key IN ('%s', '%s') OR key = '%s:free'",
             PQbackendPID(db), k1, k2, t.name);
    query_text(db, sql, out, sizeof out);
    /* commit order: k2's earlier row first, then this transaction's rows in
     * id order; only its heads leased, to its session */
    ck_assert_str_eq(out, "k2 before/-/false,k1 a/test-holder/true,k1 b/-/false,"
                          "free/test-holder/true,k2 after/-/false");
    /* only the earlier k2 row pending: nothing to lease, the count says so */
    exec_ok(db, "BEGIN");
    snprintf(sql, sizeof sql, "SELECT idemq.emit('', 'nowhere', 'k2 third', NULL, '%s')", k2);
    exec_ok(db, sql);
    query_text(db,
               "SELECT coalesce(r_id::text, 'null') || '/' || r_emitted "
               "FROM idemq.outbox_take('test-holder', 100, 600000)",
               out, sizeof out);
    ck_assert_str_eq(out, "null/1");
    exec_ok(db, "COMMIT");
    /* a transaction that wrote nothing takes nothing */
    exec_ok(db, "BEGIN");
    query_text(db, "SELECT count(*) FROM idemq.outbox_take('test-holder', 100, 600000)", out,
               sizeof out);
    ck_assert_str_eq(out, "0");
    exec_ok(db, "COMMIT");
    snprintf(sql, sizeof sql,
             "DELETE FROM idemq.outbox WHERE order_key IN ('%s', '%s') OR key = '%s:free'", k1,
             k2, t.name);
    exec_ok(db, sql);
    PQfinish(app);
    PQfinish(db);
    itest_teardown(&t);
}
END_TEST

/* A lease lasts while its session does: rows leased for 10 minutes by a
 * session that is still open are left alone by a relay, and relayed at
 * once, in commit order, when that session is gone (a relay that died). */
START_TEST(test_lease_ends_with_session)
{
    struct itest t;
    char q[200], sql[512], ok[128], bodies[4][256], ids[4][64], keys[4][128], out[64];
    PGconn *holder;

    setup(&t, "oblease", "");
    declare_out(&t, q, sizeof q);
    snprintf(ok, sizeof ok, "%s:k", t.name);
    holder = connect_db();
    exec_ok(holder, "BEGIN");
    snprintf(sql, sizeof sql,
             "SELECT idemq.emit('', '%s', 'first', NULL, '%s'), "
             "idemq.emit('', '%s', 'second', NULL, '%s')",
             q, ok, q, ok);
    exec_ok(holder, sql);
    query_text(holder, "SELECT count(*) FROM idemq.outbox_take('gone-soon', 100, 600000)", out,
               sizeof out);
    ck_assert_str_eq(out, "1");
    exec_ok(holder, "COMMIT");
    itest_run_until_idle(&t, 1);
    ck_assert_int_eq(drain(&t, q, bodies, ids, keys, 4), 0); /* the head is leased: none */
    PQfinish(holder);
    /* the session is gone (its backend exits a moment later): its lease with it */
    wait_long(&t, "SELECT count(*) FROM idemq.outbox o WHERE order_key = $1 AND "
                  "NOT idemq.outbox_lease_free(o.lease_until, o.lease_pid)",
              ok, 0, 5000);
    itest_run_until_idle(&t, 1);
    ck_assert_int_eq(drain(&t, q, bodies, ids, keys, 4), 2);
    ck_assert_str_eq(bodies[0], "first");
    ck_assert_str_eq(bodies[1], "second");
    itest_teardown(&t);
}
END_TEST

/* Privileges: the role `idemq migrate --grant` prepares can emit (the
 * commit-time stamp runs as the owner) and claim, but not write the table;
 * a role without the grant cannot emit. */
START_TEST(test_privileges)
{
    struct itest t;
    char role[128], bare[128], sql[512], out[4096], dsn[1024];
    PGconn *db;
    PGresult *r;

    setup(&t, "obpriv", "");
    snprintf(role, sizeof role, "%s_run", t.name);
    snprintf(bare, sizeof bare, "%s_bare", t.name);
    snprintf(sql, sizeof sql, "CREATE ROLE %s LOGIN; CREATE ROLE %s LOGIN", role, bare);
    itest_sql(&t, sql);
    snprintf(sql, sizeof sql, "migrate --grant %s", role);
    ck_assert_int_eq(itest_idemq(&t, sql, out, sizeof out), 0);
    for (int pass = 0; pass < 2; pass++) {
        const char *who = pass == 0 ? role : bare;
        char *u;
        snprintf(dsn, sizeof dsn, "%s", getenv("IDEMQ_PG_DSN"));
        u = strstr(dsn, "user=");
        ck_assert_ptr_nonnull(u);
        snprintf(u, sizeof dsn - (size_t)(u - dsn), "user=%s", who);
        db = connect_db_dsn(dsn);
        snprintf(sql, sizeof sql,
                 "BEGIN; SELECT idemq.emit('', '%s.none', 'priv', NULL, '%s:k'); COMMIT", t.name,
                 t.name);
        r = PQexec(db, sql);
        if (pass == 0) {
            ck_assert_msg(PQresultStatus(r) == PGRES_COMMAND_OK, "%s", PQerrorMessage(db));
            PQclear(r);
            r = PQexec(db, "INSERT INTO idemq.outbox (exchange, routing_key, body) "
                           "VALUES ('', 'x', 'y')");
            ck_assert_str_eq(PQresultErrorField(r, PG_DIAG_SQLSTATE), "42501");
            PQclear(r);
            snprintf(sql, sizeof sql,
                     "SELECT count(*) FROM idemq.outbox_claim('%s', 100, 1000) "
                     "WHERE r_order_key = '%s:k'",
                     role, t.name);
            r = PQexec(db, sql);
            ck_assert_msg(PQresultStatus(r) == PGRES_TUPLES_OK, "%s", PQerrorMessage(db));
            ck_assert_str_eq(PQgetvalue(r, 0, 0), "1");
        } else {
            ck_assert_str_eq(PQresultErrorField(r, PG_DIAG_SQLSTATE), "42501");
        }
        PQclear(r);
        PQfinish(db);
    }
    snprintf(sql, sizeof sql, "%s:k", t.name);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.outbox WHERE order_key = $1 "
                                    "AND commit_seq IS NOT NULL",
                                sql),
                     1);
    /* not left pending for the other tests' relays */
    itest_sql(&t, "UPDATE idemq.outbox SET state = 'parked', parked_at = now(), "
                  "last_error = 'test_privileges' WHERE routing_key LIKE '%.none' "
                  "AND state = 'pending'");
    itest_teardown(&t);
}
END_TEST

/* The value of an unlabelled metric in a /metrics body, -1 if absent. */
static long metric(const char *body, const char *name)
{
    char needle[128];
    const char *p;
    snprintf(needle, sizeof needle, "\n%s ", name);
    p = strstr(body, needle);
    return p ? atol(p + strlen(needle)) : -1;
}

/* /ready fails while the oldest unsent row is older than outbox.stuck_s
 * (a row leased by a relay that is gone, lease far ahead); /metrics shows
 * the depth, and the relayed row in the counters and the histogram. */
START_TEST(test_metrics_and_ready)
{
    struct itest t;
    char q[200], sql[512], conf[256], url[128], body[32768];
    int port = itest_free_port(), code = 0;
    pid_t pid;

    snprintf(conf, sizeof conf,
             "outbox: { relay = 1; poll_ms = 200; stuck_s = 1; };\n"
             "metrics: { listen = \"127.0.0.1:%d\"; };",
             port);
    itest_extra_conf = conf;
    itest_setup(&t, "obmetrics", "idemq_test.emit_one", "", "");
    itest_extra_conf = NULL;
    declare_out(&t, q, sizeof q);
    snprintf(sql, sizeof sql,
             "SELECT idemq.emit('', '%s', 'fine'); "
             "BEGIN; SELECT idemq.emit('', '%s', 'stuck'); UPDATE idemq.outbox SET "
             "lease_holder = 'gone', lease_until = now() + interval '1 hour', created_at = "
             "now() - interval '1 hour' WHERE id = lastval(); COMMIT",
             q, q);
    itest_sql(&t, sql);
    pid = itest_spawn(&t, t.cfg_path, 3, NULL);
    snprintf(url, sizeof url, "http://127.0.0.1:%d/ready", port);
    for (int i = 0; i < itest_ms(200); i++) {
        code = itest_http_get(url, body, sizeof body);
        if (code == 503 && strstr(body, "outbox"))
            break;
        usleep(50000);
    }
    ck_assert_msg(code == 503 && strstr(body, "oldest unsent row"), "/ready: %d %s", code, body);
    snprintf(url, sizeof url, "http://127.0.0.1:%d/metrics", port);
    for (int i = 0; i < itest_ms(200); i++) {
        code = itest_http_get(url, body, sizeof body);
        if (code == 200 && metric(body, "idemq_outbox_relayed_total") >= 1)
            break;
        usleep(50000);
    }
    /* at least: other tests' rows in the shared ledger may be relayed too */
    ck_assert_int_ge(metric(body, "idemq_outbox_relayed_total"), 1);
    ck_assert_int_ge(metric(body, "idemq_outbox_commit_to_confirm_seconds_count"), 1);
    ck_assert_int_ge(metric(body, "idemq_outbox_pending"), 1); /* the stuck row */
    ck_assert(itest_wait(pid, itest_ms(30000)) != -1);
    /* the shared ledger: the stuck row must not hold up other tests' /ready */
    itest_sql(&t, "DELETE FROM idemq.outbox WHERE lease_holder = 'gone'");
    itest_teardown(&t);
}
END_TEST


/* Producer-controlled text of outbox rows (exchange, routing key, order key,
 * the broker's error that quotes them) is printed escaped by `jobs show`
 * and `parked list`, like the rest of their output: no control byte
 * reaches the terminal. */
START_TEST(test_show_escaped)
{
    struct itest t;
    char key[128], sql[768], args[300], out[16384];

    setup(&t, "obesc", "");
    snprintf(key, sizeof key, "%s:esc", t.name);
    snprintf(sql, sizeof sql,
             "SELECT idemq.emit(E'ex\\x1b[2J', E'rk\\x1b[31m\\nfake line', 'x', NULL, "
             "E'ok\\r', '%s'); UPDATE idemq.outbox SET state = 'parked', parked_at = now(), "
             "attempts = 1, last_error = E'returned: key rk\\x1b[31m\\nfake line' "
             "WHERE key = '%s'",
             key, key);
    itest_sql(&t, sql);
    snprintf(args, sizeof args, "jobs show %s", key);
    ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 0);
    ck_assert_msg(strstr(out, " parked: ") != NULL, "%s", out);
    ck_assert_msg(!strchr(out, '\x1b') && !strchr(out, '\r') && !strstr(out, "\nfake line"),
                  "control bytes printed: %s", out);
    ck_assert_msg(strstr(out, "rk\\x1b[31m\\nfake line") && strstr(out, "ex\\x1b[2J") &&
                      strstr(out, "ok\\r"),
                  "%s", out);
    snprintf(args, sizeof args, "parked list --key %s", key);
    ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "outbox rows parked") != NULL, "%s", out);
    ck_assert_msg(!strchr(out, '\x1b') && !strstr(out, "\nfake line"),
                  "control bytes printed: %s", out);
    ck_assert_msg(strstr(out, "rk\\x1b[31m\\nfake line") != NULL, "%s", out);
    itest_teardown(&t);
}
END_TEST

/* Checks that the drained messages hold each good row "K SEQ" (keys 0..keys-1,
 * per key seq 0..per-1, in order) exactly once, with distinct message_ids;
 * other bodies are counted in *others. */
static void check_good_rows(char bodies[][256], char ids[][64], int n, int keys, int per,
                            int *others)
{
    int last[16];
    ck_assert(keys <= 16);
    for (int k = 0; k < keys; k++)
        last[k] = -1;
    *others = 0;
    for (int i = 0; i < n; i++) {
        int k = -1, seq = -1;
        for (int j = 0; j < i; j++)
            ck_assert_msg(strcmp(ids[i], ids[j]) != 0, "%s published twice", ids[i]);
        if (sscanf(bodies[i], "%d %d", &k, &seq) != 2) {
            (*others)++;
            continue;
        }
        ck_assert_msg(k >= 0 && k < keys && seq == last[k] + 1, "key %d: %d after %d", k, seq,
                      k >= 0 && k < keys ? last[k] : -2);
        last[k] = seq;
    }
    for (int k = 0; k < keys; k++)
        ck_assert_int_eq(last[k], per - 1);
}

/*
 * Rows the client library cannot encode (a 300-byte routing key, a 300-byte
 * header name, a header value over the frame size: written directly, as
 * idemq.emit refuses them) and a body over the broker's max_message_size
 * (406), all of one order key, among good rows of four others in one
 * transaction: `idemq run --until-idle` ends; each good row is published
 * once, in order per key; the unencodable rows are parked at once and the
 * 406 one after outbox.max_attempts, each with its reason (`parked list`,
 * idemq_outbox_parked_total); the good row behind them in their key goes
 * out after them; the worker never reconnects.
 */
START_TEST(test_refused_rows_parked)
{
    enum { KEYS = 4, PER = 5 };
    struct itest t;
    char q[200], sql[4096], conf[512], log[300], out[16384], bad[160], url[128];
    static char bodies[64][256], ids[64][64], keys[64][128], body[32768], page[1 << 20];
    int n, st, others, port = itest_free_port(), cport = itest_free_port(), o = 0, code;
    long parked = -1, big;
    bool v3;
    pid_t pid;

    snprintf(conf, sizeof conf,
             "outbox: { relay = 1; poll_ms = 200; max_attempts = 2; };\n"
             "metrics: { listen = \"127.0.0.1:%d\"; };\n"
             "console: { listen = \"127.0.0.1:%d\"; };",
             port, cport);
    itest_extra_conf = conf;
    itest_setup(&t, "obrefuse", "idemq_test.emit_one", "", "");
    itest_extra_conf = NULL;
    declare_out(&t, q, sizeof q);
    snprintf(bad, sizeof bad, "%s:bad", t.name);
    /* a body over max_message_size: RabbitMQ 3.x reads the setting when a
     * channel opens (set low for this run), 4.x only at boot (its default,
     * 16 MiB, is idemq.emit's bound: one byte more, written directly) */
    v3 = getenv("IDEMQ_SERVER_RABBITMQ") && strncmp(getenv("IDEMQ_SERVER_RABBITMQ"), "3.", 2) == 0;
    big = v3 ? 100000 : 16777217;
    o += snprintf(sql + o, sizeof sql - (size_t)o, "BEGIN; ");
    for (int i = 0; i < KEYS * PER; i++) {
        if (i == KEYS * PER / 2)
            o += snprintf(
                sql + o, sizeof sql - (size_t)o,
                "INSERT INTO idemq.outbox (key, exchange, routing_key, body, headers, order_key) "
                "VALUES ('%s:rk', '', repeat('r', 300), 'x', NULL, '%s'), "
                "('%s:hname', '', '%s', 'x', jsonb_build_object(repeat('n', 300), 1), '%s'), "
                "('%s:hbig', '', '%s', 'x', jsonb_build_object('big', repeat('h', 200000)), "
                "'%s'); "
                "INSERT INTO idemq.outbox (key, exchange, routing_key, body, order_key) "
                "VALUES ('%s:big', '', '%s', convert_to(repeat('b', %ld), 'UTF8'), '%s'); ",
                t.name, bad, t.name, q, bad, t.name, q, bad, t.name, q, big, bad);
        o += snprintf(sql + o, sizeof sql - (size_t)o,
                      "SELECT idemq.emit('', '%s', '%d %d', NULL, '%s:%d'); ", q, i % KEYS,
                      i / KEYS, t.name, i % KEYS);
    }
    o += snprintf(sql + o, sizeof sql - (size_t)o,
                  "SELECT idemq.emit('', '%s', 'after', NULL, '%s'); COMMIT", q, bad);
    ck_assert_int_lt(o, (int)sizeof sql);
    itest_sql(&t, sql);

    if (v3)
        set_max_message_size(65536);
    snprintf(log, sizeof log, "%s/%s.log", getenv("IDEMQ_STATE_DIR"), t.name);
    pid = itest_spawn_log(t.cfg_path, 5, NULL, log); /* idle: time to scrape the last park */
    snprintf(url, sizeof url, "http://127.0.0.1:%d/metrics", port);
    for (int i = 0; i < itest_ms(400) && parked < 4; i++) {
        if (itest_http_get(url, body, sizeof body) == 200)
            parked = metric(body, "idemq_outbox_parked_total");
        usleep(50000);
    }
    /* the console's failure groups page lists them by exchange and reason */
    snprintf(url, sizeof url, "http://127.0.0.1:%d/groups", cport);
    code = itest_http_get(url, page, sizeof page);
    st = itest_wait(pid, itest_ms(30000));
    if (v3)
        set_max_message_size(0);
    ck_assert_msg(parked == 4, "idemq_outbox_parked_total %ld (log %s)", parked, log);
    ck_assert_msg(code == 200 && strstr(page, "id=\"outbox-groups\"") &&
                      strstr(page, "PRECONDITION_FAILED") && strstr(page, "routing key is"),
                  "/groups: %d %.2000s", code, strstr(page, "<h2>") ? strstr(page, "<h2>") : page);
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "status 0x%x (log %s)", st,
                  log);
    ck_assert_msg(itest_count_lines(log, "NOT READY") == 0, "the worker reconnected: %s", log);

    n = drain(&t, q, bodies, ids, keys, 64);
    check_good_rows(bodies, ids, n, KEYS, PER, &others);
    ck_assert_int_eq(others, 1); /* "after" */
    ck_assert_int_eq(n, KEYS * PER + 1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.outbox WHERE order_key = $1 "
                                    "AND state = 'parked'",
                                bad),
                     4);
    snprintf(sql, sizeof sql, "%s:rk", t.name);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.outbox WHERE key = $1 AND "
                                    "attempts = 1 AND last_error LIKE '%routing key%255%'",
                                sql),
                     1);
    snprintf(sql, sizeof sql, "%s:hname", t.name);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.outbox WHERE key = $1 AND "
                                    "attempts = 1 AND last_error LIKE '%header name%255%'",
                                sql),
                     1);
    snprintf(sql, sizeof sql, "%s:hbig", t.name);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.outbox WHERE key = $1 AND "
                                    "attempts = 1 AND last_error LIKE '%headers%frame%'",
                                sql),
                     1);
    snprintf(sql, sizeof sql, "%s:big", t.name);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.outbox WHERE key = $1 AND "
                                    "attempts = 2 AND last_error LIKE '%406%PRECONDITION_FAILED%'",
                                sql),
                     1);
    /* the good row behind them in their key went after the last of them */
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.outbox_sent s WHERE "
                                    "s.order_key = $1 AND s.sent_at > (SELECT max(parked_at) "
                                    "FROM idemq.outbox p WHERE p.order_key = $1)",
                                bad),
                     1);
    snprintf(sql, sizeof sql, "parked list --key %s:big", t.name);
    ck_assert_int_eq(itest_idemq(&t, sql, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "outbox rows parked") && strstr(out, "PRECONDITION_FAILED"),
                  "%.2000s", out);
    snprintf(sql, sizeof sql, "parked list --key %s:rk", t.name);
    ck_assert_int_eq(itest_idemq(&t, sql, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "outbox rows parked") && strstr(out, "routing key is 300"),
                  "%.2000s", out);
    itest_teardown(&t);
}
END_TEST

/* The test effect of the permission case: emits to the payload's exchange
 * "ex" with routing key "rk" and order key "ok". */
#define EMIT_EX_EFFECT                                                                       \
    "CREATE OR REPLACE FUNCTION idemq_test.emit_ex(p_key text, p_payload jsonb, p_meta "     \
    "jsonb) RETURNS jsonb LANGUAGE plpgsql AS $fn$ BEGIN "                                   \
    "RETURN jsonb_build_object('outbox_id', idemq.emit(p_payload->>'ex', p_payload->>'rk', " \
    "p_payload->>'body', NULL, p_payload->>'ok', p_key)); END $fn$"

/*
 * A row to an exchange the run user may not write (403 ACCESS_REFUSED,
 * under the least-privilege user of consumer/OPERATIONS.md plus write on
 * the outbox's exchange): the emitting jobs are applied and acknowledged
 * once, the refused row is parked after outbox.max_attempts with the
 * broker's reason, the other rows flow (the one behind it in its order key
 * after it), and the consuming channel is never closed (no reconnect).
 */
START_TEST(test_refused_forbidden)
{
    enum { JOBS = 10 };
    struct itest t;
    char run_user[96], pw[64], run_url[300], ox[160], forbidden[160], sql[512], log[300];
    char jb[JOBS][512], key[160], out[16384];
    const char *jbs[JOBS];
    static char bodies[32][256], ids[32][64], keys[32][128];
    char *admin_url = strdup(getenv("IDEMQ_AMQP_URL"));
    struct broker *b;
    char err[512], q[200];
    int n, st, others;

    itest_extra_conf = OUTBOX_CONF "\ntopology: { verify = \"passive\"; };";
    itest_setup(&t, "obperm", "idemq_test.emit_ex", "", "emits = true;");
    itest_extra_conf = NULL;
    itest_sql(&t, EMIT_EX_EFFECT);
    declare_out(&t, q, sizeof q);
    snprintf(ox, sizeof ox, "%s.ox", t.name);
    snprintf(forbidden, sizeof forbidden, "%s.forbidden", t.name);
    ck_assert_int_eq(broker_open(t.conf, "itest", false, &b, err, sizeof err), IDEMQ_OK);
    ck_assert_int_eq(broker_admin_declare_exchange(b, ox, "direct", false, NULL), IDEMQ_OK);
    ck_assert_int_eq(broker_admin_declare_exchange(b, forbidden, "direct", false, NULL), IDEMQ_OK);
    ck_assert_int_eq(broker_admin_bind(b, q, ox, q, NULL), IDEMQ_OK);
    ck_assert_int_eq(broker_admin_bind(b, q, forbidden, q, NULL), IDEMQ_OK);
    broker_close(b);
    snprintf(run_user, sizeof run_user, "%s_run", t.name);
    snprintf(pw, sizeof pw, "Op-%d", (int)getpid());
    ctl("add_user %s %s", run_user, pw);
    /* consumer/OPERATIONS.md "Roles and permissions", with the outbox's exchange */
    ctl("set_permissions -p / %s '^$' '^(%s\\.(retry|dlx)|%s\\.ox)$' '^%s$'", run_user, t.name,
        t.name, t.name);
    snprintf(run_url, sizeof run_url, "amqp://%s:%s@127.0.0.1%s", run_user, pw,
             strrchr(admin_url, ':'));
    /* nine jobs of three order keys ("K SEQ"), and job 3, of key 0 between
     * its first and second, emits to the forbidden exchange */
    for (int i = 0, g = 0; i < JOBS; i++) {
        if (i == 3)
            snprintf(jb[i], sizeof jb[i],
                     "{\"job_id\":\"%s:%d\",\"ex\":\"%s\",\"rk\":\"%s\",\"ok\":\"%s:0\","
                     "\"body\":\"forbidden\"}",
                     t.name, i, forbidden, q, t.name);
        else
            snprintf(jb[i], sizeof jb[i],
                     "{\"job_id\":\"%s:%d\",\"ex\":\"%s\",\"rk\":\"%s\",\"ok\":\"%s:%d\","
                     "\"body\":\"%d %d\"}",
                     t.name, i, ox, q, t.name, g % 3, g % 3, g / 3), g++;
        jbs[i] = jb[i];
    }
    itest_publish(&t, jbs, JOBS);
    snprintf(log, sizeof log, "%s/%s.log", getenv("IDEMQ_STATE_DIR"), t.name);
    setenv("IDEMQ_AMQP_URL", run_url, 1);
    st = itest_wait(itest_spawn_log(t.cfg_path, 3, NULL, log), itest_ms(60000));
    setenv("IDEMQ_AMQP_URL", admin_url, 1);
    free(admin_url);
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "status 0x%x (log %s)", st,
                  log);
    ck_assert_msg(itest_count_lines(log, "NOT READY") == 0, "the worker reconnected: %s", log);
    ck_assert_int_eq(itest_queue_ready(&t, t.conf->inputs[0].queue), 0);
    snprintf(sql, sizeof sql, "%s:%%", t.name);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key LIKE $1 AND "
                                    "state = 'applied'",
                                sql),
                     JOBS);
    n = drain(&t, q, bodies, ids, keys, 32);
    ck_assert_int_eq(n, JOBS - 1);
    check_good_rows(bodies, ids, n, 3, 3, &others);
    ck_assert_int_eq(others, 0);
    snprintf(key, sizeof key, "%s:3", t.name);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.outbox WHERE key = $1 AND "
                                    "state = 'parked' AND attempts = 2 AND "
                                    "last_error LIKE '%403%ACCESS_REFUSED%'",
                                key),
                     1);
    snprintf(sql, sizeof sql, "parked list --key %s", key);
    ck_assert_int_eq(itest_idemq(&t, sql, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "outbox rows parked") && strstr(out, "ACCESS_REFUSED"), "%.2000s",
                  out);
    /* check-config says which permission the relay needs, and that the rows decide */
    ck_assert_int_eq(itest_idemq(&t, "check-config", out, sizeof out), 0);
    ck_assert_msg(strstr(out, "needs write permission on every exchange that idemq.emit names") &&
                      strstr(out, "decide it at run time"),
                  "%.2000s", out);
    ck_assert_msg(itest_count_lines(log, "needs write permission on every exchange") == 1, "%s",
                  log);
    ctl("delete_user %s", run_user);
    itest_teardown(&t);
}
END_TEST

/* idemq.emit refuses what can never be published, with its SQLSTATE, so
 * the emitting transaction fails (an effect's job is parked with the
 * code) instead of the relay; the bounds themselves are accepted. */
START_TEST(test_emit_refuses)
{
    struct itest t;
    static const char *const cases[][2] = {
        {"SELECT idemq.emit('', repeat('r', 256), 'x')", "22001"},
        {"SELECT idemq.emit(repeat('e', 256), 'rk', 'x')", "22001"},
        {"SELECT idemq.emit('', 'rk', 'x', jsonb_build_object(repeat('n', 256), 1))", "22001"},
        {"SELECT idemq.emit('', 'rk', 'x', jsonb_build_object('a', "
         "jsonb_build_object(repeat('n', 256), 1)))",
         "22001"},
        {"SELECT idemq.emit('', 'rk', 'x', jsonb_build_object('big', repeat('h', 40000)))",
         "54000"},
        {"SELECT idemq.emit('', 'rk', 'x', '{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{"
         "\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":1}}}}}}}}}}"
         "}}}}}}}')", /* 17 levels */
         "54000"},
        {"SELECT idemq.emit('', 'rk', convert_to(repeat('b', 16777217), 'UTF8'))", "54000"},
    };
    char q[200], b[1024], key[128], sql[512];
    const char *bs[1] = {b};
    PGconn *db;

    setup(&t, "obemitlim", "emits = true;");
    declare_out(&t, q, sizeof q);
    db = connect_db();
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        PGresult *r = PQexec(db, cases[i][0]);
        const char *code = PQresultErrorField(r, PG_DIAG_SQLSTATE);
        ck_assert_msg(code && strcmp(code, cases[i][1]) == 0, "%s: %s (want %s)", cases[i][0],
                      code ? code : "no error", cases[i][1]);
        ck_assert_msg(strstr(PQresultErrorMessage(r), "idemq.emit"), "%s",
                      PQresultErrorMessage(r));
        PQclear(r);
    }
    /* at the bounds: accepted (then parked by hand: nothing to publish) */
    exec_ok(db, "BEGIN");
    exec_ok(db, "SELECT idemq.emit(repeat('e', 255), repeat('r', 255), "
                "convert_to(repeat('b', 16777216), 'UTF8'), jsonb_build_object(repeat('n', 255), "
                "repeat('h', 30000)))");
    exec_ok(db, "UPDATE idemq.outbox SET state = 'parked', parked_at = now() "
                "WHERE id = currval('idemq.outbox_id_seq')");
    exec_ok(db, "COMMIT");
    PQfinish(db);
    /* an effect that emits a routing key built from its payload: the job
     * is parked with the code, nothing is emitted */
    snprintf(key, sizeof key, "%s:long", t.name);
    snprintf(b, sizeof b, "{\"job_id\":\"%s\",\"rk\":\"%0300d\"}", key, 7);
    itest_publish(&t, bs, 1);
    itest_run_until_idle(&t, 1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1", key), 1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM " OB_ALL " o WHERE key = $1", key), 0);
    snprintf(sql, sizeof sql, "%s", key);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key = $1 AND "
                                    "last_error LIKE '%routing key%'",
                                sql),
                     1);
    itest_teardown(&t);
}
END_TEST

/* Suspends (or resumes) the process of queue q on the broker: publishes
 * to it are taken but not confirmed meanwhile. */
static void queue_suspend(const char *q, bool suspend)
{
    ctl("eval '[sys:%s(amqqueue:get_pid(Q)) || Q <- rabbit_amqqueue:list(), "
        "element(4, amqqueue:get_name(Q)) =:= <<\"%s\">>].'",
        suspend ? "suspend" : "resume", q);
}

/* The lines of a log that hold needle, waiting up to ms for at least one. */
static int wait_log(const char *log, const char *needle, int ms)
{
    for (int i = 0; i < itest_ms(ms) / 100 && itest_count_lines(log, needle) == 0; i++)
        usleep(100000);
    return itest_count_lines(log, needle);
}

/* A publish the broker does not confirm (its queue's process suspended):
 * after the confirm wait the side channel is closed and the row given
 * back, uncounted, while the row beside it in the claim is sent; the
 * worker does not reconnect; once the queue answers again the row goes out
 * (again, same message_id: at least once) and is marked sent. */
START_TEST(test_confirm_timeout)
{
    struct itest t;
    char q[200], slow[220], sql[768], log[300], key[160], want[64];
    static char bodies[8][256], ids[8][64], keys[8][128];
    struct broker *b;
    char err[512];
    pid_t pid;
    int n, st;

    setup(&t, "obslow", "");
    declare_out(&t, q, sizeof q);
    snprintf(slow, sizeof slow, "%s.slow", t.name);
    ck_assert_msg(broker_open(t.conf, "outbox test", false, &b, err, sizeof err) == IDEMQ_OK,
                  "%s", err);
    ck_assert(broker_admin_declare_queue(b, slow, NULL, false) == IDEMQ_OK);
    ck_assert(broker_admin_purge(b, slow) == IDEMQ_OK);
    broker_close(b);
    queue_suspend(slow, true);
    snprintf(key, sizeof key, "%s:slow", t.name);
    snprintf(sql, sizeof sql,
             "SELECT idemq.emit('', '%s', 'slow', NULL, NULL, '%s'); "
             "SELECT idemq.emit('', '%s', 'fast', NULL, NULL, '%s:fast')",
             slow, key, q, t.name);
    itest_sql(&t, sql);
    snprintf(log, sizeof log, "%s/%s.log", getenv("IDEMQ_STATE_DIR"), t.name);
    pid = itest_spawn_log(t.cfg_path, 60, NULL, log);
    n = wait_log(log, "not all confirmed", 30000);
    queue_suspend(slow, false);
    ck_assert_msg(n >= 1, "no confirm timeout in %s", log);
    wait_long(&t, "SELECT count(*) FROM idemq.outbox_sent WHERE key = $1", key, 1, 30000);
    kill(pid, SIGTERM);
    st = itest_wait(pid, itest_ms(30000));
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "status 0x%x", st);
    ck_assert_msg(itest_count_lines(log, "NOT READY") == 0, "the worker reconnected: %s", log);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.outbox_sent WHERE key = $1 AND "
                                    "attempts = 1",
                                key),
                     1); /* the timeout counted nothing */
    ck_assert_int_eq(drain(&t, q, bodies, ids, keys, 8), 1);
    ck_assert_str_eq(bodies[0], "fast");
    snprintf(want, sizeof want, "outbox:%ld",
             itest_long(&t, "SELECT id FROM idemq.outbox_sent WHERE key = $1", key));
    n = drain(&t, slow, bodies, ids, keys, 8);
    ck_assert_msg(n >= 1 && n <= 4, "%d copies", n);
    for (int i = 0; i < n; i++)
        ck_assert_str_eq(ids[i], want);
    itest_teardown(&t);
}
END_TEST

/* The effect of the isolation case: emits one row and returns the
 * isolation level of its transaction. */
#define ISO_EFFECT                                                                           \
    "CREATE OR REPLACE FUNCTION idemq_test.emit_iso(p_key text, p_payload jsonb, p_meta "    \
    "jsonb) RETURNS jsonb LANGUAGE plpgsql AS $fn$ BEGIN "                                   \
    "PERFORM idemq.emit('', p_payload->>'rk', p_key, NULL, p_payload->>'ok', p_key); "       \
    "RETURN jsonb_build_object('iso', current_setting('transaction_isolation')); END $fn$"

/* Order per key holds whatever default_transaction_isolation the database
 * sets: the batch transactions that lease rows run at READ COMMITTED, and
 * idemq.outbox_take refuses to run at another level (its head test needs
 * a fresh snapshot per statement). */
START_TEST(test_isolation_pinned)
{
    struct itest t;
    char q[200], b[4][512], key[128], ok[128], out[64];
    const char *bs[4] = {b[0], b[1], b[2], b[3]};
    static char bodies[8][256], ids[8][64], keys[8][128];
    PGconn *db;
    PGresult *r;
    int st;

    itest_extra_conf = OUTBOX_CONF;
    itest_setup(&t, "obiso", "idemq_test.emit_iso", "", "emits = true;");
    itest_extra_conf = NULL;
    itest_sql(&t, ISO_EFFECT);
    declare_out(&t, q, sizeof q);
    snprintf(ok, sizeof ok, "%s:k", t.name);
    for (int i = 0; i < 4; i++) {
        snprintf(b[i], sizeof b[i], "{\"job_id\":\"%s:%d\",\"rk\":\"%s\",\"ok\":\"%s\"}", t.name,
                 i, q, ok);
    }
    itest_publish(&t, bs, 4);
    itest_sql(&t, "ALTER DATABASE idemq SET default_transaction_isolation = 'repeatable read'");
    st = itest_wait(itest_spawn(&t, t.cfg_path, 1, NULL), itest_ms(60000));
    /* outbox_take itself, at repeatable read */
    db = connect_db();
    query_text(db, "SHOW default_transaction_isolation", out, sizeof out);
    exec_ok(db, "BEGIN");
    exec_ok(db, "SELECT idemq.emit('', 'nowhere', 'iso', NULL, 'iso-test')");
    r = PQexec(db, "SELECT * FROM idemq.outbox_take('iso-test', 10, 1000)");
    itest_sql(&t, "ALTER DATABASE idemq RESET default_transaction_isolation");
    ck_assert_str_eq(out, "repeatable read");
    ck_assert_msg(PQresultErrorField(r, PG_DIAG_SQLSTATE) &&
                      strcmp(PQresultErrorField(r, PG_DIAG_SQLSTATE), "25000") == 0 &&
                      strstr(PQresultErrorMessage(r), "READ COMMITTED"),
                  "%s", PQresultErrorMessage(r));
    PQclear(r);
    exec_ok(db, "ROLLBACK");
    PQfinish(db);
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "status 0x%x", st);
    for (int i = 0; i < 4; i++) {
        snprintf(key, sizeof key, "%s:%d", t.name, i);
        ck_assert_str_eq(itest_text(&t, "SELECT result->>'iso' FROM idemq.job_info($1)",
                                    key, out, sizeof out),
                         "read committed");
    }
    ck_assert_int_eq(drain(&t, q, bodies, ids, keys, 8), 4);
    itest_teardown(&t);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("outbox");
    TCase *tc = tcase_create("outbox");
    tcase_set_timeout(tc, itest_ms(120));
    tcase_add_test(tc, test_effect_emits_once);
    tcase_add_test(tc, test_trace_context_continues);
    tcase_add_test(tc, test_application_emit);
    tcase_add_test(tc, test_commit_order);
    tcase_add_test(tc, test_unroutable_parked);
    tcase_add_test(tc, test_batch_refused_middle);
    tcase_add_test(tc, test_crash_after_commit);
    tcase_add_test(tc, test_crash_after_confirm);
    tcase_add_test(tc, test_broker_down);
    tcase_add_test(tc, test_metrics_and_ready);
    tcase_add_test(tc, test_two_relays);
    tcase_add_test(tc, test_privileges);
    tcase_add_test(tc, test_take_before_commit);
    tcase_add_test(tc, test_lease_ends_with_session);
    suite_add_tcase(s, tc);
    tc = tcase_create("outbox_kill"); /* three relays under a kill loop */
    tcase_set_timeout(tc, itest_ms(kill_secs() + 120));
    tcase_add_test(tc, test_relays_kill_loop);
    suite_add_tcase(s, tc);
    tc = tcase_create("outbox_refusals"); /* every refusal ends in a defined state */
    tcase_set_timeout(tc, itest_ms(120));
    tcase_add_test(tc, test_refused_rows_parked);
    tcase_add_test(tc, test_refused_forbidden);
    tcase_add_test(tc, test_emit_refuses);
    tcase_add_test(tc, test_isolation_pinned);
    tcase_add_test(tc, test_confirm_timeout);
    suite_add_tcase(s, tc);
    tc = tcase_create("outbox_sealed"); /* bodies sealed at rest */
    tcase_set_timeout(tc, itest_ms(120));
    tcase_add_test(tc, test_outbox_sealed);
    suite_add_tcase(s, tc);
    tc = tcase_create("outbox_show"); /* operator output */
    tcase_set_timeout(tc, itest_ms(120));
    tcase_add_test(tc, test_show_escaped);
    suite_add_tcase(s, tc);
    /* least-privilege mode (scripts/test): these again, as the deployment's roles */
    itest_lp_tcase(s, (const TTest *const[]){test_effect_emits_once, test_trace_context_continues,
                                          test_application_emit, test_outbox_sealed, NULL});
    return check_run(s);
}
