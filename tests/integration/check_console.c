/*
 * Integration test of the web console: a real `idemq run` with
 * console.listen on real RabbitMQ and PostgreSQL, driven by headless
 * Chromium (tests/browser/console.test.mjs, playwright-core): every page,
 * a hostile key shown as text, cross-site and token-less POSTs refused, and
 * a group redrive and a discard confirmed after their dry runs; then the
 * ledger must show the actions recorded, the redriven keys applied once
 * and the discarded park closed. Plus plain HTTP checks of what needs no
 * browser (the viewport meta, 404, the stylesheet).
 */
#include <check.h>

#include "check_run.h"
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "itest.h"

#define EFFECTS_FOR "SELECT count(*) FROM idemq_test.effects WHERE key = $1"
#define TOKEN "console-test-token-4f1c-9a8b7c6d5e4f3a2b"
#define TOKEN_ALICE "alice-5b0e9c1d7a2f4e6b8c3d1a0f9e8d7c6b"
#define TOKEN_BOB "bob-1d2c3b4a5f6e7d8c9b0a1f2e3d4c5b6a7"

static const char *effect_sql =
    "CREATE TABLE IF NOT EXISTS idemq_test.console_broken (test text PRIMARY KEY);"
    "CREATE OR REPLACE FUNCTION idemq_test.console_effect(p_key text, p_payload jsonb,"
    " p_meta jsonb) RETURNS jsonb LANGUAGE plpgsql AS $fn$ BEGIN"
    " IF EXISTS (SELECT 1 FROM idemq_test.console_broken b WHERE b.test = p_payload->>'test')"
    " THEN RAISE EXCEPTION 'order % rejected: limit %', p_payload->>'order',"
    " p_payload->>'limit' USING ERRCODE = '22023';"
    " END IF; RETURN idemq_test.record(p_key, p_payload, p_meta); END $fn$;";

static long long mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

