/*
 * Integration tests of PostgreSQL queue inputs (transport = "postgres",
 * adapters/pgq.h, consumer/pgq_worker.h) against the real PostgreSQL (see
 * itest.h; the broker is not used by these inputs). Each row of the
 * boundary table in adapters/PORT.md has its test here: a rolled-back
 * enqueue never runs, two enqueues of one key apply once, rows of one
 * order key apply in enqueue order, a transient failure is retried from
 * its row with every attempt in the history, a permanent one is parked
 * with its payload and redriven back into the queue, a notification wakes
 * an idle worker at once, two `idemq run` replicas apply every key exactly
 * once, the enqueue's limits answer with their SQLSTATEs, and
 * check-config refuses what a postgres input cannot be.
 */
#include <check.h>

#include "check_run.h"
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "itest.h"
#include "tprov.h"

/* 1 when every pgq worker session of the cluster is connected and idle
 * (waiting for a NOTIFY or its next look), at least one of them. */
#define PGQ_WORKERS_IDLE                                                                     \
    "SELECT (count(*) FILTER (WHERE state = 'idle') >= 1 AND "                              \
    "count(*) FILTER (WHERE state <> 'idle') = 0)::int FROM pg_stat_activity "              \
    "WHERE application_name LIKE 'idemq pgq worker %%'"

/* Extra top-level lines of the next config written (e.g. a database
 * group), or NULL. */
static const char *pg_extra_top;
/* The effect of the next config written; NULL = idemq_test.record. */
static const char *pg_effect;

/* Writes a config with one postgres input, queue = the test's name. */
static void write_pg_config(struct itest *t, const char *path, const char *extra_consumer,
                            const char *extra_input)
{
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fprintf(f,
            "retry: { base_delay_ms = 200; max_delay_ms = 2000; jitter = \"none\"; "
            "max_attempts = 5; };\n"
            "%s\n"
            "consumer: { id = \"%s\"; %s };\n"
            "log: { level = \"info\"; };\n"
            "inputs = ( { name = \"%s\"; transport = \"postgres\"; queue = \"%s\";\n"
            "  effect_function = \"%s\"; %s } );\n",
            pg_extra_top ? pg_extra_top : "", t->name, extra_consumer ? extra_consumer : "",
            t->name, t->name, pg_effect ? pg_effect : "idemq_test.record",
            extra_input ? extra_input : "");
    fclose(f);
}

/* Runs `idemq run` on the postgres config to idleness; asserts exit 0. */
static void run_pg(const char *cfg, int idle_s)
{
    pid_t pid = itest_spawn(NULL, cfg, idle_s, NULL);
    int st = itest_wait(pid, itest_ms(60000));
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "idemq run failed: %d",
                  st);
}

/* A query's first value as a long, the SQL built with printf. */
static long qlong(struct itest *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static long qlong(struct itest *t, const char *fmt, ...)
{
    char sql[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(sql, sizeof sql, fmt, ap);
    va_end(ap);
    return itest_long(t, sql, NULL);
}

static void qexec(struct itest *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void qexec(struct itest *t, const char *fmt, ...)
{
    char sql[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(sql, sizeof sql, fmt, ap);
    va_end(ap);
    itest_sql(t, sql);
}

/* The SQLSTATE a statement fails with ("" when it succeeds). */
static const char *sqlstate_of(struct itest *t, const char *sql, char buf[6])
{
    PGresult *r = PQexec(t->db, sql);
    const char *s = PQresultErrorField(r, PG_DIAG_SQLSTATE);
    snprintf(buf, 6, "%s", PQresultStatus(r) == PGRES_TUPLES_OK ? "" : s ? s : "?");
    PQclear(r);
    return buf;
}

static void setup(struct itest *t, const char *tag, char *cfg, size_t len,
                  const char *extra_consumer, const char *extra_input)
{
    itest_setup(t, tag, "idemq_test.record", "", "");
    snprintf(cfg, len, "/tmp/%s.pg.cfg", t->name);
    write_pg_config(t, cfg, extra_consumer, extra_input);
}

START_TEST(test_rolled_back_enqueue_never_runs)
{
    struct itest t;
    char cfg[300];
    setup(&t, "pgq_rb", cfg, sizeof cfg, "", "");
    qexec(&t, "BEGIN; SELECT idemq.enqueue('%s', '{\"job_id\":\"%s:rb\"}'); ROLLBACK", t.name,
          t.name);
    qexec(&t, "BEGIN; SELECT idemq.enqueue('%s', '{\"job_id\":\"%s:ok\"}'); COMMIT", t.name,
          t.name);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.queue_jobs WHERE queue = '%s'",
                           t.name), 1);
    run_pg(cfg, 1);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq_test.effects WHERE key = '%s:ok'",
                           t.name), 1);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq_test.effects WHERE key = '%s:rb'",
                           t.name), 0);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.jobs WHERE key = '%s:rb'", t.name),
                     0);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.queue_jobs WHERE queue = '%s'",
                           t.name), 0);
    itest_teardown(&t);
}
END_TEST

START_TEST(test_two_enqueues_of_one_key)
{
    struct itest t;
    char cfg[300];
    /* the enqueue's key argument is the business key */
    setup(&t, "pgq_dup", cfg, sizeof cfg, "", "key_source = \"key\";");
    qexec(&t, "SELECT idemq.enqueue('%s', '{\"amount\":1}', '%s:k')", t.name, t.name);
    qexec(&t, "SELECT idemq.enqueue('%s', '{\"amount\":1}', '%s:k')", t.name, t.name);
    /* a row without the key argument has no business key: parked */
    qexec(&t, "SELECT idemq.enqueue('%s', '{\"amount\":2}')", t.name);
    /* a key longer than the enqueue allows, written around it: parked, never cut */
    qexec(&t, "INSERT INTO idemq.queue_jobs (queue, key, payload) VALUES ('%s', '%s:' || "
              "repeat('k', 300), '\\x7b7d')", t.name, t.name);
    run_pg(cfg, 1);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.parked WHERE source_queue = '%s' "
                               "AND error_code = 'key_too_long'", t.name), 1);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq_test.effects WHERE key LIKE "
                               "'%s:kkk%%'", t.name), 0);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq_test.effects WHERE key = '%s:k'",
                           t.name), 1);
    /* the second copy is a duplicate in the history: an attempt row, or
     * (plain path, both rows in one batch) a later copy in the batch row */
    ck_assert_int_eq(qlong(&t, "SELECT (SELECT count(*) FROM idemq.attempts WHERE key = '%s:k' "
                               "AND outcome = 'duplicate') + (SELECT count(*) FROM "
                               "idemq.key_batches('%s:k', NULL, NULL) WHERE NOT applied)",
                           t.name, t.name), 1);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.parked WHERE source_queue = '%s' "
                               "AND error_code = 'key_missing'", t.name), 1);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.queue_jobs WHERE queue = '%s'",
                           t.name), 0);
    itest_teardown(&t);
}
END_TEST

START_TEST(test_order_per_key)
{
    struct itest t;
    char cfg[300];
    /* three workers, batches of 4: only the head of each order key is taken */
    setup(&t, "pgq_ord", cfg, sizeof cfg, "workers = 3; batch_max = 4;", "");
    for (int i = 0; i < 30; i++)
        qexec(&t, "SELECT idemq.enqueue('%s', '{\"job_id\":\"%s:%d\"%s}', NULL, 'acct%d')",
              t.name, t.name, i, i % 7 == 0 ? ",\"sleep_ms\":100" : "", i % 3);
    run_pg(cfg, 1);
    ck_assert_int_eq(qlong(&t, "SELECT count(DISTINCT key) FROM idemq_test.effects WHERE key "
                               "LIKE '%s:%%'", t.name), 30);
    /* per order key (i %% 3), the effects' ids follow i */
    ck_assert_int_eq(qlong(&t,
                           "SELECT count(*) FROM (SELECT split_part(key, ':', 2)::int AS i, "
                           "lag(split_part(key, ':', 2)::int) OVER (PARTITION BY "
                           "split_part(key, ':', 2)::int %% 3 ORDER BY id) AS prev "
                           "FROM idemq_test.effects WHERE key LIKE '%s:%%') x "
                           "WHERE prev IS NOT NULL AND prev > i", t.name), 0);
    itest_teardown(&t);
}
END_TEST

