/*
 * Integration tests of ordered lanes: consistent-hash partitions with a
 * single active consumer each, in-place retries that hold only their lane,
 * on_park = hold_key, and the ledger's sequence guard (stale, gap,
 * deferred, drain, report) across replicas, failover and ring changes,
 * and a paused replica's give-back that keeps a standby from overtaking.
 * Real RabbitMQ and PostgreSQL (see itest.h). Sizes: LANES_KEYS (200).
 */
#include <check.h>

#include "check_run.h"
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "itest.h"
#include "topology.h"

#define SEQ_INPUT                                                                           \
    "order_key_source = \"json:authorization_id\"; sequence_source = \"json:seq\";"
#define EVENTS "idemq_demo.authorization_events"
/* Keys of this test whose events were applied out of sequence order. */
#define OUT_OF_ORDER                                                                        \
    "SELECT count(*) FROM (SELECT seq, lag(seq) OVER (PARTITION BY authorization_id "       \
    "ORDER BY id) AS prev FROM " EVENTS " WHERE authorization_id LIKE $1 || ':%') x "         \
    "WHERE prev IS NOT NULL AND seq <> prev + 1"
#define APPLIED_EVENTS "SELECT count(*) FROM " EVENTS " WHERE authorization_id LIKE $1 || ':%'"
#define DISTINCT_EVENTS                                                                     \
    "SELECT count(DISTINCT (authorization_id, seq)) FROM " EVENTS                          \
    " WHERE authorization_id LIKE $1 || ':%'"

static int env_int(const char *name, int def)
{
    const char *v = getenv(name);
    return v && atoi(v) > 0 ? atoi(v) : def;
}

/* The five events of an authorization: authorize 1000, capture 600,
 * capture 400, refund 300, refund 200. */
static const char *const KIND[6] = {"", "authorize", "capture", "capture", "refund", "refund"};
static const int AMOUNT[6] = {0, 1000, 600, 400, 300, 200};

static void event_body(struct itest *t, char *buf, size_t len, int auth, int seq,
                       const char *extra)
{
    snprintf(buf, len,
             "{\"job_id\":\"%s:a%d:%d\",\"authorization_id\":\"%s:a%d\",\"seq\":%d,"
             "\"kind\":\"%s\",\"amount_minor\":%d%s%s}",
             t->name, auth, seq, t->name, auth, seq, KIND[seq], AMOUNT[seq], extra ? "," : "",
             extra ? extra : "");
}

struct pub {
    struct itest *t;
    struct broker *b;
};

static void pub_open(struct pub *p, struct itest *t)
{
    char err[512];
    p->t = t;
    ck_assert_msg(broker_open(t->conf, "itest lanes publish", true, &p->b, err, sizeof err) == 0,
                  "%s", err);
}

/* Publishes event seq of authorization auth to the hash exchange, routed
 * (hashed) by its authorization id. */
static void pub_event(struct pub *p, int auth, int seq, const char *extra)
{
    char body[512], rk[128];
    event_body(p->t, body, sizeof body, auth, seq, extra);
    snprintf(rk, sizeof rk, "%s:a%d", p->t->name, auth);
    ck_assert_msg(broker_publish(p->b, p->t->conf->inputs[0].exchange, rk, body, strlen(body),
                                 NULL) == IDEMQ_OK,
                  "%s", broker_error(p->b));
}

static void pub_close(struct pub *p)
{
    ck_assert_msg(broker_wait_confirms(p->b, itest_ms(20000)) == IDEMQ_OK, "%s",
                  broker_error(p->b));
    broker_close(p->b);
}

static void wait_ok(pid_t pid, int ms)
{
    int st = itest_wait(pid, itest_ms(ms));
    ck_assert_msg(st != -1, "idemq did not finish in time");
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "idemq exited with status 0x%x", st);
}

static long ready_in_partitions(struct itest *t)
{
    long n = 0;
    for (int k = 0; k < t->conf->inputs[0].partitions; k++) {
        char q[TOPOLOGY_NAME_MAX];
        topology_partition_queue(&t->conf->inputs[0], k, q, sizeof q);
        n += itest_queue_ready(t, q);
    }
    return n;
}

static void event_key(struct itest *t, char *buf, size_t len, int auth, int seq)
{
    snprintf(buf, len, "%s:a%d:%d", t->name, auth, seq);
}

/* 1. keys x 5 sequenced events, some per-key orders shuffled and some events
 * duplicated, 3 replicas over 8 partitions: every event applied exactly
 * once, in sequence order per key; no refund before its capture. */
