/*
 * Integration tests of the ledger lifecycle: the dedup window
 * (a replay inside it is a duplicate, after it as documented), pruning that
 * never removes an unsettled key, the archive (still readable, exported with
 * checksums that verify), retention (older history gone, newer complete),
 * one maintainer at a time, maintenance by a role that may only EXECUTE,
 * and the in-place upgrade of a populated version 3 ledger.
 *
 * Every test runs in a database of its own (time moves there: maintenance
 * acts at an owner-only idemq.maintenance_now), against the real servers.
 */
#include <check.h>

#include "check_run.h"
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "broker_admin.h"
#include "itest.h"
#include "ledger_db.h"
#include "ledger_migrate.h"
#include "topology.h"

#define EFFECTS_FOR "SELECT count(*) FROM idemq_test.effects WHERE key = $1"
#define HISTORY(o) "SELECT count(*) FROM idemq.key_history($1) WHERE outcome = '" o "'"

static char base_dsn[512], own_db[64];

/* Points IDEMQ_PG_DSN (this test's process and the idemq it starts) at a
 * new database of its own. */
static void own_database(const char *tag)
{
    char err[512], sql[256], dsn[700];
    const char *base = getenv("IDEMQ_PG_DSN");
    PGconn *c;
    ck_assert_ptr_nonnull(base);
    snprintf(base_dsn, sizeof base_dsn, "%s", base);
    snprintf(own_db, sizeof own_db, "idemq_lc_%s_%d", tag, (int)getpid());
    c = ledger_db_connect(base_dsn, "itest lifecycle", 0, err, sizeof err);
    ck_assert_msg(c != NULL, "%s", err);
    snprintf(sql, sizeof sql, "DROP DATABASE IF EXISTS %s", own_db);
    PQclear(PQexec(c, sql));
    snprintf(sql, sizeof sql, "CREATE DATABASE %s", own_db);
    {
        PGresult *r = PQexec(c, sql);
        ck_assert_msg(PQresultStatus(r) == PGRES_COMMAND_OK, "%s", PQerrorMessage(c));
        PQclear(r);
    }
    PQfinish(c);
    snprintf(dsn, sizeof dsn, "%s dbname=%s", base_dsn, own_db); /* the last dbname wins */
    setenv("IDEMQ_PG_DSN", dsn, 1);
}

static void drop_own_database(void)
{
    char err[512], sql[256];
    PGconn *c = ledger_db_connect(base_dsn, "itest lifecycle", 0, err, sizeof err);
    setenv("IDEMQ_PG_DSN", base_dsn, 1);
    if (!c)
        return;
    snprintf(sql, sizeof sql, "DROP DATABASE IF EXISTS %s WITH (FORCE)", own_db);
    PQclear(PQexec(c, sql));
    PQfinish(c);
}

/* A test's ledger: own database, the ledger.* windows given, migrated by
 * `idemq migrate` (which writes the windows and makes the first
 * partitions). */
static void lc_setup_more(struct itest *t, const char *tag, const char *ledger,
                          const char *more)
{
    static char extra[768];
    char out[4096];
    own_database(tag);
    snprintf(extra, sizeof extra, "ledger: { %s };%s", ledger, more);
    itest_extra_conf = extra;
    itest_setup(t, tag, "idemq_test.record", "", "");
    ck_assert_msg(itest_idemq(t, "migrate", out, sizeof out) == 0, "%s", out);
}

static void lc_setup(struct itest *t, const char *tag, const char *ledger)
{
    lc_setup_more(t, tag, ledger, "");
}

static void lc_teardown(struct itest *t)
{
    itest_teardown(t);
    itest_extra_conf = NULL;
    itest_retry_conf = NULL;
    drop_own_database();
}

/* Publishes {"job_id": key, ...extra} with an AMQP timestamp (0: none). */
static void publish_ts(struct itest *t, const char *key, const char *extra, long long ts)
{
    struct broker *b;
    char err[512], body[512];
    json_t *orig = ts ? json_pack("{s:I}", "timestamp", (json_int_t)ts) : NULL;
    struct broker_props p = {NULL, NULL, NULL, true, NULL, orig};
    const struct conf_input *in = &t->conf->inputs[0];
    snprintf(body, sizeof body, "{\"job_id\":\"%s\",\"amount_minor\":100%s%s}", key,
             extra ? "," : "", extra ? extra : "");
    ck_assert_msg(broker_open(t->conf, "itest publish", true, &b, err, sizeof err) == 0, "%s",
                  err);
    ck_assert_msg(broker_publish(b, in->exchange, in->routing_key, body, strlen(body), &p) ==
                      IDEMQ_OK,
                  "%s", broker_error(b));
    ck_assert_msg(broker_wait_confirms(b, itest_ms(10000)) == IDEMQ_OK, "%s", broker_error(b));
    broker_close(b);
    json_decref(orig);
}

/* `idemq maintain --now '<SQL expression's value>'`; returns its output. */
static void maintain_at(struct itest *t, const char *when_sql, char *out, size_t len)
{
    char when[64], args[160];
    itest_text(t, when_sql, NULL, when, sizeof when);
    snprintf(args, sizeof args, "maintain --now '%s'", when);
    ck_assert_msg(itest_idemq(t, args, out, len) == 0, "%s", out);
}

static void key(struct itest *t, char *buf, size_t len, const char *what)
{
    snprintf(buf, len, "%s:%s", t->name, what);
}

/* 1. The dedup window. A replay inside it is a duplicate, even with an AMQP
 * timestamp older than the window (the key is still claimed). Past the
 * window (the claims pruned), a replay with an old timestamp is parked as
 * outside_dedup_window, and one without a timestamp is applied as new.
 * Pruning never removes a key that is not settled (retrying, parked). */