START_TEST(test_console_browser)
{
    struct itest t;
    char extra[1024], tokfile[256], url[128], body[1024], sql[512], a[3][160], hostile[200];
    char group[16], cmd[4096], page[65536], obs[200], late[1024], bidi[200], longkey[300];
    char nokey_park[24], retrying[200];
    const char *bodies[1] = {body};
    const char *shots = getenv("IDEMQ_CONSOLE_SHOTS");
    int port = itest_free_port(), rc;
    long long deadline;
    pid_t pid;
    FILE *f;

    ck_assert_msg(access(IDEMQ_SOURCE_DIR "/tests/browser/node_modules/playwright-core",
                         R_OK) == 0 && access("/usr/bin/chromium", X_OK) == 0,
                  "the browser test needs chromium and tests/browser/node_modules: run "
                  "scripts/setup");
    snprintf(tokfile, sizeof tokfile, "/tmp/idemq-console-token-%d", (int)getpid());
    ck_assert_ptr_nonnull(f = fopen(tokfile, "w"));
    fprintf(f, "# name token\nbrowser-test %s\nother %s\n", TOKEN, TOKEN_BOB);
    fclose(f);
    /* as the deployment's roles (least-privilege mode), the console redrives
     * with the operator's broker user, as the docs recommend */
    snprintf(extra, sizeof extra,
             "console: { listen = \"127.0.0.1:%d\"; token_file = \"%s\"; "
             "statement_timeout_ms = 3000;%s%s%s };",
             port, tokfile, itest_lp() ? " operator_broker_url = \"" : "",
             itest_lp() ? getenv("IDEMQ_TEST_LP_OPERATOR_URL") : "", itest_lp() ? "\";" : "");
    itest_extra_conf = extra;
    itest_setup(&t, "console", "idemq_test.console_effect", "", "");
    itest_sql(&t, effect_sql);
    snprintf(sql, sizeof sql, "INSERT INTO idemq_test.console_broken VALUES ('%s')", t.name);
    itest_sql(&t, sql);
    for (int i = 0; i < 3; i++) { /* one failure group of three keys */
        snprintf(a[i], sizeof a[i], "%s:a%d", t.name, i);
        snprintf(body, sizeof body,
                 "{\"job_id\":\"%s\",\"test\":\"%s\",\"order\":%d,\"limit\":%d}", a[i],
                 t.name, 1001 + i * 17, 500 + i * 250);
        itest_publish(&t, bodies, 1);
    }
    /* a hostile key, parked in a group of its own */
    snprintf(hostile, sizeof hostile, "%s:<script>alert(1)</script>\"'&", t.name);
    snprintf(body, sizeof body,
             "{\"job_id\":\"%s:<script>alert(1)</script>\\\"'&\",\"raise\":\"22023\"}", t.name);
    itest_publish(&t, bodies, 1);
    /* a key with a right-to-left override: it would show "...exe.txt" */
    snprintf(bidi, sizeof bidi, "%s:inv\xe2\x80\xaetxt.exe", t.name);
    snprintf(body, sizeof body, "{\"job_id\":\"%s\",\"raise\":\"23514\"}", bidi);
    itest_publish(&t, bodies, 1);
    /* a message without a key (a body that is not JSON) */
    snprintf(body, sizeof body, "{\"job_id\": nope %s", t.name);
    itest_publish(&t, bodies, 1);
    /* a long key with a long reason, in a group of its own */
    snprintf(longkey, sizeof longkey, "%s:long-", t.name);
    while (strlen(longkey) < 240)
        strcat(longkey, "k");
    snprintf(body, sizeof body,
             "{\"job_id\":\"%s\",\"test\":\"%s\",\"order\":\"%0300d\",\"limit\":1}",
             longkey, t.name, 0);
    for (char *c = strstr(body, "\"order\":\"") + 9; *c == '0'; c++)
        *c = 'x';
    itest_publish(&t, bodies, 1);
    itest_run_until_idle(&t, 2);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE source_queue = $1",
                                t.name),
                     7);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1", hostile),
                     1);
    itest_text(&t,
               "SELECT idemq.park_group(source_queue, error_class, error_code, sqlstate, reason,"
               " key) FROM idemq.parked WHERE key = $1",
               a[0], group, sizeof group);
    /* a baseline for the /observe page: what an observe-mode input of
     * another process recorded (the rows observe_batch writes) */
    snprintf(obs, sizeof obs, "%s_obs", t.name);
    itest_long(&t,
               "WITH o(outcome, code, n) AS (VALUES ('observed', NULL, 40),"
               " ('duplicate', NULL, 3), ('duplicate', 'key_reuse', 1),"
               " ('late_replay', 'outside_dedup_window', 1), ('would_park', 'bad_json', 2)),"
               " ins AS (INSERT INTO idemq.observations (input, queue, key, outcome, code, reason,"
               " payload_sha256, redelivered, consumer_id) SELECT $1, $1 || '.q', $1 || ':' || g,"
               " o.outcome, o.code, NULL, NULL, false, 'check_console' FROM o,"
               " generate_series(1, o.n) g RETURNING 1) SELECT count(*) FROM ins",
               obs);
    /* a job retrying now: its row and its last attempt, as a transient
     * failure leaves them (no copy is needed: the page reads the ledger) */
    snprintf(retrying, sizeof retrying, "%s:retrying", t.name);
    itest_long(&t,
               "WITH j AS (INSERT INTO idemq.jobs (key, state, source_queue, payload_sha256,"
               " attempts) VALUES ($1, 'retrying', split_part($1, ':', 1), 'x', 2) RETURNING 1),"
               " a AS (INSERT INTO idemq.attempts (key, attempt, outcome, started_at, finished_at,"
               " error_class, sqlstate, message, delay_ms) VALUES ($1, 2, 'transient_error',"
               " now(), now(), 'transient', '40001', 'could not serialize access', 4000)"
               " RETURNING 1) SELECT (SELECT count(*) FROM j) + (SELECT count(*) FROM a)",
               retrying);
    setenv("CONSOLE_RETRYING_KEY", retrying, 1);
    /* the cause fixed; the daemon runs with its console */
    snprintf(sql, sizeof sql, "DELETE FROM idemq_test.console_broken WHERE test = '%s'", t.name);
    itest_sql(&t, sql);
    pid = itest_spawn(&t, t.cfg_path, 120, NULL);
    snprintf(url, sizeof url, "http://127.0.0.1:%d", port);
    deadline = mono_ms() + itest_ms(15000);
    snprintf(cmd, sizeof cmd, "%s/", url);
    while (itest_http_get(cmd, page, sizeof page) != 200 && mono_ms() < deadline)
        usleep(100 * 1000);
    ck_assert_int_eq(itest_http_get(cmd, page, sizeof page), 200);
    ck_assert_msg(strstr(page, "name=\"viewport\"") != NULL, "%s", page);
    snprintf(cmd, sizeof cmd, "%s/nope", url);
    ck_assert_int_eq(itest_http_get(cmd, page, sizeof page), 404);
    snprintf(cmd, sizeof cmd, "%s/console.css", url);
    ck_assert_int_eq(itest_http_get(cmd, page, sizeof page), 200);

    setenv("CONSOLE_URL", url, 1);
    setenv("CONSOLE_TOKEN", TOKEN, 1);
    setenv("CONSOLE_TOKEN_OTHER", TOKEN_BOB, 1);
    setenv("CONSOLE_GROUP", group, 1);
    setenv("CONSOLE_KEY", a[0], 1);
    setenv("CONSOLE_SCRIPT_KEY", hostile, 1);
    setenv("CONSOLE_BIDI_KEY", bidi, 1);
    setenv("CONSOLE_LONG_KEY", longkey, 1);
    snprintf(nokey_park, sizeof nokey_park, "%ld",
             itest_long(&t, "SELECT max(id) FROM idemq.parked WHERE source_queue = $1 AND"
                            " key IS NULL",
                        t.name));
    setenv("CONSOLE_NOKEY_PARK", nokey_park, 1);
    setenv("CONSOLE_EXPECT", "3", 1);
    setenv("CONSOLE_OBSERVE_INPUT", obs, 1);
    /* a park of the same group that appears between the dry run and the
     * action: the action must leave it for the next dry run */
    snprintf(late, sizeof late,
             "INSERT INTO idemq.parked (key, source_queue, exchange, routing_key, body, headers,"
             " properties, payload_sha256, error_class, error_code, sqlstate, reason, attempts)"
             " SELECT '%s:late', source_queue, exchange, routing_key, body, headers, properties,"
             " payload_sha256, error_class, error_code, sqlstate, reason, attempts"
             " FROM idemq.parked WHERE key = '%s'",
             t.name, a[0]);
    setenv("CONSOLE_LATE_PARK_SQL", late, 1);
    setenv("SHOTS_DIR", shots ? shots : "", 1);
    snprintf(cmd, sizeof cmd, "cd '%s/tests/browser' && timeout 90 node console.test.mjs",
             IDEMQ_SOURCE_DIR);
    rc = system(cmd);
    ck_assert_msg(rc == 0, "the browser test failed (status %d): see its lines above", rc);

    /* the ledger changed: the action recorded, the redriven keys applied once */
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.operator_actions WHERE action ="
                                    " 'redrive' AND actor = 'console:browser-test' AND reason ="
                                    " 'fixed the limit' AND selected = 3 AND done = 3 AND"
                                    " selection LIKE '%' || $1 || '%'",
                                group),
                     1);
    deadline = mono_ms() + itest_ms(20000);
    while (mono_ms() < deadline &&
           itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key LIKE $1 || ':a%' AND"
                          " state = 'applied'",
                      t.name) < 3)
        usleep(100 * 1000);
    for (int i = 0; i < 3; i++)
        ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, a[i]), 1);
    /* the park that appeared after the dry run is still open, untouched */
    snprintf(sql, sizeof sql, "%s:late", t.name);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1", sql), 1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.operator_action_keys WHERE"
                                    " key = $1", sql),
                     0);
    /* the hostile key's group discarded through the console */
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1", hostile),
                     0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.park_history WHERE key = $1 AND"
                                    " resolution = 'discarded: hostile key' AND resolved_by ="
                                    " 'console:browser-test'",
                                hostile),
                     1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.operator_action_keys k JOIN"
                                    " idemq.operator_actions a ON a.id = k.action_id WHERE"
                                    " k.key = $1 AND a.action = 'discard' AND k.outcome ="
                                    " 'discarded'",
                                hostile),
                     1);
    /* one message archived from its page, one key discarded from its page */
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.park_history WHERE id ="
                                    " $1::bigint AND resolution = 'archived: no key' AND"
                                    " resolved_by = 'console:browser-test'",
                                nokey_park),
                     1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.park_history WHERE key = $1 AND"
                                    " resolution = 'discarded: bidi key' AND resolved_by ="
                                    " 'console:other'",
                                bidi),
                     1);
    kill(pid, SIGTERM); /* drains and exits 0 (under ASan: no leak either) */
    rc = itest_wait(pid, itest_ms(15000));
    ck_assert_msg(rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) == 0, "status 0x%x", rc);
    unlink(tokfile);
    itest_extra_conf = NULL;
    itest_teardown(&t);
}
END_TEST

/* curl's HTTP status for url with extra curl arguments (auth), -1 if none. */
static int curl_status(const char *url, const char *args)
{
    char cmd[1024], out[16] = "";
    FILE *p;
    snprintf(cmd, sizeof cmd, "curl -s -o /dev/null -w '%%{http_code}' %s '%s'", args, url);
    if (!(p = popen(cmd, "r")))
        return -1;
    if (!fgets(out, sizeof out, p))
        out[0] = '\0';
    pclose(p);
    return atoi(out) > 0 ? atoi(out) : -1; /* "000": no answer */
}

