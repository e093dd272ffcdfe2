/*
 * Integration tests of retries as an audit workflow: error classes, durable
 * backoff on broker delay buckets, dead-lettering with full history,
 * redrive (idemq and a broker-side shovel), outages and bad deploys, and an
 * unconfirmed republish. Real RabbitMQ and PostgreSQL (see itest.h).
 */
#include <check.h>

#include "check_run.h"
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "itest.h"
#include "job.h"
#include "topology.h"

#define EFFECTS_FOR "SELECT count(*) FROM idemq_test.effects WHERE key = $1"
#define OUTCOMES(o) "SELECT count(*) FROM idemq.attempts WHERE key = $1 AND outcome = '" o "'"

static void publish1(struct itest *t, const char *key, const char *extra)
{
    char b[512];
    const char *bodies[1] = {b};
    snprintf(b, sizeof b, "{\"job_id\":\"%s\",\"amount_minor\":100%s%s}", key,
             extra ? "," : "", extra ? extra : "");
    itest_publish(t, bodies, 1);
}

static void mkkey(struct itest *t, char *buf, size_t len, const char *what)
{
    snprintf(buf, len, "%s:%s", t->name, what);
}

static void run_ok(struct itest *t, int idle_s)
{
    itest_run_until_idle(t, idle_s);
}

/* 1. Fails with 40001 twice, then succeeds: applied on attempt 3, the
 * history is in the ledger, the observed delays grow and each is at least
 * the computed delay and less than twice it (plus processing slack). Also
 * `idemq jobs show` tells that story. */
START_TEST(test_transient_then_applied)
{
    struct itest t;
    char key[128], out[16384], q[512];
    itest_retry_conf = "base_delay_ms = 300; max_delay_ms = 5000; jitter = \"none\";";
    itest_setup(&t, "retry3", "idemq_test.record", "", "");
    mkkey(&t, key, sizeof key, "flaky");
    publish1(&t, key, "\"raise\":\"40001\",\"raise_until\":2");
    run_ok(&t, 3);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
    ck_assert_int_eq(itest_long(&t, "SELECT attempts FROM idemq.jobs WHERE key = $1 "
                                    "AND state = 'applied'",
                                key),
                     3);
    ck_assert_int_eq(itest_long(&t, OUTCOMES("transient_error"), key), 2);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.attempts WHERE key = $1 AND "
                                    "outcome = 'transient_error' AND error_class = 'transient' "
                                    "AND sqlstate = '40001' AND attempt IN (1, 2)",
                                key),
                     2);
    ck_assert_int_eq(itest_long(&t, "SELECT attempt FROM idemq.attempts WHERE key = $1 "
                                    "AND outcome = 'applied'",
                                key),
                     3);
    /* delays chosen: 300 then 600 ms; observed = next start - previous end */
    snprintf(q, sizeof q,
             "SELECT count(*) FROM (SELECT delay_ms, extract(epoch FROM lead(started_at) OVER "
             "(ORDER BY attempt) - finished_at) * 1000 AS observed FROM idemq.attempts "
             "WHERE key = $1 AND outcome <> 'duplicate') x WHERE delay_ms IS NOT NULL AND "
             "observed >= delay_ms - 5 AND observed < 2 * delay_ms + 400");
    ck_assert_int_eq(itest_long(&t, q, key), 2);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM (SELECT delay_ms, lag(delay_ms) OVER "
                                    "(ORDER BY attempt) AS prev FROM idemq.attempts WHERE key = "
                                    "$1 AND outcome = 'transient_error') x WHERE delay_ms > prev",
                                key),
                     1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1", key), 0);
    /* jobs show */
    snprintf(q, sizeof q, "jobs show %s", key);
    ck_assert_int_eq(itest_idemq(&t, q, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "state applied, 3 attempts") != NULL, "%s", out);
    ck_assert_msg(strstr(out, "attempt 1 (generation 0): transient_error transient") != NULL,
                  "%s", out);
    ck_assert_msg(strstr(out, "SQLSTATE 40001") != NULL, "%s", out);
    ck_assert_msg(strstr(out, "attempt 3 (generation 0): applied") != NULL, "%s", out);
    ck_assert_msg(strstr(out, "result: {") != NULL, "%s", out);
    ck_assert(strstr(out, "attempt 1 ") < strstr(out, "attempt 3 "));
    ck_assert_int_eq(itest_queue_ready(&t, t.name), 0);
    itest_teardown(&t);
    itest_retry_conf = NULL;
}
END_TEST

/* 2. A 23505 raised by the effect parks after one attempt; the dead-letter
 * message and the park row carry every field. */