START_TEST(test_dedup_window)
{
    struct itest t;
    char k1[128], k2[128], k3[128], kr[128], kp[128], out[16384], args[256];
    long long old_ts = (long long)time(NULL) - 3 * 86400;

    itest_retry_conf = "max_attempts = 5; base_delay_ms = 600000; max_delay_ms = 600000;";
    lc_setup(&t, "window",
             "dedup_window_days = 2; partition_interval = \"1 hour\"; history_hot_days = 1; "
             "history_retention_days = 3;");
    key(&t, k1, sizeof k1, "k1");
    key(&t, k2, sizeof k2, "k2");
    key(&t, k3, sizeof k3, "k3");
    key(&t, kr, sizeof kr, "retrying");
    key(&t, kp, sizeof kp, "parked");
    publish_ts(&t, k1, NULL, 0);
    publish_ts(&t, k2, NULL, 0);
    publish_ts(&t, k3, NULL, 0);
    itest_run_until_idle(&t, 1); /* a plain batch: its history is a batches row */
    publish_ts(&t, kr, "\"raise\":\"IR001\"", 0);
    publish_ts(&t, kp, "\"raise\":\"22023\"", 0);
    itest_run_until_idle(&t, 2);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key LIKE $1 || ':k%' "
                                    "AND state = 'applied'",
                                t.name),
                     3);

    /* inside the window: duplicates, whatever their timestamp */
    publish_ts(&t, k1, NULL, 0);
    publish_ts(&t, k3, NULL, old_ts);
    itest_run_until_idle(&t, 2);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, k1), 1);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, k3), 1);
    ck_assert_int_eq(itest_long(&t, HISTORY("duplicate"), k1), 1);
    ck_assert_int_eq(itest_long(&t, HISTORY("duplicate"), k3), 1);

    /* two days and two hours later: the applied keys are pruned, the
     * unsettled ones stay */
    maintain_at(&t, "SELECT now() + interval '2 days 2 hours'", out, sizeof out);
    ck_assert_msg(strstr(out, "keys pruned") != NULL, "%s", out);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key LIKE $1 || ':k%'",
                                t.name),
                     0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key = $1 AND state = "
                                    "'retrying'",
                                kr),
                     1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key = $1 AND state = "
                                    "'parked'",
                                kp),
                     1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1", kp), 1);
    /* the story of a pruned key is still told (from the archived batch) */
    snprintf(args, sizeof args, "jobs show %s", k1);
    ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "pruned past the dedup window") != NULL, "%s", out);
    ck_assert_msg(strstr(out, "applied, batch #") != NULL, "%s", out);

    /* past the window: an old message of a key no longer claimed is parked */
    publish_ts(&t, k2, NULL, old_ts);
    itest_run_until_idle(&t, 2);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, k2), 1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key = $1 AND state = "
                                    "'parked'",
                                k2),
                     1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1 AND "
                                    "error_code = 'outside_dedup_window' AND error_class = "
                                    "'permanent'",
                                k2),
                     1);
    /* ... and one without a timestamp is applied as new */
    publish_ts(&t, k1, NULL, 0);
    itest_run_until_idle(&t, 2);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, k1), 2);
    lc_teardown(&t);
}
END_TEST

/* Sleeps until the next multiple of step seconds (plus a little). */
static void next_boundary(int step)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    usleep((useconds_t)((step - ts.tv_sec % step) * 1000000L - ts.tv_nsec / 1000 + 200000));
}

/* 2. Archive and retention, with 10-second partitions: batch A, then batch
 * B in a later partition. Archived history is still read by `jobs show`;
 * its export verifies (idemq archive verify and sha256sum -c) and a changed
 * file does not. Past the retention of A but not of B: A's partitions are
 * dropped, its history gone; B's history is complete; the parked key stays
 * claimed and its open park stays. */
START_TEST(test_archive_and_retention)
{
    struct itest t;
    char ka[128], kb[128], kp[128], out[16384], args[512], dir[256], cmd[700], b_at[64],
        sql[512];

    lc_setup(&t, "archive",
             "dedup_window_days = 0.01; partition_interval = \"10 seconds\"; "
             "history_hot_days = 0.005; history_retention_days = 0.02;");
    key(&t, ka, sizeof ka, "a1");
    key(&t, kb, sizeof kb, "b1");
    key(&t, kp, sizeof kp, "parked");
    publish_ts(&t, kp, "\"raise\":\"22023\"", 0);
    itest_run_until_idle(&t, 1);
    next_boundary(10);
    publish_ts(&t, ka, NULL, 0);
    publish_ts(&t, ka, NULL, 0); /* a copy, in the same (plain) batch */
    itest_run_until_idle(&t, 1);
    next_boundary(10);
    publish_ts(&t, kb, NULL, 0);
    itest_run_until_idle(&t, 1);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, ka), 1);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, kb), 1);
    itest_text(&t, "SELECT applied_at FROM idemq.jobs WHERE key = $1", kb, b_at, sizeof b_at);
    /* A and B landed in different batch partitions */
    ck_assert_int_eq(itest_long(&t, "SELECT count(DISTINCT h.relname) FROM idemq.history_parts h, "
                                    "idemq.batches b WHERE h.kind = 'batches' AND b.at >= h.lo "
                                    "AND b.at < h.hi AND (b.keys[1] = $1 || ':a1' OR b.keys[1] = "
                                    "$1 || ':b1')",
                                t.name),
                     2);

    /* past the hot window: archived, still readable */
    maintain_at(&t, "SELECT now() + interval '8 minutes'", out, sizeof out);
    ck_assert_int_ge(itest_long(&t, "SELECT count(*) FROM idemq.history_parts WHERE kind = "
                                    "'batches' AND location = 'archive'",
                                NULL),
                     2);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.batches WHERE $1 = ANY (keys)", ka),
                     0);
    snprintf(args, sizeof args, "jobs show %s", ka);
    ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "applied, batch #") != NULL, "%s", out);
    ck_assert_msg(strstr(out, "duplicate delivery, no effect: a later copy in the same batch") != NULL, "%s", out);

    /* the export, checked by our verify and by sha256sum */
    snprintf(dir, sizeof dir, "/tmp/%s_archive", t.name);
    snprintf(cmd, sizeof cmd, "rm -rf %s && mkdir -p %s", dir, dir);
    ck_assert_int_eq(system(cmd), 0);
    snprintf(args, sizeof args, "archive export --dir %s", dir);
    ck_assert_msg(itest_idemq(&t, args, out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "exported ") != NULL, "%s", out);
    snprintf(args, sizeof args, "archive verify --dir %s", dir);
    ck_assert_msg(itest_idemq(&t, args, out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "OK batches_p") != NULL, "%s", out);
    snprintf(cmd, sizeof cmd, "cd %s && sha256sum --quiet -c *.sha256", dir);
    ck_assert_int_eq(system(cmd), 0);
    snprintf(cmd, sizeof cmd, "grep -l ':a1' %s/batches_p*.csv | head -n 1 | xargs sed -i "
                              "'s/:a1/:zz/'", dir);
    ck_assert_int_eq(system(cmd), 0);
    ck_assert_msg(itest_idemq(&t, args, out, sizeof out) == 1, "%s", out);
    ck_assert_msg(strstr(out, "FAILED batches_p") != NULL, "%s", out);
    snprintf(cmd, sizeof cmd, "cd %s && sha256sum --quiet -c *.sha256 >/dev/null 2>&1", dir);
    ck_assert_int_ne(system(cmd), 0);

    /* past A's retention, not B's (B's partition starts where A's ended, or
     * later): A's history is gone, B's complete; the parked key and its open
     * park stay */
    snprintf(sql, sizeof sql, "SELECT lo + interval '0.02 days' FROM idemq.history_parts WHERE "
                              "kind = 'batches' AND lo <= '%s' AND '%s' < hi", b_at, b_at);
    maintain_at(&t, sql, out, sizeof out);
    ck_assert_msg(strstr(out, "dropped") != NULL, "%s", out);
    snprintf(sql, sizeof sql, "SELECT count(*) FROM idemq.history_parts WHERE kind = 'batches' "
                              "AND location = 'dropped' AND hi <= '%s'", b_at);
    ck_assert_int_ge(itest_long(&t, sql, NULL), 1);
    snprintf(sql, sizeof sql, "SELECT count(*) FROM idemq.history_parts WHERE kind = 'batches' "
                              "AND location = 'archive' AND lo <= '%s' AND '%s' < hi", b_at, b_at);
    ck_assert_int_eq(itest_long(&t, sql, NULL), 1);
    snprintf(args, sizeof args, "jobs show %s", ka);
    ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 1);
    ck_assert_msg(strstr(out, "no job, attempt or park") != NULL, "%s", out);
    snprintf(args, sizeof args, "jobs show %s", kb);
    ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "applied, batch #") != NULL, "%s", out);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key = $1 AND state = "
                                    "'parked'",
                                kp),
                     1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1", kp), 1);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    ck_assert_int_eq(system(cmd), 0);
    lc_teardown(&t);
}
END_TEST

