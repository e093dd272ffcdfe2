/*
 * ledger_outbox: claim, sent, failed and release of idemq.outbox rows (see
 * ledger_outbox.h).
 */
#include "ledger_outbox.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ops.h"
#include "protect.h"

static const char *opt(PGresult *res, int i, int col)
{
    return PQgetisnull(res, i, col) ? NULL : PQgetvalue(res, i, col);
}

void ledger_outbox_rows_free(struct outbox_rows *r)
{
    for (int i = 0; r->row && i < r->n; i++) {
        if (r->row[i].body_malloced)
            free(r->row[i].body);
        else
            PQfreemem(r->row[i].body);
    }
    free(r->row);
    PQclear(r->res);
    memset(r, 0, sizeof *r);
}

/* Opens w's body, stored sealed with key w->body_key, in place. A body
 * that cannot be opened leaves w->body NULL and w->unopened set;
 * IDEMQ_ERR_NOMEM only when out of memory. */
static idemq_err_t open_body(struct outbox_row *w)
{
    unsigned char *plain = NULL;
    size_t n = 0;
    enum protect_open_result o =
        protect_open(protect_global(), w->body_key, w->body, w->body_len, &plain, &n);
    PQfreemem(w->body);
    w->body = NULL;
    w->body_len = 0;
    if (o == PROTECT_OPENED) {
        w->body = plain;
        w->body_len = n;
        w->body_malloced = true;
        return IDEMQ_OK;
    }
    w->unopened = protect_open_str(o);
    return o == PROTECT_FAILED ? IDEMQ_ERR_NOMEM : IDEMQ_OK;
}

/* Fills r from r->res (columns id, key, exchange, routing key, body,
 * headers, order key, message_id, and the body's key in column key_col; a
 * row with a NULL id is skipped). */
static idemq_err_t fill_rows(struct outbox_rows *r, int key_col, struct ledger_db_error *e)
{
    int n = PQntuples(r->res);
    if (n == 0)
        return IDEMQ_OK;
    if (!(r->row = calloc((size_t)n, sizeof *r->row))) {
        ledger_outbox_rows_free(r);
        snprintf(e->message, sizeof e->message, "out of memory");
        return IDEMQ_ERR_NOMEM;
    }
    for (int i = 0; i < n; i++) {
        struct outbox_row *w = &r->row[r->n];
        if (PQgetisnull(r->res, i, 0))
            continue;
        w->id = atoll(PQgetvalue(r->res, i, 0));
        w->key = opt(r->res, i, 1);
        w->exchange = PQgetvalue(r->res, i, 2);
        w->routing_key = PQgetvalue(r->res, i, 3);
        w->headers = opt(r->res, i, 5);
        w->order_key = opt(r->res, i, 6);
        w->message_id = PQgetvalue(r->res, i, 7);
        w->body_key = opt(r->res, i, key_col);
        w->body = PQunescapeBytea((const unsigned char *)PQgetvalue(r->res, i, 4), &w->body_len);
        if (!w->body || (w->body_key && open_body(w) != IDEMQ_OK)) {
            r->n++; /* its body is freed with the others */
            ledger_outbox_rows_free(r);
            snprintf(e->message, sizeof e->message, "out of memory");
            return IDEMQ_ERR_NOMEM;
        }
        r->n++;
    }
    return IDEMQ_OK;
}

/* Runs sql (one of the lease functions, params holder, limit, lease_ms,
 * then the sealed[0..n_sealed) params of the take) into r. */
static idemq_err_t lease_rows(PGconn *db, const char *sql, const char *holder, int limit,
                              int lease_ms, const char *const *sealed, int n_sealed,
                              struct outbox_rows *r, struct ledger_db_error *e)
{
    char lim[16], lease[16];
    const char *params[6] = {holder, lim, lease, NULL, NULL, NULL};

    memset(r, 0, sizeof *r);
    snprintf(lim, sizeof lim, "%d", limit);
    snprintf(lease, sizeof lease, "%d", lease_ms);
    for (int i = 0; i < n_sealed && i < 3; i++)
        params[3 + i] = sealed[i];
    if (!(r->res = ledger_db_query(db, sql, 3 + n_sealed, params, e)))
        return ledger_db_err(e);
    return fill_rows(r, 8, e);
}

