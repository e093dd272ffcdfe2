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
#include "broker_admin.h"
#include "job.h"
#include "groups.h"
#include "ledger_db.h"
#include "ledger_outbox.h"
#include "log.h"
#include "observe.h"
#include "protect.h"
#include "textesc.h"
#include "republish.h"
#include "resolve.h"
#include "seal.h"
#include "sqs_redrive.h"
#include "topology.h"

PGconn *ops_connect(const struct conf *c, const char *app, int statement_timeout_ms)
{
    char err[512];
    PGconn *db = ledger_db_connect(c->dsn, app, statement_timeout_ms, err, sizeof err);
    if (!db)
        log_error("%s", err);
    else
        PQclear(PQexec(db, "SET TimeZone = 'UTC'"));
    return db;
}

const char *ops_val(const PGresult *r, int row, int col)
{
    return PQgetisnull(r, row, col) ? "-" : PQgetvalue(r, row, col);
}

const char *ops_text(struct ops_strs *a, const char *s)
{
    const unsigned char *u = (const unsigned char *)s;
    size_t n = strlen(s), need = 0, k;
    char *copy, **v;
    bool same = true;

    for (size_t i = 0; i < n; i += k) {
        size_t w = textesc_term_one(u + i, n - i, &k, NULL);
        same = same && w == k;
        need += w;
    }
    if (same)
        return s;
    if (a->n == a->cap) {
        size_t cap = a->cap ? a->cap * 2 : 16;
        if (!(v = realloc(a->v, cap * sizeof *v)))
            return "?";
        a->v = v;
        a->cap = cap;
    }
    if (!(copy = malloc(need + 1)))
        return "?";
    need = 0;
    for (size_t i = 0; i < n; i += k)
        need += textesc_term_one(u + i, n - i, &k, copy + need);
    copy[need] = '\0';
    a->v[a->n++] = copy;
    return copy;
}

const char *ops_tval(struct ops_strs *a, const PGresult *r, int row, int col)
{
    return ops_text(a, ops_val(r, row, col));
}

void ops_strs_free(struct ops_strs *a)
{
    for (size_t i = 0; i < a->n; i++)
        free(a->v[i]);
    free(a->v);
    memset(a, 0, sizeof *a);
}

static PGconn *connect(const struct conf *c)
{
    return ops_connect(c, "idemq ops", c->statement_timeout_ms);
}


/* The visible leases of the key's PostgreSQL queue rows (a provider call
 * that may be in flight): one line each. Prints nothing when none (or on a
 * ledger without them). */
static void lease_show(PGconn *db, const char *key, FILE *out, struct ops_strs *a)
{
    const char *params[1] = {key};
    PGresult *r = PQexecParams(db,
                               "SELECT r_queue, r_id, r_leased_by, r_lease_until, r_expired "
                               "FROM idemq.queue_lease_of($1)",
                               1, NULL, params, NULL, NULL, 0);
    if (PQresultStatus(r) == PGRES_TUPLES_OK)
        for (int i = 0; i < PQntuples(r); i++)
            fprintf(out, "  queue %s row %s: leased by %s until %s%s\n", ops_tval(a, r, i, 0),
                    ops_tval(a, r, i, 1), ops_tval(a, r, i, 2), ops_tval(a, r, i, 3),
                    strcmp(PQgetvalue(r, i, 4), "t") == 0
                        ? " (expired: its holder stopped extending it; the next take "
                          "takes the row again)"
                        : " (its provider call may be in flight)");
    PQclear(r);
}

int ops_jobs_show(const struct conf *c, const char *key, FILE *out)
{
    const char *params[1] = {key};
    PGconn *db = connect(c);
    PGresult *job, *tl;
    struct ops_strs a = {NULL, 0, 0};
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
        /* an application's emit may name a key idemq never consumed */
        if (ledger_outbox_print_key(db, key, out) > 0)
            goto out;
        /* or an observe-mode input saw it without claiming it */
        if (observe_show(db, key, out) > 0)
            goto out;
        fprintf(out, "no job, attempt or park with key %s\n", ops_text(&a, key));
        rc = 1;
        goto out;
    }
    fprintf(out, "key %s\n", ops_text(&a, key));
    if (PQntuples(job) == 1) {
        fprintf(out, "  state %s, %s attempts, generation %s (budget counts from attempt %s)\n",
                ops_tval(&a, job, 0, 0), ops_tval(&a, job, 0, 1), ops_tval(&a, job, 0, 2), ops_tval(&a, job, 0, 3));
        fprintf(out, "  queue %s, payload sha256 %s\n", ops_tval(&a, job, 0, 11), ops_tval(&a, job, 0, 12));
        fprintf(out, "  first seen %s, applied %s, run after %s\n", ops_tval(&a, job, 0, 4),
                ops_tval(&a, job, 0, 5), ops_tval(&a, job, 0, 6));
        if (!PQgetisnull(job, 0, 8))
            fprintf(out, "  last error %s %s: %s\n", ops_tval(&a, job, 0, 8), ops_tval(&a, job, 0, 9),
                    ops_tval(&a, job, 0, 10));
    } else {
        fprintf(out, "  (no job row: the message never decoded into a job, or its key was "
                     "pruned past the dedup window)\n");
    }
    lease_show(db, key, out, &a);
    fprintf(out, "history (in commit order):\n");
    for (int i = 0; i < PQntuples(tl); i++)
        fprintf(out, "  %s  %s\n", ops_tval(&a, tl, i, 0), ops_tval(&a, tl, i, 1));
    if (PQntuples(job) == 1 && !PQgetisnull(job, 0, 7))
        fprintf(out, "result: %s\n", ops_tval(&a, job, 0, 7));
    resolve_show(db, key, out); /* provider intent and resolutions */
    ledger_outbox_print_key(db, key, out); /* messages its effect emitted */
    groups_show(db, key, out);  /* redrive count and operator actions */
    observe_show(db, key, out); /* observed only, and its observations */
