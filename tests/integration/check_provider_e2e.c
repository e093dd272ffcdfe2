/* Issue 9's end-to-end tests 1-10: provider inputs through `idemq run` with
 * a real RabbitMQ, PostgreSQL and idemq-test-provider (the worker loop
 * drives consumer/provider_flow). */
#include <check.h>

#include "check_run.h"
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "itest.h"
#include "tprov.h"
#include "topology.h"

static struct itest T;
static struct tprov P;

/* A provider input at the test provider; extra = more provider lines. */
static const char *retry_conf = "base_delay_ms = 200; max_delay_ms = 10000; jitter = \"none\";";

static void setup_provider(const char *tag, const char *const *args, const char *extra)
{
    char input[2048];
    tprov_start(&P, args);
    snprintf(input, sizeof input,
             "provider: { url = \"%s\"; path = \"/charges\"; timeout_ms = %d; "
             "retry_after_max_ms = 5000; reconcile_after_s = 10; %s };",
             P.url, itest_ms(3000), extra ? extra : "");
    itest_retry_conf = retry_conf;
    itest_setup(&T, tag, "idemq_test.record", "", input);
}

static void teardown(void)
{
    itest_teardown(&T);
    tprov_stop(&P);
    itest_retry_conf = NULL;
}

static void publish_payout(const char *key, const char *extra)
{
    char body[512];
    snprintf(body, sizeof body, "{\"job_id\":\"%s\",\"amount_minor\":500%s%s}", key,
             extra ? "," : "", extra ? extra : "");
    {
        const char *bodies[1] = {body};
        itest_publish(&T, bodies, 1);
    }
}

#define STATE "SELECT state FROM idemq.jobs WHERE key = $1"
#define REF "SELECT provider_ref FROM idemq.intents WHERE key = $1"
#define EFFECTS "SELECT count(*) FROM idemq_test.effects WHERE key = $1"

/* 1. The provider applies the charge but the answer is lost: retried with
 * the same key; one charge; the ledger holds its reference. */
START_TEST(test1_lost_answer)
{
    char key[128], b[256];
    setup_provider("pe1", NULL, NULL);
    snprintf(key, sizeof key, "%s-k1", T.name);
    tprov_control(&P, "{\"fault\":\"drop\",\"count\":1}");
    publish_payout(key, NULL);
    itest_run_until_idle(&T, 4);
    ck_assert_int_eq(tprov_stat(&P, key, "key_charges"), 1);
    ck_assert_str_eq(itest_text(&T, STATE, key, b, sizeof b), "applied");
    ck_assert_str_eq(itest_text(&T, REF, key, b, sizeof b), "ch_000001");
    ck_assert_int_eq(itest_long(&T, EFFECTS, key), 1);
    teardown();
}
END_TEST

/* 2. idemq SIGKILLed between the provider call and the ack (test hook):
 * after a restart, reconciliation converges on exactly one reference. */
START_TEST(test2_killed_between_call_and_ack)
{
    const char *env[] = {"IDEMQ_TEST_CRASH=provider_after_call", NULL};
    char key[128], b[256];
    pid_t pid;
    int st;
    setup_provider("pe2", NULL, "lookup_key_path = \"/charges/by-idempotency-key/{key}\";");
    snprintf(key, sizeof key, "%s-k2", T.name);
    publish_payout(key, NULL);
    pid = itest_spawn(&T, T.cfg_path, 30, env);
    st = itest_wait(pid, itest_ms(30000));
    ck_assert_msg(st != -1 && WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL,
                  "idemq was not killed by the hook (status 0x%x)", st);
    ck_assert_int_eq(tprov_stat(&P, key, "key_charges"), 1);
    ck_assert_str_eq(itest_text(&T, STATE, key, b, sizeof b), "provider_pending");
    itest_run_until_idle(&T, 12); /* waits out the lease, then looks it up */
    ck_assert_str_eq(itest_text(&T, STATE, key, b, sizeof b), "applied");
    ck_assert_int_eq(tprov_stat(&P, key, "key_charges"), 1);
    ck_assert_str_eq(itest_text(&T, REF, key, b, sizeof b), "ch_000001");
    teardown();
}
END_TEST

/* 3. 5xx for a while, then the provider recovers: applied once. */
START_TEST(test3_5xx_then_recovers)
{
    char key[128], b[256];
    setup_provider("pe3", NULL, NULL);
    snprintf(key, sizeof key, "%s-k3", T.name);
    tprov_control(&P, "{\"fault\":\"status=503\",\"count\":3}");
    publish_payout(key, NULL);
    itest_run_until_idle(&T, 5);
    ck_assert_str_eq(itest_text(&T, STATE, key, b, sizeof b), "applied");
    ck_assert_int_eq(tprov_stat(&P, key, "key_charges"), 1);
    ck_assert_int_eq(itest_long(&T, EFFECTS, key), 1);
    ck_assert_int_eq(itest_long(&T, "SELECT count(*) FROM idemq.attempts WHERE key = $1 AND "
                                    "outcome = 'provider_unknown'", key), 3);
    teardown();
}
END_TEST