idemq_err_t ledger_outbox_claim(PGconn *db, const char *holder, int limit, int lease_ms,
                                struct outbox_rows *r, struct ledger_db_error *e)
{
    return lease_rows(db,
                      "SELECT r_id, r_key, r_exchange, r_routing_key, r_body, r_headers,"
                      " r_order_key, r_message_id, r_body_key"
                      " FROM idemq.outbox_claim($1, $2, $3) ORDER BY r_id",
                      holder, limit, lease_ms, NULL, 0, r, e);
}

static idemq_err_t nomem(struct ledger_db_error *e)
{
    snprintf(e->message, sizeof e->message, "out of memory");
    e->sqlstate[0] = '\0';
    e->conn_lost = false;
    return IDEMQ_ERR_NOMEM;
}

/* Reads the open transaction's bodies stored as sent and seals each with
 * the active key into *ids ("{1,2}") and *bodies (a bytea[] literal of
 * hex bodies); both NULL when there is none. */
static idemq_err_t seal_unsealed(PGconn *db, const struct protect *p, char **ids, char **bodies,
                                 struct ledger_db_error *e)
{
    PGresult *res;
    size_t icap = 3, bcap = 3, io = 0, bo = 0;
    int n;
    idemq_err_t err = IDEMQ_OK;

    *ids = *bodies = NULL;
    if (!(res = ledger_db_query(db, "SELECT r_id, r_body FROM idemq.outbox_unsealed()", 0, NULL,
                                e)))
        return ledger_db_err(e);
    if ((n = PQntuples(res)) == 0) {
        PQclear(res);
        return IDEMQ_OK;
    }
    for (int i = 0; i < n; i++) { /* a hex body is at most 2 * (raw + overhead) */
        icap += 22;
        bcap += 8 + 2 * (size_t)PQgetlength(res, i, 1) + 2 * PROTECT_OVERHEAD;
    }
    *ids = malloc(icap);
    *bodies = malloc(bcap);
    if (!*ids || !*bodies)
        err = nomem(e);
    if (!err) {
        (*ids)[io++] = '{';
        (*bodies)[bo++] = '{';
    }
    for (int i = 0; i < n && !err; i++) {
        size_t raw_len = 0, sealed_len = 0;
        unsigned char *raw =
            PQunescapeBytea((const unsigned char *)PQgetvalue(res, i, 1), &raw_len);
        unsigned char *sealed = NULL;
        if (!raw) {
            err = nomem(e);
            break;
        }
        err = protect_seal(p, raw, raw_len, &sealed, &sealed_len);
        PQfreemem(raw);
        if (err) {
            snprintf(e->message, sizeof e->message, "cannot seal outbox row %s: %s",
                     PQgetvalue(res, i, 0), idemq_err_str(err));
            e->sqlstate[0] = '\0';
            e->conn_lost = false;
            break;
        }
        io += (size_t)snprintf(*ids + io, icap - io, "%s%s", i ? "," : "", PQgetvalue(res, i, 0));
        bo += (size_t)snprintf(*bodies + bo, bcap - bo, "%s\"\\\\x", i ? "," : "");
        for (size_t k = 0; k < sealed_len; k++) { /* up to 16 MiB: no call per byte */
            (*bodies)[bo++] = "0123456789abcdef"[sealed[k] >> 4];
            (*bodies)[bo++] = "0123456789abcdef"[sealed[k] & 15];
        }
        (*bodies)[bo++] = '"';
        free(sealed);
    }
    PQclear(res);
    if (!err) {
        snprintf(*ids + io, icap - io, "}");
        snprintf(*bodies + bo, bcap - bo, "}");
        return IDEMQ_OK;
    }
    free(*ids);
    free(*bodies);
    *ids = *bodies = NULL;
    return err;
}

idemq_err_t ledger_outbox_take(PGconn *db, const char *holder, int limit, int lease_ms,
                               struct outbox_rows *r, int *emitted, struct ledger_db_error *e)
{
    const struct protect *p = protect_global();
    const char *key = protect_active(p);
    char *ids = NULL, *bodies = NULL;
    idemq_err_t err;