START_TEST(test_permanent_parks_with_fields)
{
    struct itest t;
    char key[128], dlq[300], sql[256];
    struct broker *b;
    char err[512];
    struct job j;
    const char *hdrs[] = {"x-idemq-key", "x-idemq-error-class", "x-idemq-error-code",
                          "x-idemq-sqlstate", "x-idemq-error", "x-idemq-attempts",
                          "x-idemq-generation", "x-idemq-park-id", "x-idemq-payload-sha256",
                          "x-idemq-first-attempt-at", "x-idemq-last-attempt-at",
                          "x-idemq-parked-at", "x-idemq-origin-exchange",
                          "x-idemq-origin-queue", "x-idemq-origin-routing-key", NULL};
    itest_setup(&t, "perm", "idemq_test.record", "", "");
    mkkey(&t, key, sizeof key, "dup-iban");
    publish1(&t, key, "\"raise\":\"23505\"");
    run_ok(&t, 2);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.attempts WHERE key = $1", key),
                     1);
    ck_assert_int_eq(
        itest_long(&t,
                   "SELECT count(*) FROM idemq.parked p JOIN idemq.jobs j USING (key) WHERE "
                   "key = $1 AND j.state = 'parked' AND p.error_class = 'permanent' AND "
                   "p.error_code = 'effect_error' AND p.sqlstate = '23505' AND p.attempts = 1 "
                   "AND p.payload_sha256 = encode(sha256(p.body), 'hex') AND p.reason LIKE "
                   "'requested failure 23505%' AND p.first_attempt_at IS NOT NULL AND "
                   "p.last_attempt_at IS NOT NULL AND p.dlq_published_at IS NOT NULL AND "
                   "cardinality(p.attempt_ids) = 1 AND p.source_queue = p.routing_key",
                   key),
        1);
    topology_dlq(&t.conf->inputs[0], dlq, sizeof dlq);
    ck_assert_int_eq(itest_queue_ready(&t, dlq), 1);
    ck_assert(broker_open(t.conf, "itest", false, &b, err, sizeof err) == 0);
    job_init(&j);
    ck_assert_msg(broker_get(b, dlq, &j, true) == IDEMQ_OK, "%s", broker_error(b));
    for (int i = 0; hdrs[i]; i++)
        ck_assert_msg(json_object_get(j.headers, hdrs[i]) != NULL, "DLQ message lacks %s",
                      hdrs[i]);
    ck_assert_str_eq(json_string_value(json_object_get(j.headers, "x-idemq-key")), key);
    ck_assert_str_eq(json_string_value(json_object_get(j.headers, "x-idemq-error-class")),
                     "permanent");
    ck_assert_str_eq(json_string_value(json_object_get(j.headers, "x-idemq-sqlstate")), "23505");
    ck_assert_str_eq(json_string_value(json_object_get(j.headers, "x-idemq-origin-queue")),
                     t.name);
    ck_assert_int_eq(json_integer_value(json_object_get(j.headers, "x-idemq-attempts")), 1);
    ck_assert_ptr_nonnull(strstr((char *)j.body, key));
    snprintf(sql, sizeof sql, "SELECT count(*) FROM idemq.parked WHERE key = $1 AND "
             "payload_sha256 = '%s'",
             json_string_value(json_object_get(j.headers, "x-idemq-payload-sha256")));
    ck_assert_int_eq(itest_long(&t, sql, key), 1);
    job_destroy(&j);
    broker_close(b);
    itest_teardown(&t);
}
END_TEST

/* 3. Always transient: parked after exactly max_attempts. */
START_TEST(test_exhausted_after_max_attempts)
{
    struct itest t;
    char key[128];
    itest_retry_conf = "max_attempts = 3; base_delay_ms = 100; max_delay_ms = 400;";
    itest_setup(&t, "exhaust", "idemq_test.record", "", "");
    mkkey(&t, key, sizeof key, "always-busy");
    publish1(&t, key, "\"raise\":\"55P03\"");
    run_ok(&t, 3);
    ck_assert_int_eq(itest_long(&t, OUTCOMES("transient_error"), key), 3);
    ck_assert_int_eq(itest_long(&t, "SELECT max(attempt) FROM idemq.attempts WHERE key = $1",
                                key),
                     3);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1 AND "
                                    "error_class = 'transient' AND error_code = "
                                    "'retries_exhausted' AND attempts = 3 AND sqlstate = '55P03'",
                                key),
                     1);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 0);
    itest_teardown(&t);
    itest_retry_conf = NULL;
}
END_TEST

/* 4. The consumer stops during a backoff and starts again: attempt numbers
 * continue from the ledger, the schedule is kept, never more than
 * max_attempts. */
START_TEST(test_restart_keeps_schedule)
{
    struct itest t;
    char key[128];
    int st;
    itest_retry_conf = "max_attempts = 3; base_delay_ms = 1200; max_delay_ms = 5000; "
                       "jitter = \"none\";";
    itest_setup(&t, "restart", "idemq_test.record", "", "");
    mkkey(&t, key, sizeof key, "restarted");
    publish1(&t, key, "\"raise\":\"40P01\"");
    /* First run: attempt 1, then the job waits 1.2 s on the broker while
     * this process goes idle and exits. */
    st = itest_wait(itest_spawn(&t, t.cfg_path, 1, NULL), itest_ms(30000));
    ck_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    ck_assert_int_eq(itest_long(&t, OUTCOMES("transient_error"), key), 1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key = $1 AND state "
                                    "= 'retrying' AND run_after > last_attempt_at",
                                key),
                     1);
    run_ok(&t, 6);
    ck_assert_int_eq(itest_long(&t, OUTCOMES("transient_error"), key), 3);
    ck_assert_int_eq(itest_long(&t, "SELECT string_agg(attempt::text, ',' ORDER BY id) FROM "
                                    "idemq.attempts WHERE key = $1 AND outcome = "
                                    "'transient_error' AND attempt BETWEEN 1 AND 3 AND "
                                    "attempt = (SELECT count(*) FROM idemq.attempts b WHERE "
                                    "b.key = $1 AND b.outcome = 'transient_error' AND b.id <= "
                                    "attempts.id)",
                                key) != -1,
                     1);
    /* the second attempt honoured the first delay across the restart */
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.attempts a JOIN idemq.attempts "
                                    "b ON b.key = a.key AND b.attempt = 2 AND b.outcome = "
                                    "'transient_error' WHERE a.key = $1 AND a.attempt = 1 AND "
                                    "a.outcome = 'transient_error' AND b.started_at >= "
                                    "a.finished_at + interval '1195 ms'",
                                key),
                     1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1 AND "
                                    "attempts = 3",
                                key),
                     1);
    itest_teardown(&t);
    itest_retry_conf = NULL;
}
END_TEST

/* 5. idemq redrive of a parked job after its cause is fixed: applied once,
 * with a new generation; a redrive of a message whose key is already
 * applied is a duplicate. */
