/*
 * Integration tests of the spine: exactly-once effects through the ledger,
 * against the real RabbitMQ and PostgreSQL (see itest.h).
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

#define EFFECTS_FOR "SELECT count(*) FROM idemq_test.effects WHERE key = $1"
/* Every delivery of a key in its history: attempt rows and, for a plain
 * apply, the batch history (idemq.key_history reads both). */
#define ATTEMPTS_FOR(outcome)                                                                \
    "SELECT count(*) FROM idemq.key_history($1) WHERE outcome = '" outcome "'"

static void body(char *buf, size_t len, const char *key, const char *extra)
{
    snprintf(buf, len, "{\"job_id\":\"%s\",\"amount_minor\":100%s%s}", key, extra ? "," : "",
             extra ? extra : "");
}

/* 1. The same job delivered twice: one effect, one job row, a duplicate
 * attempt, nothing left on the queue. */
START_TEST(test_duplicate_delivery)
{
    struct itest t;
    char key[128], b[256];
    const char *bodies[2];
    itest_setup(&t, "dup", "idemq_test.record", "", "");
    snprintf(key, sizeof key, "%s:payout-1", t.name);
    body(b, sizeof b, key, NULL);
    bodies[0] = bodies[1] = b;
    itest_publish(&t, bodies, 2);
    itest_run_until_idle(&t, 2);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key = $1", key), 1);
    ck_assert_int_eq(itest_long(&t, ATTEMPTS_FOR("applied"), key), 1);
    ck_assert_int_eq(itest_long(&t, ATTEMPTS_FOR("duplicate"), key), 1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key = $1 "
                                    "AND state = 'applied' AND attempts = 1",
                                key),
                     1);
    ck_assert_int_eq(itest_queue_ready(&t, t.name), 0);
    itest_teardown(&t);
}
END_TEST

/* 2. A job redelivered after it settled (even with another payload) leaves
 * state, result and applied_at unchanged. */
START_TEST(test_replay_after_settled)
{
    struct itest t;
    char key[128], b1[256], b2[256], before[512], after[512];
    const char *bodies[1];
    /* job_info: the claim row with what a plain apply keeps in its batch row */
    const char *q = "SELECT state || '|' || result::text || '|' || applied_at::text || '|' || "
                    "payload_sha256 FROM idemq.job_info($1)";
    itest_setup(&t, "replay", "idemq_test.record", "", "");
    snprintf(key, sizeof key, "%s:payout-2", t.name);
    body(b1, sizeof b1, key, NULL);
    bodies[0] = b1;
    itest_publish(&t, bodies, 1);
    itest_run_until_idle(&t, 1);
    itest_text(&t, q, key, before, sizeof before);
    ck_assert_ptr_nonnull(strstr(before, "applied|"));
    body(b2, sizeof b2, key, "\"late\":true");
    bodies[0] = b2;
    itest_publish(&t, bodies, 1);
    itest_run_until_idle(&t, 1);
    itest_text(&t, q, key, after, sizeof after);
    ck_assert_str_eq(before, after);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
    ck_assert_int_eq(itest_long(&t, ATTEMPTS_FOR("duplicate"), key), 1);
    ck_assert_int_eq(itest_queue_ready(&t, t.name), 0);
    itest_teardown(&t);
}
END_TEST

/* 3. SIGKILL after commit, before ack: the broker redelivers and the ledger
 * turns the redelivery into a duplicate. Still exactly one effect. */