static PGconn *own_connect(const char *user)
{
    char err[512], dsn[800];
    PGconn *c;
    snprintf(dsn, sizeof dsn, "%s%s%s", getenv("IDEMQ_PG_DSN"), user ? " user=" : "",
             user ? user : "");
    c = ledger_db_connect(dsn, "itest lifecycle", 0, err, sizeof err);
    ck_assert_msg(c != NULL, "%s", err);
    return c;
}

/* Runs sql on c; returns the first value (or "") in buf; *state gets the
 * SQLSTATE of a failure ("" when it ran). */
static char *run(PGconn *c, const char *sql, char *buf, size_t len, char *state)
{
    PGresult *r = PQexec(c, sql);
    ExecStatusType st = PQresultStatus(r);
    buf[0] = '\0';
    state[0] = '\0';
    if (st == PGRES_TUPLES_OK && PQntuples(r) > 0)
        snprintf(buf, len, "%s", PQgetvalue(r, 0, 0));
    else if (st != PGRES_TUPLES_OK && st != PGRES_COMMAND_OK)
    {
        const char *code = PQresultErrorField(r, PG_DIAG_SQLSTATE);
        snprintf(state, 6, "%s", code ? code : "?");
    }
    PQclear(r);
    return buf;
}

static void run_ok(PGconn *c, const char *sql, char *buf, size_t len)
{
    char state[6];
    run(c, sql, buf, len, state);
    ck_assert_msg(!state[0], "%s failed: %s %s", sql, state, PQerrorMessage(c));
}

/* 3. Exactly one session maintains at a time: a second caller is told
 * "busy" while the first holds the maintenance lock, and two replicas that
 * maintain while they run never have overlapping maintenance runs. */
START_TEST(test_one_maintainer)
{
    struct itest t;
    PGconn *a, *b;
    char v[512], cfg2[300], q2[128];
    pid_t p1, p2;
    int s1, s2;

    lc_setup(&t, "excl",
             "dedup_window_days = 0.01; partition_interval = \"10 seconds\"; "
             "history_hot_days = 0.005; history_retention_days = 0.02;");
    a = own_connect(NULL);
    b = own_connect(NULL);
    run_ok(a, "BEGIN", v, sizeof v);
    run_ok(a, "SELECT idemq.maintain('session a', 100)->>'busy'", v, sizeof v);
    ck_assert_str_eq(v, "false");
    run_ok(b, "SELECT idemq.maintain('session b', 100)->>'busy'", v, sizeof v);
    ck_assert_str_eq(v, "true");
    run_ok(a, "COMMIT", v, sizeof v);
    run_ok(b, "SELECT idemq.maintain('session b', 100)->>'busy'", v, sizeof v);
    ck_assert_str_eq(v, "false");
    PQfinish(a);
    PQfinish(b);

    /* two replicas (a second queue bound to the same exchange), each with
     * its maintenance caller, for a few partition intervals */
    snprintf(q2, sizeof q2, "%s_b", t.name);
    snprintf(cfg2, sizeof cfg2, "/tmp/%s.cfg", q2);
    itest_write_config(&t, cfg2, q2, "idemq_test.record", "", "");
    {
        struct broker *br;
        char err[512];
        struct conf_input in2 = t.conf->inputs[0];
        in2.queue = q2;
        ck_assert(broker_open(t.conf, "itest", false, &br, err, sizeof err) == 0);
        ck_assert_msg(topology_declare(br, t.conf, &in2) == 0, "%s", broker_error(br));
        broker_close(br);
    }
    run_ok(t.db, "TRUNCATE idemq.maintenance_runs", v, sizeof v);
    p1 = itest_spawn(&t, t.cfg_path, 25, NULL);
    p2 = itest_spawn(&t, cfg2, 25, NULL);
    s1 = itest_wait(p1, itest_ms(90000));
    s2 = itest_wait(p2, itest_ms(90000));
    unlink(cfg2);
    ck_assert_msg(WIFEXITED(s1) && WEXITSTATUS(s1) == 0, "first idemq: 0x%x", s1);
    ck_assert_msg(WIFEXITED(s2) && WEXITSTATUS(s2) == 0, "second idemq: 0x%x", s2);
    ck_assert_int_ge(itest_long(&t, "SELECT count(*) FROM idemq.maintenance_runs", NULL), 2);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.maintenance_runs x JOIN "
                                    "idemq.maintenance_runs y ON x.run_id < y.run_id AND "
                                    "x.started_at < y.finished_at AND y.started_at < x.finished_at",
                                NULL),
                     0);
    {
        struct broker *br;
        char err[512];
        struct conf_input in2 = t.conf->inputs[0];
        in2.queue = q2;
        in2.exchange = "";
        ck_assert(broker_open(t.conf, "itest", false, &br, err, sizeof err) == 0);
        broker_close(br);
        itest_delete_topology(&t, &in2);
    }
    lc_teardown(&t);
}
END_TEST