START_TEST(test_redrive_after_fix)
{
    struct itest t;
    char key[128], sql[512], out[8192], args[300], dlq[300];
    json_t *h;
    itest_setup(&t, "redrive", "idemq_test.record", "", "");
    mkkey(&t, key, sizeof key, "fix-me");
    snprintf(sql, sizeof sql, "INSERT INTO idemq_test.failing VALUES ('%s', '23514')", key);
    itest_sql(&t, sql);
    publish1(&t, key, NULL);
    run_ok(&t, 2);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key = $1 AND state "
                                    "= 'parked'",
                                key),
                     1);
    topology_dlq(&t.conf->inputs[0], dlq, sizeof dlq);
    ck_assert_int_eq(itest_queue_ready(&t, dlq), 1);
    /* a dry run moves nothing */
    snprintf(args, sizeof args, "redrive --dry-run --key %s", key);
    ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "would redrive 1 message") != NULL, "%s", out);
    ck_assert_int_eq(itest_queue_ready(&t, dlq), 1);
    /* fix the cause, redrive, consume */
    snprintf(sql, sizeof sql, "DELETE FROM idemq_test.failing WHERE key = '%s'", key);
    itest_sql(&t, sql);
    snprintf(args, sizeof args, "redrive --key %s --class permanent", key);
    ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "redrove 1 message") != NULL, "%s", out);
    ck_assert_int_eq(itest_queue_ready(&t, dlq), 0);
    run_ok(&t, 2);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key = $1 AND state "
                                    "= 'applied' AND generation = 1 AND attempts = 2 AND "
                                    "budget_base = 1",
                                key),
                     1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.redrives WHERE key = $1 AND "
                                    "generation = 1 AND source LIKE 'idemq redrive (%'",
                                key),
                     1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq_test.effects WHERE key = $1 "
                                    "AND (meta->>'generation')::int = 1",
                                key),
                     1);
    /* a dead-letter copy of the now applied key, redriven: a duplicate */
    h = json_pack("{s:s,s:s,s:s,s:i,s:s}", "x-idemq-key", key, "x-idemq-origin-queue", t.name,
                  "x-idemq-error-class", "permanent", "x-idemq-generation", 0,
                  "x-idemq-origin-exchange", t.name);
    snprintf(sql, sizeof sql, "{\"job_id\":\"%s\",\"amount_minor\":100}", key);
    itest_publish_to(&t, "", dlq, sql, h, NULL);
    json_decref(h);
    snprintf(args, sizeof args, "redrive --key %s", key);
    ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 0);
    run_ok(&t, 2);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
    ck_assert_int_eq(itest_long(&t, OUTCOMES("duplicate"), key), 1);
    /* parked list shows the park and counts by class */
    snprintf(args, sizeof args, "parked list --key %s", key);
    ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "count by error class: permanent=1") != NULL, "%s", out);
    itest_teardown(&t);
}
END_TEST

/* 6. Broker-side redrive: a dynamic shovel moves the dead letter back to
 * the work queue; the consumer recognises the parked key's generation. */
START_TEST(test_shovel_redrive)
{
    struct itest t;
    char key[128], sql[512], cmd[2048], dlq[300];
    const char *mgmt = getenv("IDEMQ_RABBIT_MGMT_URL");
    itest_setup(&t, "shovel", "idemq_test.record", "", "");
    ck_assert_msg(mgmt != NULL, "IDEMQ_RABBIT_MGMT_URL not set");
    mkkey(&t, key, sizeof key, "shovel-me");
    snprintf(sql, sizeof sql, "INSERT INTO idemq_test.failing VALUES ('%s', '22012')", key);
    itest_sql(&t, sql);
    publish1(&t, key, NULL);
    run_ok(&t, 2);
    topology_dlq(&t.conf->inputs[0], dlq, sizeof dlq);
    ck_assert_int_eq(itest_queue_ready(&t, dlq), 1);
    snprintf(sql, sizeof sql, "DELETE FROM idemq_test.failing WHERE key = '%s'", key);
    itest_sql(&t, sql);
    snprintf(cmd, sizeof cmd,
             "curl -sf -u guest:guest -X PUT -H 'content-type: application/json' "
             "%s/api/parameters/shovel/%%2F/%s -d '{\"value\":{\"src-protocol\":\"amqp091\","
             "\"src-uri\":\"amqp://\",\"src-queue\":\"%s\",\"src-delete-after\":"
             "\"queue-length\",\"dest-protocol\":\"amqp091\",\"dest-uri\":\"amqp://\","
             "\"dest-queue\":\"%s\"}}' >/dev/null",
             mgmt, t.name, dlq, t.name);
    ck_assert_int_eq(system(cmd), 0);
    for (int i = 0; i < 100 && itest_queue_ready(&t, dlq) != 0; i++)
        usleep(100000);
    ck_assert_int_eq(itest_queue_ready(&t, dlq), 0);
    run_ok(&t, 2);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.redrives WHERE key = $1 AND "
                                    "generation = 1 AND source = 'broker'",
                                key),
                     1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key = $1 AND state "
                                    "= 'applied' AND generation = 1",
                                key),
                     1);
    itest_teardown(&t);
}
END_TEST

/* a producer's CC/BCC header (sender-selected distribution) never
 * steers a publish made with idemq's credentials: the retry copy in the
 * delay bucket and the dead-letter copy carry neither, and `idemq redrive`
 * of a dead-letter copy that does (one a producer or the broker put there)
 * copies nothing into the unrelated queue the header names. Checked with
 * basic.get on the victim queue. */
