/*
 * Integration tests of the total worker loop: no message,
 * database answer or broker event stops a worker or loses a delivery. Each
 * test reproduces one finding against the real RabbitMQ and PostgreSQL and
 * the real idemq binary (see itest.h); each failed before its fix.
 */
#include <check.h>

#include "check_run.h"
#include <amqp.h>
#include <jansson.h>
#include <openssl/evp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "itest.h"
#include "ledger_txn.h"
#include "topology.h"

#define EFFECTS_FOR "SELECT count(*) FROM idemq_test.effects WHERE key = $1"
#define EFFECTS_LIKE "SELECT count(*) FROM idemq_test.effects WHERE key LIKE $1 || ':%'"
#define PARKED_CODE "SELECT count(*) FROM idemq.parked WHERE source_queue = $1 AND error_code = "

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static long long mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Polls a count query until it reaches want (or the deadline). */
static long wait_count(struct itest *t, const char *sql, const char *p1, long want, int ms)
{
    long v = -1;
    for (int waited = 0; waited <= ms; waited += 100) {
        if ((v = itest_long(t, sql, p1)) >= want)
            return v;
        sleep_ms(100);
    }
    return v;
}

static void payout(char *buf, size_t len, const char *key, const char *extra)
{
    snprintf(buf, len, "{\"job_id\":\"%s\",\"amount_minor\":100%s%s}", key, extra ? "," : "",
             extra ? extra : "");
}

static void publish_keys(struct itest *t, const char *prefix, int n, const char *extra)
{
    char **bodies = calloc((size_t)n, sizeof *bodies);
    for (int i = 0; i < n; i++) {
        char key[200];
        bodies[i] = malloc(512);
        snprintf(key, sizeof key, "%s:%s%d", t->name, prefix, i);
        payout(bodies[i], 512, key, extra);
    }
    itest_publish(t, (const char *const *)bodies, n);
    for (int i = 0; i < n; i++)
        free(bodies[i]);
    free(bodies);
}

static int run_logged(struct itest *t, int idle_s, const char *log, int timeout_ms)
{
    pid_t pid = itest_spawn_log(t->cfg_path, idle_s, NULL, log);
    int st = itest_wait(pid, itest_ms(timeout_ms));
    ck_assert_msg(st != -1, "idemq did not finish in time (log %s)", log);
    ck_assert_msg(WIFEXITED(st), "idemq died with signal %d (log %s)",
                  WIFSIGNALED(st) ? WTERMSIG(st) : 0, log);
    return WEXITSTATUS(st);
}

/* A header table nested depth levels deep, as raw AMQP (pool allocated). */
static amqp_table_t nested_table(amqp_pool_t *pool, int depth)
{
    amqp_table_t t = {0, NULL};
    amqp_table_entry_t *prev = NULL;
    /* built inside out, iteratively (no recursion in the test either) */
    for (int d = 0; d < depth; d++) {
        amqp_table_entry_t *e = amqp_pool_alloc(pool, sizeof *e);
        e->key = amqp_cstring_bytes(d == 0 ? "leaf" : "n");
        if (!prev) {
            e->value.kind = AMQP_FIELD_KIND_I32;
            e->value.value.i32 = 7;
        } else {
            e->value.kind = AMQP_FIELD_KIND_TABLE;
            e->value.value.table.num_entries = 1;
            e->value.value.table.entries = prev;
        }
        prev = e;
    }
    t.num_entries = 1;
    t.entries = prev;
    return t;
}

static void raw_props(amqp_basic_properties_t *p, amqp_table_t headers)
{
    memset(p, 0, sizeof *p);
    p->_flags = AMQP_BASIC_DELIVERY_MODE_FLAG | AMQP_BASIC_HEADERS_FLAG;
    p->delivery_mode = 2;
    p->headers = headers;
}

/* ---- the recovery claim runs inside its transaction ---- */

/*
 * ledger_txn_claim_failed ran before the pending BEGIN was flushed, so the
 * claim committed on its own (autocommit) and released its row lock before
 * the failure was recorded. Inside the transaction, another session must
 * not see the claimed row until the commit, and a rollback leaves nothing.
 */
START_TEST(test_claim_failed_inside_txn)
{
    struct itest t;
    struct ledger_txn *lt;
    struct ledger_db_error e;
    struct ledger_result r;
    struct job j;
    char err[512], key[200];
    PGconn *worker;

    itest_setup(&t, "claimtx", "idemq_test.record", "", "");
    worker = ledger_db_connect(getenv("IDEMQ_PG_DSN"), "itest worker", 0, err, sizeof err);
    ck_assert_msg(worker != NULL, "%s", err);
    ck_assert_ptr_nonnull(lt = ledger_txn_new(worker, t.conf, err, sizeof err));
    job_init(&j);
    memset(&r, 0, sizeof r);
    snprintf(key, sizeof key, "%s:k", t.name);
    ck_assert_int_eq(job_set_body(&j, "{}", 2), IDEMQ_OK);
    j.input = 0;
    j.has_key = true;
    snprintf(j.key, sizeof j.key, "%s", key);
    job_decode(&j, &t.conf->inputs[0]); /* sets the hash */
    j.has_key = true;
    snprintf(j.key, sizeof j.key, "%s", key);

    ck_assert_int_eq(ledger_txn_begin(lt, &e), IDEMQ_OK);
    ck_assert_int_eq(ledger_txn_claim_failed(lt, &j, &r, &e), IDEMQ_OK);
    ck_assert_int_eq(r.outcome, LEDGER_ERROR);
    /* another session: the claim is not committed */
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key = $1", key), 0);
    ledger_txn_rollback(lt);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key = $1", key), 0);

    ledger_txn_result_clear(&r);
    job_destroy(&j);
    ledger_txn_free(lt);
    PQfinish(worker);
    itest_teardown(&t);
}
END_TEST

/* Every ledger function runs with a pinned search_path (CVE-2018-1058). */
START_TEST(test_search_path_pinned)
{
    struct itest t;
    itest_setup(&t, "pin", "idemq_test.record", "", "");
    ck_assert_int_gt(itest_long(&t, "SELECT count(*) FROM pg_proc p JOIN pg_namespace n "
                                    "ON n.oid = p.pronamespace WHERE n.nspname = 'idemq'",
                                NULL),
                     5);
    ck_assert_int_eq(itest_long(&t,
                                "SELECT count(*) FROM pg_proc p JOIN pg_namespace n "
                                "ON n.oid = p.pronamespace WHERE n.nspname = 'idemq' "
                                "AND p.prokind = 'f' AND NOT coalesce(p.proconfig, '{}') @> "
                                "'{\"search_path=pg_catalog, idemq, pg_temp\"}'",
                                NULL),
                     0);
    itest_teardown(&t);
}
END_TEST

/* ---- crash-loop on one message ---- */

/*
 * A header table nested 20,000 levels deep (about 100 KB with short names;
 * 17,000 here, the most our encoding fits in frame_max) made PostgreSQL
 * reject the batch (54001) and every replica abort on the redelivered
 * message. Now the headers are cut at the depth limit and the
 * message parked as headers_too_deep; a field count over the limit is
 * headers_too_large; the batch-mates are applied; two workers, exit 0.
 * RabbitMQ 4.0 takes about 4 s to hand the deep one over (3.10: 15 ms), so
 * the 21 behind it came after --until-idle's 2 s: the worker finished with
 * them dispatched to it, 20 effects instead of 40. Now a worker finishes
 * only once the broker's cancel-ok confirms nothing more was on its way.
 */
START_TEST(test_deep_and_large_headers)
{
    struct itest t;
    struct itest_raw *raw;
    amqp_pool_t pool;
    amqp_basic_properties_t p;
    amqp_table_entry_t *many;
    char body[512], key[200], log[300];
    const struct conf_input *in;

    itest_setup(&t, "deep", "idemq_test.record", "workers = 2;", "");
    in = &t.conf->inputs[0];
    snprintf(log, sizeof log, "/tmp/%s.log", t.name);
    publish_keys(&t, "before", 20, NULL);
    raw = itest_raw_open();
    init_amqp_pool(&pool, 1 << 16);
    snprintf(key, sizeof key, "%s:deep", t.name);
    payout(body, sizeof body, key, NULL);
    raw_props(&p, nested_table(&pool, 17000)); /* ~119 KB, inside frame_max */
    itest_raw_publish(raw, in->exchange, in->routing_key, strlen(in->routing_key), body,
                      strlen(body), &p);
    /* 3,000 fields: over the field limit, well inside frame_max */
    many = amqp_pool_alloc(&pool, 3000 * sizeof *many);
    for (int i = 0; i < 3000; i++) {
        char *name = amqp_pool_alloc(&pool, 16);
        snprintf(name, 16, "h%d", i);
        many[i].key = amqp_cstring_bytes(name);
        many[i].value.kind = AMQP_FIELD_KIND_I8;
        many[i].value.value.i8 = 1;
    }
    raw_props(&p, (amqp_table_t){3000, many});
    snprintf(key, sizeof key, "%s:wide", t.name);
    payout(body, sizeof body, key, NULL);
    itest_raw_publish(raw, in->exchange, in->routing_key, strlen(in->routing_key), body,
                      strlen(body), &p);
    itest_raw_close(raw);
    empty_amqp_pool(&pool);
    publish_keys(&t, "after", 20, NULL);

    ck_assert_int_eq(run_logged(&t, 2, log, 90000), 0);
    ck_assert_int_eq(itest_long(&t, EFFECTS_LIKE, t.name), 40);
    ck_assert_int_eq(itest_long(&t, PARKED_CODE "'headers_too_deep'", t.name), 1);
    ck_assert_int_eq(itest_long(&t, PARKED_CODE "'headers_too_large'", t.name), 1);
    /* parked with its key: the body was fine */
    snprintf(key, sizeof key, "%s:deep", t.name);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1", key), 1);
    ck_assert_int_eq(itest_queue_ready(&t, t.name), 0);
    unlink(log);
    itest_teardown(&t);
}
END_TEST

/*
 * A row lock outliving statement_timeout (a `retrying` key held FOR UPDATE
 * by another session) failed the whole batch, then the job alone, then its
 * recovery claim, and the worker aborted (the innocent batch-mates were
 * never applied). Now the batch-mates are applied at once, the locked job
 * is given back to the broker (NOT READY, backoff) and is applied once
 * the lock goes.
 */
