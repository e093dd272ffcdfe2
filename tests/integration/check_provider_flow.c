/* Provider effects below the worker loop: consumer/provider_flow,
 * the reconciler's sweep and idemq resolve against a real PostgreSQL and the
 * real idemq-test-provider, driven by a broker-less stand-in for the
 * worker: a decision RETRY or WAIT "redelivers" the job after its delay. */
#include <check.h>

#include "check_run.h"
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "conf.h"
#include "effect_http.h"
#include "job.h"
#include "ledger_db.h"
#include "ledger_grants.h"
#include "ledger_migrate.h"
#include "ledger_provider.h"
#include "ledger_txn.h"
#include "protect.h"
#include "provider_flow.h"
#include "reconcile.h"
#include "seal.h"
#include "tprov.h"

static struct {
    PGconn *db;
    struct conf *c;
    struct tprov p;
    struct provider_flow *f;
    char prefix[64];
} T;

static int mult(void)
{
    const char *m = getenv("IDEMQ_TEST_TIMEOUT_MULT");
    return m && atoi(m) > 0 ? atoi(m) : 1;
}

static void sql(const char *q)
{
    PGresult *r = PQexec(T.db, q);
    ck_assert_msg(PQresultStatus(r) == PGRES_COMMAND_OK || PQresultStatus(r) == PGRES_TUPLES_OK,
                  "%s\n%s", PQerrorMessage(T.db), q);
    PQclear(r);
}

/* First column of the first row as text ("" for NULL or no row). */
static char *val(const char *q, const char *p1, char *buf, size_t len)
{
    const char *params[1] = {p1};
    PGresult *r = PQexecParams(T.db, q, p1 ? 1 : 0, NULL, params, NULL, NULL, 0);
    ck_assert_msg(PQresultStatus(r) == PGRES_TUPLES_OK, "%s\n%s", PQerrorMessage(T.db), q);
    snprintf(buf, len, "%s", PQntuples(r) && !PQgetisnull(r, 0, 0) ? PQgetvalue(r, 0, 0) : "");
    PQclear(r);
    return buf;
}

/* A redrive as idemq's dead-letter copy carries it: the park's generation,
 * sealed with the ledger's secret (consumer/seal.h). */
static void redrive_headers(json_t *h, const char *key, int generation)
{
    char secret[300];
    ck_assert(seal_set_secret_hex(
        val("SELECT secret::text FROM idemq.redrive_seal WHERE id = 1", NULL, secret,
            sizeof secret)));
    json_object_set_new(h, "x-idemq-generation", json_integer(generation));
    ck_assert(seal_put_park(h, key));
}

static long num(const char *q, const char *p1)
{
    char b[64];
    return atol(val(q, p1, b, sizeof b));
}

static char *slurp(const char *path)
{
    FILE *fp = fopen(path, "rb");
    char *buf;
    long n;
    ck_assert_ptr_nonnull(fp);
    fseek(fp, 0, SEEK_END);
    n = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    buf = calloc(1, (size_t)n + 1);
    ck_assert_int_eq(fread(buf, 1, (size_t)n, fp), n);
    fclose(fp);
    return buf;
}

/* (Re)loads T.c and a new flow for one provider input of the running
 * provider configured with the extra provider lines; effect = the SQL
 * effect or NULL. */
static const char *top_conf = ""; /* top-level settings configure adds */

static void configure(const char *extra, const char *effect)
{
    char text[4096], err[1024];

    provider_flow_free(T.f);
    conf_free(T.c);
    snprintf(text, sizeof text,
             "%sretry: { max_attempts = 4; base_delay_ms = 100; max_delay_ms = 2000; "
             "jitter = \"none\"; };\n"
             "consumer: { id = \"%s\"; };\n"
             "inputs = ( { name = \"%s\"; queue = \"%s.q\"; %s%s%s\n"
             "  provider: { url = \"%s\"; path = \"/charges\"; timeout_ms = %d; "
             "retry_after_max_ms = 2000; %s %s }; } );\n",
             top_conf, T.prefix, T.prefix, T.prefix, effect ? "effect_function = \"" : "",
             effect ? effect : "",
             effect ? "\";" : "", T.p.url, 3000 * mult(),
             extra && strstr(extra, "reconcile_after_s") ? "" : "reconcile_after_s = 60;",
             extra ? extra : "");
    ck_assert_msg(conf_load_string(text, &T.c, err, sizeof err) == IDEMQ_OK, "%s\n%s", err, text);
    T.f = provider_flow_new(T.c, 0, err, sizeof err);
    ck_assert_msg(T.f != NULL, "%s", err);
}

/* Starts the provider (args) and a flow for one provider input configured
 * with the extra provider lines; effect = the SQL effect or NULL. */
static void setup_with(const char *const *prov_args, const char *extra, const char *effect)
{
    char err[1024];
    int applied;
    struct timespec ts;
    static int seq;

    ck_assert_msg(getenv("IDEMQ_PG_DSN"), "IDEMQ_PG_DSN must point at a real PostgreSQL");
    memset(&T, 0, sizeof T);
    clock_gettime(CLOCK_REALTIME, &ts);
    snprintf(T.prefix, sizeof T.prefix, "pf%d-%ld-%d", (int)getpid(),
             (long)(ts.tv_nsec / 1000) % 100000, seq++);
    T.db = ledger_db_connect(getenv("IDEMQ_PG_DSN"), "check_provider_flow", 0, err, sizeof err);
    ck_assert_msg(T.db != NULL, "%s", err);
    sql("SET client_min_messages = warning");
    ck_assert_msg(ledger_migrate_run(T.db, &applied, err, sizeof err) == IDEMQ_OK, "%s", err);
    sql("SELECT pg_advisory_lock(4242)");
    {
        char *s = slurp(IDEMQ_SOURCE_DIR "/tests/integration/effects.sql");
        sql(s);
        free(s);
    }
    sql("SELECT pg_advisory_unlock(4242)");
    tprov_start(&T.p, prov_args);
    configure(extra, effect);
}

static void setup(void) { setup_with(NULL, NULL, "idemq_test.record"); }

static void teardown(void)
{
    provider_flow_free(T.f);
    tprov_stop(&T.p);
    conf_free(T.c);
    PQfinish(T.db);
    memset(&T, 0, sizeof T);
}

/* A decoded delivery of the provider input: key K (prefixed), payload
 * extra fields. */
static void make_job(struct job *j, const char *k, const char *fields, char *key, size_t keylen)
{
    char body[1024];
    snprintf(key, keylen, "%s-%s", T.prefix, k);
    snprintf(body, sizeof body, "{\"job_id\":\"%s\",\"amount_minor\":500%s%s}", key,
             fields ? "," : "", fields ? fields : "");
    job_init(j);
    ck_assert_int_eq(job_set_body(j, body, strlen(body)), IDEMQ_OK);
    j->input = 0;
    j->tag = 7;
    snprintf(j->exchange, sizeof j->exchange, "x");
    snprintf(j->routing_key, sizeof j->routing_key, "rk");
    ck_assert_int_eq(job_decode(j, &T.c->inputs[0]), IDEMQ_OK);
}

/* Delivers j once and waits for its decision. */
static void deliver(struct job *j, struct provider_decision *d)
{
    int n = 0;
    ck_assert_int_eq(provider_flow_start(T.f, T.db, j, j), IDEMQ_OK);
    for (int i = 0; i < 600 * mult() && n == 0; i++)
        n = provider_flow_poll(T.f, T.db, 50, d, 1);
    ck_assert_msg(n == 1, "no decision for %s", j->key);
    ck_assert_ptr_eq(d->cookie, j);
}

/* Lets the time a decision asked for pass, as the delay bucket would. */
static void nap_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Redelivers j after every RETRY/WAIT (waiting its delay, at most cap_ms)
 * until ACK or PARK; returns the final decision, counts the rounds. */
static void settle(struct job *j, struct provider_decision *d, int *rounds, long cap_ms)
{
    *rounds = 0;
    for (;;) {
        deliver(j, d);
        (*rounds)++;
        ck_assert_msg(*rounds < 30, "no settlement for %s", j->key);
        if (d->kind != PROVIDER_FLOW_RETRY && d->kind != PROVIDER_FLOW_WAIT)
            return;
        nap_ms(d->delay_ms < cap_ms ? d->delay_ms : cap_ms);
        provider_flow_decision_clear(d);
    }
}

/* Delivers j until its decision is not WAIT (its next step is due),
 * waiting each delay asked for, a bounded number of rounds. */
static void deliver_due(struct job *j, struct provider_decision *d)
{
    for (int round = 0;; round++) {
        deliver(j, d);
        if (d->kind != PROVIDER_FLOW_WAIT)
            return;
        ck_assert_msg(round < 30, "%s still waits", j->key);
        nap_ms(d->delay_ms);
        provider_flow_decision_clear(d);
    }
}

/* Runs one statement with key as $1 and checks it changed one row. */
static void on_key(const char *q, const char *key)
{
    const char *p[1] = {key};
    PGresult *r = PQexecParams(T.db, q, 1, NULL, p, NULL, NULL, 0);
    ck_assert_msg(PQresultStatus(r) == PGRES_COMMAND_OK, "%s\n%s", PQerrorMessage(T.db), q);
    ck_assert_str_eq(PQcmdTuples(r), "1");
    PQclear(r);
}

/* A redrive of j's park (generation gen in x-idemq-generation), as idemq
 * redrive publishes it. */
static void make_redrive(struct job *r, const struct job *j, int gen)
{
    job_init(r);
    ck_assert_int_eq(job_set_body(r, j->body, j->body_len), IDEMQ_OK);
    r->input = j->input;
    redrive_headers(r->headers, j->key, gen);
    ck_assert_int_eq(job_decode(r, &T.c->inputs[j->input]), IDEMQ_OK);
}

#define JOB_STATE "SELECT state FROM idemq.jobs WHERE key = $1"
#define INTENT_STATE "SELECT state FROM idemq.intents WHERE key = $1"
#define INTENT_REF "SELECT provider_ref FROM idemq.intents WHERE key = $1"
#define EFFECTS "SELECT count(*) FROM idemq_test.effects WHERE key = $1"

/* The plain path: one call, the reference stored, the SQL effect run once
 * with the answer in meta.provider; a duplicate sends nothing. */
START_TEST(test_applied_then_duplicate)
{
    struct job j;
    struct provider_decision d;
    char key[300], b[512];

    make_job(&j, "plain", NULL, key, sizeof key);
    deliver(&j, &d);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_ACK);
    ck_assert_str_eq(d.outcome, "applied");
    ck_assert_str_eq(val(JOB_STATE, key, b, sizeof b), "applied");
    ck_assert_str_eq(val(INTENT_STATE, key, b, sizeof b), "applied");
    ck_assert_str_eq(val(INTENT_REF, key, b, sizeof b), "ch_000001");
    ck_assert_int_eq(num(EFFECTS, key), 1);
    ck_assert_str_eq(val("SELECT meta->'provider'->>'reference' FROM idemq_test.effects "
                         "WHERE key = $1", key, b, sizeof b), "ch_000001");
    ck_assert_str_eq(val("SELECT meta->'provider'->'answer'->>'status' FROM idemq_test.effects "
                         "WHERE key = $1", key, b, sizeof b), "201");
    ck_assert_int_eq(num("SELECT count(*) FROM idemq.attempts WHERE key = $1 AND outcome = "
                         "'provider_request'", key), 1);
    provider_flow_decision_clear(&d);
    deliver(&j, &d);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_ACK);
    ck_assert_str_eq(d.outcome, "duplicate");
    ck_assert_int_eq(tprov_stat(&T.p, NULL, "requests"), 1);
    ck_assert_int_eq(tprov_stat(&T.p, key, "key_charges"), 1);
    ck_assert_int_eq(num(EFFECTS, key), 1);
    provider_flow_decision_clear(&d);
    ck_assert_int_eq(provider_flow_pending(T.f), 0);
    job_destroy(&j);
}
END_TEST

