/* The provider's end-to-end tests 1-10: provider inputs through `idemq run` with
 * a real RabbitMQ, PostgreSQL and idemq-test-provider (the worker loop
 * drives consumer/provider_flow). */
#include <check.h>
#include <curl/curl.h>
#include <jansson.h>

#include "check_run.h"
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "itest.h"
#include "ledger_db.h"
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

/* Empties the input's queue: the message of a key is gone, only its
 * intent is left (why names the broker connection). */
static void purge_input(const char *why)
{
    struct broker *br;
    char err[256];
    ck_assert(broker_open(T.conf, why, false, &br, err, sizeof err) == IDEMQ_OK);
    ck_assert(broker_admin_purge(br, T.conf->inputs[0].queue) == IDEMQ_OK);
    broker_close(br);
}

/* Ages the intents of keys 'it_<tag>...' past their lease and the
 * reconciler's wait, so that the next sweep takes them (due_now: and
 * clears a retry's run_after). */
static void age_intents(const char *tag, bool due_now)
{
    char sql[400];
    snprintf(sql, sizeof sql,
             "UPDATE idemq.intents SET lease_until = now() - interval '1 s', "
             "last_request_at = now() - interval '1 hour', updated_at = now() - interval "
             "'1 hour'%s WHERE key LIKE 'it_%s%%'",
             due_now ? ", run_after = NULL" : "", tag);
    itest_sql(&T, sql);
}

/* The stored request went out a second time and the key applied once. */
static void applied_on_resend(const char *key)
{
    char b[256];
    ck_assert_str_eq(itest_text(&T, STATE, key, b, sizeof b), "applied");
    ck_assert_int_eq(tprov_stat(&P, key, "key_charges"), 1);
    ck_assert_int_eq(tprov_stat(&P, NULL, "requests"), 2);
    ck_assert_int_eq(itest_long(&T, EFFECTS, key), 1);
}

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
    purge_input("pe6 purge"); /* the message is gone */
    age_intents("pe6", false);
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

/* 11. Test 6 under the role of `idemq migrate --grant`: the reconciler
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
    purge_input("pe11 purge");
    age_intents("pe11", false);
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

/* Collects a management API answer. */
static size_t mgmt_body(char *d, size_t size, size_t n, void *arg)
{
    char *buf = arg;
    size_t have = strlen(buf), take = size * n;
    if (have + take >= 65536)
        take = 65535 - have;
    memcpy(buf + have, d, take);
    buf[have + take] = '\0';
    return size * n;
}

/* One request to the broker's management API (guest); returns the status. */
static long mgmt(const char *method, const char *path, char *out)
{
    CURL *e = curl_easy_init();
    char url[1024];
    long status = 0;
    const char *base = getenv("IDEMQ_RABBIT_MGMT_URL");
    ck_assert_msg(base && e, "needs IDEMQ_RABBIT_MGMT_URL (scripts/services env)");
    snprintf(url, sizeof url, "%s%s", base, path);
    out[0] = '\0';
    curl_easy_setopt(e, CURLOPT_URL, url);
    curl_easy_setopt(e, CURLOPT_CUSTOMREQUEST, method);
    curl_easy_setopt(e, CURLOPT_USERPWD, "guest:guest");
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, mgmt_body);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, out);
    curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, 10000L);
    ck_assert_int_eq(curl_easy_perform(e), CURLE_OK);
    curl_easy_getinfo(e, CURLINFO_RESPONSE_CODE, &status);
    curl_easy_cleanup(e);
    return status;
}

/* The names of the AMQP connections whose client-given name contains
 * needle, as the broker's management API lists them (it lists a new
 * connection within its statistics interval, some seconds), into a JSON
 * array (caller frees). */
static json_t *connections(const char *needle)
{
    static char out[65536];
    json_t *list, *names = json_array(), *c;
    size_t i;
    ck_assert_int_eq(mgmt("GET", "/api/connections?columns=name,client_properties", out), 200);
    list = json_loads(out, 0, NULL);
    ck_assert_ptr_nonnull(list);
    json_array_foreach(list, i, c) {
        const char *cn = json_string_value(
            json_object_get(json_object_get(c, "client_properties"), "connection_name"));
        const char *name = json_string_value(json_object_get(c, "name"));
        if (cn && name && strstr(cn, needle))
            json_array_append_new(names, json_string(name));
    }
    json_decref(list);
    return names;
}