START_TEST(test_locked_key)
{
    struct itest t;
    char key[200], body[512], log[300], err[512];
    PGconn *holder;
    PGresult *r;
    pid_t pid;
    int st;

    itest_extra_conf = "database: { statement_timeout_ms = 1000; };";
    itest_setup(&t, "locked", "idemq_test.record", "batch_max = 20; batch_wait_ms = 500;", "");
    itest_extra_conf = NULL;
    snprintf(log, sizeof log, "/tmp/%s.log", t.name);
    snprintf(key, sizeof key, "%s:locked", t.name);
    /* the key exists, retrying, due; another session holds its row */
    {
        const char *vals[2] = {key, t.name};
        r = PQexecParams(t.db,
                         "INSERT INTO idemq.jobs (key, state, source_queue, payload_sha256, "
                         "attempts, run_after) VALUES ($1, 'retrying', $2, 'x', 1, now())",
                         2, NULL, vals, NULL, NULL, 0);
        ck_assert_msg(PQresultStatus(r) == PGRES_COMMAND_OK, "%s", PQerrorMessage(t.db));
        PQclear(r);
    }
    holder = ledger_db_connect(getenv("IDEMQ_PG_DSN"), "itest holder", 0, err, sizeof err);
    ck_assert_msg(holder != NULL, "%s", err);
    PQclear(PQexec(holder, "BEGIN"));
    {
        const char *vals[1] = {key};
        r = PQexecParams(holder, "SELECT 1 FROM idemq.jobs WHERE key = $1 FOR UPDATE", 1, NULL,
                         vals, NULL, NULL, 0);
        ck_assert_int_eq(PQntuples(r), 1);
        PQclear(r);
    }
    publish_keys(&t, "mate", 5, NULL);
    payout(body, sizeof body, key, NULL);
    itest_publish(&t, (const char *[]){body}, 1);
    publish_keys(&t, "late", 5, NULL);
    pid = itest_spawn_log(t.cfg_path, 3, NULL, log);
    /* the batch-mates are applied while the lock is still held */
    ck_assert_int_eq(wait_count(&t, EFFECTS_LIKE, t.name, 10, itest_ms(30000)), 10);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 0);
    /* the locked one goes back to the broker (the others went on), the
     * worker pauses, alive */
    for (int i = 0; i < 200 && !itest_count_lines(log, "giving the unsettled deliveries back");
         i++)
        sleep_ms(100);
    ck_assert_int_gt(itest_count_lines(log, "giving the unsettled deliveries back"), 0);
    ck_assert_int_eq(waitpid(pid, &st, WNOHANG), 0);
    PQclear(PQexec(holder, "ROLLBACK"));
    PQfinish(holder);
    st = itest_wait(pid, itest_ms(60000));
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "status 0x%x", st);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
    ck_assert_int_eq(itest_long(&t, EFFECTS_LIKE, t.name), 11);
    ck_assert_int_eq(itest_count_lines(log, "PANIC"), 0);
    unlink(log);
    itest_teardown(&t);
}
END_TEST

/* Installs a trigger on table (idemq.attempts or idemq.parked) that raises
 * sqlstate for rows of key. */
static void fail_writes(struct itest *t, const char *table, const char *key, const char *sqlstate,
                        const char *tag)
{
    char sql[2048];
    snprintf(sql, sizeof sql,
             "CREATE OR REPLACE FUNCTION idemq_test.%s_fail() RETURNS trigger LANGUAGE plpgsql "
             "AS $f$ BEGIN IF NEW.key = '%s' THEN RAISE EXCEPTION 'injected %s' USING ERRCODE = "
             "'%s'; END IF; RETURN NEW; END $f$; "
             "CREATE TRIGGER %s_fail BEFORE INSERT ON %s FOR EACH ROW "
             "EXECUTE FUNCTION idemq_test.%s_fail()",
             tag, key, sqlstate, sqlstate, tag, table, tag);
    itest_sql(t, sql);
}

static void unfail_writes(struct itest *t, const char *table, const char *tag)
{
    char sql[512];
    snprintf(sql, sizeof sql, "DROP TRIGGER IF EXISTS %s_fail ON %s; "
                              "DROP FUNCTION IF EXISTS idemq_test.%s_fail()",
             tag, table, tag);
    itest_sql(t, sql);
}

/*
 * record_failure itself failing (here: a permanent error writing the
 * attempt row) used to abort the worker. Now the job climbs the ladder to
 * a park with what can be stored (`unprocessable`), its batch-mates are
 * applied. And when even that park fails, the delivery is rejected to the
 * queue's dead-letter exchange: it ends in <queue>.dead, never loops.
 */
START_TEST(test_failure_cannot_be_recorded)
{
    struct itest t;
    char k1[200], k2[200], b1[512], b2[512], log[300], dlq[300];
    const char *bodies[2] = {b1, b2};

    itest_setup(&t, "norec", "idemq_test.record", "batch_max = 20; batch_wait_ms = 500;", "");
    snprintf(log, sizeof log, "/tmp/%s.log", t.name);
    snprintf(k1, sizeof k1, "%s:unrecordable", t.name);
    snprintf(k2, sizeof k2, "%s:unparkable", t.name);
    /* both fail transiently in their effect; their failures cannot be written */
    payout(b1, sizeof b1, k1, "\"raise\":\"40001\"");
    payout(b2, sizeof b2, k2, "\"raise\":\"40001\"");
    fail_writes(&t, "idemq.attempts", k1, "P0001", "norec1");
    fail_writes(&t, "idemq.attempts", k2, "P0001", "norec2");
    fail_writes(&t, "idemq.parked", k2, "P0001", "norec3");
    publish_keys(&t, "mate", 5, NULL);
    itest_publish(&t, bodies, 2);
    publish_keys(&t, "late", 5, NULL);

    ck_assert_int_eq(run_logged(&t, 2, log, 90000), 0);
    unfail_writes(&t, "idemq.attempts", "norec1");
    unfail_writes(&t, "idemq.attempts", "norec2");
    unfail_writes(&t, "idemq.parked", "norec3");
    ck_assert_int_eq(itest_long(&t, EFFECTS_LIKE, t.name), 10);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, k1), 0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1 AND "
                                    "error_code = 'unprocessable'",
                                k1),
                     1);
    /* the unparkable one: rejected to the broker's dead-letter path */
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1", k2), 0);
    topology_dlq(&t.conf->inputs[0], dlq, sizeof dlq);
    ck_assert_int_eq(itest_queue_ready(&t, dlq), 2); /* k1's dead-letter copy and k2 */
    ck_assert_int_eq(itest_queue_ready(&t, t.name), 0);
    ck_assert_int_eq(itest_count_lines(log, "rejecting it to the queue's dead-letter exchange"),
                     1);
    unlink(log);
    itest_teardown(&t);
}
END_TEST

/*
 * A deadlock/serialization failure while recording a failure (rung 2)
 * used to abort the worker. Now it is contention: the delivery goes back
 * to the broker, the worker says NOT READY (/ready 503) and backs off, and
 * once the contention is gone the job goes its normal way.
 */
START_TEST(test_contention_while_recording)
{
    struct itest t;
    char key[200], body[512], log[300], url[64], out[4096], extra[100];
    pid_t pid;
    int st, not_ready = 0, port = itest_free_port();

    snprintf(extra, sizeof extra, "metrics: { listen = \"127.0.0.1:%d\"; };", port);
    itest_extra_conf = extra;
    itest_retry_conf = "base_delay_ms = 100; max_delay_ms = 200; jitter = \"none\";";
    itest_setup(&t, "contend", "idemq_test.record", "", "");
    itest_extra_conf = NULL;
    itest_retry_conf = NULL;
    snprintf(url, sizeof url, "http://127.0.0.1:%d/ready", port);
    snprintf(log, sizeof log, "/tmp/%s.log", t.name);
    snprintf(key, sizeof key, "%s:busy", t.name);
    payout(body, sizeof body, key, "\"raise\":\"40001\",\"raise_until\":1");
    fail_writes(&t, "idemq.attempts", key, "40P01", "contend");
    itest_publish(&t, (const char *[]){body}, 1);
    publish_keys(&t, "mate", 3, NULL);
    pid = itest_spawn_log(t.cfg_path, 3, NULL, log);
    for (int i = 0; i < 300 && !not_ready; i++) {
        not_ready = itest_http_get(url, out, sizeof out) == 503;
        sleep_ms(100);
    }
    ck_assert_msg(not_ready, "/ready never said 503 (log %s)", log);
    ck_assert_ptr_nonnull(strstr(out, "not ready"));
    ck_assert_int_eq(waitpid(pid, &st, WNOHANG), 0); /* alive */
    unfail_writes(&t, "idemq.attempts", "contend");
    st = itest_wait(pid, itest_ms(60000));
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "status 0x%x", st);
    /* the first attempt's failure recorded, the retry applied it */
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
    ck_assert_int_eq(itest_long(&t, EFFECTS_LIKE, t.name), 4);
    unlink(log);
    itest_teardown(&t);
}
END_TEST

/* ---- a delivery the client library cannot decode ---- */

/*
 * RabbitMQ accepts a header table with an empty field name (top level or
 * nested); librabbitmq-c 0.11's amqp_read_message refuses it (its
 * properties clone: "invalid parameter"). idemq dropped the connection,
 * the broker redelivered, and the worker looped forever. idemq now reads a
 * message's frames itself (adapters/delivery.c): such headers are just
 * headers, the jobs are applied once, nothing loops. (What the library's
 * frame decoder itself refuses is parked as `undecodable` and rejected to
 * <queue>.dead: tests/unit/check_delivery.c feeds it such frames.)
 */