/* Issue test 1 at the flow level: the provider applies the charge, the
 * answer is lost; the retry goes out under the same key and the provider
 * holds exactly one charge; the ledger its reference. */
START_TEST(test_lost_answer_resent_same_key)
{
    struct job j;
    struct provider_decision d;
    char key[300], b[512];
    int rounds;

    make_job(&j, "lost", NULL, key, sizeof key);
    tprov_control(&T.p, "{\"fault\":\"drop\",\"count\":1}");
    deliver(&j, &d);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_RETRY);
    ck_assert_str_eq(val(JOB_STATE, key, b, sizeof b), "provider_unknown");
    ck_assert_str_eq(val(INTENT_STATE, key, b, sizeof b), "unknown");
    ck_assert_int_eq(tprov_stat(&T.p, key, "key_charges"), 1);
    nap_ms(d.delay_ms);
    provider_flow_decision_clear(&d);
    settle(&j, &d, &rounds, 3000);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_ACK);
    ck_assert_str_eq(d.outcome, "applied");
    ck_assert_int_eq(tprov_stat(&T.p, key, "key_charges"), 1);
    ck_assert_int_eq(tprov_stat(&T.p, NULL, "requests"), 2); /* the same key twice */
    ck_assert_str_eq(val(INTENT_REF, key, b, sizeof b), "ch_000001");
    ck_assert_int_eq(num(EFFECTS, key), 1);
    ck_assert_int_eq(num("SELECT count(*) FROM idemq.attempts WHERE key = $1 AND outcome = "
                         "'provider_unknown'", key), 1);
    provider_flow_decision_clear(&d);
    job_destroy(&j);
}
END_TEST

/* With a lookup route the unknown outcome is settled by asking, not by
 * resending: the provider's existing reference is adopted. */
START_TEST(test_lost_answer_looked_up)
{
    struct job j;
    struct provider_decision d;
    char key[300], b[512];
    int rounds;

    teardown();
    setup_with(NULL, "lookup_key_path = \"/charges/by-idempotency-key/{key}\";",
               "idemq_test.record");
    make_job(&j, "lookup", NULL, key, sizeof key);
    tprov_control(&T.p, "{\"fault\":\"drop\",\"count\":1}");
    deliver(&j, &d);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_RETRY);
    nap_ms(d.delay_ms);
    provider_flow_decision_clear(&d);
    settle(&j, &d, &rounds, 3000);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_ACK);
    ck_assert_int_eq(tprov_stat(&T.p, NULL, "requests"), 1); /* POSTs: never resent */
    ck_assert_int_eq(tprov_stat(&T.p, key, "key_charges"), 1);
    ck_assert_str_eq(val(INTENT_REF, key, b, sizeof b), "ch_000001");
    ck_assert_int_eq(num("SELECT count(*) FROM idemq.attempts WHERE key = $1 AND outcome = "
                         "'provider_lookup' AND message LIKE '%found provider reference%'", key),
                     1);
    ck_assert_str_eq(val("SELECT meta->'provider'->>'how' FROM idemq_test.effects WHERE key = $1",
                         key, b, sizeof b), "lookup by key");
    provider_flow_decision_clear(&d);
    job_destroy(&j);
}
END_TEST

/* Issue test 3: 5xx for a while (nothing applied), then applied once; a 502
 * after applying is an unknown outcome settled by the same key. */
START_TEST(test_5xx_then_recovers)
{
    struct job j, k;
    struct provider_decision d;
    char key[300], key2[300];
    int rounds;

    make_job(&j, "5xx", NULL, key, sizeof key);
    tprov_control(&T.p, "{\"fault\":\"status=503\",\"count\":2}");
    settle(&j, &d, &rounds, 3000);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_ACK);
    ck_assert_int_eq(rounds, 3);
    ck_assert_int_eq(tprov_stat(&T.p, key, "key_charges"), 1);
    ck_assert_int_eq(num(EFFECTS, key), 1);
    provider_flow_decision_clear(&d);

    make_job(&k, "502", NULL, key2, sizeof key2);
    tprov_control(&T.p, "{\"fault\":\"status_after=502\",\"count\":1}");
    settle(&k, &d, &rounds, 3000);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_ACK);
    ck_assert_int_eq(rounds, 2);
    ck_assert_int_eq(tprov_stat(&T.p, key2, "key_charges"), 1);
    provider_flow_decision_clear(&d);
    job_destroy(&j);
    job_destroy(&k);
}
END_TEST

/* Issue test 4: a 4xx parks after one attempt, the answer kept; a copy
 * sends nothing. */
START_TEST(test_4xx_parks_with_response)
{
    struct job j;
    struct provider_decision d;
    char key[300], b[512];

    make_job(&j, "4xx", NULL, key, sizeof key);
    tprov_control(&T.p, "{\"fault\":\"status=400\",\"count\":1}");
    deliver(&j, &d);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_PARK);
    ck_assert_ptr_nonnull(d.park);
    ck_assert_str_eq(json_string_value(json_object_get(d.park, "error_code")),
                     "provider_rejected");
    ck_assert_str_eq(json_string_value(json_object_get(d.park, "error_class")), "permanent");
    ck_assert_ptr_nonnull(strstr(json_string_value(json_object_get(d.park, "reason")),
                                 "HTTP 400"));
    ck_assert_str_eq(val(JOB_STATE, key, b, sizeof b), "parked");
    ck_assert_str_eq(val(INTENT_STATE, key, b, sizeof b), "rejected");
    ck_assert_str_eq(val("SELECT last_response->>'status' FROM idemq.intents WHERE key = $1",
                         key, b, sizeof b), "400");
    ck_assert_str_eq(val("SELECT convert_from(body, 'UTF8') FROM idemq.parked WHERE key = $1",
                         key, b, sizeof b), (const char *)j.body);
    provider_flow_decision_clear(&d);
    deliver(&j, &d); /* a copy: the park is re-published (not confirmed yet), nothing sent */
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_PARK);
    ck_assert_int_eq(tprov_stat(&T.p, NULL, "requests"), 1);
    ck_assert_int_eq(num(EFFECTS, key), 0);
    provider_flow_decision_clear(&d);
    job_destroy(&j);
}
END_TEST

/* Issue test 5: 429 with Retry-After: the retry is not earlier than asked;
 * past provider.retry_after_max_ms the job parks. */
START_TEST(test_429_retry_after)
{
    struct job j, k;
    struct provider_decision d;
    char key[300], key2[300], b[512];
    int rounds;

    make_job(&j, "429", NULL, key, sizeof key);
    tprov_control(&T.p, "{\"fault\":\"rate=2\",\"count\":1}");
    deliver(&j, &d);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_RETRY);
    ck_assert_int_ge(d.delay_ms, 2000);
    ck_assert_int_ge(num("SELECT (extract(epoch FROM run_after - last_attempt_at) * 1000)::int "
                         "FROM idemq.jobs WHERE key = $1", key), 1990);
    provider_flow_decision_clear(&d);
    deliver(&j, &d); /* back too early: waits the rest, sends nothing */
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_WAIT);
    ck_assert_int_eq(tprov_stat(&T.p, NULL, "requests"), 1);
    nap_ms(d.delay_ms);
    provider_flow_decision_clear(&d);
    settle(&j, &d, &rounds, 3000);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_ACK);
    ck_assert_int_eq(tprov_stat(&T.p, key, "key_charges"), 1);
    provider_flow_decision_clear(&d);

    make_job(&k, "429long", NULL, key2, sizeof key2);
    tprov_control(&T.p, "{\"fault\":\"rate=30\",\"count\":1}");
    deliver(&k, &d);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_PARK);
    ck_assert_str_eq(json_string_value(json_object_get(d.park, "error_code")),
                     "provider_rate_limited");
    ck_assert_str_eq(val(INTENT_STATE, key2, b, sizeof b), "not_applied");
    provider_flow_decision_clear(&d);
    job_destroy(&j);
    job_destroy(&k);
}
END_TEST

/* A request of another client holds the key at the provider. */
static pid_t concurrent_post(const char *key, const char *body, int latency_ms)
{
    pid_t pid;
    fflush(NULL);
    pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        char h1[400], h2[64], out[256];
        const char *hs[] = {h1, h2, NULL};
        snprintf(h1, sizeof h1, "Idempotency-Key: %s", key);
        snprintf(h2, sizeof h2, "X-Test-Fault: latency=%d", latency_ms);
        _exit(tprov_http(&T.p, "POST", "/charges", body, hs, out, sizeof out) == 201 ? 0 : 1);
    }
    return pid;
}

/* Issue test 7: 409 while the key is in flight at the provider -> retried
 * later with the same key, one charge; another body under the key (422) ->
 * parked, never resent. A second copy inside idemq waits for the lease. */
START_TEST(test_409_and_422)
{
    struct job j, k, copy;
    struct provider_decision d, d2;
    char key[300], key2[300];
    int rounds, st;
    pid_t other;

    make_job(&j, "409", NULL, key, sizeof key);
    other = concurrent_post(key, (const char *)j.body, 1500 * mult());
    for (int i = 0; i < 200 && tprov_stat(&T.p, NULL, "requests") < 1; i++)
        nap_ms(10);
    deliver(&j, &d);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_RETRY);
    ck_assert_int_eq(num("SELECT waits FROM idemq.intents WHERE key = $1", key), 1);
    provider_flow_decision_clear(&d);
    ck_assert_int_eq(waitpid(other, &st, 0), other);
    ck_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    settle(&j, &d, &rounds, 3000);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_ACK);
    ck_assert_int_eq(tprov_stat(&T.p, key, "key_charges"), 1);
    provider_flow_decision_clear(&d);

    /* 422: the provider knows the key with another body */
    make_job(&k, "422", NULL, key2, sizeof key2);
    other = concurrent_post(key2, "{\"other\":true}", 0);
    ck_assert_int_eq(waitpid(other, &st, 0), other);
    deliver(&k, &d);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_PARK);
    ck_assert_str_eq(json_string_value(json_object_get(d.park, "error_code")),
                     "provider_rejected");
    ck_assert_ptr_nonnull(strstr(json_string_value(json_object_get(d.park, "reason")),
                                 "HTTP 422"));
    provider_flow_decision_clear(&d);
    {
        long before = tprov_stat(&T.p, NULL, "requests");
        deliver(&k, &d);
        ck_assert_int_eq(tprov_stat(&T.p, NULL, "requests"), before); /* never resent */
        provider_flow_decision_clear(&d);
    }

    /* two copies inside idemq: the second waits for the first's lease */
    make_job(&copy, "copies", NULL, key2, sizeof key2);
    tprov_control(&T.p, "{\"fault\":\"latency=800\",\"count\":1}");
    ck_assert_int_eq(provider_flow_start(T.f, T.db, &copy, "first"), IDEMQ_OK);
    ck_assert_int_eq(provider_flow_start(T.f, T.db, &copy, "second"), IDEMQ_OK);
    ck_assert_int_eq(provider_flow_poll(T.f, T.db, 0, &d, 1), 1);
    ck_assert_str_eq((const char *)d.cookie, "second");
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_WAIT);
    ck_assert_int_ge(d.delay_ms, 3000 * mult());
    for (int i = 0; i < 300 && provider_flow_poll(T.f, T.db, 50, &d2, 1) == 0; i++)
        ;
    ck_assert_str_eq((const char *)d2.cookie, "first");
    ck_assert_int_eq(d2.kind, PROVIDER_FLOW_ACK);
    ck_assert_int_eq(tprov_stat(&T.p, key2, "key_charges"), 1);
    provider_flow_decision_clear(&d);
    provider_flow_decision_clear(&d2);
    job_destroy(&j);
    job_destroy(&k);
    job_destroy(&copy);
}
END_TEST