    *emitted = 0;
    memset(r, 0, sizeof *r);
    if (key && (err = seal_unsealed(db, p, &ids, &bodies, e)) != IDEMQ_OK)
        return err;
    if (ids) {
        const char *sealed[3] = {ids, bodies, key};
        err = lease_rows(db,
                         "SELECT r_id, r_key, r_exchange, r_routing_key, r_body,"
                         " r_headers, r_order_key, r_message_id, r_body_key, r_emitted"
                         " FROM idemq.outbox_take($1, $2, $3, $4::bigint[], $5::bytea[], $6)",
                         holder, limit, lease_ms, sealed, 3, r, e);
    } else {
        err = lease_rows(db,
                         "SELECT r_id, r_key, r_exchange, r_routing_key, r_body,"
                         " r_headers, r_order_key, r_message_id, r_body_key, r_emitted"
                         " FROM idemq.outbox_take($1, $2, $3)",
                         holder, limit, lease_ms, NULL, 0, r, e);
    }
    free(ids);
    free(bodies);
    *emitted = !err && PQntuples(r->res) > 0 ? atoi(PQgetvalue(r->res, 0, 9)) : 0;
    return err;
}

/* "{1,2,3}" of ids[0..n); NULL when out of memory (free it). */
static char *id_array(const long long *ids, int n)
{
    size_t cap = 3 + (size_t)n * 21, o = 0;
    char *arr = malloc(cap);
    if (!arr)
        return NULL;
    arr[o++] = '{';
    for (int i = 0; i < n; i++)
        o += (size_t)snprintf(arr + o, cap - o, "%s%lld", i ? "," : "", ids[i]);
    snprintf(arr + o, cap - o, "}");
    return arr;
}

idemq_err_t ledger_outbox_sent(PGconn *db, const char *holder, const long long *ids, int n,
                               double *latency_ms, struct ledger_db_error *e)
{
    const char *params[2];
    char *arr;
    PGresult *res;

    for (int i = 0; i < n; i++)
        latency_ms[i] = -1;
    if (n <= 0)
        return IDEMQ_OK;
    if (!(arr = id_array(ids, n))) {
        snprintf(e->message, sizeof e->message, "out of memory");
        return IDEMQ_ERR_NOMEM;
    }
    params[0] = holder;
    params[1] = arr;
    res = ledger_db_query(db, "SELECT r_id, r_latency_ms FROM idemq.outbox_sent($1, $2)", 2,
                          params, e);
    free(arr);
    if (!res)
        return ledger_db_err(e);
    for (int r = 0; r < PQntuples(res); r++) {
        long long id = atoll(PQgetvalue(res, r, 0));
        for (int i = 0; i < n; i++)
            if (ids[i] == id) {
                latency_ms[i] = atof(PQgetvalue(res, r, 1));
                break;
            }
    }
    PQclear(res);
    return IDEMQ_OK;
}

idemq_err_t ledger_outbox_failed(PGconn *db, const char *holder, long long id, const char *error,
                                 bool park, int max_attempts, int retry_ms, bool *parked,
                                 struct ledger_db_error *e)
{
    char sid[24], smax[16], sretry[16];
    const char *params[6] = {holder, sid, error, park ? "t" : "f", smax, sretry};
    PGresult *res;

    snprintf(sid, sizeof sid, "%lld", id);
    snprintf(smax, sizeof smax, "%d", max_attempts);
    snprintf(sretry, sizeof sretry, "%d", retry_ms);
    res = ledger_db_query(db, "SELECT idemq.outbox_failed($1, $2, $3, $4, $5, $6)", 6, params,
                          e);
    if (!res)
        return ledger_db_err(e);
    *parked = PQntuples(res) == 1 && !PQgetisnull(res, 0, 0) &&
              strcmp(PQgetvalue(res, 0, 0), "parked") == 0;
    PQclear(res);
    return IDEMQ_OK;
}

idemq_err_t ledger_outbox_release(PGconn *db, const char *holder, const long long *ids, int n,
                                  const char *error, struct ledger_db_error *e)
{
    char *arr;
    const char *params[3];
    PGresult *res;

    if (n <= 0)
        return IDEMQ_OK;
    if (!(arr = id_array(ids, n)))
        return IDEMQ_ERR_NOMEM;
    params[0] = holder;
    params[1] = arr;
    params[2] = error;
    res = ledger_db_query(db, "SELECT idemq.outbox_release($1, $2, $3)", 3, params, e);
    free(arr);
    if (!res)
        return ledger_db_err(e);
    PQclear(res);
    return IDEMQ_OK;
}

