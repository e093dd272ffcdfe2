/*
 * Integration tests of the retry path's loss windows: the delay
 * buckets of a quorum input are quorum queues that dead-letter at least
 * once, and a retry whose bucket copy is lost is published again from the
 * ledger's retry copy (consumer/rescue.c), by one replica at a time. Real
 * RabbitMQ and PostgreSQL (see itest.h).
 */
#include <check.h>

#include "check_run.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "itest.h"
#include "topology.h"

#define EFFECTS_FOR "SELECT count(*) FROM idemq_test.effects WHERE key = $1"
#define RESCUES_FOR "SELECT count(*) FROM idemq.retry_rescues WHERE key = $1"
/* The advisory lock a rescuer of this queue takes (ledger/functions_rescue.sql). */
#define RESCUE_LOCK "SELECT pg_advisory_lock(hashtext('idemq.rescue'), hashtext($1))::text"
#define RESCUE_UNLOCK "SELECT pg_advisory_unlock(hashtext('idemq.rescue'), hashtext($1))::text"

static void publish_flaky(struct itest *t, char *key, size_t len, const char *what,
                          json_t *headers)
{
    char b[512];
    snprintf(key, len, "%s:%s", t->name, what);
    snprintf(b, sizeof b, "{\"job_id\":\"%s\",\"raise\":\"40001\",\"raise_until\":1}", key);
    itest_publish_to(t, t->name, t->name, b, headers, NULL);
}

/* Runs idemq until idle for idle_s and asserts it exited 0. */
static void run_idle(struct itest *t, int idle_s)
{
    int st = itest_wait(itest_spawn(t, t->cfg_path, idle_s, NULL), itest_ms(60000));
    ck_assert_msg(st != -1, "idemq did not finish in time");
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "idemq exited with status 0x%x", st);
}

/* Waits (polling) until the job's run_after lies more than s seconds back. */
static void wait_run_after_past(struct itest *t, const char *key, double s)
{
    char sql[256];
    snprintf(sql, sizeof sql,
             "SELECT count(*) FROM idemq.jobs WHERE key = $1 AND run_after < "
             "clock_timestamp() - interval '%.3f s'",
             s);
    for (int i = 0; i < itest_ms(300); i++) {
        if (itest_long(t, sql, key) == 1)
            return;
        usleep(100000);
    }
    ck_abort_msg("run_after of %s did not pass", key);
}

/* Attempt 1 of a flaky job fails; the process goes idle and exits before
 * its retry comes back from the bucket (delay 3 s); the bucket's copy is
 * then purged, as a node crash at the dead-lettering moment would lose it.
 * sealed_key: the key protection.active names (NULL: none). */
static void fail_once_then_lose_copy(struct itest *t, char *key, size_t len, json_t *headers,
                                     const char *sealed_key)
{
    char bucket[TOPOLOGY_NAME_MAX];
    struct broker *b;
    char err[512];
    publish_flaky(t, key, len, "lost-copy", headers);
    run_idle(t, 1);
    ck_assert_int_eq(itest_long(t, "SELECT count(*) FROM idemq.jobs WHERE key = $1 AND "
                                   "state = 'retrying' AND attempts = 1",
                               key),
                     1);
    /* the ledger keeps the message while the job waits for its retry:
     * as sent, or sealed (not a byte of the key in it) under the active key */
    ck_assert_int_eq(itest_long(t, sealed_key ?
                                   "SELECT count(*) FROM idemq.retry_copies c JOIN idemq.jobs j "
                                   "USING (key) WHERE key = $1 AND c.attempt = 1 AND "
                                   "c.generation = 0 AND position(convert_to($1, 'UTF8') IN "
                                   "c.body) = 0 AND c.body_key IS NOT NULL AND "
                                   "c.source_queue = j.source_queue" :
                                   "SELECT count(*) FROM idemq.retry_copies c JOIN idemq.jobs j "
                                   "USING (key) WHERE key = $1 AND c.attempt = 1 AND "
                                   "c.generation = 0 AND position($1 IN convert_from(c.body, "
                                   "'UTF8')) > 0 AND c.body_key IS NULL AND "
                                   "c.source_queue = j.source_queue",
                               key),
                     1);
    if (sealed_key) {
        char sql[256];
        snprintf(sql, sizeof sql, "SELECT count(*) FROM idemq.retry_copies WHERE key = $1 AND "
                 "body_key = '%s'", sealed_key);
        ck_assert_int_eq(itest_long(t, sql, key), 1);
    }
    topology_bucket_queue(&t->conf->inputs[0], topology_bucket(3000), bucket, sizeof bucket);
    ck_assert_int_eq(itest_queue_ready(t, bucket), 1);
    ck_assert_msg(broker_open(t->conf, "itest purge", false, &b, err, sizeof err) == IDEMQ_OK,
                  "%s", err);
    ck_assert(broker_admin_purge(b, bucket) == IDEMQ_OK);
    broker_close(b);
}