/* Waits up to ms until the broker lists a connection named with needle. */
static void wait_connection(const char *needle, int ms)
{
    for (int waited = 0;; waited += 100) {
        json_t *names = connections(needle);
        size_t n = json_array_size(names);
        json_decref(names);
        if (n > 0)
            return;
        ck_assert_msg(waited < ms, "no connection of %s listed by the broker", needle);
        usleep(100000);
    }
}

/* Closes (from the broker's side, as an operator or a node would) every
 * AMQP connection whose client-given name contains needle; returns how
 * many. The worker sees its channel gone and reconnects. */
static int close_connections(const char *needle)
{
    static char out[65536];
    json_t *names = connections(needle), *v;
    size_t i;
    int n = 0;
    json_array_foreach(names, i, v) {
        char path[600], *esc = curl_easy_escape(NULL, json_string_value(v), 0);
        snprintf(path, sizeof path, "/api/connections/%s", esc);
        curl_free(esc);
        ck_assert_int_eq(mgmt("DELETE", path, out) / 100, 2);
        n++;
    }
    json_decref(names);
    return n;
}

/* Waits up to ms for the provider to have counted at least want requests. */
static long wait_requests(long want, int ms)
{
    long n = tprov_stat(&P, NULL, "requests");
    for (int i = 0; i < ms / 20 && n < want; i++) {
        usleep(20000);
        n = tprov_stat(&P, NULL, "requests");
    }
    return n;
}

#define LEASE_EXPIRED_LIKE \
    "SELECT count(*) FROM idemq.attempts WHERE key LIKE $1 || '%' AND error_code = " \
    "'lease_expired'"
#define APPLIED_LIKE "SELECT count(*) FROM idemq.jobs WHERE key LIKE $1 || '%' AND state = 'applied'"
#define EFFECTS_LIKE "SELECT count(*) FROM idemq_test.effects WHERE key LIKE $1 || '%'"

/* 11. A broker reconnect while calls are in flight: the calls go on,
 * their answers are recorded, the redeliveries settle with them. Each
 * charge once, one request each, no unknown outcome, no lease expired. */
START_TEST(test11_broker_reconnect_keeps_calls)
{
    enum { N = 4 };
    char key[128], b[256], log[300], ctl[128];
    pid_t pid;
    int st;
    setup_provider("pe11", NULL, "max_in_flight = 8;");
    snprintf(log, sizeof log, "/tmp/%s.log", T.name);
    snprintf(ctl, sizeof ctl, "{\"fault\":\"latency=%d\",\"count\":%d}", itest_ms(1500), N);
    pid = itest_spawn_log(T.cfg_path, 10, NULL, log);
    wait_connection(T.name, itest_ms(20000)); /* so it can be closed at once below */
    tprov_control(&P, ctl);
    for (int i = 0; i < N; i++) {
        snprintf(key, sizeof key, "%s-k11-%d", T.name, i);
        publish_payout(key, NULL);
    }
    ck_assert_int_eq(wait_requests(N, itest_ms(10000)), N); /* all in flight */
    ck_assert_int_ge(close_connections(T.name), 1);
    st = itest_wait(pid, itest_ms(60000));
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "idemq: 0x%x (see %s)", st,
                  log);
    ck_assert_int_ge(itest_count_lines(log, "broker failure"), 1); /* it did reconnect */
    ck_assert_int_eq(itest_long(&T, LEASE_EXPIRED_LIKE, T.name), 0);
    ck_assert_int_eq(itest_long(&T, "SELECT count(*) FROM idemq.intents WHERE key LIKE $1 || "
                                    "'%' AND (uncertain OR unknowns > 0)", T.name), 0);
    ck_assert_int_eq(itest_long(&T, APPLIED_LIKE, T.name), N);
    ck_assert_int_eq(itest_long(&T, EFFECTS_LIKE, T.name), N);
    ck_assert_int_eq(tprov_stat(&P, NULL, "requests"), N); /* never resent */
    for (int i = 0; i < N; i++) {
        snprintf(key, sizeof key, "%s-k11-%d", T.name, i);
        ck_assert_int_eq(tprov_stat(&P, key, "key_charges"), 1);
        ck_assert_str_eq(itest_text(&T, STATE, key, b, sizeof b), "applied");
    }
    ck_assert_int_eq(itest_queue_ready(&T, T.conf->inputs[0].queue), 0);
    unlink(log);
    teardown();
}
END_TEST

