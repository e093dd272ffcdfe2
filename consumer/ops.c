/*
 * ops: jobs show, parked list and redrive (see ops.h).
 */
#include "ops.h"

#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "broker.h"
#include "ledger_db.h"
#include "log.h"
#include "topology.h"

static PGconn *connect(const struct conf *c)
{
    char err[512];
    PGconn *db = ledger_db_connect(c->dsn, "idemq ops", c->statement_timeout_ms, err, sizeof err);
    if (!db)
        log_error("%s", err);
    else
        PQclear(PQexec(db, "SET TimeZone = 'UTC'"));
    return db;
}

static const char *val(const PGresult *r, int row, int col)
{
    return PQgetisnull(r, row, col) ? "-" : PQgetvalue(r, row, col);
}

int ops_jobs_show(const struct conf *c, const char *key, FILE *out)
{
    const char *params[1] = {key};
    PGconn *db = connect(c);
    PGresult *job, *tl;
    int rc = 0;

    if (!db)
        return 4;
    /* The ledger's readers cover the hot partitions, the v3 tables and the
     * archive, and fill in what a plain apply keeps in its batch row. */
    job = PQexecParams(db,
                       "SELECT state, attempts, generation, budget_base, first_seen_at, "
                       "applied_at, run_after, result, last_error_class, last_sqlstate, "
                       "last_error, source_queue, payload_sha256 FROM idemq.job_info($1)",
                       1, NULL, params, NULL, NULL, 0);
    tl = PQexecParams(db,
                      "SELECT at, what FROM idemq.key_history($1) ORDER BY at, ord, id", 1,
                      NULL, params, NULL, NULL, 0);
    if (PQresultStatus(job) != PGRES_TUPLES_OK || PQresultStatus(tl) != PGRES_TUPLES_OK) {
        log_error("cannot read the ledger: %s", PQerrorMessage(db));
        rc = 4;
        goto out;
    }
    if (PQntuples(job) == 0 && PQntuples(tl) == 0) {
        fprintf(out, "no job, attempt or park with key %s\n", key);
        rc = 1;
        goto out;
    }
    fprintf(out, "key %s\n", key);
    if (PQntuples(job) == 1) {
        fprintf(out, "  state %s, %s attempts, generation %s (budget counts from attempt %s)\n",
                val(job, 0, 0), val(job, 0, 1), val(job, 0, 2), val(job, 0, 3));
        fprintf(out, "  queue %s, payload sha256 %s\n", val(job, 0, 11), val(job, 0, 12));
        fprintf(out, "  first seen %s, applied %s, run after %s\n", val(job, 0, 4),
                val(job, 0, 5), val(job, 0, 6));
        if (!PQgetisnull(job, 0, 8))
            fprintf(out, "  last error %s %s: %s\n", val(job, 0, 8), val(job, 0, 9),
                    val(job, 0, 10));
    } else {
        fprintf(out, "  (no job row: the message never decoded into a job, or its key was "
                     "pruned past the dedup window)\n");
    }
    fprintf(out, "history (oldest first):\n");
    for (int i = 0; i < PQntuples(tl); i++)
        fprintf(out, "  %s  %s\n", val(tl, i, 0), val(tl, i, 1));
    if (PQntuples(job) == 1 && !PQgetisnull(job, 0, 7))
        fprintf(out, "result: %s\n", val(job, 0, 7));
out:
    PQclear(job);
    PQclear(tl);
    PQfinish(db);
    return rc;
}