/* Writes a token file at path with the lines given; returns path. */
static const char *token_file(char *path, size_t len, const char *tag, const char *lines)
{
    FILE *f;
    snprintf(path, len, "/tmp/idemq-console-%s-%d", tag, (int)getpid());
    ck_assert_ptr_nonnull(f = fopen(path, "w"));
    fputs(lines, f);
    fclose(f);
    return path;
}

/* Waits until the console at url answers anything. */
static void wait_console(const char *url)
{
    long long deadline = mono_ms() + itest_ms(15000);
    while (curl_status(url, "") == -1 && mono_ms() < deadline)
        usleep(100 * 1000);
}

/* DNS rebinding: a page of evil.example whose name now resolves to
 * 127.0.0.1 reaches the console from loopback with its own name in Host.
 * Only the listen address, localhost, 127.0.0.1 and [::1] with the port
 * (and console.hosts) are answered; the rest get 421 and nothing is read.
 */
START_TEST(test_console_foreign_host)
{
    struct itest t;
    char extra[1024], url[160], hdr[200], tokline[200];
    int port = itest_free_port(), rc;
    pid_t pid;

    snprintf(extra, sizeof extra,
             "console: { listen = \"127.0.0.1:%d\"; };", port);
    itest_extra_conf = extra;
    itest_setup(&t, "console_host", "idemq_test.record", "", "");
    pid = itest_spawn(&t, t.cfg_path, 60, NULL);
    snprintf(url, sizeof url, "http://127.0.0.1:%d/key?k=%s:k", port, t.name);
    wait_console(url);
    snprintf(hdr, sizeof hdr, "-H 'Host: evil.example:%d'", port);
    ck_assert_int_eq(curl_status(url, hdr), 421);
    ck_assert_int_eq(curl_status(url, "-H 'Host: evil.example'"), 421);
    snprintf(hdr, sizeof hdr, "-H 'Host: 127.0.0.1:%d.evil.example'", port);
    ck_assert_int_eq(curl_status(url, hdr), 421);
    snprintf(hdr, sizeof hdr, "-H 'Host: 127.0.0.1:%d'", port + 1);
    ck_assert_int_eq(curl_status(url, hdr), 421);
    ck_assert_int_eq(curl_status(url, "-H 'Host:'"), 421); /* none at all */
    snprintf(url, sizeof url, "http://127.0.0.1:%d/", port);
    snprintf(hdr, sizeof hdr, "-H 'Host: evil.example:%d' -H 'Origin: http://evil.example:%d'"
                              " -X POST --data 'action=redrive'", port, port);
    snprintf(tokline, sizeof tokline, "http://127.0.0.1:%d/confirm", port);
    ck_assert_int_eq(curl_status(tokline, hdr), 421);
    /* the names that do name the console */
    ck_assert_int_eq(curl_status(url, ""), 200);
    snprintf(hdr, sizeof hdr, "-H 'Host: localhost:%d'", port);
    ck_assert_int_eq(curl_status(url, hdr), 200);
    snprintf(hdr, sizeof hdr, "-H 'Host: LocalHost:%d'", port);
    ck_assert_int_eq(curl_status(url, hdr), 200);
    snprintf(hdr, sizeof hdr, "-H 'Host: [::1]:%d'", port);
    ck_assert_int_eq(curl_status(url, hdr), 200);
    kill(pid, SIGTERM);
    rc = itest_wait(pid, itest_ms(15000));
    ck_assert_msg(rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) == 0, "status 0x%x", rc);
    itest_extra_conf = NULL;
    itest_teardown(&t);
}
END_TEST

/* console.reads_need_token: loopback reads need the token as well (a
 * proxy or tunnel on the same host makes every client loopback); and
 * console.hosts adds the names a proxy sends. */
START_TEST(test_console_reads_need_token)
{
    struct itest t;
    char extra[1024], url[160], hdr[200], tokfile[256];
    int port = itest_free_port(), rc;
    pid_t pid;

    token_file(tokfile, sizeof tokfile, "rtok",
               "# name token\nalice " TOKEN_ALICE "\n\nbob " TOKEN_BOB "\n");
    snprintf(extra, sizeof extra,
             "console: { listen = \"127.0.0.1:%d\"; token_file = \"%s\"; "
             "reads_need_token = true; hosts = [\"console.example:%d\"]; };",
             port, tokfile, port);
    itest_extra_conf = extra;
    itest_setup(&t, "console_host", "idemq_test.record", "", "");
    pid = itest_spawn(&t, t.cfg_path, 60, NULL);
    snprintf(url, sizeof url, "http://127.0.0.1:%d/", port);
    wait_console(url);
    ck_assert_int_eq(curl_status(url, ""), 401);
    ck_assert_int_eq(curl_status(url, "-u alice:" TOKEN_BOB), 401);
    ck_assert_int_eq(curl_status(url, "-u alice:" TOKEN_ALICE), 200);
    snprintf(hdr, sizeof hdr, "-u alice:" TOKEN_ALICE " -H 'Host: console.example:%d'", port);
    ck_assert_int_eq(curl_status(url, hdr), 200);
    snprintf(hdr, sizeof hdr, "-u alice:" TOKEN_ALICE " -H 'Host: evil.example:%d'", port);
    ck_assert_int_eq(curl_status(url, hdr), 421);
    ck_assert_int_eq(curl_status(url, "-u bob:" TOKEN_BOB), 200);
    ck_assert_int_eq(curl_status(url, "-u bob:" TOKEN_ALICE), 401); /* not bob's */
    snprintf(url, sizeof url, "http://127.0.0.1:%d/console.css", port);
    ck_assert_int_eq(curl_status(url, ""), 401);
    /* guesses are throttled: after a burst of wrong tokens even the right
     * one is not compared for a while */
    for (int i = 0; i < 12; i++)
        curl_status(url, "-u alice:guess-guess-guess-guess-guess-guess");
    ck_assert_int_eq(curl_status(url, "-u alice:" TOKEN_ALICE), 429);
    kill(pid, SIGTERM);
    rc = itest_wait(pid, itest_ms(15000));
    ck_assert_msg(rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) == 0, "status 0x%x", rc);
    itest_extra_conf = NULL;
    itest_teardown(&t);
    unlink(tokfile);
}
END_TEST

/* A token file of an older version (one token, no name), a short token
 * and a repeated token are refused at start, with what to write (idemq
 * runs on without its console). */