/* 1. A quorum input's delay buckets are quorum queues that dead-letter
 * back to the work queue at least once (replicated; no single node holds
 * every retry), and a retry through them waits its delay. */
START_TEST(test_quorum_buckets)
{
    struct itest t;
    char key[128], bucket[TOPOLOGY_NAME_MAX], err[512];
    struct broker *b;
    json_t *args;
    itest_retry_conf = "base_delay_ms = 300; max_delay_ms = 1000; jitter = \"none\";";
    itest_setup(&t, "qbucket", "idemq_test.record", "", "queue_type = \"quorum\";");
    topology_bucket_queue(&t.conf->inputs[0], 200, bucket, sizeof bucket);
    ck_assert(broker_open(t.conf, "itest", false, &b, err, sizeof err) == IDEMQ_OK);
    /* A redeclare with other arguments is refused (406): these are its own. */
    args = json_pack("{s:s,s:s,s:s,s:s,s:s}", "x-queue-type", "quorum",
                     "x-dead-letter-exchange", "", "x-dead-letter-routing-key", t.name,
                     "x-dead-letter-strategy", "at-least-once", "x-overflow", "reject-publish");
    ck_assert_msg(broker_admin_declare_queue(b, bucket, args, false) == IDEMQ_OK, "%s",
                  broker_error(b));
    json_decref(args);
    args = json_pack("{s:s}", "x-queue-type", "classic");
    ck_assert(broker_admin_declare_queue(b, bucket, args, false) != IDEMQ_OK);
    json_decref(args);
    broker_close(b);

    publish_flaky(&t, key, sizeof key, "q-retry", NULL);
    run_idle(&t, 2);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
    ck_assert_int_eq(itest_long(&t, "SELECT attempts FROM idemq.jobs WHERE key = $1 AND state = "
                                    "'applied'",
                                key),
                     2);
    /* the retry waited at least its delay (300 ms), less than twice it */
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.attempts a JOIN idemq.attempts "
                                    "b ON b.key = a.key AND b.outcome = 'applied' WHERE a.key = "
                                    "$1 AND a.outcome = 'transient_error' AND a.delay_ms = 300 "
                                    "AND b.started_at >= a.finished_at + interval '295 ms' AND "
                                    "b.started_at < a.finished_at + interval '1000 ms'",
                                key),
                     1);
    ck_assert_int_eq(itest_long(&t, RESCUES_FOR, key), 0);
    ck_assert_int_eq(itest_queue_ready(&t, t.name), 0);
    ck_assert_int_eq(itest_queue_ready(&t, bucket), 0);
    itest_teardown(&t);
    itest_retry_conf = NULL;
}
END_TEST

/* 2. The bucket's copy of a retry is lost: after run_after + rescue_after a
 * replica publishes the ledger's copy again (confirmed), records the rescue,
 * and the job is applied once, on its next attempt. */
START_TEST(test_rescue_lost_copy)
{
    struct itest t;
    char key[128];
    itest_retry_conf = "base_delay_ms = 3000; max_delay_ms = 3000; jitter = \"none\"; "
                       "rescue_after_s = 1;";
    itest_setup(&t, "rescue", "idemq_test.record", "", "");
    fail_once_then_lose_copy(&t, key, sizeof key, NULL, NULL);
    run_idle(&t, 6);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
    ck_assert_int_eq(itest_long(&t, "SELECT attempts FROM idemq.jobs WHERE key = $1 AND state = "
                                    "'applied'",
                                key),
                     2);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.retry_rescues r JOIN idemq.jobs j "
                                    "USING (key) WHERE key = $1 AND r.attempt = 1 AND "
                                    "r.generation = 0 AND r.queue = j.source_queue AND "
                                    "r.rescued_at > r.run_after + interval '1 s'",
                                key),
                     1);
    ck_assert_int_eq(itest_queue_ready(&t, t.name), 0);
    itest_teardown(&t);
    itest_retry_conf = NULL;
}
END_TEST