/* 4. A 4xx parks after one attempt with the answer kept (ledger and DLQ). */
START_TEST(test4_4xx_parked)
{
    char key[128], b[256], dlq[TOPOLOGY_NAME_MAX];
    setup_provider("pe4", NULL, NULL);
    snprintf(key, sizeof key, "%s-k4", T.name);
    tprov_control(&P, "{\"fault\":\"status=400\",\"count\":1}");
    publish_payout(key, NULL);
    itest_run_until_idle(&T, 3);
    ck_assert_str_eq(itest_text(&T, STATE, key, b, sizeof b), "parked");
    ck_assert_int_eq(tprov_stat(&P, NULL, "requests"), 1);
    ck_assert_str_eq(itest_text(&T, "SELECT error_code FROM idemq.parked WHERE key = $1", key, b,
                                sizeof b), "provider_rejected");
    ck_assert_str_eq(itest_text(&T, "SELECT last_response->>'status' FROM idemq.intents "
                                    "WHERE key = $1", key, b, sizeof b), "400");
    topology_dlq(&T.conf->inputs[0], dlq, sizeof dlq);
    ck_assert_int_eq(itest_queue_ready(&T, dlq), 1);
    teardown();
}
END_TEST

/* 5. 429 with Retry-After: the next attempt is not earlier than asked. */
START_TEST(test5_retry_after)
{
    char key[128];
    setup_provider("pe5", NULL, NULL);
    snprintf(key, sizeof key, "%s-k5", T.name);
    tprov_control(&P, "{\"fault\":\"rate=2\",\"count\":1}");
    publish_payout(key, NULL);
    itest_run_until_idle(&T, 5);
    ck_assert_int_eq(tprov_stat(&P, key, "key_charges"), 1);
    ck_assert_int_ge(itest_long(&T,
                                "SELECT (extract(epoch FROM max(started_at) - min(started_at)) "
                                "* 1000)::bigint FROM idemq.attempts WHERE key = $1 AND outcome "
                                "= 'provider_request'", key),
                     2000);
    teardown();
}
END_TEST

/* 6. A stale pending intent with no message left in the queue: the sweep
 * inside `idemq run` reconciles it. */
START_TEST(test6_sweep_in_run)
{
    const char *env[] = {"IDEMQ_TEST_CRASH=provider_after_call", NULL};
    char key[128], b[256];
    pid_t pid;
    setup_provider("pe6", NULL, "lookup_key_path = \"/charges/by-idempotency-key/{key}\";");
    snprintf(key, sizeof key, "%s-k6", T.name);
    publish_payout(key, NULL);
    pid = itest_spawn(&T, T.cfg_path, 30, env);
    itest_wait(pid, itest_ms(30000));
    {
        struct broker *br;
        char err[256];
        ck_assert(broker_open(T.conf, "pe6 purge", false, &br, err, sizeof err) == IDEMQ_OK);
        ck_assert(broker_admin_purge(br, T.conf->inputs[0].queue) ==
                  IDEMQ_OK); /* the message is gone */
        broker_close(br);
    }
    itest_sql(&T, "UPDATE idemq.intents SET lease_until = now() - interval '1 s', "
                  "last_request_at = now() - interval '1 hour', updated_at = now() - interval "
                  "'1 hour' WHERE key LIKE 'it_pe6%'");
    itest_run_until_idle(&T, 8);
    ck_assert_str_eq(itest_text(&T, STATE, key, b, sizeof b), "applied");
    ck_assert_int_eq(tprov_stat(&P, key, "key_charges"), 1);
    teardown();
}
END_TEST

/* 7. 409 while in flight -> retried later with the same key, one charge;
 * 422 (same key, another body) -> parked, never resent. */