START_TEST(test_replicas_apply_in_order)
{
    struct itest t;
    struct pub p;
    pid_t pids[3];
    int keys = env_int("LANES_KEYS", 200);
    static const int shuffled[5] = {1, 3, 2, 5, 4};
    itest_setup(&t, "order", "idemq_test.authorization", "batch_max = 50;",
                "partitions = 8; " SEQ_INPUT);
    pub_open(&p, &t);
    for (int a = 0; a < keys; a++) {
        for (int i = 0; i < 5; i++) {
            int seq = a % 4 == 1 ? shuffled[i] : i + 1;
            pub_event(&p, a, seq, NULL);
            if (a % 7 == 3 && seq == 2)
                pub_event(&p, a, seq, NULL); /* a duplicate delivery */
        }
    }
    pub_close(&p);
    for (int r = 0; r < 3; r++)
        pids[r] = itest_spawn(&t, t.cfg_path, 3, NULL);
    for (int r = 0; r < 3; r++)
        wait_ok(pids[r], 120000);
    ck_assert_int_eq(itest_long(&t, APPLIED_EVENTS, t.name), 5L * keys);
    ck_assert_int_eq(itest_long(&t, DISTINCT_EVENTS, t.name), 5L * keys);
    ck_assert_int_eq(itest_long(&t, OUT_OF_ORDER, t.name), 0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key LIKE $1 || ':%'",
                                t.name),
                     0);
    /* shuffled keys were really deferred and drained */
    ck_assert_int_gt(itest_long(&t, "SELECT count(*) FROM idemq.attempts WHERE outcome = "
                                    "'deferred' AND key LIKE $1 || ':%'",
                                t.name),
                     0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.deferred WHERE key LIKE $1 || ':%'",
                                t.name),
                     0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq_demo.authorizations WHERE "
                                    "authorization_id LIKE $1 || ':%' AND captured_minor = 1000 "
                                    "AND refunded_minor = 500",
                                t.name),
                     keys);
    ck_assert_int_eq(ready_in_partitions(&t), 0);
    itest_teardown(&t);
}
END_TEST

/* 2. The active replica is SIGKILLed mid-run: the standby (single active
 * consumer) takes over; nothing lost, duplicated or reordered. */
START_TEST(test_failover_keeps_order)
{
    struct itest t;
    struct pub p;
    pid_t a, b;
    int keys = env_int("LANES_KEYS", 200) / 2;
    itest_setup(&t, "failover", "idemq_test.authorization", "batch_max = 20;",
                "partitions = 4; " SEQ_INPUT);
    pub_open(&p, &t);
    for (int k = 0; k < keys; k++)
        for (int seq = 1; seq <= 5; seq++)
            pub_event(&p, k, seq, "\"sleep_ms\":4");
    pub_close(&p);
    a = itest_spawn(&t, t.cfg_path, 4, NULL);
    usleep(700000);
    b = itest_spawn(&t, t.cfg_path, 4, NULL); /* waits as the standby of every partition */
    /* kill the active one mid-run, once it has applied something */
    for (int i = 0; i < 200 && itest_long(&t, APPLIED_EVENTS, t.name) < 25; i++)
        usleep(50000);
    ck_assert_int_gt(itest_long(&t, APPLIED_EVENTS, t.name), 0);
    ck_assert_int_lt(itest_long(&t, APPLIED_EVENTS, t.name), 5L * keys);
    kill(a, SIGKILL);
    waitpid(a, NULL, 0);
    wait_ok(b, 120000);
    ck_assert_int_eq(itest_long(&t, APPLIED_EVENTS, t.name), 5L * keys);
    ck_assert_int_eq(itest_long(&t, DISTINCT_EVENTS, t.name), 5L * keys);
    ck_assert_int_eq(itest_long(&t, OUT_OF_ORDER, t.name), 0);
    ck_assert_int_eq(ready_in_partitions(&t), 0);
    itest_teardown(&t);
}
END_TEST

/* 3a. A transient failure in a lane: the lane's later messages (other keys
 * too) wait behind it, in place; then all apply in delivery order. */
