/*
 * ledger_rescue: calls idemq.rescue_take / idemq.rescue_record with
 * parameters only (queue lists and keys travel as JSON arrays).
 */
#include "ledger_rescue.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "protect.h"

#define TAKE_SQL                                                                            \
    "SELECT r_key, r_generation::text, r_attempt::text, r_queue, r_run_after::text, r_body, " \
    "r_headers::text, r_properties::text, r_exchange, r_routing_key, r_body_key "           \
    "FROM idemq.rescue_take(ARRAY(SELECT jsonb_array_elements_text($1::jsonb)), "           \
    "$2::integer, $3::integer)"

static void nomem(struct ledger_db_error *e)
{
    snprintf(e->message, sizeof e->message, "out of memory");
    e->sqlstate[0] = '\0';
    e->conn_lost = false;
}

/* JSON array of the standard (not partitioned) inputs' queues to rescue. */
static char *standard_queues(const struct conf *c, const bool *include)
{
    json_t *a = json_array();
    char *s;
    for (int i = 0; a && i < c->n_inputs; i++)
        if (!CONF_INPUT_ORDERED(&c->inputs[i]) && (!include || include[i]))
            json_array_append_new(a, json_string(c->inputs[i].queue));
    s = a ? json_dumps(a, JSON_COMPACT) : NULL;
    json_decref(a);
    return s;
}

static int input_of(const struct conf *c, const char *queue)
{
    for (int i = 0; i < c->n_inputs; i++)
        if (!CONF_INPUT_ORDERED(&c->inputs[i]) && strcmp(c->inputs[i].queue, queue) == 0)
            return i;
    return -1;
}

/* Column col of a binary-format row as a NUL-terminated copy (caller frees). */
static char *col_text(const PGresult *r, int row, int col)
{
    return strndup(PQgetvalue(r, row, col), (size_t)PQgetlength(r, row, col));
}

/* Fills one copy from row `row`; false when out of memory. */
static bool fill(const PGresult *r, int row, int input, struct ledger_rescue_copy *x)
{
    struct job *j = &x->job;
    char *t;
    json_t *v;

    job_reset(j);
    j->input = input;
    j->tag = 0;
    if (!(t = col_text(r, row, 0)))
        return false;
    snprintf(j->key, sizeof j->key, "%s", t);
    j->has_key = true;
    free(t);
    if (!(t = col_text(r, row, 1)))
        return false;
    x->generation = atoi(t);
    free(t);
    if (!(t = col_text(r, row, 2)))
        return false;
    x->attempt = atoi(t);
    free(t);
    if (!(t = col_text(r, row, 4)))
        return false;
    snprintf(x->run_after, sizeof x->run_after, "%s", t);
    free(t);
    x->unopened = NULL;
    x->body_key[0] = '\0';
    if (!PQgetisnull(r, row, 10)) { /* sealed at rest: opened with the key it names */
        enum protect_open_result o;
        unsigned char *plain = NULL;
        size_t plain_len = 0;
        bool ok;
        if (!(t = col_text(r, row, 10)))
            return false;
        snprintf(x->body_key, sizeof x->body_key, "%s", t);
        free(t);
        o = protect_open(protect_global(), x->body_key, (const unsigned char *)PQgetvalue(r, row, 5),
                         (size_t)PQgetlength(r, row, 5), &plain, &plain_len);
        if (o == PROTECT_FAILED)
            return false;
        if (o != PROTECT_OPENED) {
            x->unopened = protect_open_str(o);
            ok = job_set_body(j, "", 0) == IDEMQ_OK;
        } else {
            ok = job_set_body(j, plain, plain_len) == IDEMQ_OK;
            explicit_bzero(plain, plain_len);
        }
        free(plain);
        if (!ok)
            return false;
    } else if (job_set_body(j, PQgetvalue(r, row, 5), (size_t)PQgetlength(r, row, 5))) {
        return false;
    }
    for (int col = 6; col <= 7; col++) {
        if (PQgetisnull(r, row, col))
            continue;
        v = json_loadb(PQgetvalue(r, row, col), (size_t)PQgetlength(r, row, col), 0, NULL);
        if (json_is_object(v))
            json_object_update(col == 6 ? j->headers : j->props, v);
        json_decref(v);
    }
    for (int col = 8; col <= 9; col++) {
        if (PQgetisnull(r, row, col))
            continue;
        if (!(t = col_text(r, row, col)))
            return false;
        snprintf(col == 8 ? j->exchange : j->routing_key, JOB_SHORTSTR, "%s", t);
        free(t);
    }
    return true;
}