/* Issue test 8: an intent older than the provider's key window is not
 * resent blindly: parked with a clear class when nothing can look it up. */
START_TEST(test_key_window_not_resent)
{
    struct job j;
    struct provider_decision d;
    char key[300], b[512];

    make_job(&j, "window", NULL, key, sizeof key);
    tprov_control(&T.p, "{\"fault\":\"drop\",\"count\":1}");
    deliver(&j, &d);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_RETRY);
    provider_flow_decision_clear(&d);
    /* a day and more later (the default window is 86400 s) */
    {
        const char *p[1] = {key};
        PGresult *r = PQexecParams(T.db,
                                   "UPDATE idemq.intents SET first_request_at = first_request_at "
                                   "- interval '2 days', run_after = now() WHERE key = $1",
                                   1, NULL, p, NULL, NULL, 0);
        ck_assert_int_eq(PQresultStatus(r), PGRES_COMMAND_OK);
        PQclear(r);
    }
    deliver(&j, &d);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_PARK);
    ck_assert_str_eq(json_string_value(json_object_get(d.park, "error_code")),
                     "key_window_expired");
    ck_assert_str_eq(json_string_value(json_object_get(d.park, "error_class")),
                     "unknown_outcome");
    ck_assert_int_eq(tprov_stat(&T.p, NULL, "requests"), 1);
    ck_assert_str_eq(val(INTENT_STATE, key, b, sizeof b), "parked");
    provider_flow_decision_clear(&d);
    job_destroy(&j);
}
END_TEST

/* Past the key window, a lookup by client reference still settles it. */
START_TEST(test_key_window_reference_lookup)
{
    struct job j;
    struct provider_decision d;
    char key[300];

    teardown();
    setup_with(NULL,
               "body_template = \"{\\\"reference\\\": {{key}}, \\\"amount\\\": "
               "{{payload.amount_minor}}}\"; lookup_key_path = "
               "\"/charges/by-idempotency-key/{key}\"; lookup_reference_path = "
               "\"/charges?reference={key}\";",
               "idemq_test.record");
    make_job(&j, "window-ref", NULL, key, sizeof key);
    tprov_control(&T.p, "{\"fault\":\"drop\",\"count\":1}");
    deliver(&j, &d);
    provider_flow_decision_clear(&d);
    {
        const char *p[1] = {key};
        PGresult *r = PQexecParams(T.db,
                                   "UPDATE idemq.intents SET first_request_at = first_request_at "
                                   "- interval '2 days', run_after = now() WHERE key = $1",
                                   1, NULL, p, NULL, NULL, 0);
        PQclear(r);
    }
    tprov_control(&T.p, "{\"expire_keys\":true}"); /* the provider forgot the key */
    deliver(&j, &d);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_ACK);
    ck_assert_str_eq(d.outcome, "applied");
    ck_assert_int_eq(tprov_stat(&T.p, NULL, "requests"), 1);
    ck_assert_int_eq(num("SELECT count(*) FROM idemq.attempts WHERE key = $1 AND message LIKE "
                         "'looking up by reference%'", key), 1);
    provider_flow_decision_clear(&d);
    job_destroy(&j);
}
END_TEST

/* Issue test 9: a provider without keys drops the connection after
 * charging: never charged twice; parked unknown_outcome, then settled by
 * idemq resolve (here its ledger function). */
START_TEST(test_non_idempotent_parks_unknown)
{
    const char *args[] = {"--non-idempotent", NULL};
    struct job j;
    struct provider_decision d;
    char key[300], b[512], prior[32], opts_err[8];
    struct ledger_db_error e;
    char *opts;

    teardown();
    setup_with(args, "idempotent = false;", "idemq_test.record");
    make_job(&j, "nonidem", NULL, key, sizeof key);
    tprov_control(&T.p, "{\"fault\":\"drop\",\"count\":1}");
    deliver(&j, &d);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_PARK);
    ck_assert_str_eq(json_string_value(json_object_get(d.park, "error_class")),
                     "unknown_outcome");
    ck_assert_int_eq(tprov_stat(&T.p, key, "key_charges"), 1);
    provider_flow_decision_clear(&d);
    deliver(&j, &d); /* a copy: never resent */
    ck_assert_int_eq(tprov_stat(&T.p, NULL, "requests"), 1);
    provider_flow_decision_clear(&d);
    (void)opts_err;
    opts = ledger_provider_opts(T.c, 0);
    ck_assert_int_eq(ledger_provider_resolve(T.db, key, "applied", "ch_000001", "tester",
                                             "found it in the provider dashboard", opts, NULL,
                                             0, prior, sizeof prior, &e),
                     IDEMQ_OK);
    ck_assert_str_eq(prior, "parked");
    ck_assert_str_eq(val(JOB_STATE, key, b, sizeof b), "applied");
    ck_assert_str_eq(val(INTENT_REF, key, b, sizeof b), "ch_000001");
    ck_assert_int_eq(num(EFFECTS, key), 1);
    ck_assert_str_eq(val("SELECT resolved_by || ': ' || reason FROM idemq.resolutions "
                         "WHERE key = $1", key, b, sizeof b),
                     "tester: found it in the provider dashboard");
    ck_assert_int_eq(ledger_provider_resolve(T.db, key, "discard", NULL, "tester", "again",
                                             opts, NULL, 0, prior, sizeof prior, &e),
                     IDEMQ_ERR_SQL); /* applied: nothing to resolve */
    free(opts);
    provider_flow_decision_clear(&d);
    job_destroy(&j);
}
END_TEST

/* Issue test 9 with a lookup by client reference: reconciled, one charge. */
START_TEST(test_non_idempotent_reference_lookup)
{
    const char *args[] = {"--non-idempotent", NULL};
    struct job j;
    struct provider_decision d;
    char key[300];
    int rounds;

    teardown();
    setup_with(args,
               "idempotent = false; lookup_reference_path = \"/charges?reference={key}\"; "
               "body_template = \"{\\\"reference\\\": {{key}}}\";",
               "idemq_test.record");
    make_job(&j, "nonidem-ref", NULL, key, sizeof key);
    tprov_control(&T.p, "{\"fault\":\"drop\",\"count\":1}");
    settle(&j, &d, &rounds, 3000);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_ACK);
    ck_assert_int_eq(tprov_stat(&T.p, key, "key_charges"), 1);
    ck_assert_int_eq(tprov_stat(&T.p, NULL, "requests"), 1);
    provider_flow_decision_clear(&d);

    /* the request never reached it (5xx before applying): no record ->
     * never resent by idemq, parked no_record after the deadline */
    {
        struct job k;
        char key2[300], b[512];
        const char *p[1] = {key2};
        make_job(&k, "nonidem-none", NULL, key2, sizeof key2);
        tprov_control(&T.p, "{\"fault\":\"status=503\",\"count\":1}");
        deliver(&k, &d);
        ck_assert_int_eq(d.kind, PROVIDER_FLOW_RETRY);
        provider_flow_decision_clear(&d);
        nap_ms(300);
        deliver(&k, &d); /* looked up: no record yet, before the deadline */
        ck_assert_int_eq(d.kind, PROVIDER_FLOW_RETRY);
        provider_flow_decision_clear(&d);
        PQclear(PQexecParams(T.db,
                             "UPDATE idemq.intents SET last_request_at = last_request_at - "
                             "interval '1 hour', run_after = now() WHERE key = $1",
                             1, NULL, p, NULL, NULL, 0));
        deliver(&k, &d);
        ck_assert_int_eq(d.kind, PROVIDER_FLOW_PARK);
        ck_assert_str_eq(json_string_value(json_object_get(d.park, "error_class")), "no_record");
        ck_assert_str_eq(val(INTENT_STATE, key2, b, sizeof b), "not_applied");
        ck_assert_int_eq(tprov_stat(&T.p, key2, "key_charges"), 0);
        ck_assert_int_eq(tprov_stat(&T.p, NULL, "requests"), 2);
        provider_flow_decision_clear(&d);
        job_destroy(&k);
    }
    job_destroy(&j);
}
END_TEST

/* A key that cannot be an Idempotency-Key header is parked with a named
 * code and never sent. */
START_TEST(test_invalid_header_key_parked)
{
    struct job j;
    struct provider_decision d;
    const char *body = "{\"job_id\":\"bad\\r\\nX-Evil: 1\",\"amount_minor\":5}";

    job_init(&j);
    ck_assert_int_eq(job_set_body(&j, body, strlen(body)), IDEMQ_OK);
    j.input = 0;
    ck_assert_int_eq(job_decode(&j, &T.c->inputs[0]), IDEMQ_OK);
    deliver(&j, &d);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_PARK);
    ck_assert_str_eq(d.outcome, "key_invalid_header");
    ck_assert_str_eq(json_string_value(json_object_get(d.park, "error_code")),
                     "key_invalid_header");
    ck_assert_int_eq(tprov_stat(&T.p, NULL, "requests"), 0);
    provider_flow_decision_clear(&d);
    job_destroy(&j);
}
END_TEST

/* The provider confirmed, the local effect failed transiently: the retry
 * runs the effect again with the recorded reference, no new request. A
 * permanent effect error parks with the reference in the reason. */
START_TEST(test_local_effect_failure)
{
    struct job j, k;
    struct provider_decision d;
    char key[300], key2[300], q[512];
    int rounds;

    make_job(&j, "effect", NULL, key, sizeof key);
    snprintf(q, sizeof q, "INSERT INTO idemq_test.failing VALUES ('%s', '40001')", key);
    sql(q);
    deliver(&j, &d);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_RETRY);
    ck_assert_int_eq(num("SELECT count(*) FROM idemq.intents WHERE key = $1 AND state = "
                         "'confirmed' AND provider_ref = 'ch_000001'", key), 1);
    provider_flow_decision_clear(&d);
    snprintf(q, sizeof q, "DELETE FROM idemq_test.failing WHERE key = '%s'", key);
    sql(q);
    settle(&j, &d, &rounds, 3000);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_ACK);
    ck_assert_int_eq(num(EFFECTS, key), 1);
    ck_assert_int_eq(tprov_stat(&T.p, NULL, "requests"), 1);
    provider_flow_decision_clear(&d);

    make_job(&k, "effect-perm", "\"raise\":\"22023\"", key2, sizeof key2);
    deliver(&k, &d);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_PARK);
    ck_assert_str_eq(json_string_value(json_object_get(d.park, "error_class")), "permanent");
    ck_assert_ptr_nonnull(strstr(json_string_value(json_object_get(d.park, "reason")),
                                 "provider reference ch_000002 is recorded"));
    ck_assert_str_eq(json_string_value(json_object_get(d.park, "sqlstate")), "22023");
    provider_flow_decision_clear(&d);
    job_destroy(&j);
    job_destroy(&k);
}
END_TEST