START_TEST(test_crash_after_commit)
{
    struct itest t;
    char key[128], b[256];
    const char *bodies[1];
    const char *env[] = {"IDEMQ_TEST_CRASH=after_commit", NULL};
    int st;
    itest_setup(&t, "crash", "idemq_test.record", "", "");
    snprintf(key, sizeof key, "%s:payout-3", t.name);
    body(b, sizeof b, key, NULL);
    bodies[0] = b;
    itest_publish(&t, bodies, 1);
    st = itest_wait(itest_spawn(&t, t.cfg_path, 5, env), itest_ms(30000));
    ck_assert_msg(st != -1 && WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL,
                  "expected the crash hook to SIGKILL idemq, status 0x%x", st);
    /* Committed, not acknowledged: the effect exists and the message is back. */
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
    ck_assert_int_eq(itest_long(&t, ATTEMPTS_FOR("applied"), key), 1);
    for (int i = 0; i < 50 && itest_queue_ready(&t, t.name) != 1; i++)
        usleep(100000);
    ck_assert_int_eq(itest_queue_ready(&t, t.name), 1);
    itest_run_until_idle(&t, 1);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
    ck_assert_int_eq(itest_long(&t, ATTEMPTS_FOR("duplicate"), key), 1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.key_history($1) "
                                    "WHERE outcome = 'duplicate' AND redelivered",
                                key),
                     1);
    ck_assert_int_eq(itest_queue_ready(&t, t.name), 0);
    itest_teardown(&t);
}
END_TEST

/* 4. Two consumer processes receive the same keys at the same time (each
 * from its own queue, the effect sleeping to widen the race): one effect per
 * key, the other process records a duplicate. */
START_TEST(test_two_consumers_same_key)
{
    struct itest t;
    char cfg2[300], q2[128], key[128], b[256];
    const int n = 12;
    pid_t p1, p2;
    int s1, s2;
    struct broker *br;
    char err[512];

    itest_setup(&t, "race", "idemq_test.record", "batch_max = 4;", "");
    snprintf(q2, sizeof q2, "%s_b", t.name);
    snprintf(cfg2, sizeof cfg2, "/tmp/%s.cfg", q2);
    itest_write_config(&t, cfg2, q2, "idemq_test.record", "batch_max = 4;", "");
    ck_assert(broker_open(t.conf, "itest", true, &br, err, sizeof err) == 0);
    {
        /* Second queue bound to the first test exchange too: every publish
         * reaches both queues. */
        struct conf_input in2 = t.conf->inputs[0];
        in2.queue = q2;
        ck_assert_msg(topology_declare(br, t.conf, &in2) == 0, "%s", broker_error(br));
    }
    for (int i = 0; i < n; i++) {
        snprintf(key, sizeof key, "%s:k%d", t.name, i);
        body(b, sizeof b, key, "\"sleep_ms\":150");
        ck_assert(broker_publish(br, t.name, t.name, b, strlen(b), NULL) == 0);
    }
    ck_assert(broker_wait_confirms(br, itest_ms(10000)) == 0);
    p1 = itest_spawn(&t, t.cfg_path, 2, NULL);
    p2 = itest_spawn(&t, cfg2, 2, NULL);
    s1 = itest_wait(p1, itest_ms(60000));
    s2 = itest_wait(p2, itest_ms(60000));
    ck_assert_msg(WIFEXITED(s1) && WEXITSTATUS(s1) == 0, "first idemq: 0x%x", s1);
    ck_assert_msg(WIFEXITED(s2) && WEXITSTATUS(s2) == 0, "second idemq: 0x%x", s2);
    for (int i = 0; i < n; i++) {
        snprintf(key, sizeof key, "%s:k%d", t.name, i);
        ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
        ck_assert_int_eq(itest_long(&t, ATTEMPTS_FOR("applied"), key), 1);
        ck_assert_int_eq(itest_long(&t, ATTEMPTS_FOR("duplicate"), key), 1);
    }
    /* The race was real: some duplicate claim started while the applying
     * transaction of the same key was still open (it waited on the key). */
    {
        long overlapped = 0;
        for (int i = 0; i < n; i++) {
            snprintf(key, sizeof key, "%s:k%d", t.name, i);
            overlapped += itest_long(&t, "SELECT count(*) FROM idemq.key_history($1) d, "
                                         "idemq.key_history($1) a WHERE a.outcome = 'applied' "
                                         "AND d.outcome = 'duplicate' AND a.queue <> d.queue "
                                         "AND d.started_at < a.finished_at",
                                     key);
        }
        ck_assert_int_ge(overlapped, 1);
    }
    ck_assert_int_eq(itest_queue_ready(&t, t.name), 0);
    ck_assert_int_eq(itest_queue_ready(&t, q2), 0);
    broker_close(br);
    {
        struct conf_input in2 = t.conf->inputs[0];
        in2.queue = q2;
        in2.exchange = "";
        itest_delete_topology(&t, &in2);
    }
    unlink(cfg2);
    itest_teardown(&t);
}
END_TEST