START_TEST(test_due_time_and_priority)
{
    struct itest t;
    char cfg[300];
    /* one worker taking one row at a time: the claim order is the apply order */
    setup(&t, "pgq_due", cfg, sizeof cfg, "workers = 1; batch_max = 1;", "");
    /* due at one moment in the past: priority decides, lower first, then id */
    qexec(&t, "SELECT idemq.enqueue('%s', jsonb_build_object('job_id', '%s:p' || p), NULL, "
              "NULL, timestamptz '2026-01-01 00:00:00+00', p) FROM unnest(ARRAY[5, -3, 0, 2]) p",
          t.name, t.name);
    /* due later than everything else, whatever its priority */
    qexec(&t, "CREATE TEMP TABLE pgq_due AS SELECT now() + interval '1500 ms' AS at, "
              "idemq.enqueue('%s', '{\"job_id\":\"%s:late\"}', NULL, NULL, now() + "
              "interval '1500 ms', -100) AS id", t.name, t.name);
    run_pg(cfg, 3);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM (SELECT key, row_number() OVER (ORDER BY "
                               "id) AS n FROM idemq_test.effects WHERE key LIKE '%s:%%') x "
                               "WHERE (n, key) NOT IN ((1, '%s:p-3'), (2, '%s:p0'), "
                               "(3, '%s:p2'), (4, '%s:p5'), (5, '%s:late'))",
                           t.name, t.name, t.name, t.name, t.name, t.name), 0);
    /* never before its run_after */
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq_test.effects e, pgq_due d WHERE "
                               "e.key = '%s:late' AND e.created_at >= d.at", t.name), 1);
    itest_teardown(&t);
}
END_TEST

START_TEST(test_queue_gauges)
{
    struct itest t;
    char cfg[300], top[128], url[128], body[65536];
    int port = itest_free_port();
    pid_t pid;
    int st;
    snprintf(top, sizeof top, "metrics: { listen = \"127.0.0.1:%d\"; };", port);
    pg_extra_top = top;
    setup(&t, "pgq_gauge", cfg, sizeof cfg, "", "");
    pg_extra_top = NULL;
    /* three rows due in an hour: they stay in the queue while it runs */
    qexec(&t, "SELECT idemq.enqueue('%s', jsonb_build_object('job_id', '%s:' || g), NULL, NULL, "
              "now() + interval '1 hour') FROM generate_series(1, 3) g", t.name, t.name);
    pid = itest_spawn(&t, cfg, 30, NULL);
    snprintf(url, sizeof url, "http://127.0.0.1:%d/metrics", port);
    {
        char want[256];
        snprintf(want, sizeof want, "idemq_queue_rows{input=\"%s\"} 3\n", t.name);
        /* the gauges are refreshed every few seconds: poll until they hold the rows */
        for (long long end = itest_mono_ms() + itest_ms(15000);
             (itest_http_get(url, body, sizeof body) != 200 || !strstr(body, want)) &&
             itest_mono_ms() < end;)
            usleep(100 * 1000);
        ck_assert_msg(strstr(body, want) != NULL, "%s", body);
        snprintf(want, sizeof want, "idemq_queue_ready_rows{input=\"%s\"} 0\n", t.name);
        ck_assert_msg(strstr(body, want) != NULL, "%s", body);
        ck_assert_ptr_nonnull(strstr(body, "idemq_queue_gauges_up 1\n"));
    }
    ck_assert_int_eq(kill(pid, SIGTERM), 0);
    st = itest_wait(pid, itest_ms(30000));
    ck_assert(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq_test.effects WHERE key LIKE '%s:%%'",
                           t.name), 0);
    qexec(&t, "DELETE FROM idemq.queue_jobs WHERE queue = '%s'", t.name);
    itest_teardown(&t);
}
END_TEST

/* A metric's value in a /metrics page: the line that begins with
 * line_start (-1 when absent; never a HELP or TYPE line). */
static long metric_of(const char *body, const char *line_start)
{
    size_t n = strlen(line_start);
    for (const char *p = body; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
        if (strncmp(p, line_start, n) == 0)
            return strtol(p + n, NULL, 10);
    return -1;
}

/* The workers' counts on /metrics, by input, match the ledger: admitted
 * (rows taken) vs completed, applied, duplicates, retried, parked. /ready
 * answers 200 while the workers take rows. */
START_TEST(test_worker_metrics_and_ready)
{
    struct itest t;
    char cfg[300], top[128], url[128], rurl[128], body[65536], want[256];
    int port = itest_free_port();
    long applied, parked, retried, admitted;
    pid_t pid;
    int st;
    snprintf(top, sizeof top, "metrics: { listen = \"127.0.0.1:%d\"; };", port);
    pg_extra_top = top;
    setup(&t, "pgq_wmet", cfg, sizeof cfg, "", "");
    pg_extra_top = NULL;
    /* 5 applied, one of them enqueued twice (a duplicate), one retried
     * once then applied, one parked */
    qexec(&t, "SELECT idemq.enqueue('%s', jsonb_build_object('job_id', '%s:' || g)) "
              "FROM generate_series(1, 5) g", t.name, t.name);
    qexec(&t, "SELECT idemq.enqueue('%s', '{\"job_id\":\"%s:1\"}')", t.name, t.name);
    qexec(&t, "SELECT idemq.enqueue('%s', '{\"job_id\":\"%s:r\",\"raise\":\"40001\","
              "\"raise_until\":1}')", t.name, t.name);
    qexec(&t, "INSERT INTO idemq_test.failing VALUES ('%s:p', '22012')", t.name);
    qexec(&t, "SELECT idemq.enqueue('%s', '{\"job_id\":\"%s:p\"}')", t.name, t.name);
    pid = itest_spawn(&t, cfg, 30, NULL);
    snprintf(url, sizeof url, "http://127.0.0.1:%d/metrics", port);
    snprintf(rurl, sizeof rurl, "http://127.0.0.1:%d/ready", port);
    snprintf(want, sizeof want, "idemq_pgq_rows_total{input=\"%s\",outcome=\"completed\"} 8\n",
             t.name);
    for (long long end = itest_mono_ms() + itest_ms(20000);
         (itest_http_get(url, body, sizeof body) != 200 || !strstr(body, want)) &&
         itest_mono_ms() < end;)
        usleep(100 * 1000);
    ck_assert_msg(strstr(body, want) != NULL, "%s", body);
    applied = qlong(&t, "SELECT count(*) FROM idemq.jobs WHERE key LIKE '%s:%%' AND state = "
                        "'applied'", t.name);
    parked = qlong(&t, "SELECT count(*) FROM idemq.parked WHERE key LIKE '%s:%%'", t.name);
    retried = qlong(&t, "SELECT count(*) FROM idemq.attempts WHERE key LIKE '%s:%%' AND "
                        "outcome = 'transient_error'", t.name);
    ck_assert_int_eq(applied, 6);
    ck_assert_int_eq(parked, 1);
    ck_assert_int_eq(retried, 1);
#define PGQ_METRIC(outcome)                                                                  \
    (snprintf(want, sizeof want, "idemq_pgq_rows_total{input=\"%s\",outcome=\"%s\"} ",       \
              t.name, outcome),                                                              \
     metric_of(body, want))
    ck_assert_int_eq(PGQ_METRIC("applied"), applied);
    ck_assert_int_eq(PGQ_METRIC("duplicate"), 1);
    ck_assert_int_eq(PGQ_METRIC("retried"), retried);
    ck_assert_int_eq(PGQ_METRIC("parked"), parked);
    /* every row taken: 8 enqueued, the retried one taken twice */
    admitted = PGQ_METRIC("admitted");
    ck_assert_int_eq(admitted, 9);
#undef PGQ_METRIC
    ck_assert_int_eq(metric_of(body, "idemq_pgq_not_ready_total "), 0);
    ck_assert_int_eq(itest_http_get(rurl, body, sizeof body), 200);
    ck_assert_int_eq(kill(pid, SIGTERM), 0);
    st = itest_wait(pid, itest_ms(30000));
    ck_assert(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0);
    itest_teardown(&t);
}
END_TEST

/* A worker that cannot take rows (its effect function is missing): /ready
 * answers 503 and /metrics counts the back-off. */
START_TEST(test_not_ready_worker_fails_ready)
{
    struct itest t;
    char cfg[300], top[128], url[128], body[65536];
    int port = itest_free_port(), code = 0;
    pid_t pid;
    int st;
    snprintf(top, sizeof top, "metrics: { listen = \"127.0.0.1:%d\"; };", port);
    pg_extra_top = top;
    pg_effect = "idemq_test.no_such_effect";
    setup(&t, "pgq_nready", cfg, sizeof cfg, "", "");
    pg_extra_top = NULL;
    pg_effect = NULL;
    qexec(&t, "SELECT idemq.enqueue('%s', '{\"job_id\":\"%s:1\"}')", t.name, t.name);
    pid = itest_spawn(&t, cfg, 30, NULL);
    snprintf(url, sizeof url, "http://127.0.0.1:%d/ready", port);
    for (long long end = itest_mono_ms() + itest_ms(15000);
         (code = itest_http_get(url, body, sizeof body)) != 503 && itest_mono_ms() < end;)
        usleep(100 * 1000);
    ck_assert_int_eq(code, 503);
    ck_assert_msg(strstr(body, "not ready: a PostgreSQL queue worker backs off"), "%s", body);
    snprintf(url, sizeof url, "http://127.0.0.1:%d/metrics", port);
    ck_assert_int_eq(itest_http_get(url, body, sizeof body), 200);
    ck_assert_int_ge(metric_of(body, "idemq_pgq_not_ready_total "), 1);
    ck_assert_int_eq(kill(pid, SIGTERM), 0);
    st = itest_wait(pid, itest_ms(30000));
    ck_assert(st != -1 && WIFEXITED(st));
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.queue_jobs WHERE queue = '%s'",
                           t.name), 1);
    qexec(&t, "DELETE FROM idemq.queue_jobs WHERE queue = '%s'", t.name);
    itest_teardown(&t);
}
END_TEST

