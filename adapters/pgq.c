/*
 * pgq: the PostgreSQL queue transport: rows of idemq.queue_jobs in and
 * out of the worker's transaction, and LISTEN/NOTIFY (see pgq.h).
 */
#include "pgq.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "log.h"

#define TAKE_COLUMNS                                                                        \
    "SELECT r_id, r_key, r_order_key, r_payload, r_attempts, r_redrive_gen, r_park_id, "    \
    "r_enqueued_at, r_traceparent, r_tracestate "
#define TAKE_NCOLS 10
#define TAKE_SQL TAKE_COLUMNS "FROM idemq.queue_take($1, $2)"
#define TAKE_ROW_SQL TAKE_COLUMNS "FROM idemq.queue_take_row($1)"
/* queue_take_after: a job's columns, then the row's run_after and priority */
#define TAKE_FROM_SQL                                                                       \
    TAKE_COLUMNS ", r_run_after, r_priority FROM idemq.queue_take_after($1, $2, "           \
                 "$3::timestamptz, $4::smallint, $5::bigint)"
#define SETTLE_SQL                                                                          \
    "SELECT idemq.queue_settle($1::bigint[], $2::bigint[], $3::integer[], $4::boolean[], "  \
    "$5::text[], $6::text[], $7::bigint[])"

idemq_err_t pgq_listen(PGconn *db, struct ledger_db_error *e)
{
    return ledger_db_exec(db, "LISTEN " PGQ_CHANNEL, e);
}

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

bool pgq_row_job(const struct pgq_row *row, const struct conf_input *in, int input_idx,
                 struct job *j)
{
    json_t *props;
    char *key, *okey, *at;

    job_reset(j);
    j->input = input_idx;
    j->tag = (uint64_t)row->id;
    j->received_ns = now_ns();
    j->redelivered = row->attempts > 0;
    if (job_set_body(j, row->payload, row->payload_len) != IDEMQ_OK)
        return false;
    if (row->key && strlen(row->key) < sizeof j->message_id) {
        snprintf(j->message_id, sizeof j->message_id, "%s", row->key);
        j->has_message_id = true;
    } else if (row->key) {
        /* idemq.enqueue refuses it; a row written otherwise is parked,
         * never applied under a cut key */
        j->wire_err = IDEMQ_ERR_KEY_TOO_LONG;
        snprintf(j->wire_reason, sizeof j->wire_reason,
                 "the row's key holds %zu bytes, more than %zu", strlen(row->key),
                 sizeof j->message_id - 1);
    }
    snprintf(j->routing_key, sizeof j->routing_key, "%s", in->queue);
    /* JSON holds UTF-8 only: a database whose encoding lets other bytes
     * through gets them as '?' here (the key itself is judged by
     * job_decode, which parks an invalid one) */
    key = row->key ? strdup(row->key) : NULL;
    okey = row->order_key ? strdup(row->order_key) : NULL;
    at = strdup(row->enqueued_at ? row->enqueued_at : "");
    if ((row->key && !key) || (row->order_key && !okey) || !at) {
        free(key);
        free(okey);
        free(at);
        return false;
    }
    if (key)
        job_utf8_sanitize(key);
    if (okey)
        job_utf8_sanitize(okey);
    job_utf8_sanitize(at);
    props = json_pack("{s:s, s:s, s:I, s:s?, s:s?, s:s, s:i}", "transport", "postgres", "queue",
                      in->queue, "queue_row", (json_int_t)row->id, "enqueue_key", key,
                      "order_key", okey, "enqueued_at", at, "attempts", row->attempts);
    free(key);
    free(okey);
    free(at);
    if (!props)
        return false;
    json_decref(j->props);
    j->props = props;
    /* the trace context as a broker message carries it, for job_decode's
     * trace_job_begin to check; text that is not UTF-8 is no JSON string,
     * and no valid context either: dropped */
    if (row->traceparent) {
        json_t *v = json_string(row->traceparent);
        if (v && json_object_set_new(j->headers, "traceparent", v))
            return false;
        if (v && row->tracestate && (v = json_string(row->tracestate)) &&
            json_object_set_new(j->headers, "tracestate", v))
            return false;
    }
    job_decode(j, in);
    if (j->decode_err == IDEMQ_OK && row->has_redrive) {
        /* Put back by idemq.queue_redrive (an operator function: neither a
         * producer nor the table's readers can set it): presented as a
         * redrive of that generation, which the ledger checks against the
         * key's own. Set after job_decode, which refuses unsealed redrive
         * headers on a broker delivery. */
        if (json_object_set_new(j->headers, "x-idemq-generation",
                                json_integer(row->redrive_gen)) ||
            (row->park_id > 0 &&
             json_object_set_new(j->headers, "x-idemq-park-id", json_integer(row->park_id))) ||
            json_object_set_new(j->headers, "x-idemq-redriven-by", json_string("queue_redrive")))
            return false;
    }
    return true;
}