START_TEST(test_console_token_file_refused)
{
    struct itest t;
    char extra[1024], tokfile[256], out[4096];
    static const char *const files[] = {
        TOKEN_ALICE "\n",
        "alice short-token\n",
        "alice " TOKEN_ALICE "\nbob " TOKEN_ALICE "\n",
    };
    static const char *const says[] = {"one field", "32 to 255", "earlier line"};
    for (int i = 0; i < 3; i++) {
        int port = itest_free_port();
        token_file(tokfile, sizeof tokfile, "badtok", files[i]);
        snprintf(extra, sizeof extra, "console: { listen = \"127.0.0.1:%d\"; token_file = \"%s\"; };",
                 port, tokfile);
        itest_extra_conf = extra;
        itest_setup(&t, "console_badtok", "idemq_test.record", "", "");
        itest_idemq(&t, "run --until-idle 1", out, sizeof out);
        ck_assert_msg(strstr(out, says[i]) != NULL && strstr(out, "without the console"),
                      "file %d: %s", i, out);
        itest_extra_conf = NULL;
        itest_teardown(&t);
        unlink(tokfile);
    }
}
END_TEST

/* A client that is not on loopback (the test hook makes every client one:
 * the tests must not listen beyond loopback) reads only with the token as
 * the HTTP Basic password, and never without console.token_file. */
START_TEST(test_console_remote_read)
{
#ifndef IDEMQ_TEST_HOOKS
    fprintf(stderr, "test_console_remote_read: needs -DIDEMQ_TEST_HOOKS=ON (scripts/test)\n");
    ck_abort_msg("built without IDEMQ_TEST_HOOKS");
#else
    struct itest t;
    char extra[1024], tokfile[256], url[128];
    const char *env[] = {"IDEMQ_TEST_CONSOLE_REMOTE=1", NULL};
    int port = itest_free_port(), rc;
    long long deadline;
    pid_t pid;
    FILE *f;

    snprintf(tokfile, sizeof tokfile, "/tmp/idemq-console-rtoken-%d", (int)getpid());
    ck_assert_ptr_nonnull(f = fopen(tokfile, "w"));
    fprintf(f, "ops %s\n", TOKEN);
    fclose(f);
    for (int with_token = 1; with_token >= 0; with_token--) {
        snprintf(extra, sizeof extra, "console: { listen = \"127.0.0.1:%d\"; token_file = \"%s\"; };",
                 port, with_token ? tokfile : "");
        itest_extra_conf = extra;
        itest_setup(&t, "console_remote", "idemq_test.record", "", "");
        pid = itest_spawn(&t, t.cfg_path, 60, env);
        snprintf(url, sizeof url, "http://127.0.0.1:%d/", port);
        deadline = mono_ms() + itest_ms(15000);
        while (curl_status(url, "") == -1 && mono_ms() < deadline)
            usleep(100 * 1000);
        /* no credentials, a wrong token, the token as the password */
        ck_assert_int_eq(curl_status(url, ""), 401);
        ck_assert_int_eq(curl_status(url, "-u ops:not-the-token"), 401);
        ck_assert_int_eq(curl_status(url, "-u ops:" TOKEN), with_token ? 200 : 401);
        snprintf(url, sizeof url, "http://127.0.0.1:%d/observe", port);
        ck_assert_int_eq(curl_status(url, "-u ops:" TOKEN), with_token ? 200 : 401);
        /* the token under another name than its own */
        ck_assert_int_eq(curl_status(url, "-u anyone:" TOKEN), 401);
        snprintf(url, sizeof url, "http://127.0.0.1:%d/console.css", port);
        ck_assert_int_eq(curl_status(url, ""), 401);
        kill(pid, SIGTERM);
        rc = itest_wait(pid, itest_ms(15000));
        ck_assert_msg(rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) == 0, "status 0x%x", rc);
        itest_extra_conf = NULL;
        itest_teardown(&t);
    }
    unlink(tokfile);
#endif
}
END_TEST

/* The body of url (POST data when not NULL, with the console's Origin)
 * into out; returns the HTTP status, -1 if none. */
static int curl_page(const char *url, const char *origin, const char *data, char *out,
                     size_t len)
{
    char cmd[2048], form[128];
    size_t got;
    FILE *p;
    char *nl;
    if (data) { /* through a file: a form may be larger than a command line */
        snprintf(form, sizeof form, "/tmp/idemq-console-form-%d", (int)getpid());
        ck_assert_ptr_nonnull(p = fopen(form, "w"));
        fputs(data, p);
        fclose(p);
        snprintf(cmd, sizeof cmd,
                 "curl -s -m 20 -w '\n%%{http_code}' -H 'Origin: %s' --data-binary @%s '%s'",
                 origin, form, url);
    } else
        snprintf(cmd, sizeof cmd, "curl -s -m 20 -w '\n%%{http_code}' '%s'", url);
    if (!(p = popen(cmd, "r")))
        return -1;
    got = fread(out, 1, len - 1, p);
    out[got] = '\0';
    pclose(p);
    if (data)
        unlink(form);
    if (!(nl = strrchr(out, '\n')))
        return -1;
    *nl = '\0';
    return atoi(nl + 1) > 0 ? atoi(nl + 1) : -1;
}

/* The value of the first hidden csrf field of page into out[33]. */
static void csrf_of(const char *page, char *out)
{
    const char *p = strstr(page, "name=\"csrf\" value=\"");
    out[0] = '\0';
    if (p)
        snprintf(out, 33, "%s", p + strlen("name=\"csrf\" value=\""));
}

/* console.operator_broker_url: the console's redrives (their dry runs
 * too) connect as that user, not with the daemon's broker.url. A user the
 * broker refuses makes the dry run fail while the daemon consumes on. */