/* consumer.max_rate holds a postgres input's workers as a broker input's:
 * 40 rows at 20 per second over two workers take about 2 s (one token
 * each, a burst of 2), not the few milliseconds of a free drain. */
START_TEST(test_max_rate_paces_the_drain)
{
    struct itest t;
    char cfg[300];
    long span_ms;
    setup(&t, "pgq_rate", cfg, sizeof cfg, "workers = 2; max_rate = 20;", "");
    qexec(&t, "SELECT idemq.enqueue('%s', jsonb_build_object('job_id', '%s:' || g)) "
              "FROM generate_series(1, 40) g", t.name, t.name);
    run_pg(cfg, 1);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq_test.effects WHERE key LIKE '%s:%%'",
                           t.name), 40);
    span_ms = qlong(&t, "SELECT (extract(epoch FROM max(created_at) - min(created_at)) * 1000)"
                        "::bigint FROM idemq_test.effects WHERE key LIKE '%s:%%'", t.name);
    /* 38 tokens after the burst at 50 ms each: 1.9 s; a little slack */
    ck_assert_msg(span_ms >= 1700, "40 rows at max_rate 20 took %ld ms", span_ms);
    ck_assert_msg(span_ms <= 6000, "40 rows at max_rate 20 took %ld ms", span_ms);
    itest_teardown(&t);
}
END_TEST

START_TEST(test_retry_then_success_with_history)
{
    struct itest t;
    char cfg[300];
    setup(&t, "pgq_retry", cfg, sizeof cfg, "", "");
    qexec(&t, "SELECT idemq.enqueue('%s', '{\"job_id\":\"%s:r\",\"raise\":\"40001\","
              "\"raise_until\":2}')", t.name, t.name);
    run_pg(cfg, 2);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq_test.effects WHERE key = '%s:r'",
                           t.name), 1);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.attempts WHERE key = '%s:r' AND "
                               "outcome = 'transient_error'", t.name), 2);
    ck_assert_int_eq(qlong(&t, "SELECT attempts FROM idemq.jobs WHERE key = '%s:r' AND state "
                               "= 'applied'", t.name), 3);
    /* the second attempt waited at least the base delay after the first */
    ck_assert_int_ge(qlong(&t, "SELECT (extract(epoch FROM max(started_at) - min(started_at)) "
                               "* 1000)::bigint FROM idemq.attempts WHERE key = '%s:r' AND "
                               "outcome = 'transient_error'", t.name), 190);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.queue_jobs WHERE queue = '%s'",
                           t.name), 0);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.retry_copies WHERE key = '%s:r'",
                           t.name), 0);
    itest_teardown(&t);
}
END_TEST

START_TEST(test_plain_path_and_its_fallback)
{
    struct itest t;
    char cfg[300];
    setup(&t, "pgq_plain", cfg, sizeof cfg, "", "");
    /* a batch of new keys goes through the plain path: one batch row */
    qexec(&t, "SELECT idemq.enqueue('%s', jsonb_build_object('job_id', '%s:' || k)) FROM "
              "unnest(ARRAY['d', 'e', 'd']) k", t.name, t.name);
    run_pg(cfg, 1);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.batches WHERE '%s:d' = ANY (keys) "
                               "AND '%s:e' = ANY (keys)", t.name, t.name), 1);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq_test.effects WHERE key IN "
                               "('%s:d', '%s:e')", t.name, t.name), 2);
    /* an effect that raises in a batch: rolled back to the savepoint, the
     * batch applied again job by job in the same transaction, the rows
     * still held: the others applied once, the failing one kept for its
     * retry with its attempt */
    qexec(&t, "INSERT INTO idemq_test.failing VALUES ('%s:b', '40001')", t.name);
    qexec(&t, "SELECT idemq.enqueue('%s', jsonb_build_object('job_id', '%s:' || k)) FROM "
              "unnest(ARRAY['a', 'b', 'c']) k", t.name, t.name);
    run_pg(cfg, 1);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq_test.effects WHERE key IN "
                               "('%s:a', '%s:c')", t.name, t.name), 2);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq_test.effects WHERE key = '%s:b'",
                           t.name), 0);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.jobs WHERE key IN ('%s:a', '%s:c') "
                               "AND state = 'applied'", t.name, t.name), 2);
    ck_assert_int_ge(qlong(&t, "SELECT count(*) FROM idemq.attempts WHERE key = '%s:b' AND "
                               "outcome = 'transient_error'", t.name), 1);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.queue_jobs WHERE queue = '%s' AND "
                               "convert_from(payload, 'UTF8')::jsonb->>'job_id' <> '%s:b'",
                           t.name, t.name), 0);
    ck_assert_int_eq(qlong(&t, "SELECT (SELECT count(*) FROM idemq.queue_jobs WHERE queue = "
                               "'%s') + (SELECT count(*) FROM idemq.parked WHERE key = '%s:b')",
                           t.name, t.name), 1);
    itest_teardown(&t);
}
END_TEST

START_TEST(test_key_and_error_with_quotes)
{
    struct itest t;
    char cfg[300];
    /* a key (and so the effect's error message, which names it) with the
     * characters an array literal must escape travels whole: the retry is
     * held in the row with the message, then applied */
    setup(&t, "pgq_quote", cfg, sizeof cfg, "", "");
    qexec(&t, "INSERT INTO idemq_test.failing VALUES ('%s:a\"b\\c{d,e}''f', '40001')", t.name);
    qexec(&t, "SELECT idemq.enqueue('%s', jsonb_build_object('job_id', '%s:a\"b\\c{d,e}''f'))",
          t.name, t.name);
    run_pg(cfg, 1);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.queue_jobs WHERE queue = '%s' AND "
                               "attempts >= 1 AND position('key %s:a\"b\\c{d,e}''f is marked "
                               "failing' IN last_error) > 0", t.name, t.name), 1);
    qexec(&t, "DELETE FROM idemq_test.failing WHERE key LIKE '%s:%%'", t.name);
    run_pg(cfg, 2);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq_test.effects WHERE key = "
                               "'%s:a\"b\\c{d,e}''f'", t.name), 1);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.queue_jobs WHERE queue = '%s'",
                           t.name), 0);
    itest_teardown(&t);
}
END_TEST

START_TEST(test_effect_enqueues_a_chain)
{
    struct itest t;
    char cfg[300], fn[128];
    /* an effect that enqueues the next job of a chain before its own work:
     * the next job exists only if the effect commits */
    itest_setup(&t, "pgq_chain", "idemq_test.record", "", "");
    snprintf(fn, sizeof fn, "idemq_test.chain_%s", t.name);
    qexec(&t,
          "CREATE FUNCTION %s(p_key text, p_payload jsonb, p_meta jsonb) RETURNS jsonb "
          "LANGUAGE plpgsql AS $$ BEGIN "
          "IF p_payload ? 'next' THEN PERFORM idemq.enqueue('%s', jsonb_build_object('job_id', "
          "p_payload->>'next')); END IF; "
          "RETURN idemq_test.record(p_key, p_payload, p_meta); END $$",
          fn, t.name);
    snprintf(cfg, sizeof cfg, "/tmp/%s.pg.cfg", t.name);
    pg_effect = fn;
    write_pg_config(&t, cfg, "", "");
    pg_effect = NULL;
    qexec(&t, "SELECT idemq.enqueue('%s', '{\"job_id\":\"%s:a\",\"next\":\"%s:b\"}')",
          t.name, t.name, t.name);
    /* this one enqueues, then fails for good: its enqueue goes with it */
    qexec(&t, "SELECT idemq.enqueue('%s', '{\"job_id\":\"%s:c\",\"next\":\"%s:d\","
              "\"raise\":\"22012\"}')", t.name, t.name, t.name);
    run_pg(cfg, 1);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq_test.effects WHERE key IN ('%s:a', "
                               "'%s:b')", t.name, t.name), 2);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.parked WHERE key = '%s:c'", t.name),
                     1);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.jobs WHERE key = '%s:d'", t.name), 0);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.queue_jobs WHERE queue = '%s'",
                           t.name), 0);
    qexec(&t, "DROP FUNCTION %s(text, jsonb, jsonb)", fn);
    itest_teardown(&t);
}
END_TEST