bool pgq_result_row_job(const PGresult *r, int i, const struct conf_input *in, int input_idx,
                        struct job *j)
{
    struct pgq_row row;
    size_t len = 0;
    unsigned char *body;
    bool ok;

    memset(&row, 0, sizeof row);
    if (!(body = PQunescapeBytea((const unsigned char *)PQgetvalue(r, i, 3), &len)))
        return false;
    row.id = strtoll(PQgetvalue(r, i, 0), NULL, 10);
    row.key = PQgetisnull(r, i, 1) ? NULL : PQgetvalue(r, i, 1);
    row.order_key = PQgetisnull(r, i, 2) ? NULL : PQgetvalue(r, i, 2);
    row.payload = body;
    row.payload_len = len;
    row.attempts = atoi(PQgetvalue(r, i, 4));
    row.has_redrive = !PQgetisnull(r, i, 5);
    row.redrive_gen = row.has_redrive ? strtoll(PQgetvalue(r, i, 5), NULL, 10) : 0;
    row.park_id = PQgetisnull(r, i, 6) ? 0 : strtoll(PQgetvalue(r, i, 6), NULL, 10);
    row.enqueued_at = PQgetvalue(r, i, 7);
    row.traceparent = PQgetisnull(r, i, 8) ? NULL : PQgetvalue(r, i, 8);
    row.tracestate = PQgetisnull(r, i, 9) ? NULL : PQgetvalue(r, i, 9);
    ok = pgq_row_job(&row, in, input_idx, j);
    PQfreemem(body);
    return ok;
}

/* Runs a take statement and turns its rows into jobs[0..*n); with pos,
 * moves it to the last row (the statement returns run_after and priority
 * after the TAKE_NCOLS columns of a job). */
static idemq_err_t take(PGconn *db, const char *sql, int np, const char *const *params,
                        const struct conf_input *in, int input_idx, struct job *jobs, int cap,
                        int *n, struct pgq_pos *pos, struct ledger_db_error *e)
{
    PGresult *r;
    int rows;

    *n = 0;
    r = ledger_db_exec_params(db, sql, np, NULL, params, NULL, NULL, 0);
    if (PQresultStatus(r) != PGRES_TUPLES_OK ||
        PQnfields(r) != (pos ? TAKE_NCOLS + 2 : TAKE_NCOLS)) {
        ledger_db_error_from(db, r, e);
        PQclear(r);
        return ledger_db_err(e);
    }
    rows = PQntuples(r);
    for (int i = 0; i < rows && i < cap; i++) {
        if (!pgq_result_row_job(r, i, in, input_idx, &jobs[i])) {
            PQclear(r);
            snprintf(e->message, sizeof e->message, "out of memory taking queue rows");
            e->sqlstate[0] = '\0';
            e->conn_lost = false;
            return IDEMQ_ERR_NOMEM;
        }
        (*n)++;
    }
    if (pos && *n > 0) {
        int last = *n - 1;
        pos->set = true;
        snprintf(pos->run_after, sizeof pos->run_after, "%s", PQgetvalue(r, last, TAKE_NCOLS));
        pos->priority = atoi(PQgetvalue(r, last, TAKE_NCOLS + 1));
        pos->id = strtoll(PQgetvalue(r, last, 0), NULL, 10);
    }
    PQclear(r);
    return IDEMQ_OK;
}

idemq_err_t pgq_take(PGconn *db, const struct conf_input *in, int input_idx, struct job *jobs,
                     int cap, int *n, struct ledger_db_error *e)
{
    char lim[16];
    const char *params[2] = {in->queue, lim};
    snprintf(lim, sizeof lim, "%d", cap);
    return take(db, TAKE_SQL, 2, params, in, input_idx, jobs, cap, n, NULL, e);
}

idemq_err_t pgq_take_from(PGconn *db, const struct conf_input *in, int input_idx,
                          struct pgq_pos *pos, struct job *jobs, int cap, int *n,
                          struct ledger_db_error *e)
{
    char lim[16], prio[16], id[32];
    const char *params[5] = {in->queue, lim, "-infinity", "-32768", "0"};
    snprintf(lim, sizeof lim, "%d", cap);
    if (pos->set) {
        snprintf(prio, sizeof prio, "%d", pos->priority);
        snprintf(id, sizeof id, "%lld", pos->id);
        params[2] = pos->run_after;
        params[3] = prio;
        params[4] = id;
    }
    return take(db, TAKE_FROM_SQL, 5, params, in, input_idx, jobs, cap, n, pos, e);
}