out:
    PQclear(job);
    PQclear(tl);
    PQfinish(db);
    ops_strs_free(&a);
    return rc;
}

/* Remembers a delivery tag to requeue at the end; false when out of memory. */
static bool hold(uint64_t **held, size_t *n, size_t *cap, uint64_t tag)
{
    if (*n == *cap) {
        size_t ncap = *cap ? *cap * 2 : 64;
        uint64_t *nh = realloc(*held, ncap * sizeof **held);
        if (!nh)
            return false;
        *held = nh;
        *cap = ncap;
    }
    (*held)[(*n)++] = tag;
    return true;
}

/*
 * What a message in <queue>.dead says about itself: from idemq's x-idemq-*
 * headers, or, for a message the broker dead-lettered on its own (a quorum
 * delivery limit: no x-idemq-park-id, an x-death header), from x-death and
 * the body (the key, decoded per the input's key_source).
 */
struct dead_view {
    const char *key;    /* NULL = none */
    const char *cls;    /* error class; "broker" for broker-made */
    const char *code;   /* error code; the x-death reason for broker-made */
    const char *origin; /* queue to redrive to, NULL = unknown */
    long long park_id;  /* -1 = none */
    long long died_at;  /* broker-made: x-death time (epoch s), else -1 */
    long count;         /* broker-made: x-death count */
    json_t *death;      /* broker-made: the newest x-death entry, else NULL */
    bool refused;       /* its origin header names a queue of no input */
    bool not_redrivable; /* its park does not hold the whole message */
};

/* Fills v for a message j read from in's dead-letter queue (decodes j). */
static void dead_view(struct job *j, const struct conf_input *in, struct dead_view *v)
{
    json_t *deaths = json_object_get(j->headers, "x-death");
    json_t *id = json_object_get(j->headers, "x-idemq-park-id");
    memset(v, 0, sizeof *v);
    v->park_id = json_is_integer(id) ? (long long)json_integer_value(id) : -1;
    v->died_at = -1;
    if (v->park_id < 0 && json_is_array(deaths) && json_array_size(deaths) > 0 &&
        json_is_object(json_array_get(deaths, 0))) {
        const char *q;
        v->death = json_array_get(deaths, 0); /* newest first */
        q = json_string_value(json_object_get(v->death, "queue"));
        job_decode(j, in);
        v->key = j->has_key ? j->key : NULL;
        v->cls = "broker";
        v->code = json_string_value(json_object_get(v->death, "reason"));
        if (!v->code)
            v->code = "unknown";
        v->origin = q && topology_is_input_queue(in, q) ? q : NULL;
        v->died_at = json_is_integer(json_object_get(v->death, "time"))
                         ? (long long)json_integer_value(json_object_get(v->death, "time"))
                         : -1;
        v->count = json_is_integer(json_object_get(v->death, "count"))
                       ? (long)json_integer_value(json_object_get(v->death, "count"))
                       : 0;
        return;
    }
    v->key = json_string_value(json_object_get(j->headers, "x-idemq-key"));
    v->cls = json_string_value(json_object_get(j->headers, "x-idemq-error-class"));
    v->code = json_string_value(json_object_get(j->headers, "x-idemq-error-code"));
    /* Only the input's own queues: a producer-supplied header must not
     * steer a publish made with idemq's credentials. */
    v->origin = json_string_value(json_object_get(j->headers, "x-idemq-origin-queue"));
    if (v->origin && !topology_is_input_queue(in, v->origin)) {
        v->origin = NULL;
        v->refused = true;
    }
    v->not_redrivable = json_is_false(json_object_get(j->headers, "x-idemq-redrivable"));
}

static int cmp_ll(const void *a, const void *b)
{
    long long x = *(const long long *)a, y = *(const long long *)b;
    return (x > y) - (x < y);
}

static bool matches(const struct dead_view *v, const struct ops_filter *f, long long since_id,
                    long long since_epoch)
{
    if (f->park_ids && (v->park_id < 0 || !bsearch(&v->park_id, f->park_ids, f->n_park_ids,
                                                   sizeof *f->park_ids, cmp_ll)))
        return false;
    if (f->key && (!v->key || strcmp(v->key, f->key) != 0))
        return false;
    if (f->error_class && (!v->cls || strcmp(v->cls, f->error_class) != 0))
        return false;
    if (f->since && (v->park_id >= 0 ? v->park_id < since_id
                                     : v->died_at < 0 || v->died_at < since_epoch))
        return false;
    return true;
}

/* Epoch seconds of a --since timestamp; -1 (and *rc = 2) if it is bad. */
static long long since_epoch_of(PGconn *db, const char *since, int *rc)
{
    const char *params[1] = {since};
    PGresult *r = PQexecParams(db, "SELECT floor(extract(epoch FROM $1::timestamptz))::bigint",
                               1, NULL, params, NULL, NULL, 0);
    long long t = -1;
    if (PQresultStatus(r) != PGRES_TUPLES_OK) {
        log_error("bad --since: %s", PQerrorMessage(db));
        *rc = 2;
    } else {
        t = atoll(PQgetvalue(r, 0, 0));
    }
    PQclear(r);
    return t;
}