/* Issue test 2 at the flow level: the worker dies between the provider's
 * answer and transaction 2 (here: the flow is abandoned while the provider
 * holds its answer after charging). The redelivery waits for the lease,
 * then the ledger counts an unknown outcome and converges on the one
 * reference. */
START_TEST(test_crash_between_call_and_commit)
{
    struct job j;
    struct provider_decision d;
    char key[300], b[512];
    const char *p[1] = {key};
    int rounds;

    make_job(&j, "crash", NULL, key, sizeof key);
    tprov_control(&T.p, "{\"fault\":\"hold=1500\",\"count\":1}");
    ck_assert_int_eq(provider_flow_start(T.f, T.db, &j, &j), IDEMQ_OK);
    for (int i = 0; i < 100 && tprov_stat(&T.p, key, "key_charges") == 0; i++)
        ck_assert_int_eq(provider_flow_poll(T.f, T.db, 20, &d, 1), 0); /* sends it */
    ck_assert_int_eq(tprov_stat(&T.p, key, "key_charges"), 1);
    provider_flow_abandon(T.f); /* the crash: its request is cut off */
    ck_assert_int_eq(provider_flow_pending(T.f), 0);
    ck_assert_str_eq(val(INTENT_STATE, key, b, sizeof b), "pending");
    deliver(&j, &d); /* the redelivery: the lease still holds */
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_WAIT);
    provider_flow_decision_clear(&d);
    /* let the lease run out (as the delay bucket would wait for it) */
    PQclear(PQexecParams(T.db, "UPDATE idemq.intents SET lease_until = now() WHERE key = $1", 1,
                         NULL, p, NULL, NULL, 0));
    nap_ms(1600); /* the held answer is over at the provider */
    settle(&j, &d, &rounds, 3000);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_ACK);
    ck_assert_int_eq(tprov_stat(&T.p, key, "key_charges"), 1);
    ck_assert_str_eq(val(INTENT_REF, key, b, sizeof b), "ch_000001");
    ck_assert_int_eq(num("SELECT count(*) FROM idemq.attempts WHERE key = $1 AND error_code = "
                         "'lease_expired'", key), 1);
    ck_assert_int_eq(num(EFFECTS, key), 1);
    provider_flow_decision_clear(&d);
    job_destroy(&j);
}
END_TEST

/* The per-input cap: jobs over provider.max_in_flight wait in the flow, no
 * lease taken, and start as slots free. */
START_TEST(test_in_flight_cap)
{
    struct job js[3];
    struct provider_decision d[3];
    char keys[3][300];
    int n = 0;

    teardown();
    setup_with(NULL, "max_in_flight = 1;", NULL);
    tprov_control(&T.p, "{\"fault\":\"latency=300\",\"count\":3}");
    for (int i = 0; i < 3; i++) {
        char name[16];
        snprintf(name, sizeof name, "cap%d", i);
        make_job(&js[i], name, NULL, keys[i], sizeof keys[i]);
        ck_assert_int_eq(provider_flow_start(T.f, T.db, &js[i], &js[i]), IDEMQ_OK);
    }
    ck_assert_int_eq(num("SELECT count(*) FROM idemq.intents WHERE key LIKE $1 || '%'",
                         T.prefix), 1);
    ck_assert_int_eq(provider_flow_pending(T.f), 3);
    for (int i = 0; i < 600 && n < 3; i++)
        n += provider_flow_poll(T.f, T.db, 50, d + n, 3 - n);
    ck_assert_int_eq(n, 3);
    for (int i = 0; i < 3; i++) {
        ck_assert_int_eq(d[i].kind, PROVIDER_FLOW_ACK);
        ck_assert_int_eq(tprov_stat(&T.p, keys[i], "key_charges"), 1);
        provider_flow_decision_clear(&d[i]);
        job_destroy(&js[i]);
    }
    /* no SQL effect configured: the job's result is the reference */
    ck_assert_int_eq(num("SELECT count(*) FROM idemq.jobs WHERE key LIKE $1 || '%' AND "
                         "result ? 'provider_reference'", T.prefix), 3);
}
END_TEST

/* ---- the reconciler and the operator commands ---- */

/* Pretends the intent's request went out long ago and no one came back:
 * its lease ran out and nothing has happened for hours. */
static void age_intent(const char *key)
{
    const char *p[1] = {key};
    PGresult *r = PQexecParams(T.db,
                               "UPDATE idemq.intents SET lease_until = least(lease_until, "
                               "now() - interval '1 s'), last_request_at = last_request_at - "
                               "interval '2 hours', updated_at = now() - interval '2 hours', "
                               "run_after = least(run_after, now() - interval '2 hours') "
                               "WHERE key = $1",
                               1, NULL, p, NULL, NULL, 0);
    ck_assert_int_eq(PQresultStatus(r), PGRES_COMMAND_OK);
    ck_assert_str_eq(PQcmdTuples(r), "1");
    PQclear(r);
}

/* Runs the sweep until it has nothing in flight. */
static struct reconcile_counts sweep(void)
{
    struct reconcile_counts n;
    struct ledger_db_error e;
    char err[512];
    struct reconcile_sweep *s = reconcile_sweep_new(T.c, "check_provider_flow reconciler", NULL,
                                                    err, sizeof err);
    ck_assert_msg(s != NULL, "%s", err);
    memset(&n, 0, sizeof n);
    for (int i = 0; i < 100; i++) {
        ck_assert_msg(reconcile_sweep_step(s, T.db, 0, 200, &n, &e) == IDEMQ_OK, "%s %s",
                      e.sqlstate, e.message);
        if (!reconcile_sweep_busy(s))
            break;
    }
    ck_assert(!reconcile_sweep_busy(s));
    reconcile_sweep_free(s);
    return n;
}

/* Leaves a key pending at the provider's side: the call was made (the
 * provider holds the answer after charging when hold), then the worker
 * vanished with the message. */
static void orphan_call(struct job *j, const char *fault)
{
    struct provider_decision d;
    char ctl[128];
    snprintf(ctl, sizeof ctl, "{\"fault\":\"%s\",\"count\":1}", fault);
    tprov_control(&T.p, ctl);
    ck_assert_int_eq(provider_flow_start(T.f, T.db, j, j), IDEMQ_OK);
    for (int i = 0; i < 100 && tprov_stat(&T.p, NULL, "requests") == 0; i++)
        ck_assert_int_eq(provider_flow_poll(T.f, T.db, 20, &d, 1), 0);
    provider_flow_abandon(T.f);
}

/* Issue test 6: a stale pending intent with no message left -> the sweep
 * reconciles it: looked up and converged on the one reference. */
START_TEST(test_sweep_stale_pending)
{
    struct job j;
    struct reconcile_counts n;
    char key[300], b[512];

    teardown();
    setup_with(NULL, "lookup_key_path = \"/charges/by-idempotency-key/{key}\";",
               "idemq_test.record");
    make_job(&j, "stale", NULL, key, sizeof key);
    orphan_call(&j, "hold=300");
    nap_ms(400);
    ck_assert_int_eq(tprov_stat(&T.p, key, "key_charges"), 1);
    n = sweep(); /* not overdue yet: nothing taken */
    ck_assert_int_eq(n.taken, 0);
    age_intent(key);
    n = sweep();
    ck_assert_int_eq(n.taken, 1);
    ck_assert_int_eq(n.looked_up, 1);
    ck_assert_int_eq(n.applied, 1);
    ck_assert_str_eq(val(JOB_STATE, key, b, sizeof b), "applied");
    ck_assert_str_eq(val(INTENT_REF, key, b, sizeof b), "ch_000001");
    ck_assert_int_eq(num(EFFECTS, key), 1);
    ck_assert_int_eq(tprov_stat(&T.p, NULL, "requests"), 1);
    ck_assert_int_eq(num("SELECT count(*) FROM idemq.attempts WHERE key = $1 AND consumer_id = "
                         "'check_provider_flow reconciler'", key), 4);
    /* the message shows up after all: a duplicate */
    {
        struct provider_decision d;
        deliver(&j, &d);
        ck_assert_int_eq(d.kind, PROVIDER_FLOW_ACK);
        ck_assert_str_eq(d.outcome, "duplicate");
        provider_flow_decision_clear(&d);
    }
    job_destroy(&j);
}
END_TEST

/* Without a lookup, a provider that deduplicates is asked again under the
 * same key inside its window: the sweep resends the stored request. */
START_TEST(test_sweep_resends_same_key)
{
    struct job j;
    struct reconcile_counts n;
    char key[300], b[512];

    make_job(&j, "stale-resend", NULL, key, sizeof key);
    orphan_call(&j, "hold=200");
    nap_ms(300);
    age_intent(key);
    n = sweep();
    ck_assert_int_eq(n.resent, 1);
    ck_assert_int_eq(n.applied, 1);
    ck_assert_str_eq(val(JOB_STATE, key, b, sizeof b), "applied");
    ck_assert_int_eq(tprov_stat(&T.p, key, "key_charges"), 1);
    ck_assert_int_eq(tprov_stat(&T.p, NULL, "requests"), 2);
    job_destroy(&j);
}
END_TEST

/* Issue test 8 / the deadline: the provider has no record of a request of a
 * provider without keys: parked no_record; with no lookup and the key
 * window over: parked unknown_outcome. */
START_TEST(test_sweep_parks_no_record)
{
    const char *args[] = {"--non-idempotent", NULL};
    struct job j;
    struct provider_decision d;
    struct reconcile_counts n;
    char key[300], b[512];

    teardown();
    setup_with(args,
               "idempotent = false; lookup_reference_path = \"/charges?reference={key}\"; "
               "body_template = \"{\\\"reference\\\": {{key}}}\";",
               "idemq_test.record");
    make_job(&j, "norecord", NULL, key, sizeof key);
    tprov_control(&T.p, "{\"fault\":\"status=503\",\"count\":1}");
    deliver(&j, &d); /* unknown; the message is then lost */
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_RETRY);
    provider_flow_decision_clear(&d);
    age_intent(key);
    n = sweep();
    ck_assert_int_eq(n.looked_up, 1);
    ck_assert_int_eq(n.parked, 1);
    ck_assert_str_eq(val(JOB_STATE, key, b, sizeof b), "parked");
    ck_assert_str_eq(val("SELECT error_class || ' ' || error_code FROM idemq.parked WHERE "
                         "key = $1", key, b, sizeof b), "no_record provider_no_record");
    ck_assert_int_eq(tprov_stat(&T.p, NULL, "requests"), 1);
    ck_assert_int_eq(tprov_stat(&T.p, key, "key_charges"), 0);
    job_destroy(&j);

    teardown();
    setup();
    make_job(&j, "window-sweep", NULL, key, sizeof key);
    orphan_call(&j, "hold=200");
    nap_ms(300);
    age_intent(key);
    {
        const char *p[1] = {key};
        PQclear(PQexecParams(T.db, "UPDATE idemq.intents SET first_request_at = first_request_at"
                                   " - interval '2 days' WHERE key = $1",
                             1, NULL, p, NULL, NULL, 0));
    }
    n = sweep();
    ck_assert_int_eq(n.parked, 1);
    ck_assert_str_eq(val("SELECT error_class || ' ' || error_code FROM idemq.parked WHERE "
                         "key = $1", key, b, sizeof b), "unknown_outcome key_window_expired");
    ck_assert_int_eq(tprov_stat(&T.p, NULL, "requests"), 1); /* not resent */
    job_destroy(&j);
}
END_TEST