/* 4. Maintenance by a role that may only EXECUTE idemq's functions: it
 * creates partitions (owned by the ledger's owner, through the SECURITY
 * DEFINER function), cannot create tables itself, and cannot move
 * maintenance's clock. */
START_TEST(test_least_privilege_maintenance)
{
    struct itest t;
    PGconn *c;
    char v[512], sql[512], role[64], state[6];
    long created = 0;

    lc_setup(&t, "priv",
             "dedup_window_days = 0.01; partition_interval = \"10 seconds\"; "
             "history_hot_days = 0.005; history_retention_days = 0.02;");
    snprintf(role, sizeof role, "idemq_lc_exec_%d", (int)getpid());
    snprintf(sql, sizeof sql,
             "DROP ROLE IF EXISTS %s; CREATE ROLE %s LOGIN; "
             "GRANT USAGE ON SCHEMA idemq TO %s; "
             "GRANT EXECUTE ON FUNCTION idemq.maintain(text, integer) TO %s",
             role, role, role, role);
    itest_sql(&t, sql);
    c = own_connect(role);
    run(c, "CREATE TABLE idemq.not_allowed (a integer)", v, sizeof v, state);
    ck_assert_str_eq(state, "42501");
    /* partitions come due every 10 s: wait until one is made by this role */
    for (int i = 0; i < itest_ms(40) && created == 0; i++) {
        run_ok(c, "SELECT idemq.maintain('exec role', 1000)->>'created'", v, sizeof v);
        created = atol(v);
        if (!created)
            sleep(1);
    }
    ck_assert_int_ge(created, 1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM pg_class c WHERE c.relname LIKE "
                                    "'batches_p%' AND c.relowner <> (SELECT relowner FROM "
                                    "pg_class WHERE oid = 'idemq.jobs'::regclass)",
                                NULL),
                     0);
    run_ok(c, "SET idemq.maintenance_now = '2099-01-01'", v, sizeof v);
    run(c, "SELECT idemq.maintain('exec role', 100)", v, sizeof v, state);
    ck_assert_str_eq(state, "42501");
    PQfinish(c);
    snprintf(sql, sizeof sql, "DROP OWNED BY %s; DROP ROLE %s", role, role);
    itest_sql(&t, sql);
    lc_teardown(&t);
}
END_TEST

static long long mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* The concurrent writer of D2's tests: inserts attempt rows stamped now
 * (the slot maintenance must not attach), one transaction each, until told
 * to stop. */
struct inserter {
    const char *dsn;
    atomic_int stop;
    long rows;
    char error[256];
};

static void *insert_loop(void *arg)
{
    struct inserter *in = arg;
    char err[512];
    PGconn *c = ledger_db_connect(in->dsn, "itest inserter", 0, err, sizeof err);
    if (!c) {
        snprintf(in->error, sizeof in->error, "%s", err);
        return NULL;
    }
    while (!atomic_load(&in->stop)) {
        PGresult *r = PQexec(c, "INSERT INTO idemq.attempts (key, attempt, outcome, started_at, "
                                "finished_at, consumer_id) VALUES ('d2:now', 1, 'duplicate', "
                                "clock_timestamp(), clock_timestamp(), 'inserter')");
        if (PQresultStatus(r) != PGRES_COMMAND_OK) {
            snprintf(in->error, sizeof in->error, "%s", PQerrorMessage(c));
            PQclear(r);
            break;
        }
        PQclear(r);
        in->rows++;
    }
    PQfinish(c);
    return NULL;
}

/* Maintenance "fell behind": every partition of attempts and batches is
 * gone (as after a pause longer than the partitions made ahead), so the
 * current slot's rows go to the default partitions. */
static void lose_partitions(PGconn *c)
{
    char v[512];
    run_ok(c,
           "DO $$ DECLARE p record; BEGIN FOR p IN SELECT h.relname, h.kind FROM "
           "idemq.history_parts h WHERE h.kind IN ('attempts', 'batches') AND h.attached LOOP "
           "EXECUTE format('ALTER TABLE idemq.%I DETACH PARTITION idemq.%I', "
           "(SELECT x.parent FROM idemq.history_parent(p.kind) x), p.relname); "
           "EXECUTE format('DROP TABLE idemq.%I', p.relname); "
           "DELETE FROM idemq.history_parts h WHERE h.relname = p.relname; END LOOP; END $$",
           v, sizeof v);
}

/* 6. Maintenance resumes after falling behind while a writer inserts into
 * the current slot: no call fails (the slot still receiving inserts is
 * not attached), each call moves at most its batch bound of the backlog,
 * repeated calls catch up, partitions exist from the next slot boundary on,
 * and no row is lost. */