/* Runs `idemq ARGS -c cfg` with a broker URL nobody answers (port 1),
 * capturing stdout and stderr into out; returns the exit code. The
 * operator commands on parks of postgres inputs must not need a broker. */
static int idemq_no_broker(const char *cfg, const char *args, char *out, size_t outlen)
{
    char cmd[1024];
    size_t n = 0;
    FILE *p;
    int st;
    char as[1024];
    /* in least-privilege mode as the command's role; the broker unreachable
     * either way (the last IDEMQ_AMQP_URL wins) */
    snprintf(cmd, sizeof cmd,
             "%sIDEMQ_AMQP_URL='amqp://guest:guest@127.0.0.1:1/%%2F' %s %s -c %s 2>&1",
             itest_lp_env_prefix(args, as, sizeof as), IDEMQ_BINARY, args, cfg);
    p = popen(cmd, "r");
    ck_assert_ptr_nonnull(p);
    while (n + 1 < outlen && fgets(out + n, (int)(outlen - n), p))
        n += strlen(out + n);
    out[n] = '\0';
    while (fgetc(p) != EOF) /* drain what did not fit */
        ;
    st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

START_TEST(test_park_and_redrive)
{
    struct itest t;
    char cfg[300];
    long park;
    setup(&t, "pgq_park", cfg, sizeof cfg, "", "");
    qexec(&t, "INSERT INTO idemq_test.failing VALUES ('%s:p', '22012')", t.name);
    qexec(&t, "SELECT idemq.enqueue('%s', '{\"job_id\":\"%s:p\",\"n\":7}', NULL, 'o1')", t.name,
          t.name);
    qexec(&t, "SELECT idemq.enqueue('%s', '{\"job_id\":\"%s:after\"}', NULL, 'o1')", t.name,
          t.name);
    run_pg(cfg, 1);
    park = qlong(&t, "SELECT id FROM idemq.parked WHERE key = '%s:p'", t.name);
    ck_assert_int_gt(park, 0);
    /* the park holds the payload; the row is gone; the key's next row ran */
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.parked WHERE id = %ld AND "
                               "convert_from(body, 'UTF8')::jsonb->>'n' = '7' AND "
                               "error_code = 'effect_error'", park), 1);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.queue_jobs WHERE queue = '%s'",
                           t.name), 0);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq_test.effects WHERE key = "
                               "'%s:after'", t.name), 1);
    /* `parked list` shows it with no broker running: a postgres input has
     * no dead-letter queue to browse */
    {
        static char out[16384];
        char args[300];
        int rc;
        snprintf(args, sizeof args, "parked list --input %s", t.name);
        rc = idemq_no_broker(cfg, args, out, sizeof out);
        ck_assert_msg(rc == 0 && strstr(out, "effect_error") && !strstr(out, "unreachable"),
                      "parked list without a broker: exit %d: %s", rc, out);
    }
    /* fixed, then redriven into the queue: applied once, the park closed */
    qexec(&t, "DELETE FROM idemq_test.failing WHERE key = '%s:p'", t.name);
    ck_assert_int_gt(qlong(&t, "SELECT idemq.queue_redrive(%ld, 'check_pgq')", park), 0);
    run_pg(cfg, 1);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq_test.effects WHERE key = '%s:p'",
                           t.name), 1);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.parked WHERE id = %ld", park), 0);
    ck_assert_int_eq(qlong(&t, "SELECT generation FROM idemq.jobs WHERE key = '%s:p' AND state "
                               "= 'applied'", t.name), 1);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.redrives WHERE key = '%s:p'",
                           t.name), 1);
    /* a second redrive of the closed park finds nothing */
    {
        char sql[256], st[6];
        snprintf(sql, sizeof sql, "SELECT idemq.queue_redrive(%ld, 'check_pgq')", park);
        ck_assert_str_eq(sqlstate_of(&t, sql, st), "P0002");
    }
    itest_teardown(&t);
}
END_TEST

/* `idemq redrive` on a postgres input: a dry run moves nothing; the redrive
 * puts the park back through idemq.queue_redrive, with no broker running,
 * and the job is applied once as the next generation. */
START_TEST(test_cli_redrive)
{
    struct itest t;
    char cfg[300], args[300];
    static char out[16384];
    long park;
    int rc;
    setup(&t, "pgq_cli", cfg, sizeof cfg, "", "");
    qexec(&t, "INSERT INTO idemq_test.failing VALUES ('%s:p', '22012')", t.name);
    qexec(&t, "SELECT idemq.enqueue('%s', '{\"job_id\":\"%s:p\"}')", t.name, t.name);
    run_pg(cfg, 1);
    park = qlong(&t, "SELECT id FROM idemq.parked WHERE key = '%s:p'", t.name);
    ck_assert_int_gt(park, 0);
    qexec(&t, "DELETE FROM idemq_test.failing WHERE key = '%s:p'", t.name);
    snprintf(args, sizeof args, "redrive --input %s --dry-run", t.name);
    rc = idemq_no_broker(cfg, args, out, sizeof out);
    ck_assert_msg(rc == 0 && strstr(out, "would redrive park"), "dry run: exit %d: %s", rc, out);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.queue_jobs WHERE queue = '%s'",
                           t.name), 0);
    snprintf(args, sizeof args, "redrive --input %s", t.name);
    rc = idemq_no_broker(cfg, args, out, sizeof out);
    ck_assert_msg(rc == 0 && strstr(out, "redrove 1 park"), "redrive: exit %d: %s", rc, out);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.queue_jobs WHERE queue = '%s' AND "
                               "park_id = %ld", t.name, park), 1);
    run_pg(cfg, 1);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq_test.effects WHERE key = '%s:p'",
                           t.name), 1);
    ck_assert_int_eq(qlong(&t, "SELECT generation FROM idemq.jobs WHERE key = '%s:p' AND state "
                               "= 'applied'", t.name), 1);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.parked WHERE id = %ld", park), 0);
    /* nothing left to redrive */
    rc = idemq_no_broker(cfg, args, out, sizeof out);
    ck_assert_msg(rc == 0 && strstr(out, "redrove 0 parks"), "second redrive: exit %d: %s", rc,
                  out);
    /* the park actions (CLI and console): `parked redrive` of a selection,
     * recorded as an operator action, through the same path */
    qexec(&t, "INSERT INTO idemq_test.failing VALUES ('%s:q', '22012')", t.name);
    qexec(&t, "SELECT idemq.enqueue('%s', '{\"job_id\":\"%s:q\"}')", t.name, t.name);
    run_pg(cfg, 1);
    park = qlong(&t, "SELECT id FROM idemq.parked WHERE key = '%s:q'", t.name);
    ck_assert_int_gt(park, 0);
    qexec(&t, "DELETE FROM idemq_test.failing WHERE key = '%s:q'", t.name);
    snprintf(args, sizeof args, "parked redrive --input %s --actor check_pgq", t.name);
    rc = idemq_no_broker(cfg, args, out, sizeof out);
    ck_assert_msg(rc == 0 && strstr(out, "redrove 1 park"), "parked redrive: exit %d: %s", rc,
                  out);
    run_pg(cfg, 1);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq_test.effects WHERE key = '%s:q'",
                           t.name), 1);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.parked WHERE id = %ld", park), 0);
    itest_teardown(&t);
}
END_TEST

/* cpu_s of the perf line `run` logs when it stops, or -1. */
static double cpu_of_log(const char *path)
{
    char line[2048];
    double v = -1;
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    while (fgets(line, sizeof line, f)) {
        const char *p = strstr(line, " cpu_s=");
        if (p)
            v = strtod(p + 7, NULL);
    }
    fclose(f);
    return v;
}

START_TEST(test_statement_timeout_is_an_attempt)
{
    struct itest t;
    char cfg[300];
    /* an effect that always outlives the statement timeout, beside good
     * jobs in the same batch: the good ones are applied, the slow one's
     * whole-call failures are its attempts, and it parks when they run out */
    pg_extra_top = "database: { statement_timeout_ms = 300; };";
    setup(&t, "pgq_slow", cfg, sizeof cfg, "batch_max = 10;", "");
    pg_extra_top = NULL;
    qexec(&t, "SELECT idemq.enqueue('%s', '{\"job_id\":\"%s:a\"}')", t.name, t.name);
    qexec(&t, "SELECT idemq.enqueue('%s', '{\"job_id\":\"%s:slow\",\"sleep_ms\":2000}')",
          t.name, t.name);
    qexec(&t, "SELECT idemq.enqueue('%s', '{\"job_id\":\"%s:b\"}')", t.name, t.name);
    run_pg(cfg, 3);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq_test.effects WHERE key IN "
                               "('%s:a', '%s:b')", t.name, t.name), 2);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq_test.effects WHERE key = "
                               "'%s:slow'", t.name), 0);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.attempts WHERE key = '%s:slow' AND "
                               "sqlstate = '57014'", t.name), 5);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.parked WHERE key = '%s:slow' AND "
                               "error_code = 'retries_exhausted'", t.name), 1);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.queue_jobs WHERE queue = '%s'",
                           t.name), 0);
    itest_teardown(&t);
}
END_TEST