START_TEST(test7_409_and_422)
{
    char key[128], key2[128], b[256], out[256];
    pid_t other;
    int st;
    setup_provider("pe7", NULL, NULL);
    snprintf(key, sizeof key, "%s-k7", T.name);
    snprintf(key2, sizeof key2, "%s-k7b", T.name);
    fflush(NULL);
    other = fork();
    if (other == 0) {
        char h1[300], body[300];
        const char *hs[] = {h1, "X-Test-Fault: latency=2000", NULL};
        snprintf(h1, sizeof h1, "Idempotency-Key: %s", key);
        snprintf(body, sizeof body, "{\"job_id\":\"%s\",\"amount_minor\":500}", key);
        _exit(tprov_http(&P, "POST", "/charges", body, hs, out, sizeof out) == 201 ? 0 : 1);
    }
    {
        char h1[300];
        const char *hs[] = {h1, NULL};
        snprintf(h1, sizeof h1, "Idempotency-Key: %s", key2);
        ck_assert_int_eq(tprov_http(&P, "POST", "/charges", "{\"other\":1}", hs, out, sizeof out),
                         201);
    }
    publish_payout(key, NULL);
    publish_payout(key2, NULL);
    itest_run_until_idle(&T, 5);
    waitpid(other, &st, 0);
    ck_assert_str_eq(itest_text(&T, STATE, key, b, sizeof b), "applied");
    ck_assert_int_eq(tprov_stat(&P, key, "key_charges"), 1);
    ck_assert_int_ge(itest_long(&T, "SELECT count(*) FROM idemq.attempts WHERE key = $1 AND "
                                    "error_code = 'conflict'", key), 1);
    ck_assert_str_eq(itest_text(&T, STATE, key2, b, sizeof b), "parked");
    ck_assert_int_eq(itest_long(&T, "SELECT count(*) FROM idemq.attempts WHERE key = $1 AND "
                                    "outcome = 'provider_request'", key2), 1);
    teardown();
}
END_TEST

/* 8. An intent older than the provider's key window is not resent blindly. */
START_TEST(test8_key_window)
{
    char key[128], b[256];
    retry_conf = "base_delay_ms = 4000; max_delay_ms = 10000; jitter = \"none\";";
    setup_provider("pe8", NULL, NULL); /* a retry 4 s later: time to age the key */
    snprintf(key, sizeof key, "%s-k8", T.name);
    tprov_control(&P, "{\"fault\":\"drop\",\"count\":1}");
    publish_payout(key, "\"sleep_ms\":0");
    /* the first delivery records an unknown outcome and is delayed; the key
     * ages past the window before the retry comes back */
    {
        pid_t pid = itest_spawn(&T, T.cfg_path, 8, NULL);
        for (int i = 0; i < 200; i++) {
            if (itest_long(&T, "SELECT count(*) FROM idemq.intents WHERE key = $1 AND state = "
                               "'unknown'", key) == 1)
                break;
            usleep(50000);
        }
        itest_sql(&T, "UPDATE idemq.intents SET first_request_at = first_request_at - interval "
                      "'2 days' WHERE key LIKE 'it_pe8%'");
        ck_assert_int_ne(itest_wait(pid, itest_ms(60000)), -1);
    }
    ck_assert_str_eq(itest_text(&T, STATE, key, b, sizeof b), "parked");
    ck_assert_str_eq(itest_text(&T, "SELECT error_code FROM idemq.parked WHERE key = $1", key, b,
                                sizeof b), "key_window_expired");
    ck_assert_int_eq(tprov_stat(&P, NULL, "requests"), 1);
    teardown();
    retry_conf = "base_delay_ms = 200; max_delay_ms = 10000; jitter = \"none\";";
}
END_TEST

/* 9. A non-idempotent provider drops the connection after charging: never
 * charged twice; parked unknown_outcome and settled by idemq resolve. */
START_TEST(test9_non_idempotent_resolve)
{
    const char *args[] = {"--non-idempotent", NULL};
    char key[128], b[256], cmd[512], out[8192];
    setup_provider("pe9", args, "idempotent = false;");
    snprintf(key, sizeof key, "%s-k9", T.name);
    tprov_control(&P, "{\"fault\":\"drop\",\"count\":1}");
    publish_payout(key, NULL);
    itest_run_until_idle(&T, 3);
    ck_assert_str_eq(itest_text(&T, "SELECT error_class FROM idemq.parked WHERE key = $1", key, b,
                                sizeof b), "unknown_outcome");
    ck_assert_int_eq(tprov_stat(&P, key, "key_charges"), 1);
    snprintf(cmd, sizeof cmd, "resolve '%s' --applied ch_000001 --reason 'seen in dashboard'",
             key);
    ck_assert_int_eq(itest_idemq(&T, cmd, out, sizeof out), 0);
    ck_assert_str_eq(itest_text(&T, STATE, key, b, sizeof b), "applied");
    snprintf(cmd, sizeof cmd, "jobs show '%s'", key);
    ck_assert_int_eq(itest_idemq(&T, cmd, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "seen in dashboard"), "%s", out);
    ck_assert_int_eq(tprov_stat(&P, key, "key_charges"), 1);
    teardown();
}
END_TEST

/* 11. Test 6 under the role of `idemq migrate --grant` (D7): the reconciler
 * of `run` settles the stale intent through idemq's functions, and `run`
 * logs no 42501. */