START_TEST(test_console_operator_broker_url)
{
    struct itest t;
    char extra[1024], tokfile[256], url[160], origin[64], data[256], csrf[33];
    char group[16], body[256], key[128];
    static char page[1 << 21]; /* the whole of /groups, however many groups the ledger has */
    const char *bodies[1] = {body};
    const char *amqp = getenv("IDEMQ_AMQP_URL");
    int port = itest_free_port(), rc;
    pid_t pid;

    token_file(tokfile, sizeof tokfile, "optok", "ops " TOKEN_ALICE "\n");
    snprintf(extra, sizeof extra,
             "console: { listen = \"127.0.0.1:%d\"; token_file = \"%s\";"
             " operator_broker_url = \"amqp://nobody:wrong@127.0.0.1%s\"; };",
             port, tokfile, strrchr(amqp, ':'));
    itest_extra_conf = extra;
    itest_setup(&t, "console_op", "idemq_test.record", "", "");
    snprintf(key, sizeof key, "%s:p", t.name);
    snprintf(body, sizeof body, "{\"job_id\":\"%s\",\"raise\":\"22023\"}", key);
    itest_publish(&t, bodies, 1);
    itest_run_until_idle(&t, 2);
    itest_text(&t,
               "SELECT idemq.park_group(source_queue, error_class, error_code, sqlstate, reason,"
               " key) FROM idemq.parked WHERE key = $1",
               key, group, sizeof group);
    pid = itest_spawn(&t, t.cfg_path, 60, NULL);
    snprintf(origin, sizeof origin, "http://127.0.0.1:%d", port);
    snprintf(url, sizeof url, "%s/groups", origin);
    wait_console(url);
    ck_assert_int_eq(curl_page(url, NULL, NULL, page, sizeof page), 200);
    csrf_of(page, csrf);
    ck_assert_int_eq((int)strlen(csrf), 32);
    snprintf(url, sizeof url, "%s/confirm", origin);
    snprintf(data, sizeof data, "csrf=%s&action=redrive&group=%s", csrf, group);
    ck_assert_int_eq(curl_page(url, origin, data, page, sizeof page), 200);
    ck_assert_msg(strstr(page, "the dry run failed") != NULL, "%s", page);
    kill(pid, SIGTERM);
    rc = itest_wait(pid, itest_ms(15000));
    ck_assert_msg(rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) == 0, "status 0x%x", rc);
    itest_extra_conf = NULL;
    itest_teardown(&t);
    unlink(tokfile);
}
END_TEST

/* Slow clients: 16 connections (the per-address limit) that send one byte
 * a second never finish their headers, so an idle timeout never closes
 * them. Each request must arrive whole within a total time, so they are
 * closed and another client of the same address is answered. */
START_TEST(test_console_slow_clients)
{
    struct itest t;
    char extra[256], url[160];
    int port = itest_free_port(), rc, got = -1, socks[16];
    static const char trickle[] = "GET /aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    pid_t pid;

    snprintf(extra, sizeof extra, "console: { listen = \"127.0.0.1:%d\"; };", port);
    itest_extra_conf = extra;
    itest_setup(&t, "console_slow", "idemq_test.record", "", "");
    pid = itest_spawn(&t, t.cfg_path, 60, NULL);
    snprintf(url, sizeof url, "http://127.0.0.1:%d/console.css", port);
    wait_console(url);
    ck_assert_int_eq(curl_status(url, "-m 3"), 200);
    for (int i = 0; i < 16; i++) {
        struct sockaddr_in sa;
        memset(&sa, 0, sizeof sa);
        sa.sin_family = AF_INET;
        sa.sin_port = htons((uint16_t)port);
        sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        ck_assert_int_ge(socks[i] = socket(AF_INET, SOCK_STREAM, 0), 0);
        ck_assert_int_eq(connect(socks[i], (struct sockaddr *)&sa, sizeof sa), 0);
    }
    for (int tick = 0; tick < 16 && got != 200; tick++) {
        for (int i = 0; i < 16; i++)
            (void)!send(socks[i], trickle + tick, 1, MSG_NOSIGNAL);
        usleep(1000 * 1000);
        if (tick >= 8) /* past the total time a request may take to arrive */
            got = curl_status(url, "-m 3");
    }
    ck_assert_msg(got == 200, "locked out by slow clients (%d)", got);
    for (int i = 0; i < 16; i++)
        close(socks[i]);
    kill(pid, SIGTERM);
    rc = itest_wait(pid, itest_ms(15000));
    ck_assert_msg(rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) == 0, "status 0x%x", rc);
    itest_extra_conf = NULL;
    itest_teardown(&t);
}
END_TEST

/* The console acts under the role `idemq migrate --grant` prepares
 * (SELECT and EXECUTE only): a discard confirmed and done through its
 * pages is recorded as the token's holder, the parks closed. */
START_TEST(test_console_least_privilege)
{
    struct itest t;
    char extra[1024], tokfile[256], url[160], origin[64], data[512], csrf[33], role[64];
    char group[16], body[256], keys[2][128], sql[512], dsn[512], envdsn[600];
    static char page[1 << 21];
    const char *bodies[1] = {body};
    const char *env[2] = {envdsn, NULL};
    int port = itest_free_port(), rc;
    char *u;
    pid_t pid;

    token_file(tokfile, sizeof tokfile, "lptok", "ops " TOKEN_ALICE "\n");
    snprintf(extra, sizeof extra,
             "console: { listen = \"127.0.0.1:%d\"; token_file = \"%s\"; };", port, tokfile);
    itest_extra_conf = extra;
    itest_setup(&t, "console_lp", "idemq_test.record", "", "");
    for (int i = 0; i < 2; i++) {
        snprintf(keys[i], sizeof keys[i], "%s:k%d", t.name, i);
        snprintf(body, sizeof body, "{\"job_id\":\"%s\",\"raise\":\"22023\"}", keys[i]);
        itest_publish(&t, bodies, 1);
    }
    itest_run_until_idle(&t, 2);
    itest_text(&t,
               "SELECT idemq.park_group(source_queue, error_class, error_code, sqlstate, reason,"
               " key) FROM idemq.parked WHERE key = $1",
               keys[0], group, sizeof group);
    snprintf(role, sizeof role, "%s_run", t.name);
    snprintf(sql, sizeof sql, "DROP ROLE IF EXISTS %s; CREATE ROLE %s LOGIN", role, role);
    itest_sql(&t, sql);
    snprintf(sql, sizeof sql, "migrate --grant %s", role);
    ck_assert_int_eq(itest_idemq(&t, sql, page, sizeof page), 0);
    snprintf(dsn, sizeof dsn, "%s", getenv("IDEMQ_PG_DSN"));
    ck_assert_ptr_nonnull(u = strstr(dsn, "user="));
    snprintf(u, sizeof dsn - (size_t)(u - dsn), "user=%s", role);
    snprintf(envdsn, sizeof envdsn, "IDEMQ_PG_DSN=%s", dsn);
    pid = itest_spawn(&t, t.cfg_path, 60, env);
    snprintf(origin, sizeof origin, "http://127.0.0.1:%d", port);
    snprintf(url, sizeof url, "%s/groups", origin);
    wait_console(url);
    /* what a client may send wrong: 400, 404, 413 */
    {
        static const char *const bad[] = {"action=nuke&group=", "action=discard&group=xyz",
                                          "action=discard&park=12a", "action=discard&keyhex=zz",
                                          "action=discard"};
        static char big[9000];
        char form[200], more[300];
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
            snprintf(url, sizeof url, "%s/groups", origin);
            ck_assert_int_eq(curl_page(url, NULL, NULL, page, sizeof page), 200);
            csrf_of(page, csrf);
            snprintf(form, sizeof form, "%s%s", bad[i], i == 0 ? group : "");
            snprintf(more, sizeof more, "csrf=%s&%s", csrf, form);
            snprintf(url, sizeof url, "%s/confirm", origin);
            ck_assert_msg(curl_page(url, origin, more, page, sizeof page) == 400, "%s", form);
        }
        memset(big, 'a', sizeof big - 1);
        memcpy(big, "csrf=", 5);
        ck_assert_int_eq(curl_page(url, origin, big, page, sizeof page), 413);
        snprintf(url, sizeof url, "%s/park?id=999999999999", origin);
        ck_assert_int_eq(curl_page(url, NULL, NULL, page, sizeof page), 404);
        snprintf(url, sizeof url, "%s/park?id=1;drop", origin);
        ck_assert_int_eq(curl_page(url, NULL, NULL, page, sizeof page), 400);
    }
    snprintf(url, sizeof url, "%s/groups", origin);
    ck_assert_int_eq(curl_page(url, NULL, NULL, page, sizeof page), 200);
    csrf_of(page, csrf);
    snprintf(url, sizeof url, "%s/confirm", origin);
    snprintf(data, sizeof data, "csrf=%s&action=discard&group=%s", csrf, group);
    ck_assert_int_eq(curl_page(url, origin, data, page, sizeof page), 200);
    ck_assert_msg(strstr(page, "<b>2</b> open parks") != NULL, "%s", page);
    csrf_of(page, csrf);
    snprintf(url, sizeof url, "%s/act", origin);
    snprintf(data, sizeof data, "csrf=%s&token=%s&reason=least+privilege", csrf, TOKEN_ALICE);
    ck_assert_int_eq(curl_page(url, origin, data, page, sizeof page), 200);
    ck_assert_msg(strstr(page, "id=\"act-result\">done<") != NULL, "%s", page);
    snprintf(url, sizeof url, "%s/key?k=%s:k0", origin, t.name);
    ck_assert_int_eq(curl_page(url, NULL, NULL, page, sizeof page), 200);
    kill(pid, SIGTERM);
    rc = itest_wait(pid, itest_ms(15000));
    ck_assert_msg(rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) == 0, "status 0x%x", rc);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.park_history WHERE key LIKE"
                                    " $1 || ':k%' AND resolution = 'discarded: least privilege'"
                                    " AND resolved_by = 'console:ops'",
                                t.name),
                     2);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.operator_actions WHERE actor ="
                                    " 'console:ops' AND done = 2 AND finished_at IS NOT NULL"
                                    " AND selection LIKE '%' || $1 || '%'",
                                group),
                     1);
    snprintf(sql, sizeof sql, "DROP OWNED BY %s; DROP ROLE %s", role, role);
    itest_sql(&t, sql);
    itest_extra_conf = NULL;
    itest_teardown(&t);
    unlink(tokfile);
}
END_TEST