START_TEST(test_maintenance_catches_up_under_inserts)
{
    struct itest t;
    struct inserter in = {0};
    pthread_t th;
    PGconn *c;
    char v[4096], state[6];
    long before, after, calls = 0, moved = 0, left = -1;
    long long t0;

    /* history_hot_days 0.02 (29 min): no slot of the backlog (10 to 6 min
     * old) may be archived while the test runs, or its rows would leave
     * idemq.attempts and the count below would miss them (an ASan run
     * under load lost one 10 s slot that way with 0.005 days) */
    lc_setup(&t, "behind",
             "dedup_window_days = 0.01; partition_interval = \"10 seconds\"; "
             "history_hot_days = 0.02; history_retention_days = 0.04;");
    c = own_connect(NULL);
    lose_partitions(c);
    /* the backlog: 25,000 rows of 4 minutes that ended 6 minutes ago (past
     * slots: they ended more than 5 minutes ago) */
    run_ok(c, "INSERT INTO idemq.attempts (key, attempt, outcome, started_at, finished_at, "
              "consumer_id) SELECT 'd2:old:' || i, 1, 'duplicate', clock_timestamp() - "
              "interval '10 minutes' + (i % 240) * interval '1 second', clock_timestamp(), 'old' "
              "FROM generate_series(1, 25000) i",
           v, sizeof v);
    in.dsn = getenv("IDEMQ_PG_DSN");
    ck_assert_int_eq(pthread_create(&th, NULL, insert_loop, &in), 0);
    for (int i = 0; i < 1000 && in.rows < 50 && !in.error[0]; i++)
        usleep(10000);
    ck_assert_msg(in.rows >= 50, "the inserter does not insert: %s", in.error);
    t0 = mono_ms();
    do {
        json_t *res;
        run(c, "SELECT idemq.maintain('d2 test', 200)", v, sizeof v, state);
        ck_assert_msg(!state[0], "call %ld failed: %s %s", calls + 1, state, PQerrorMessage(c));
        calls++;
        ck_assert_ptr_nonnull(res = json_loads(v, 0, NULL));
        ck_assert_msg(json_integer_value(json_object_get(res, "rescued")) <= 10000,
                      "one call moved more than its bound: %s", v);
        moved += json_integer_value(json_object_get(res, "rescued"));
        json_decref(res);
        left = itest_long(&t, "SELECT count(*) FROM idemq.attempts_default WHERE key LIKE "
                              "'d2:old:%'",
                          NULL);
    } while (left > 0 && mono_ms() - t0 < itest_ms(30000));
    atomic_store(&in.stop, 1);
    pthread_join(th, NULL);
    ck_assert_msg(!in.error[0], "the inserter failed: %s", in.error);
    ck_assert_msg(left == 0, "%ld backlog rows still in the default partition after %ld calls",
                  left, calls);
    ck_assert_msg(calls >= 3 && moved >= 25000, "%ld calls moved %ld rows", calls, moved);
    /* partitions from the next slot boundary on; none covers the slot the
     * writer was inserting into when the calls began */
    ck_assert_int_ge(itest_long(&t, "SELECT count(*) FROM idemq.history_parts WHERE kind = "
                                    "'attempts' AND attached AND lo > clock_timestamp()",
                                NULL),
                     1);
    /* no row lost: the backlog and the writer's rows, all readable once
     * the last filling partition is attached (idemq.attempts does not read
     * an unattached one; jobs show does) */
    t0 = mono_ms();
    while (itest_long(&t, "SELECT count(*) FROM idemq.history_parts h WHERE "
                          "idemq.history_filling(h.attached, h.location, h.lo)",
                      NULL) > 0 &&
           mono_ms() - t0 < itest_ms(30000)) {
        run(c, "SELECT idemq.maintain('d2 test', 200)", v, sizeof v, state);
        ck_assert_msg(!state[0], "a last call failed: %s %s", state, PQerrorMessage(c));
    }
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.history_parts h WHERE "
                                    "idemq.history_filling(h.attached, h.location, h.lo)",
                                NULL),
                     0);
    before = 25000 + in.rows;
    after = itest_long(&t, "SELECT count(*) FROM idemq.attempts WHERE key LIKE 'd2:%'", NULL);
    ck_assert_int_eq(after, before);
    PQfinish(c);
    lc_teardown(&t);
}
END_TEST

/* 7. One failing step does not stop the others: a row that arrives in
 * a past slot while its rows move (forced here by a trigger on the default
 * partition) makes that slot's ATTACH fail with 23514; the call still
 * archives, reports the failure, and the next call moves the late row and
 * attaches the slot. The log says which step failed. */
START_TEST(test_maintenance_step_failure_reported)
{
    struct itest t;
    PGconn *c;
    char v[4096], when[64], sql[512], out[16384];
    json_t *res, *e;

    lc_setup(&t, "stepfail",
             "dedup_window_days = 0.01; partition_interval = \"10 seconds\"; "
             "history_hot_days = 0.005; history_retention_days = 0.02;");
    c = own_connect(NULL);
    run_ok(c, "CREATE FUNCTION idemq_test.late_row() RETURNS trigger LANGUAGE plpgsql AS $$ "
              "BEGIN IF OLD.key LIKE 'd2:past%' THEN INSERT INTO idemq.attempts (key, attempt, "
              "outcome, started_at, finished_at, consumer_id) VALUES ('d2:late', 1, 'duplicate', "
              "OLD.started_at, OLD.finished_at, 'late'); END IF; RETURN NULL; END $$; "
              "CREATE TRIGGER late_row AFTER DELETE ON idemq.attempts_default FOR EACH ROW "
              "EXECUTE FUNCTION idemq_test.late_row()",
           v, sizeof v);
    /* rows of a slot 10 minutes back, which has no partition */
    run_ok(c, "INSERT INTO idemq.attempts (key, attempt, outcome, started_at, finished_at, "
              "consumer_id) SELECT 'd2:past:' || i, 1, 'duplicate', clock_timestamp() - "
              "interval '10 minutes', clock_timestamp(), 'past' FROM generate_series(1, 100) i",
           v, sizeof v);
    /* 8 minutes on: past the hot window too, so there is archiving to do */
    itest_text(&t, "SELECT (now() + interval '8 minutes')::text", NULL, when, sizeof when);
    snprintf(sql, sizeof sql,
             "SELECT idemq.maintain('d2 test', 2000) FROM (SELECT set_config("
             "'idemq.maintenance_now', '%s', false)) s",
             when);
    run_ok(c, sql, v, sizeof v);
    ck_assert_ptr_nonnull(res = json_loads(v, 0, NULL));
    ck_assert_msg(json_integer_value(json_object_get(res, "failed")) == 1, "%s", v);
    e = json_array_get(json_object_get(res, "errors"), 0);
    ck_assert_msg(e && strcmp(json_string_value(json_object_get(e, "sqlstate")), "23514") == 0 &&
                      strcmp(json_string_value(json_object_get(e, "step")), "attach") == 0,
                  "%s", v);
    ck_assert_msg(json_integer_value(json_object_get(res, "archived")) == 1, "%s", v);
    ck_assert_msg(json_integer_value(json_object_get(res, "rescued")) == 100, "%s", v);
    json_decref(res);
    /* the moved rows are still read through the key's history */
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.key_attempts($1)", "d2:past:7"),
                     1);
    /* the next call moves the late rows and attaches the slot */
    run_ok(c, sql, v, sizeof v);
    ck_assert_ptr_nonnull(res = json_loads(v, 0, NULL));
    ck_assert_msg(json_integer_value(json_object_get(res, "failed")) == 0, "%s", v);
    json_decref(res);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.attempts_default", NULL), 0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.attempts WHERE key LIKE 'd2:%'",
                                NULL),
                     200);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.history_parts WHERE kind = "
                                    "'attempts' AND NOT attached AND location = 'hot' AND lo > "
                                    "'-infinity'",
                                NULL),
                     0);
    /* `idemq maintain` logs a failed step: another past slot, 20 minutes back */
    run_ok(c, "INSERT INTO idemq.attempts (key, attempt, outcome, started_at, finished_at, "
              "consumer_id) SELECT 'd2:past2:' || i, 1, 'duplicate', clock_timestamp() - "
              "interval '20 minutes', clock_timestamp(), 'past' FROM generate_series(1, 10) i",
           v, sizeof v);
    maintain_at(&t, "SELECT now()", out, sizeof out);
    ck_assert_msg(strstr(out, "step attach of attempts_p") && strstr(out, "failed") &&
                      strstr(out, "23514"),
                  "%s", out);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.attempts_default", NULL), 0);
    PQfinish(c);
    lc_teardown(&t);
}
END_TEST