/* A key file of 32 hex-encoded bytes (0600) at path. */
/* Retry copies sealed at rest: with protection.active the ledger's copy of
 * a retry holds no byte of the message in the clear. A process that lacks
 * its key reports the copy and leaves it (never publishes it empty, never
 * drops it); once the key is listed again the copy is opened, published
 * again, and the job applied once from the original body. */
START_TEST(test_rescue_sealed_copy)
{
    struct itest t;
    char key[128], k1[128], k2[128], extra[600], cfg2[300], log[300];
    FILE *f;
    int st;
    itest_key_file(k1, sizeof k1, "rescue-k1", 0x20);
    itest_key_file(k2, sizeof k2, "rescue-k2", 0x50);
    snprintf(extra, sizeof extra, "protection: { keys = [ \"k1=%s\" ]; active = \"k1\"; };", k1);
    itest_extra_conf = extra;
    itest_retry_conf = "base_delay_ms = 3000; max_delay_ms = 3000; jitter = \"none\"; "
                       "rescue_after_s = 1;";
    itest_setup(&t, "rescue_sealed", "idemq_test.record", "", "");
    itest_extra_conf = NULL;
    fail_once_then_lose_copy(&t, key, sizeof key, NULL, "k1");
    /* the same config with k2 instead of k1: the copy cannot be opened */
    {
        static char text[1 << 16];
        char *at, find[300];
        size_t n;
        ck_assert_ptr_nonnull(f = fopen(t.cfg_path, "r"));
        n = fread(text, 1, sizeof text - 1, f);
        text[n] = '\0';
        fclose(f);
        snprintf(find, sizeof find, "\"k1=%s\" ]; active = \"k1\"", k1);
        ck_assert_ptr_nonnull(at = strstr(text, find));
        snprintf(cfg2, sizeof cfg2, "%s.k2", t.cfg_path);
        ck_assert_ptr_nonnull(f = fopen(cfg2, "w"));
        fprintf(f, "%.*s\"k2=%s\" ]; active = \"k2\"%s", (int)(at - text), text, k2,
                at + strlen(find));
        fclose(f);
    }
    snprintf(log, sizeof log, "/tmp/%s.rescue.log", t.name);
    unlink(log);
    st = itest_wait(itest_spawn_log(cfg2, 6, NULL, log), itest_ms(60000));
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "idemq: 0x%x", st);
    ck_assert_int_ge(itest_count_lines(log, "is sealed with key \"k1\" and cannot be opened"), 1);
    ck_assert_int_eq(itest_long(&t, RESCUES_FOR, key), 0);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.retry_copies WHERE key = $1 "
                                    "AND body_key = 'k1'", key), 1);
    ck_assert_int_eq(itest_queue_ready(&t, t.name), 0);
    /* k1 listed again: rescued, applied once from the original body */
    run_idle(&t, 6);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
    ck_assert_int_eq(itest_long(&t, "SELECT attempts FROM idemq.jobs WHERE key = $1 AND state = "
                                    "'applied'", key), 2);
    ck_assert_int_eq(itest_long(&t, RESCUES_FOR, key), 1);
    unlink(cfg2);
    unlink(k1);
    unlink(k2);
    itest_teardown(&t);
    itest_retry_conf = NULL;
}
END_TEST

/* A login role granted by `idemq migrate --grant` (EXECUTE and SELECT only)
 * and a DSN for it (the test's DSN with its user). */
static void grant_role(struct itest *t, char *role, size_t rlen, char *dsn, size_t dlen)
{
    char sql[512], out[4096];
    char *u;
    snprintf(role, rlen, "%s_run", t->name);
    snprintf(sql, sizeof sql, "DROP ROLE IF EXISTS %s; CREATE ROLE %s LOGIN", role, role);
    itest_sql(t, sql);
    snprintf(sql, sizeof sql, "migrate --grant %s", role);
    ck_assert_msg(itest_idemq(t, sql, out, sizeof out) == 0, "%s", out);
    snprintf(dsn, dlen, "%s", getenv("IDEMQ_PG_DSN"));
    ck_assert_ptr_nonnull(u = strstr(dsn, "user="));
    snprintf(u, dlen - (size_t)(u - dsn), "user=%s", role);
}

