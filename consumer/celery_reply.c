/*
 * celery_reply: rpc:// results of committed Celery tasks: read back what
 * the ledger holds for each key (idemq.job_info), publish, confirm.
 */
#include "celery_reply.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "celery.h"
#include "ledger_db.h"
#include "log.h"

/* True when jobs[i] is to be answered now. */
static bool due(const struct conf *c, const struct job *j, const struct plan *p)
{
    if (!j->reply || j->input < 0 || j->input >= c->n_inputs || !c->inputs[j->input].celery)
        return false;
    return p->how == SETTLE_ACK || p->how == SETTLE_DEAD || p->how == SETTLE_REJECT;
}

static idemq_err_t send(struct broker *b, const struct job *j, const char *body, char *why,
                        size_t whylen)
{
    /* Celery's rpc backend: JSON in utf-8, delivery_mode 1 (not persistent) */
    json_t *orig = json_pack("{s:s, s:s}", "correlation_id", j->correlation_id,
                             "content_encoding", "utf-8");
    struct broker_props props = {NULL, "application/json", NULL, false, NULL, orig};
    idemq_err_t err;
    if (!orig) { /* ids that cannot travel: no answer rather than a stuck batch */
        log_job(LOG_LVL_WARN, j->has_key ? j->key : NULL, j->tag, 0,
                "celery result of task %s not sent: its correlation_id is not text", j->task_id);
        return IDEMQ_OK;
    }
    /* on the side channel: a refusal (403, 404) closes that one, never the
     * channel that holds the batch's deliveries */
    if ((err = broker_side_publish(b, "", j->reply_to, body, strlen(body), &props, false)) !=
        IDEMQ_OK)
        snprintf(why, whylen, "celery result of task %s to %s: %s", j->task_id, j->reply_to,
                 broker_error(b));
    json_decref(orig);
    return err;
}

/* The FAILURE / REVOKED reply of a job that never reached its effect. */
static char *decode_reply(const struct job *j)
{
    char msg[600];
    if (j->celery_err == IDEMQ_ERR_CELERY_EXPIRED)
        return celery_reply_body(j->task_id, "REVOKED", NULL, "TaskRevokedError",
                                 "celery.exceptions", j->reason);
    snprintf(msg, sizeof msg, "idemq parked the task: %s: %s", idemq_err_name(j->decode_err),
             j->reason);
    return celery_reply_body(j->task_id, "FAILURE", NULL, "IdemqParked", NULL, msg);
}

idemq_err_t celery_reply_batch(struct broker *b, PGconn *db, const struct conf *c,
                               const struct job *jobs, const struct plan *plans, int n,
                               int confirm_ms, char *why, size_t whylen)
{
    json_t *keys = json_array();
    char *keys_text = NULL;
    PGresult *r = NULL;
    struct ledger_db_error e;
    idemq_err_t err = IDEMQ_OK;
    int sent = 0, asked = 0;

    if (!keys)
        return IDEMQ_ERR_NOMEM;
    for (int i = 0; i < n; i++)
        if (due(c, &jobs[i], &plans[i]) && jobs[i].decode_err == IDEMQ_OK && jobs[i].has_key) {
            json_array_append_new(keys, json_string(jobs[i].key));
            asked++;
        }
    if (asked) {
        const char *params[1];
        if (!(keys_text = json_dumps(keys, JSON_COMPACT))) {
            err = IDEMQ_ERR_NOMEM;
            goto out;
        }
        params[0] = keys_text;
        r = ledger_db_query(db,
                            "SELECT k.o, i.state, i.result::text, i.last_error_class, "
                            "       i.last_error "
                            "  FROM jsonb_array_elements_text($1::jsonb) WITH ORDINALITY AS k(k, o) "
                            "  LEFT JOIN LATERAL idemq.job_info(k.k) i ON true ORDER BY k.o",
                            1, params, &e);
        if (!r) {
            snprintf(why, whylen, "reading Celery results back: %s", e.message);
            err = ledger_db_err(&e);
            goto out;
        }
        if (PQntuples(r) != asked) {
            snprintf(why, whylen, "reading Celery results back: %d rows for %d keys",
                     PQntuples(r), asked);
            err = IDEMQ_ERR_SQL;
            goto out;
        }
    }
    for (int i = 0, row = 0; i < n && !err; i++) {
        const struct job *j = &jobs[i];
        char *body = NULL;
        if (!due(c, j, &plans[i]))
            continue;
        if (j->decode_err != IDEMQ_OK || !j->has_key) {
            body = decode_reply(j);
        } else {
            const char *state = PQgetisnull(r, row, 1) ? "" : PQgetvalue(r, row, 1);
            if (strcmp(state, "applied") == 0) {
                json_t *res = PQgetisnull(r, row, 2) ? NULL
                                                     : json_loads(PQgetvalue(r, row, 2),
                                                                  JSON_DECODE_ANY, NULL);
                body = celery_reply_body(j->task_id, "SUCCESS", res, NULL, NULL, NULL);
                json_decref(res);
            } else if (strcmp(state, "parked") == 0) {
                char msg[700];
                snprintf(msg, sizeof msg, "idemq parked the task: %s: %s",
                         PQgetisnull(r, row, 3) ? "permanent" : PQgetvalue(r, row, 3),
                         PQgetisnull(r, row, 4) ? "" : PQgetvalue(r, row, 4));
                body = celery_reply_body(j->task_id, "FAILURE", NULL, "IdemqParked", NULL, msg);
            } else { /* retrying or not claimed: its result comes later */
                row++;
                continue;
            }
            row++;
        }
        if (!body) {
            err = IDEMQ_ERR_NOMEM;
            snprintf(why, whylen, "out of memory building a Celery result");
            break;
        }
        err = send(b, j, body, why, whylen);
        free(body);
        if (!err) {
            sent++;
            log_job(LOG_LVL_DEBUG, j->has_key ? j->key : NULL, j->tag, plans[i].attempt,
                    "celery result of task %s sent to %s", j->task_id, j->reply_to);
        }
    }
    if (!err && sent && (err = broker_side_wait_confirms(b, confirm_ms)) != IDEMQ_OK)
        snprintf(why, whylen, "celery results not confirmed: %s", broker_error(b));
out:
    PQclear(r);
    free(keys_text);
    json_decref(keys);
    return err;
}