START_TEST(test_transient_holds_lane)
{
    struct itest t;
    struct pub p;
    char k1[160];
    itest_retry_conf = "base_delay_ms = 300; max_delay_ms = 1000; max_attempts = 4; "
                       "jitter = \"none\";";
    itest_setup(&t, "hold", "idemq_test.authorization", "",
                "partitions = 1; order_key_source = \"json:authorization_id\";");
    pub_open(&p, &t);
    pub_event(&p, 1, 1, "\"raise\":\"40001\",\"raise_until\":2"); /* fails twice */
    pub_event(&p, 2, 1, NULL);                                       /* another key, same lane */
    pub_event(&p, 1, 2, NULL);
    pub_close(&p);
    itest_run_until_idle(&t, 3);
    event_key(&t, k1, sizeof k1, 1, 1);
    ck_assert_int_eq(itest_long(&t, "SELECT attempts FROM idemq.jobs WHERE key = $1 AND state = "
                                    "'applied'",
                                k1),
                     3);
    ck_assert_int_eq(itest_long(&t, APPLIED_EVENTS, t.name), 3);
    /* delivery order: a1 authorize, a2 authorize, a1 capture */
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM (SELECT idempotency_key, row_number() "
                                    "OVER (ORDER BY id) AS n FROM " EVENTS " WHERE "
                                    "authorization_id LIKE $1 || ':%') x WHERE "
                                    "(n = 1 AND idempotency_key LIKE '%:a1:1') OR (n = 2 AND "
                                    "idempotency_key LIKE '%:a2:1') OR (n = 3 AND "
                                    "idempotency_key LIKE '%:a1:2')",
                                t.name),
                     3);
    /* the retries waited in place (no delay bucket), at least the backoff */
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.attempts WHERE key = $1 AND "
                                    "outcome = 'transient_error'",
                                k1),
                     2);
    ck_assert_int_ge(itest_long(&t, "SELECT extract(epoch FROM (SELECT min(applied_at) FROM "
                                    "idemq.jobs WHERE key LIKE $1 || ':a2:%') - (SELECT "
                                    "min(started_at) FROM idemq.attempts WHERE key LIKE $1 || "
                                    "':a1:1')) * 1000",
                                t.name),
                     900 - 50);
    ck_assert_int_eq(ready_in_partitions(&t), 0);
    itest_teardown(&t);
    itest_retry_conf = NULL;
}
END_TEST

/* 3b. on_park = hold_key: a parked key holds only its own successors (in the
 * ledger); other keys of the lane flow; after a redrive all apply in order.
 * With the sequence guard, and with an ordering key alone. */
static void hold_key_case(bool with_sequence)
{
    struct itest t;
    struct pub p;
    char k1[160], k2[160], sql[512], out[8192];
    itest_retry_conf = "base_delay_ms = 100; max_delay_ms = 200; max_attempts = 2; "
                       "jitter = \"none\";";
    itest_setup(&t, "holdkey", "idemq_test.authorization", "",
                with_sequence ? "partitions = 1; on_park = \"hold_key\"; " SEQ_INPUT
                              : "partitions = 1; on_park = \"hold_key\"; "
                                "order_key_source = \"json:authorization_id\";");
    event_key(&t, k1, sizeof k1, 1, 1);
    event_key(&t, k2, sizeof k2, 1, 2);
    snprintf(sql, sizeof sql, "INSERT INTO idemq_test.failing VALUES ('%s', '40001')", k1);
    itest_sql(&t, sql);
    pub_open(&p, &t);
    pub_event(&p, 1, 1, NULL); /* fails until an operator fixes it: parks */
    pub_event(&p, 1, 2, NULL); /* held with its key */
    pub_event(&p, 2, 1, NULL);
    pub_event(&p, 2, 2, NULL);
    pub_close(&p);
    itest_run_until_idle(&t, 2);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key = $1 AND state = "
                                    "'parked'",
                                k1),
                     1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.deferred WHERE key = $1", k2), 1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM " EVENTS " WHERE authorization_id "
                                    "LIKE $1 || ':a2'",
                                t.name),
                     2);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM " EVENTS " WHERE authorization_id "
                                    "LIKE $1 || ':a1'",
                                t.name),
                     0);
    /* the operator fixes the cause and redrives */
    snprintf(sql, sizeof sql, "DELETE FROM idemq_test.failing WHERE key = '%s'", k1);
    itest_sql(&t, sql);
    ck_assert_int_eq(itest_idemq(&t, "redrive", out, sizeof out), 0);
    itest_run_until_idle(&t, 2);
    ck_assert_int_eq(itest_long(&t, APPLIED_EVENTS, t.name), 4);
    ck_assert_int_eq(itest_long(&t, OUT_OF_ORDER, t.name), 0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.deferred WHERE key = $1", k2), 0);
    itest_teardown(&t);
    itest_retry_conf = NULL;
}