int ops_parked_list(const struct conf *c, const struct ops_filter *f, FILE *out)
{
    char limit[24], queue[300] = "";
    const char *params[5];
    PGconn *db;
    PGresult *rows, *counts;
    int rc = 0;

    if (f->input) {
        for (int i = 0; i < c->n_inputs; i++)
            if (strcmp(c->inputs[i].name, f->input) == 0)
                snprintf(queue, sizeof queue, "%s", c->inputs[i].queue);
        if (!queue[0]) {
            fprintf(stderr, "idemq: no input named %s\n", f->input);
            return 2;
        }
    }
    if (!(db = connect(c)))
        return 4;
    snprintf(limit, sizeof limit, "%ld", f->limit > 0 ? f->limit : 1000000000L);
    params[0] = f->key;
    params[1] = f->error_class;
    params[2] = f->since;
    params[3] = queue[0] ? queue : NULL;
    params[4] = limit;
    /* Open parks, and parks resolved since (idemq.park_history, hot
     * partitions): a redriven and applied park stays listed, as resolved. */
#define PARKED_ROWS                                                                          \
    " FROM (SELECT id, parked_at, key, error_class, error_code, sqlstate, attempts,"          \
    "  generation, CASE WHEN dlq_published_at IS NULL THEN 'no' ELSE 'yes' END AS dlq,"      \
    "  reason, source_queue FROM idemq.parked"                                              \
    "  UNION ALL SELECT id, parked_at, key, park->>'error_class', park->>'error_code',"      \
    "  park->>'sqlstate', (park->>'attempts')::integer, generation, 'resolved',"            \
    "  (park->>'reason') || ' [resolved: ' || resolution || ']', source_queue"              \
    "  FROM idemq.park_history) p"
#define PARKED_WHERE                                                                         \
    " WHERE ($1::text IS NULL OR key = $1) AND ($2::text IS NULL OR error_class = $2)"      \
    " AND ($3::timestamptz IS NULL OR parked_at >= $3) AND ($4::text IS NULL OR"            \
    " source_queue = $4)"
    rows = PQexecParams(db,
                        "SELECT id, parked_at, coalesce(key, '(no key)'), error_class,"
                        " error_code, coalesce(sqlstate, '-'), attempts, generation, dlq,"
                        " left(reason, 80), source_queue" PARKED_ROWS PARKED_WHERE
                        " ORDER BY id LIMIT $5::bigint",
                        5, NULL, params, NULL, NULL, 0);
    counts = PQexecParams(db,
                          "SELECT error_class, count(*)" PARKED_ROWS PARKED_WHERE
                          " GROUP BY 1 ORDER BY 1",
                          4, NULL, params, NULL, NULL, 0);
#undef PARKED_WHERE
#undef PARKED_ROWS
    if (PQresultStatus(rows) != PGRES_TUPLES_OK || PQresultStatus(counts) != PGRES_TUPLES_OK) {
        log_error("cannot list parked messages: %s", PQerrorMessage(db));
        rc = PQstatus(db) == CONNECTION_OK ? 2 : 4;
        goto out;
    }
    fprintf(out, "%-6s %-27s %-32s %-10s %-18s %-8s %-3s %-3s %-4s %s\n", "id", "parked_at",
            "key", "class", "code", "sqlstate", "att", "gen", "dlq", "reason");
    for (int i = 0; i < PQntuples(rows); i++)
        fprintf(out, "%-6s %-27s %-32s %-10s %-18s %-8s %-3s %-3s %-4s %s\n", val(rows, i, 0),
                val(rows, i, 1), val(rows, i, 2), val(rows, i, 3), val(rows, i, 4),
                val(rows, i, 5), val(rows, i, 6), val(rows, i, 7), val(rows, i, 8),
                val(rows, i, 9));
    fprintf(out, "count by error class:");
    if (PQntuples(counts) == 0)
        fprintf(out, " none");
    for (int i = 0; i < PQntuples(counts); i++)
        fprintf(out, " %s=%s", val(counts, i, 0), val(counts, i, 1));
    fprintf(out, "\n");
out:
    PQclear(rows);
    PQclear(counts);
    PQfinish(db);
    return rc;
}

/* Smallest park id at or after f->since (so the filter works on headers). */
static long long since_park_id(PGconn *db, const char *since, int *rc)
{
    const char *params[1] = {since};
    PGresult *r = PQexecParams(db,
                               "SELECT coalesce(min(id), (SELECT coalesce(max(id), 0) + 1 "
                               "FROM idemq.parked)) FROM idemq.parked WHERE parked_at >= $1",
                               1, NULL, params, NULL, NULL, 0);
    long long id = 0;
    if (PQresultStatus(r) != PGRES_TUPLES_OK) {
        log_error("bad --since: %s", PQerrorMessage(db));
        *rc = 2;
    } else {
        id = atoll(PQgetvalue(r, 0, 0));
    }
    PQclear(r);
    return id;
}

static const char *hdr(const struct job *j, const char *name, const char *dflt)
{
    const char *v = json_string_value(json_object_get(j->headers, name));
    return v ? v : dflt;
}

static bool matches(const struct job *j, const struct ops_filter *f, long long since_id)
{
    const char *key = json_string_value(json_object_get(j->headers, "x-idemq-key"));
    const char *cls = json_string_value(json_object_get(j->headers, "x-idemq-error-class"));
    json_t *id = json_object_get(j->headers, "x-idemq-park-id");
    if (f->key && (!key || strcmp(key, f->key) != 0))
        return false;
    if (f->error_class && (!cls || strcmp(cls, f->error_class) != 0))
        return false;
    if (f->since && (!json_is_integer(id) || json_integer_value(id) < since_id))
        return false;
    return true;
}