/* Runs the real idemq binary with a config for this test; output to out. */
static int idemq_cmd(const char *args, char *out, size_t outlen)
{
    char cfg[256], cmd[2048];
    FILE *fp;
    size_t n = 0;
    int st;
    snprintf(cfg, sizeof cfg, "/tmp/%s.cfg", T.prefix);
    fp = fopen(cfg, "w");
    ck_assert_ptr_nonnull(fp);
    conf_print(T.c, fp);
    fclose(fp);
    snprintf(cmd, sizeof cmd, "%s %s -c %s 2>&1", IDEMQ_BINARY, args, cfg);
    fp = popen(cmd, "r");
    ck_assert_ptr_nonnull(fp);
    while (n + 1 < outlen) {
        size_t r = fread(out + n, 1, outlen - n - 1, fp);
        if (!r)
            break;
        n += r;
    }
    out[n] = '\0';
    st = pclose(fp);
    unlink(cfg);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* idemq reconcile settles an overdue intent; idemq resolve --not-applied
 * makes a parked key redrivable (the redrive resends under the same key),
 * --discard makes a redrive a duplicate; jobs show tells the story. */
START_TEST(test_commands_reconcile_resolve_show)
{
    struct job j, k, r;
    struct provider_decision d;
    char key[300], key2[300], out[16384], args[512], b[512];

    make_job(&j, "cmd", NULL, key, sizeof key);
    orphan_call(&j, "hold=200");
    nap_ms(300);
    age_intent(key);
    ck_assert_int_eq(idemq_cmd("reconcile", out, sizeof out), 0);
    ck_assert_msg(strstr(out, "applied: converged on the provider's reference"), "%s", out);
    ck_assert_msg(strstr(out, "reconciled 1 intent: 1 applied"), "%s", out);
    ck_assert_str_eq(val(JOB_STATE, key, b, sizeof b), "applied");

    /* a 4xx park, settled by hand as not applied, then redriven */
    make_job(&k, "cmd-4xx", NULL, key2, sizeof key2);
    tprov_control(&T.p, "{\"fault\":\"status=402\",\"count\":1}");
    deliver(&k, &d);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_PARK);
    provider_flow_decision_clear(&d);
    snprintf(args, sizeof args, "resolve '%s' --not-applied", key2);
    ck_assert_int_eq(idemq_cmd(args, out, sizeof out), 2); /* no --reason */
    snprintf(args, sizeof args, "resolve '%s' --not-applied --reason 'card fixed, retry'", key2);
    ck_assert_msg(idemq_cmd(args, out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "not applied (intent was rejected)"), "%s", out);
    /* the redrive: the park's generation in x-idemq-generation */
    job_init(&r);
    ck_assert_int_eq(job_set_body(&r, k.body, k.body_len), IDEMQ_OK);
    r.input = 0;
    redrive_headers(r.headers, key2, 0);
    ck_assert_int_eq(job_decode(&r, &T.c->inputs[0]), IDEMQ_OK);
    deliver(&r, &d);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_ACK);
    ck_assert_str_eq(d.outcome, "applied");
    ck_assert_int_eq(tprov_stat(&T.p, key2, "key_charges"), 1);
    provider_flow_decision_clear(&d);
    snprintf(args, sizeof args, "jobs show '%s'", key2);
    ck_assert_int_eq(idemq_cmd(args, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "provider intent: applied"), "%s", out);
    ck_assert_msg(strstr(out, "resolution "), "%s", out);
    ck_assert_msg(strstr(out, "not_applied"), "%s", out);
    ck_assert_msg(strstr(out, "card fixed, retry"), "%s", out);
    ck_assert_msg(strstr(out, "redrive to generation 1"), "%s", out);
    ck_assert_msg(strstr(out, "provider_request"), "%s", out);
    /* resolve refuses what is not parked */
    snprintf(args, sizeof args, "resolve '%s' --discard --reason x", key2);
    ck_assert_int_eq(idemq_cmd(args, out, sizeof out), 1);
    ck_assert_msg(strstr(out, "not parked"), "%s", out);
    job_destroy(&j);
    job_destroy(&k);
    job_destroy(&r);
}
END_TEST

/* An uncertain park without any lookup is not redriven blindly: the
 * redrive goes back to the dead letters until an operator resolves it;
 * --discard turns later redrives into duplicates. */
START_TEST(test_uncertain_park_redrive_refused)
{
    const char *args[] = {"--non-idempotent", NULL};
    struct job j, r;
    struct provider_decision d;
    char key[300], cmd[512], out[4096];

    teardown();
    setup_with(args, "idempotent = false;", "idemq_test.record");
    make_job(&j, "uncertain", NULL, key, sizeof key);
    tprov_control(&T.p, "{\"fault\":\"drop\",\"count\":1}");
    deliver(&j, &d);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_PARK);
    provider_flow_decision_clear(&d);
    job_init(&r);
    ck_assert_int_eq(job_set_body(&r, j.body, j.body_len), IDEMQ_OK);
    r.input = 0;
    redrive_headers(r.headers, key, 0);
    ck_assert_int_eq(job_decode(&r, &T.c->inputs[0]), IDEMQ_OK);
    deliver(&r, &d);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_PARK);
    ck_assert_ptr_nonnull(strstr(d.reason, "idemq resolve"));
    ck_assert_int_eq(tprov_stat(&T.p, NULL, "requests"), 1);
    provider_flow_decision_clear(&d);
    snprintf(cmd, sizeof cmd, "resolve '%s' --discard --reason 'refunded by hand'", key);
    ck_assert_msg(idemq_cmd(cmd, out, sizeof out) == 0, "%s", out);
    deliver(&r, &d);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_ACK);
    ck_assert_str_eq(d.outcome, "duplicate");
    ck_assert_int_eq(tprov_stat(&T.p, NULL, "requests"), 1);
    provider_flow_decision_clear(&d);
    job_destroy(&j);
    job_destroy(&r);
}
END_TEST

/* The provider gauges: counts and ages of unsettled intents and the
 * request -> confirmation latency, in a form promtool accepts. */
START_TEST(test_gauges_promtool)
{
    struct job j, k;
    struct provider_decision d;
    struct ledger_db_error e;
    char key[300], key2[300], text[8192], path[128], cmd[256];
    FILE *fp;

    make_job(&j, "gauge-ok", NULL, key, sizeof key);
    deliver(&j, &d);
    provider_flow_decision_clear(&d);
    make_job(&k, "gauge-unknown", NULL, key2, sizeof key2);
    tprov_control(&T.p, "{\"fault\":\"status=503\",\"count\":1}");
    deliver(&k, &d);
    provider_flow_decision_clear(&d);
    ck_assert_int_eq(reconcile_gauges_refresh(T.db, T.c, &e), IDEMQ_OK);
    reconcile_metrics_render(text, sizeof text);
    ck_assert_int_eq(strncmp(text, "# HELP", 6), 0);
    ck_assert_ptr_nonnull(strstr(text, "stat=\"max\"}")); /* all of it fits: one input */
    {
        char want[256];
        snprintf(want, sizeof want, "idemq_provider_intents{input=\"%s\",state=\"unknown\"} 1",
                 T.prefix);
        ck_assert_msg(strstr(text, want), "no %s in the rendered gauges", want);
        snprintf(want, sizeof want,
                 "idemq_provider_confirm_latency_seconds{input=\"%s\",stat=\"p50\"}", T.prefix);
        ck_assert_msg(strstr(text, want), "no %s in the rendered gauges", want);
        snprintf(want, sizeof want, "idemq_provider_confirmed_recent{input=\"%s\"} 1", T.prefix);
        ck_assert_msg(strstr(text, want), "no %s in the rendered gauges", want);
    }
    snprintf(path, sizeof path, "/tmp/%s.prom", T.prefix);
    fp = fopen(path, "w");
    ck_assert_ptr_nonnull(fp);
    fputs(text, fp);
    fclose(fp);
    snprintf(cmd, sizeof cmd, "promtool check metrics < %s", path);
    ck_assert_msg(system(cmd) == 0, "promtool rejects %s", path);
    /* a small buffer: whole lines or nothing, still valid */
    {
        char small[300];
        size_t n = reconcile_metrics_render(small, sizeof small);
        ck_assert_uint_gt(n, 0);
        ck_assert_uint_lt(n, sizeof small);
        ck_assert_int_eq(small[n - 1], '\n');
    }
    unlink(path);
    job_destroy(&j);
    job_destroy(&k);
}
END_TEST

/* a 4xx to the resend of an uncertain request proves nothing about the
 * first one: the key parks as unknown_outcome (not rejected), stays
 * uncertain, and a redrive after the provider's key window is refused
 * instead of starting a new window (a second charge). */
START_TEST(test_4xx_after_unknown_stays_uncertain)
{
    struct job j, r;
    struct provider_decision d;
    char key[300], b[512];

    make_job(&j, "d1", NULL, key, sizeof key);
    tprov_control(&T.p, "{\"fault\":\"drop\",\"count\":1}"); /* charged, answer lost */
    deliver(&j, &d);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_RETRY);
    nap_ms(d.delay_ms);
    provider_flow_decision_clear(&d);
    tprov_control(&T.p, "{\"fault\":\"status=401\",\"count\":1}"); /* the resend: 401 */
    deliver(&j, &d);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_PARK);
    ck_assert_str_eq(json_string_value(json_object_get(d.park, "error_class")),
                     "unknown_outcome");
    ck_assert_str_eq(val(INTENT_STATE, key, b, sizeof b), "parked");
    ck_assert_str_eq(val("SELECT uncertain FROM idemq.intents WHERE key = $1", key, b, sizeof b),
                     "t");
    provider_flow_decision_clear(&d);
    /* the key window passes; the provider forgets the key */
    on_key("UPDATE idemq.intents SET first_request_at = first_request_at - interval '2 days' "
           "WHERE key = $1", key);
    tprov_control(&T.p, "{\"expire_keys\":true}");
    make_redrive(&r, &j, 0);
    deliver(&r, &d);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_PARK);
    ck_assert_int_eq(tprov_stat(&T.p, NULL, "requests"), 2);
    ck_assert_int_eq(tprov_stat(&T.p, key, "key_charges"), 1);
    provider_flow_decision_clear(&d);
    job_destroy(&j);
    job_destroy(&r);
}
END_TEST

/* a redrive of a parked provider key closes its open park (moved to
 * idemq.park_history, like a SQL key's), so parked list no longer shows an
 * applied key. */
