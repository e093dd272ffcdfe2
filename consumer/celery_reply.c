/*
 * celery_reply: rpc:// results of committed Celery tasks: read back what
 * the ledger holds for each key (idemq.job_info, the key's last park), bind
 * the client's reply queue to the replies exchange once, publish there,
 * confirm; best effort after the acknowledgements.
 */
#include "celery_reply.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "celery.h"
#include "ledger_db.h"
#include "ledger_txn.h"
#include "log.h"
#include "trace.h"

static long long mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

void celery_reply_cache_init(struct celery_reply_cache *r) { memset(r, 0, sizeof *r); }

bool celery_reply_queue_ok(const char *s)
{
    static const int dash[] = {8, 13, 18, 23};
    if (!s || strlen(s) != 36)
        return false;
    for (int i = 0, d = 0; i < 36; i++) {
        if (d < 4 && i == dash[d]) {
            if (s[i] != '-')
                return false;
            d++;
        } else if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f'))) {
            return false;
        }
    }
    return true;
}

/* Binds queue to the replies exchange unless this worker did so lately. */
static idemq_err_t bind_once(struct celery_reply_cache *r, struct broker *b, const char *queue)
{
    long long now = mono_ms();
    int slot = 0;
    idemq_err_t err;

    for (int i = 0; i < r->n; i++) {
        if (strcmp(r->name[i], queue) == 0 && now - r->at_ms[i] < CELERY_REPLY_BOUND_MS)
            return IDEMQ_OK;
        if (r->at_ms[i] < r->at_ms[slot])
            slot = i;
    }
    if ((err = broker_bind_aside(b, queue, CELERY_REPLIES_EXCHANGE, queue)) != IDEMQ_OK)
        return err;
    for (int i = 0; i < r->n; i++)
        if (strcmp(r->name[i], queue) == 0) {
            r->at_ms[i] = now;
            return IDEMQ_OK;
        }
    if (r->n < CELERY_REPLY_BOUND_MAX)
        slot = r->n++;
    snprintf(r->name[slot], sizeof r->name[slot], "%s", queue);
    r->at_ms[slot] = now;
    return IDEMQ_OK;
}