START_TEST(test_notify_wakes_idle_worker)
{
    struct itest t;
    char cfg[300], log[300];
    double cpu;
    pid_t pid;
    int st;
    setup(&t, "pgq_wake", cfg, sizeof cfg, "", "");
    snprintf(log, sizeof log, "/tmp/%s.log", t.name);
    pid = itest_spawn_log(cfg, 3, NULL, log);
    /* idle: its workers' sessions are connected (and listening) and wait
     * (the reading the loop ended on is the one asserted: a worker's
     * once-a-second look at the queue makes it active for a moment) */
    {
        long idle = 0;
        for (long long end = itest_mono_ms() + itest_ms(15000);
             (idle = qlong(&t, PGQ_WORKERS_IDLE)) != 1 && itest_mono_ms() < end;)
            usleep(50 * 1000);
        ck_assert_int_eq(idle, 1);
    }
    itest_sql(&t, "CREATE TEMP TABLE pgq_wake (key text, at timestamptz)");
    /* six enqueues 370 ms apart: their phases spread over the 1 s idle
     * wait, so a worker that only polled would take about 500 ms on the
     * median one */
    for (int i = 0; i < 6; i++) {
        /* autocommit: the enqueue commits right after its clock reading */
        qexec(&t, "INSERT INTO pgq_wake SELECT '%s:w%d', clock_timestamp() FROM (SELECT "
                  "idemq.enqueue('%s', '{\"job_id\":\"%s:w%d\"}')) x", t.name, i, t.name,
              t.name, i);
        usleep(370 * 1000);
    }
    st = itest_wait(pid, itest_ms(30000));
    ck_assert(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq_test.effects e JOIN pgq_wake w USING "
                               "(key)"), 6);
    /* from the enqueue to the effect: the median well under the idle wait
     * (the median, so that a commit stalled on a busy disk is not taken
     * for a missed notification) */
    ck_assert_int_lt(qlong(&t, "SELECT (percentile_cont(0.5) WITHIN GROUP (ORDER BY "
                               "extract(epoch FROM e.created_at - w.at) * 1000))::bigint "
                               "FROM idemq_test.effects e JOIN pgq_wake w USING (key)"),
                     itest_ms(250));
    /* idle it waits, never spins: about 5.5 s of run, mostly idle, with two
     * workers (a spinning loop burns a second and more) */
    cpu = cpu_of_log(log);
    ck_assert_msg(cpu >= 0 && cpu < 0.2 * itest_ms(1000) / 1000.0, "run used %.3f s of CPU",
                  cpu);
    itest_teardown(&t);
}
END_TEST

START_TEST(test_two_replicas_exactly_once)
{
    struct itest t;
    char cfg[300];
    pid_t a, b;
    int sa, sb;
    setup(&t, "pgq_two", cfg, sizeof cfg, "workers = 2; batch_max = 10;", "");
    /* 400 keys, every fifth enqueued twice, some with an order key */
    qexec(&t,
          "SELECT idemq.enqueue('%s', jsonb_build_object('job_id', '%s:' || (g %% 400)), NULL, "
          "CASE WHEN g %% 4 = 0 THEN 'o' || (g %% 5) END) FROM generate_series(0, 479) g",
          t.name, t.name);
    a = itest_spawn(&t, cfg, 2, NULL);
    b = itest_spawn(&t, cfg, 2, NULL);
    sa = itest_wait(a, itest_ms(60000));
    sb = itest_wait(b, itest_ms(60000));
    ck_assert(sa != -1 && WIFEXITED(sa) && WEXITSTATUS(sa) == 0);
    ck_assert(sb != -1 && WIFEXITED(sb) && WEXITSTATUS(sb) == 0);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq_test.effects WHERE key LIKE '%s:%%'",
                           t.name), 400);
    ck_assert_int_eq(qlong(&t, "SELECT count(DISTINCT key) FROM idemq_test.effects WHERE key "
                               "LIKE '%s:%%'", t.name), 400);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.queue_jobs WHERE queue = '%s'",
                           t.name), 0);
    itest_teardown(&t);
}
END_TEST

/* The enqueuing transaction's trace context travels with the row and is
 * checked when the row is taken, as a broker message's header is: a valid
 * one reaches the effect's meta (with its tracestate), an invalid one and
 * one over the enqueue's bound are dropped, and a row enqueued without one
 * carries none. */
START_TEST(test_trace_context_of_rows)
{
    struct itest t;
    char cfg[300];
    const char *tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    setup(&t, "pgq_trace", cfg, sizeof cfg, "", "");
    qexec(&t, "BEGIN; SELECT set_config('idemq.traceparent', '%s', true), "
              "set_config('idemq.tracestate', 'v=1', true); "
              "SELECT idemq.enqueue('%s', '{\"job_id\":\"%s:ok\"}'); COMMIT",
          tp, t.name, t.name);
    qexec(&t, "BEGIN; SELECT set_config('idemq.traceparent', upper('%s'), true); "
              "SELECT idemq.enqueue('%s', '{\"job_id\":\"%s:upper\"}'); COMMIT",
          tp, t.name, t.name);
    qexec(&t, "BEGIN; SELECT set_config('idemq.traceparent', '%s-' || repeat('a', 300), true); "
              "SELECT idemq.enqueue('%s', '{\"job_id\":\"%s:long\"}'); COMMIT",
          tp, t.name, t.name);
    qexec(&t, "SELECT idemq.enqueue('%s', '{\"job_id\":\"%s:none\"}')", t.name, t.name);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.queue_jobs WHERE queue = '%s' AND "
                               "traceparent IS NOT NULL", t.name),
                     2); /* the one over 256 bytes is not stored */
    run_pg(cfg, 1);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq_test.effects WHERE key = '%s:ok' AND "
                               "meta->>'traceparent' = '%s' AND meta->>'tracestate' = 'v=1'",
                           t.name, tp),
                     1);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq_test.effects WHERE key LIKE '%s:%%' "
                               "AND NOT meta ? 'traceparent' AND NOT meta ? 'tracestate'",
                           t.name),
                     3);
    itest_teardown(&t);
}
END_TEST

START_TEST(test_enqueue_limits)
{
    struct itest t;
    char st[6];
    itest_setup(&t, "pgq_lim", "idemq_test.record", "", "");
    ck_assert_str_eq(sqlstate_of(&t, "SELECT idemq.enqueue('', '{}')", st), "22023");
    ck_assert_str_eq(sqlstate_of(&t, "SELECT idemq.enqueue(NULL, '{}')", st), "22023");
    ck_assert_str_eq(sqlstate_of(&t, "SELECT idemq.enqueue(E'q\\n', '{}')", st), "22023");
    ck_assert_str_eq(sqlstate_of(&t, "SELECT idemq.enqueue(repeat('q', 256), '{}')", st),
                     "22023");
    ck_assert_str_eq(sqlstate_of(&t, "SELECT idemq.enqueue('q', NULL)", st), "22004");
    ck_assert_str_eq(sqlstate_of(&t, "SELECT idemq.enqueue_raw('q', "
                                     "decode(repeat('00', 1048577), 'hex'))", st), "54000");
    ck_assert_str_eq(sqlstate_of(&t, "SELECT idemq.enqueue('q', '{}', '')", st), "22023");
    ck_assert_str_eq(sqlstate_of(&t, "SELECT idemq.enqueue('q', '{}', NULL, '')", st), "22023");
    ck_assert_str_eq(sqlstate_of(&t, "SELECT idemq.enqueue('q', '{}', repeat('k', 256))", st),
                     "22001");
    ck_assert_str_eq(sqlstate_of(&t, "SELECT idemq.enqueue('q', '{}', NULL, repeat('k', 256))",
                                 st), "22001");
    ck_assert_str_eq(sqlstate_of(&t, "SELECT idemq.enqueue('q', '{}', NULL, NULL, now() + "
                                     "interval '367 days')", st), "22008");
    ck_assert_str_eq(sqlstate_of(&t, "SELECT idemq.enqueue('q', '{}', NULL, NULL, now(), "
                                     "40000)", st), "22003");
    /* at the limits: accepted (and rolled back) */
    ck_assert_str_eq(sqlstate_of(&t, "BEGIN; SELECT idemq.enqueue(repeat('q', 255), '{}', "
                                     "repeat('k', 255), repeat('o', 255), now() + interval "
                                     "'365 days', -32768)", st), "");
    itest_sql(&t, "ROLLBACK");
    /* PUBLIC may not enqueue: the operator grants it to an application */
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM pg_proc p WHERE p.pronamespace = "
                                    "'idemq'::regnamespace AND p.proname IN ('enqueue', "
                                    "'enqueue_raw', 'queue_take', 'queue_take_after', "
                                    "'queue_settle', 'queue_redrive') AND has_function_privilege('public', "
                                    "p.oid, 'EXECUTE')", NULL), 0);
    itest_teardown(&t);
}
END_TEST