START_TEST(test_redrive_closes_park)
{
    struct job j, r;
    struct provider_decision d;
    char key[300], b[512];

    make_job(&j, "d8", NULL, key, sizeof key);
    tprov_control(&T.p, "{\"fault\":\"status=402\",\"count\":1}");
    deliver(&j, &d);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_PARK);
    provider_flow_decision_clear(&d);
    ck_assert_int_eq(num("SELECT count(*) FROM idemq.parked WHERE key = $1", key), 1);
    make_redrive(&r, &j, 0);
    deliver(&r, &d);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_ACK);
    ck_assert_str_eq(d.outcome, "applied");
    provider_flow_decision_clear(&d);
    ck_assert_int_eq(num("SELECT count(*) FROM idemq.parked WHERE key = $1", key), 0);
    ck_assert_str_eq(val("SELECT resolution FROM idemq.park_history WHERE key = $1", key, b,
                         sizeof b), "redriven to generation 1");
    job_destroy(&j);
    job_destroy(&r);
}
END_TEST

/* a second, different reference while the intent is confirmed (two
 * requests answered, the local effect not committed yet) never replaces
 * the first: it is recorded as a CHECK THE PROVIDER alarm. */
START_TEST(test_second_reference_while_confirmed)
{
    struct job j;
    struct provider_decision d;
    struct ledger_provider_step s;
    struct ledger_db_error e;
    char key[300], b[512], q[512], *opts;
    int rounds;

    make_job(&j, "d15", NULL, key, sizeof key);
    snprintf(q, sizeof q, "INSERT INTO idemq_test.failing VALUES ('%s', '40001')", key);
    sql(q);
    deliver(&j, &d);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_RETRY);
    provider_flow_decision_clear(&d);
    ck_assert_str_eq(val(INTENT_STATE, key, b, sizeof b), "confirmed");
    ck_assert_str_eq(val(INTENT_REF, key, b, sizeof b), "ch_000001");
    /* the late success of another request of the key (another replica's) */
    opts = ledger_provider_opts(T.c, 0);
    memset(&s, 0, sizeof s);
    ck_assert_int_eq(ledger_provider_result(T.db, key, 1, "call", "success", 201,
                                            "{\"status\": 201, \"body\": {\"id\": \"ch_other\"}}",
                                            "ch_other", -1, "", opts, NULL, "check", true, &s, &e),
                     IDEMQ_OK);
    ledger_provider_step_clear(&s);
    free(opts);
    ck_assert_str_eq(val(INTENT_REF, key, b, sizeof b), "ch_000001");
    ck_assert_int_eq(num("SELECT count(*) FROM idemq.attempts WHERE key = $1 AND message LIKE "
                         "'%ch_other%CHECK THE PROVIDER FOR A SECOND CHARGE%'", key), 1);
    snprintf(q, sizeof q, "DELETE FROM idemq_test.failing WHERE key = '%s'", key);
    sql(q);
    settle(&j, &d, &rounds, 3000);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_ACK);
    ck_assert_str_eq(val("SELECT meta->'provider'->>'reference' FROM idemq_test.effects "
                         "WHERE key = $1", key, b, sizeof b), "ch_000001");
    ck_assert_str_eq(val(INTENT_REF, key, b, sizeof b), "ch_000001");
    provider_flow_decision_clear(&d);
    job_destroy(&j);
}
END_TEST

/* a 409 proves a request under the key is in progress: the intent
 * becomes uncertain. */
START_TEST(test_409_makes_uncertain)
{
    struct job j;
    struct provider_decision d;
    char key[300], b[512];
    int rounds, st;
    pid_t other;

    make_job(&j, "d12-409", NULL, key, sizeof key);
    other = concurrent_post(key, (const char *)j.body, 1500 * mult());
    for (int i = 0; i < 200 && tprov_stat(&T.p, NULL, "requests") < 1; i++)
        nap_ms(10);
    deliver(&j, &d);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_RETRY);
    ck_assert_str_eq(val("SELECT uncertain FROM idemq.intents WHERE key = $1", key, b, sizeof b),
                     "t");
    ck_assert_str_eq(val(INTENT_STATE, key, b, sizeof b), "unknown");
    provider_flow_decision_clear(&d);
    ck_assert_int_eq(waitpid(other, &st, 0), other);
    settle(&j, &d, &rounds, 3000);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_ACK);
    ck_assert_int_eq(tprov_stat(&T.p, key, "key_charges"), 1);
    provider_flow_decision_clear(&d);
    job_destroy(&j);
}
END_TEST

/* a lookup 404 cannot clear uncertainty while a request of the
 * generation may still be in flight (younger than its lease plus the call's
 * timeout); once older, it can (and the request goes out again, same key). */
START_TEST(test_lookup_404_young_request_stays_uncertain)
{
    struct job j;
    struct provider_decision d;
    char key[300], b[512];

    teardown();
    setup_with(NULL, "lookup_key_path = \"/charges/by-idempotency-key/{key}\";",
               "idemq_test.record");
    make_job(&j, "d12-404", NULL, key, sizeof key);
    tprov_control(&T.p, "{\"fault\":\"status=503\",\"count\":1}"); /* unknown, not applied */
    deliver(&j, &d);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_RETRY);
    nap_ms(d.delay_ms);
    provider_flow_decision_clear(&d);
    deliver(&j, &d); /* the lookup: 404, but the request is seconds old */
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_RETRY);
    ck_assert_int_ge(d.delay_ms, 1000);
    ck_assert_str_eq(val("SELECT uncertain FROM idemq.intents WHERE key = $1", key, b, sizeof b),
                     "t");
    ck_assert_int_eq(tprov_stat(&T.p, NULL, "requests"), 1);
    provider_flow_decision_clear(&d);
    /* the request is old now: the next 404 settles it, the resend applies */
    on_key("UPDATE idemq.intents SET last_request_at = last_request_at - interval '1 minute', "
           "run_after = now() WHERE key = $1", key);
    on_key("UPDATE idemq.jobs SET run_after = now() WHERE key = $1", key);
    deliver(&j, &d);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_ACK);
    ck_assert_str_eq(d.outcome, "applied");
    ck_assert_int_eq(tprov_stat(&T.p, NULL, "requests"), 2);
    ck_assert_int_eq(tprov_stat(&T.p, key, "key_charges"), 1);
    provider_flow_decision_clear(&d);
    job_destroy(&j);
}
END_TEST

/* values from the wire or the config that do not fit a parameter:
 * a Retry-After of 30 days parks provider_rate_limited (not a database
 * error); a reference longer than 255 bytes is a bad response, parked with
 * the answer kept, never cut. */
START_TEST(test_oversized_wire_values)
{
    struct job j, k;
    struct provider_decision d;
    char key[300], key2[300], b[512], fields[400], ref[301];

    make_job(&j, "d4-rate", NULL, key, sizeof key);
    tprov_control(&T.p, "{\"fault\":\"rate=2592000\",\"count\":1}");
    deliver(&j, &d);
    ck_assert_msg(d.kind == PROVIDER_FLOW_PARK, "%s: %s", d.outcome, d.reason);
    ck_assert_str_eq(json_string_value(json_object_get(d.park, "error_code")),
                     "provider_rate_limited");
    provider_flow_decision_clear(&d);
    job_destroy(&j);

    teardown();
    setup_with(NULL,
               "reference_field = \"reference\"; body_template = \"{\\\"reference\\\": "
               "{{payload.ref}}}\";",
               "idemq_test.record");
    memset(ref, 'r', 300);
    ref[300] = '\0';
    snprintf(fields, sizeof fields, "\"ref\":\"%s\"", ref);
    make_job(&k, "d4-ref", fields, key2, sizeof key2);
    deliver(&k, &d);
    ck_assert_msg(d.kind == PROVIDER_FLOW_PARK, "%s: %s", d.outcome, d.reason);
    ck_assert_str_eq(json_string_value(json_object_get(d.park, "error_code")),
                     "provider_bad_response");
    ck_assert_str_eq(val(INTENT_REF, key2, b, sizeof b), "");
    ck_assert_int_eq(num("SELECT length(last_response->'body'->>'reference') FROM idemq.intents "
                         "WHERE key = $1", key2), 300);
    ck_assert_int_eq(num(EFFECTS, key2), 0);
    provider_flow_decision_clear(&d);
    job_destroy(&k);
}
END_TEST

/* a deadline more than 24.8 days ahead (reconcile_after_s up to 30
 * days) does not overflow the step's delay. */
START_TEST(test_far_deadline_delay)
{
    const char *args[] = {"--non-idempotent", NULL};
    struct job j;
    struct provider_decision d;
    char key[300];

    teardown();
    setup_with(args,
               "idempotent = false; lookup_reference_path = \"/charges?reference={key}\"; "
               "body_template = \"{\\\"reference\\\": {{key}}}\"; "
               "reconcile_after_s = 2592000;",
               "idemq_test.record");
    make_job(&j, "d4-deadline", NULL, key, sizeof key);
    tprov_control(&T.p, "{\"fault\":\"status=503\",\"count\":1}");
    deliver(&j, &d);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_RETRY);
    provider_flow_decision_clear(&d);
    on_key("UPDATE idemq.intents SET last_request_at = last_request_at - interval '1 minute', "
           "run_after = now() WHERE key = $1", key);
    on_key("UPDATE idemq.jobs SET run_after = now() WHERE key = $1", key);
    deliver(&j, &d); /* lookup: no record; the deadline is 30 days after the request */
    ck_assert_msg(d.kind == PROVIDER_FLOW_RETRY, "%s: %s", d.outcome, d.reason);
    ck_assert_int_gt(d.delay_ms, 86400L * 1000);
    provider_flow_decision_clear(&d);
    deliver(&j, &d); /* back early: waits the rest */
    ck_assert_msg(d.kind == PROVIDER_FLOW_WAIT, "%s: %s", d.outcome, d.reason);
    ck_assert_int_gt(d.delay_ms, 86400L * 1000);
    ck_assert_int_eq(tprov_stat(&T.p, NULL, "requests"), 1);
    provider_flow_decision_clear(&d);
    job_destroy(&j);
}
END_TEST

/* the provider's reference is durable before the local effect runs: a
 * statement timeout (57014) or an ASSERT (P0004) in the effect, which
 * PL/pgSQL's WHEN OTHERS does not catch, keeps the reference recorded; a
 * transient one retries only the effect (no new request), a permanent one
 * parks with the reference. */
START_TEST(test_effect_timeout_keeps_reference)
{
    struct job j, k;
    struct provider_decision d;
    char key[300], key2[300], b[512], q[512];
    int rounds;

    make_job(&j, "d5-57014", NULL, key, sizeof key);
    snprintf(q, sizeof q, "INSERT INTO idemq_test.failing VALUES ('%s', '57014')", key);
    sql(q);
    deliver(&j, &d);
    ck_assert_msg(d.kind == PROVIDER_FLOW_RETRY, "%s: %s", d.outcome, d.reason);
    ck_assert_str_eq(val(INTENT_STATE, key, b, sizeof b), "confirmed");
    ck_assert_str_eq(val(INTENT_REF, key, b, sizeof b), "ch_000001");
    provider_flow_decision_clear(&d);
    snprintf(q, sizeof q, "DELETE FROM idemq_test.failing WHERE key = '%s'", key);
    sql(q);
    settle(&j, &d, &rounds, 3000);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_ACK);
    ck_assert_int_eq(num(EFFECTS, key), 1);
    ck_assert_int_eq(tprov_stat(&T.p, NULL, "requests"), 1); /* never sent again */
    ck_assert_str_eq(val("SELECT meta->'provider'->>'reference' FROM idemq_test.effects "
                         "WHERE key = $1", key, b, sizeof b), "ch_000001");
    provider_flow_decision_clear(&d);

    make_job(&k, "d5-assert", "\"raise\":\"P0004\"", key2, sizeof key2);
    deliver(&k, &d);
    ck_assert_msg(d.kind == PROVIDER_FLOW_PARK, "%s: %s", d.outcome, d.reason);
    ck_assert_str_eq(json_string_value(json_object_get(d.park, "error_class")), "permanent");
    ck_assert_ptr_nonnull(strstr(json_string_value(json_object_get(d.park, "reason")),
                                 "provider reference ch_000002 is recorded"));
    ck_assert_str_eq(val(INTENT_REF, key2, b, sizeof b), "ch_000002");
    ck_assert_int_eq(tprov_stat(&T.p, NULL, "requests"), 2);
    provider_flow_decision_clear(&d);
    job_destroy(&j);
    job_destroy(&k);
}
END_TEST