/* 12. SIGTERM with provider jobs queued behind max_in_flight: only
 * the calls in flight are awaited; the queued jobs go back to the broker
 * unclaimed. After a restart every job is applied once, and no intent ever
 * had its lease expire. */
START_TEST(test12_stop_drain_starts_nothing)
{
    enum { N = 40 };
    char key[128], ctl[128];
    pid_t pid;
    int st;
    long at_stop, t0;
    struct timespec ts;
    setup_provider("pe12", NULL, "max_in_flight = 2;");
    snprintf(ctl, sizeof ctl, "{\"fault\":\"latency=%d\",\"count\":%d}", itest_ms(1500), N);
    tprov_control(&P, ctl);
    for (int i = 0; i < N; i++) {
        snprintf(key, sizeof key, "%s-k12-%d", T.name, i);
        publish_payout(key, NULL);
    }
    pid = itest_spawn(&T, T.cfg_path, 60, NULL);
    ck_assert_int_ge(wait_requests(2, itest_ms(10000)), 2);
    at_stop = tprov_stat(&P, NULL, "requests");
    clock_gettime(CLOCK_MONOTONIC, &ts);
    t0 = ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
    kill(pid, SIGTERM);
    st = itest_wait(pid, itest_ms(60000));
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ck_assert_msg(st != -1 && WIFEXITED(st), "idemq did not stop (0x%x)", st);
    /* the drain waited for the calls in flight (one latency), not more */
    ck_assert_int_le(tprov_stat(&P, NULL, "requests"), at_stop + 2);
    ck_assert_int_lt(ts.tv_sec * 1000 + ts.tv_nsec / 1000000 - t0, itest_ms(10000));
    ck_assert_int_eq(itest_long(&T, "SELECT count(*) FROM idemq.intents WHERE key LIKE $1 || "
                                    "'%' AND state = 'pending'", T.name), 0);
    tprov_control(&P, "{\"fault\":\"\"}");
    itest_run_until_idle(&T, 3);
    ck_assert_int_eq(itest_long(&T, LEASE_EXPIRED_LIKE, T.name), 0);
    ck_assert_int_eq(itest_long(&T, APPLIED_LIKE, T.name), N);
    ck_assert_int_eq(itest_long(&T, EFFECTS_LIKE, T.name), N);
    for (int i = 0; i < N; i++) {
        snprintf(key, sizeof key, "%s-k12-%d", T.name, i);
        ck_assert_int_eq(tprov_stat(&P, key, "key_charges"), 1);
    }
    teardown();
}
END_TEST

/* 13. Transaction 1 waited so long (here: on another session's
 * uncommitted claim of the key) that little of its lease is left when the
 * request would leave: it is not sent, and that is recorded at once (the
 * intent stays certain, not an unknown outcome at the lease's end); the
 * retry sends it, one charge. */