static void get_without_cc(struct broker *b, const char *queue)
{
    struct job j;
    job_init(&j);
    ck_assert_msg(broker_get(b, queue, &j, false) == IDEMQ_OK, "%s: %s", queue,
                  broker_error(b));
    ck_assert_msg(!json_object_get(j.headers, "CC") && !json_object_get(j.headers, "BCC"),
                  "the copy in %s still carries a CC/BCC header", queue);
    ck_assert(broker_nack(b, j.tag, true) == IDEMQ_OK);
    job_destroy(&j);
}

static void assert_queue_empty(struct broker *b, const char *queue)
{
    struct job j;
    idemq_err_t e;
    job_init(&j);
    e = broker_get(b, queue, &j, true);
    ck_assert_msg(e == IDEMQ_ERR_TIMEOUT, "%s holds a message (%s): %.*s", queue,
                  e == IDEMQ_OK ? "copied there" : broker_error(b), (int)j.body_len,
                  j.body ? (const char *)j.body : "");
    job_destroy(&j);
}

START_TEST(test_cc_header_never_steers)
{
    struct itest t;
    char flaky[128], perm[128], forged[128], body[512], dlq[300], dlx[300], victim[300];
    char bucket[300];
    char out[8192], err[512];
    struct broker *b;
    json_t *h;

    itest_retry_conf = "base_delay_ms = 3000; max_delay_ms = 3000; jitter = \"none\";";
    itest_setup(&t, "cc", "idemq_test.record", "", "");
    itest_retry_conf = NULL;
    topology_dlq(&t.conf->inputs[0], dlq, sizeof dlq);
    topology_bucket_queue(&t.conf->inputs[0], topology_bucket(3000), bucket, sizeof bucket);
    snprintf(victim, sizeof victim, "%s.victim", t.name);
    ck_assert_int_eq(broker_open(t.conf, "itest cc", true, &b, err, sizeof err), IDEMQ_OK);
    ck_assert_int_eq(broker_admin_declare_queue(b, victim, NULL, false), IDEMQ_OK);
    mkkey(&t, flaky, sizeof flaky, "flaky");
    mkkey(&t, perm, sizeof perm, "perm");
    mkkey(&t, forged, sizeof forged, "forged");
    h = json_pack("{s:[s],s:[s]}", "CC", victim, "BCC", victim);
    snprintf(body, sizeof body, "{\"job_id\":\"%s\",\"raise\":\"40001\",\"raise_until\":1}",
             flaky);
    itest_publish_to(&t, t.name, t.name, body, h, NULL);
    snprintf(body, sizeof body, "{\"job_id\":\"%s\",\"raise\":\"23505\"}", perm);
    itest_publish_to(&t, t.name, t.name, body, h, NULL);
    json_decref(h);
    /* one attempt each: the flaky one waits 3 s in its bucket, the other parks */
    run_ok(&t, 1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key = $1 AND state "
                                    "= 'parked'",
                                perm),
                     1);
    get_without_cc(b, bucket);
    get_without_cc(b, dlq);
    /* a dead-letter copy that carries CC anyway (published there, or
     * dead-lettered by the broker without a routing key); through the
     * dead-letter exchange, where the CC routes nowhere */
    h = json_pack("{s:s,s:s,s:s,s:[s]}", "x-idemq-key", forged, "x-idemq-origin-queue", t.name,
                  "x-idemq-error-class", "permanent", "CC", victim);
    snprintf(body, sizeof body, "{\"job_id\":\"%s\",\"amount_minor\":1}", forged);
    topology_dlx(&t.conf->inputs[0], dlx, sizeof dlx);
    itest_publish_to(&t, dlx, t.name, body, h, NULL);
    json_decref(h);
    assert_queue_empty(b, victim);
    ck_assert_int_eq(itest_idemq(&t, "redrive", out, sizeof out), 0);
    ck_assert_msg(strstr(out, "redrove 2 messages") != NULL, "%s", out);
    run_ok(&t, 5); /* the flaky job's retry comes back and applies */
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, flaky), 1);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, forged), 1);
    assert_queue_empty(b, victim);
    ck_assert_int_eq(broker_admin_delete_queue(b, victim), IDEMQ_OK);
    broker_close(b);
    itest_teardown(&t);
}
END_TEST

/* a producer's AMQP timestamp of 0, 2^63 or more, or far ahead is no
 * timestamp: a new key carrying one is applied, not parked as outside the
 * dedup window (and the sanitizer build does not abort on the age). A
 * plausible timestamp older than the window still parks. */
START_TEST(test_implausible_timestamp_is_absent)
{
    struct itest t;
    const char *what[] = {"zero", "wrapped", "future", "old"};
    const json_int_t ts[] = {0, INT64_MIN, (json_int_t)time(NULL) + 86400,
                             (json_int_t)time(NULL) - 500 * 86400};
    char key[4][128], body[256], err[512];
    struct broker *b;

    itest_setup(&t, "ts", "idemq_test.record", "", "");
    ck_assert_int_eq(broker_open(t.conf, "itest ts", true, &b, err, sizeof err), IDEMQ_OK);
    for (int i = 0; i < 4; i++) {
        json_t *orig = json_pack("{s:I}", "timestamp", ts[i]);
        struct broker_props p = {NULL, NULL, NULL, true, NULL, orig};
        mkkey(&t, key[i], sizeof key[i], what[i]);
        snprintf(body, sizeof body, "{\"job_id\":\"%s\",\"amount_minor\":1}", key[i]);
        ck_assert(broker_publish(b, t.name, t.name, body, strlen(body), &p) == IDEMQ_OK);
        json_decref(orig);
    }
    ck_assert(broker_wait_confirms(b, itest_ms(10000)) == IDEMQ_OK);
    broker_close(b);
    run_ok(&t, 2);
    for (int i = 0; i < 3; i++) {
        char st[32];
        ck_assert_msg(itest_long(&t, EFFECTS_FOR, key[i]) == 1, "%s: state %s, not applied",
                      what[i],
                      itest_text(&t, "SELECT coalesce((SELECT state || ' ' || coalesce((SELECT "
                                     "error_code FROM idemq.parked p WHERE p.key = j.key LIMIT "
                                     "1), '') FROM idemq.jobs j WHERE key = $1), 'none')",
                                 key[i], st, sizeof st));
    }
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key[3]), 0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1 AND "
                                    "error_code = 'outside_dedup_window'",
                                key[3]),
                     1);
    itest_teardown(&t);
}
END_TEST