START_TEST(test_killed_replica)
{
    struct itest t;
    char cfg[300];
    pid_t a, b, c;
    int sb, sc;
    setup(&t, "pgq_kill", cfg, sizeof cfg, "workers = 2; batch_max = 5;", "");
    /* 300 jobs of 10 ms each, a third of them in 5 order keys */
    qexec(&t,
          "SELECT idemq.enqueue('%s', jsonb_build_object('job_id', '%s:' || g, 'sleep_ms', 10), "
          "NULL, CASE WHEN g %% 3 = 0 THEN 'o' || (g %% 5) END) FROM generate_series(0, 299) g",
          t.name, t.name);
    a = itest_spawn(&t, cfg, 2, NULL);
    b = itest_spawn(&t, cfg, 2, NULL);
    /* both replicas at work (a tenth applied) before A dies */
    for (long long end = itest_mono_ms() + itest_ms(30000);
         qlong(&t, "SELECT count(*) FROM idemq_test.effects WHERE key LIKE '%s:%%'", t.name) <
             30 &&
         itest_mono_ms() < end;)
        usleep(20 * 1000);
    ck_assert_int_eq(kill(a, SIGKILL), 0); /* mid-transaction, most likely */
    waitpid(a, NULL, 0);
    c = itest_spawn(&t, cfg, 2, NULL);
    sb = itest_wait(b, itest_ms(60000));
    sc = itest_wait(c, itest_ms(60000));
    ck_assert(sb != -1 && WIFEXITED(sb) && WEXITSTATUS(sb) == 0);
    ck_assert(sc != -1 && WIFEXITED(sc) && WEXITSTATUS(sc) == 0);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq_test.effects WHERE key LIKE '%s:%%'",
                           t.name), 300);
    ck_assert_int_eq(qlong(&t, "SELECT count(DISTINCT key) FROM idemq_test.effects WHERE key "
                               "LIKE '%s:%%'", t.name), 300);
    /* per order key, in enqueue order */
    ck_assert_int_eq(qlong(&t,
                           "SELECT count(*) FROM (SELECT split_part(key, ':', 2)::int AS i, "
                           "lag(split_part(key, ':', 2)::int) OVER (PARTITION BY "
                           "split_part(key, ':', 2)::int %% 5 ORDER BY id) AS prev "
                           "FROM idemq_test.effects WHERE key LIKE '%s:%%' AND "
                           "split_part(key, ':', 2)::int %% 3 = 0) x "
                           "WHERE prev IS NOT NULL AND prev > i", t.name), 0);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.queue_jobs WHERE queue = '%s'",
                           t.name), 0);
    itest_teardown(&t);
}
END_TEST


/* Provider inputs over a postgres queue (the rows under a visible lease,
 * consumer/pgq_lease.h), at the test provider. */
static struct tprov P;

/* A postgres provider input at the test provider, timeout_ms as given;
 * t->cfg_path is the config (for itest_idemq). */
static void setup_provider_pg(struct itest *t, const char *tag, char *cfg, size_t len,
                              int timeout_ms, const char *extra_consumer)
{
    char input[1024];
    tprov_start(&P, NULL);
    snprintf(input, sizeof input,
             "provider: { url = \"%s\"; path = \"/charges\"; timeout_ms = %d; "
             "lookup_key_path = \"/charges/by-idempotency-key/{key}\"; "
             "reconcile_after_s = 15; retry_after_max_ms = 2000; };",
             P.url, timeout_ms);
    setup(t, tag, cfg, len, extra_consumer, input);
    snprintf(t->cfg_path, sizeof t->cfg_path, "%s", cfg);
}

static void teardown_provider_pg(struct itest *t)
{
    qexec(t, "DELETE FROM idemq.queue_jobs WHERE queue = '%s'", t->name);
    qexec(t, "DELETE FROM idemq.queue_lease_expiries WHERE queue = '%s'", t->name);
    itest_teardown(t);
    tprov_stop(&P);
}

/* Two keys, one of them enqueued twice: one charge per key at the
 * provider, each key applied once with its reference, a duplicate, the
 * queue empty. */
START_TEST(test_provider_job_applied_once)
{
    struct itest t;
    char cfg[300], k1[128], k2[128];
    setup_provider_pg(&t, "pgq_prov", cfg, sizeof cfg, 3000, "");
    snprintf(k1, sizeof k1, "%s:a", t.name);
    snprintf(k2, sizeof k2, "%s:b", t.name);
    qexec(&t, "SELECT idemq.enqueue('%s', jsonb_build_object('job_id', k, 'amount_minor', 500)) "
              "FROM unnest(ARRAY['%s', '%s', '%s']) k", t.name, k1, k2, k1);
    /* the second row of k1 waits out the first one's lease (8 s), then
     * finds it applied */
    run_pg(cfg, 10);
    ck_assert_int_eq(tprov_stat(&P, k1, "key_charges"), 1);
    ck_assert_int_eq(tprov_stat(&P, k2, "key_charges"), 1);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.jobs WHERE key IN ('%s', '%s') "
                               "AND state = 'applied'", k1, k2), 2);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.intents WHERE key IN ('%s', '%s') "
                               "AND provider_ref IS NOT NULL", k1, k2), 2);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq_test.effects WHERE key IN "
                               "('%s', '%s')", k1, k2), 2);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.queue_jobs WHERE queue = '%s'",
                           t.name), 0);
    ck_assert_int_eq(qlong(&t, "SELECT requests FROM idemq.intents WHERE key = '%s'", k1), 1);
    teardown_provider_pg(&t);
}
END_TEST

/* The holder of a lease is SIGKILLed while its provider call is in flight
 * (the provider applies the charge and holds its answer): the row, `jobs
 * show`, the console's job page and /metrics show the lease while it is
 * held; the row stays out of every take until
 * the lease ends, then a second replica takes it (a lease expiry counted),
 * the ledger finds the call's outcome uncertain and sends the job to a
 * lookup of the key, and the provider charged the key exactly once. */