START_TEST(test_empty_header_names)
{
    struct itest t;
    struct itest_raw *raw;
    amqp_basic_properties_t p;
    amqp_table_entry_t top[2], inner[1];
    char body[512], key[200], log[300], dlq[300], out[8192];
    const struct conf_input *in;

    itest_setup(&t, "undec", "idemq_test.record", "workers = 2;", "");
    in = &t.conf->inputs[0];
    snprintf(log, sizeof log, "/tmp/%s.log", t.name);
    topology_dlq(in, dlq, sizeof dlq);
    publish_keys(&t, "a", 10, NULL);
    raw = itest_raw_open();
    /* empty name at the top level */
    top[0].key = amqp_cstring_bytes("");
    top[0].value.kind = AMQP_FIELD_KIND_I32;
    top[0].value.value.i32 = 1;
    raw_props(&p, (amqp_table_t){1, top});
    snprintf(key, sizeof key, "%s:undec1", t.name);
    payout(body, sizeof body, key, NULL);
    itest_raw_publish(raw, in->exchange, in->routing_key, strlen(in->routing_key), body,
                      strlen(body), &p);
    /* empty name nested one level down */
    inner[0].key = amqp_cstring_bytes("");
    inner[0].value.kind = AMQP_FIELD_KIND_UTF8;
    inner[0].value.value.bytes = amqp_cstring_bytes("x");
    top[0].key = amqp_cstring_bytes("outer");
    top[0].value.kind = AMQP_FIELD_KIND_TABLE;
    top[0].value.value.table = (amqp_table_t){1, inner};
    top[1].key = amqp_cstring_bytes("ok");
    top[1].value.kind = AMQP_FIELD_KIND_BOOLEAN;
    top[1].value.value.boolean = 1;
    raw_props(&p, (amqp_table_t){2, top});
    snprintf(key, sizeof key, "%s:undec2", t.name);
    payout(body, sizeof body, key, NULL);
    itest_raw_publish(raw, in->exchange, in->routing_key, strlen(in->routing_key), body,
                      strlen(body), &p);
    itest_raw_close(raw);
    publish_keys(&t, "b", 10, NULL);
    /* and one ordinary park, so redrive has something to move */
    itest_publish(&t, (const char *[]){"{not json"}, 1);

    ck_assert_int_eq(run_logged(&t, 2, log, 90000), 0);
    ck_assert_int_eq(itest_long(&t, EFFECTS_LIKE, t.name), 22);
    snprintf(key, sizeof key, "%s:undec2", t.name);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
    ck_assert_int_eq(itest_long(&t, PARKED_CODE "'bad_json'", t.name), 1);
    ck_assert_int_eq(itest_queue_ready(&t, t.name), 0);
    ck_assert_int_eq(itest_queue_ready(&t, dlq), 1);
    /* nothing looped: no broker failure at all */
    ck_assert_int_eq(itest_count_lines(log, "broker failure"), 0);
    /* the dry run says what stays; the redrive moves the one parked */
    ck_assert_int_eq(itest_idemq(&t, "redrive --dry-run", out, sizeof out), 0);
    ck_assert_msg(strstr(out, "would redrive 1 message; 1 stay in the dead-letter queues"), "%s",
                  out);
    ck_assert_int_eq(itest_idemq(&t, "redrive", out, sizeof out), 0);
    ck_assert_msg(strstr(out, "redrove 1 message; 0 left"), "%s", out);
    unlink(log);
    itest_teardown(&t);
}
END_TEST

/* ---- bodies over the limit are not read whole ---- */

static void sha256_hex(const void *data, size_t n, char out[65])
{
    unsigned char md[32];
    unsigned int len = 0;
    static const char hx[] = "0123456789abcdef";
    EVP_Digest(data, n, md, &len, EVP_sha256(), NULL);
    for (int i = 0; i < 32; i++) {
        out[2 * i] = hx[md[i] >> 4];
        out[2 * i + 1] = hx[md[i] & 15];
    }
    out[64] = '\0';
}

/*
 * max_body_bytes was checked after the whole body was read and copied, and
 * the whole oversized body was stored in idemq.parked and republished. Now
 * the size comes from the content header: a 3 MiB body against a 64 KiB
 * limit is parked with a 4 KiB prefix, its size and the SHA-256 of all of
 * it, not redrivable (and so is its dead-letter copy).
 */
START_TEST(test_oversized_body)
{
    struct itest t;
    size_t n = 3u << 20;
    char *big = malloc(n + 1), sha[65], buf[128], out[4096], dlq[300];
    struct broker *b;
    char err[512];

    itest_setup(&t, "big", "idemq_test.record", "", "max_body_bytes = 65536;");
    topology_dlq(&t.conf->inputs[0], dlq, sizeof dlq);
    ck_assert_ptr_nonnull(big);
    for (size_t i = 0; i < n; i++)
        big[i] = (char)('a' + i % 26);
    big[n] = '\0';
    snprintf(big, 64, "{\"job_id\":\"%s:big\",\"pad\":\"", t.name);
    big[strlen(big)] = 'x';
    sha256_hex(big, n, sha);
    ck_assert_int_eq(broker_open(t.conf, "itest big", true, &b, err, sizeof err), IDEMQ_OK);
    ck_assert_int_eq(broker_publish(b, t.conf->inputs[0].exchange, t.conf->inputs[0].routing_key,
                                    big, n, NULL),
                     IDEMQ_OK);
    ck_assert_int_eq(broker_wait_confirms(b, itest_ms(20000)), IDEMQ_OK);
    broker_close(b);
    publish_keys(&t, "ok", 3, NULL);
    itest_run_until_idle(&t, 2);

    ck_assert_int_eq(itest_long(&t, EFFECTS_LIKE, t.name), 3);
    ck_assert_int_eq(itest_long(&t, PARKED_CODE "'body_too_large' AND NOT redrivable AND "
                                                "octet_length(body) = 4096 AND "
                                                "body_size = 3145728",
                                t.name),
                     1);
    ck_assert_str_eq(itest_text(&t, "SELECT payload_sha256 FROM idemq.parked WHERE "
                                    "source_queue = $1 AND error_code = 'body_too_large'",
                                t.name, buf, sizeof buf),
                     sha);
    ck_assert_int_eq(itest_queue_ready(&t, dlq), 1);
    ck_assert_int_eq(itest_idemq(&t, "redrive", out, sizeof out), 0);
    ck_assert_msg(strstr(out, "redrove 0 messages; 1 left"), "%s", out);
    ck_assert_msg(strstr(out, "not redrivable"), "%s", out);
    free(big);
    itest_teardown(&t);
}
END_TEST

/*
 * idemq redrive published to whatever queue a producer-supplied
 * x-idemq-origin-queue named, with idemq's credentials. A dead letter
 * whose origin is not one of its input's queues now stays where it is.
 */
START_TEST(test_redrive_refuses_foreign_origin)
{
    struct itest t;
    char dlq[300], victim[300], out[4096], err[512];
    struct broker *b;
    json_t *h;

    itest_setup(&t, "origin", "idemq_test.record", "", "");
    topology_dlq(&t.conf->inputs[0], dlq, sizeof dlq);
    snprintf(victim, sizeof victim, "%s.victim", t.name);
    ck_assert_int_eq(broker_open(t.conf, "itest origin", true, &b, err, sizeof err), IDEMQ_OK);
    ck_assert_int_eq(broker_admin_declare_queue(b, victim, NULL, false), IDEMQ_OK);
    h = json_pack("{s:s,s:s,s:s}", "x-idemq-origin-queue", victim, "x-idemq-key", "forged",
                  "x-idemq-error-class", "permanent");
    {
        struct broker_props p = {NULL, NULL, h, true, NULL, NULL};
        ck_assert_int_eq(broker_publish(b, "", dlq, "{\"job_id\":\"forged\"}", 19, &p),
                         IDEMQ_OK);
        ck_assert_int_eq(broker_wait_confirms(b, itest_ms(10000)), IDEMQ_OK);
    }
    json_decref(h);
    ck_assert_int_eq(itest_idemq(&t, "redrive", out, sizeof out), 0);
    ck_assert_msg(strstr(out, "redrove 0 messages; 1 left"), "%s", out);
    ck_assert_msg(strstr(out, "refused"), "%s", out);
    ck_assert_int_eq(itest_queue_ready(&t, victim), 0);
    {
        long ready = -1;
        for (int i = 0; i < 50 && ready != 1; i++) {
            ready = itest_queue_ready(&t, dlq);
            sleep_ms(100);
        }
        ck_assert_int_eq(ready, 1);
    }
    ck_assert_int_eq(broker_admin_delete_queue(b, victim), IDEMQ_OK);
    broker_close(b);
    itest_teardown(&t);
}
END_TEST

/* ---- a frozen database ---- */

/*
 * PostgreSQL stopped with SIGSTOP (the kernel still answers TCP, so
 * keepalives cannot see it): workers blocked inside libpq, silently, with
 * /ready 200. Now each call has a client-side deadline (statement_timeout
 * + 5 s): the worker abandons the connection, logs it, says NOT READY, and
 * once the server is back every job is applied once.
 */
START_TEST(test_frozen_database)
{
    struct itest t;
    char log[300], url[64], out[4096], cont[600], extra[200];
    pid_t pid;
    int st, not_ready = 0, stopped, port = itest_free_port();
    long long t0;

    /* not a fixed port: other sessions on the machine run this test too */
    snprintf(extra, sizeof extra,
             "database: { statement_timeout_ms = 1000; }; "
             "metrics: { listen = \"127.0.0.1:%d\"; };",
             port);
    itest_extra_conf = extra;
    itest_setup(&t, "frozen", "idemq_test.record", "workers = 2; batch_max = 10;", "");
    itest_extra_conf = NULL;
    snprintf(url, sizeof url, "http://127.0.0.1:%d/ready", port);
    snprintf(log, sizeof log, "/tmp/%s.log", t.name);
    publish_keys(&t, "first", 50, "\"sleep_ms\":20");
    /* idle long enough that no worker finishes while the server is frozen */
    pid = itest_spawn_log(t.cfg_path, 10, NULL, log);
    ck_assert_int_ge(wait_count(&t, EFFECTS_LIKE, t.name, 5, itest_ms(20000)), 5);
    /* A watchdog resumes the server whatever happens to this test. */
    snprintf(cont, sizeof cont,
             "(sleep 25; pm=$(head -1 $(cat %s/pg-dir)/data/postmaster.pid); "
             "kill -CONT $pm $(pgrep -P $pm)) >/dev/null 2>&1 &",
             getenv("IDEMQ_STATE_DIR"));
    ck_assert_int_eq(system(cont), 0);
    stopped = itest_pg_signal(SIGSTOP);
    ck_assert_int_gt(stopped, 1);
    t0 = time(NULL);
    for (int i = 0; i < 200 && !not_ready; i++) { /* deadline 6 s: 503 within ~10 s */
        not_ready = itest_http_get(url, out, sizeof out) == 503 &&
                    itest_count_lines(log, "did not answer within") > 0;
        sleep_ms(100);
    }
    itest_pg_signal(SIGCONT);
    ck_assert_msg(not_ready, "no NOT READY for the frozen database (log %s; /ready: %s)", log,
                  out);
    ck_assert_int_le(time(NULL) - t0, 20);
    ck_assert_ptr_nonnull(strstr(out, "not ready"));
    ck_assert_int_eq(waitpid(pid, &st, WNOHANG), 0);
    itest_reconnect_db(&t);
    st = itest_wait(pid, itest_ms(90000));
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "status 0x%x", st);
    /* every job applied, none twice */
    ck_assert_int_eq(itest_long(&t, EFFECTS_LIKE, t.name), 50);
    ck_assert_int_eq(itest_long(&t,
                                "SELECT count(*) FROM (SELECT key FROM idemq_test.effects WHERE "
                                "key LIKE $1 || ':%' GROUP BY key HAVING count(*) > 1) d",
                                t.name),
                     0);
    unlink(log);
    itest_teardown(&t);
}
END_TEST