/* 5. Malformed messages interleaved with good ones: every good one applied
 * by the same process, every bad one parked with its reason, none lost. */
START_TEST(test_malformed_interleaved)
{
    struct itest t;
    char goods[10][256], key[128], big[2048];
    const char *bodies[20];
    int nb = 0;
    const char *bad[] = {"not json at all", "[1,2,3]", "{\"no_key\":true}", "{\"job_id\":\"\"}",
                         "{\"job_id\":{\"nested\":1}}", "{\"job_id\":\"x\"", NULL, NULL};
    itest_setup(&t, "poison", "idemq_test.record", "batch_max = 3;", "max_body_bytes = 1024;");
    memset(big, ' ', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    memcpy(big, "{\"job_id\":\"big\"}", 16);
    bad[6] = big;
    for (int i = 0; i < 7; i++) {
        snprintf(key, sizeof key, "%s:good-%d", t.name, i);
        body(goods[i], sizeof goods[i], key, NULL);
        bodies[nb++] = goods[i];
        bodies[nb++] = bad[i];
    }
    itest_publish(&t, bodies, nb);
    itest_run_until_idle(&t, 2);
    for (int i = 0; i < 7; i++) {
        snprintf(key, sizeof key, "%s:good-%d", t.name, i);
        ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
    }
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE source_queue = $1",
                                t.name),
                     7);
    ck_assert_int_eq(
        itest_long(&t,
                   "SELECT count(DISTINCT error_code) FROM idemq.parked WHERE source_queue = $1 "
                   "AND error_class = 'permanent' AND error_code IN ('bad_json', 'not_object', "
                   "'key_missing', 'key_empty', 'key_invalid', 'body_too_large') "
                   "AND payload_sha256 = encode(sha256(body), 'hex') AND reason <> ''",
                   t.name),
        6);
    /* The raw bytes are kept exactly. */
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE source_queue = $1 "
                                    "AND body = convert_to('not json at all', 'UTF8')",
                                t.name),
                     1);
    ck_assert_int_eq(itest_queue_ready(&t, t.name), 0);
    itest_teardown(&t);
}
END_TEST

/* SIGTERM drains: the process finishes and acknowledges what it took and
 * exits 0 long before its idle limit; nothing is left unapplied. */
START_TEST(test_sigterm_drains)
{
    struct itest t;
    char key[128], b[20][200];
    const char *bodies[20];
    pid_t pid;
    int st;
    itest_setup(&t, "term", "idemq_test.record", "batch_max = 5;", "");
    for (int i = 0; i < 20; i++) {
        snprintf(b[i], sizeof b[i], "{\"job_id\":\"%s:t%d\",\"sleep_ms\":20}", t.name, i);
        bodies[i] = b[i];
    }
    pid = itest_spawn(&t, t.cfg_path, 60, NULL);
    itest_publish(&t, bodies, 20);
    for (int i = 0; i < 100 && itest_long(&t, "SELECT count(*) FROM idemq_test.effects WHERE "
                                              "key LIKE $1 || ':%'",
                                          t.name) < 5;
         i++)
        usleep(50000);
    kill(pid, SIGTERM);
    st = itest_wait(pid, itest_ms(10000));
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "status 0x%x", st);
    /* whatever it did not take is still on the queue; the rest is applied */
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq_test.effects WHERE key LIKE $1 "
                                    "|| ':%'",
                                t.name) +
                         itest_queue_ready(&t, t.name),
                     20);
    itest_run_until_idle(&t, 1);
    for (int i = 0; i < 20; i++) {
        snprintf(key, sizeof key, "%s:t%d", t.name, i);
        ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
    }
    itest_teardown(&t);
}
END_TEST