/* 8. The background paths of `run` and the archive commands under the role
 * of `idemq migrate --grant`: maintenance in `run` creates partitions
 * and moves rows (as the ledger's owner, through idemq.maintain), and
 * `archive export` reads the archive and records the export; no 42501. */
START_TEST(test_grant_role_maintenance_and_archive)
{
    struct itest t;
    PGconn *c;
    char v[512], sql[512], out[16384], role[64], dsn[800], owner[700], log[160], dir[256],
        cmd[600], k[128];
    int st;

    lc_setup(&t, "grantbg",
             "dedup_window_days = 0.01; partition_interval = \"10 seconds\"; "
             "history_hot_days = 0.005; history_retention_days = 0.02;");
    snprintf(role, sizeof role, "idemq_lc_run_%d", (int)getpid());
    snprintf(sql, sizeof sql, "DROP ROLE IF EXISTS %s; CREATE ROLE %s LOGIN", role, role);
    itest_sql(&t, sql);
    snprintf(sql, sizeof sql, "migrate --grant %s", role);
    ck_assert_msg(itest_idemq(&t, sql, out, sizeof out) == 0, "%s", out);
    c = own_connect(NULL);
    lose_partitions(c); /* maintenance has work to do when run starts */
    run_ok(c, "INSERT INTO idemq.attempts (key, attempt, outcome, started_at, finished_at, "
              "consumer_id) SELECT 'gr:past:' || i, 1, 'duplicate', clock_timestamp() - "
              "interval '10 minutes', clock_timestamp(), 'past' FROM generate_series(1, 50) i",
           v, sizeof v);
    key(&t, k, sizeof k, "job");
    publish_ts(&t, k, NULL, 0);
    snprintf(owner, sizeof owner, "%s", getenv("IDEMQ_PG_DSN"));
    snprintf(dsn, sizeof dsn, "%s user=%s", owner, role); /* the last user wins */
    setenv("IDEMQ_PG_DSN", dsn, 1);
    snprintf(log, sizeof log, "/tmp/%s.log", t.name);
    st = itest_wait(itest_spawn_log(t.cfg_path, 3, NULL, log), itest_ms(60000));
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "status 0x%x (%s)", st, log);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, k), 1);
    ck_assert_msg(itest_count_lines(log, "permission denied") == 0, "42501 in %s", log);
    ck_assert_msg(itest_count_lines(log, "maintain failed") == 0, "%s", log);
    ck_assert_msg(itest_count_lines(log, "partitions created") >= 1, "no maintenance in %s", log);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.attempts_default WHERE key LIKE "
                                    "'gr:past:%'",
                                NULL),
                     0);
    /* archive (as the owner, at a later time), then export as the role */
    setenv("IDEMQ_PG_DSN", owner, 1);
    maintain_at(&t, "SELECT now() + interval '8 minutes'", out, sizeof out);
    ck_assert_int_ge(itest_long(&t, "SELECT count(*) FROM idemq.history_parts WHERE location = "
                                    "'archive'",
                                NULL),
                     1);
    setenv("IDEMQ_PG_DSN", dsn, 1);
    snprintf(dir, sizeof dir, "/tmp/%s_archive", t.name);
    snprintf(cmd, sizeof cmd, "rm -rf %s && mkdir -p %s", dir, dir);
    ck_assert_int_eq(system(cmd), 0);
    snprintf(sql, sizeof sql, "archive export --dir %s", dir);
    st = itest_idemq(&t, sql, out, sizeof out);
    setenv("IDEMQ_PG_DSN", owner, 1);
    ck_assert_msg(st == 0 && strstr(out, "exported ") && !strstr(out, "permission denied"), "%s",
                  out);
    ck_assert_int_ge(itest_long(&t, "SELECT count(*) FROM idemq.history_parts WHERE "
                                    "exported_at IS NOT NULL",
                                NULL),
                     1);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    ck_assert_int_eq(system(cmd), 0);
    unlink(log);
    PQfinish(c);
    snprintf(sql, sizeof sql, "DROP OWNED BY %s; DROP ROLE %s", role, role);
    itest_sql(&t, sql);
    lc_teardown(&t);
}
END_TEST

/* 5. A populated version 3 ledger (the current release's schema, filled as
 * it fills it) migrates in place: every row of history is kept, no table
 * is rewritten or copied (same files), the old history is registered and
 * read by jobs show, and processing continues: a replay of an applied v3
 * key is a duplicate, a retrying v3 key is applied on its next attempt. */