/*
 * An input's sensitive fields never show: a job parks with an error text
 * that quotes its card number; the stored reason and last error, `idemq
 * jobs show`, `idemq parked list` and the console's park page (body and
 * reason) show "***" in its place, while the other fields stay readable.
 */
#define TRACE_ID "4bf92f3577b34da6a3ce929d0e0e4736"

START_TEST(test_console_masks_sensitive)
{
    struct itest t;
    char extra[1024], tokfile[256], url[160], sql[1024], effect[200], key[200], body[512];
    char id[32], out[1 << 16], buf[600];
    static char page[1 << 21];
    int port = itest_free_port(), rc;
    pid_t pid;
    const char *card = "4111111111111111";

    token_file(tokfile, sizeof tokfile, "masktok", "ops " TOKEN_ALICE "\n");
    snprintf(extra, sizeof extra,
             "console: { listen = \"127.0.0.1:%d\"; token_file = \"%s\"; };", port, tokfile);
    itest_extra_conf = extra;
    itest_setup(&t, "console_mask", "idemq_test.record", "", "");
    snprintf(sql, sizeof sql,
             "CREATE FUNCTION idemq_test.%s_fx(p_key text, p_payload jsonb, p_meta jsonb) "
             "RETURNS jsonb LANGUAGE plpgsql AS $fn$ BEGIN "
             "RAISE EXCEPTION 'card %% declined', p_payload->'card'->>'number' "
             "USING ERRCODE = 'IP001'; END $fn$",
             t.name);
    itest_sql(&t, sql);
    snprintf(effect, sizeof effect, "idemq_test.%s_fx", t.name);
    itest_write_config(&t, t.cfg_path, t.name, effect, "",
                       "sensitive = [ \"card.number\", \"account.iban\" ];");
    snprintf(key, sizeof key, "%s:k1", t.name);
    snprintf(body, sizeof body,
             "{\"job_id\":\"%s\",\"card\":{\"number\":\"%s\",\"brand\":\"visa\"},"
             "\"account\":{\"iban\":\"DE89370400440532013000\"}}",
             key, card);
    {
        /* with a trace context: its trace id is shown with the attempts,
         * as it is (no masking rule applies to it) */
        json_t *h = json_pack("{s:s}", "traceparent", "00-" TRACE_ID "-00f067aa0ba902b7-01");
        itest_publish_to(&t, t.conf->inputs[0].exchange, t.conf->inputs[0].routing_key, body, h,
                         NULL);
        json_decref(h);
    }
    itest_run_until_idle(&t, 2);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1", key), 1);
    itest_text(&t, "SELECT reason FROM idemq.parked WHERE key = $1", key, buf, sizeof buf);
    ck_assert_msg(strstr(buf, "card *** declined") && !strstr(buf, card), "%s", buf);
    itest_text(&t, "SELECT coalesce(last_error, '') FROM idemq.job_info($1)", key, buf,
               sizeof buf);
    ck_assert_msg(!strstr(buf, card), "%s", buf);
    snprintf(sql, sizeof sql, "jobs show '%s'", key);
    ck_assert_int_eq(itest_idemq(&t, sql, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "***") && !strstr(out, card), "%s", out);
    ck_assert_msg(strstr(out, "trace " TRACE_ID), "no trace id in jobs show: %s", out);
    snprintf(sql, sizeof sql, "parked list --key '%s'", key);
    ck_assert_int_eq(itest_idemq(&t, sql, out, sizeof out), 0);
    ck_assert_msg(strstr(out, key) && !strstr(out, card), "%.4000s", out);
    itest_text(&t, "SELECT id FROM idemq.parked WHERE key = $1", key, id, sizeof id);

    pid = itest_spawn(&t, t.cfg_path, 60, NULL);
    snprintf(url, sizeof url, "http://127.0.0.1:%d/groups", port);
    wait_console(url);
    snprintf(url, sizeof url, "http://127.0.0.1:%d/park?id=%s", port, id);
    ck_assert_int_eq(curl_page(url, NULL, NULL, page, sizeof page), 200);
    ck_assert_msg(!strstr(page, card) && !strstr(page, "DE89370400440532013000"), "%s", page);
    ck_assert_msg(strstr(page, "&quot;number&quot;: &quot;***&quot;") ||
                      strstr(page, "\"number\": \"***\""),
                  "%s", page);
    ck_assert_msg(strstr(page, "visa"), "%s", page);
    snprintf(url, sizeof url, "http://127.0.0.1:%d/groups", port);
    ck_assert_int_eq(curl_page(url, NULL, NULL, page, sizeof page), 200);
    ck_assert_msg(!strstr(page, card), "%s", page);
    snprintf(url, sizeof url, "http://127.0.0.1:%d/key?k=%s", port, key);
    ck_assert_int_eq(curl_page(url, NULL, NULL, page, sizeof page), 200);
    ck_assert_msg(strstr(page, "trace " TRACE_ID) && !strstr(page, card),
                  "no trace id on the key's page: %.4000s", page);
    kill(pid, SIGTERM);
    rc = itest_wait(pid, itest_ms(15000));
    ck_assert_msg(rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) == 0, "status 0x%x", rc);
    itest_extra_conf = NULL;
    itest_teardown(&t);
    unlink(tokfile);
}
END_TEST