/* a running consumer follows a change of the ledger's dedup window
 * (idemq migrate writing idemq.retention) without reconnecting, as
 * pruning does: a replay older than the new, shorter window parks as
 * outside_dedup_window. The window is restored afterwards. */
static void wait_for(struct itest *t, const char *sql, const char *key, const char *what)
{
    for (int i = 0; i < itest_ms(100); i++) {
        if (itest_long(t, sql, key) == 1)
            return;
        usleep(100000);
    }
    ck_abort_msg("%s: %s did not happen within 10 s", key, what);
}

START_TEST(test_window_change_followed)
{
    struct itest t;
    char warm[128], late[128], body[256], err[512], old_window[64];
    struct broker *b;
    json_t *orig;
    pid_t pid;
    int st;

    itest_setup(&t, "window", "idemq_test.record", "", "");
    mkkey(&t, warm, sizeof warm, "warm");
    mkkey(&t, late, sizeof late, "late");
    itest_text(&t, "SELECT dedup_window::text FROM idemq.retention WHERE id = 1", NULL,
               old_window, sizeof old_window);
    pid = itest_spawn(&t, t.cfg_path, 4, NULL);
    publish1(&t, warm, NULL);
    wait_for(&t, EFFECTS_FOR, warm, "applied");
    /* what `idemq migrate` does with a shorter ledger.dedup_window_days */
    itest_sql(&t, "UPDATE idemq.retention SET dedup_window = interval '1 day' WHERE id = 1");
    ck_assert_int_eq(broker_open(t.conf, "itest window", true, &b, err, sizeof err), IDEMQ_OK);
    orig = json_pack("{s:I}", "timestamp", (json_int_t)time(NULL) - 2 * 86400);
    {
        struct broker_props p = {NULL, NULL, NULL, true, NULL, orig};
        snprintf(body, sizeof body, "{\"job_id\":\"%s\",\"amount_minor\":1}", late);
        ck_assert(broker_publish(b, t.name, t.name, body, strlen(body), &p) == IDEMQ_OK);
        ck_assert(broker_wait_confirms(b, itest_ms(10000)) == IDEMQ_OK);
    }
    json_decref(orig);
    broker_close(b);
    wait_for(&t, "SELECT count(*) FROM idemq.jobs WHERE key = $1 AND state IN ('applied', "
                 "'parked')",
             late, "settled");
    st = itest_wait(pid, itest_ms(60000));
    {
        char sql[256];
        snprintf(sql, sizeof sql,
                 "UPDATE idemq.retention SET dedup_window = interval '%s' WHERE id = 1",
                 old_window);
        itest_sql(&t, sql);
    }
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "status 0x%x", st);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, late), 0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1 AND "
                                    "error_code = 'outside_dedup_window'",
                                late),
                     1);
    itest_teardown(&t);
}
END_TEST

/* a producer cannot redrive a parked key: the same body with
 * x-idemq-generation (and a made-up x-idemq-redriven-by, or a made-up
 * x-idemq-seal) is parked as forged_redrive and not applied; the key stays
 * parked in its generation. Those parks are not redrivable: a redrive of
 * their group moves nothing. The key's own sealed dead-letter copy,
 * redriven by `idemq redrive`, still applies, recorded as the operator's. */
START_TEST(test_forged_redrive_parks)
{
    struct itest t;
    char key[128], sql[512], body[256], args[300], out[8192];
    json_t *h;
    itest_setup(&t, "forged", "idemq_test.record", "", "");
    mkkey(&t, key, sizeof key, "parked");
    snprintf(sql, sizeof sql, "INSERT INTO idemq_test.failing VALUES ('%s', '23514')", key);
    itest_sql(&t, sql);
    publish1(&t, key, NULL);
    run_ok(&t, 2);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key = $1 AND state "
                                    "= 'parked'",
                                key),
                     1);
    snprintf(sql, sizeof sql, "DELETE FROM idemq_test.failing WHERE key = '%s'", key);
    itest_sql(&t, sql);
    snprintf(body, sizeof body, "{\"job_id\":\"%s\",\"amount_minor\":100}", key);
    h = json_pack("{s:i,s:s}", "x-idemq-generation", 0, "x-idemq-redriven-by", "ops-admin");
    itest_publish_to(&t, t.name, t.name, body, h, NULL);
    json_decref(h);
    h = json_pack("{s:i,s:s}", "x-idemq-generation", 0, "x-idemq-seal",
                  "0000000000000000000000000000000000000000000000000000000000000000");
    itest_publish_to(&t, t.name, t.name, body, h, NULL);
    json_decref(h);
    run_ok(&t, 2);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.redrives WHERE key = $1", key),
                     0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key = $1 AND state "
                                    "= 'parked' AND generation = 0",
                                key),
                     1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1 AND "
                                    "error_code = 'forged_redrive'",
                                key),
                     2);
    /* the forger's copies are not redrivable: a redrive of their failure
     * group (which an operator may well do) moves none of them, so the
     * forger's body is never applied as the key's redrive */
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1 AND "
                                    "error_code = 'forged_redrive' AND NOT redrivable",
                                key),
                     2);
    {
        char g[16];
        itest_text(&t,
                   "SELECT idemq.park_group(source_queue, error_class, error_code, sqlstate,"
                   " reason, key) FROM idemq.parked WHERE key = $1 AND error_code ="
                   " 'forged_redrive' LIMIT 1",
                   key, g, sizeof g);
        snprintf(args, sizeof args, "parked redrive --group %s", g);
        itest_idemq(&t, args, out, sizeof out);
        ck_assert_msg(strstr(out, "not redrivable") != NULL, "%s", out);
        run_ok(&t, 2);
        ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 0);
    }
    /* the operator's redrive of the key: its own sealed copy applies once */
    snprintf(args, sizeof args, "redrive --key %s", key);
    ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "redrove 1 message") != NULL, "%s", out);
    run_ok(&t, 2);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.redrives WHERE key = $1 AND "
                                    "generation = 1 AND source LIKE 'idemq redrive (%'",
                                key),
                     1);
    itest_teardown(&t);
}
END_TEST

