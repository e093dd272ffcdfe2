/*
 * pgq_lease: the visible leases of PostgreSQL queue rows whose effect is a
 * provider call, and their way through provider_flow (see pgq_lease.h).
 */
#include "pgq_lease.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "log.h"
#include "pgq.h"
#include "provider_flow.h"

/* A row's lease is the longest call (provider.timeout_ms) plus this: the
 * ledger's lease of a request is the call's timeout plus 5 s, so a row
 * whose holder died becomes ready about when its intent may be looked up. */
#define PGQ_LEASE_EXTRA_MS 5000
/* Decisions settled per poll at most. */
#define PGQ_LEASE_POLL_MAX 64

struct held {
    long long id;
    int input;
};

struct pgq_lease {
    const struct conf *c; /* the worker's PostgreSQL inputs as the inputs */
    int worker_id;
    struct provider_flow *flow;
    char holder[200];
    int lease_ms;
    long long extended_at; /* when the leases held were last extended */
    struct held *held;
    int n_held, cap_held;
    bool draining;
};

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

idemq_err_t pgq_lease_new(const struct conf *view, int worker_id, struct pgq_lease **out,
                          char *errbuf, size_t errlen)
{
    struct pgq_lease *pl;
    char host[128] = "";
    int longest = 0;
    bool any = false;

    *out = NULL;
    for (int i = 0; i < view->n_inputs; i++) {
        if (!CONF_INPUT_PROVIDER(&view->inputs[i]))
            continue;
        any = true;
        if (view->inputs[i].provider.timeout_ms > longest)
            longest = view->inputs[i].provider.timeout_ms;
    }
    if (!any)
        return IDEMQ_OK;
    if (!(pl = calloc(1, sizeof *pl))) {
        snprintf(errbuf, errlen, "out of memory");
        return IDEMQ_ERR_NOMEM;
    }
    pl->c = view;
    pl->worker_id = worker_id;
    pl->lease_ms = longest + PGQ_LEASE_EXTRA_MS;
    if (gethostname(host, sizeof host - 1) != 0 || !host[0])
        snprintf(host, sizeof host, "localhost");
    snprintf(pl->holder, sizeof pl->holder, "%s:%ld:w%d", host, (long)getpid(), worker_id);
    if (!(pl->flow = provider_flow_new(view, worker_id, errbuf, errlen))) {
        free(pl);
        return IDEMQ_ERR_CONFIG;
    }
    *out = pl;
    return IDEMQ_OK;
}

void pgq_lease_free(struct pgq_lease *pl)
{
    if (!pl)
        return;
    provider_flow_free(pl->flow);
    free(pl->held);
    free(pl);
}

const char *pgq_lease_holder(const struct pgq_lease *pl)
{
    return pl->holder;
}

int pgq_lease_ms(const struct pgq_lease *pl)
{
    return pl->lease_ms;
}

int pgq_lease_room(const struct pgq_lease *pl, int input)
{
    int n = 0;
    if (!pl || pl->draining || input < 0 || input >= pl->c->n_inputs ||
        !CONF_INPUT_PROVIDER(&pl->c->inputs[input]))
        return 0;
    for (int k = 0; k < pl->n_held; k++)
        n += pl->held[k].input == input;
    n = pl->c->inputs[input].provider.max_in_flight - n;
    return n > 0 ? n : 0;
}

int pgq_lease_pending(const struct pgq_lease *pl)
{
    return pl ? pl->n_held : 0;
}

int pgq_lease_in_flow(const struct pgq_lease *pl)
{
    return pl ? provider_flow_pending(pl->flow) : 0;
}

static bool hold(struct pgq_lease *pl, long long id, int input)
{
    if (pl->n_held == pl->cap_held) {
        int cap = pl->cap_held ? pl->cap_held * 2 : 16;
        struct held *nh = realloc(pl->held, sizeof *nh * (size_t)cap);
        if (!nh)
            return false;
        pl->held = nh;
        pl->cap_held = cap;
    }
    pl->held[pl->n_held].id = id;
    pl->held[pl->n_held].input = input;
    pl->n_held++;
    return true;
}

/* The input of held row id, or -1. */
static int held_input(const struct pgq_lease *pl, long long id)
{
    for (int k = 0; k < pl->n_held; k++)
        if (pl->held[k].id == id)
            return pl->held[k].input;
    return -1;
}

void pgq_lease_forget(struct pgq_lease *pl, long long id)
{
    for (int k = 0; k < pl->n_held; k++) {
        if (pl->held[k].id == id) {
            pl->held[k] = pl->held[--pl->n_held];
            return;
        }
    }
}

/* The columns of idemq.queue_lease: the ten of a take, then the holder
 * whose lease ran out (or NULL). */
#define LEASE_NCOLS 11
#define LEASE_SQL                                                                          \
    "SELECT r_id, r_key, r_order_key, r_payload, r_attempts, r_redrive_gen, r_park_id, "   \
    "r_enqueued_at, r_traceparent, r_tracestate, r_expired_holder "                        \
    "FROM idemq.queue_lease($1, $2::int, $3, $4::int)"

