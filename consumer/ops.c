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
#include "resolve.h"
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
    job = PQexecParams(db,
                       "SELECT state, attempts, generation, budget_base, first_seen_at, "
                       "applied_at, run_after, result, last_error_class, last_sqlstate, "
                       "last_error, source_queue, payload_sha256 "
                       "FROM idemq.jobs WHERE key = $1",
                       1, NULL, params, NULL, NULL, 0);
    tl = PQexecParams(
        db,
        "SELECT at, what FROM ("
        /* Attempts in id order (the order their transactions committed:
         * a duplicate waits for the applier's claim), so a duplicate never
         * shows before the attempt that applied; the running max keeps the
         * sort key of attempts monotonic in id order. */
        " SELECT max(finished_at) OVER (ORDER BY id) AS at, 1 AS ord, id,"
        "  format('%s%s%s%s%s%s  [started %s, queue %s, redelivered %s%s, %s]',"
        "   CASE WHEN outcome = 'duplicate' THEN 'duplicate delivery, no effect'"
        "        ELSE format('attempt %s (generation %s): %s', attempt, generation, outcome)"
        "   END,"
        "   coalesce(' ' || error_class, ''), coalesce(' ' || error_code, ''),"
        "   coalesce(' SQLSTATE ' || sqlstate, ''), coalesce(': ' || message, '')"
        "   || CASE WHEN outcome = 'transient_error' THEN ' (retry in ' || delay_ms || ' ms)'"
        "           WHEN outcome = 'delayed' THEN ' (early; waits ' || delay_ms || ' ms more)'"
        "           ELSE '' END,"
        "   CASE WHEN outcome = 'applied' THEN '  <== the effect was applied here' ELSE '' END,"
        "   started_at, queue, redelivered, coalesce(', delivery count ' || delivery_count, ''),"
        "   consumer_id) AS what"
        " FROM idemq.attempts WHERE key = $1"
        " UNION ALL"
        " SELECT parked_at, 2, id, format('parked #%s (generation %s): %s %s%s: %s; %s attempts;"
        " dead-lettered %s%s', id, generation, error_class, error_code,"
        "   coalesce(' SQLSTATE ' || sqlstate, ''), reason, attempts,"
        "   coalesce(dlq_published_at::text, 'not confirmed yet'),"
        "   CASE WHEN redrivable THEN '' ELSE format('; not redrivable (body %s of %s bytes kept)',"
        "        octet_length(body), coalesce(body_size, octet_length(body))) END)"
        " FROM idemq.parked WHERE key = $1"
        " UNION ALL"
        " SELECT redriven_at, 3, id, format('redrive to generation %s by %s (park #%s): fresh"
        " attempt budget', generation, source, coalesce(park_id::text, '?'))"
        " FROM idemq.redrives WHERE key = $1"
        " UNION ALL" /* ordered lanes: a job waiting for its predecessor */
        " SELECT deferred_at, 4, id, format('waiting in idemq.deferred (%s): ordering key %s,"
        " sequence %s; %s', reason, order_key, coalesce(seq::text, '-'),"
        "   coalesce('reported as overdue at ' || reported_at, 'not overdue yet'))"
        " FROM idemq.deferred WHERE key = $1"
        ") t ORDER BY at, ord, id",
        1, NULL, params, NULL, NULL, 0);
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
        fprintf(out, "  (no job row: the message never decoded into a job)\n");
    }
    fprintf(out, "history (in commit order):\n");
    for (int i = 0; i < PQntuples(tl); i++)
        fprintf(out, "  %s  %s\n", val(tl, i, 0), val(tl, i, 1));
    if (PQntuples(job) == 1 && !PQgetisnull(job, 0, 7))
        fprintf(out, "result: %s\n", val(job, 0, 7));
    resolve_show(db, key, out); /* provider intent and resolutions (issue 9) */
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
#define PARKED_WHERE                                                                         \
    " WHERE ($1::text IS NULL OR key = $1) AND ($2::text IS NULL OR error_class = $2)"      \
    " AND ($3::timestamptz IS NULL OR parked_at >= $3) AND ($4::text IS NULL OR"            \
    " source_queue = $4)"
    rows = PQexecParams(db,
                        "SELECT id, parked_at, coalesce(key, '(no key)'), error_class,"
                        " error_code, coalesce(sqlstate, '-'), attempts, generation,"
                        " CASE WHEN dlq_published_at IS NULL THEN 'no' ELSE 'yes' END,"
                        " left(reason, 80), source_queue FROM idemq.parked" PARKED_WHERE
                        " ORDER BY id LIMIT $5::bigint",
                        5, NULL, params, NULL, NULL, 0);
    counts = PQexecParams(db,
                          "SELECT error_class, count(*) FROM idemq.parked" PARKED_WHERE
                          " GROUP BY 1 ORDER BY 1",
                          4, NULL, params, NULL, NULL, 0);