/* ---- more consumers than the old fixed table held ---- */

/* idemq's own limit of 64 consumers per channel made a worker reconnect-loop
 * forever on a config check-config accepted. The table now grows: 70
 * partitions are consumed, every job applied. */
START_TEST(test_many_partitions)
{
    struct itest t;
    itest_setup(&t, "wide", "idemq_test.record", "max_buffered_mib = 20000;", "partitions = 70;");
    publish_keys(&t, "p", 140, NULL);
    itest_run_until_idle(&t, 3);
    ck_assert_int_eq(itest_long(&t, EFFECTS_LIKE, t.name), 140);
    itest_teardown(&t);
}
END_TEST

/* ---- jobs show tells the story in commit order ---- */

/* Under a duplicate storm a duplicate copy printed before the attempt that
 * applied the job, all labelled "attempt 1". Now the story is in commit
 * order and the applying attempt is marked. */
START_TEST(test_jobs_show_order)
{
    struct itest t;
    char key[200], body[512], out[16384];
    const char *bodies[30];
    char *applied, *dup;

    itest_setup(&t, "story", "idemq_test.record", "workers = 2; batch_max = 5;", "");
    snprintf(key, sizeof key, "%s:storm", t.name);
    payout(body, sizeof body, key, "\"sleep_ms\":30");
    for (int i = 0; i < 30; i++)
        bodies[i] = body;
    itest_publish(&t, bodies, 30);
    itest_run_until_idle(&t, 2);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
    {
        char args[300];
        snprintf(args, sizeof args, "jobs show '%s'", key);
        ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 0);
    }
    applied = strstr(out, "<== the effect was applied here");
    dup = strstr(out, "duplicate delivery, no effect");
    ck_assert_msg(applied && dup, "%s", out);
    ck_assert_msg(applied < dup, "a duplicate shows before the applying attempt:\n%s", out);
    itest_teardown(&t);
}
END_TEST

/* ---- resuming after a broker restart ---- */

/*
 * After a RabbitMQ restart the reconnect backoff had grown to 11-17 s and
 * its ceiling was neither documented nor configurable. With
 * broker.reconnect_max_ms = 2000, a job published once the broker is back
 * is applied within about that.
 */
START_TEST(test_broker_restart_resume)
{
    struct itest t;
    char log[300], key[200], body[512];
    pid_t pid;
    int st;
    long long t0, waited;
    struct timespec a, b;

    itest_setup(&t, "resume", "idemq_test.record", "", "");
    { /* the reconnect ceiling lives in the broker group */
        char cmd[600];
        snprintf(cmd, sizeof cmd, "sed -i 's/^broker: { heartbeat = 10; };/broker: { heartbeat = "
                                  "10; reconnect_max_ms = 2000; };/' %s",
                 t.cfg_path);
        ck_assert_int_eq(system(cmd), 0);
    }
    snprintf(log, sizeof log, "/tmp/%s.log", t.name);
    publish_keys(&t, "before", 5, NULL);
    pid = itest_spawn_log(t.cfg_path, 30, NULL, log);
    ck_assert_int_eq(wait_count(&t, EFFECTS_LIKE, t.name, 5, itest_ms(20000)), 5);
    ck_assert_int_eq(itest_services("rabbit-stop"), 0);
    sleep_ms(8000); /* long enough for the backoff to reach its ceiling */
    ck_assert_int_eq(itest_services("rabbit-start"), 0);
    snprintf(key, sizeof key, "%s:after", t.name);
    payout(body, sizeof body, key, NULL);
    clock_gettime(CLOCK_MONOTONIC, &a);
    itest_publish(&t, (const char *[]){body}, 1);
    t0 = a.tv_sec * 1000LL + a.tv_nsec / 1000000;
    ck_assert_int_eq(wait_count(&t, EFFECTS_FOR, key, 1, itest_ms(30000)), 1);
    clock_gettime(CLOCK_MONOTONIC, &b);
    waited = b.tv_sec * 1000LL + b.tv_nsec / 1000000 - t0;
    ck_assert_msg(waited < itest_ms(2000 + 4000), "applied %lld ms after the broker was back",
                  waited);
    kill(pid, SIGTERM);
    st = itest_wait(pid, itest_ms(30000));
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "status 0x%x", st);
    unlink(log);
    itest_teardown(&t);
}
END_TEST

/* ---- oldest-ready age goes back to 0 ---- */

/* idemq_oldest_ready_age_seconds kept the age of the last delivery forever
 * once a queue went idle. */
START_TEST(test_oldest_age_resets)
{
    struct itest t;
    struct itest_raw *raw;
    amqp_basic_properties_t p;
    char body[512], key[200], out[16384], log[300];
    const struct conf_input *in;
    pid_t pid;
    int st;
    double age = -2;
    char *m, extra[100], murl[64];
    int port = itest_free_port();

    snprintf(extra, sizeof extra, "metrics: { listen = \"127.0.0.1:%d\"; };", port);
    snprintf(murl, sizeof murl, "http://127.0.0.1:%d/metrics", port);
    itest_extra_conf = extra;
    itest_setup(&t, "age", "idemq_test.record", "", "");
    itest_extra_conf = NULL;
    in = &t.conf->inputs[0];
    snprintf(log, sizeof log, "/tmp/%s.log", t.name);
    raw = itest_raw_open();
    memset(&p, 0, sizeof p);
    p._flags = AMQP_BASIC_TIMESTAMP_FLAG;
    p.timestamp = (uint64_t)time(NULL) - 3600; /* produced an hour ago */
    snprintf(key, sizeof key, "%s:old", t.name);
    payout(body, sizeof body, key, NULL);
    itest_raw_publish(raw, in->exchange, in->routing_key, strlen(in->routing_key), body,
                      strlen(body), &p);
    itest_raw_close(raw);
    pid = itest_spawn_log(t.cfg_path, 30, NULL, log);
    ck_assert_int_eq(wait_count(&t, EFFECTS_FOR, key, 1, itest_ms(20000)), 1);
    /* idle now: the age drops to 0 */
    for (int i = 0; i < 100; i++) {
        ck_assert_int_eq(itest_http_get(murl, out, sizeof out), 200);
        m = strstr(out, "\nidemq_oldest_ready_age_seconds ");
        ck_assert_ptr_nonnull(m);
        age = atof(m + strlen("\nidemq_oldest_ready_age_seconds "));
        if (age == 0)
            break;
        sleep_ms(100);
    }
    ck_assert_msg(age == 0, "oldest-ready age stays %g with the queue idle", age);
    kill(pid, SIGTERM);
    st = itest_wait(pid, itest_ms(30000));
    ck_assert_msg(st != -1 && WIFEXITED(st), "status 0x%x", st);
    unlink(log);
    itest_teardown(&t);
}
END_TEST

/* ---- a hostile producer ---- */

struct hostile {
    const char *code;  /* expected park code, NULL = applied */
    int count;
};

/*
 * A few hundred hostile deliveries interleaved with good jobs over two
 * workers: headers nested deep and wide and near frame_max, every AMQP
 * field type, invalid UTF-8 and control characters in keys, headers and
 * routing keys, bodies over the limit, empty bodies, odd content types
 * and encodings, duplicate fields, non-objects. The process never exits
 * early; every bad one is parked with its named code; every good one is
 * applied exactly once.
 */
