/*
 * ledger_lanes: calls idemq.defer_job, idemq.lane_parked,
 * idemq.take_deferred and idemq.report_deferred with parameters only.
 */
#include "ledger_lanes.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"

bool ledger_lanes_any(const struct conf *c)
{
    for (int i = 0; i < c->n_inputs; i++)
        if (CONF_INPUT_ORDERED(&c->inputs[i]) && c->inputs[i].order_kind != CONF_KEY_NONE)
            return true;
    return false;
}

static void nomem(struct ledger_db_error *e)
{
    snprintf(e->message, sizeof e->message, "out of memory");
    e->sqlstate[0] = '\0';
    e->conn_lost = false;
}

idemq_err_t ledger_lanes_defer(PGconn *db, const struct conf *c, const struct job *j,
                               const char *why, struct ledger_db_error *e)
{
    const struct conf_input *in = &c->inputs[j->input];
    char seq[32], lane[16];
    char *headers = json_dumps(j->headers, JSON_COMPACT);
    char *props = json_dumps(j->props, JSON_COMPACT);
    const char *vals[11];
    int lens[11] = {0}, fmts[11] = {0};
    PGresult *r = NULL;
    idemq_err_t err = IDEMQ_OK;

    if (!headers || !props) {
        nomem(e);
        err = IDEMQ_ERR_NOMEM;
        goto out;
    }
    snprintf(seq, sizeof seq, "%lld", j->seq);
    snprintf(lane, sizeof lane, "%d", j->lane);
    vals[0] = j->key;
    vals[1] = in->queue;
    vals[2] = j->order_key;
    vals[3] = j->has_seq ? seq : NULL;
    vals[4] = strncmp(why, "held", 4) == 0 ? "held" : "gap";
    vals[5] = j->lane >= 0 ? lane : NULL;
    vals[6] = j->exchange;
    vals[7] = j->routing_key;
    vals[8] = (const char *)j->body;
    lens[8] = (int)j->body_len;
    fmts[8] = 1;
    vals[9] = headers;
    vals[10] = props;
    r = ledger_db_exec_params(db, "SELECT idemq.defer_job($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
                     11, NULL, vals, lens, fmts, 0);
    if (PQresultStatus(r) != PGRES_TUPLES_OK) {
        ledger_db_error_from(db, r, e);
        err = ledger_db_err(e);
    }
out:
    PQclear(r);
    free(headers);
    free(props);
    return err;
}

idemq_err_t ledger_lanes_parked(PGconn *db, const struct conf *c, const struct job *j,
                                struct ledger_db_error *e)
{
    const struct conf_input *in = &c->inputs[j->input];
    char seq[32];
    const char *vals[5];
    PGresult *r;

    snprintf(seq, sizeof seq, "%lld", j->seq);
    vals[0] = in->queue;
    vals[1] = j->has_order_key ? j->order_key : NULL;
    vals[2] = j->has_seq ? seq : NULL;
    vals[3] = j->key;
    vals[4] = in->on_park_mode == CONF_ON_PARK_HOLD_KEY ? "true" : "false";
    r = ledger_db_query(db, "SELECT idemq.lane_parked($1, $2, $3, $4, $5)", 5, vals, e);
    if (!r)
        return ledger_db_err(e);
    PQclear(r);
    return IDEMQ_OK;
}

/* JSON array of the queues of c's ordered inputs with an ordering key. */
static char *ordered_queues(const struct conf *c)
{
    json_t *a = json_array();
    char *s;
    for (int i = 0; a && i < c->n_inputs; i++)
        if (CONF_INPUT_ORDERED(&c->inputs[i]) && c->inputs[i].order_kind != CONF_KEY_NONE)
            json_array_append_new(a, json_string(c->inputs[i].queue));
    s = a ? json_dumps(a, JSON_COMPACT) : NULL;
    json_decref(a);
    return s;
}

static int input_of(const struct conf *c, const char *queue)
{
    for (int i = 0; i < c->n_inputs; i++)
        if (strcmp(c->inputs[i].queue, queue) == 0)
            return i;
    return -1;
}

static void copy_short(char *dst, const char *src)
{
    snprintf(dst, JOB_SHORTSTR, "%s", src);
}