/* Applies one copy of key (a SQL input of its own, effect idemq_test.record)
 * in one transaction of a session of its own, as a worker's batch would;
 * returns its outcome and
 * the park's error_code in code ("" if none). */
static enum ledger_outcome sql_copy(const char *key, char *code, size_t codelen)
{
    struct conf *c;
    struct ledger_txn *lt;
    struct ledger_result res;
    struct ledger_db_error e;
    struct job j, *jp = &j;
    PGconn *db;
    char text[1024], err[512], body[400];
    enum ledger_outcome out;

    snprintf(text, sizeof text,
             "consumer: { id = \"%s-sql\"; };\n"
             "inputs = ( { name = \"%s-sql\"; queue = \"%s-sql.q\"; "
             "effect_function = \"idemq_test.record\"; } );\n",
             T.prefix, T.prefix, T.prefix);
    ck_assert_msg(conf_load_string(text, &c, err, sizeof err) == IDEMQ_OK, "%s", err);
    db = ledger_db_connect(getenv("IDEMQ_PG_DSN"), "check_provider_flow sql", 0, err, sizeof err);
    ck_assert_msg(db != NULL, "%s", err);
    lt = ledger_txn_new(db, c, err, sizeof err);
    ck_assert_msg(lt != NULL, "%s", err);
    snprintf(body, sizeof body, "{\"job_id\":\"%s\",\"amount_minor\":500}", key);
    job_init(&j);
    ck_assert_int_eq(job_set_body(&j, body, strlen(body)), IDEMQ_OK);
    j.input = 0;
    ck_assert_int_eq(job_decode(&j, &c->inputs[0]), IDEMQ_OK);
    memset(&res, 0, sizeof res);
    ck_assert_int_eq(ledger_txn_begin(lt, &e), IDEMQ_OK);
    ck_assert_msg(ledger_txn_apply(lt, &jp, 1, &res, &e) == IDEMQ_OK, "%s %s", e.sqlstate,
                  e.message);
    out = res.outcome;
    snprintf(code, codelen, "%s", "");
    if (out == LEDGER_CONFLICT) { /* what the worker's batch does with it */
        json_t *park = NULL;
        ck_assert_int_eq(ledger_txn_park_message(lt, &j, "key_conflict", res.message, true,
                                                 &park, &e),
                         IDEMQ_OK);
        snprintf(code, codelen, "%s",
                 json_string_value(json_object_get(park, "error_code")));
        json_decref(park);
    }
    ck_assert_int_eq(ledger_txn_commit(lt, &e), IDEMQ_OK);
    ledger_txn_result_clear(&res);
    ledger_txn_free(lt);
    PQfinish(db);
    job_destroy(&j);
    conf_free(c);
    return out;
}

/* a key held by a provider job is not a SQL input's to apply: the SQL
 * copy is a key_conflict (the provider job untouched, no effect); and the
 * reconciler never turns a job applied by another input back into a
 * provider state (parked key_conflict, nothing sent). */
START_TEST(test_cross_input_key_conflict)
{
    struct job j;
    struct reconcile_counts n;
    char key[300], b[512], code[64];
    long before;

    make_job(&j, "d10", NULL, key, sizeof key);
    orphan_call(&j, "hold=200"); /* charged; the worker vanished: intent pending */
    nap_ms(300);
    ck_assert_str_eq(val(JOB_STATE, key, b, sizeof b), "provider_pending");
    ck_assert_int_eq(sql_copy(key, code, sizeof code), LEDGER_CONFLICT);
    ck_assert_str_eq(code, "key_conflict");
    ck_assert_int_eq(num(EFFECTS, key), 0);
    ck_assert_str_eq(val(JOB_STATE, key, b, sizeof b), "provider_pending");

    /* a job applied by a SQL input while its intent was pending (before
     * this fix, or by hand): the sweep leaves the job alone */
    on_key("UPDATE idemq.jobs SET state = 'applied', applied_at = now() WHERE key = $1", key);
    age_intent(key);
    before = tprov_stat(&T.p, NULL, "requests");
    n = sweep();
    ck_assert_int_eq(n.parked, 1);
    ck_assert_str_eq(val(JOB_STATE, key, b, sizeof b), "applied");
    ck_assert_str_eq(val(INTENT_STATE, key, b, sizeof b), "parked");
    ck_assert_str_eq(val("SELECT error_code FROM idemq.parked WHERE key = $1", key, b, sizeof b),
                     "key_conflict");
    ck_assert_int_eq(tprov_stat(&T.p, NULL, "requests"), before);
    n = sweep(); /* settled: not taken again */
    ck_assert_int_eq(n.taken, 0);
    { /* the held answer arrives after all: its reference is recorded, nothing else moves */
        struct ledger_provider_step st;
        struct ledger_db_error e;
        char *opts = ledger_provider_opts(T.c, 0);
        memset(&st, 0, sizeof st);
        ck_assert_int_eq(ledger_provider_result(T.db, key, 1, "call", "success", 201,
                                                "{\"status\": 201}", "ch_000001", -1, "", opts,
                                                NULL, "check", true, &st, &e),
                         IDEMQ_OK);
        ck_assert_int_eq(st.action, LEDGER_PROVIDER_DUPLICATE);
        ledger_provider_step_clear(&st);
        free(opts);
        ck_assert_str_eq(val(INTENT_REF, key, b, sizeof b), "ch_000001");
        ck_assert_str_eq(val(INTENT_STATE, key, b, sizeof b), "parked");
        ck_assert_str_eq(val(JOB_STATE, key, b, sizeof b), "applied");
        ck_assert_int_eq(num(EFFECTS, key), 0);
    }
    job_destroy(&j);

    /* the other way round: a provider copy of a SQL input's unsettled key */
    {
        struct job k;
        struct provider_decision d;
        char key2[300];
        make_job(&k, "d10-sql", NULL, key2, sizeof key2);
        ck_assert_int_eq(sql_copy(key2, code, sizeof code), LEDGER_APPLIED);
        on_key("UPDATE idemq.jobs SET state = 'retrying' WHERE key = $1", key2);
        before = tprov_stat(&T.p, NULL, "requests");
        deliver(&k, &d);
        ck_assert_msg(d.kind == PROVIDER_FLOW_PARK, "%s: %s", d.outcome, d.reason);
        ck_assert_str_eq(json_string_value(json_object_get(d.park, "error_code")),
                         "key_conflict");
        ck_assert_str_eq(val(JOB_STATE, key2, b, sizeof b), "retrying");
        ck_assert_int_eq(tprov_stat(&T.p, NULL, "requests"), before);
        provider_flow_decision_clear(&d);
        job_destroy(&k);
    }
}
END_TEST

/* ---- the provider input's message sealed at rest (protection.active) ---- */

static struct protect *sealed_keys;
static char key_path[2][128];

/* Writes key file i (32 bytes as hex, mode 0600). */
static void write_key(int i, unsigned char fill)
{
    FILE *f;
    snprintf(key_path[i], sizeof key_path[i], "/tmp/%s.k%d", T.prefix, i + 1);
    ck_assert_ptr_nonnull(f = fopen(key_path[i], "w"));
    for (int b = 0; b < 32; b++)
        fprintf(f, "%02x", (unsigned char)(fill + b));
    fclose(f);
    ck_assert_int_eq(chmod(key_path[i], 0600), 0);
}

/* Reconfigures T with protection listing k1 and/or k2, active the last
 * listed, and makes those the process's keys. */
static void protect_with(bool k1, bool k2)
{
    static char top[700];
    char err[512];
    snprintf(top, sizeof top, "protection: { keys = [ %s%s%s%s%s%s%s ]; active = \"%s\"; };\n",
             k1 ? "\"k1=" : "", k1 ? key_path[0] : "", k1 ? "\"" : "", k1 && k2 ? ", " : "",
             k2 ? "\"k2=" : "", k2 ? key_path[1] : "", k2 ? "\"" : "", k2 ? "k2" : "k1");
    top_conf = top;
    configure(NULL, "idemq_test.record");
    protect_set_global(NULL);
    protect_free(sealed_keys);
    sealed_keys = NULL;
    ck_assert_msg(protect_load(T.c, &sealed_keys, err, sizeof err) == IDEMQ_OK, "%s", err);
    protect_set_global(sealed_keys);
}

/* The newest park of j's key holds j's message sealed with k1: no byte of
 * it in the clear, the message's own hash and size, and it opens to the
 * exact bytes. */
static void park_sealed(const struct job *j)
{
    char q[600], hex[8192];
    unsigned char *stored, *plain = NULL;
    size_t stored_len, plain_len = 0;
    snprintf(q, sizeof q,
             "SELECT count(*) FROM idemq.parked WHERE key = $1 AND body_key = 'k1' AND "
             "position('amount_minor'::bytea IN body) = 0 AND payload_sha256 = '%s' AND "
             "body_size = %zu AND octet_length(body) = %zu",
             j->sha256_hex, j->body_len, j->body_len + PROTECT_OVERHEAD);
    ck_assert_int_ge(num(q, j->key), 1);
    val("SELECT body FROM idemq.parked WHERE key = $1 ORDER BY id DESC LIMIT 1", j->key, hex,
        sizeof hex);
    ck_assert_ptr_nonnull(stored = PQunescapeBytea((const unsigned char *)hex, &stored_len));
    ck_assert_int_eq(protect_open(sealed_keys, "k1", stored, stored_len, &plain, &plain_len),
                     PROTECT_OPENED);
    ck_assert_int_eq(plain_len, j->body_len);
    ck_assert_int_eq(memcmp(plain, j->body, plain_len), 0);
    free(plain);
    PQfreemem(stored);
}

#define INTENT_SEALED                                                                       \
    "SELECT count(*) FROM idemq.intents WHERE key = $1 AND body_key = 'k1' AND "            \
    "position('amount_minor'::bytea IN body) = 0"
#define EFFECT_PAYLOAD                                                                      \
    "SELECT count(*) FROM idemq_test.effects WHERE key = $1 AND payload->>'job_id' = $1 "   \
    "AND payload->>'amount_minor' = '500'"

/* With protection.active, the message a provider input keeps with its
 * intent is sealed, and so is every park made from it (a 4xx, a key
 * conflict, a key that cannot be a header): the message's own hash and
 * size, opened for redrive. The local effect gets the opened message, from
 * the worker, the reconciler and idemq resolve; a process without its key
 * records the effect's attempt as failed, naming the key, and applies once
 * the key is listed again. */