START_TEST(test_provider_lease_holder_crash)
{
    struct itest t;
    char cfg[300], key[128], out[8192], want[128], top[256], url[256], body[65536];
    int port = itest_free_port(), cport = itest_free_port();
    pid_t a, b;
    int st;
    snprintf(top, sizeof top,
             "metrics: { listen = \"127.0.0.1:%d\"; };\n"
             "console: { listen = \"127.0.0.1:%d\"; };",
             port, cport);
    pg_extra_top = top;
    setup_provider_pg(&t, "pgq_lease", cfg, sizeof cfg, 10000, "");
    pg_extra_top = NULL;
    snprintf(key, sizeof key, "%s:c", t.name);
    /* the first request: charged, its answer held past the kill */
    tprov_control(&P, "{\"fault\":\"hold=11000\",\"count\":1}");
    qexec(&t, "SELECT idemq.enqueue('%s', jsonb_build_object('job_id', '%s', "
              "'amount_minor', 500))", t.name, key);
    a = itest_spawn(&t, cfg, 30, NULL);
    /* the call is in flight: the provider holds the charge's answer */
    for (long long end = itest_mono_ms() + itest_ms(15000);
         tprov_stat(&P, key, "key_charges") < 1 && itest_mono_ms() < end;)
        usleep(20 * 1000);
    ck_assert_int_eq(tprov_stat(&P, key, "key_charges"), 1);
    /* the lease is visible in the row, in `jobs show` and on /metrics */
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.queue_jobs WHERE queue = '%s' AND "
                               "leased_by LIKE '%%:%d:w%%' AND lease_until > now() + "
                               "interval '5 seconds'", t.name, (int)a), 1);
    {
        char args[256];
        snprintf(args, sizeof args, "jobs show '%s'", key);
        ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 0);
    }
    snprintf(want, sizeof want, ":%d:w0 until ", (int)a);
    ck_assert_msg(strstr(out, "leased by ") && strstr(out, want), "%s", out);
    ck_assert_msg(strstr(out, "may be in flight"), "%s", out);
    /* the console's job page */
    snprintf(url, sizeof url, "http://127.0.0.1:%d/key?k=%s", cport, key);
    for (long long end = itest_mono_ms() + itest_ms(5000);
         itest_http_get(url, body, sizeof body) != 200 && itest_mono_ms() < end;)
        usleep(100 * 1000);
    snprintf(want, sizeof want, ":%d:w0</td>", (int)a);
    ck_assert_msg(strstr(body, "Queue lease") && strstr(body, want), "%s", body);
    snprintf(url, sizeof url, "http://127.0.0.1:%d/metrics", port);
    snprintf(want, sizeof want, "idemq_queue_leased_rows{input=\"%s\"} 1\n", t.name);
    for (long long end = itest_mono_ms() + itest_ms(15000);
         (itest_http_get(url, body, sizeof body) != 200 || !strstr(body, want)) &&
         itest_mono_ms() < end;)
        usleep(100 * 1000);
    ck_assert_msg(strstr(body, want) != NULL, "%s", body);
    ck_assert_int_eq(kill(a, SIGKILL), 0);
    waitpid(a, NULL, 0);
    /* nobody takes the row while the lease lasts */
    run_pg(cfg, 1);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.queue_jobs WHERE queue = '%s' AND "
                               "leased_by IS NOT NULL", t.name), 1);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.jobs WHERE key = '%s' AND "
                               "state = 'applied'", key), 0);
    /* once it ends, another replica takes the row and looks the key up */
    for (long long end = itest_mono_ms() + itest_ms(20000);
         qlong(&t, "SELECT count(*) FROM idemq.queue_jobs WHERE queue = '%s' AND "
                   "lease_until > now()", t.name) > 0 && itest_mono_ms() < end;)
        usleep(100 * 1000);
    b = itest_spawn(&t, cfg, 3, NULL);
    st = itest_wait(b, itest_ms(60000));
    ck_assert(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0);
    ck_assert_int_eq(tprov_stat(&P, key, "key_charges"), 1);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.jobs WHERE key = '%s' AND "
                               "state = 'applied'", key), 1);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq_test.effects WHERE key = '%s'", key),
                     1);
    ck_assert_int_ge(qlong(&t, "SELECT lookups FROM idemq.intents WHERE key = '%s'", key), 1);
    ck_assert_int_eq(qlong(&t, "SELECT requests FROM idemq.intents WHERE key = '%s'", key), 1);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.queue_jobs WHERE queue = '%s'",
                           t.name), 0);
    ck_assert_int_eq(qlong(&t, "SELECT expired FROM idemq.queue_lease_expiries WHERE "
                               "queue = '%s'", t.name), 1);
    teardown_provider_pg(&t);
}
END_TEST

/* Three replicas, SIGKILLed in turn mid-batch (each time the others and it
 * applied 50 more), each restarted at once: every key applied exactly
 * once (effects and ledger), order keys in enqueue order, the queue
 * drained. */
START_TEST(test_three_replicas_kill_loop)
{
    struct itest t;
    char cfg[300];
    pid_t r[3];
    long done = 0;
    int kills = 0;
    setup(&t, "pgq_kill3", cfg, sizeof cfg, "workers = 2; batch_max = 5;", "");
    /* 600 jobs of 10 ms each, a third of them in 7 order keys */
    qexec(&t,
          "SELECT idemq.enqueue('%s', jsonb_build_object('job_id', '%s:' || g, 'sleep_ms', 10), "
          "NULL, CASE WHEN g %% 3 = 0 THEN 'o' || (g %% 7) END) FROM generate_series(0, 599) g",
          t.name, t.name);
    for (int i = 0; i < 3; i++)
        r[i] = itest_spawn(&t, cfg, 2, NULL);
    for (long long end = itest_mono_ms() + itest_ms(25000); kills < 6 && itest_mono_ms() < end;) {
        long n = qlong(&t, "SELECT count(*) FROM idemq_test.effects WHERE key LIKE '%s:%%'",
                       t.name);
        if (n >= 540)
            break; /* keep a tail for the last ones to drain */
        if (n < done + 50) {
            usleep(10 * 1000);
            continue;
        }
        done = n;
        ck_assert_int_eq(kill(r[kills % 3], SIGKILL), 0); /* mid-transaction, most likely */
        waitpid(r[kills % 3], NULL, 0);
        r[kills % 3] = itest_spawn(&t, cfg, 2, NULL);
        kills++;
    }
    ck_assert_int_ge(kills, 3);
    for (int i = 0; i < 3; i++) {
        int st = itest_wait(r[i], itest_ms(60000));
        ck_assert(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0);
    }
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq_test.effects WHERE key LIKE '%s:%%'",
                           t.name), 600);
    ck_assert_int_eq(qlong(&t, "SELECT count(DISTINCT key) FROM idemq_test.effects WHERE key "
                               "LIKE '%s:%%'", t.name), 600);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.jobs WHERE key LIKE '%s:%%' AND "
                               "state = 'applied'", t.name), 600);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.parked WHERE key LIKE '%s:%%'",
                           t.name), 0);
    /* per order key, in enqueue order */
    ck_assert_int_eq(qlong(&t,
                           "SELECT count(*) FROM (SELECT split_part(key, ':', 2)::int AS i, "
                           "lag(split_part(key, ':', 2)::int) OVER (PARTITION BY "
                           "split_part(key, ':', 2)::int %% 7 ORDER BY id) AS prev "
                           "FROM idemq_test.effects WHERE key LIKE '%s:%%' AND "
                           "split_part(key, ':', 2)::int %% 3 = 0) x "
                           "WHERE prev IS NOT NULL AND prev > i", t.name), 0);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.queue_jobs WHERE queue = '%s'",
                           t.name), 0);
    itest_teardown(&t);
}
END_TEST

/* The DSN of the test database with another user. */
static void dsn_as(const char *role, char *dsn, size_t len)
{
    char *u;
    snprintf(dsn, len, "%s", getenv("IDEMQ_PG_DSN"));
    u = strstr(dsn, "user=");
    ck_assert_ptr_nonnull(u);
    snprintf(u, len - (size_t)(u - dsn), "user=%s", role);
}

/* Connects as role and returns the SQLSTATE sql fails with ("" if not). */
static const char *as_role(const char *role, const char *sql, char st[6])
{
    char dsn[512];
    PGconn *db;
    PGresult *r;
    const char *s;
    dsn_as(role, dsn, sizeof dsn);
    db = PQconnectdb(dsn);
    ck_assert_msg(PQstatus(db) == CONNECTION_OK, "%s", PQerrorMessage(db));
    r = PQexec(db, sql);
    s = PQresultErrorField(r, PG_DIAG_SQLSTATE);
    snprintf(st, 6, "%s", PQresultStatus(r) == PGRES_TUPLES_OK ||
                          PQresultStatus(r) == PGRES_COMMAND_OK ? "" : s ? s : "?");
    PQclear(r);
    PQfinish(db);
    return st;
}