/* A key reused with a different body: a delivery whose key is applied but
 * whose body's SHA-256 differs from the applied one is recorded as
 * key_reuse (the attempt row, `jobs show`), on the plain and the isolating
 * path, while a same-body copy stays a plain duplicate; with
 * on_key_reuse = "park" it is parked as key_reuse instead (the key stays
 * applied, the effect ran once). */
static void reuse_run(struct itest *t, const char *key, bool park, bool legacy)
{
    char b1[256], b2[256], same[256], args[300], out[16384], sql[512];
    const char *first[1] = {b1}, *later[2] = {same, b2};
    snprintf(b1, sizeof b1, "{\"job_id\":\"%s\",\"amount_minor\":100}", key);
    snprintf(same, sizeof same, "{\"job_id\":\"%s\",\"amount_minor\":100}", key);
    snprintf(b2, sizeof b2, "{\"job_id\":\"%s\",\"amount_minor\":999}", key);
    itest_publish(t, first, 1);
    run_ok(t, 1);
    /* the plain path keeps the first 8 bytes of the digest in the job row
     * (migration 19), the whole one in its batch row */
    snprintf(sql, sizeof sql,
             "SELECT count(*) FROM idemq.jobs j JOIN idemq.batches h"
             " ON h.at = j.applied_at AND h.id = j.batch_id"
             " WHERE j.key = $1 AND j.payload_sha256 IS NULL"
             " AND j.sha256_head = substring(sha256('%s'::bytea) FOR 8)"
             " AND substring(h.sha256 FROM (array_position(h.keys, j.key) - 1) * 32 + 1 FOR 32)"
             " = sha256('%s'::bytea)",
             b1, b1);
    ck_assert_int_eq(itest_long(t, sql, key), 1);
    if (legacy) /* a row written before migration 19: its batch row decides */
        ck_assert_int_eq(itest_long(t, "WITH u AS (UPDATE idemq.jobs SET sha256_head = NULL"
                                       " WHERE key = $1 RETURNING 1) SELECT count(*) FROM u",
                                    key),
                         1);
    itest_publish(t, later, 2);
    run_ok(t, 1);
    ck_assert_int_eq(itest_long(t, EFFECTS_FOR, key), 1);
    ck_assert_int_eq(itest_long(t, "SELECT count(*) FROM idemq.jobs WHERE key = $1 AND state = "
                                   "'applied'",
                               key),
                     1);
    ck_assert_int_eq(itest_long(t, "SELECT count(*) FROM idemq.attempts WHERE key = $1 AND "
                                   "outcome = 'duplicate' AND message LIKE 'key_reuse%'",
                               key),
                     1);
    ck_assert_int_eq(itest_long(t, "SELECT count(*) FROM idemq.parked WHERE key = $1 AND "
                                   "error_code = 'key_reuse'",
                               key),
                     (park ? 1 : 0));
    snprintf(args, sizeof args, "jobs show %s", key);
    ck_assert_int_eq(itest_idemq(t, args, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "key_reuse") != NULL, "%s", out);
}

START_TEST(test_key_reuse_recorded)
{
    struct itest t;
    char key[128];
    itest_setup(&t, "reuse", "idemq_test.record", "", "");
    mkkey(&t, key, sizeof key, "k");
    reuse_run(&t, key, false, false);
    mkkey(&t, key, sizeof key, "legacy");
    reuse_run(&t, key, false, true);
    itest_teardown(&t);
}
END_TEST

START_TEST(test_key_reuse_parks)
{
    struct itest t;
    char key[128];
    itest_setup(&t, "reusep", "idemq_test.record", "", "on_key_reuse = \"park\";");
    mkkey(&t, key, sizeof key, "k");
    reuse_run(&t, key, true, false);
    itest_teardown(&t);
}
END_TEST

/* 7. PostgreSQL stopped for ~10 s while jobs flow: nothing parked, nothing
 * lost, all applied once after it returns. */
START_TEST(test_postgres_outage)
{
    struct itest t;
    char bodies_buf[40][160], key[128];
    const char *bodies[40];
    pid_t pid;
    int st;
    itest_setup(&t, "pgdown", "idemq_test.record", "batch_max = 2;", "");
    for (int i = 0; i < 40; i++) {
        snprintf(bodies_buf[i], sizeof bodies_buf[i],
                 "{\"job_id\":\"%s:k%d\",\"amount_minor\":1,\"sleep_ms\":50}", t.name, i);
        bodies[i] = bodies_buf[i];
    }
    itest_publish(&t, bodies, 40);
    pid = itest_spawn(&t, t.cfg_path, 5, NULL);
    usleep(500000);
    ck_assert_int_eq(itest_services("pg-stop"), 0);
    sleep(10);
    ck_assert_int_eq(itest_services("pg-start"), 0);
    st = itest_wait(pid, itest_ms(90000));
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "status 0x%x", st);
    itest_reconnect_db(&t);
    for (int i = 0; i < 40; i++) {
        snprintf(key, sizeof key, "%s:k%d", t.name, i);
        ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
    }
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE source_queue = $1",
                                t.name),
                     0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.attempts WHERE queue = $1 AND "
                                    "outcome LIKE '%error'",
                                t.name),
                     0);
    ck_assert_int_eq(itest_queue_ready(&t, t.name), 0);
    itest_teardown(&t);
}
END_TEST