START_TEST(test_hostile_producer)
{
    struct itest t;
    struct itest_raw *raw;
    amqp_pool_t pool;
    char log[300], key[400], body[8192], fanout[200];
    const struct conf_input *in;
    const char *odd_rk = "\xff\xfe\x01rk\n";
    int good = 0, expect_dup = 0, expect_bad = 0, expect_large = 0, expect_deep = 0,
        expect_wide = 0, expect_notobj = 0, expect_null = 0, expect_missing = 0,
        expect_empty = 0, expect_long = 0, expect_invalid = 0;

    itest_setup(&t, "hostile", "idemq_test.record", "workers = 2; batch_max = 50;",
                "max_body_bytes = 4096;");
    in = &t.conf->inputs[0];
    snprintf(log, sizeof log, "/tmp/%s.log", t.name);
    snprintf(fanout, sizeof fanout, "%s.fan", t.name);
    {
        /* a fanout exchange delivers whatever the routing key's bytes */
        struct broker *b;
        char err[512];
        ck_assert_int_eq(broker_open(t.conf, "itest bind", false, &b, err, sizeof err),
                         IDEMQ_OK);
        ck_assert_int_eq(broker_admin_declare_exchange(b, fanout, "fanout", false, NULL), IDEMQ_OK);
        ck_assert_int_eq(broker_admin_bind(b, in->queue, fanout, "", NULL), IDEMQ_OK);
        broker_close(b);
    }
    raw = itest_raw_open();
    init_amqp_pool(&pool, 1 << 16);
    for (int round = 0; round < 20; round++) {
        amqp_basic_properties_t p;
        amqp_table_entry_t *e = amqp_pool_alloc(&pool, 20 * sizeof *e);
        amqp_field_value_t *arr = amqp_pool_alloc(&pool, 3 * sizeof *arr);
        static const char bin[] = {'\0', '\xff', '\x80', 'z'};
        int ne = 0;
#define RAW(rk, b, n, pp)                                                                     \
    itest_raw_publish(raw, in->exchange, (rk), strlen(rk), (b), (n), (pp))
        /* 1. good, with every AMQP field type in its headers */
        memset(&p, 0, sizeof p);
        p._flags = AMQP_BASIC_HEADERS_FLAG | AMQP_BASIC_CONTENT_TYPE_FLAG |
                   AMQP_BASIC_CONTENT_ENCODING_FLAG | AMQP_BASIC_TIMESTAMP_FLAG |
                   AMQP_BASIC_PRIORITY_FLAG | AMQP_BASIC_CORRELATION_ID_FLAG;
        p.content_type = amqp_cstring_bytes("application/x-odd; charset=latin1");
        p.content_encoding = amqp_cstring_bytes("identity\x01");
        p.correlation_id.bytes = (void *)bin;
        p.correlation_id.len = sizeof bin;
        /* a timestamp within the dedup window: one of 1970 is parked as
         * outside_dedup_window (check_lifecycle) */
        p.timestamp = (uint64_t)time(NULL) - 60;
        p.priority = 9;
#define FIELD(name, k)                                                                        \
    e[ne].key = amqp_cstring_bytes(name);                                                     \
    e[ne].value.kind = (k)
        FIELD("t", AMQP_FIELD_KIND_BOOLEAN); e[ne++].value.value.boolean = 1;
        FIELD("b", AMQP_FIELD_KIND_I8); e[ne++].value.value.i8 = -8;
        FIELD("B", AMQP_FIELD_KIND_U8); e[ne++].value.value.u8 = 250;
        FIELD("s", AMQP_FIELD_KIND_I16); e[ne++].value.value.i16 = -16;
        FIELD("u", AMQP_FIELD_KIND_U16); e[ne++].value.value.u16 = 65000;
        FIELD("I", AMQP_FIELD_KIND_I32); e[ne++].value.value.i32 = -32;
        FIELD("i", AMQP_FIELD_KIND_U32); e[ne++].value.value.u32 = 4000000000u;
        FIELD("l", AMQP_FIELD_KIND_I64); e[ne++].value.value.i64 = -64;
        FIELD("f", AMQP_FIELD_KIND_F32); e[ne++].value.value.f32 = 1.5f;
        FIELD("d", AMQP_FIELD_KIND_F64); e[ne++].value.value.f64 = 1e300;
        FIELD("D", AMQP_FIELD_KIND_DECIMAL); e[ne].value.value.decimal.decimals = 2;
        e[ne++].value.value.decimal.value = 12345;
        FIELD("S", AMQP_FIELD_KIND_UTF8);
        e[ne++].value.value.bytes = amqp_cstring_bytes("ctl\x01\x1b[31m\n");
        FIELD("x", AMQP_FIELD_KIND_BYTES);
        e[ne].value.value.bytes.bytes = (void *)bin;
        e[ne++].value.value.bytes.len = sizeof bin;
        FIELD("T", AMQP_FIELD_KIND_TIMESTAMP); e[ne++].value.value.u64 = 1700000000;
        FIELD("V", AMQP_FIELD_KIND_VOID); ne++;
        FIELD("A", AMQP_FIELD_KIND_ARRAY); e[ne].value.value.array.num_entries = 3;
        e[ne++].value.value.array.entries = arr;
        arr[0].kind = AMQP_FIELD_KIND_UTF8;
        arr[0].value.bytes = amqp_cstring_bytes("\xc3\x28"); /* invalid UTF-8 value */
        arr[1].kind = AMQP_FIELD_KIND_I64;
        arr[1].value.i64 = 1;
        arr[2].kind = AMQP_FIELD_KIND_VOID;
        e[ne].key.bytes = (void *)"\xfe\xff"; /* a name that is not UTF-8 */
        e[ne].key.len = 2;
        e[ne].value.kind = AMQP_FIELD_KIND_I8;
        e[ne++].value.value.i8 = 1;
#undef FIELD
        p.headers.num_entries = ne;
        p.headers.entries = e;
        snprintf(key, sizeof key, "%s:types%d", t.name, round);
        payout(body, sizeof body, key, NULL);
        RAW(in->routing_key, body, strlen(body), &p);
        good++;
        /* 2. good, control characters and an escape sequence in the key,
         * routed by a routing key of arbitrary bytes */
        snprintf(key, sizeof key, "%s:ctl\\u0001\\n\\u001b[2Jforged %d", t.name, round);
        snprintf(body, sizeof body, "{\"job_id\":\"%s\",\"amount_minor\":1}", key);
        itest_raw_publish(raw, fanout, odd_rk, strlen(odd_rk), body, strlen(body), NULL);
        good++;
        /* 3. invalid UTF-8 in the key: bad_json */
        snprintf(body, sizeof body, "{\"job_id\":\"%s:\xff\xfe%d\"}", t.name, round);
        RAW(in->routing_key, body, strlen(body), NULL);
        expect_bad++;
        /* 4. empty body; 5. gzip-looking bytes; 6. trailing garbage: bad_json */
        RAW(in->routing_key, "", 0, NULL);
        RAW(in->routing_key, "\x1f\x8b\x08\x00\x00", 5, NULL);
        RAW(in->routing_key, "{\"job_id\":\"x\"} tail", strlen("{\"job_id\":\"x\"} tail"), NULL);
        expect_bad += 3;
        /* 7. over max_body_bytes */
        memset(body, ' ', 6000);
        snprintf(body, 40, "{\"job_id\":\"%s:big%d\",\"p\":\"", t.name, round);
        body[strlen(body)] = 'x';
        RAW(in->routing_key, body, 6000, NULL);
        expect_large++;
        /* 8. headers nested too deep (but a good body) */
        raw_props(&p, nested_table(&pool, 50 + round));
        snprintf(key, sizeof key, "%s:deep%d", t.name, round);
        payout(body, sizeof body, key, NULL);
        RAW(in->routing_key, body, strlen(body), &p);
        expect_deep++;
        /* 9. near frame_max: one 120 KB header value */
        {
            char *v = amqp_pool_alloc(&pool, 120001);
            amqp_table_entry_t *w = amqp_pool_alloc(&pool, sizeof *w);
            memset(v, 'v', 120000);
            v[120000] = '\0';
            w->key = amqp_cstring_bytes("huge");
            w->value.kind = AMQP_FIELD_KIND_UTF8;
            w->value.value.bytes = amqp_cstring_bytes(v);
            raw_props(&p, (amqp_table_t){1, w});
            snprintf(key, sizeof key, "%s:wide%d", t.name, round);
            payout(body, sizeof body, key, NULL);
            RAW(in->routing_key, body, strlen(body), &p);
            expect_wide++;
        }
        /* 10. not an object; 11. key null; 12. key missing; 13. key empty;
         * 14. key too long; 15. key of the wrong type; 16. duplicate key */
        RAW(in->routing_key, "[1,2,3]", strlen("[1,2,3]"), NULL);
        expect_notobj++;
        RAW(in->routing_key, "{\"job_id\":null}", strlen("{\"job_id\":null}"), NULL);
        expect_null++;
        RAW(in->routing_key, "{\"id\":1}", strlen("{\"id\":1}"), NULL);
        expect_missing++;
        RAW(in->routing_key, "{\"job_id\":\"\"}", strlen("{\"job_id\":\"\"}"), NULL);
        expect_empty++;
        {
            int n = snprintf(body, sizeof body, "{\"job_id\":\"");
            memset(body + n, 'k', 300);
            snprintf(body + n + 300, sizeof body - (size_t)n - 300, "%d\"}", round);
            RAW(in->routing_key, body, strlen(body), NULL);
            expect_long++;
        }
        RAW(in->routing_key, "{\"job_id\":{\"a\":1}}", strlen("{\"job_id\":{\"a\":1}}"), NULL);
        expect_invalid++;
        snprintf(body, sizeof body, "{\"job_id\":\"%s:a%d\",\"job_id\":\"%s:b%d\"}",
                 t.name, round, t.name, round);
        RAW(in->routing_key, body, strlen(body), NULL);
        expect_dup++;
        /* 17. plain good ones between */
        for (int k = 0; k < 3; k++) {
            snprintf(key, sizeof key, "%s:good%d_%d", t.name, round, k);
            payout(body, sizeof body, key, NULL);
            RAW(in->routing_key, body, strlen(body), NULL);
            good++;
        }
#undef RAW
    }
    itest_raw_close(raw);
    empty_amqp_pool(&pool);

    ck_assert_int_eq(run_logged(&t, 3, log, 180000), 0);
    ck_assert_int_eq(itest_count_lines(log, "PANIC"), 0);
    /* every good one applied exactly once */
    ck_assert_int_eq(itest_long(&t, EFFECTS_LIKE, t.name), good);
    ck_assert_int_eq(itest_long(&t,
                                "SELECT count(*) FROM (SELECT key FROM idemq_test.effects WHERE "
                                "key LIKE $1 || ':%' GROUP BY key HAVING count(*) > 1) d",
                                t.name),
                     0);
    /* every bad one parked with its named code */
    {
        struct {
            const char *code;
            int n;
        } want[] = {{"bad_json", expect_bad},         {"body_too_large", expect_large},
                    {"headers_too_deep", expect_deep}, {"headers_too_large", expect_wide},
                    {"not_object", expect_notobj},     {"key_null", expect_null},
                    {"key_missing", expect_missing},   {"key_empty", expect_empty},
                    {"key_too_long", expect_long},     {"key_invalid", expect_invalid},
                    {"duplicate_field", expect_dup}};
        long total = 0;
        for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
            char sql[300];
            snprintf(sql, sizeof sql, PARKED_CODE "'%s'", want[i].code);
            ck_assert_msg(itest_long(&t, sql, t.name) == want[i].n, "%s: %ld parked, want %d",
                          want[i].code, itest_long(&t, sql, t.name), want[i].n);
            total += want[i].n;
        }
        ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE "
                                        "source_queue = $1",
                                    t.name),
                         total);
    }
    ck_assert_int_eq(itest_queue_ready(&t, t.name), 0);
    {
        struct broker *b;
        char err[512];
        ck_assert_int_eq(broker_open(t.conf, "itest cleanup", false, &b, err, sizeof err),
                         IDEMQ_OK);
        ck_assert_int_eq(broker_admin_delete_exchange(b, fanout), IDEMQ_OK);
        broker_close(b);
    }
    unlink(log);
    itest_teardown(&t);
}
END_TEST

/* ---- the remaining rows of the state table: early and repark ---- */

/*
 * A copy of a retrying job that comes back before its run_after (a
 * duplicate copy, or a redelivery after a crash) is delayed again for the
 * time still to wait, uses no attempt, and the job is applied once when
 * its time comes.
 */
START_TEST(test_early_copy_waits)
{
    struct itest t;
    char key[200], body[512];
    itest_retry_conf = "base_delay_ms = 100; max_delay_ms = 4000; jitter = \"none\";";
    itest_setup(&t, "early", "idemq_test.record", "", "");
    itest_retry_conf = NULL;
    snprintf(key, sizeof key, "%s:early", t.name);
    {
        const char *vals[2] = {key, t.name};
        PGresult *r = PQexecParams(t.db,
                                   "INSERT INTO idemq.jobs (key, state, source_queue, "
                                   "payload_sha256, attempts, run_after) VALUES ($1, "
                                   "'retrying', $2, 'x', 1, clock_timestamp() + interval '3 s')",
                                   2, NULL, vals, NULL, NULL, 0);
        ck_assert_msg(PQresultStatus(r) == PGRES_COMMAND_OK, "%s", PQerrorMessage(t.db));
        PQclear(r);
    }
    payout(body, sizeof body, key, NULL);
    itest_publish(&t, (const char *[]){body}, 1);
    itest_run_until_idle(&t, 6);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
    ck_assert_int_ge(itest_long(&t, "SELECT count(*) FROM idemq.attempts WHERE key = $1 AND "
                                    "outcome = 'delayed'",
                                key),
                     1);
    /* applied no earlier than its run_after */
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq_test.effects e JOIN idemq.jobs j "
                                    "USING (key) WHERE key = $1 AND e.created_at < j.first_seen_at "
                                    "+ interval '2.5 s'",
                                key),
                     0);
    itest_teardown(&t);
}
END_TEST