static void who(char *buf, size_t len)
{
    char host[128] = "host";
    struct passwd *pw = getpwuid(getuid());
    gethostname(host, sizeof host - 1);
    snprintf(buf, len, "idemq redrive (%s@%s)", pw ? pw->pw_name : "?", host);
}

/* Redrives one input's dead-letter queue. */
static int redrive_input(struct broker *b, const struct conf_input *in,
                         const struct ops_filter *f, long long since_id, long *moved,
                         long *kept, FILE *out)
{
    char dlq[TOPOLOGY_NAME_MAX], by[300];
    uint64_t *held = NULL;
    size_t nheld = 0, cap = 0;
    struct job j;
    int rc = 0;

    topology_dlq(in, dlq, sizeof dlq);
    who(by, sizeof by);
    job_init(&j);
    for (;;) {
        const char *origin;
        idemq_err_t err;
        if (f->limit > 0 && *moved >= f->limit)
            break;
        err = broker_get(b, dlq, &j, false);
        if (err == IDEMQ_ERR_TIMEOUT)
            break;
        if (err) {
            log_error("reading %s: %s", dlq, broker_error(b));
            rc = 1;
            break;
        }
        origin = json_string_value(json_object_get(j.headers, "x-idemq-origin-queue"));
        if (!matches(&j, f, since_id) || !origin || f->dry_run) {
            if (matches(&j, f, since_id)) {
                if (!origin)
                    log_warn("%s: message without x-idemq-origin-queue left in place", dlq);
                else
                    fprintf(out, "would redrive %s (%s) to %s\n",
                            hdr(&j, "x-idemq-key", "(no key)"),
                            hdr(&j, "x-idemq-error-class", "?"), origin);
                if (origin)
                    (*moved)++;
            }
            if (nheld == cap) {
                uint64_t *nh = realloc(held, (cap = cap ? cap * 2 : 64) * sizeof *held);
                if (!nh) {
                    rc = 1;
                    break;
                }
                held = nh;
            }
            held[nheld++] = j.tag;
            (*kept)++;
            continue;
        }
        {
            struct broker_props p = {NULL, NULL, j.headers, true, NULL, j.props};
            json_object_set_new(j.headers, "x-idemq-redriven-by", json_string(by));
            /* Straight to the origin queue (default exchange): an origin
             * fanout exchange would copy it to other queues too. */
            if (broker_publish(b, "", origin, j.body, j.body_len, &p) ||
                broker_wait_confirms(b, 10000) || broker_ack(b, j.tag, false)) {
                log_error("redrive to %s not confirmed: %s (the dead-letter copy stays)", origin,
                          broker_error(b));
                rc = 1;
                break;
            }
        }
        (*moved)++;
        fprintf(out, "redriven %s to %s\n", hdr(&j, "x-idemq-key", "(no key)"), origin);
        if (f->rate > 0) {
            struct timespec ts = {(time_t)(1.0 / f->rate), (long)(1e9 / f->rate) % 1000000000L};
            nanosleep(&ts, NULL);
        }
    }
    for (size_t i = 0; i < nheld; i++)
        if (broker_nack(b, held[i], true))
            break; /* the channel is gone: the broker requeues them anyway */
    free(held);
    job_destroy(&j);
    return rc;
}

int ops_redrive(const struct conf *c, const struct ops_filter *f, FILE *out)
{
    struct broker *b;
    char err[512];
    long long since_id = 0;
    long moved = 0, kept = 0;
    int rc = 0, found = 0;

    if (f->since) {
        PGconn *db = connect(c);
        if (!db)
            return 4;
        since_id = since_park_id(db, f->since, &rc);
        PQfinish(db);
        if (rc)
            return rc;
    }
    if (broker_open(c, "idemq redrive", true, &b, err, sizeof err)) {
        log_error("%s", err);
        return 4;
    }
    for (int i = 0; i < c->n_inputs && rc == 0; i++) {
        if (f->input && strcmp(f->input, c->inputs[i].name) != 0)
            continue;
        found++;
        rc = redrive_input(b, &c->inputs[i], f, since_id, &moved, &kept, out);
    }
    broker_close(b);
    if (!found) {
        fprintf(stderr, "idemq: no input named %s\n", f->input);
        return 2;
    }
    fprintf(out, "%s %ld message%s; left %ld in the dead-letter queue%s\n",
            f->dry_run ? "would redrive" : "redrove", moved, moved == 1 ? "" : "s",
            kept - (f->dry_run ? moved : 0), kept == 1 ? "" : "s");
    return rc;
}