/* 8. The effect function is missing (a bad deploy): nothing is parked and
 * nothing consumed; once the function exists everything is applied. */
START_TEST(test_missing_effect_function)
{
    struct itest t;
    char fn[128], key[128], sql[512], metrics[128], url[160], body[1024], log[160];
    const char *bodies[5];
    char buf[5][160];
    pid_t pid;
    int st, port = itest_free_port(); /* 20000 + pid % 20000 collided with a busy port */
    snprintf(fn, sizeof fn, "idemq_test.late_%d", (int)getpid());
    snprintf(metrics, sizeof metrics, "metrics: { listen = \"127.0.0.1:%d\"; };", port);
    snprintf(url, sizeof url, "http://127.0.0.1:%d/ready", port);
    itest_extra_conf = metrics;
    itest_setup(&t, "deploy", fn, "", "");
    itest_extra_conf = NULL;
    for (int i = 0; i < 5; i++) {
        snprintf(buf[i], sizeof buf[i], "{\"job_id\":\"%s:k%d\",\"amount_minor\":1}", t.name, i);
        bodies[i] = buf[i];
    }
    itest_publish(&t, bodies, 5);
    snprintf(log, sizeof log, "/tmp/%s.log", t.name);
    pid = itest_spawn_log(t.cfg_path, 3, NULL, log);
    sleep(3);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE source_queue = $1",
                                t.name),
                     0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.attempts WHERE queue = $1",
                                t.name),
                     0);
    ck_assert_int_eq(itest_queue_ready(&t, t.name), 5);
    /* it says so on /ready */
    ck_assert_int_eq(itest_http_get(url, body, sizeof body), 503);
    /* tersely; why is in the log */
    ck_assert_msg(strcmp(body, "not ready\n") == 0, "%s", body);
    ck_assert_msg(itest_count_lines(log, "does not exist") > 0, "log %s", log);
    snprintf(sql, sizeof sql,
             "CREATE FUNCTION %s(k text, p jsonb, m jsonb) RETURNS jsonb LANGUAGE sql AS "
             "'SELECT idemq_test.record(k, p, m)'",
             fn);
    itest_sql(&t, sql);
    st = itest_wait(pid, itest_ms(90000));
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "status 0x%x", st);
    for (int i = 0; i < 5; i++) {
        snprintf(key, sizeof key, "%s:k%d", t.name, i);
        ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
    }
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE source_queue = $1",
                                t.name),
                     0);
    snprintf(sql, sizeof sql, "DROP FUNCTION %s(text, jsonb, jsonb)", fn);
    itest_sql(&t, sql);
    unlink(log);
    itest_teardown(&t);
}
END_TEST

/* 9. A republish that is not confirmed (the delay exchange deleted under
 * the consumer): the original is not acknowledged and not lost; once the
 * topology is back, the job is applied. */
START_TEST(test_unconfirmed_republish)
{
    struct itest t;
    char key[128], ex[300];
    struct broker *b;
    char err[512];
    pid_t pid;
    int st;
    itest_retry_conf = "base_delay_ms = 200;";
    itest_setup(&t, "noconfirm", "idemq_test.record", "", "");
    mkkey(&t, key, sizeof key, "lost?");
    pid = itest_spawn(&t, t.cfg_path, 4, NULL);
    for (int i = 0; i < 100 && itest_queue_consumers(&t, t.name) < 1; i++)
        usleep(50000);
    ck_assert_int_eq(itest_queue_consumers(&t, t.name), 1);
    ck_assert(broker_open(t.conf, "itest", false, &b, err, sizeof err) == 0);
    topology_delay_exchange(&t.conf->inputs[0], ex, sizeof ex);
    ck_assert(broker_admin_delete_exchange(b, ex) == IDEMQ_OK);
    publish1(&t, key, "\"raise\":\"40001\",\"raise_until\":1");
    /* attempt 1 fails, the republish fails, the consumer stops consuming */
    for (int i = 0; i < 100 && itest_long(&t, OUTCOMES("transient_error"), key) < 1; i++)
        usleep(50000);
    usleep(1000000);
    ck_assert_int_eq(itest_long(&t, OUTCOMES("transient_error"), key), 1);
    ck_assert_int_eq(itest_queue_ready(&t, t.name), 1); /* back, unacknowledged */
    ck_assert_int_eq(itest_queue_consumers(&t, t.name), 0); /* not ready: not consuming */
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1", key), 0);
    ck_assert(topology_declare(b, t.conf, &t.conf->inputs[0]) == IDEMQ_OK);
    broker_close(b);
    st = itest_wait(pid, itest_ms(90000));
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "status 0x%x", st);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
    ck_assert_int_eq(itest_long(&t, "SELECT attempts FROM idemq.jobs WHERE key = $1 AND state "
                                    "= 'applied'",
                                key),
                     2);
    ck_assert_int_eq(itest_queue_ready(&t, t.name), 0);
    itest_teardown(&t);
    itest_retry_conf = NULL;
}
END_TEST

/* An effect that runs past statement_timeout: the whole batch call is
 * cancelled (PL/pgSQL cannot catch 57014 per job), its batch-mates still
 * commit, and the slow job's timeouts count as transient attempts until it
 * parks as retries_exhausted. */