/* True when jobs[i] is to be answered now (observe-mode inputs aside). */
static bool due(const struct conf *c, const struct job *j, const struct plan *p)
{
    if (!j->reply || j->input < 0 || j->input >= c->n_inputs || !c->inputs[j->input].celery)
        return false;
    return p->how == SETTLE_ACK || p->how == SETTLE_DEAD || p->how == SETTLE_REJECT;
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

/* The reply of a decoded job from its row of the read-back (row), or NULL
 * with *none set when no answer is due yet (retrying). status_only: a
 * duplicate of another delivery's key is told its status, not the stored
 * result or park reason. */
static char *ledger_reply(const struct job *j, PGresult *r, int row, bool status_only,
                          bool *none)
{
    const char *state = PQgetisnull(r, row, 1) ? "" : PQgetvalue(r, row, 1);
    *none = false;
    if (strcmp(state, "applied") == 0) {
        json_t *res = status_only || PQgetisnull(r, row, 2)
                          ? NULL
                          : json_loads(PQgetvalue(r, row, 2), JSON_DECODE_ANY, NULL);
        char *body = celery_reply_body(j->task_id, "SUCCESS", res, NULL, NULL, NULL);
        json_decref(res);
        return body;
    }
    if (strcmp(state, "parked") == 0) {
        char msg[700];
        const char *code = !PQgetisnull(r, row, 3)   ? PQgetvalue(r, row, 3)
                           : !PQgetisnull(r, row, 5) ? PQgetvalue(r, row, 5)
                                                     : "permanent";
        const char *why = !PQgetisnull(r, row, 4)   ? PQgetvalue(r, row, 4)
                          : !PQgetisnull(r, row, 6) ? PQgetvalue(r, row, 6)
                                                    : "";
        if (status_only)
            snprintf(msg, sizeof msg, "idemq parked the task: %s", code);
        else
            snprintf(msg, sizeof msg, "idemq parked the task: %s: %s", code, why);
        return celery_reply_body(j->task_id, "FAILURE", NULL, "IdemqParked", NULL, msg);
    }
    *none = true; /* retrying or not claimed: its result comes later */
    return NULL;
}

/* Publishes one reply to the replies exchange, routing key = its queue. */
static idemq_err_t send(struct broker *b, const struct job *j, const char *body)
{
    /* Celery's rpc backend: JSON in utf-8, delivery_mode 1 (not persistent) */
    json_t *orig = json_pack("{s:s, s:s}", "correlation_id", j->correlation_id,
                             "content_encoding", "utf-8");
    struct broker_props props = {NULL, "application/json", NULL, false, NULL, orig};
    char tp[TRACE_PARENT_LEN + 1];
    json_t *hdr = NULL;
    idemq_err_t err;
    if (!orig)
        return IDEMQ_ERR_NOMEM;
    /* the task's trace context continues in its result */
    trace_job_parent(&j->trace, tp);
    if (tp[0]) {
        hdr = j->trace.in.state[0] ? json_pack("{s:s, s:s}", "traceparent", tp, "tracestate",
                                               j->trace.in.state)
                                   : json_pack("{s:s}", "traceparent", tp);
        if (!hdr) {
            json_decref(orig);
            return IDEMQ_ERR_NOMEM;
        }
        props.headers = hdr;
    }
    /* on the side channel: a refusal (403, 404) closes that one, never the
     * channel that holds the consumers' deliveries */
    err = broker_side_publish(b, CELERY_REPLIES_EXCHANGE, j->reply_to, body, strlen(body),
                              &props, false);
    json_decref(hdr);
    json_decref(orig);
    return err;
}

static void dropped(struct celery_reply_counts *counts, const struct job *j, const char *what,
                    const char *detail)
{
    atomic_fetch_add(&counts->failed, 1);
    log_job(LOG_LVL_WARN, j->has_key ? j->key : NULL, j->tag, 0,
            "celery result of task %s to %s not sent (%s: %s); the task is committed, the "
            "client is not answered", j->task_id, j->reply_to, what, detail);
}

/* The results of the decoded due jobs, one row each in job order, or NULL
 * (with why) when they cannot be read. */
static PGresult *read_back(PGconn *db, const struct conf *c, const struct job *jobs,
                           const struct plan *plans, int n, int *asked, idemq_err_t *err,
                           char *why, size_t whylen)
{
    json_t *keys = json_array();
    char *text = NULL;
    PGresult *r = NULL;
    struct ledger_db_error e;
    const char *params[1];

    *asked = 0;
    *err = IDEMQ_OK;
    if (!keys) {
        *err = IDEMQ_ERR_NOMEM;
        return NULL;
    }
    for (int i = 0; i < n; i++)
        if (due(c, &jobs[i], &plans[i]) && !CONF_INPUT_OBSERVE(&c->inputs[jobs[i].input]) &&
            celery_reply_queue_ok(jobs[i].reply_to) && jobs[i].decode_err == IDEMQ_OK &&
            jobs[i].has_key) {
            json_array_append_new(keys, json_string(jobs[i].key));
            (*asked)++;
        }
    if (!*asked)
        goto out;
    if (!(text = json_dumps(keys, JSON_COMPACT))) {
        *err = IDEMQ_ERR_NOMEM;
        goto out;
    }
    params[0] = text;
    /* the code and reason of a parked key are those of its last park */
    r = ledger_db_query(db,
                        "SELECT k.o, i.state, i.result::text, p.error_code, p.reason, "
                        "       i.last_error_class, i.last_error "
                        "  FROM jsonb_array_elements_text($1::jsonb) WITH ORDINALITY AS k(k, o) "
                        "  LEFT JOIN LATERAL idemq.job_info(k.k) i ON true "
                        "  LEFT JOIN LATERAL (SELECT x.error_code, x.reason FROM idemq.parked x "
                        "                      WHERE x.key = k.k AND i.state = 'parked' "
                        "                      ORDER BY x.id DESC LIMIT 1) p ON true "
                        " ORDER BY k.o",
                        1, params, &e);
    if (!r) {
        snprintf(why, whylen, "reading Celery results back: %s", e.message);
        *err = ledger_db_err(&e);
    } else if (PQntuples(r) != *asked) {
        snprintf(why, whylen, "reading Celery results back: %d rows for %d keys", PQntuples(r),
                 *asked);
        *err = IDEMQ_ERR_SQL;
        PQclear(r);
        r = NULL;
    }
out:
    free(text);
    json_decref(keys);
    return r;
}

idemq_err_t celery_reply_batch(struct celery_reply_cache *bound, struct broker *b, PGconn *db,
                               const struct conf *c, const struct job *jobs,
                               const struct plan *plans, int n, int confirm_ms,
                               struct celery_reply_counts *counts, char *why, size_t whylen)
{
    const struct job **sent_jobs = calloc((size_t)n + 1, sizeof *sent_jobs);
    enum broker_confirm *out = calloc((size_t)n + 1, sizeof *out);
    const char **ids = calloc((size_t)n + 1, sizeof *ids);
    idemq_err_t err = IDEMQ_OK, rerr, serr;
    int asked, published = 0;
    PGresult *r = NULL;

    if (!sent_jobs || !out || !ids) {
        snprintf(why, whylen, "out of memory answering Celery tasks");
        err = IDEMQ_ERR_NOMEM;
        goto done;
    }
    r = read_back(db, c, jobs, plans, n, &asked, &rerr, why, whylen);

    for (int i = 0, row = 0; i < n; i++) {
        const struct job *j = &jobs[i];
        const struct conf_input *in;
        char *body = NULL;
        bool none = false;

        if (!due(c, j, &plans[i]))
            continue;
        in = &c->inputs[j->input];
        if (CONF_INPUT_OBSERVE(in)) { /* a copy of live traffic: watching answers no one */
            atomic_fetch_add(&counts->observe, 1);
            continue;
        }
        if (!celery_reply_queue_ok(j->reply_to)) {
            atomic_fetch_add(&counts->refused, 1);
            log_job(LOG_LVL_WARN, j->has_key ? j->key : NULL, j->tag, 0,
                    "celery result of task %s not sent: reply_to \"%s\" is not a Celery rpc:// "
                    "reply queue (a UUID); idemq answers nothing else", j->task_id, j->reply_to);
            continue;
        }
        if (j->decode_err != IDEMQ_OK || !j->has_key) {
            body = decode_reply(j);
        } else if (!r) {
            row++;
            dropped(counts, j, "result not read", rerr == IDEMQ_ERR_NOMEM ? "out of memory"
                                                                          : why);
            continue;
        } else {
            bool dup = plans[i].outcome == LEDGER_DUPLICATE || plans[i].outcome == LEDGER_REPARK;
            body = ledger_reply(j, r, row++, dup && in->celery_status_only, &none);
            if (none)
                continue;
        }
        if (!body) {
            dropped(counts, j, "building it", "out of memory");
            continue;
        }
        if (err) { /* the connection failed on an earlier reply */
            dropped(counts, j, "publishing it", "the connection failed");
        } else if (bind_once(bound, b, j->reply_to) != IDEMQ_OK) {
            dropped(counts, j, "binding its queue", broker_error(b));
        } else if ((serr = send(b, j, body)) != IDEMQ_OK) {
            dropped(counts, j, "publishing it", broker_error(b));
            if (!broker_readable(b)) { /* the connection failed, not only the side channel */
                err = serr;
                snprintf(why, whylen, "celery result of task %s: %s", j->task_id,
                         broker_error(b));
            }
        } else {
            sent_jobs[published] = j;
            ids[published++] = NULL;
        }
        free(body);
    }
    PQclear(r);
    r = NULL;
    if (published && err) { /* the connection failed: no confirm will come */
        for (int k = 0; k < published; k++)
            dropped(counts, sent_jobs[k], "not confirmed", "the connection failed");
    } else if (published) {
        idemq_err_t werr =
            broker_side_wait_confirms_each(b, confirm_ms, ids, out, (size_t)published);
        for (int k = 0; k < published; k++) {
            const struct job *j = sent_jobs[k];
            if (out[k] == BROKER_CONFIRM_ACKED) {
                atomic_fetch_add(&counts->sent, 1);
                log_job(LOG_LVL_DEBUG, j->has_key ? j->key : NULL, j->tag, 0,
                        "celery result of task %s sent to %s", j->task_id, j->reply_to);
            } else {
                dropped(counts, j, out[k] == BROKER_CONFIRM_PENDING ? "not confirmed"
                                                                    : "refused by the broker",
                        broker_error(b));
            }
        }
        if (werr && !err && !broker_readable(b)) { /* the connection, not a refusal */
            err = werr;
            snprintf(why, whylen, "celery results not confirmed: %s", broker_error(b));
        }
    }
    if (!err && rerr == IDEMQ_ERR_DB_CONN)
        err = rerr; /* the session is gone: the worker reconnects */
done:
    free(sent_jobs);
    free(out);
    free(ids);
    return err;
}