/* Writes a key file of 32 bytes (hex when hex) with mode. */
static void key_file(char *path, size_t len, const char *tag, unsigned char fill, bool hex,
                     mode_t mode)
{
    FILE *f;
    snprintf(path, len, "/tmp/idemq-key-%s-%d", tag, (int)getpid());
    unlink(path);
    ck_assert_ptr_nonnull(f = fopen(path, "w"));
    for (int i = 0; i < 32; i++)
        hex ? fprintf(f, "%02x", fill + i) : fputc(fill + i, f);
    if (hex)
        fputc('\n', f);
    fclose(f);
    ck_assert_int_eq(chmod(path, mode), 0);
}

/* The console page of the park of key into page; returns the status. */
static int park_page(struct itest *t, int port, const char *key, char *page, size_t len)
{
    char id[32], url[160];
    itest_text(t, "SELECT id FROM idemq.parked WHERE key = $1", key, id, sizeof id);
    snprintf(url, sizeof url, "http://127.0.0.1:%d/park?id=%s", port, id);
    return curl_page(url, NULL, NULL, page, len);
}

/*
 * Parked bodies sealed at rest: with protection.active = k1 a parked body
 * holds no byte of the message in idemq.parked (ciphertext under k1, the
 * hash and size of the message itself); the console opens it; redrive
 * applies it once. Rotation: k2 active, k1 still listed: new parks are
 * sealed with k2, old ones still open. k1 no longer listed: its copy is
 * reported (console, `parked list` count), never shown or dropped. A key
 * file others may read is refused at startup.
 */
START_TEST(test_sealed_parks)
{
    struct itest t;
    char extra[1024], k1[128], k2[128], url[160], key1[200], key2[200], body[512], out[1 << 16];
    char buf[256];
    static char page[1 << 21];
    int port = itest_free_port(), rc;
    pid_t pid;
    const char *card = "4111111111111111";

    key_file(k1, sizeof k1, "k1", 0x10, true, 0600);
    key_file(k2, sizeof k2, "k2", 0x40, false, 0400);
    snprintf(extra, sizeof extra,
             "console: { listen = \"127.0.0.1:%d\"; };\n"
             "protection: { keys = [ \"k1=%s\" ]; active = \"k1\"; };",
             port, k1);
    itest_extra_conf = extra;
    itest_setup(&t, "sealed", "idemq_test.record", "", "");
    snprintf(key1, sizeof key1, "%s:k1", t.name);
    snprintf(body, sizeof body,
             "{\"job_id\":\"%s\",\"raise\":\"IP001\",\"raise_until\":1,"
             "\"card\":{\"number\":\"%s\",\"brand\":\"visa\"}}",
             key1, card);
    itest_publish(&t, (const char *[]){body}, 1);
    itest_run_until_idle(&t, 2);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1 AND "
                                    "body_key = 'k1'", key1), 1);
    ck_assert_int_eq(itest_long(&t,
                                "SELECT count(*) FROM idemq.parked WHERE key = $1 AND "
                                "(position('\\x34313131'::bytea IN body) > 0 OR "
                                "position(convert_to('visa', 'UTF8') IN body) > 0 OR "
                                "position(convert_to('job_id', 'UTF8') IN body) > 0)",
                                key1),
                     0);
    {
        char sql[1024];
        snprintf(sql, sizeof sql,
                 "SELECT count(*) FROM idemq.parked WHERE key = $1 AND payload_sha256 = "
                 "encode(sha256(convert_to('%s', 'UTF8')), 'hex') AND body_size = %zu AND "
                 "octet_length(body) = %zu",
                 body, strlen(body), strlen(body) + 28);
        ck_assert_int_eq(itest_long(&t, sql, key1), 1);
    }
    pid = itest_spawn(&t, t.cfg_path, 60, NULL);
    snprintf(url, sizeof url, "http://127.0.0.1:%d/groups", port);
    wait_console(url);
    ck_assert_int_eq(park_page(&t, port, key1, page, sizeof page), 200);
    ck_assert_msg(strstr(page, card) && strstr(page, "visa"), "%s", page);
    kill(pid, SIGTERM);
    rc = itest_wait(pid, itest_ms(15000));
    ck_assert_msg(rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) == 0, "status 0x%x", rc);

    /* rotation: k2 seals new parks, k1 still opens the old one */
    snprintf(extra, sizeof extra,
             "console: { listen = \"127.0.0.1:%d\"; };\n"
             "protection: { keys = [ \"k1=%s\", \"k2=%s\" ]; active = \"k2\"; };",
             port, k1, k2);
    itest_write_config(&t, t.cfg_path, t.name, "idemq_test.record", "", "");
    snprintf(key2, sizeof key2, "%s:k2", t.name);
    snprintf(body, sizeof body,
             "{\"job_id\":\"%s\",\"raise\":\"IP001\",\"card\":{\"number\":\"%s\"}}", key2, card);
    itest_publish(&t, (const char *[]){body}, 1);
    itest_run_until_idle(&t, 2);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1 AND "
                                    "body_key = 'k2'", key2), 1);
    pid = itest_spawn(&t, t.cfg_path, 60, NULL);
    wait_console(url);
    ck_assert_int_eq(park_page(&t, port, key1, page, sizeof page), 200);
    ck_assert_msg(strstr(page, "visa"), "%s", page);
    ck_assert_int_eq(park_page(&t, port, key2, page, sizeof page), 200);
    ck_assert_msg(strstr(page, card), "%s", page);
    kill(pid, SIGTERM);
    rc = itest_wait(pid, itest_ms(15000));
    ck_assert_msg(rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) == 0, "status 0x%x", rc);

    /* redrive (from the dead-letter queue): applied once */
    snprintf(buf, sizeof buf, "redrive --key '%s'", key1);
    ck_assert_int_eq(itest_idemq(&t, buf, out, sizeof out), 0);
    itest_run_until_idle(&t, 2);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key1), 1);
    itest_run_until_idle(&t, 1);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key1), 1);

    /* k1 gone: its copy (now in the history) is reported, k2's still opens */
    snprintf(extra, sizeof extra,
             "console: { listen = \"127.0.0.1:%d\"; };\n"
             "protection: { keys = [ \"k2=%s\" ]; active = \"k2\"; };",
             port, k2);
    itest_write_config(&t, t.cfg_path, t.name, "idemq_test.record", "", "");
    snprintf(buf, sizeof buf, "parked list --key '%s'", key1);
    ck_assert_int_eq(itest_idemq(&t, buf, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "cannot be opened): 1"), "%s", out);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.park_history WHERE key = $1 "
                                    "AND park->>'body_key' = 'k1'", key1), 1);
    /* an open park whose key is gone: said so on its page */
    {
        char sql[512];
        snprintf(sql, sizeof sql, "UPDATE idemq.parked SET body_key = 'k9' WHERE key = '%s'",
                 key2);
        itest_sql(&t, sql);
    }
    pid = itest_spawn(&t, t.cfg_path, 60, NULL);
    wait_console(url);
    ck_assert_int_eq(park_page(&t, port, key2, page, sizeof page), 200);
    ck_assert_msg(strstr(page, "sealed with key k9") && strstr(page, "not configured") &&
                      !strstr(page, card),
                  "%s", page);
    kill(pid, SIGTERM);
    rc = itest_wait(pid, itest_ms(15000));
    ck_assert_msg(rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) == 0, "status 0x%x", rc);
    snprintf(buf, sizeof buf, "parked list --key '%s'", key2);
    ck_assert_int_eq(itest_idemq(&t, buf, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "cannot be opened): 1"), "%s", out);

    /* a key file others may read: refused, naming the file, not the key */
    ck_assert_int_eq(chmod(k2, 0644), 0);
    rc = itest_idemq(&t, "check-config", out, sizeof out);
    ck_assert_msg(rc != 0 && strstr(out, "chmod 600") && strstr(out, k2), "%d %s", rc, out);
    /* the copies no listed key opens would show in other tests' lists */
    snprintf(buf, sizeof buf, "DELETE FROM idemq.parked WHERE key LIKE '%s:%%'", t.name);
    itest_sql(&t, buf);
    snprintf(buf, sizeof buf, "DELETE FROM idemq.park_history WHERE key LIKE '%s:%%'", t.name);
    itest_sql(&t, buf);
    itest_extra_conf = NULL;
    itest_teardown(&t);
    unlink(k1);
    unlink(k2);
}
END_TEST