START_TEST(test_statement_timeout_is_transient)
{
    struct itest t;
    char key[128], slow[128], b[4][200];
    const char *bodies[4];
    itest_retry_conf = "max_attempts = 2; base_delay_ms = 100; max_delay_ms = 200;";
    itest_extra_conf = "database: { statement_timeout_ms = 600; };";
    itest_setup(&t, "timeout", "idemq_test.record", "batch_max = 10; batch_wait_ms = 200;", "");
    itest_extra_conf = NULL;
    mkkey(&t, slow, sizeof slow, "slow");
    for (int i = 0; i < 4; i++) {
        if (i == 1)
            snprintf(b[i], sizeof b[i], "{\"job_id\":\"%s\",\"sleep_ms\":3000}", slow);
        else
            snprintf(b[i], sizeof b[i], "{\"job_id\":\"%s:ok%d\"}", t.name, i);
        bodies[i] = b[i];
    }
    itest_publish(&t, bodies, 4);
    run_ok(&t, 3);
    for (int i = 0; i < 4; i += 1 + (i == 0)) {
        snprintf(key, sizeof key, "%s:ok%d", t.name, i);
        ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
    }
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, slow), 0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.attempts WHERE key = $1 AND "
                                    "outcome = 'transient_error' AND sqlstate = '57014'",
                                slow),
                     2);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1 AND "
                                    "error_code = 'retries_exhausted' AND sqlstate = '57014'",
                                slow),
                     1);
    itest_teardown(&t);
    itest_retry_conf = NULL;
}
END_TEST

/* A quorum work queue (and quorum dead-letter queue and delay buckets): a
 * duplicate is absorbed, a transient failure retries and a
 * permanent one parks, exactly as with classic queues. */
START_TEST(test_quorum_queue)
{
    struct itest t;
    char key[128], bad[128], dlq[300], b[3][200];
    const char *bodies[3];
    itest_retry_conf = "base_delay_ms = 100; max_delay_ms = 400;";
    itest_setup(&t, "quorum", "idemq_test.record", "", "queue_type = \"quorum\";");
    mkkey(&t, key, sizeof key, "q1");
    mkkey(&t, bad, sizeof bad, "q-bad");
    snprintf(b[0], sizeof b[0], "{\"job_id\":\"%s\",\"raise\":\"40001\",\"raise_until\":1}",
             key);
    snprintf(b[1], sizeof b[1], "{\"job_id\":\"%s\"}", key);
    snprintf(b[2], sizeof b[2], "{\"job_id\":\"%s\",\"raise\":\"22003\"}", bad);
    for (int i = 0; i < 3; i++)
        bodies[i] = b[i];
    itest_publish(&t, bodies, 3);
    run_ok(&t, 2);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
    ck_assert_int_eq(itest_long(&t, "SELECT attempts FROM idemq.jobs WHERE key = $1 AND state "
                                    "= 'applied'",
                                key),
                     2);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1 AND "
                                    "sqlstate = '22003'",
                                bad),
                     1);
    topology_dlq(&t.conf->inputs[0], dlq, sizeof dlq);
    ck_assert_int_eq(itest_queue_ready(&t, dlq), 1);
    ck_assert_int_eq(itest_queue_ready(&t, t.name), 0);
    itest_teardown(&t);
    itest_retry_conf = NULL;
}
END_TEST

/* A routing key that is not UTF-8 (AMQP allows any bytes) must not wedge
 * the failure path: the job parks with the key's bytes replaced. */
START_TEST(test_non_utf8_routing_key)
{
    struct itest t;
    char key[128], b[200];
    itest_setup(&t, "rk8", "idemq_test.record", "", "exchange_type = \"fanout\";");
    mkkey(&t, key, sizeof key, "bytes");
    snprintf(b, sizeof b, "{\"job_id\":\"%s\",\"raise\":\"23505\"}", key);
    itest_publish_to(&t, t.name, "rk.\xff\xfe", b, NULL, NULL);
    run_ok(&t, 2);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1 AND "
                                    "routing_key = 'rk.?' || '?'",
                                key),
                     1);
    ck_assert_int_eq(itest_queue_ready(&t, t.name), 0);
    itest_teardown(&t);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("retry");
    TCase *tc = tcase_create("retry");
    tcase_set_timeout(tc, itest_ms(180));
    tcase_add_test(tc, test_transient_then_applied);
    tcase_add_test(tc, test_permanent_parks_with_fields);
    tcase_add_test(tc, test_exhausted_after_max_attempts);
    tcase_add_test(tc, test_restart_keeps_schedule);
    tcase_add_test(tc, test_redrive_after_fix);
    tcase_add_test(tc, test_shovel_redrive);
    tcase_add_test(tc, test_postgres_outage);
    tcase_add_test(tc, test_missing_effect_function);
    tcase_add_test(tc, test_unconfirmed_republish);
    tcase_add_test(tc, test_statement_timeout_is_transient);
    tcase_add_test(tc, test_quorum_queue);
    tcase_add_test(tc, test_non_utf8_routing_key);
    suite_add_tcase(s, tc);
    /* what a producer's headers and properties must not reach */
    tc = tcase_create("producers");
    tcase_set_timeout(tc, itest_ms(180));
    tcase_add_test(tc, test_cc_header_never_steers);
    tcase_add_test(tc, test_implausible_timestamp_is_absent);
    tcase_add_test(tc, test_window_change_followed);
    tcase_add_test(tc, test_forged_redrive_parks);
    tcase_add_test(tc, test_key_reuse_recorded);
    tcase_add_test(tc, test_key_reuse_parks);
    suite_add_tcase(s, tc);
    /* least-privilege mode (scripts/test): these again, as the deployment's roles */
    itest_lp_tcase(s, (const TTest *const[]){test_transient_then_applied,
                                              test_permanent_parks_with_fields,
                                              test_redrive_after_fix, test_shovel_redrive, NULL});
    return check_run(s);
}