#undef PARKED_WHERE
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

/* The queue a dead letter of input `in` goes back to: its
 * x-idemq-origin-queue (or, for a message the broker dead-lettered itself,
 * the queue of its first x-death record), and only if that queue is the
 * input's own (its queue or one of its partitions): a producer-supplied
 * header must not steer a publish with idemq's credentials. NULL, with
 * *why set, when there is none or it is refused. */
static const char *origin_of(const struct job *j, const struct conf_input *in, const char **why)
{
    const char *o = json_string_value(json_object_get(j->headers, "x-idemq-origin-queue"));
    if (!o)
        o = json_string_value(json_object_get(j->headers, "x-first-death-queue"));
    if (!o) {
        *why = "no x-idemq-origin-queue or x-death record";
        return NULL;
    }
    if (topology_is_input_queue(in, o))
        return o;
    *why = "its origin queue is not one of this input's queues (refused)";
    return NULL;
}

/* Connections parked on a message the client library cannot decode: each
 * holds its message unacknowledged until the end (it then returns to the
 * head of the queue), so the redrive can go on past it on a new one. */
#define REDRIVE_MAX_UNDECODABLE 16

struct redrive {
    struct broker *b;
    struct broker *stuck[REDRIVE_MAX_UNDECODABLE];
    int n_stuck;
    uint64_t *held;
    size_t nheld, cap;
};

static bool hold(struct redrive *r, uint64_t tag)
{
    if (r->nheld == r->cap) {
        size_t cap = r->cap ? r->cap * 2 : 64;
        uint64_t *nh = realloc(r->held, cap * sizeof *nh);
        if (!nh)
            return false;
        r->held = nh;
        r->cap = cap;
    }
    r->held[r->nheld++] = tag;
    return true;
}

/* Gives every held message back (requeued, in order) and, on the stuck
 * connections, the undecodable ones. */
static void release(struct redrive *r)
{
    for (size_t i = 0; i < r->nheld; i++)
        if (broker_nack(r->b, r->held[i], true))
            break; /* the channel is gone: the broker requeues them anyway */
    r->nheld = 0;
    for (int i = 0; i < r->n_stuck; i++)
        broker_close(r->stuck[i]);
    r->n_stuck = 0;
}