START_TEST(test_sealed_message)
{
    struct job j, k, m, bad, c;
    struct provider_decision d;
    struct reconcile_counts n;
    char key[300], key2[300], key3[300], key4[300], q[512], out[8192], b[128];
    char body[400];
    int rounds;

    write_key(0, 0x31);
    write_key(1, 0x61);
    protect_with(true, false);

    /* a 4xx parks the sealed message */
    make_job(&j, "s-4xx", NULL, key, sizeof key);
    tprov_control(&T.p, "{\"fault\":\"status=400\",\"count\":1}");
    deliver(&j, &d);
    ck_assert_msg(d.kind == PROVIDER_FLOW_PARK, "%s: %s", d.outcome, d.reason);
    provider_flow_decision_clear(&d);
    ck_assert_int_eq(num(INTENT_SEALED, key), 1);
    park_sealed(&j);
    /* idemq resolve --applied runs the effect with the opened message */
    snprintf(q, sizeof q, "resolve '%s' --applied ch_manual --reason 'sealed test'", key);
    ck_assert_msg(idemq_cmd(q, out, sizeof out) == 0, "%s", out);
    ck_assert_int_eq(num(EFFECT_PAYLOAD, key), 1);

    /* confirmed, then the effect runs without k1: failed, naming the key */
    make_job(&k, "s-effect", NULL, key2, sizeof key2);
    snprintf(q, sizeof q, "INSERT INTO idemq_test.failing VALUES ('%s', '40001')", key2);
    sql(q);
    deliver(&k, &d);
    ck_assert_msg(d.kind == PROVIDER_FLOW_RETRY, "%s: %s", d.outcome, d.reason);
    ck_assert_str_eq(val(INTENT_STATE, key2, b, sizeof b), "confirmed");
    ck_assert_int_eq(num(INTENT_SEALED, key2), 1);
    provider_flow_decision_clear(&d);
    snprintf(q, sizeof q, "DELETE FROM idemq_test.failing WHERE key = '%s'", key2);
    sql(q);
    protect_with(false, true);
    deliver_due(&k, &d);
    ck_assert_msg(d.kind == PROVIDER_FLOW_RETRY, "%s: %s", d.outcome, d.reason);
    provider_flow_decision_clear(&d);
    ck_assert_int_eq(num(EFFECTS, key2), 0);
    ck_assert_int_eq(num("SELECT count(*) FROM idemq.attempts WHERE key = $1 AND outcome = "
                         "'transient_error' AND message LIKE '%sealed with key ''k1''%'", key2),
                     1);
    protect_with(true, true); /* k1 listed again (k2 active) */
    settle(&k, &d, &rounds, 3000);
    ck_assert_msg(d.kind == PROVIDER_FLOW_ACK, "%s: %s", d.outcome, d.reason);
    provider_flow_decision_clear(&d);
    ck_assert_int_eq(num(EFFECT_PAYLOAD, key2), 1);
    ck_assert_int_eq(tprov_stat(&T.p, NULL, "requests"), 2);

    /* the reconciler opens it too (no message at hand) */
    protect_with(true, false);
    make_job(&m, "s-sweep", NULL, key3, sizeof key3);
    snprintf(q, sizeof q, "INSERT INTO idemq_test.failing VALUES ('%s', '40001')", key3);
    sql(q);
    deliver(&m, &d);
    ck_assert_msg(d.kind == PROVIDER_FLOW_RETRY, "%s: %s", d.outcome, d.reason);
    provider_flow_decision_clear(&d);
    snprintf(q, sizeof q, "DELETE FROM idemq_test.failing WHERE key = '%s'", key3);
    sql(q);
    age_intent(key3);
    n = sweep();
    ck_assert_int_eq(n.applied, 1);
    ck_assert_int_eq(num(EFFECT_PAYLOAD, key3), 1);

    /* a key that cannot be a header parks its message sealed */
    snprintf(body, sizeof body, "{\"job_id\":\"%s-bad\\r\\nX: 1\",\"amount_minor\":5}",
             T.prefix);
    job_init(&bad);
    ck_assert_int_eq(job_set_body(&bad, body, strlen(body)), IDEMQ_OK);
    bad.input = 0;
    ck_assert_int_eq(job_decode(&bad, &T.c->inputs[0]), IDEMQ_OK);
    deliver(&bad, &d);
    ck_assert_str_eq(d.outcome, "key_invalid_header");
    provider_flow_decision_clear(&d);
    park_sealed(&bad);

    /* a provider copy of a SQL input's key parks its message sealed */
    make_job(&c, "s-conflict", NULL, key4, sizeof key4);
    ck_assert_int_eq(sql_copy(key4, b, sizeof b), LEDGER_APPLIED);
    on_key("UPDATE idemq.jobs SET state = 'retrying' WHERE key = $1", key4);
    deliver(&c, &d);
    ck_assert_str_eq(json_string_value(json_object_get(d.park, "error_code")), "key_conflict");
    provider_flow_decision_clear(&d);
    park_sealed(&c);

    protect_set_global(NULL);
    protect_free(sealed_keys);
    sealed_keys = NULL;
    top_conf = "";
    unlink(key_path[0]);
    unlink(key_path[1]);
    job_destroy(&j);
    job_destroy(&k);
    job_destroy(&m);
    job_destroy(&bad);
    job_destroy(&c);
}
END_TEST

/* The flow under the least-privileged role of idemq migrate --grant: the
 * reference and the local effect (transaction 2b, provider_confirmed) run
 * with the owner's rights, as every other provider function. */
START_TEST(test_flow_under_grant_role)
{
    struct job j;
    struct provider_decision d;
    char key[300], role[80], q[256], err[512], dsn[1024], *u;
    PGconn *owner = T.db, *db;

    snprintf(role, sizeof role, "%s_run", T.prefix);
    for (char *c = role; *c; c++)
        if (*c == '-')
            *c = '_';
    snprintf(q, sizeof q, "CREATE ROLE %s LOGIN", role);
    sql(q);
    ck_assert_msg(ledger_grants_apply(owner, T.c, role, err, sizeof err) == IDEMQ_OK, "%s", err);
    snprintf(dsn, sizeof dsn, "%s", getenv("IDEMQ_PG_DSN"));
    u = strstr(dsn, "user=");
    ck_assert_ptr_nonnull(u);
    snprintf(u, sizeof dsn - (size_t)(u - dsn), "user=%s", role);
    db = PQconnectdb(dsn);
    ck_assert_msg(PQstatus(db) == CONNECTION_OK, "%s", PQerrorMessage(db));

    make_job(&j, "grant", NULL, key, sizeof key);
    T.db = db; /* the flow's statements, as idemq run's */
    deliver(&j, &d);
    T.db = owner;
    ck_assert_msg(d.kind == PROVIDER_FLOW_ACK, "%s: %s", d.outcome, d.reason);
    ck_assert_str_eq(d.outcome, "applied");
    ck_assert_int_eq(num(EFFECTS, key), 1);
    provider_flow_decision_clear(&d);
    PQfinish(db);
    snprintf(q, sizeof q, "DROP OWNED BY %s; DROP ROLE %s", role, role);
    sql(q);
    job_destroy(&j);
}
END_TEST

/* D1 with a lookup route (added after the park): the redrive of the
 * uncertain key asks the provider about that key and adopts its charge,
 * instead of sending the request again. */
START_TEST(test_uncertain_redrive_looks_up)
{
    struct job j, r;
    struct provider_decision d;
    char key[300], b[512];

    make_job(&j, "d1-lookup", NULL, key, sizeof key);
    tprov_control(&T.p, "{\"fault\":\"drop\",\"count\":1}");
    deliver(&j, &d);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_RETRY);
    nap_ms(d.delay_ms);
    provider_flow_decision_clear(&d);
    tprov_control(&T.p, "{\"fault\":\"status=403\",\"count\":1}");
    deliver(&j, &d);
    ck_assert_int_eq(d.kind, PROVIDER_FLOW_PARK);
    provider_flow_decision_clear(&d);
    configure("lookup_key_path = \"/charges/by-idempotency-key/{key}\";", "idemq_test.record");
    make_redrive(&r, &j, 0);
    deliver(&r, &d);
    ck_assert_msg(d.kind == PROVIDER_FLOW_ACK, "%s: %s", d.outcome, d.reason);
    ck_assert_str_eq(d.outcome, "applied");
    ck_assert_int_eq(tprov_stat(&T.p, NULL, "requests"), 2); /* POSTs: no third one */
    ck_assert_int_eq(tprov_stat(&T.p, key, "key_charges"), 1);
    ck_assert_str_eq(val("SELECT meta->'provider'->>'how' FROM idemq_test.effects WHERE key = $1",
                         key, b, sizeof b), "lookup by key");
    provider_flow_decision_clear(&d);
    job_destroy(&j);
    job_destroy(&r);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("provider_flow");
    TCase *tc = tcase_create("flow");
    tcase_set_timeout(tc, 120 * mult());
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_add_test(tc, test_applied_then_duplicate);
    tcase_add_test(tc, test_lost_answer_resent_same_key);
    tcase_add_test(tc, test_lost_answer_looked_up);
    tcase_add_test(tc, test_5xx_then_recovers);
    tcase_add_test(tc, test_4xx_parks_with_response);
    tcase_add_test(tc, test_429_retry_after);
    tcase_add_test(tc, test_409_and_422);
    tcase_add_test(tc, test_key_window_not_resent);
    tcase_add_test(tc, test_key_window_reference_lookup);
    tcase_add_test(tc, test_non_idempotent_parks_unknown);
    tcase_add_test(tc, test_non_idempotent_reference_lookup);
    tcase_add_test(tc, test_invalid_header_key_parked);
    tcase_add_test(tc, test_local_effect_failure);
    tcase_add_test(tc, test_crash_between_call_and_commit);
    tcase_add_test(tc, test_in_flight_cap);
    suite_add_tcase(s, tc);
    tc = tcase_create("reconcile");
    tcase_set_timeout(tc, 120 * mult());
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_add_test(tc, test_sweep_stale_pending);
    tcase_add_test(tc, test_sweep_resends_same_key);
    tcase_add_test(tc, test_sweep_parks_no_record);
    tcase_add_test(tc, test_commands_reconcile_resolve_show);
    tcase_add_test(tc, test_uncertain_park_redrive_refused);
    tcase_add_test(tc, test_gauges_promtool);
    suite_add_tcase(s, tc);
    tc = tcase_create("edges");
    tcase_set_timeout(tc, 120 * mult());
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_add_test(tc, test_4xx_after_unknown_stays_uncertain);
    tcase_add_test(tc, test_uncertain_redrive_looks_up);
    tcase_add_test(tc, test_redrive_closes_park);
    tcase_add_test(tc, test_second_reference_while_confirmed);
    tcase_add_test(tc, test_409_makes_uncertain);
    tcase_add_test(tc, test_lookup_404_young_request_stays_uncertain);
    tcase_add_test(tc, test_oversized_wire_values);
    tcase_add_test(tc, test_far_deadline_delay);
    tcase_add_test(tc, test_effect_timeout_keeps_reference);
    tcase_add_test(tc, test_cross_input_key_conflict);
    tcase_add_test(tc, test_flow_under_grant_role);
    suite_add_tcase(s, tc);
    tc = tcase_create("sealed");
    tcase_set_timeout(tc, 120 * mult());
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_add_test(tc, test_sealed_message);
    suite_add_tcase(s, tc);
    return check_run(s);
}