START_TEST(test_hold_key_after_park)
{
    hold_key_case(true);
}
END_TEST

START_TEST(test_hold_key_without_sequence)
{
    hold_key_case(false);
}
END_TEST

/* 4. A gap never filled: the successor stays deferred (not applied), is
 * reported once it is older than deferred_report_after_s, and `jobs show`
 * tells why it waits. */
START_TEST(test_gap_reported_not_applied)
{
    struct itest t;
    struct pub p;
    char k3[160], args[256], out[8192];
    itest_setup(&t, "gap", "idemq_test.authorization", "",
                "partitions = 2; deferred_report_after_s = 1; " SEQ_INPUT);
    pub_open(&p, &t);
    pub_event(&p, 1, 1, NULL);
    pub_event(&p, 1, 3, NULL); /* seq 2 never comes */
    pub_close(&p);
    itest_run_until_idle(&t, 3);
    event_key(&t, k3, sizeof k3, 1, 3);
    ck_assert_int_eq(itest_long(&t, APPLIED_EVENTS, t.name), 1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key = $1 AND state = "
                                    "'deferred'",
                                k3),
                     1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.deferred WHERE key = $1 AND "
                                    "reason = 'gap' AND seq = 3 AND reported_at IS NOT NULL",
                                k3),
                     1);
    snprintf(args, sizeof args, "jobs show %s", k3);
    ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "state deferred") != NULL, "%s", out);
    ck_assert_msg(strstr(out, "waits for 2") != NULL, "%s", out);
    ck_assert_msg(strstr(out, "reported as overdue") != NULL, "%s", out);
    ck_assert_int_eq(ready_in_partitions(&t), 0);
    itest_teardown(&t);
}
END_TEST

/* A deferred successor whose effect then fails transiently retries from the
 * ledger (it has no delivery any more), after its backoff, and applies in
 * order; `run --until-idle` waits for it instead of leaving it behind. */
START_TEST(test_deferred_retries_from_ledger)
{
    struct itest t;
    struct pub p;
    char k2[160];
    itest_retry_conf = "base_delay_ms = 1500; max_delay_ms = 3000; jitter = \"none\";";
    itest_setup(&t, "dretry", "idemq_test.authorization", "", "partitions = 1; " SEQ_INPUT);
    pub_open(&p, &t);
    pub_event(&p, 1, 2, "\"raise\":\"40001\",\"raise_until\":1"); /* first: deferred */
    pub_event(&p, 1, 1, NULL);
    pub_close(&p);
    itest_run_until_idle(&t, 1); /* shorter than the 1.5 s backoff */
    event_key(&t, k2, sizeof k2, 1, 2);
    ck_assert_int_eq(itest_long(&t, APPLIED_EVENTS, t.name), 2);
    ck_assert_int_eq(itest_long(&t, OUT_OF_ORDER, t.name), 0);
    ck_assert_int_eq(itest_long(&t, "SELECT attempts FROM idemq.jobs WHERE key = $1 AND state = "
                                    "'applied'",
                                k2),
                     2);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.attempts WHERE key = $1 AND "
                                    "outcome = 'transient_error' AND sqlstate = '40001'",
                                k2),
                     1);
    /* the retry honoured the backoff */
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.attempts a JOIN idemq.attempts b "
                                    "ON b.key = a.key AND b.outcome = 'applied' WHERE a.key = $1 "
                                    "AND a.outcome = 'transient_error' AND b.started_at >= "
                                    "a.finished_at + interval '1450 ms'",
                                k2),
                     1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.deferred WHERE key = $1", k2), 0);
    itest_teardown(&t);
    itest_retry_conf = NULL;
}
END_TEST

/* 5. The hash ring shrinks while a replica runs (partition p4 is unbound
 * with a backlog): later events of its keys land in other partitions before
 * their predecessors; the guard defers them until the backlog is drained
 * by a replica configured with the old ring. No reordering. */