START_TEST(test13_lease_bounds_the_call)
{
    char key[128], b[256], sql[512];
    const char *p[1] = {key};
    PGresult *r;
    pid_t pid;
    itest_extra_conf = "database: { statement_timeout_ms = 40000; };"; /* the wait is long */
    setup_provider("pe13", NULL, NULL);
    itest_extra_conf = NULL;
    snprintf(key, sizeof key, "%s-k13", T.name);
    itest_sql(&T, "BEGIN");
    snprintf(sql, sizeof sql, "INSERT INTO idemq.jobs (key, state, source_queue, payload_sha256) "
                              "VALUES ($1, 'pending', 'x', 'x')");
    r = PQexecParams(T.db, sql, 1, NULL, p, NULL, NULL, 0);
    ck_assert_int_eq(PQresultStatus(r), PGRES_COMMAND_OK);
    PQclear(r);
    publish_payout(key, NULL);
    pid = itest_spawn(&T, T.cfg_path, 3, NULL);
    {
        /* a session of our own sees transaction 1 wait for the claim */
        char err[256];
        PGconn *watch = ledger_db_connect(getenv("IDEMQ_PG_DSN"), "itest watch", 0, err,
                                          sizeof err);
        ck_assert_msg(watch != NULL, "%s", err);
        for (int i = 0;; i++) {
            r = PQexec(watch, "SELECT count(*) FROM pg_stat_activity WHERE application_name "
                              "LIKE 'idemq worker%' AND wait_event_type = 'Lock'");
            ck_assert_int_eq(PQresultStatus(r), PGRES_TUPLES_OK);
            if (strcmp(PQgetvalue(r, 0, 0), "0") != 0) {
                PQclear(r);
                break;
            }
            PQclear(r);
            ck_assert_msg(i < itest_ms(20000) / 20, "transaction 1 never waited for the claim");
            usleep(20000);
        }
        PQfinish(watch);
    }
    /* the lease is timeout_ms + 5 s from the start of transaction 1; hold
     * the claim until less than 2.25 s of it are left (a send needs 2 s of
     * margin and 0.5 s of call) */
    usleep((useconds_t)(T.conf->inputs[0].provider.timeout_ms + 5000 - 2250) * 1000);
    ck_assert_int_eq(tprov_stat(&P, NULL, "requests"), 0);
    itest_sql(&T, "ROLLBACK");
    ck_assert_int_ne(itest_wait(pid, itest_ms(60000)), -1);
    /* (the wait counted as idle time: the retry copy may still be queued) */
    itest_run_until_idle(&T, 3);
    ck_assert_str_eq(itest_text(&T, STATE, key, b, sizeof b), "applied");
    ck_assert_int_eq(itest_long(&T, "SELECT count(*) FROM idemq.attempts WHERE key = $1 AND "
                                    "error_code = 'provider_not_sent'", key), 1);
    ck_assert_int_eq(itest_long(&T, LEASE_EXPIRED_LIKE, key), 0);
    ck_assert_int_eq(itest_long(&T, "SELECT count(*) FROM idemq.intents WHERE key = $1 AND "
                                    "NOT uncertain AND unknowns = 0", key), 1);
    ck_assert_int_eq(tprov_stat(&P, NULL, "requests"), 1); /* only the retry left */
    ck_assert_int_eq(tprov_stat(&P, key, "key_charges"), 1);
    teardown();
}
END_TEST

/* cfg2: T's config with its protection block replaced by one that lists
 * only key k2 (active): what a process that lost key k1 runs with. */
static void config_without_k1(const char *k1, const char *k2, char *cfg2, size_t len)
{
    static char text[1 << 16];
    char *at, find[300];
    size_t n;
    FILE *f;
    ck_assert_ptr_nonnull(f = fopen(T.cfg_path, "r"));
    n = fread(text, 1, sizeof text - 1, f);
    text[n] = '\0';
    fclose(f);
    snprintf(find, sizeof find, "\"k1=%s\" ]; active = \"k1\"", k1);
    ck_assert_ptr_nonnull(at = strstr(text, find));
    snprintf(cfg2, len, "%s.k2", T.cfg_path);
    ck_assert_ptr_nonnull(f = fopen(cfg2, "w"));
    fprintf(f, "%.*s\"k2=%s\" ]; active = \"k2\"%s", (int)(at - text), text, k2,
            at + strlen(find));
    fclose(f);
}

/* Runs the first copy of key under protection (k1 active) until the test
 * hook kills idemq right after the provider's call: the intent is pending
 * and the request is stored sealed. Then the copy is purged and another
 * copy of the key with a different body is published, so the next
 * delivery must send the stored request (it differs from its own). */