/*
 * parked list, second part: messages the broker dead-lettered into each
 * input's <queue>.dead by itself, which have no park row until a redrive
 * records them. Browses (get, then requeue everything it took). Returns 0,
 * or 4 if the broker is unreachable; adds to *n.
 */
static int list_broker_dead(const struct conf *c, const struct ops_filter *f,
                            long long since_epoch, FILE *out, long *n)
{
    struct broker *b;
    char err[512], dlq[TOPOLOGY_NAME_MAX];
    struct job j;
    int rc = 0;

    if (f->error_class && strcmp(f->error_class, "broker") != 0)
        return 0;
    {   /* only broker inputs have a dead-letter queue: none matches, no broker */
        int matching = 0;
        for (int i = 0; i < c->n_inputs; i++)
            matching += !f->input || strcmp(f->input, c->inputs[i].name) == 0;
        if (!matching)
            return 0;
    }
    if (broker_open(c, "idemq parked list", false, &b, err, sizeof err)) {
        log_error("%s", err);
        fprintf(out, "dead letters made by the broker: not listed (broker unreachable)\n");
        return 4;
    }
    job_init(&j);
    for (int i = 0; i < c->n_inputs && rc == 0; i++) {
        const struct conf_input *in = &c->inputs[i];
        uint64_t *held = NULL;
        size_t nheld = 0, cap = 0;
        uint32_t waiting = 0;
        if (f->input && strcmp(f->input, in->name) != 0)
            continue;
        topology_dlq(in, dlq, sizeof dlq);
        if (broker_admin_queue_counts(b, dlq, &waiting, NULL)) { /* passive: keeps b usable */
            if (!strstr(broker_error(b), "404")) {
                log_error("checking %s: %s", dlq, broker_error(b));
                rc = 4;
            }
            continue; /* no dead-letter queue: nothing the broker put there */
        }
        for (uint32_t seen = 0; seen < waiting; seen++) { /* what is there now */
            struct dead_view v;
            idemq_err_t e = broker_get(b, dlq, &j, false);
            if (e == IDEMQ_ERR_TIMEOUT)
                break;
            if (e) {
                log_error("reading %s: %s", dlq, broker_error(b));
                rc = 4;
                break;
            }
            if (!hold(&held, &nheld, &cap, j.tag)) {
                rc = 1;
                break;
            }
            dead_view(&j, in, &v);
            if (!v.death || !matches(&v, f, 0, since_epoch))
                continue;
            if (f->limit > 0 && *n >= f->limit)
                break;
            if (*n == 0)
                fprintf(out, "dead-lettered by the broker, no park row yet (`idemq redrive` "
                             "records and moves them):\n");
            (*n)++;
            {
                char when[32] = "-";
                time_t t = (time_t)v.died_at;
                struct tm tm;
                if (v.died_at >= 0 && gmtime_r(&t, &tm))
                    strftime(when, sizeof when, "%Y-%m-%d %H:%M:%SZ", &tm);
                fprintf(out, "  %-20s %-32s %-10s %-18s from %s, %ld time(s); dlq %s\n", when,
                        v.key ? v.key : "(no key)", v.cls, v.code,
                        json_string_value(json_object_get(v.death, "queue"))
                            ? json_string_value(json_object_get(v.death, "queue"))
                            : "?",
                        v.count, dlq);
            }
        }
        for (size_t k = 0; k < nheld; k++)
            if (broker_nack(b, held[k], true))
                break; /* the channel is gone: the broker requeues them anyway */
        free(held);
    }
    job_destroy(&j);
    broker_close(b);
    return rc;
}

/* The ids of the keys c lists, as a PostgreSQL text[] literal. */
static void listed_key_ids(const struct conf *c, char *ids, size_t len)
{
    size_t off = 0;
    ids[off++] = '{';
    for (int i = 0; i < c->protection_keys.n; i++) {
        const char *e = c->protection_keys.v[i], *eq = strchr(e, '=');
        if (eq && off + (size_t)(eq - e) + 2 < len) /* ids are [A-Za-z0-9_-] */
            off += (size_t)snprintf(ids + off, len - off, "%s%.*s", off > 1 ? "," : "",
                                    (int)(eq - e), e);
    }
    ids[off++] = '}';
    ids[off] = '\0';
}

/* The count sql returns for params, or -1 when the ledger did not answer. */
static long count_of(PGconn *db, const char *sql, int n, const char *const *params)
{
    PGresult *r = PQexecParams(db, sql, n, NULL, params, NULL, NULL, 0);
    long count = -1;
    if (PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1)
        count = atol(PQgetvalue(r, 0, 0));
    PQclear(r);
    return count;
}

/* Parks matching the list's filters (params: key, class, since, queue), open
 * ones and resolved ones of the hot history, whose body is sealed with a
 * key c does not list: they cannot be opened until that key is listed
 * again. Returns the count, or -1 when the ledger did not answer. */