START_TEST(test_ring_change_keeps_order)
{
    struct itest t;
    struct pub p;
    struct broker *b;
    char err[512], cfg4[300], q4[TOPOLOGY_NAME_MAX];
    pid_t small, big;
    int keys = env_int("LANES_KEYS", 200) / 4;
    itest_setup(&t, "ring", "idemq_test.authorization", "",
                "partitions = 5; " SEQ_INPUT);
    snprintf(cfg4, sizeof cfg4, "%s.4.cfg", t.cfg_path);
    itest_write_config(&t, cfg4, t.name, "idemq_test.authorization", "",
                       "partitions = 4; " SEQ_INPUT);
    pub_open(&p, &t);
    for (int k = 0; k < keys; k++)
        for (int seq = 1; seq <= 2; seq++)
            pub_event(&p, k, seq, NULL);
    pub_close(&p);
    topology_partition_queue(&t.conf->inputs[0], 4, q4, sizeof q4);
    ck_assert_int_gt(itest_queue_ready(&t, q4), 0);
    small = itest_spawn(&t, cfg4, 4, NULL); /* consumes p0..p3 only */
    usleep(1000000);
    /* the ring shrinks: p4 leaves the exchange with its backlog */
    ck_assert_msg(broker_open(t.conf, "itest ring", false, &b, err, sizeof err) == 0, "%s", err);
    ck_assert_msg(broker_admin_unbind(b, q4, t.conf->inputs[0].exchange, "1") == IDEMQ_OK, "%s",
                  broker_error(b));
    broker_close(b);
    pub_open(&p, &t);
    for (int k = 0; k < keys; k++)
        for (int seq = 3; seq <= 5; seq++)
            pub_event(&p, k, seq, NULL);
    pub_close(&p);
    for (int i = 0; i < 200 && itest_long(&t, "SELECT count(*) FROM idemq.deferred WHERE key "
                                              "LIKE $1 || ':%'",
                                          t.name) == 0;
         i++)
        usleep(50000);
    /* successors of p4's keys arrived first: deferred, not applied */
    ck_assert_int_gt(itest_long(&t, "SELECT count(*) FROM idemq.deferred WHERE key LIKE $1 || ':%'",
                                t.name),
                     0);
    ck_assert_int_eq(itest_long(&t, OUT_OF_ORDER, t.name), 0);
    big = itest_spawn(&t, t.cfg_path, 4, NULL); /* the old ring: drains p4 */
    wait_ok(big, 120000);
    wait_ok(small, 120000);
    ck_assert_int_eq(itest_long(&t, APPLIED_EVENTS, t.name), 5L * keys);
    ck_assert_int_eq(itest_long(&t, DISTINCT_EVENTS, t.name), 5L * keys);
    ck_assert_int_eq(itest_long(&t, OUT_OF_ORDER, t.name), 0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.deferred WHERE key LIKE $1 || ':%'",
                                t.name),
                     0);
    unlink(cfg4);
    itest_teardown(&t);
}
END_TEST

/* 6. A give-back on the active replica (its database session killed while
 * a transient failure holds its lane's deliveries) hands the lane to the
 * standby replica (single active consumer) with the held deliveries first:
 * no later message of the order key is applied before the returned earlier
 * ones. An ordering key without a sequence: only the broker keeps order.
 * Both queue types. */
#define GB_MSGS 20
/* Effects of this test applied after a later seq of their order key. */
#define GB_OUT_OF_ORDER                                                                      \
    "SELECT count(*) FROM (SELECT (payload->>'seq')::int AS seq, lag((payload->>'seq')::int) " \
    "OVER (ORDER BY id) AS prev FROM idemq_test.effects WHERE key LIKE $1 || ':%') x "        \
    "WHERE prev IS NOT NULL AND seq < prev"
#define GB_WORKERS                                                                           \
    "FROM pg_stat_activity WHERE datname = current_database() AND application_name LIKE "    \
    "'idemq worker %'"