idemq_err_t pgq_lease_take(struct pgq_lease *pl, PGconn *db, const struct conf_input *in,
                           int input, struct job *jobs, int cap, int *n, int *expired,
                           struct ledger_db_error *e)
{
    char lim[16], ms[16];
    const char *params[4] = {in->queue, lim, pl->holder, ms};
    PGresult *r;
    int rows;

    *n = 0;
    *expired = 0;
    if (cap <= 0)
        return IDEMQ_OK;
    snprintf(lim, sizeof lim, "%d", cap);
    snprintf(ms, sizeof ms, "%d", pl->lease_ms);
    r = ledger_db_exec_params(db, LEASE_SQL, 4, NULL, params, NULL, NULL, 0);
    if (PQresultStatus(r) != PGRES_TUPLES_OK || PQnfields(r) != LEASE_NCOLS) {
        ledger_db_error_from(db, r, e);
        PQclear(r);
        return ledger_db_err(e);
    }
    rows = PQntuples(r);
    for (int i = 0; i < rows && i < cap; i++) {
        long long id = strtoll(PQgetvalue(r, i, 0), NULL, 10);

        /* Held from here: a row that cannot become a job is left to its
         * lease (nothing else touched it). */
        if (!hold(pl, id, input) || !pgq_result_row_job(r, i, in, input, &jobs[i]))
            goto nomem;
        if (!PQgetisnull(r, i, 10)) {
            (*expired)++;
            log_job(LOG_LVL_WARN, jobs[i].has_key ? jobs[i].key : NULL, (uint64_t)id, 0,
                    "queue row %lld taken again: the lease of %s ran out", id,
                    PQgetvalue(r, i, 10));
        }
        (*n)++;
    }
    PQclear(r);
    return IDEMQ_OK;
nomem:
    PQclear(r);
    snprintf(e->message, sizeof e->message, "out of memory taking queue rows");
    e->sqlstate[0] = '\0';
    e->conn_lost = false;
    return IDEMQ_ERR_NOMEM;
}

idemq_err_t pgq_lease_start(struct pgq_lease *pl, PGconn *db, const struct job *j)
{
    /* the row id is the cookie: ids start at 1, never NULL */
    idemq_err_t err = provider_flow_start(pl->flow, db, j, (void *)(intptr_t)(long long)j->tag);
    if (err)
        pgq_lease_forget(pl, (long long)j->tag);
    return err;
}

/* Extends every lease held, when a third of it has passed. */
static idemq_err_t extend(struct pgq_lease *pl, PGconn *db, struct ledger_db_error *e)
{
    char ms[16], *ids;
    size_t len = 0, cap;
    const char *params[3];
    PGresult *r;

    if (pl->n_held == 0 || now_ms() - pl->extended_at < pl->lease_ms / 3)
        return IDEMQ_OK;
    cap = (size_t)pl->n_held * 22 + 3;
    if (!(ids = malloc(cap))) {
        snprintf(e->message, sizeof e->message, "out of memory extending leases");
        e->sqlstate[0] = '\0';
        e->conn_lost = false;
        return IDEMQ_ERR_NOMEM;
    }
    ids[len++] = '{';
    for (int k = 0; k < pl->n_held; k++)
        len += (size_t)snprintf(ids + len, cap - len, "%s%lld", k ? "," : "", pl->held[k].id);
    snprintf(ids + len, cap - len, "}");
    snprintf(ms, sizeof ms, "%d", pl->lease_ms);
    params[0] = ids;
    params[1] = pl->holder;
    params[2] = ms;
    r = ledger_db_exec_params(db, "SELECT idemq.queue_lease_extend($1::bigint[], $2, $3::int)",
                              3, NULL, params, NULL, NULL, 0);
    free(ids);
    if (PQresultStatus(r) != PGRES_TUPLES_OK) {
        ledger_db_error_from(db, r, e);
        PQclear(r);
        return ledger_db_err(e);
    }
    if (PQntuples(r) < pl->n_held)
        log_warn("pgq worker %d: %d of %d leased rows were no longer held (their leases ran "
                 "out before this extension)", pl->worker_id, pl->n_held - PQntuples(r),
                 pl->n_held);
    PQclear(r);
    pl->extended_at = now_ms();
    return IDEMQ_OK;
}

/* Settles the row of one decision. */
static idemq_err_t settle(struct pgq_lease *pl, PGconn *db, const struct provider_decision *d,
                          long long id, int input, struct pgq_lease_counts *c,
                          struct ledger_db_error *e)
{
    struct pgq_lease_tally none, *by = c->by && input >= 0 && input < c->n_by ? &c->by[input]
                                                                               : &none;
    char sid[32], delay[24], park[32];
    const char *params[6];
    const char *action;
    PGresult *r;
    bool held;