idemq_err_t pgq_take_row(PGconn *db, const struct conf_input *in, int input_idx, long long id,
                         struct job *j, bool *found, struct ledger_db_error *e)
{
    char sid[32];
    const char *params[1] = {sid};
    int n = 0;
    idemq_err_t err;
    snprintf(sid, sizeof sid, "%lld", id);
    err = take(db, TAKE_ROW_SQL, 1, params, in, input_idx, j, 1, &n, NULL, e);
    *found = err == IDEMQ_OK && n == 1;
    return err;
}

bool pgq_settle_init(struct pgq_settle *s, int cap)
{
    size_t c = (size_t)(cap > 0 ? cap : 1);
    memset(s, 0, sizeof *s);
    s->cap = (int)c;
    s->done = calloc(c, sizeof *s->done);
    s->retry = calloc(c, sizeof *s->retry);
    s->delay_ms = calloc(c, sizeof *s->delay_ms);
    s->counts = calloc(c, sizeof *s->counts);
    s->errors = calloc(c, sizeof *s->errors);
    s->keys = calloc(c, sizeof *s->keys);
    s->parks = calloc(c, sizeof *s->parks);
    return s->done && s->retry && s->delay_ms && s->counts && s->errors && s->keys && s->parks;
}

void pgq_settle_reset(struct pgq_settle *s)
{
    for (int i = 0; i < s->n_retry; i++) {
        free(s->errors[i]);
        free(s->keys[i]);
        s->errors[i] = s->keys[i] = NULL;
    }
    s->n_done = s->n_retry = s->n_parks = 0;
}

void pgq_settle_free(struct pgq_settle *s)
{
    if (s->errors)
        pgq_settle_reset(s);
    free(s->done);
    free(s->retry);
    free(s->delay_ms);
    free(s->counts);
    free(s->errors);
    free(s->keys);
    free(s->parks);
    memset(s, 0, sizeof *s);
}

void pgq_settle_done(struct pgq_settle *s, long long row, long long park_id)
{
    IDEMQ_ASSERT(s->n_done < s->cap && s->n_parks < s->cap);
    s->done[s->n_done++] = row;
    if (park_id > 0)
        s->parks[s->n_parks++] = park_id;
}

bool pgq_settle_retry(struct pgq_settle *s, long long row, const char *key, long delay_ms,
                      bool counts, const char *error)
{
    int i = s->n_retry;
    IDEMQ_ASSERT(i < s->cap);
    if (!(s->errors[i] = strdup(error ? error : "")) || !(s->keys[i] = strdup(key ? key : ""))) {
        free(s->errors[i]);
        s->errors[i] = NULL;
        return false;
    }
    s->retry[i] = row;
    s->delay_ms[i] = delay_ms < 0 ? 0 : delay_ms;
    s->counts[i] = counts;
    s->n_retry++;
    return true;
}

/* A PostgreSQL array literal being built: "{" elements "}". Each element
 * is quoted, with double quotes and backslashes escaped, so any text (an effect's error
 * message, a key) travels as one element. buf NULL: out of memory. */
struct arr {
    char *buf;
    size_t len, cap;
    int n;
};

static void arr_init(struct arr *a)
{
    a->cap = 64;
    a->len = 1;
    a->n = 0;
    if ((a->buf = malloc(a->cap)))
        strcpy(a->buf, "{");
}

/* Makes room for more bytes and the NUL; false (buf freed) if not. */
static bool arr_room(struct arr *a, size_t more)
{
    char *nb;
    size_t nc = a->cap;
    if (!a->buf)
        return false;
    if (a->len + more + 1 <= a->cap)
        return true;
    while (nc < a->len + more + 1)
        nc *= 2;
    if (!(nb = realloc(a->buf, nc))) {
        free(a->buf);
        a->buf = NULL;
        return false;
    }
    a->buf = nb;
    a->cap = nc;
    return true;
}

static void arr_add(struct arr *a, const char *v)
{
    char *o;
    if (!arr_room(a, 2 * strlen(v) + 3))
        return;
    o = a->buf + a->len;
    if (a->n++)
        *o++ = ',';
    *o++ = '"';
    for (; *v; v++) {
        if (*v == '"' || *v == '\\')
            *o++ = '\\';
        *o++ = *v;
    }
    *o++ = '"';
    *o = '\0';
    a->len = (size_t)(o - a->buf);
}

/* Closes the literal and hands it over (caller frees); NULL if out of
 * memory. */