START_TEST(test_least_privilege_roles)
{
    struct itest t;
    char cfg[300], run[64], app[64], bare[64], sql[1024], st[6], dsn[512], env[600], cmd[1200];
    const char *envv[2] = {env, NULL};
    char fn[128];
    pid_t pid;
    int ws;
    /* an effect PUBLIC may not execute: the run role needs the grant */
    itest_setup(&t, "pgq_roles", "idemq_test.record", "", "");
    snprintf(fn, sizeof fn, "idemq_test.rec_%s", t.name);
    qexec(&t, "CREATE FUNCTION %s(text, jsonb, jsonb) RETURNS jsonb LANGUAGE sql AS "
              "'SELECT idemq_test.record($1, $2, $3)'; REVOKE EXECUTE ON FUNCTION "
              "%s(text, jsonb, jsonb) FROM PUBLIC", fn, fn);
    snprintf(cfg, sizeof cfg, "/tmp/%s.pg.cfg", t.name);
    pg_effect = fn;
    write_pg_config(&t, cfg, "", "");
    pg_effect = NULL;
    snprintf(run, sizeof run, "%s_run", t.name);
    snprintf(app, sizeof app, "%s_app", t.name);
    snprintf(bare, sizeof bare, "%s_bare", t.name);
    qexec(&t, "CREATE ROLE %s LOGIN; CREATE ROLE %s LOGIN; CREATE ROLE %s LOGIN", run, app,
          bare);
    /* the run role: idemq migrate --grant */
    snprintf(cmd, sizeof cmd, "%s migrate -c %s --grant %s > /dev/null 2>&1", IDEMQ_BINARY, cfg,
             run);
    ck_assert_int_eq(system(cmd), 0);
    /* the application: EXECUTE on the two enqueue functions, nothing else */
    qexec(&t, "GRANT USAGE ON SCHEMA idemq TO %s; GRANT EXECUTE ON FUNCTION "
              "idemq.enqueue(text, jsonb, text, text, timestamptz, integer), "
              "idemq.enqueue_raw(text, bytea, text, text, timestamptz, integer) TO %s",
          app, app);
    for (int i = 0; i < 3; i++) {
        snprintf(sql, sizeof sql, "SELECT idemq.enqueue('%s', '{\"job_id\":\"%s:%d\"%s}')",
                 t.name, t.name, i,
                 i == 1 ? ",\"raise\":\"40001\",\"raise_until\":1"
                        : i == 2 ? ",\"raise\":\"22023\"" : "");
        ck_assert_str_eq(as_role(app, sql, st), "");
    }
    /* the application cannot write the table, take, settle or redrive */
    snprintf(sql, sizeof sql, "INSERT INTO idemq.queue_jobs (queue, payload, redrive_gen) "
                              "VALUES ('%s', '\\x7b7d', 0)", t.name);
    ck_assert_str_eq(as_role(app, sql, st), "42501");
    ck_assert_str_eq(as_role(app, "SELECT * FROM idemq.queue_jobs", st), "42501");
    ck_assert_str_eq(as_role(app, "SELECT * FROM idemq.queue_take('x', 1)", st), "42501");
    ck_assert_str_eq(as_role(app, "SELECT idemq.queue_redrive(1, 'x')", st), "42501");
    ck_assert_str_eq(as_role(app, "SELECT idemq.queue_settle('{1}', '{}', '{}', '{}', '{}', "
                                  "'{}', '{}')", st), "42501");
    /* a role without the grant cannot enqueue */
    snprintf(sql, sizeof sql, "SELECT idemq.enqueue('%s', '{}')", t.name);
    ck_assert_str_eq(as_role(bare, sql, st), "42501");
    /* the run role writes nothing directly, and runs the input */
    ck_assert_str_eq(as_role(run, "DELETE FROM idemq.queue_jobs", st), "42501");
    dsn_as(run, dsn, sizeof dsn);
    snprintf(env, sizeof env, "IDEMQ_PG_DSN=%s", dsn);
    pid = itest_spawn(&t, cfg, 2, envv);
    ws = itest_wait(pid, itest_ms(60000));
    ck_assert(ws != -1 && WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq_test.effects WHERE key IN ('%s:0', "
                               "'%s:1')", t.name, t.name), 2);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.attempts WHERE key = '%s:1' AND "
                               "outcome = 'transient_error'", t.name), 1);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.parked WHERE key = '%s:2'", t.name),
                     1);
    ck_assert_int_eq(qlong(&t, "SELECT count(*) FROM idemq.queue_jobs WHERE queue = '%s'",
                           t.name), 0);
    qexec(&t, "DROP OWNED BY %s, %s, %s; DROP ROLE %s; DROP ROLE %s; DROP ROLE %s; DROP "
              "FUNCTION %s(text, jsonb, jsonb)", run, app, bare, run, app, bare, fn);
    itest_teardown(&t);
}
END_TEST

START_TEST(test_config_refuses)
{
    static const char *const bad[] = {
        /* a postgres input has no exchange, partitions, observe mode */
        "inputs = ({ name = \"a\"; transport = \"postgres\"; queue = \"a\"; exchange = \"x\"; "
        "effect_function = \"f\"; });",
        "inputs = ({ name = \"a\"; transport = \"postgres\"; queue = \"a\"; partitions = 2; "
        "effect_function = \"f\"; });",
        "inputs = ({ name = \"a\"; transport = \"postgres\"; queue = \"a\"; mode = \"observe\"; "
        "effect_function = \"f\"; });",
        "inputs = ({ name = \"a\"; transport = \"postgres\"; queue = \"a\"; key_source = "
        "\"header:k\"; effect_function = \"f\"; });",
        /* key = the enqueue's key: postgres only; an unknown transport */
        "inputs = ({ name = \"a\"; queue = \"a\"; key_source = \"key\"; effect_function = "
        "\"f\"; });",
        "inputs = ({ name = \"a\"; transport = \"kafka\"; queue = \"a\"; effect_function = "
        "\"f\"; });",
    };
    struct conf *c = NULL;
    char err[512];
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ck_assert_msg(conf_load_string(bad[i], &c, err, sizeof err) == IDEMQ_ERR_CONFIG,
                      "accepted: %s", bad[i]);
        ck_assert_ptr_null(c);
    }
    /* observe mode: refused with the reason and what to do instead */
    ck_assert(conf_load_string("inputs = ({ name = \"a\"; transport = \"postgres\"; queue = "
                               "\"a\"; mode = \"observe\"; effect_function = \"f\"; });",
                               &c, err, sizeof err) == IDEMQ_ERR_CONFIG);
    ck_assert_msg(strstr(err, "no copy to take") && strstr(err, "on a broker input"), "%s", err);
    /* both kinds in one file: the postgres one apart from the broker's */
    ck_assert_msg(conf_load_string("inputs = ({ name = \"b\"; queue = \"b\"; effect_function = "
                                   "\"f\"; }, { name = \"p\"; transport = \"postgres\"; queue "
                                   "= \"p\"; key_source = \"key\"; effect_function = \"g\"; });",
                                   &c, err, sizeof err) == IDEMQ_OK, "%s", err);
    ck_assert_int_eq(c->n_inputs, 1);
    ck_assert_int_eq(c->n_pg_inputs, 1);
    ck_assert_str_eq(c->inputs[0].name, "b");
    ck_assert_str_eq(c->pg_inputs[0].name, "p");
    ck_assert_int_eq(c->pg_inputs[0].key_kind, CONF_KEY_MESSAGE_ID);
    conf_free(c);
    /* a postgres input before a Celery one: the routes' effects are
     * numbered after the broker inputs that stay (the ledger session of
     * the broker workers resolves effects in that order) */
    ck_assert_msg(conf_load_string("inputs = ({ name = \"p\"; transport = \"postgres\"; "
                                   "queue = \"p\"; effect_function = \"g\"; }, { name = "
                                   "\"c\"; queue = \"c\"; protocol = \"celery\"; key_source "
                                   "= \"task_id\"; celery_tasks = [\"t.a=x.a\", "
                                   "\"t.b=x.b\"]; });", &c, err, sizeof err) == IDEMQ_OK,
                  "%s", err);
    ck_assert_int_eq(c->n_inputs, 1);
    ck_assert_int_eq(c->n_routes, 2);
    ck_assert_int_eq(c->inputs[0].routes[0].effect, 1);
    ck_assert_int_eq(c->inputs[0].routes[1].effect, 2);
    ck_assert_int_eq(conf_pg_view(c).n_inputs, 1);
    ck_assert_int_eq(conf_pg_view(c).n_routes, 0);
    conf_free(c);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("pgq");
    TCase *tc = tcase_create("pgq");
    tcase_set_timeout(tc, itest_ms(180));
    tcase_add_test(tc, test_config_refuses);
    tcase_add_test(tc, test_enqueue_limits);
    tcase_add_test(tc, test_trace_context_of_rows);
    tcase_add_test(tc, test_rolled_back_enqueue_never_runs);
    tcase_add_test(tc, test_two_enqueues_of_one_key);
    tcase_add_test(tc, test_order_per_key);
    tcase_add_test(tc, test_due_time_and_priority);
    tcase_add_test(tc, test_queue_gauges);
    tcase_add_test(tc, test_worker_metrics_and_ready);
    tcase_add_test(tc, test_not_ready_worker_fails_ready);
    tcase_add_test(tc, test_max_rate_paces_the_drain);
    tcase_add_test(tc, test_retry_then_success_with_history);
    tcase_add_test(tc, test_plain_path_and_its_fallback);
    tcase_add_test(tc, test_key_and_error_with_quotes);
    tcase_add_test(tc, test_effect_enqueues_a_chain);
    tcase_add_test(tc, test_park_and_redrive);
    tcase_add_test(tc, test_cli_redrive);
    tcase_add_test(tc, test_statement_timeout_is_an_attempt);
    tcase_add_test(tc, test_notify_wakes_idle_worker);
    tcase_add_test(tc, test_two_replicas_exactly_once);
    tcase_add_test(tc, test_killed_replica);
    tcase_add_test(tc, test_provider_job_applied_once);
    tcase_add_test(tc, test_provider_lease_holder_crash);
    tcase_add_test(tc, test_three_replicas_kill_loop);
    tcase_add_test(tc, test_least_privilege_roles);
    /* apply, retry, park and redrive as the roles of migrate --grant */
    itest_lp_tcase(s, (const TTest *const[]){test_retry_then_success_with_history,
                                              test_park_and_redrive, test_cli_redrive, NULL});
    suite_add_tcase(s, tc);
    return check_run(s);
}