static long unreadable_parks(PGconn *db, const struct conf *c, const char *const *filter)
{
    char ids[32 * 40 + 3];
    const char *params[5] = {filter[0], filter[1], filter[2], filter[3], ids};

    listed_key_ids(c, ids, sizeof ids);
    return count_of(db,
                     "SELECT count(*) FROM (SELECT key, error_class, parked_at, source_queue,"
                     " body_key FROM idemq.parked UNION ALL SELECT key, park->>'error_class',"
                     " parked_at, source_queue, park->>'body_key' FROM idemq.park_history) p"
                     " WHERE body_key IS NOT NULL AND NOT body_key = ANY ($5::text[])"
                     " AND ($1::text IS NULL OR key = $1) AND ($2::text IS NULL OR"
                     " error_class = $2) AND ($3::timestamptz IS NULL OR parked_at >= $3)"
                     " AND ($4::text IS NULL OR source_queue = $4)",
                     5, params);
}

/* Outbox rows still pending (filters: key, since) whose body is sealed
 * with a key c does not list: the relay cannot publish them until that key
 * is listed again (it logs each and counts idemq_outbox_unopened_total).
 * Returns the count, or -1 when the ledger did not answer. */
static long unreadable_outbox(PGconn *db, const struct conf *c, const char *const *filter)
{
    char ids[32 * 40 + 3];
    const char *params[3] = {filter[0], filter[2], ids};

    listed_key_ids(c, ids, sizeof ids);
    return count_of(db,
                     "SELECT count(*) FROM idemq.outbox WHERE state = 'pending'"
                     " AND body_key IS NOT NULL AND NOT body_key = ANY ($3::text[])"
                     " AND ($1::text IS NULL OR key = $1)"
                     " AND ($2::timestamptz IS NULL OR created_at >= $2)",
                     3, params);
}