static void drop_role(struct itest *t, const char *role)
{
    char sql[256];
    snprintf(sql, sizeof sql, "DROP OWNED BY %s; DROP ROLE %s", role, role);
    itest_sql(t, sql);
}

/* 2b. The same under the least-privilege role of `migrate --grant`:
 * the rescuer takes, publishes and records the copy through idemq's
 * functions (it may not write retry_copies or retry_rescues itself). */
START_TEST(test_rescue_lost_copy_grant_role)
{
    struct itest t;
    char key[128], role[96], dsn[512], owner_dsn[512], log[160];
    itest_retry_conf = "base_delay_ms = 3000; max_delay_ms = 3000; jitter = \"none\"; "
                       "rescue_after_s = 1;";
    itest_setup(&t, "rescuegr", "idemq_test.record", "", "");
    grant_role(&t, role, sizeof role, dsn, sizeof dsn);
    snprintf(owner_dsn, sizeof owner_dsn, "%s", getenv("IDEMQ_PG_DSN"));
    setenv("IDEMQ_PG_DSN", dsn, 1);
    fail_once_then_lose_copy(&t, key, sizeof key, NULL, NULL);
    snprintf(log, sizeof log, "/tmp/%s.log", t.name);
    {
        int st = itest_wait(itest_spawn_log(t.cfg_path, 6, NULL, log), itest_ms(60000));
        ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "status 0x%x", st);
    }
    setenv("IDEMQ_PG_DSN", owner_dsn, 1);
    ck_assert_msg(itest_count_lines(log, "permission denied") == 0, "42501 in %s", log);
    ck_assert_int_eq(itest_long(&t, RESCUES_FOR, key), 1);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
    ck_assert_int_eq(itest_long(&t, "SELECT attempts FROM idemq.jobs WHERE key = $1 AND state = "
                                    "'applied'",
                                key),
                     2);
    ck_assert_int_eq(itest_queue_ready(&t, t.name), 0);
    unlink(log);
    drop_role(&t, role);
    itest_teardown(&t);
    itest_retry_conf = NULL;
}
END_TEST

/* 3. One replica at a time: while another session holds the queue's rescue
 * lock nobody republishes; once it is released the copy is rescued once. */
START_TEST(test_rescue_one_at_a_time)
{
    struct itest t;
    char key[128], out[16];
    itest_retry_conf = "base_delay_ms = 3000; max_delay_ms = 3000; jitter = \"none\"; "
                       "rescue_after_s = 1;";
    itest_setup(&t, "rescuelk", "idemq_test.record", "", "");
    fail_once_then_lose_copy(&t, key, sizeof key, NULL, NULL);
    ck_assert_str_eq(itest_text(&t, RESCUE_LOCK, t.name, out, sizeof out), "");
    wait_run_after_past(&t, key, 1.5);
    run_idle(&t, 3);
    ck_assert_int_eq(itest_long(&t, RESCUES_FOR, key), 0);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 0);
    ck_assert_str_eq(itest_text(&t, RESCUE_UNLOCK, t.name, out, sizeof out), "true");
    run_idle(&t, 3);
    ck_assert_int_eq(itest_long(&t, RESCUES_FOR, key), 1);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
    itest_teardown(&t);
    itest_retry_conf = NULL;
}
END_TEST

/* 4. No rescue while the work queue holds a backlog (more than batch_max
 * ready messages): the copy may be waiting at its tail. 300 other jobs
 * drain at 20 per second through a prefetch of 10, so the queue holds more
 * than 100 ready messages for about 10 s; the due copy is rescued only
 * after that (its rescued copy then waits behind what is left, so with
 * rescue_after_s = 1 it may be rescued once more: harmless, the job is
 * applied once). */
