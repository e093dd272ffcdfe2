/*
 * ledger_outbox: claim, sent, failed and release of idemq.outbox rows (see
 * ledger_outbox.h).
 */
#include "ledger_outbox.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ops.h"

static const char *opt(PGresult *res, int i, int col)
{
    return PQgetisnull(res, i, col) ? NULL : PQgetvalue(res, i, col);
}

void ledger_outbox_rows_free(struct outbox_rows *r)
{
    for (int i = 0; r->row && i < r->n; i++)
        PQfreemem(r->row[i].body);
    free(r->row);
    PQclear(r->res);
    memset(r, 0, sizeof *r);
}

/* Fills r from r->res (columns id, key, exchange, routing key, body,
 * headers, order key, message_id; a row with a NULL id is skipped). */
static idemq_err_t fill_rows(struct outbox_rows *r, struct ledger_db_error *e)
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
        w->body = PQunescapeBytea((const unsigned char *)PQgetvalue(r->res, i, 4), &w->body_len);
        if (!w->body) {
            ledger_outbox_rows_free(r);
            snprintf(e->message, sizeof e->message, "out of memory");
            return IDEMQ_ERR_NOMEM;
        }
        r->n++;
    }
    return IDEMQ_OK;
}

/* Runs sql (one of the lease functions, params holder, limit, lease_ms)
 * into r. */
static idemq_err_t lease_rows(PGconn *db, const char *sql, const char *holder, int limit,
                              int lease_ms, struct outbox_rows *r, struct ledger_db_error *e)
{
    char lim[16], lease[16];
    const char *params[3] = {holder, lim, lease};

    memset(r, 0, sizeof *r);
    snprintf(lim, sizeof lim, "%d", limit);
    snprintf(lease, sizeof lease, "%d", lease_ms);
    if (!(r->res = ledger_db_query(db, sql, 3, params, e)))
        return ledger_db_err(e);
    return fill_rows(r, e);
}

idemq_err_t ledger_outbox_claim(PGconn *db, const char *holder, int limit, int lease_ms,
                                struct outbox_rows *r, struct ledger_db_error *e)
{
    return lease_rows(db,
                      "SELECT r_id, r_key, r_exchange, r_routing_key, r_body, r_headers,"
                      " r_order_key, r_message_id FROM idemq.outbox_claim($1, $2, $3)"
                      " ORDER BY r_id",
                      holder, limit, lease_ms, r, e);
}

idemq_err_t ledger_outbox_take(PGconn *db, const char *holder, int limit, int lease_ms,
                               struct outbox_rows *r, int *emitted, struct ledger_db_error *e)
{
    idemq_err_t err = lease_rows(db,
                                 "SELECT r_id, r_key, r_exchange, r_routing_key, r_body,"
                                 " r_headers, r_order_key, r_message_id, r_emitted"
                                 " FROM idemq.outbox_take($1, $2, $3)",
                                 holder, limit, lease_ms, r, e);
    *emitted = !err && PQntuples(r->res) > 0 ? atoi(PQgetvalue(r->res, 0, 8)) : 0;
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