int ops_parked_list(const struct conf *c, const struct ops_filter *f, FILE *out)
{
    char limit[24], queue[300] = "";
    const char *params[5];
    PGconn *db;
    PGresult *rows, *counts;
    struct ops_strs a = {NULL, 0, 0};
    int rc = 0;

    if (f->input) {
        for (int i = 0; i < c->n_inputs; i++)
            if (strcmp(c->inputs[i].name, f->input) == 0)
                snprintf(queue, sizeof queue, "%s", c->inputs[i].queue);
        for (int i = 0; i < c->n_pg_inputs; i++) /* PostgreSQL queue inputs */
            if (strcmp(c->pg_inputs[i].name, f->input) == 0)
                snprintf(queue, sizeof queue, "%s", c->pg_inputs[i].queue);
        for (int i = 0; i < c->n_sqs_inputs; i++) /* Amazon SQS inputs */
            if (strcmp(c->sqs_inputs[i].name, f->input) == 0)
                snprintf(queue, sizeof queue, "%s", c->sqs_inputs[i].queue);
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
        fprintf(out, "%-6s %-27s %-32s %-10s %-18s %-8s %-3s %-3s %-4s %s\n", ops_val(rows, i, 0),
                ops_val(rows, i, 1), ops_tval(&a, rows, i, 2), ops_tval(&a, rows, i, 3),
                ops_tval(&a, rows, i, 4), ops_val(rows, i, 5), ops_val(rows, i, 6),
                ops_val(rows, i, 7), ops_val(rows, i, 8), ops_tval(&a, rows, i, 9));
    {
        long n_broker = 0;
        long long since_epoch = f->since ? since_epoch_of(db, f->since, &rc) : 0;
        if (rc == 0) {
            int brc = list_broker_dead(c, f, since_epoch, out, &n_broker);
            if (brc)
                rc = brc;
        }
        /* parked outbox rows have no input and no error class */
        int n_outbox = f->input || f->error_class
                           ? 0
                           : ledger_outbox_print_parked(db, f->key, f->since, f->limit, out);
        fprintf(out, "count by error class:");
        if (PQntuples(counts) == 0 && n_broker == 0 && n_outbox <= 0)
            fprintf(out, " none");
        for (int i = 0; i < PQntuples(counts); i++)
            fprintf(out, " %s=%s", ops_val(counts, i, 0), ops_val(counts, i, 1));
        if (n_broker)
            fprintf(out, " broker(not yet recorded)=%ld", n_broker);
        if (n_outbox > 0)
            fprintf(out, " outbox=%d", n_outbox);
        fprintf(out, "\n");
        {
            long sealed = unreadable_parks(db, c, params);
            long held = unreadable_outbox(db, c, params);
            if (sealed > 0)
                fprintf(out, "bodies sealed with a key protection.keys does not list "
                             "(cannot be opened): %ld\n", sealed);
            if (held > 0)
                fprintf(out, "outbox rows sealed with a key protection.keys does not list "
                             "(not published until it is listed again): %ld\n", held);
        }
    }
out:
    PQclear(rows);
    PQclear(counts);
    ops_strs_free(&a);
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

void ops_who(char *buf, size_t len)
{
    char host[128] = "host";
    struct passwd *pw = getpwuid(getuid());
    gethostname(host, sizeof host - 1);
    snprintf(buf, len, "idemq redrive (%s@%s)", pw ? pw->pw_name : "?", host);
}

/*
 * A message the broker dead-lettered by itself gets a park row (error class
 * broker, code = x-death reason) before it moves, so the audit shows it;
 * its copy then carries the x-idemq-* headers of any redrive, without the
 * broker's x-death history. 0, or an exit code (4: database unreachable).
 */
static int adopt(const struct conf *c, PGconn **db, const struct conf_input *in, struct job *j,
                 const struct dead_view *v, const char *by)
{
    char reason[512], count[24], size[24], *hdrs, *props;
    const char *params[14];
    json_t *keep;
    PGresult *r;
    const char *k;
    json_t *e;
    void *tmp;
    int rc = 0;

    if (!*db && !(*db = connect(c)))
        return 4;
    snprintf(reason, sizeof reason,
             "dead-lettered by the broker from queue %s (x-death reason %s, %ld time(s)) "
             "before idemq parked it: a quorum delivery limit, or a dead-letter policy",
             v->origin ? v->origin : "?", v->code, v->count);
    snprintf(count, sizeof count, "%ld", v->count);
    snprintf(size, sizeof size, "%zu", j->body_len);
    hdrs = json_dumps(j->headers, JSON_COMPACT);
    props = json_dumps(j->props, JSON_COMPACT);
    {
        size_t n = 0, sealed_len;
        unsigned char *sealed, *body;
        const char *key_id;
        if (protect_seal_stored(j->body, j->body_len, &sealed, &sealed_len, &key_id)) {
            log_error("cannot seal the body of the broker's dead letter %s: left in place",
                      v->key ? v->key : "(no key)");
            free(hdrs);
            free(props);
            return 1;
        }
        body = sealed ? PQescapeByteaConn(*db, sealed, sealed_len, &n)
                      : PQescapeByteaConn(*db, j->body, j->body_len, &n);
        free(sealed);
        params[0] = v->key;
        params[1] = v->origin ? v->origin : in->queue;
        params[2] = j->exchange;
        params[3] = j->routing_key;
        params[4] = (const char *)body;
        params[5] = hdrs;
        params[6] = props;
        params[7] = j->sha256_hex;
        params[8] = v->code;
        params[9] = reason;
        params[10] = count;
        params[11] = by;
        params[12] = key_id;
        params[13] = size;
        r = body && hdrs && props
                ? PQexecParams(*db,
                               "SELECT r_park_id, r_generation FROM idemq.adopt_dead_letter("
                               "$1, $2, $3, $4, $5::bytea, $6::jsonb, $7::jsonb, $8, $9, $10, "
                               "$11::integer, $12, $13, $14::bigint)",
                               14, NULL, params, NULL, NULL, 0)
                : NULL;
        PQfreemem(body);
    }
    free(hdrs);
    free(props);
    if (PQresultStatus(r) != PGRES_TUPLES_OK || PQntuples(r) != 1) {
        log_error("cannot record the broker's dead letter %s in the ledger: %s (left in place)",
                  v->key ? v->key : "(no key)", PQerrorMessage(*db));
        PQclear(r);
        return PQstatus(*db) == CONNECTION_OK ? 1 : 4;
    }
    /* the copy: the broker's death history (and whatever else it acts on)
     * off, idemq's redrive headers on */
    keep = json_object();
    json_object_foreach_safe(j->headers, tmp, k, e)
    {
        if (!republish_broker_header(k))
            json_object_set(keep, k, e);
    }
    if (v->key)
        json_object_set_new(keep, "x-idemq-key", json_string(v->key));
    json_object_set_new(keep, "x-idemq-error-class", json_string("broker"));
    json_object_set_new(keep, "x-idemq-error-code", json_string(v->code));
    json_object_set_new(keep, "x-idemq-park-id", json_integer(atoll(PQgetvalue(r, 0, 0))));
    json_object_set_new(keep, "x-idemq-generation", json_integer(atoll(PQgetvalue(r, 0, 1))));
    if (v->origin)
        json_object_set_new(keep, "x-idemq-origin-queue", json_string(v->origin));
    json_decref(j->headers);
    j->headers = keep;
    PQclear(r);
    return rc;
}

/* Connections parked on a message the client library cannot decode: each
 * holds its message (and what it held before) unacknowledged until the
 * end, when they return to the queue, so the redrive goes on past it on a
 * new connection. */
#define REDRIVE_MAX_UNDECODABLE 16

struct redrive {
    struct broker *b;
    struct broker *stuck[REDRIVE_MAX_UNDECODABLE];
    int n_stuck;
    uint64_t *held; /* taken and left in place, on b */
    size_t nheld, cap;
};

/* Gives back what is held (requeued) and closes the stuck connections. */
static void release(struct redrive *r)
{
    for (size_t i = 0; r->b && i < r->nheld; i++)
        if (broker_nack(r->b, r->held[i], true))
            break; /* the channel is gone: the broker requeues them anyway */
    r->nheld = 0;
    for (int i = 0; i < r->n_stuck; i++)
        broker_close(r->stuck[i]);
    r->n_stuck = 0;
}

/* The ledger's redrive secret into seal.c; 0, or an exit code. */
int ops_load_seal(PGconn *db)
{
    PGresult *r = PQexec(db, "SELECT secret FROM idemq.redrive_seal WHERE id = 1");
    int rc = 0;
    if (PQresultStatus(r) != PGRES_TUPLES_OK || PQntuples(r) != 1 ||
        !seal_set_secret_hex(PQgetvalue(r, 0, 0))) {
        log_error("cannot read the redrive secret (idemq.redrive_seal; run idemq migrate): %s",
                  PQerrorMessage(db));
        rc = PQstatus(db) == CONNECTION_OK ? 1 : 4;
    }
    PQclear(r);
    return rc;
}

/*
 * Seals the copy about to be redriven (seal.h). A copy idemq sealed keeps
 * its seal; one it did not (dead-lettered before seals existed, or put in
 * <queue>.dead by someone else) is sealed only while the ledger holds the
 * open park its headers name (same id, key and generation); otherwise it
 * goes without x-idemq-generation, so it cannot start a redrive (a
 * duplicate of a parked or applied key, or a new job), and *note says so.
 * Then the seal of who redrives it (x-idemq-redrive-seal; the caller adds
 * x-idemq-redriven-by = by). 0, or an exit code.
 */
int ops_seal_copy(PGconn *db, struct job *j, const char *key, const char *by,
                  const char **note)
{
    json_t *h = j->headers, *gen = json_object_get(h, "x-idemq-generation");
    char why[160], s[SEAL_HEX], g[24], id[24];
    long long park = -1;

    *note = NULL;
    if (!gen)
        return 0;
    if (json_is_integer(json_object_get(h, "x-idemq-park-id")))
        park = (long long)json_integer_value(json_object_get(h, "x-idemq-park-id"));
    if (!key || !json_is_integer(gen) || !seal_check_headers(h, key, why, sizeof why)) {
        bool open_park = false;
        if (key && json_is_integer(gen) && park > 0) {
            const char *params[3] = {id, key, g};
            PGresult *r;
            snprintf(id, sizeof id, "%lld", park);
            snprintf(g, sizeof g, "%lld", (long long)json_integer_value(gen));
            r = PQexecParams(db, "SELECT count(*) FROM idemq.parked WHERE id = $1::bigint AND "
                                 "key = $2 AND generation = $3::integer",
                             3, NULL, params, NULL, NULL, 0);
            if (PQresultStatus(r) != PGRES_TUPLES_OK) {
                log_error("cannot look up park %s: %s", id, PQerrorMessage(db));
                PQclear(r);
                return PQstatus(db) == CONNECTION_OK ? 1 : 4;
            }
            open_park = strcmp(PQgetvalue(r, 0, 0), "1") == 0;
            PQclear(r);
        }
        if (open_park) {
            if (!seal_put_park(h, key))
                return 1;
        } else {
            json_object_del(h, "x-idemq-generation");
            json_object_del(h, "x-idemq-seal");
            *note = " (not sealed by idemq and no open park matches it: sent without its "
                    "generation, so it cannot start a redrive)";
            return 0;
        }
    }
    if (!seal_by(key, (long long)json_integer_value(gen), park, by, s) ||
        json_object_set_new(h, "x-idemq-redrive-seal", json_string(s)))
        return 1;
    return 0;
}

/* Redrives one input's dead-letter queue; *left counts what stays there. */
static int redrive_input(const struct conf *c, PGconn **db, struct redrive *r,
                         const struct conf_input *in, const struct ops_filter *f,
                         long long since_id, long long since_epoch, long *moved, long *left,
                         FILE *out)
{
    char dlq[TOPOLOGY_NAME_MAX], by[300], origin[TOPOLOGY_NAME_MAX], err[512];
    struct job j;
    int rc = 0;

    topology_dlq(in, dlq, sizeof dlq);
    ops_who(by, sizeof by);
    job_init(&j);
    for (;;) {
        struct dead_view v;
        const char *why = NULL;
        bool match;
        idemq_err_t e;
        if (f->limit > 0 && *moved >= f->limit)
            break;
        e = broker_get(r->b, dlq, &j, false);
        if (e == IDEMQ_ERR_TIMEOUT)
            break;
        if (e == IDEMQ_ERR_UNDECODABLE) {
            /* This connection cannot read past it: keep it (with the
             * message) aside and go on with a new one. */
            log_warn("%s: delivery %llu cannot be decoded by the client library (not "
                     "redrivable); left in place",
                     dlq, (unsigned long long)j.tag);
            (*left)++;
            if (r->n_stuck == REDRIVE_MAX_UNDECODABLE) {
                log_error("%s: more than %d undecodable messages; stopping here", dlq,
                          REDRIVE_MAX_UNDECODABLE);
                rc = 1;
                break;
            }
            r->nheld = 0; /* what it holds returns when it closes */
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
        dead_view(&j, in, &v);
        match = matches(&v, f, since_id, since_epoch);
        if (match && v.origin && v.not_redrivable) {
            v.origin = NULL;
            why = "not redrivable: the park does not hold the whole message";
        } else if (match && !v.origin) {
            why = v.refused ? "its x-idemq-origin-queue names a queue of no input (refused)"
                            : "no x-idemq-origin-queue, nor an x-death naming one of the "
                              "input's queues";
        }
        if (!match || !v.origin || f->dry_run) {
            if (why)
                log_warn("%s: %s (%s) left in place: %s", dlq, v.key ? v.key : "(no key)",
                         v.cls ? v.cls : "?", why);
            else if (match) {
                fprintf(out, "would redrive %s (%s) to %s\n", v.key ? v.key : "(no key)",
                        v.cls ? v.cls : "?", v.origin);
                (*moved)++;
            }
            (*left)++;
            if (!hold(&r->held, &r->nheld, &r->cap, j.tag)) {
                rc = 1;
                break;
            }
            continue;
        }
        snprintf(origin, sizeof origin, "%s", v.origin); /* adopt replaces the headers */
        if (v.death && (rc = adopt(c, db, in, &j, &v, by)) != 0) {
            (*left)++;
            (void)hold(&r->held, &r->nheld, &r->cap, j.tag); /* requeued at the end */
            break;
        }
        {
            struct broker_props p = {NULL, NULL, j.headers, true, NULL, j.props};
            const char *note = NULL;
            /* A CC a producer put on the message (or the broker kept while
             * dead-lettering it) would copy it, with the operator's
             * credentials, into any queue it names. */
            republish_strip_broker_headers(j.headers);
            json_object_del(j.headers, "x-idemq-redriven-by");
            json_object_del(j.headers, "x-idemq-redrive-seal");
            if ((rc = ops_seal_copy(*db, &j, v.key, by, &note)) != 0) {
                (*left)++;
                (void)hold(&r->held, &r->nheld, &r->cap, j.tag);
                break;
            }
            json_object_set_new(j.headers, "x-idemq-redriven-by", json_string(by));
            if (note)
                log_warn("%s: %s%s", dlq, v.key ? v.key : "(no key)", note);
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
        if (f->on_moved)
            f->on_moved(f->moved_arg, v.key, v.park_id);
        fprintf(out, "redriven %s%s to %s\n", v.key ? v.key : "(no key)",
                v.death ? " (dead-lettered by the broker; now recorded in idemq.parked)" : "",
                origin);
        if (f->rate > 0) {
            struct timespec ts = {(time_t)(1.0 / f->rate), (long)(1e9 / f->rate) % 1000000000L};
            nanosleep(&ts, NULL);
        }
    }
    job_destroy(&j);
    return rc;
}

/*
 * redrive, PostgreSQL queue inputs: each open park of input in that
 * matches f (and is in f->park_ids, when set) goes back into its queue as a
 * new row through idemq.queue_redrive, the same path as the SQL call.
 * Returns 0, or 1 when a statement fails; adds to *moved.
 */
static int redrive_pg_input(PGconn *db, const struct conf_input *in, const struct ops_filter *f,
                            FILE *out, long *moved)
{
    char limit[24], *ids = NULL;
    const char *params[6];
    PGresult *rows;
    struct ops_strs a = {NULL, 0, 0};
    int rc = 0;

    if (f->park_ids) { /* a failure group's parks: "{1,2,...}" */
        size_t cap = 3 + f->n_park_ids * 21, n = 0;
        if (!(ids = malloc(cap)))
            return 1;
        ids[n++] = '{';
        for (size_t i = 0; i < f->n_park_ids; i++)
            n += (size_t)snprintf(ids + n, cap - n, "%s%lld", i ? "," : "", f->park_ids[i]);
        snprintf(ids + n, cap - n, "}");
    }
    snprintf(limit, sizeof limit, "%ld", f->limit > 0 ? f->limit : 1000000000L);
    params[0] = in->queue;
    params[1] = f->key;
    params[2] = f->error_class;
    params[3] = f->since;
    params[4] = ids;
    params[5] = limit;
    rows = PQexecParams(db,
                        "SELECT id, coalesce(key, '(no key)'), key FROM idemq.parked"
                        " WHERE properties->>'transport' = 'postgres'"
                        " AND properties->>'queue' = $1 AND coalesce(redrivable, true)"
                        " AND ($2::text IS NULL OR key = $2)"
                        " AND ($3::text IS NULL OR error_class = $3)"
                        " AND ($4::timestamptz IS NULL OR parked_at >= $4)"
                        " AND ($5::bigint[] IS NULL OR id = ANY ($5::bigint[]))"
                        " ORDER BY id LIMIT $6::bigint",
                        6, NULL, params, NULL, NULL, 0);
    free(ids);
    if (PQresultStatus(rows) != PGRES_TUPLES_OK) {
        log_error("cannot list the parks of input %s: %s", in->name, PQerrorMessage(db));
        PQclear(rows);
        return 1;
    }
    for (int i = 0; i < PQntuples(rows) && rc == 0; i++) {
        const char *p[1] = {ops_val(rows, i, 0)};
        const char *key = ops_tval(&a, rows, i, 1);
        if (f->dry_run) {
            fprintf(out, "would redrive park %s (key %s) into queue %s\n", p[0], key, in->queue);
            (*moved)++;
            continue;
        }
        PGresult *r = PQexecParams(db, "SELECT idemq.queue_redrive($1::bigint, 'idemq redrive')",
                                   1, NULL, p, NULL, NULL, 0);
        if (PQresultStatus(r) == PGRES_TUPLES_OK) {
            fprintf(out, "redrove park %s (key %s) into queue %s as row %s\n", p[0], key,
                    in->queue, ops_val(r, 0, 0));
            (*moved)++;
            if (f->on_moved)
                f->on_moved(f->moved_arg, PQgetisnull(rows, i, 2) ? NULL : ops_val(rows, i, 2),
                            atoll(p[0]));
        } else {
            const char *st = PQresultErrorField(r, PG_DIAG_SQLSTATE);
            if (st && strcmp(st, "P0002") == 0) { /* closed meanwhile: nothing to do */
                fprintf(out, "park %s is no longer open\n", p[0]);
            } else {
                log_error("redriving park %s: %s", p[0], PQerrorMessage(db));
                rc = 1;
            }
        }
        PQclear(r);
    }
    PQclear(rows);
    ops_strs_free(&a);
    return rc;
}

int ops_redrive(const struct conf *c, const struct ops_filter *f, FILE *out)
{
    struct redrive r;
    char err[512];
    long long since_id = 0, since_epoch = 0;
    long moved = 0, left = 0;
    int rc = 0, found = 0, pg_found = 0;
    PGconn *db = NULL; /* the ledger: the seal's secret, --since, broker-made dead letters */

    memset(&r, 0, sizeof r);
    if (f->input) {
        for (int i = 0; i < c->n_inputs; i++)
            found += strcmp(f->input, c->inputs[i].name) == 0;
        for (int i = 0; i < c->n_pg_inputs; i++)
            pg_found += strcmp(f->input, c->pg_inputs[i].name) == 0;
        for (int i = 0; i < c->n_sqs_inputs; i++)
            pg_found += strcmp(f->input, c->sqs_inputs[i].name) == 0;
        if (!found && !pg_found) {
            fprintf(stderr, "idemq: no input named %s\n", f->input);
            return 2;
        }
    }
    /* The ledger's secret seals what this redrive publishes. */
    if (!(db = connect(c)))
        return 4;
    if ((rc = ops_load_seal(db)) != 0) {
        PQfinish(db);
        return rc;
    }
    if (f->since) {
        since_id = since_park_id(db, f->since, &rc);
        if (!rc)
            since_epoch = since_epoch_of(db, f->since, &rc);
        if (rc) {
            PQfinish(db);
            return rc;
        }
    }
    /* PostgreSQL queue inputs: their parks go back into their queues */
    for (int i = 0; i < c->n_pg_inputs && rc == 0; i++)
        if (!f->input || strcmp(f->input, c->pg_inputs[i].name) == 0)
            rc = redrive_pg_input(db, &c->pg_inputs[i], f, out, &moved);
    /* Amazon SQS inputs: from their dead-letter queues (sqs_redrive.h) */
    for (int i = 0; i < c->n_sqs_inputs && rc == 0; i++)
        if (!f->input || strcmp(f->input, c->sqs_inputs[i].name) == 0)
            rc = sqs_redrive_input(c, db, &c->sqs_inputs[i], f, out, &moved, &left);
    if (c->n_inputs == 0 || (f->input && !found)) { /* no broker input: no broker */
        PQfinish(db);
        fprintf(out, "%s %ld park%s into %s%s\n", f->dry_run ? "would redrive" : "redrove",
                moved, moved == 1 ? "" : "s",
                f->input ? "the queue of input " : "their queues",
                f->input ? f->input : "");
        return rc;
    }
    if (broker_open(c, "idemq redrive", true, &r.b, err, sizeof err)) {
        log_error("%s", err);
        PQfinish(db);
        return 4;
    }
    for (int i = 0; i < c->n_inputs && rc == 0 && r.b; i++) {
        if (f->input && strcmp(f->input, c->inputs[i].name) != 0)
            continue;
        rc = redrive_input(c, &db, &r, &c->inputs[i], f, since_id, since_epoch, &moved, &left,
                           out);
    }
    release(&r);
    broker_close(r.b);
    free(r.held);
    PQfinish(db);
    fprintf(out, "%s %ld message%s; %ld %s in the dead-letter queue%s%s%s%s\n",
            f->dry_run ? "would redrive" : "redrove", moved, moved == 1 ? "" : "s", left,
            f->dry_run ? "stay" : "left", f->input ? " of input " : "s",
            f->input ? f->input : "", f->input ? " (other inputs not looked at)" : "",
            f->dry_run ? " (dry run: nothing was moved)" : "");
    return rc;
}

int ops_erase(const struct conf *c, const char *key, const char *why, FILE *out)
{
    char by[128];
    const char *params[3];
    PGconn *db = connect(c);
    PGresult *r;
    struct ops_strs a = {NULL, 0, 0};
    int rc = 0;

    if (!db)
        return 4;
    {
        char host[128] = "host";
        struct passwd *pw = getpwuid(getuid());
        gethostname(host, sizeof host - 1);
        snprintf(by, sizeof by, "idemq erase (%s@%s)", pw ? pw->pw_name : "?", host);
    }
    params[0] = key;
    params[1] = by;
    params[2] = why;
    r = PQexecParams(db,
                     "SELECT r_action, r_parks, r_history, r_intents"
                     " FROM idemq.erase_key($1, $2, $3)",
                     3, NULL, params, NULL, NULL, 0);
    if (PQresultStatus(r) != PGRES_TUPLES_OK || PQntuples(r) != 1) {
        fprintf(stderr, "idemq: not erased: %s\n",
                ops_text(&a, PQresultErrorField(r, PG_DIAG_MESSAGE_PRIMARY)
                                 ? PQresultErrorField(r, PG_DIAG_MESSAGE_PRIMARY)
                                 : PQerrorMessage(db)));
        rc = PQstatus(db) == CONNECTION_OK ? 2 : 4;
    } else {
        fprintf(out,
                "erased %s: %s open park(s), %s resolved park(s), %s provider request(s); "
                "hashes, states, times and error texts kept; operator action #%s by %s\n",
                ops_text(&a, key), PQgetvalue(r, 0, 1), PQgetvalue(r, 0, 2),
                PQgetvalue(r, 0, 3), PQgetvalue(r, 0, 0), ops_text(&a, by));
        fprintf(out, "not touched: a dead-letter copy still in the broker (<queue>.dead), "
                     "and copies outside the ledger\n");
    }
    PQclear(r);
    ops_strs_free(&a);
    PQfinish(db);
    return rc;
}