START_TEST(test_v3_upgrade)
{
    struct itest t;
    PGconn *c;
    char v[512], sql[8192], fn_jobs[32], fn_att[32], k_app[128], k_retry[128], out[16384];
    long n_att, n_jobs, n_parked, n_redr, n_def;
    int applied;
    char err[1024];

    own_database("v3");
    c = own_connect(NULL);
    run_ok(c, "SET client_min_messages = warning; CREATE SCHEMA idemq; "
              "CREATE TABLE idemq.schema_migrations (version integer PRIMARY KEY, name text NOT "
              "NULL, applied_at timestamptz NOT NULL DEFAULT now()); CREATE TABLE "
              "idemq.schema_functions (id integer PRIMARY KEY CHECK (id = 1), sha256 text NOT "
              "NULL, applied_at timestamptz NOT NULL DEFAULT now())",
           v, sizeof v);
    for (int i = 0; i < ledger_migrations_count; i++) {
        const struct ledger_migration *m = &ledger_migrations[i];
        if (m->version > 3)
            continue;
        run_ok(c, m->sql, v, sizeof v);
        snprintf(sql, sizeof sql, "INSERT INTO idemq.schema_migrations VALUES (%d, '%s')",
                 m->version, m->name);
        run_ok(c, sql, v, sizeof v);
    }
    /* as version 3 fills it: a key per state, an attempt per delivery */
    snprintf(k_app, sizeof k_app, "v3:%d:applied", (int)getpid());
    snprintf(k_retry, sizeof k_retry, "v3:%d:retrying", (int)getpid());
    snprintf(sql, sizeof sql,
             "INSERT INTO idemq.jobs (key, state, source_queue, payload_sha256, attempts, "
             "applied_at, result, run_after, generation, budget_base) VALUES "
             "('%s', 'applied', 'q', 'aa', 1, now(), '{\"intent_id\": 7}', NULL, 0, 0), "
             "('%s', 'retrying', 'q', 'bb', 1, NULL, NULL, now() - interval '1 s', 0, 0), "
             "('v3:parked', 'parked', 'q', 'cc', 1, NULL, NULL, NULL, 0, 0), "
             "('v3:redriven', 'applied', 'q', 'dd', 2, now(), '{}', NULL, 1, 1), "
             "('v3:deferred', 'deferred', 'q', 'ee', 0, NULL, NULL, NULL, 0, 0);"
             "INSERT INTO idemq.jobs (key, state, source_queue, payload_sha256, attempts, "
             "applied_at) SELECT 'v3:bulk:' || i, 'applied', 'q', 'ff', 1, now() FROM "
             "generate_series(1, 2000) i;"
             "INSERT INTO idemq.attempts (key, attempt, outcome, started_at, finished_at, queue, "
             "consumer_id, generation) SELECT 'v3:bulk:' || i, 1, 'applied', now(), now(), 'q', "
             "'v3', 0 FROM generate_series(1, 2000) i;"
             "INSERT INTO idemq.attempts (key, attempt, outcome, started_at, finished_at, queue, "
             "consumer_id, generation, error_class, sqlstate, delay_ms) VALUES "
             "('%s', 1, 'applied', now(), now(), 'q', 'v3', 0, NULL, NULL, NULL), "
             "('%s', 1, 'duplicate', now(), now(), 'q', 'v3', 0, NULL, NULL, NULL), "
             "('%s', 1, 'transient_error', now(), now(), 'q', 'v3', 0, 'transient', '40001', 100), "
             "('v3:parked', 1, 'permanent_error', now(), now(), 'q', 'v3', 0, 'permanent', "
             "'22023', NULL), ('v3:deferred', 0, 'deferred', now(), now(), 'q', 'v3', 0, NULL, "
             "NULL, NULL);"
             "INSERT INTO idemq.parked (key, source_queue, body, payload_sha256, error_class, "
             "error_code, reason, generation) VALUES ('v3:parked', 'q', '\\x7b7d', 'cc', "
             "'permanent', 'effect_error', 'bad', 0), ('v3:redriven', 'q', '\\x7b7d', 'dd', "
             "'permanent', 'effect_error', 'fixed since', 0);"
             "INSERT INTO idemq.redrives (key, generation, source) VALUES ('v3:redriven', 1, "
             "'broker');"
             "INSERT INTO idemq.order_keys (source_queue, order_key, last_seq) VALUES ('q', 'o1', 1);"
             "INSERT INTO idemq.deferred (key, source_queue, order_key, seq, reason, body) VALUES "
             "('v3:deferred', 'q', 'o1', 3, 'gap', '\\x7b7d')",
             k_app, k_retry, k_app, k_app, k_retry);
    run_ok(c, sql, v, sizeof v);
    n_att = atol(run(c, "SELECT count(*) FROM idemq.attempts", v, sizeof v, err));
    n_jobs = atol(run(c, "SELECT count(*) FROM idemq.jobs", v, sizeof v, err));
    n_parked = atol(run(c, "SELECT count(*) FROM idemq.parked", v, sizeof v, err));
    n_redr = atol(run(c, "SELECT count(*) FROM idemq.redrives", v, sizeof v, err));
    n_def = atol(run(c, "SELECT count(*) FROM idemq.deferred", v, sizeof v, err));
    run_ok(c, "SELECT pg_relation_filenode('idemq.jobs')", fn_jobs, sizeof fn_jobs);
    run_ok(c, "SELECT pg_relation_filenode('idemq.attempts')", fn_att, sizeof fn_att);

    /* the upgrade */
    ck_assert_msg(ledger_migrate_run(c, &applied, err, sizeof err) == IDEMQ_OK, "%s", err);
    ck_assert_int_ge(applied, 1);
    ck_assert_int_eq(atol(run(c, "SELECT max(version) FROM idemq.schema_migrations", v, sizeof v,
                              err)),
                     ledger_migrate_latest());
    ck_assert_int_eq(atol(run(c, "SELECT count(*) FROM idemq.attempts_v3", v, sizeof v, err)),
                     n_att);
    ck_assert_int_eq(atol(run(c, "SELECT count(*) FROM idemq.jobs", v, sizeof v, err)), n_jobs);
    ck_assert_int_eq(atol(run(c, "SELECT count(*) FROM idemq.parked", v, sizeof v, err)),
                     n_parked);
    ck_assert_int_eq(atol(run(c, "SELECT count(*) FROM idemq.redrives_v3", v, sizeof v, err)),
                     n_redr);
    ck_assert_int_eq(atol(run(c, "SELECT count(*) FROM idemq.deferred", v, sizeof v, err)), n_def);
    /* no rewrite, no copy: the same files */
    ck_assert_str_eq(run(c, "SELECT pg_relation_filenode('idemq.jobs')::text", v, sizeof v, err),
                     fn_jobs);
    ck_assert_str_eq(run(c, "SELECT pg_relation_filenode('idemq.attempts_v3')::text", v, sizeof v,
                         err),
                     fn_att);
    ck_assert_int_eq(atol(run(c, "SELECT count(*) FROM idemq.history_parts WHERE relname IN "
                                 "('attempts_v3', 'redrives_v3')",
                              v, sizeof v, err)),
                     2);
    ck_assert_int_eq(atol(run(c, "SELECT count(*) FROM idemq.deferred WHERE due_at = "
                                 "'-infinity'",
                              v, sizeof v, err)),
                     n_def);
    /* the v3 history is read through the new functions */
    snprintf(sql, sizeof sql, "SELECT count(*) FROM idemq.key_history('%s') WHERE kind = "
                              "'attempt'", k_app);
    ck_assert_int_eq(atol(run(c, sql, v, sizeof v, err)), 2);
    snprintf(sql, sizeof sql, "SELECT result->>'intent_id' FROM idemq.job_info('%s')", k_app);
    ck_assert_str_eq(run(c, sql, v, sizeof v, err), "7");
    PQfinish(c);

    /* and processing goes on */
    itest_setup(&t, "v3", "idemq_test.record", "", "");
    publish_ts(&t, k_app, NULL, 0);
    publish_ts(&t, k_retry, NULL, 0);
    itest_run_until_idle(&t, 2);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, k_app), 0);
    ck_assert_int_eq(itest_long(&t, HISTORY("duplicate"), k_app), 2);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, k_retry), 1);
    ck_assert_int_eq(itest_long(&t, "SELECT attempts FROM idemq.jobs WHERE key = $1 AND state = "
                                    "'applied'",
                                k_retry),
                     2);
    snprintf(sql, sizeof sql, "jobs show %s", k_app);
    ck_assert_int_eq(itest_idemq(&t, sql, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "attempt 1 (generation 0): applied") != NULL, "%s", out);
    lc_teardown(&t);
}
END_TEST