static void sealed_first_call(const char *tag, char *key, size_t klen, char *k1, char *k2,
                              size_t plen)
{
    const char *env[] = {"IDEMQ_TEST_CRASH=provider_after_call", NULL};
    char extra[600];
    int st;
    itest_key_file(k1, plen, "pe-k1", 0x20);
    itest_key_file(k2, plen, "pe-k2", 0x50);
    snprintf(extra, sizeof extra, "protection: { keys = [ \"k1=%s\" ]; active = \"k1\"; };", k1);
    itest_extra_conf = extra;
    setup_provider(tag, NULL, NULL); /* idempotent, no lookup: resent under its key */
    itest_extra_conf = NULL;
    snprintf(key, klen, "%s-ks", T.name);
    publish_payout(key, NULL);
    st = itest_wait(itest_spawn(&T, T.cfg_path, 30, env), itest_ms(30000));
    ck_assert_msg(st != -1 && WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL,
                  "idemq was not killed by the hook (status 0x%x)", st);
    ck_assert_int_eq(tprov_stat(&P, key, "key_charges"), 1);
    /* sealed at rest: the key named, not a byte of the request in the clear */
    ck_assert_int_eq(itest_long(&T, "SELECT count(*) FROM idemq.intents WHERE key = $1 AND "
                                    "request_body_key = 'k1' AND position(convert_to(key, "
                                    "'UTF8') IN request_body) = 0 AND position('amount_minor' "
                                    "::bytea IN request_body) = 0 AND octet_length(request_body) "
                                    "> 28", key), 1);
    /* and so is the message the intent keeps (its parks, the local effect) */
    ck_assert_int_eq(itest_long(&T, "SELECT count(*) FROM idemq.intents WHERE key = $1 AND "
                                    "body_key = 'k1' AND position('amount_minor'::bytea IN body) "
                                    "= 0 AND body_sha256 = (SELECT payload_sha256 FROM "
                                    "idemq.jobs WHERE key = $1)", key), 1);
    purge_input("sealed purge");
    publish_payout(key, "\"memo\":\"another copy\"");
}

/* 14. The request body of a provider call is sealed at rest under
 * protection.active; a resend opens it: the provider gets the exact bytes
 * of the first request (any other bytes under the key answer 422 and
 * park), and the effect runs once. */
START_TEST(test14_sealed_request_resent)
{
    char key[128], k1[128], k2[128];
    sealed_first_call("pe14", key, sizeof key, k1, k2, sizeof k1);
    itest_run_until_idle(&T, 12); /* waits out the lease, then resends */
    applied_on_resend(key);
    ck_assert_int_eq(itest_long(&T, "SELECT count(*) FROM idemq.attempts WHERE key = $1 AND "
                                    "error_code = 'conflict'", key), 0);
    /* the effect ran on the first copy's message, opened */
    ck_assert_int_eq(itest_long(&T, "SELECT count(*) FROM idemq_test.effects WHERE key = $1 "
                                    "AND payload->>'amount_minor' = '500' AND NOT payload ? "
                                    "'memo'", key), 1);
    /* erased: no request left, and no key named for it */
    {
        char cmd[300], out[4096];
        snprintf(cmd, sizeof cmd, "erase '%s' --why 'sealed request test'", key);
        ck_assert_msg(itest_idemq(&T, cmd, out, sizeof out) == 0, "%s", out);
        ck_assert_int_eq(itest_long(&T, "SELECT count(*) FROM idemq.intents WHERE key = $1 AND "
                                        "request_body = ''::bytea AND request_body_key IS NULL "
                                        "AND body = ''::bytea AND body_key IS NULL",
                                    key), 1);
    }
    unlink(k1);
    unlink(k2);
    teardown();
}
END_TEST

/* 15. A stored request sealed with a key that is no longer listed is never
 * sent (neither empty nor sealed): each attempt is recorded as not sent,
 * naming the key; listed again, the same request goes out and applies. */