/*
 * idemq erase KEY --why TEXT: the park's body, headers and properties are
 * gone from the ledger (open and resolved parks), the audit facts stay
 * (hash, size, state, reason), the park is no longer redrivable from the
 * ledger, and the action is recorded (who, why) and shown by jobs show. A
 * key still in flight is refused.
 */
START_TEST(test_erase_key)
{
    struct itest t;
    char key[200], body[512], out[1 << 16], args[400], sha[80], sql[512];

    itest_setup(&t, "erase", "idemq_test.record", "", "");
    snprintf(key, sizeof key, "%s:e1", t.name);
    snprintf(body, sizeof body,
             "{\"job_id\":\"%s\",\"raise\":\"IP001\",\"name\":\"Erika Mustermann\"}", key);
    itest_publish(&t, (const char *[]){body}, 1);
    itest_run_until_idle(&t, 2);
    itest_text(&t, "SELECT payload_sha256 FROM idemq.parked WHERE key = $1", key, sha,
               sizeof sha);
    ck_assert_int_eq(strlen(sha), 64);
    snprintf(args, sizeof args, "erase '%s' --why 'data subject request 42'", key);
    ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "1 open park(s)"), "%s", out);
    snprintf(sql, sizeof sql,
             "SELECT count(*) FROM idemq.parked WHERE key = $1 AND octet_length(body) = 0 AND "
             "headers IS NULL AND properties IS NULL AND NOT redrivable AND body_size = %zu "
             "AND payload_sha256 = '%s' AND reason LIKE '%%requested failure%%'",
             strlen(body), sha);
    ck_assert_int_eq(itest_long(&t, sql, key), 1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key = $1 AND "
                                    "state = 'parked'", key), 1);
    ck_assert_int_eq(itest_long(&t,
                                "SELECT count(*) FROM idemq.operator_actions a JOIN "
                                "idemq.operator_action_keys k ON k.action_id = a.id WHERE "
                                "k.key = $1 AND a.action = 'erase' AND a.reason = "
                                "'data subject request 42' AND a.actor LIKE 'idemq erase (%'",
                                key),
                     1);
    snprintf(args, sizeof args, "jobs show '%s'", key);
    ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 0);
    ck_assert_msg(strstr(out, ": erase, park #") && strstr(out, "data subject request 42"), "%s",
                  out);
    /* a key in flight is refused, and nothing is recorded */
    snprintf(sql, sizeof sql, "UPDATE idemq.jobs SET state = 'retrying' WHERE key = '%s'", key);
    itest_sql(&t, sql);
    snprintf(args, sizeof args, "erase '%s' --why again", key);
    ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 2);
    ck_assert_msg(strstr(out, "is retrying"), "%s", out);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.operator_actions WHERE "
                                    "action = 'erase' AND selection = 'key ' || $1", key), 1);
    /* --why is required */
    snprintf(args, sizeof args, "erase '%s'", key);
    ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 2);
    itest_teardown(&t);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("console");
    TCase *tc = tcase_create("console");
    tcase_set_timeout(tc, 180);
    tcase_add_test(tc, test_console_browser);
    tcase_add_test(tc, test_console_remote_read);
    suite_add_tcase(s, tc);
    tc = tcase_create("host");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_console_foreign_host);
    tcase_add_test(tc, test_console_reads_need_token);
    tcase_add_test(tc, test_console_token_file_refused);
    tcase_add_test(tc, test_console_operator_broker_url);
    tcase_add_test(tc, test_console_slow_clients);
    tcase_add_test(tc, test_console_least_privilege);
    suite_add_tcase(s, tc);
    tc = tcase_create("mask");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_console_masks_sensitive);
    tcase_add_test(tc, test_sealed_parks);
    tcase_add_test(tc, test_erase_key);
    suite_add_tcase(s, tc);
    /* least-privilege mode (scripts/test): these again, as the deployment's roles */
    itest_lp_tcase(s, (const TTest *const[]){test_console_browser, NULL});
    return check_run(s);
}