/*
 * A parked job whose dead-letter publish was never confirmed (the process
 * died between the commit and the confirm): a redelivered copy publishes
 * the dead letter again (repark) and the ledger notes the confirm; nothing
 * is applied.
 */
START_TEST(test_repark_unconfirmed)
{
    struct itest t;
    char key[200], body[512], dlq[300];
    itest_setup(&t, "repark", "idemq_test.record", "", "");
    topology_dlq(&t.conf->inputs[0], dlq, sizeof dlq);
    snprintf(key, sizeof key, "%s:bad", t.name);
    payout(body, sizeof body, key, "\"raise\":\"22023\"");
    itest_publish(&t, (const char *[]){body}, 1);
    itest_run_until_idle(&t, 2);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1 AND "
                                    "dlq_published_at IS NOT NULL",
                                key),
                     1);
    /* as if the confirm never came: no copy on the broker, none noted */
    {
        struct broker *b;
        char err[512];
        ck_assert_int_eq(broker_open(t.conf, "itest purge", false, &b, err, sizeof err),
                         IDEMQ_OK);
        ck_assert_int_eq(broker_admin_purge(b, dlq), IDEMQ_OK);
        broker_close(b);
    }
    {
        const char *vals[1] = {key};
        /* ... a while ago (a copy meeting a park of moments ago waits first) */
        PQclear(PQexecParams(t.db, "UPDATE idemq.parked SET dlq_published_at = NULL, "
                                   "parked_at = parked_at - interval '1 minute' WHERE key = $1",
                             1, NULL, vals, NULL, NULL, 0));
    }
    itest_publish(&t, (const char *[]){body}, 1); /* the redelivered copy */
    itest_run_until_idle(&t, 2);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1 AND "
                                    "dlq_published_at IS NOT NULL",
                                key),
                     1);
    ck_assert_int_eq(itest_queue_ready(&t, dlq), 1);
    ck_assert_int_eq(itest_queue_ready(&t, t.name), 0);
    itest_teardown(&t);
}
END_TEST

/* ---- deploys that take the effect away ---- */

enum deploy_fault {
    DEPLOY_DROP_PLAIN,     /* DROP FUNCTION + CREATE another signature; jobs arrive meanwhile */
    DEPLOY_DROP_ISOLATING, /* DROP FUNCTION while jobs wait for their retry */
    DEPLOY_DROP_TABLE,     /* DROP TABLE the effect writes (42P01 inside the effect) */
    DEPLOY_REVOKE,         /* REVOKE EXECUTE from the run role (made by migrate --grant) */
};

/* The test's own effect: writes its key into the test's own table. */
static void deploy_effect(struct itest *t, const char *args)
{
    char sql[1200];
    snprintf(sql, sizeof sql,
             "CREATE FUNCTION idemq_test.%s_fx(%s) "
             "RETURNS jsonb LANGUAGE plpgsql AS $fn$ BEGIN "
             "PERFORM idemq_test.switches($1, $2, $3); "
             "INSERT INTO idemq_test.%s_t (key) VALUES ($1); "
             "RETURN jsonb_build_object('ok', true); END $fn$",
             t->name, args, t->name);
    itest_sql(t, sql);
}

static long deploy_count(struct itest *t, const char *what)
{
    char sql[400];
    snprintf(sql, sizeof sql, "SELECT %s FROM idemq_test.%s_t", what, t->name);
    return itest_long(t, sql, NULL);
}

/* Polls the test's table until it holds want rows (or the deadline). */
static long deploy_wait(struct itest *t, long want, int ms)
{
    long v = -1;
    for (int waited = 0; waited <= ms; waited += 50) {
        if ((v = deploy_count(t, "count(*)")) >= want)
            return v;
        sleep_ms(50);
    }
    return v;
}

/* A counter or gauge line of /metrics ("name value"), or -1. */
static long metric(const char *url, const char *name)
{
    char out[32768], pat[200];
    const char *p;
    snprintf(pat, sizeof pat, "\n%s ", name);
    if (itest_http_get(url, out, sizeof out) != 200 || !(p = strstr(out, pat)))
        return -1;
    return atol(p + strlen(pat));
}

static void publish_deploy(struct itest *t, const char *prefix, int n, const char *extra)
{
    publish_keys(t, prefix, n, extra);
}

/*
 * A deploy takes the effect away under a running worker, with jobs in
 * flight; then puts it back (a new OID, or a new table). Nothing may be
 * parked or applied meanwhile; the worker says NOT READY (logged once, not
 * once per check or per redelivery), gives the deliveries back, and applies
 * them by itself within broker.reconnect_max_ms (1 s here) of the effect
 * being back.
 */
static void deploy_case(enum deploy_fault fault, const char *tag)
{
    struct itest t;
    char log[300], ready_url[64], metrics_url[64], sql[600], cfg[200], effect[200];
    char out[4096], role[100] = "", dsn[600];
    const char *env[2] = {NULL, NULL};
    const char *fatal = "idemq_attempts_total{class=\"fatal\"}";
    const char *sig = "p_key text, p_payload jsonb, p_meta jsonb";
    int port = itest_free_port(), st, lines;
    long long t0;
    long fatals = -1, total;
    pid_t pid;

    snprintf(cfg, sizeof cfg, "metrics: { listen = \"127.0.0.1:%d\"; };", port);
    itest_extra_conf = cfg;
    itest_broker_conf = "reconnect_max_ms = 1000;";
    itest_retry_conf = "base_delay_ms = 1500; jitter = \"none\";";
    itest_setup(&t, tag, "idemq_test.record", "workers = 1; batch_max = 20;", "");
    snprintf(sql, sizeof sql, "CREATE TABLE idemq_test.%s_t (key text NOT NULL)", t.name);
    itest_sql(&t, sql);
    deploy_effect(&t, sig);
    snprintf(effect, sizeof effect, "idemq_test.%s_fx", t.name);
    itest_write_config(&t, t.cfg_path, t.name, effect, "workers = 1; batch_max = 20;", "");
    itest_extra_conf = itest_broker_conf = itest_retry_conf = NULL;
    snprintf(ready_url, sizeof ready_url, "http://127.0.0.1:%d/ready", port);
    snprintf(metrics_url, sizeof metrics_url, "http://127.0.0.1:%d/metrics", port);
    snprintf(log, sizeof log, "/tmp/%s.log", t.name);

    if (fault == DEPLOY_REVOKE) {
        /* a least-privilege role: every batch takes the isolating path, whose
         * SECURITY DEFINER functions call the effect with the owner's rights */
        char *u;
        snprintf(role, sizeof role, "%s_r", t.name);
        snprintf(sql, sizeof sql, "CREATE ROLE %s LOGIN", role);
        itest_sql(&t, sql);
        snprintf(sql, sizeof sql, "migrate --grant %s", role);
        ck_assert_int_eq(itest_idemq(&t, sql, out, sizeof out), 0);
        snprintf(dsn, sizeof dsn, "IDEMQ_PG_DSN=%s", getenv("IDEMQ_PG_DSN"));
        ck_assert_ptr_nonnull(u = strstr(dsn, "user="));
        snprintf(u, sizeof dsn - (size_t)(u - dsn), "user=%s", role);
        env[0] = dsn;
    }
    pid = itest_spawn_log(t.cfg_path, 4, env[0] ? env : NULL, log);
    if (fault == DEPLOY_DROP_ISOLATING) {
        /* first attempts fail transiently: the keys wait in 'retrying', and
         * their next delivery takes the isolating path */
        publish_deploy(&t, "a", 10, "\"raise\":\"40001\",\"raise_until\":1");
        ck_assert_int_eq(wait_count(&t,
                                    "SELECT count(*) FROM idemq.jobs WHERE key LIKE $1 || ':%' "
                                    "AND state = 'retrying'",
                                    t.name, 10, itest_ms(10000)),
                         10);
    } else {
        publish_deploy(&t, "a", 10, NULL);
        ck_assert_int_eq(deploy_wait(&t, 10, itest_ms(10000)), 10);
    }
    /* the deploy */
    if (fault == DEPLOY_REVOKE) {
        snprintf(sql, sizeof sql,
                 "REVOKE EXECUTE ON FUNCTION idemq_test.%s_fx(text, jsonb, jsonb) FROM PUBLIC, %s",
                 t.name, role);
        itest_sql(&t, sql);
    } else if (fault == DEPLOY_DROP_TABLE) {
        snprintf(sql, sizeof sql, "DROP TABLE idemq_test.%s_t", t.name);
        itest_sql(&t, sql);
    } else {
        snprintf(sql, sizeof sql, "DROP FUNCTION idemq_test.%s_fx(text, jsonb, jsonb)", t.name);
        itest_sql(&t, sql);
        if (fault == DEPLOY_DROP_PLAIN) /* a changed signature: the name, not the function */
            deploy_effect(&t, "p_key text, p_payload jsonb");
    }
    if (fault != DEPLOY_DROP_ISOLATING)
        publish_deploy(&t, "b", 10, NULL); /* in flight while the effect is gone */
    /* NOT READY, and several failed tries (the deliveries given back each time) */
    for (int i = 0; i < 300 && fatals < 3; i++) {
        fatals = metric(metrics_url, fatal);
        sleep_ms(50);
    }
    ck_assert_msg(fatals >= 3, "the worker did not fail as a deploy error (fatal %ld; log %s)",
                  fatals, log);
    ck_assert_int_eq(itest_http_get(ready_url, out, sizeof out), 503);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE source_queue = $1",
                                t.name),
                     0);
    /* logged once, not once per check */
    lines = itest_count_lines(log, "NOT READY");
    ck_assert_msg(lines >= 1 && lines <= 2, "%d NOT READY lines for %ld failed tries (log %s)",
                  lines, fatals, log);
    /* the deploy is finished: the effect is back (a new OID, or a new table) */
    if (fault == DEPLOY_REVOKE) {
        snprintf(sql, sizeof sql,
                 "GRANT EXECUTE ON FUNCTION idemq_test.%s_fx(text, jsonb, jsonb) TO %s", t.name,
                 role);
        itest_sql(&t, sql);
        total = 20;
    } else if (fault == DEPLOY_DROP_TABLE) {
        snprintf(sql, sizeof sql, "CREATE TABLE idemq_test.%s_t (key text NOT NULL)", t.name);
        itest_sql(&t, sql);
        total = 10;
    } else {
        if (fault == DEPLOY_DROP_PLAIN) {
            snprintf(sql, sizeof sql, "DROP FUNCTION idemq_test.%s_fx(text, jsonb)", t.name);
            itest_sql(&t, sql);
        }
        deploy_effect(&t, sig);
        total = fault == DEPLOY_DROP_ISOLATING ? 10 : 20;
    }
    t0 = mono_ms();
    ck_assert_int_eq(deploy_wait(&t, total, itest_ms(10000)), total);
    /* within reconnect_max_ms (1 s), plus a batch's time */
    ck_assert_int_le(mono_ms() - t0, itest_ms(1000 + 2000));
    for (int i = 0; i < 100 && itest_http_get(ready_url, out, sizeof out) != 200; i++)
        sleep_ms(50);
    ck_assert_int_eq(itest_http_get(ready_url, out, sizeof out), 200);
    publish_deploy(&t, "c", 5, NULL); /* and goes on */
    st = itest_wait(pid, itest_ms(60000));
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "status 0x%x (log %s)", st,
                  log);
    ck_assert_int_eq(deploy_count(&t, "count(*)"), total + 5);
    ck_assert_int_eq(deploy_count(&t, "count(DISTINCT key)"), total + 5);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE source_queue = $1",
                                t.name),
                     0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key LIKE $1 || ':%' "
                                    "AND state <> 'applied'",
                                t.name),
                     0);
    unlink(log);
    if (fault == DEPLOY_REVOKE) {
        snprintf(sql, sizeof sql, "DROP OWNED BY %s; DROP ROLE %s", role, role);
        itest_sql(&t, sql);
    }
    itest_teardown(&t);
}