START_TEST(test15_sealed_request_unlisted_key)
{
    char key[128], k1[128], k2[128], cfg2[300], log[300];
    int st;
    retry_conf = "base_delay_ms = 200; max_delay_ms = 5000; jitter = \"none\"; "
                 "max_attempts = 100;";
    sealed_first_call("pe15", key, sizeof key, k1, k2, sizeof k1);
    config_without_k1(k1, k2, cfg2, sizeof cfg2);
    snprintf(log, sizeof log, "/tmp/%s.k2.log", T.name);
    unlink(log);
    /* runs until the lease has run out and a few attempts were refused */
    {
        pid_t pid = itest_spawn_log(cfg2, 30, NULL, log);
        for (long long end = itest_mono_ms() + itest_ms(30000);
             itest_long(&T, "SELECT count(*) FROM idemq.attempts WHERE key = $1 AND "
                            "error_code = 'provider_not_sent'", key) < 2 &&
             itest_mono_ms() < end;)
            usleep(50000); /* polled up to the deadline */
        kill(pid, SIGTERM);
        st = itest_wait(pid, itest_ms(30000));
        ck_assert_msg(st != -1, "idemq did not stop");
    }
    ck_assert_int_ge(itest_count_lines(log, "sealed with key 'k1' and cannot be opened"), 1);
    ck_assert_int_ge(itest_long(&T, "SELECT count(*) FROM idemq.attempts WHERE key = $1 AND "
                                    "error_code = 'provider_not_sent' AND message LIKE "
                                    "'%sealed with key ''k1''%'", key), 2);
    ck_assert_int_eq(tprov_stat(&P, NULL, "requests"), 1); /* nothing more was sent */
    ck_assert_int_eq(itest_long(&T, EFFECTS, key), 0);
    /* k1 listed again: the stored request is opened and sent */
    itest_run_until_idle(&T, 8);
    applied_on_resend(key);
    unlink(log);
    unlink(cfg2);
    unlink(k1);
    unlink(k2);
    teardown();
    retry_conf = "base_delay_ms = 200; max_delay_ms = 10000; jitter = \"none\";";
}
END_TEST

/* 16. The reconciler resends a sealed request (no message at hand): it
 * opens it first; a process without the key leaves it, naming the key. */
START_TEST(test16_sealed_request_sweep)
{
    char key[128], k1[128], k2[128], cfg2[300], log[300];
    int st;
    sealed_first_call("pe16", key, sizeof key, k1, k2, sizeof k1);
    purge_input("pe16 purge");
    age_intents("pe16", false);
    config_without_k1(k1, k2, cfg2, sizeof cfg2);
    snprintf(log, sizeof log, "/tmp/%s.k2.log", T.name);
    unlink(log);
    st = itest_wait(itest_spawn_log(cfg2, 8, NULL, log), itest_ms(60000));
    ck_assert_msg(st != -1 && WIFEXITED(st), "status 0x%x", st);
    ck_assert_int_ge(itest_count_lines(log, "sealed with key 'k1' and cannot be opened"), 1);
    ck_assert_int_eq(tprov_stat(&P, NULL, "requests"), 1);
    age_intents("pe16", true);
    itest_run_until_idle(&T, 8);
    applied_on_resend(key);
    unlink(log);
    unlink(cfg2);
    unlink(k1);
    unlink(k2);
    teardown();
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
    /* calls in flight across a reconnect and a stop */
    tc = tcase_create("in_flight");
    tcase_set_timeout(tc, itest_ms(240));
    tcase_add_test(tc, test11_broker_reconnect_keeps_calls);
    tcase_add_test(tc, test12_stop_drain_starts_nothing);
    tcase_add_test(tc, test13_lease_bounds_the_call);
    suite_add_tcase(s, tc);
    /* request bodies sealed at rest */
    tc = tcase_create("sealed");
    tcase_set_timeout(tc, itest_ms(240));
    tcase_add_test(tc, test14_sealed_request_resent);
    tcase_add_test(tc, test15_sealed_request_unlisted_key);
    tcase_add_test(tc, test16_sealed_request_sweep);
    suite_add_tcase(s, tc);
    return check_run(s);
}