START_TEST(test_rescue_waits_for_backlog)
{
    struct itest t;
    char key[128], cfg[300], filler[300][96];
    const char *bodies[300];
    FILE *f;
    itest_retry_conf = "base_delay_ms = 3000; max_delay_ms = 3000; jitter = \"none\"; "
                       "rescue_after_s = 1;";
    itest_setup(&t, "rescuebl", "idemq_test.record", "", "");
    fail_once_then_lose_copy(&t, key, sizeof key, NULL, NULL);
    wait_run_after_past(&t, key, 1.5);
    for (int i = 0; i < 300; i++) {
        snprintf(filler[i], sizeof filler[i], "{\"job_id\":\"%s:filler%03d\"}", t.name, i);
        bodies[i] = filler[i];
    }
    itest_publish(&t, bodies, 300);
    snprintf(cfg, sizeof cfg, "%s.slow", t.cfg_path);
    ck_assert_ptr_nonnull(f = fopen(cfg, "w"));
    fprintf(f,
            "broker: { heartbeat = 10; prefetch = 10; };\n"
            "retry: { %s };\n"
            "consumer: { id = \"%s\"; max_rate = 20; };\n"
            "inputs = ( { name = \"%s\"; exchange = \"%s\"; queue = \"%s\"; routing_key = \"%s\";\n"
            "  effect_function = \"idemq_test.record\"; } );\n",
            itest_retry_conf, t.name, t.name, t.name, t.name, t.name);
    fclose(f);
    {
        int st = itest_wait(itest_spawn(&t, cfg, 3, NULL), itest_ms(90000));
        ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "status 0x%x", st);
    }
    unlink(cfg);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
    ck_assert_int_ge(itest_long(&t, RESCUES_FOR, key), 1);
    /* rescued only after the backlog fell to one batch: at least 180 of the
     * 300 other jobs were applied before the first rescue */
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.retry_rescues r WHERE r.key = $1 "
                                    "AND r.rescued_at <= (SELECT e.created_at FROM "
                                    "idemq_test.effects e WHERE e.key LIKE (split_part($1, ':', "
                                    "1) || ':filler%') ORDER BY e.id OFFSET 179 LIMIT 1)",
                                key),
                     0);
    itest_teardown(&t);
    itest_retry_conf = NULL;
}
END_TEST

/* the rescuer publishes the ledger's copy to the default exchange;
 * a producer's CC/BCC header on it must not copy the job into the
 * unrelated queue it names (checked with basic.get). */
START_TEST(test_rescue_ignores_cc)
{
    struct itest t;
    char key[128], victim[300], err[512];
    struct broker *b;
    struct job j;
    idemq_err_t e;
    json_t *h;
    itest_retry_conf = "base_delay_ms = 3000; max_delay_ms = 3000; jitter = \"none\"; "
                       "rescue_after_s = 1;";
    itest_setup(&t, "rescuecc", "idemq_test.record", "", "");
    snprintf(victim, sizeof victim, "%s.victim", t.name);
    ck_assert_int_eq(broker_open(t.conf, "itest cc", false, &b, err, sizeof err), IDEMQ_OK);
    ck_assert_int_eq(broker_admin_declare_queue(b, victim, NULL, false), IDEMQ_OK);
    h = json_pack("{s:[s],s:[s]}", "CC", victim, "BCC", victim);
    fail_once_then_lose_copy(&t, key, sizeof key, h, NULL);
    json_decref(h);
    run_idle(&t, 6);
    ck_assert_int_eq(itest_long(&t, RESCUES_FOR, key), 1);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
    job_init(&j);
    e = broker_get(b, victim, &j, true);
    ck_assert_msg(e == IDEMQ_ERR_TIMEOUT, "%s holds a message (%s): %.*s", victim,
                  e == IDEMQ_OK ? "copied there" : broker_error(b), (int)j.body_len,
                  j.body ? (const char *)j.body : "");
    job_destroy(&j);
    ck_assert_int_eq(broker_admin_delete_queue(b, victim), IDEMQ_OK);
    broker_close(b);
    itest_teardown(&t);
    itest_retry_conf = NULL;
}
END_TEST

int main(void)
{
    Suite *s = suite_create("rescue");
    TCase *tc = tcase_create("rescue");
    tcase_set_timeout(tc, itest_ms(120));
    tcase_add_test(tc, test_quorum_buckets);
    tcase_add_test(tc, test_rescue_lost_copy);
    tcase_add_test(tc, test_rescue_sealed_copy);
    tcase_add_test(tc, test_rescue_lost_copy_grant_role);
    tcase_add_test(tc, test_rescue_one_at_a_time);
    tcase_add_test(tc, test_rescue_waits_for_backlog);
    suite_add_tcase(s, tc);
    /* what a producer's headers must not reach */
    tc = tcase_create("producers");
    tcase_set_timeout(tc, itest_ms(120));
    tcase_add_test(tc, test_rescue_ignores_cc);
    suite_add_tcase(s, tc);
    /* least-privilege mode (scripts/test): these again, as the deployment's roles */
    itest_lp_tcase(s, (const TTest *const[]){test_rescue_lost_copy, NULL});
    return check_run(s);
}
