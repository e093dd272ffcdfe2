/*
 * provider_run: the deliveries of a worker's provider inputs between the
 * flow's start and its decision, and the reconciler (see provider_run.h).
 */
#include "provider_run.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ledger_txn.h"
#include "log.h"
#include "provider_flow.h"
#include "reconcile.h"
#include "topology.h"

#define SWEEP_SCAN_MS 5000 /* the reconciler looks for overdue intents this often */

/* A delivery awaiting its decision, kept whole. */
struct pending {
    struct pending *next, *prev;
    struct job job;
};

struct provider_run {
    const struct conf *c;
    struct provider_flow *flow;
    struct reconcile_sweep *sweep;    /* worker 0 only */
    struct pending head;              /* list of deliveries awaiting a decision */
    struct provider_decision decisions[PROVIDER_RUN_MAX];
    struct pending *polled[PROVIDER_RUN_MAX]; /* owners of the last poll's jobs */
    int n_polled;
};

static void pending_free(struct pending *p)
{
    p->prev->next = p->next;
    p->next->prev = p->prev;
    job_destroy(&p->job);
    free(p);
}

idemq_err_t provider_run_new(const struct conf *c, int worker_id, struct provider_run **out,
                             char *errbuf, size_t errlen)
{
    struct provider_run *pr;
    bool any = false;
    char who[300];

    *out = NULL;
    for (int i = 0; i < c->n_inputs; i++)
        any = any || CONF_INPUT_PROVIDER(&c->inputs[i]);
    if (!any)
        return IDEMQ_OK;
    if (!(pr = calloc(1, sizeof *pr))) {
        snprintf(errbuf, errlen, "out of memory");
        return IDEMQ_ERR_NOMEM;
    }
    pr->c = c;
    pr->head.next = pr->head.prev = &pr->head;
    if (!(pr->flow = provider_flow_new(c, worker_id, errbuf, errlen)))
        goto fail;
    snprintf(who, sizeof who, "%s reconciler", c->consumer_id);
    if (worker_id == 0 && !(pr->sweep = reconcile_sweep_new(c, who, NULL, errbuf, errlen)))
        goto fail;
    *out = pr;
    return IDEMQ_OK;
fail:
    provider_run_free(pr);
    return IDEMQ_ERR_CONFIG;
}

void provider_run_free(struct provider_run *pr)
{
    if (!pr)
        return;
    provider_run_abandon(pr);
    provider_flow_free(pr->flow); /* cancels the calls still in flight */
    reconcile_sweep_free(pr->sweep);
    free(pr);
}

void provider_run_take(struct provider_run *pr, PGconn *db, struct job *jobs, int *n,
                       bool *release, char *why, size_t whylen)
{
    int w = 0;
    if (!pr)
        return;
    for (int i = 0; i < *n; i++) {
        struct job *j = &jobs[i];
        struct pending *p;
        if (j->input < 0 || j->input >= pr->c->n_inputs ||
            !CONF_INPUT_PROVIDER(&pr->c->inputs[j->input]) ||
            CONF_INPUT_OBSERVE(&pr->c->inputs[j->input]) || /* no provider call */
            job_decode(j, &pr->c->inputs[j->input]) != IDEMQ_OK) {
            if (w != i) { /* keep it in the batch: compact */
                struct job tmp = jobs[w];
                jobs[w] = *j;
                *j = tmp;
            }
            w++;
            continue;
        }
        if (!(p = calloc(1, sizeof *p))) {
            *release = true;
            snprintf(why, whylen, "out of memory holding a provider job");
            continue; /* its slot is reused: the tag stays unsettled */
        }
        p->job = *j; /* the pending entry owns the job now */
        job_init(j);
        p->next = pr->head.next;
        p->prev = &pr->head;
        pr->head.next->prev = p;
        pr->head.next = p;
        if (provider_flow_start(pr->flow, db, &p->job, p) != IDEMQ_OK) {
            *release = true;
            snprintf(why, whylen, "the provider flow cannot take %s", p->job.key);
            pending_free(p);
        }
    }
    *n = w;
}