START_TEST(test11_sweep_in_run_grant_role)
{
    const char *env[] = {"IDEMQ_TEST_CRASH=provider_after_call", NULL};
    char key[128], b[256], role[96], sql[256], out[4096], owner[512], dsn[700], log[160];
    char *u;
    int st;
    setup_provider("pe11", NULL, "lookup_key_path = \"/charges/by-idempotency-key/{key}\";");
    snprintf(role, sizeof role, "%s_run", T.name);
    snprintf(sql, sizeof sql, "DROP ROLE IF EXISTS %s; CREATE ROLE %s LOGIN", role, role);
    itest_sql(&T, sql);
    snprintf(sql, sizeof sql, "migrate --grant %s", role);
    ck_assert_msg(itest_idemq(&T, sql, out, sizeof out) == 0, "%s", out);
    snprintf(owner, sizeof owner, "%s", getenv("IDEMQ_PG_DSN"));
    snprintf(dsn, sizeof dsn, "%s", owner);
    ck_assert_ptr_nonnull(u = strstr(dsn, "user="));
    snprintf(u, sizeof dsn - (size_t)(u - dsn), "user=%s", role);
    setenv("IDEMQ_PG_DSN", dsn, 1);
    snprintf(key, sizeof key, "%s-k11", T.name);
    publish_payout(key, NULL);
    itest_wait(itest_spawn(&T, T.cfg_path, 30, env), itest_ms(30000));
    {
        struct broker *br;
        char err[256];
        ck_assert(broker_open(T.conf, "pe11 purge", false, &br, err, sizeof err) == IDEMQ_OK);
        ck_assert(broker_admin_purge(br, T.conf->inputs[0].queue) == IDEMQ_OK);
        broker_close(br);
    }
    itest_sql(&T, "UPDATE idemq.intents SET lease_until = now() - interval '1 s', "
                  "last_request_at = now() - interval '1 hour', updated_at = now() - interval "
                  "'1 hour' WHERE key LIKE 'it_pe11%'");
    snprintf(log, sizeof log, "/tmp/%s.log", T.name);
    st = itest_wait(itest_spawn_log(T.cfg_path, 8, NULL, log), itest_ms(60000));
    setenv("IDEMQ_PG_DSN", owner, 1);
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "status 0x%x", st);
    ck_assert_msg(itest_count_lines(log, "permission denied") == 0, "42501 in %s", log);
    ck_assert_str_eq(itest_text(&T, STATE, key, b, sizeof b), "applied");
    ck_assert_int_eq(tprov_stat(&P, key, "key_charges"), 1);
    unlink(log);
    snprintf(sql, sizeof sql, "DROP OWNED BY %s; DROP ROLE %s", role, role);
    itest_sql(&T, sql);
    teardown();
}
END_TEST

/* 10. The demo: a payout through the test provider with a lost answer and
 * a crash (SIGKILL while the provider holds its answer), one charge each. */
START_TEST(test10_demo)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "cd %s && DEMO_INPUT=provider IDEMQ_STATE_DIR=%s IDEMQ_AMQP_PORT=%s "
             "IDEMQ_PG_PORT=%s DEMO_KEEP=1 scripts/demo > /tmp/idemq-provider-demo.out 2>&1",
             IDEMQ_SOURCE_DIR, getenv("IDEMQ_STATE_DIR") ? getenv("IDEMQ_STATE_DIR") : "",
             getenv("IDEMQ_AMQP_PORT") ? getenv("IDEMQ_AMQP_PORT") : "",
             getenv("IDEMQ_PG_PORT") ? getenv("IDEMQ_PG_PORT") : "");
    ck_assert_msg(getenv("IDEMQ_STATE_DIR"), "needs the IDEMQ_* of the running services");
    ck_assert_msg(system(cmd) == 0, "scripts/demo failed: see /tmp/idemq-provider-demo.out");
    ck_assert_int_eq(system("grep -q 'exactly one charge per payout: yes' "
                            "/tmp/idemq-provider-demo.out"), 0);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("provider_e2e");
    TCase *tc = tcase_create("e2e");
    tcase_set_timeout(tc, itest_ms(240));
    tcase_add_test(tc, test1_lost_answer);
    tcase_add_test(tc, test2_killed_between_call_and_ack);
    tcase_add_test(tc, test3_5xx_then_recovers);
    tcase_add_test(tc, test4_4xx_parked);
    tcase_add_test(tc, test5_retry_after);
    tcase_add_test(tc, test6_sweep_in_run);
    tcase_add_test(tc, test7_409_and_422);
    tcase_add_test(tc, test8_key_window);
    tcase_add_test(tc, test9_non_idempotent_resolve);
    tcase_add_test(tc, test11_sweep_in_run_grant_role);
    tcase_add_test(tc, test10_demo);
    suite_add_tcase(s, tc);
    return check_run(s);
}