idemq_err_t ledger_lanes_take(PGconn *db, const struct conf *c, struct job *jobs, int max,
                              int *n, struct ledger_db_error *e)
{
    char *queues = ordered_queues(c);
    char lim[16];
    const char *vals[2];
    PGresult *r = NULL;
    idemq_err_t err = IDEMQ_OK;

    *n = 0;
    if (!queues) {
        nomem(e);
        return IDEMQ_ERR_NOMEM;
    }
    snprintf(lim, sizeof lim, "%d", max);
    vals[0] = queues;
    vals[1] = lim;
    /* body as binary (column 6): the raw bytes, not bytea text */
    r = ledger_db_exec_params(db,
                     "SELECT r_id, r_key, r_queue, r_lane, r_exchange, r_routing_key, r_body, "
                     "r_headers, r_properties FROM idemq.take_deferred("
                     "ARRAY(SELECT jsonb_array_elements_text($1::jsonb)), $2::integer)",
                     2, NULL, vals, NULL, NULL, 1);
    if (PQresultStatus(r) != PGRES_TUPLES_OK) {
        ledger_db_error_from(db, r, e);
        err = ledger_db_err(e);
        goto out;
    }
    /* Binary results: integers in network order, text as bytes, jsonb with a
     * version byte. */
    for (int row = 0; row < PQntuples(r) && *n < max; row++) {
        struct job *j = &jobs[*n];
        char *text;
        json_t *v;
        int input;
        uint64_t id = 0;
        const unsigned char *idb = (const unsigned char *)PQgetvalue(r, row, 0);

        text = strndup(PQgetvalue(r, row, 2), (size_t)PQgetlength(r, row, 2));
        input = text ? input_of(c, text) : -1;
        free(text);
        if (input < 0)
            continue; /* an input no longer configured here */
        job_reset(j);
        for (int k = 0; k < 8; k++)
            id = (id << 8) | idb[k];
        j->deferred_id = (long long)id;
        j->input = input;
        j->tag = 0;
        if (!PQgetisnull(r, row, 3)) {
            const unsigned char *lb = (const unsigned char *)PQgetvalue(r, row, 3);
            j->lane = (int)((uint32_t)lb[0] << 24 | (uint32_t)lb[1] << 16 |
                            (uint32_t)lb[2] << 8 | lb[3]);
        }
        text = strndup(PQgetvalue(r, row, 4), (size_t)PQgetlength(r, row, 4));
        copy_short(j->exchange, text ? text : "");
        free(text);
        text = strndup(PQgetvalue(r, row, 5), (size_t)PQgetlength(r, row, 5));
        copy_short(j->routing_key, text ? text : "");
        free(text);
        if (job_set_body(j, PQgetvalue(r, row, 6), (size_t)PQgetlength(r, row, 6))) {
            nomem(e);
            err = IDEMQ_ERR_NOMEM;
            goto out;
        }
        for (int col = 7; col <= 8; col++) {
            if (PQgetisnull(r, row, col) || PQgetlength(r, row, col) < 1)
                continue;
            v = json_loadb(PQgetvalue(r, row, col) + 1, (size_t)PQgetlength(r, row, col) - 1, 0,
                           NULL);
            if (json_is_object(v))
                json_object_update(col == 7 ? j->headers : j->props, v);
            json_decref(v);
        }
        v = json_object_get(j->props, "message_id");
        if (json_is_string(v)) {
            copy_short(j->message_id, json_string_value(v));
            j->has_message_id = true;
        }
        (*n)++;
    }
out:
    PQclear(r);
    free(queues);
    return err;
}

idemq_err_t ledger_lanes_retry_pending(PGconn *db, const struct conf *c, bool *pending,
                                       struct ledger_db_error *e)
{
    char *queues = ordered_queues(c);
    const char *vals[1];
    PGresult *r;

    *pending = false;
    if (!queues) {
        nomem(e);
        return IDEMQ_ERR_NOMEM;
    }
    vals[0] = queues;
    r = ledger_db_query(db,
                        /* due or scheduled (a retry's run_after): the due_at index */
                        "SELECT EXISTS (SELECT 1 FROM idemq.deferred d WHERE d.due_at IS NOT "
                        "NULL AND d.source_queue = ANY "
                        "(ARRAY(SELECT jsonb_array_elements_text($1::jsonb))))",
                        1, vals, e);
    free(queues);
    if (!r)
        return ledger_db_err(e);
    *pending = strcmp(PQgetvalue(r, 0, 0), "t") == 0;
    PQclear(r);
    return IDEMQ_OK;
}

idemq_err_t ledger_lanes_report(PGconn *db, const struct conf *c, int *reported,
                                struct ledger_db_error *e)
{
    *reported = 0;
    for (int i = 0; i < c->n_inputs; i++) {
        const struct conf_input *in = &c->inputs[i];
        char age[16];
        const char *vals[2];
        PGresult *r;

        if (!CONF_INPUT_ORDERED(in) || in->order_kind == CONF_KEY_NONE)
            continue;
        snprintf(age, sizeof age, "%d", in->deferred_report_after_s);
        vals[0] = in->queue;
        vals[1] = age;
        r = ledger_db_query(db,
                            "SELECT r_key, r_order_key, coalesce(r_seq::text, '-'), r_reason, "
                            "coalesce(r_waiting_for::text, '-'), coalesce(r_blocked_by, '-'), "
                            "r_deferred_at FROM idemq.report_deferred($1, $2::integer)",
                            2, vals, e);
        if (!r)
            return ledger_db_err(e);
        for (int row = 0; row < PQntuples(r); row++) {
            log_job(LOG_LVL_WARN, PQgetvalue(r, row, 0), 0, 0,
                    "DEFERRED for more than %d s (input %s, ordering key %s, sequence %s, "
                    "%s, waiting for sequence %s, held by %s, since %s)",
                    in->deferred_report_after_s, in->name, PQgetvalue(r, row, 1),
                    PQgetvalue(r, row, 2), PQgetvalue(r, row, 3), PQgetvalue(r, row, 4),
                    PQgetvalue(r, row, 5), PQgetvalue(r, row, 6));
            (*reported)++;
        }
        PQclear(r);
    }
    return IDEMQ_OK;
}