int provider_run_poll(struct provider_run *pr, PGconn *db, int wait_ms, struct job *jobs,
                      struct plan *plans, enum classify_class *fail, char *why, size_t whylen)
{
    int n;
    *fail = CLASS_NONE;
    if (!pr || !provider_flow_pending(pr->flow))
        return 0;
    n = provider_flow_poll(pr->flow, db, wait_ms, pr->decisions, PROVIDER_RUN_MAX);
    for (int i = 0; i < n; i++) {
        struct provider_decision *d = &pr->decisions[i];
        struct plan *pl = &plans[i];
        memset(pl, 0, sizeof *pl);
        pr->polled[i] = d->cookie;
        jobs[i] = pr->polled[i]->job; /* a view: the pending entry keeps owning it */
        switch (d->kind) {
        case PROVIDER_FLOW_ACK:
            pl->how = SETTLE_ACK;
            pl->outcome = strcmp(d->outcome, "applied") == 0 ? LEDGER_APPLIED : LEDGER_DUPLICATE;
            break;
        case PROVIDER_FLOW_RETRY:
        case PROVIDER_FLOW_WAIT:
            pl->how = SETTLE_DELAY;
            pl->delay_ms = topology_clamp_delay(pr->c, d->delay_ms);
            pl->attempt = d->attempt;
            pl->outcome = d->kind == PROVIDER_FLOW_RETRY ? LEDGER_ERROR : LEDGER_EARLY;
            log_job(LOG_LVL_INFO, d->key, jobs[i].tag, d->attempt,
                    "provider %s (%s): again in %ld ms", provider_flow_kind_name(d->kind),
                    d->outcome, pl->delay_ms);
            break;
        case PROVIDER_FLOW_PARK:
            pl->how = SETTLE_DEAD;
            pl->park = json_incref(d->park);
            pl->attempt = d->attempt;
            log_job(LOG_LVL_WARN, d->key, jobs[i].tag, d->attempt, "provider job parked (%s): %s",
                    d->outcome, d->reason);
            break;
        case PROVIDER_FLOW_FAIL:
            pl->how = SETTLE_RELEASE; /* nothing settled for it */
            snprintf(why, whylen, "provider job %s: %s", d->key, d->reason);
            *fail = d->fail_class == CLASS_FATAL ? CLASS_FATAL : CLASS_INFRA;
            break;
        }
    }
    pr->n_polled = n;
    return n;
}

void provider_run_done(struct provider_run *pr, struct plan *plans, bool settled)
{
    if (!pr)
        return;
    for (int i = 0; i < pr->n_polled; i++) {
        /* a released delivery stays until the connection drops (abandon) */
        if (plans[i].how != SETTLE_RELEASE || settled)
            pending_free(pr->polled[i]);
        settle_plan_clear(&plans[i]);
        provider_flow_decision_clear(&pr->decisions[i]);
    }
    pr->n_polled = 0;
}

void provider_run_abandon(struct provider_run *pr)
{
    if (!pr)
        return;
    provider_flow_detach(pr->flow);
    while (pr->head.next != &pr->head)
        pending_free(pr->head.next);
}

void provider_run_drain(struct provider_run *pr)
{
    if (pr)
        provider_flow_drain(pr->flow);
}

void provider_run_pump(struct provider_run *pr)
{
    if (pr)
        provider_flow_pump(pr->flow);
}

int provider_run_pending(const struct provider_run *pr)
{
    return pr ? provider_flow_pending(pr->flow) : 0;
}

bool provider_run_busy(const struct provider_run *pr)
{
    return pr && (provider_flow_pending(pr->flow) ||
                  (pr->sweep && reconcile_sweep_busy(pr->sweep)));
}

idemq_err_t provider_run_sweep(struct provider_run *pr, PGconn *db, struct ledger_db_error *e)
{
    if (!pr || !pr->sweep || !db)
        return IDEMQ_OK;
    return reconcile_sweep_step(pr->sweep, db, SWEEP_SCAN_MS, 0, NULL, e);
}