idemq_err_t ledger_outbox_gauges(PGconn *db, long *pending, long *parked, double *oldest_s,
                                 struct ledger_db_error *e)
{
    PGresult *res = ledger_db_query(
        db, "SELECT r_pending, r_parked, r_oldest_s FROM idemq.outbox_gauges()", 0, NULL, e);
    if (!res)
        return ledger_db_err(e);
    *pending = atol(PQgetvalue(res, 0, 0));
    *parked = atol(PQgetvalue(res, 0, 1));
    *oldest_s = atof(PQgetvalue(res, 0, 2));
    PQclear(res);
    return IDEMQ_OK;
}

/* Producer-controlled text (exchange, routing key, order key, key, the
 * broker's error that quotes them) is printed through ops_text, like the
 * rest of the operator output: no control byte reaches the terminal. */
int ledger_outbox_print_key(PGconn *db, const char *key, FILE *out)
{
    const char *params[1] = {key};
    struct ops_strs a = {NULL, 0, 0};
    PGresult *res = PQexecParams(
        db,
        "SELECT id, state, exchange, routing_key, coalesce(order_key, '-'), attempts, "
        "created_at, at, last_error, message_id FROM idemq.key_outbox($1) ORDER BY id",
        1, NULL, params, NULL, NULL, 0);
    int n;
    if (PQresultStatus(res) != PGRES_TUPLES_OK) {
        PQclear(res);
        return -1;
    }
    n = PQntuples(res);
    if (n)
        fprintf(out, "outbox (messages its effect emitted):\n");
    for (int i = 0; i < n; i++) {
        fprintf(out, "  %s  row %s (%s) %s: exchange '%s', routing key %s, order key %s, "
                     "%s publishes, at %s\n",
                ops_tval(&a, res, i, 6), ops_tval(&a, res, i, 0), ops_tval(&a, res, i, 9),
                ops_tval(&a, res, i, 1), ops_tval(&a, res, i, 2), ops_tval(&a, res, i, 3),
                ops_tval(&a, res, i, 4), ops_tval(&a, res, i, 5), ops_tval(&a, res, i, 7));
        if (!PQgetisnull(res, i, 8))
            fprintf(out, "    last error: %s\n", ops_tval(&a, res, i, 8));
    }
    ops_strs_free(&a);
    PQclear(res);
    return n;
}

int ledger_outbox_print_parked(PGconn *db, const char *key, const char *since, long limit,
                               FILE *out)
{
    char lim[24];
    const char *params[3] = {key, since, lim};
    struct ops_strs a = {NULL, 0, 0};
    PGresult *res;
    int n;

    snprintf(lim, sizeof lim, "%ld", limit > 0 ? limit : 1000000000L);
    res = PQexecParams(db,
                       "SELECT id, parked_at, coalesce(key, '(no key)'), exchange, routing_key, "
                       "attempts, left(last_error, 120) FROM idemq.outbox "
                       "WHERE state = 'parked' AND ($1::text IS NULL OR key = $1) "
                       "AND ($2::timestamptz IS NULL OR parked_at >= $2) "
                       "ORDER BY id LIMIT $3::bigint",
                       3, NULL, params, NULL, NULL, 0);
    if (PQresultStatus(res) != PGRES_TUPLES_OK) {
        PQclear(res);
        return -1;
    }
    n = PQntuples(res);
    if (n)
        fprintf(out, "outbox rows parked (not published; idemq.outbox):\n%-6s %-27s %-32s "
                     "%-20s %-20s %-3s %s\n",
                "row", "parked_at", "key", "exchange", "routing_key", "att", "error");
    for (int i = 0; i < n; i++)
        fprintf(out, "%-6s %-27s %-32s %-20s %-20s %-3s %s\n", ops_tval(&a, res, i, 0),
                ops_tval(&a, res, i, 1), ops_tval(&a, res, i, 2), ops_tval(&a, res, i, 3),
                ops_tval(&a, res, i, 4), ops_tval(&a, res, i, 5), ops_tval(&a, res, i, 6));
    ops_strs_free(&a);
    PQclear(res);
    return n;
}