idemq_err_t ledger_rescue_take(PGconn *db, const struct conf *c, const bool *include,
                               struct ledger_rescue_copy *out, int max, int *n,
                               struct ledger_db_error *e)
{
    char *queues = standard_queues(c, include);
    char after[24], lim[16];
    const char *vals[3];
    PGresult *r = NULL;
    idemq_err_t err;

    *n = 0;
    if (!queues) {
        nomem(e);
        return IDEMQ_ERR_NOMEM;
    }
    if ((err = ledger_db_exec(db, "BEGIN", e)) != IDEMQ_OK)
        goto out;
    snprintf(after, sizeof after, "%lld", (long long)c->rescue_after_s * 1000);
    snprintf(lim, sizeof lim, "%d", max);
    vals[0] = queues;
    vals[1] = after;
    vals[2] = lim;
    /* Binary results: every column but the body is cast to text, whose
     * binary form is its bytes; the body (bytea) comes as its raw bytes. */
    r = ledger_db_exec_params(db, TAKE_SQL, 3, NULL, vals, NULL, NULL, 1);
    if (PQresultStatus(r) != PGRES_TUPLES_OK) {
        ledger_db_error_from(db, r, e);
        err = ledger_db_err(e);
        goto out;
    }
    for (int row = 0; row < PQntuples(r) && *n < max; row++) {
        char *q = col_text(r, row, 3);
        int input = q ? input_of(c, q) : -1;
        free(q);
        if (!q) {
            nomem(e);
            err = IDEMQ_ERR_NOMEM;
            goto out;
        }
        if (input < 0)
            continue; /* a queue not configured here (rescue_take only returns ours) */
        if (!fill(r, row, input, &out[*n])) {
            nomem(e);
            err = IDEMQ_ERR_NOMEM;
            goto out;
        }
        (*n)++;
    }
out:
    PQclear(r);
    free(queues);
    return err;
}

idemq_err_t ledger_rescue_record(PGconn *db, const struct conf *c,
                                 const struct ledger_rescue_copy *copies, int n, int *recorded,
                                 struct ledger_db_error *e)
{
    json_t *a = json_array();
    char *doc = NULL;
    const char *vals[2];
    PGresult *r;
    idemq_err_t err = IDEMQ_OK;

    *recorded = 0;
    for (int i = 0; a && i < n; i++)
        if (json_array_append_new(a, json_pack("{s:s,s:i,s:i}", "k", copies[i].job.key, "g",
                                               copies[i].generation, "a", copies[i].attempt)))
            break;
    if (!a || json_array_size(a) != (size_t)n || !(doc = json_dumps(a, JSON_COMPACT))) {
        json_decref(a);
        nomem(e);
        return IDEMQ_ERR_NOMEM;
    }
    json_decref(a);
    vals[0] = doc;
    vals[1] = c->consumer_id;
    r = ledger_db_query(db, "SELECT idemq.rescue_record($1::jsonb, $2)", 2, vals, e);
    if (!r)
        err = ledger_db_err(e);
    else
        *recorded = atoi(PQgetvalue(r, 0, 0));
    PQclear(r);
    free(doc);
    return err;
}

idemq_err_t ledger_rescue_finish(PGconn *db, bool commit, struct ledger_db_error *e)
{
    PGresult *r;
    idemq_err_t err = IDEMQ_OK;

    if (!commit) {
        if (PQstatus(db) == CONNECTION_OK)
            PQclear(ledger_db_exec_raw(db, "ROLLBACK"));
        return IDEMQ_OK;
    }
    r = ledger_db_exec_raw(db, "COMMIT");
    /* A COMMIT of an aborted transaction answers ROLLBACK without error. */
    if (PQresultStatus(r) != PGRES_COMMAND_OK || strcmp(PQcmdStatus(r), "COMMIT") != 0) {
        ledger_db_error_from(db, r, e);
        if (!e->conn_lost && !e->sqlstate[0]) {
            snprintf(e->sqlstate, sizeof e->sqlstate, "25P02");
            snprintf(e->message, sizeof e->message, "transaction was rolled back at commit");
        }
        err = ledger_db_err(e);
    }
    PQclear(r);
    return err;
}