/* The plain (lean) path: the prepared statement names the effect. */
START_TEST(test_deploy_drop_plain)
{
    deploy_case(DEPLOY_DROP_PLAIN, "dplain");
}
END_TEST

/* The isolating path (idemq.apply_batch): the effect's OID of the session. */
START_TEST(test_deploy_drop_isolating)
{
    deploy_case(DEPLOY_DROP_ISOLATING, "disol");
}
END_TEST

/* EXECUTE on the effect revoked from the run role (isolating path). */
START_TEST(test_deploy_revoke)
{
    deploy_case(DEPLOY_REVOKE, "drevoke");
}
END_TEST

/* A table the effect writes is dropped: 42P01 inside the effect. */
START_TEST(test_deploy_drop_table)
{
    deploy_case(DEPLOY_DROP_TABLE, "dtable");
}
END_TEST

/* ---- server notices go through the logger ---- */

/* Effect idemq_test.<name>_fx: RAISE NOTICE and WARNING whose text holds a
 * newline followed by what would be a forged line. */
static void notice_effect(struct itest *t)
{
    char sql[1200];
    snprintf(sql, sizeof sql,
             "CREATE FUNCTION idemq_test.%s_fx(p_key text, p_payload jsonb, p_meta jsonb) "
             "RETURNS jsonb LANGUAGE plpgsql AS $fn$ BEGIN "
             "RAISE NOTICE 'hello from %%', E'\\n' || (p_payload->>'forge'); "
             "RAISE WARNING 'careful%%', E'\\nFORGED warning line'; "
             "RAISE NOTICE 'declined' USING DETAIL = 'Key (card)=(4111111111111111)'; "
             "RETURN idemq_test.record(p_key, p_payload, p_meta); END $fn$",
             t->name);
    itest_sql(t, sql);
}

/* Checks log (format json or text) after one job with key: every line is
 * one of idemq's (a JSON object with "ts", or a text line with the time and
 * "idemq["), the notice and the warning are lines of their own, escaped,
 * with the job's key. */
static void check_notice_log(const char *log, bool json, const char *key)
{
    FILE *f = fopen(log, "r");
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    int notices = 0, warnings = 0, lines = 0;

    ck_assert_ptr_nonnull(f);
    while ((len = getline(&line, &cap, f)) > 0) {
        lines++;
        if (line[len - 1] == '\n')
            line[--len] = '\0';
        /* a notice's DETAIL may quote row values: left out by default */
        ck_assert_msg(!strstr(line, "4111111111111111"), "DETAIL logged: %s", line);
        if (json) {
            json_error_t err;
            json_t *o = json_loads(line, 0, &err), *ev, *msg, *k, *lvl;
            ck_assert_msg(json_is_object(o) && json_object_get(o, "ts"),
                          "line %d of %s is not one of idemq's JSON objects: %s", lines, log,
                          line);
            ev = json_object_get(o, "event");
            msg = json_object_get(o, "msg");
            k = json_object_get(o, "key");
            lvl = json_object_get(o, "level");
            if (json_is_string(ev) && strcmp(json_string_value(ev), "db_notice") == 0) {
                ck_assert_msg(json_is_string(k) && strcmp(json_string_value(k), key) == 0,
                              "notice without the job's key: %s", line);
                if (strstr(json_string_value(msg), "hello from \n{\"level\":\"error\"")) {
                    ck_assert_str_eq(json_string_value(lvl), "info");
                    notices++;
                }
                if (strstr(json_string_value(msg), "careful\nFORGED warning line")) {
                    ck_assert_str_eq(json_string_value(lvl), "warn");
                    warnings++;
                }
            }
            json_decref(o);
        } else {
            ck_assert_msg(len > 30 && line[4] == '-' && strstr(line, " idemq["),
                          "line %d of %s is not one of idemq's: %s", lines, log, line);
            ck_assert_msg(strstr(line, "FORGED") != line, "a forged line: %s", line);
            if (strstr(line, "PostgreSQL NOTICE: hello from \\n{\"level\":\"error\"") &&
                strstr(line, key))
                notices++;
            if (strstr(line, "[WARN]") && strstr(line, "careful\\nFORGED warning line") &&
                strstr(line, key))
                warnings++;
        }
    }
    free(line);
    fclose(f);
    ck_assert_msg(notices >= 1 && warnings >= 1, "notice %d, warning %d lines in %s", notices,
                  warnings, log);
}

START_TEST(test_notice_logged)
{
    struct itest t;
    char log[300], effect[200], key[200], body[512];

    itest_log_conf = "format = \"json\";";
    itest_setup(&t, "notice", "idemq_test.record", "workers = 1;", "");
    notice_effect(&t);
    snprintf(effect, sizeof effect, "idemq_test.%s_fx", t.name);
    itest_write_config(&t, t.cfg_path, t.name, effect, "workers = 1;", "");
    itest_log_conf = NULL;
    snprintf(log, sizeof log, "/tmp/%s.log", t.name);
    snprintf(key, sizeof key, "%s:json", t.name);
    snprintf(body, sizeof body,
             "{\"job_id\":\"%s\",\"amount_minor\":1,\"forge\":\"{\\\"level\\\":\\\"error\\\","
             "\\\"forged\\\":true}\"}",
             key);
    itest_publish(&t, (const char *[]){body}, 1);
    ck_assert_int_eq(run_logged(&t, 1, log, 60000), 0);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
    check_notice_log(log, true, key);
    unlink(log);
    /* the text format */
    itest_write_config(&t, t.cfg_path, t.name, effect, "workers = 1;", "");
    snprintf(key, sizeof key, "%s:text", t.name);
    snprintf(body, sizeof body,
             "{\"job_id\":\"%s\",\"amount_minor\":1,\"forge\":\"{\\\"level\\\":\\\"error\\\"}\"}",
             key);
    itest_publish(&t, (const char *[]){body}, 1);
    ck_assert_int_eq(run_logged(&t, 1, log, 60000), 0);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
    check_notice_log(log, false, key);
    unlink(log);
    itest_teardown(&t);
}
END_TEST

/* ---- two copies of a parking key ---- */

/*
 * Two copies of one key on two workers: the first parks it while the
 * second waits on its row lock. The first's dead-letter copy is confirmed
 * (noted late: a test hook widens the gap); the second must not publish
 * another one. One park, one copy in the DLQ, nothing applied.
 */
START_TEST(test_repark_race)
{
    struct itest t;
    char key[200], body[512], dlq[300];
    const char *env[] = {"IDEMQ_TEST_MARK_DELAY_MS=1500", NULL};
    pid_t pid;
    int st;

    itest_setup(&t, "rprace", "idemq_test.record", "workers = 2; batch_max = 1;", "");
    topology_dlq(&t.conf->inputs[0], dlq, sizeof dlq);
    snprintf(key, sizeof key, "%s:twice", t.name);
    payout(body, sizeof body, key, "\"sleep_ms\":300,\"raise\":\"22023\"");
    pid = itest_spawn(&t, t.cfg_path, 4, env);
    for (int i = 0; i < 100 && itest_queue_consumers(&t, t.name) < 2; i++)
        sleep_ms(100);
    ck_assert_int_eq(itest_queue_consumers(&t, t.name), 2);
    itest_publish(&t, (const char *[]){body, body}, 2); /* one to each worker */
    st = itest_wait(pid, itest_ms(60000));
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "status 0x%x", st);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1", key), 1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1 AND "
                                    "dlq_published_at IS NOT NULL",
                                key),
                     1);
    ck_assert_int_eq(itest_queue_ready(&t, dlq), 1);
    ck_assert_int_eq(itest_queue_ready(&t, t.name), 0);
    itest_teardown(&t);
}
END_TEST

/* ---- jobs show labels an adopted intent certain ---- */

/*
 * An intent whose outcome was unknown and whose reference the provider
 * later confirmed (a lookup or a resend under the key adopted it) keeps
 * `uncertain` set; jobs show printed "applied (outcome uncertain)". The
 * provider's answer about the key makes it certain. An intent still
 * waiting for that answer stays "outcome uncertain".
 */
START_TEST(test_jobs_show_adopted)
{
    struct itest t;
    char sql[1500], out[16384], args[300];
    const char *cases[][3] = {
        /* key suffix, state and reference, the label wanted */
        {"adopted", "'applied', 'ref-42'", "(certain: confirmed by the provider after 1 unknown"},
        {"unknown", "'unknown', NULL", "(outcome uncertain)"},
    };

    itest_setup(&t, "show", "idemq_test.record", "", "");
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        snprintf(sql, sizeof sql,
                 "INSERT INTO idemq.jobs (key, state, attempts, first_seen_at, applied_at) "
                 "VALUES ('%s:%s', 'applied', 2, now(), now()); "
                 "INSERT INTO idemq.intents (key, input, provider, source_queue, idempotent, "
                 "  state, provider_ref, uncertain, unknowns, requests, request_sha256, "
                 "  request_body, body, confirmed_at) "
                 "VALUES ('%s:%s', 'in', 'prov', '%s', true, %s, true, 1, 2, 'x', '\\x7b7d', "
                 "  '\\x7b7d', now())",
                 t.name, cases[i][0], t.name, cases[i][0], t.name, cases[i][1]);
        itest_sql(&t, sql);
        snprintf(args, sizeof args, "jobs show '%s:%s'", t.name, cases[i][0]);
        ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 0);
        ck_assert_msg(strstr(out, cases[i][2]), "no \"%s\" in:\n%s", cases[i][2], out);
        if (i == 0)
            ck_assert_msg(!strstr(out, "outcome uncertain"), "%s", out);
    }
    itest_teardown(&t);
}
END_TEST