static char *arr_take(struct arr *a)
{
    char *out;
    if (!arr_room(a, 1))
        return NULL;
    a->buf[a->len++] = '}';
    a->buf[a->len] = '\0';
    out = a->buf;
    a->buf = NULL;
    return out;
}

/* An array literal of n elements given as strings. NULL when out of memory. */
static char *arr_of(int n, const char *(*get)(const struct pgq_settle *, int, char *),
                    const struct pgq_settle *s)
{
    struct arr a;
    char num[32];
    arr_init(&a);
    for (int i = 0; i < n; i++)
        arr_add(&a, get(s, i, num));
    return arr_take(&a);
}

static const char *get_done(const struct pgq_settle *s, int i, char *num)
{
    snprintf(num, 32, "%lld", s->done[i]);
    return num;
}
static const char *get_retry(const struct pgq_settle *s, int i, char *num)
{
    snprintf(num, 32, "%lld", s->retry[i]);
    return num;
}
static const char *get_delay(const struct pgq_settle *s, int i, char *num)
{
    snprintf(num, 32, "%ld", s->delay_ms[i] > 2000000000L ? 2000000000L : s->delay_ms[i]);
    return num;
}
static const char *get_counts(const struct pgq_settle *s, int i, char *num)
{
    (void)num;
    return s->counts[i] ? "t" : "f";
}
static const char *get_error(const struct pgq_settle *s, int i, char *num)
{
    (void)num;
    return s->errors[i];
}
static const char *get_key(const struct pgq_settle *s, int i, char *num)
{
    (void)num;
    return s->keys[i];
}
static const char *get_park(const struct pgq_settle *s, int i, char *num)
{
    snprintf(num, 32, "%lld", s->parks[i]);
    return num;
}

idemq_err_t pgq_settle(PGconn *db, const struct pgq_settle *s, struct ledger_db_error *e)
{
    char *p[7];
    PGresult *r;
    idemq_err_t err = IDEMQ_OK;

    p[0] = arr_of(s->n_done, get_done, s);
    p[1] = arr_of(s->n_retry, get_retry, s);
    p[2] = arr_of(s->n_retry, get_delay, s);
    p[3] = arr_of(s->n_retry, get_counts, s);
    p[4] = arr_of(s->n_retry, get_error, s);
    p[5] = arr_of(s->n_retry, get_key, s);
    p[6] = arr_of(s->n_parks, get_park, s);
    for (int i = 0; i < 7; i++)
        if (!p[i]) {
            snprintf(e->message, sizeof e->message, "out of memory settling queue rows");
            e->sqlstate[0] = '\0';
            e->conn_lost = false;
            err = IDEMQ_ERR_NOMEM;
            goto out;
        }
    r = ledger_db_exec_params(db, SETTLE_SQL, 7, NULL, (const char *const *)p, NULL, NULL, 0);
    if (PQresultStatus(r) != PGRES_TUPLES_OK) {
        ledger_db_error_from(db, r, e);
        err = ledger_db_err(e);
    }
    PQclear(r);
out:
    for (int i = 0; i < 7; i++)
        free(p[i]);
    return err;
}

/* Drains the notifications libpq has read. true if there was one. */
static bool drain(PGconn *db)
{
    PGnotify *nt;
    bool any = false;
    while ((nt = PQnotifies(db))) {
        any = true;
        PQfreemem(nt);
    }
    return any;
}

bool pgq_wait(PGconn *db, long max_ms)
{
    struct pollfd pfd;
    if (PQstatus(db) != CONNECTION_OK)
        return false;
    if (!PQconsumeInput(db))
        return false;
    if (drain(db))
        return true;
    pfd.fd = PQsocket(db);
    pfd.events = POLLIN;
    pfd.revents = 0;
    if (pfd.fd < 0)
        return false;
    if (poll(&pfd, 1, (int)(max_ms < 0 ? 0 : max_ms > 60000 ? 60000 : max_ms)) <= 0)
        return false;
    if (!PQconsumeInput(db))
        return false;
    return drain(db);
}

long pgq_next_due_ms(PGconn *db, const struct conf *c)
{
    struct arr a;
    const char *params[1];
    PGresult *r;
    long out = -1;

    arr_init(&a);
    for (int i = 0; i < c->n_inputs; i++)
        arr_add(&a, c->inputs[i].queue);
    if (!(params[0] = arr_take(&a)))
        return -1;
    r = ledger_db_exec_params(db, "SELECT idemq.queue_next_due($1::text[])", 1, NULL, params,
                              NULL, NULL, 0);
    if (PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1 && !PQgetisnull(r, 0, 0))
        out = strtol(PQgetvalue(r, 0, 0), NULL, 10);
    PQclear(r);
    free((char *)params[0]);
    return out;
}