/* 9. The transactional outbox's sent rows age out with the history (issue
 * 18): a sent row lives in a partition of idemq.outbox_sent, is still shown
 * by `jobs show` of its key once archived, and is gone once the partition
 * is dropped; a parked row and a pending one (never relayed) stay in
 * idemq.outbox, whatever the time. */
START_TEST(test_outbox_sent_ages_out)
{
    struct itest t;
    struct broker *b;
    char q[200], ks[128], kp[128], ku[128], sql[768], out[16384], args[300], rel[128],
        err[512];

    lc_setup_more(&t, "outbox",
                  "dedup_window_days = 0.01; partition_interval = \"1 minute\"; "
                  "history_hot_days = 0.005; history_retention_days = 0.02;",
                  "outbox: { relay = 1; poll_ms = 200; };");
    snprintf(q, sizeof q, "%s.out", t.name);
    ck_assert_msg(broker_open(t.conf, "itest lifecycle", false, &b, err, sizeof err) == 0, "%s",
                  err);
    ck_assert(broker_admin_declare_queue(b, q, NULL, false) == IDEMQ_OK);
    ck_assert(broker_admin_purge(b, q) == IDEMQ_OK);
    broker_close(b);
    key(&t, ks, sizeof ks, "sent");
    key(&t, kp, sizeof kp, "parked");
    key(&t, ku, sizeof ku, "pending");
    snprintf(sql, sizeof sql,
             "SELECT idemq.emit('', '%s', 'to be sent', NULL, NULL, '%s'); "
             "SELECT idemq.emit('', '%s.nowhere', 'unroutable', NULL, NULL, '%s')",
             q, ks, t.name, kp);
    itest_sql(&t, sql);
    itest_run_until_idle(&t, 1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.outbox_sent WHERE key = $1", ks),
                     1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.outbox WHERE key = $1", ks), 0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.outbox WHERE key = $1 AND "
                                    "state = 'parked'",
                                kp),
                     1);
    /* emitted now, never relayed (no idemq runs from here on) */
    snprintf(sql, sizeof sql, "SELECT idemq.emit('', '%s', 'left pending', NULL, NULL, '%s')", q,
             ku);
    itest_sql(&t, sql);
    /* the partition that holds the sent row */
    itest_text(&t, "SELECT h.relname FROM idemq.history_parts h, idemq.outbox_sent s WHERE "
                   "h.kind = 'outbox' AND h.attached AND s.key = $1 AND s.sent_at >= h.lo AND "
                   "s.sent_at < h.hi",
               ks, rel, sizeof rel);
    ck_assert_msg(rel[0], "the sent row is in no partition of its own");

    /* past the hot window: archived, still in the key's story */
    snprintf(sql, sizeof sql, "SELECT hi + interval '0.005 days' + interval '1 minute' FROM "
                              "idemq.history_parts WHERE relname = '%s'", rel);
    maintain_at(&t, sql, out, sizeof out);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.history_parts WHERE relname = $1 "
                                    "AND location = 'archive'",
                                rel),
                     1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.outbox_sent WHERE key = $1", ks),
                     0);
    snprintf(args, sizeof args, "jobs show %s", ks);
    ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 0);
    ck_assert_msg(strstr(out, ") sent: exchange") != NULL, "%s", out);

    /* past the retention: the partition is dropped, the sent row gone; the
     * parked and the pending rows stay */
    snprintf(sql, sizeof sql, "SELECT hi + interval '0.02 days' + interval '1 minute' FROM "
                              "idemq.history_parts WHERE relname = '%s'", rel);
    maintain_at(&t, sql, out, sizeof out);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.history_parts WHERE relname = $1 "
                                    "AND location = 'dropped'",
                                rel),
                     1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.key_outbox($1)", ks), 0);
    ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 1);
    ck_assert_msg(strstr(out, "no job, attempt or park") != NULL, "%s", out);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.outbox WHERE key = $1 AND "
                                    "state = 'parked'",
                                kp),
                     1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.outbox WHERE key = $1 AND "
                                    "state = 'pending'",
                                ku),
                     1);
    snprintf(args, sizeof args, "jobs show %s", kp);
    ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 0);
    ck_assert_msg(strstr(out, ") parked: exchange") != NULL, "%s", out);
    lc_teardown(&t);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("lifecycle");
    TCase *tc = tcase_create("lifecycle");
    tcase_set_timeout(tc, itest_ms(300));
    tcase_add_test(tc, test_dedup_window);
    tcase_add_test(tc, test_archive_and_retention);
    tcase_add_test(tc, test_one_maintainer);
    tcase_add_test(tc, test_least_privilege_maintenance);
    tcase_add_test(tc, test_maintenance_catches_up_under_inserts);
    tcase_add_test(tc, test_maintenance_step_failure_reported);
    tcase_add_test(tc, test_grant_role_maintenance_and_archive);
    tcase_add_test(tc, test_v3_upgrade);
    tcase_add_test(tc, test_outbox_sent_ages_out);
    suite_add_tcase(s, tc);
    /* least-privilege mode (scripts/test): these again, as the deployment's roles */
    itest_lp_tcase(s, (const TTest *const[]){test_one_maintainer, NULL});
    return check_run(s);
}