/* ---- broker permissions ---- */

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

/* amqp://user:pw@ the test broker's host and port */
static void user_url(char *buf, size_t len, const char *user, const char *pw)
{
    snprintf(buf, len, "amqp://%s:%s@127.0.0.1%s", user, pw,
             strrchr(getenv("IDEMQ_AMQP_URL"), ':'));
}

/* Whether user (URL in IDEMQ_AMQP_URL now) gets a confirmed publish
 * through exchange ex with routing key rk. */
static bool may_publish(struct itest *t, const char *ex, const char *rk)
{
    struct conf *c;
    struct broker *b;
    char err[1024];
    struct broker_props p = {NULL, NULL, NULL, true, NULL, NULL};
    bool ok;
    ck_assert_msg(conf_load(t->cfg_path, &c, err, sizeof err) == IDEMQ_OK, "%s", err);
    ck_assert_msg(broker_open(c, "itest perms", true, &b, err, sizeof err) == IDEMQ_OK, "%s",
                  err);
    ok = broker_publish(b, ex, rk, "{}", 2, &p) == IDEMQ_OK &&
         broker_wait_confirms(b, 5000) == IDEMQ_OK;
    broker_close(b);
    conf_free(c);
    return ok;
}

/*
 * The least-privilege RabbitMQ users of consumer/OPERATIONS.md: `run` may
 * publish only to its inputs' delay and dead-letter exchanges and consume only its input
 * queues (no amq.default: that reaches every queue of the vhost); the
 * operator user of `idemq redrive` / `parked list` reads <queue>.dead and
 * publishes through amq.default. Under them: a job applies, one retries,
 * one parks; the operator lists and redrives it, the run user applies it;
 * the run user can neither publish into an unrelated queue nor redrive.
 */
START_TEST(test_broker_least_privilege)
{
    struct itest t;
    char run_user[96], op_user[96], pw[64], run_url[300], op_url[300], other[128], out[16384];
    char keys[3][128], bufs[3][256], args[300], sql[400], dlq[TOPOLOGY_NAME_MAX];
    const char *bodies[3] = {bufs[0], bufs[1], bufs[2]};
    char *admin_url = strdup(getenv("IDEMQ_AMQP_URL"));
    struct broker *b;
    char err[512];

    itest_retry_conf = "base_delay_ms = 3000; max_delay_ms = 3000; jitter = \"none\"; "
                       "rescue_after_s = 1;";
    itest_extra_conf = "topology: { verify = \"passive\"; };";
    itest_setup(&t, "bperm", "idemq_test.record", "", "");
    itest_retry_conf = itest_extra_conf = NULL;
    topology_dlq(&t.conf->inputs[0], dlq, sizeof dlq);
    snprintf(run_user, sizeof run_user, "%s_run", t.name);
    snprintf(op_user, sizeof op_user, "%s_op", t.name);
    snprintf(pw, sizeof pw, "Bp-%d", (int)getpid());
    snprintf(other, sizeof other, "%s_other", t.name);
    ck_assert_int_eq(broker_open(t.conf, "itest other", false, &b, err, sizeof err), IDEMQ_OK);
    ck_assert_int_eq(broker_admin_declare_queue(b, other, NULL, false), IDEMQ_OK);
    broker_close(b);
    /* exactly as consumer/OPERATIONS.md "Roles and permissions" writes them (queue idemq.payouts there) */
    ctl("add_user %s %s", run_user, pw);
    ctl("set_permissions -p / %s '^$' '^%s\\.(retry|dlx)$' '^%s$'", run_user, t.name, t.name);
    ctl("add_user %s %s", op_user, pw);
    ctl("set_permissions -p / %s '^$' '^amq\\.default$' '^%s\\.dead$'", op_user, t.name);
    user_url(run_url, sizeof run_url, run_user, pw);
    user_url(op_url, sizeof op_url, op_user, pw);

    /* run: one applies, one retries (its copy then lost on the broker, and
     * rescued from the ledger), one parks (until its key is fixed) */
    for (int i = 0; i < 3; i++)
        snprintf(keys[i], sizeof keys[i], "%s:%d", t.name, i);
    snprintf(bufs[0], sizeof bufs[0], "{\"job_id\":\"%s\"}", keys[0]);
    snprintf(bufs[1], sizeof bufs[1], "{\"job_id\":\"%s\",\"raise\":\"40001\",\"raise_until\":1}",
             keys[1]);
    snprintf(bufs[2], sizeof bufs[2], "{\"job_id\":\"%s\"}", keys[2]);
    snprintf(sql, sizeof sql, "INSERT INTO idemq_test.failing VALUES ('%s', '22023')", keys[2]);
    itest_sql(&t, sql);
    itest_publish(&t, bodies, 3);
    setenv("IDEMQ_AMQP_URL", run_url, 1);
    ck_assert_int_eq(itest_idemq(&t, "run --until-idle 1", out, sizeof out), 0);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, keys[0]), 1);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, keys[2]), 0);
    ck_assert_int_eq(itest_queue_ready(&t, dlq), 1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key = $1 AND "
                                    "state = 'retrying'",
                                keys[1]),
                     1);
    {
        char bucket[TOPOLOGY_NAME_MAX];
        topology_bucket_queue(&t.conf->inputs[0], topology_bucket(3000), bucket, sizeof bucket);
        ck_assert_int_eq(broker_open(t.conf, "itest purge", false, &b, err, sizeof err),
                         IDEMQ_OK);
        ck_assert_int_eq(broker_admin_purge(b, bucket), IDEMQ_OK);
        broker_close(b);
    }
    {
        char log[300];
        int st;
        snprintf(log, sizeof log, "/tmp/%s.log", t.name);
        st = itest_wait(itest_spawn_log(t.cfg_path, 6, NULL, log), itest_ms(30000));
        ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0,
                      "idemq run under the run user did not finish (status 0x%x, log %s)", st,
                      log);
        ck_assert_msg(itest_long(&t, EFFECTS_FOR, keys[1]) == 1,
                      "the lost retry was not rescued (log %s)", log);
        unlink(log);
    }
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.retry_rescues WHERE key = $1",
                                keys[1]),
                     1);
    /* the run user reaches no other queue, not even its own work queue directly */
    ck_assert_msg(!may_publish(&t, "", other), "the run user published into %s", other);
    ck_assert_msg(!may_publish(&t, "", t.name), "the run user published via amq.default");
    ck_assert_msg(may_publish(&t, t.name, t.name) == false,
                  "the run user published to the work exchange");
    /* and cannot redrive */
    snprintf(args, sizeof args, "redrive --input %s", t.name);
    ck_assert_int_ne(itest_idemq(&t, args, out, sizeof out), 0);
    ck_assert_int_eq(itest_queue_ready(&t, dlq), 1);

    /* the operator lists and redrives */
    setenv("IDEMQ_AMQP_URL", op_url, 1);
    snprintf(args, sizeof args, "parked list --input %s", t.name);
    ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 0);
    ck_assert_msg(strstr(out, keys[2]), "%s", out);
    snprintf(sql, sizeof sql, "DELETE FROM idemq_test.failing WHERE key = '%s'", keys[2]);
    itest_sql(&t, sql);
    snprintf(args, sizeof args, "redrive --input %s", t.name);
    ck_assert_msg(itest_idemq(&t, args, out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "redriven"), "%s", out);
    setenv("IDEMQ_AMQP_URL", run_url, 1);
    ck_assert_int_eq(itest_idemq(&t, "run --until-idle 2", out, sizeof out), 0);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, keys[2]), 1);
    ck_assert_int_eq(itest_queue_ready(&t, dlq), 0);

    setenv("IDEMQ_AMQP_URL", admin_url, 1);
    free(admin_url);
    ck_assert_int_eq(itest_queue_ready(&t, other), 0);
    ctl("delete_user %s", run_user);
    ctl("delete_user %s", op_user);
    ck_assert_int_eq(broker_open(t.conf, "itest other", false, &b, err, sizeof err), IDEMQ_OK);
    ck_assert_int_eq(broker_admin_delete_queue(b, other), IDEMQ_OK);
    broker_close(b);
    itest_teardown(&t);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("total");
    TCase *tc = tcase_create("total");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_claim_failed_inside_txn);
    tcase_add_test(tc, test_search_path_pinned);
    tcase_add_test(tc, test_deep_and_large_headers);
    tcase_add_test(tc, test_locked_key);
    tcase_add_test(tc, test_failure_cannot_be_recorded);
    tcase_add_test(tc, test_contention_while_recording);
    tcase_add_test(tc, test_empty_header_names);
    tcase_add_test(tc, test_oversized_body);
    tcase_add_test(tc, test_redrive_refuses_foreign_origin);
    tcase_add_test(tc, test_frozen_database);
    tcase_add_test(tc, test_many_partitions);
    tcase_add_test(tc, test_jobs_show_order);
    tcase_add_test(tc, test_oldest_age_resets);
    tcase_add_test(tc, test_hostile_producer);
    tcase_add_test(tc, test_broker_restart_resume);
    tcase_add_test(tc, test_early_copy_waits);
    tcase_add_test(tc, test_repark_unconfirmed);
    suite_add_tcase(s, tc);
    tc = tcase_create("deploy"); /* CK_RUN_CASE=deploy runs these alone */
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_deploy_drop_plain);
    tcase_add_test(tc, test_deploy_drop_isolating);
    tcase_add_test(tc, test_deploy_drop_table);
    tcase_add_test(tc, test_deploy_revoke);
    suite_add_tcase(s, tc);
    tc = tcase_create("notice");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_notice_logged);
    suite_add_tcase(s, tc);
    tc = tcase_create("show");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_jobs_show_adopted);
    suite_add_tcase(s, tc);
    tc = tcase_create("perms");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_broker_least_privilege);
    suite_add_tcase(s, tc);
    tc = tcase_create("repark");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_repark_race);
    suite_add_tcase(s, tc);
    /* least-privilege mode (scripts/test): these again, as the deployment's roles */
    itest_lp_tcase(s, (const TTest *const[]){test_jobs_show_order, NULL});
    return check_run(s);
}