/* Redrives one input's dead-letter queue; *left counts what stays there. */
static int redrive_input(const struct conf *c, struct redrive *r, const struct conf_input *in,
                         const struct ops_filter *f, long long since_id, long *moved,
                         long *left, FILE *out)
{
    char dlq[TOPOLOGY_NAME_MAX], by[300], err[512];
    struct job j;
    int rc = 0;

    topology_dlq(in, dlq, sizeof dlq);
    who(by, sizeof by);
    job_init(&j);
    for (;;) {
        const char *origin, *why = NULL;
        idemq_err_t e;
        json_t *redrivable;
        if (f->limit > 0 && *moved >= f->limit)
            break;
        e = broker_get(r->b, dlq, &j, false);
        if (e == IDEMQ_ERR_TIMEOUT)
            break;
        if (e == IDEMQ_ERR_UNDECODABLE) {
            /* This connection cannot read past it: keep it (and the message)
             * aside and go on with a new one. */
            log_warn("%s: delivery %llu cannot be decoded by the client library (parked as "
                     "undecodable, not redrivable); left in place",
                     dlq, (unsigned long long)j.tag);
            (*left)++;
            if (r->n_stuck == REDRIVE_MAX_UNDECODABLE) {
                log_error("%s: more than %d undecodable messages; stopping here", dlq,
                          REDRIVE_MAX_UNDECODABLE);
                rc = 1;
                break;
            }
            /* what this connection holds stays held with it until the end */
            r->nheld = 0;
            r->stuck[r->n_stuck++] = r->b;
            if (broker_open(c, "idemq redrive", true, &r->b, err, sizeof err)) {
                log_error("%s", err);
                r->b = NULL;
                rc = 4;
                break;
            }
            continue;
        }
        if (e) {
            log_error("reading %s: %s", dlq, broker_error(r->b));
            rc = 1;
            break;
        }
        if (!matches(&j, f, since_id)) {
            (*left)++;
            if (!hold(r, j.tag)) {
                rc = 1;
                break;
            }
            continue;
        }
        origin = origin_of(&j, in, &why);
        redrivable = json_object_get(j.headers, "x-idemq-redrivable");
        if (origin && json_is_false(redrivable)) {
            origin = NULL;
            why = "not redrivable: the park does not hold the whole message";
        }
        if (!origin || f->dry_run) {
            if (!origin)
                log_warn("%s: %s (%s) left in place: %s", dlq, hdr(&j, "x-idemq-key", "(no key)"),
                         hdr(&j, "x-idemq-error-class", "?"), why);
            else {
                fprintf(out, "would redrive %s (%s) to %s\n", hdr(&j, "x-idemq-key", "(no key)"),
                        hdr(&j, "x-idemq-error-class", "?"), origin);
                (*moved)++;
            }
            (*left)++;
            if (!hold(r, j.tag)) {
                rc = 1;
                break;
            }
            continue;
        }
        {
            struct broker_props p = {NULL, NULL, j.headers, true, NULL, j.props};
            json_object_set_new(j.headers, "x-idemq-redriven-by", json_string(by));
            /* Straight to the origin queue (default exchange): an origin
             * fanout exchange would copy it to other queues too. */
            if (broker_publish(r->b, "", origin, j.body, j.body_len, &p) ||
                broker_wait_confirms(r->b, 10000) || broker_ack(r->b, j.tag, false)) {
                log_error("redrive to %s not confirmed: %s (the dead-letter copy stays)", origin,
                          broker_error(r->b));
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
    job_destroy(&j);
    return rc;
}

int ops_redrive(const struct conf *c, const struct ops_filter *f, FILE *out)
{
    struct redrive r;
    char err[512];
    long long since_id = 0;
    long moved = 0, left = 0;
    int rc = 0, found = 0;

    memset(&r, 0, sizeof r);
    if (f->since) {
        PGconn *db = connect(c);
        if (!db)
            return 4;
        since_id = since_park_id(db, f->since, &rc);
        PQfinish(db);
        if (rc)
            return rc;
    }
    if (f->input) {
        for (int i = 0; i < c->n_inputs; i++)
            found += strcmp(f->input, c->inputs[i].name) == 0;
        if (!found) {
            fprintf(stderr, "idemq: no input named %s\n", f->input);
            return 2;
        }
    }
    if (broker_open(c, "idemq redrive", true, &r.b, err, sizeof err)) {
        log_error("%s", err);
        return 4;
    }
    for (int i = 0; i < c->n_inputs && rc == 0 && r.b; i++) {
        if (f->input && strcmp(f->input, c->inputs[i].name) != 0)
            continue;
        rc = redrive_input(c, &r, &c->inputs[i], f, since_id, &moved, &left, out);
    }
    if (r.b)
        release(&r);
    broker_close(r.b);
    free(r.held);
    fprintf(out, "%s %ld message%s; %ld %s in the dead-letter queue%s%s%s%s\n",
            f->dry_run ? "would redrive" : "redrove", moved, moved == 1 ? "" : "s", left,
            f->dry_run ? "stay" : "left", f->input ? " of input " : "s",
            f->input ? f->input : "", f->input ? " (other inputs not looked at)" : "",
            f->dry_run ? " (dry run: nothing was moved)" : "");
    return rc;
}