    snprintf(sid, sizeof sid, "%lld", id);
    snprintf(delay, sizeof delay, "%ld", d->delay_ms);
    params[0] = sid;
    params[1] = pl->holder;
    params[3] = delay;
    params[4] = d->reason;
    params[5] = NULL;
    switch (d->kind) {
    case PROVIDER_FLOW_ACK:
        action = "done";
        break;
    case PROVIDER_FLOW_PARK:
        action = "done";
        if (json_integer_value(json_object_get(d->park, "park_id")) > 0) {
            snprintf(park, sizeof park, "%lld",
                     (long long)json_integer_value(json_object_get(d->park, "park_id")));
            params[5] = park;
        }
        break;
    case PROVIDER_FLOW_RETRY:
        action = "retry";
        break;
    case PROVIDER_FLOW_WAIT:
        action = "wait";
        break;
    case PROVIDER_FLOW_FAIL:
    default:
        return IDEMQ_OK; /* not here: pgq_lease_poll */
    }
    params[2] = action;
    r = ledger_db_exec_params(db,
                              "SELECT idemq.queue_lease_settle($1::bigint, $2, $3, $4::int, "
                              "$5, $6::bigint)",
                              6, NULL, params, NULL, NULL, 0);
    if (PQresultStatus(r) != PGRES_TUPLES_OK) {
        ledger_db_error_from(db, r, e);
        PQclear(r);
        return ledger_db_err(e);
    }
    held = strcmp(PQgetvalue(r, 0, 0), "t") == 0;
    PQclear(r);
    if (!held)
        log_job(LOG_LVL_WARN, d->key, id, d->attempt,
                "queue row %lld: its lease ran out before its %s was recorded: the worker "
                "that took it again settles it", id, provider_flow_kind_name(d->kind));
    else
        log_job(LOG_LVL_DEBUG, d->key, id, d->attempt, "queue row %lld settled: %s (%s)", id,
                provider_flow_kind_name(d->kind), d->outcome);
    if (d->kind == PROVIDER_FLOW_ACK && strcmp(d->outcome, "applied") == 0) {
        c->applied++;
        by->applied++;
    } else if (d->kind == PROVIDER_FLOW_ACK) {
        c->duplicates++;
        by->duplicates++;
    } else if (d->kind == PROVIDER_FLOW_PARK) {
        c->parked++;
        by->parked++;
    } else if (d->kind == PROVIDER_FLOW_RETRY) {
        c->retried++;
        by->retried++;
    }
    return IDEMQ_OK;
}

idemq_err_t pgq_lease_poll(struct pgq_lease *pl, PGconn *db, int wait_ms,
                           struct pgq_lease_counts *c, enum classify_class *fail, char *why,
                           size_t whylen, struct ledger_db_error *e)
{
    struct provider_decision ds[PGQ_LEASE_POLL_MAX];
    idemq_err_t err = IDEMQ_OK;
    int n;

    c->applied = c->duplicates = c->retried = c->parked = 0;
    if (c->by && c->n_by > 0)
        memset(c->by, 0, sizeof *c->by * (size_t)c->n_by);
    *fail = CLASS_NONE;
    if (!pl || (pl->n_held == 0 && provider_flow_pending(pl->flow) == 0))
        return IDEMQ_OK;
    if ((err = extend(pl, db, e)))
        return err;
    n = provider_flow_poll(pl->flow, db, wait_ms, ds, PGQ_LEASE_POLL_MAX);
    for (int k = 0; k < n; k++) {
        long long id = (long long)(intptr_t)ds[k].cookie;
        int input = held_input(pl, id);
        pgq_lease_forget(pl, id);
        if (ds[k].kind == PROVIDER_FLOW_FAIL) {
            /* the row is left to its lease; the next take finds what the
             * ledger holds */
            *fail = ds[k].fail_class == CLASS_FATAL ? CLASS_FATAL : CLASS_INFRA;
            snprintf(why, whylen, "provider job %s: %s", ds[k].key, ds[k].reason);
        } else if (!err) {
            err = settle(pl, db, &ds[k], id, input, c, e);
        }
        provider_flow_decision_clear(&ds[k]);
    }
    return err;
}

void pgq_lease_drain(struct pgq_lease *pl)
{
    if (!pl)
        return;
    pl->draining = true;
    provider_flow_drain(pl->flow);
}

void pgq_lease_release(struct pgq_lease *pl, PGconn *db)
{
    char *ids;
    size_t len = 0, cap;
    const char *params[2];

    if (!pl || pl->n_held == 0 || !db || PQstatus(db) != CONNECTION_OK)
        return;
    cap = (size_t)pl->n_held * 22 + 3;
    if (!(ids = malloc(cap)))
        return;
    ids[len++] = '{';
    for (int k = 0; k < pl->n_held; k++)
        len += (size_t)snprintf(ids + len, cap - len, "%s%lld", k ? "," : "", pl->held[k].id);
    snprintf(ids + len, cap - len, "}");
    params[0] = ids;
    params[1] = pl->holder;
    PQclear(ledger_db_exec_params(db, "SELECT idemq.queue_lease_release($1::bigint[], $2)", 2,
                                  NULL, params, NULL, NULL, 0));
    free(ids);
    pl->n_held = 0;
}
