/*
 * Integration tests of the total worker loop (issue 8): no message,
 * database answer or broker event stops a worker or loses a delivery. Each
 * test reproduces one finding against the real RabbitMQ and PostgreSQL and
 * the real idemq binary (see itest.h); each failed before its fix.
 */
#include <check.h>

#include "check_run.h"
#include <amqp.h>
#include <openssl/evp.h>
#include <signal.h>
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
    char key[200], body[512], log[300], url[64], out[4096];
    pid_t pid;
    int st, not_ready = 0;

    itest_extra_conf = "metrics: { listen = \"127.0.0.1:19387\"; };";
    itest_retry_conf = "base_delay_ms = 100; max_delay_ms = 200; jitter = \"none\";";
    itest_setup(&t, "contend", "idemq_test.record", "", "");
    itest_extra_conf = NULL;
    itest_retry_conf = NULL;
    snprintf(url, sizeof url, "http://127.0.0.1:19387/ready");
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
    ck_assert_int_eq(broker_declare_queue(b, victim, NULL, false), IDEMQ_OK);
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
    ck_assert_int_eq(broker_delete_queue(b, victim), IDEMQ_OK);
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
    char log[300], url[64], out[4096], cont[600];
    pid_t pid;
    int st, not_ready = 0, stopped;
    long long t0;

    itest_extra_conf = "database: { statement_timeout_ms = 1000; }; "
                       "metrics: { listen = \"127.0.0.1:19388\"; };";
    itest_setup(&t, "frozen", "idemq_test.record", "workers = 2; batch_max = 10;", "");
    itest_extra_conf = NULL;
    snprintf(url, sizeof url, "http://127.0.0.1:19388/ready");
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
    suite_add_tcase(s, tc);
    return check_run(s);
}