static void giveback_order_case(const char *queue_type)
{
    struct itest t;
    struct pub p;
    char extra[256], first[160], sql[512], pids[1024], order[512], q[TOPOLOGY_NAME_MAX];
    pid_t a, b;
    itest_retry_conf = "base_delay_ms = 300; max_delay_ms = 300; max_attempts = 40; "
                       "jitter = \"none\";";
    itest_broker_conf = "prefetch = 5;";
    snprintf(extra, sizeof extra,
             "partitions = 1; order_key_source = \"json:k\"; queue_type = \"%s\";", queue_type);
    itest_setup(&t, "gborder", "idemq_test.record", "batch_max = 5;", extra);
    itest_broker_conf = NULL;
    topology_partition_queue(&t.conf->inputs[0], 0, q, sizeof q);
    /* the first message fails (transient) until the test lets it pass:
     * replica A holds it and the deliveries behind it in its lane */
    snprintf(first, sizeof first, "%s:1", t.name);
    snprintf(sql, sizeof sql, "INSERT INTO idemq_test.failing VALUES ('%s', '40001')", first);
    itest_sql(&t, sql);
    pub_open(&p, &t);
    for (int i = 1; i <= GB_MSGS; i++) {
        char body[256], rk[128];
        snprintf(rk, sizeof rk, "%s:k", t.name);
        snprintf(body, sizeof body, "{\"job_id\":\"%s:%d\",\"k\":\"%s\",\"seq\":%d}", t.name, i,
                 rk, i);
        ck_assert_msg(broker_publish(p.b, t.conf->inputs[0].exchange, rk, body, strlen(body),
                                     NULL) == IDEMQ_OK,
                      "%s", broker_error(p.b));
    }
    pub_close(&p);
    a = itest_spawn(&t, t.cfg_path, 4, NULL);
    for (int i = 0; i < 200 && itest_long(&t, "SELECT count(*) FROM idemq.attempts WHERE key = "
                                              "$1 AND outcome = 'transient_error'",
                                          first) < 2;
         i++)
        usleep(50000);
    ck_assert_int_ge(itest_long(&t, "SELECT count(*) FROM idemq.attempts WHERE key = $1 AND "
                                    "outcome = 'transient_error'",
                                first),
                     2);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq_test.effects WHERE key LIKE $1 "
                                    "|| ':%'",
                                t.name),
                     0);
    /* A's database sessions, before B has any */
    itest_text(&t, "SELECT coalesce(string_agg(pid::text, ','), '') " GB_WORKERS " AND $1 = $1",
               t.name, pids, sizeof pids);
    ck_assert_msg(pids[0] != '\0', "replica A has no database session");
    b = itest_spawn(&t, t.cfg_path, 4, NULL); /* the standby */
    for (int i = 0; i < 100 && itest_queue_consumers(&t, q) < 2; i++)
        usleep(50000);
    usleep(300000);
    /* A's session dies (STEP_INFRA): A gives its lane back */
    ck_assert_int_ge(itest_long(&t, "SELECT count(pg_terminate_backend(pid)) " GB_WORKERS
                                    " AND pid = ANY (string_to_array($1, ',')::int[])",
                                pids),
                     1);
    snprintf(sql, sizeof sql, "DELETE FROM idemq_test.failing WHERE key = '%s'", first);
    itest_sql(&t, sql);
    wait_ok(b, 120000);
    wait_ok(a, 120000);
    ck_assert_int_eq(itest_long(&t, "SELECT count(DISTINCT key) FROM idemq_test.effects WHERE "
                                    "key LIKE $1 || ':%'",
                                t.name),
                     GB_MSGS);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq_test.effects WHERE key LIKE $1 "
                                    "|| ':%'",
                                t.name),
                     GB_MSGS);
    itest_text(&t, "SELECT string_agg(payload->>'seq', ' ' ORDER BY id) FROM idemq_test.effects "
                   "WHERE key LIKE $1 || ':%'",
               t.name, order, sizeof order);
    ck_assert_msg(itest_long(&t, GB_OUT_OF_ORDER, t.name) == 0, "%s queue: applied in the order %s",
                  queue_type, order);
    ck_assert_int_eq(ready_in_partitions(&t), 0);
    itest_teardown(&t);
    itest_retry_conf = NULL;
}

START_TEST(test_giveback_keeps_order_classic)
{
    giveback_order_case("classic");
}
END_TEST

START_TEST(test_giveback_keeps_order_quorum)
{
    giveback_order_case("quorum");
}
END_TEST

int main(void)
{
    Suite *s = suite_create("lanes");
    TCase *tc = tcase_create("lanes");
    tcase_set_timeout(tc, itest_ms(240));
    tcase_add_test(tc, test_replicas_apply_in_order);
    tcase_add_test(tc, test_failover_keeps_order);
    tcase_add_test(tc, test_transient_holds_lane);
    tcase_add_test(tc, test_hold_key_after_park);
    tcase_add_test(tc, test_hold_key_without_sequence);
    tcase_add_test(tc, test_gap_reported_not_applied);
    tcase_add_test(tc, test_ring_change_keeps_order);
    tcase_add_test(tc, test_deferred_retries_from_ledger);
    suite_add_tcase(s, tc);
    tc = tcase_create("giveback"); /* CK_RUN_CASE=giveback runs these alone */
    tcase_set_timeout(tc, itest_ms(240));
    tcase_add_test(tc, test_giveback_keeps_order_classic);
    tcase_add_test(tc, test_giveback_keeps_order_quorum);
    suite_add_tcase(s, tc);
    return check_run(s);
}