/* migrate twice is a no-op; check-config rejects a bad file with exit 3. */
START_TEST(test_cli_migrate_and_check)
{
    struct itest t;
    char cmd[1024];
    FILE *p;
    char out[512] = "";
    int rc;
    itest_setup(&t, "cli", "idemq_test.record", "", "");
    snprintf(cmd, sizeof cmd, "%s migrate -c %s 2>&1", IDEMQ_BINARY, t.cfg_path);
    p = popen(cmd, "r");
    ck_assert_ptr_nonnull(p);
    ck_assert_ptr_nonnull(fgets(out, sizeof out, p));
    ck_assert_int_eq(pclose(p), 0);
    ck_assert_msg(strstr(out, "(0 migrations applied)") != NULL, "%s", out);
    snprintf(cmd, sizeof cmd, "%s check-config -c %s/tests/unit/conf/bad_range.cfg 2>/dev/null",
             IDEMQ_BINARY, IDEMQ_SOURCE_DIR);
    rc = system(cmd);
    ck_assert_int_eq(WEXITSTATUS(rc), 3);
    itest_teardown(&t);
}
END_TEST

/* check-config --online: what needs the servers. The test's own input
 * passes (ledger, effect, EXECUTE, queues); a missing effect function is
 * exit 3, a queue nobody declared exit 6, each named; offline the output
 * says what it did not check. */
START_TEST(test_check_config_online)
{
    struct itest t;
    char out[16384], cfg[512];
    int rc;
    itest_setup(&t, "online", "idemq_test.record", "", "");
    rc = itest_idemq(&t, "check-config --online", out, sizeof out);
    ck_assert_msg(rc == 0, "rc %d: %s", rc, out);
    ck_assert_msg(strstr(out, "online: database: reachable") &&
                      strstr(out, "effect idemq_test.record(text,jsonb,jsonb) exists") &&
                      strstr(out, "exist with the configured arguments"),
                  "%s", out);
    rc = itest_idemq(&t, "check-config", out, sizeof out);
    ck_assert_msg(rc == 0 && strstr(out, "# not checked without the servers"), "%s", out);
    snprintf(cfg, sizeof cfg, "%s.nofn", t.cfg_path);
    itest_write_config(&t, cfg, t.name, "idemq_test.no_such_effect", "", "");
    {
        char cmd[1200];
        FILE *p;
        size_t n;
        snprintf(cmd, sizeof cmd, "%s check-config --online -c %s 2>&1", IDEMQ_BINARY, cfg);
        p = popen(cmd, "r");
        ck_assert_ptr_nonnull(p);
        n = fread(out, 1, sizeof out - 1, p);
        out[n] = '\0';
        rc = pclose(p);
        ck_assert_msg(WEXITSTATUS(rc) == 3 && strstr(out, "no_such_effect(text,jsonb,jsonb) "
                                                          "does not exist"), "%s", out);
        itest_write_config(&t, cfg, "idemq_test.online_undeclared", "idemq_test.record", "", "");
        p = popen(cmd, "r");
        ck_assert_ptr_nonnull(p);
        n = fread(out, 1, sizeof out - 1, p);
        out[n] = '\0';
        rc = pclose(p);
        ck_assert_msg(WEXITSTATUS(rc) == 6 && strstr(out, "idemq declare"), "%s", out);
    }
    unlink(cfg);
    itest_teardown(&t);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("spine");
    TCase *tc = tcase_create("spine");
    tcase_set_timeout(tc, itest_ms(120));
    tcase_add_test(tc, test_duplicate_delivery);
    tcase_add_test(tc, test_replay_after_settled);
    tcase_add_test(tc, test_crash_after_commit);
    tcase_add_test(tc, test_two_consumers_same_key);
    tcase_add_test(tc, test_malformed_interleaved);
    tcase_add_test(tc, test_cli_migrate_and_check);
    tcase_add_test(tc, test_check_config_online);
    tcase_add_test(tc, test_sigterm_drains);
    suite_add_tcase(s, tc);
    /* least-privilege mode (scripts/test): these again, as the deployment's roles */
    itest_lp_tcase(s, (const TTest *const[]){test_duplicate_delivery, test_replay_after_settled,
                                              NULL});
    return check_run(s);
}
