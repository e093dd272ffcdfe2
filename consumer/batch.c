/*
 * batch: one batch's transactions and the ladder of fallbacks that makes
 * every job end committed in some plan (see batch.h).
 */
#include "batch.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "backoff.h"
#include "classify.h"
#include "ledger_db.h"
#include "ledger_lanes.h"
#include "log.h"
#include "outbox.h"
#include "protect.h"
#include "topology.h"

#define CALL_RETRIES 3 /* whole-call transient failures retried in place */

/* What one transaction came to. */
enum step {
    STEP_OK = 0,
    STEP_INFRA,  /* database gone */
    STEP_FATAL,  /* deploy/config problem */
    STEP_RETRY,  /* the whole call failed transiently */
    STEP_SPLIT,  /* the whole call failed permanently */
};

bool batch_init(struct batch *bt, const struct conf *c, int cap, atomic_long *by_class,
                uint64_t seed)
{
    memset(bt, 0, sizeof *bt);
    bt->c = c;
    bt->cap = cap;
    bt->by_class = by_class;
    bt->rng = seed ? seed : 1;
    bt->jobs = calloc((size_t)cap, sizeof *bt->jobs);
    bt->plans = calloc((size_t)cap, sizeof *bt->plans);
    bt->good = calloc((size_t)cap, sizeof *bt->good);
    bt->res = calloc((size_t)cap, sizeof *bt->res);
    bt->obs_jobs = calloc((size_t)cap, sizeof *bt->obs_jobs);
    bt->obs = calloc((size_t)cap, sizeof *bt->obs);
    if (!bt->jobs || !bt->plans || !bt->good || !bt->res || !bt->obs_jobs || !bt->obs)
        return false;
    for (int i = 0; i < cap; i++)
        job_init(&bt->jobs[i]);
    return true;
}

void batch_free(struct batch *bt)
{
    for (int i = 0; bt->jobs && i < bt->cap; i++)
        job_destroy(&bt->jobs[i]);
    for (int i = 0; bt->plans && i < bt->cap; i++)
        settle_plan_clear(&bt->plans[i]);
    for (int i = 0; bt->res && i < bt->cap; i++)
        ledger_txn_result_clear(&bt->res[i]);
    free(bt->jobs);
    free(bt->plans);
    free(bt->good);
    free(bt->res);
    free(bt->obs_jobs);
    free(bt->obs);
    ledger_outbox_rows_free(&bt->taken);
    memset(bt, 0, sizeof *bt);
}

static bool is_ordered(const struct batch *bt, const struct job *j)
{
    return CONF_INPUT_ORDERED(&bt->c->inputs[j->input]);
}

/* A delivery of an input in observe mode: never applied, never parked. */
static bool is_observed(const struct batch *bt, const struct job *j)
{
    return CONF_INPUT_OBSERVE(&bt->c->inputs[j->input]);
}

/* A lane's id for comparisons: > 0 for a delivery of an ordered input. */
static int lane_id(const struct job *j)
{
    return j->lane >= 0 && !j->deferred_id ? j->input * 100 + j->lane + 1 : 0;
}

static void count_class(struct batch *bt, enum classify_class cls)
{
    if (bt->by_class)
        atomic_fetch_add(&bt->by_class[cls], 1);
}

/* Classifies a whole-call failure into the step it leads to. */
static enum step call_failed(struct batch *bt, const struct ledger_db_error *e, const char *what)
{
    enum classify_class cls = classify_sqlstate(e->sqlstate, e->conn_lost, &bt->c->rules);
    snprintf(bt->why, sizeof bt->why, "%s: %s %s", what, e->sqlstate, e->message);
    bt->last_call = *e;
    switch (cls) {
    case CLASS_INFRA: return STEP_INFRA;
    case CLASS_FATAL: return STEP_FATAL;
    case CLASS_TRANSIENT: return STEP_RETRY;
    case CLASS_PERMANENT: return STEP_SPLIT;
    case CLASS_NONE: break;
    }
    return STEP_SPLIT;
}

/* Statement timeouts do not pass by running the same call again at once. */
static bool timed_out(const struct batch *bt)
{
    return strcmp(bt->last_call.sqlstate, "57014") == 0;
}

/*
 * Decides what a failed job's attempt leads to and records it (inside the
 * transaction): a durable retry schedule and a delay, or a park. forced:
 * IDEMQ_OK to classify r's SQLSTATE, or the code of a permanent failure the
 * ledger decided (outside_dedup_window).
 */
static enum step plan_failure(struct batch *bt, struct job *j, struct ledger_result *r,
                              struct plan *p, idemq_err_t forced)
{
    struct ledger_db_error e;
    enum classify_class cls = forced ? CLASS_PERMANENT
                                     : classify_sqlstate(r->sqlstate, false, &bt->c->rules);
    int used = r->attempt - r->base; /* attempts of this generation's budget */
    idemq_err_t code = forced ? forced : IDEMQ_ERR_EFFECT;
    bool park;

    if (cls == CLASS_FATAL) {
        /* the key last: the worker logs the same reason once, whichever job met it */
        snprintf(bt->why, sizeof bt->why, "effect failed with %s %s (%s; first job %s)",
                 r->sqlstate, r->message, classify_name(cls), j->key);
        return STEP_FATAL;
    }
    if (cls == CLASS_INFRA || cls == CLASS_NONE)
        cls = CLASS_TRANSIENT;
    count_class(bt, cls);
    park = cls == CLASS_PERMANENT || used >= bt->c->max_attempts;
    if (cls == CLASS_TRANSIENT && park)
        code = IDEMQ_ERR_RETRIES_EXHAUSTED;
    p->attempt = r->attempt;
    p->delay_ms = park ? 0
                       : topology_clamp_delay(bt->c, backoff_delay_ms(used, bt->c->base_delay_ms,
                                                                      bt->c->max_delay_ms,
                                                                      bt->c->jitter_mode, &bt->rng));
    if (ledger_txn_record_failure(bt->lt, j, r, classify_name(cls), idemq_err_name(code), park,
                                  p->delay_ms, &e))
        return call_failed(bt, &e, "record_failure");
    if (park && !r->park) {
        snprintf(bt->why, sizeof bt->why, "record_failure returned no park facts for %s", j->key);
        return STEP_SPLIT;
    }
    if (park && is_ordered(bt, j)) {
        if (ledger_lanes_parked(bt->db, bt->c, j, &e))
            return call_failed(bt, &e, "lane_parked");
        bt->drain_hint = true;
    }
    {
        struct log_fields lf = LOG_FIELDS_NONE;
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        lf.event = park ? "park" : "retry";
        lf.input = bt->c->inputs[j->input].name;
        lf.key = j->key;
        lf.tag = j->tag;
        lf.attempt = r->attempt;
        lf.outcome = park ? "parked" : "retry";
        lf.error_class = classify_name(cls);
        lf.code = idemq_err_name(code);
        lf.sqlstate = r->sqlstate;
        lf.duration_ms = j->received_ns ? (double)((long long)ts.tv_sec * 1000000000LL +
                                                   ts.tv_nsec - j->received_ns) / 1e6
                                        : -1.0;
        LOG_FIELDS(park ? LOG_LVL_WARN : LOG_LVL_INFO, &lf, "%s error %s: %s -> %s (%ld ms)%s",
                   classify_name(cls), r->sqlstate, r->message, park ? "parked" : "retry in",
                   p->delay_ms,
                   !park && is_ordered(bt, j) ? (j->deferred_id ? ", from the ledger"
                                                                : ", in place")
                                              : "");
    }
    p->how = park ? SETTLE_DEAD : SETTLE_DELAY;
    if (!park && is_ordered(bt, j)) /* retried in place: later jobs must not overtake it */
        p->how = j->deferred_id ? SETTLE_NONE : SETTLE_HOLD;
    if (park)
        p->park = json_incref(r->park);
    return STEP_OK;
}

/* Parks job j, which failed decoding, inside the open transaction. */
static enum step park_undecoded(struct batch *bt, struct job *j, struct plan *p)
{
    struct ledger_db_error e;
    if (ledger_txn_park_message(bt->lt, j, idemq_err_name(j->decode_err), j->reason, true,
                                &p->park, &e))
        return call_failed(bt, &e, "park_message");
    if (!p->park) {
        snprintf(bt->why, sizeof bt->why, "park_message returned no park facts");
        return STEP_SPLIT;
    }
    if (is_ordered(bt, j) && j->has_key &&
        ledger_lanes_parked(bt->db, bt->c, j, &e)) /* drops a deferred copy */
        return call_failed(bt, &e, "lane_parked");
    /* What the client library could not decode cannot be republished: the
     * broker dead-letters it from the queue itself (basic.reject). */
    p->how = j->decode_err == IDEMQ_ERR_UNDECODABLE ? SETTLE_REJECT : SETTLE_DEAD;
    p->attempt = 1;
    {
        struct log_fields lf = LOG_FIELDS_NONE;
        lf.event = "park";
        lf.input = bt->c->inputs[j->input].name;
        lf.key = j->has_key ? j->key : NULL;
        lf.tag = j->tag;
        lf.attempt = 1;
        lf.outcome = "parked";
        lf.error_class = "permanent";
        lf.code = idemq_err_name(j->decode_err);
        LOG_FIELDS(LOG_LVL_WARN, &lf, "parked %s: %s", idemq_err_name(j->decode_err), j->reason);
    }
    return STEP_OK;
}

/*
 * Observe mode, inside the open transaction: what apply mode
 * would make of bt->obs_jobs[0..nobs) is decided and recorded by the
 * ledger (no effect, no park); every one of them is acknowledged.
 */
static enum step observe_txn(struct batch *bt, struct job *jobs, struct plan *plans, int nobs)
{
    struct ledger_db_error e;

    if (ledger_txn_observe(bt->lt, bt->obs_jobs, nobs, bt->obs, &e))
        return call_failed(bt, &e, "observe_batch");
    for (int k = 0; k < nobs; k++) {
        struct job *j = bt->obs_jobs[k];
        struct plan *p = &plans[j - jobs];
        const struct ledger_observed *o = &bt->obs[k];
        p->how = SETTLE_ACK;
        p->attempt = 0;
        p->observed = (int)o->outcome;
        p->observe_code =
            o->outcome == OBSERVE_WOULD_PARK || o->outcome == OBSERVE_LATE ? (int)o->code : 0;
        if (o->outcome == OBSERVE_WOULD_PARK || o->outcome == OBSERVE_LATE)
            log_job(LOG_LVL_INFO, j->has_key ? j->key : NULL, j->tag, 0,
                    "observe: %s %s (apply mode would park it; acknowledged)",
                    ledger_observe_outcome_name(o->outcome), o->code_name);
        else if (o->outcome == OBSERVE_DUPLICATE)
            log_job(LOG_LVL_DEBUG, j->key, j->tag, 0, "observe: duplicate%s%s",
                    o->code_name[0] ? " " : "", o->code_name);
    }
    return STEP_OK;
}

/* Whether the batch holds a job of an input whose effect emits. */
static bool batch_emits(const struct batch *bt)
{
    for (int i = 0; i < bt->n; i++)
        if (bt->jobs[i].input >= 0 && bt->jobs[i].input < bt->c->n_inputs &&
            bt->c->inputs[bt->jobs[i].input].emits)
            return true;
    return false;
}

/* leases the open transaction's publishable outbox rows to the
 * worker's relay (see struct batch). Rows beyond what bt->taken can keep
 * are left to a claim. With a key active the take also seals the bodies
 * the transaction emitted (ledger_outbox_take), so it runs even when
 * nothing is to be leased (relay off, or rows already taken by an earlier
 * commit of this batch): it then leases nothing (limit 0). */
static enum step take_outbox(struct batch *bt, struct outbox_rows *t)
{
    struct ledger_db_error e;
    int emitted = 0;
    bool seal = protect_active(protect_global()) != NULL;

    if (!batch_emits(bt) || (!bt->outbox_holder && !seal))
        return STEP_OK;
    if (!bt->outbox_holder || bt->taken.res) {
        struct outbox_rows none;
        if (bt->taken.res) /* an earlier commit of this batch took rows */
            bt->outbox_rest = true;
        if (!seal)
            return STEP_OK;
        if (ledger_outbox_take(bt->db, bt->outbox_holder ? bt->outbox_holder : "", 0,
                               bt->outbox_lease_ms, &none, &emitted, &e))
            return call_failed(bt, &e, "outbox_take");
        ledger_outbox_rows_free(&none);
        return STEP_OK;
    }
    if (ledger_outbox_take(bt->db, bt->outbox_holder, OUTBOX_CLAIM_MAX, bt->outbox_lease_ms, t,
                           &emitted, &e))
        return call_failed(bt, &e, "outbox_take");
    if (emitted > t->n)
        bt->outbox_rest = true;
    return STEP_OK;
}

static enum step commit(struct batch *bt)
{
    struct ledger_db_error e;
    struct outbox_rows taken = {NULL, NULL, 0};
    enum step st;

    if ((st = take_outbox(bt, &taken)) != STEP_OK) {
        ledger_txn_rollback(bt->lt);
        return st;
    }
#ifdef IDEMQ_TEST_HOOKS
    if (bt->crash == BATCH_CRASH_BEFORE_COMMIT) {
        log_warn("test hook: SIGKILL before commit");
        kill(getpid(), SIGKILL);
    }
#endif
    if (ledger_txn_commit(bt->lt, &e)) {
        /* rows it may have committed stay leased to this session: a claim
         * takes them once the lease passes or the session is gone */
        ledger_outbox_rows_free(&taken);
        return call_failed(bt, &e, "COMMIT");
    }
    if (taken.res)
        bt->taken = taken;
    if (bt->progress) { /* a transaction finished: the worker is alive */
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        atomic_store(bt->progress, (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000);
    }
#ifdef IDEMQ_TEST_HOOKS
    if (bt->crash == BATCH_CRASH_AFTER_COMMIT) {
        log_warn("test hook: SIGKILL after commit, before ack");
        kill(getpid(), SIGKILL);
    }
#endif
    return STEP_OK;
}

/*
 * A Celery `expires` applies only to a task whose key is not claimed yet:
 * inside the open transaction, the expired jobs of jobs[0..n) whose key the
 * ledger holds (a redelivery of a task that ran, a retry) become jobs again
 * and go through the claim like any copy (a duplicate is answered with the
 * stored result, never REVOKED); the rest stay parked as celery_expired.
 */
static enum step expired_but_claimed(struct batch *bt, struct job *jobs, int n)
{
    struct ledger_db_error e;
    json_t *keys = json_array();
    char *text = NULL;
    PGresult *r = NULL;
    const char *params[1];
    enum step st = STEP_OK;
    int asked = 0;

    if (!keys)
        goto nomem;
    for (int i = 0; i < n; i++)
        if (jobs[i].decode_err == IDEMQ_ERR_CELERY_EXPIRED && jobs[i].has_key &&
            jobs[i].effect >= 0) { /* observe mode too: it reports what apply would do */
            json_array_append_new(keys, json_string(jobs[i].key));
            asked++;
        }
    if (!asked)
        goto out;
    if (!(text = json_dumps(keys, JSON_COMPACT)))
        goto nomem;
    params[0] = text;
    if (!(r = ledger_db_query(bt->db,
                              "SELECT k FROM jsonb_array_elements_text($1::jsonb) AS k "
                              " WHERE EXISTS (SELECT 1 FROM idemq.jobs t WHERE t.key = k)",
                              1, params, &e))) {
        st = call_failed(bt, &e, "claimed expired keys");
        goto out;
    }
    for (int row = 0; row < PQntuples(r); row++)
        for (int i = 0; i < n; i++)
            if (jobs[i].decode_err == IDEMQ_ERR_CELERY_EXPIRED && jobs[i].has_key &&
                strcmp(jobs[i].key, PQgetvalue(r, row, 0)) == 0) {
                log_job(LOG_LVL_INFO, jobs[i].key, jobs[i].tag, 0,
                        "celery task past its expires, but its key is claimed: not revoked, "
                        "taken as a copy of the claimed task");
                jobs[i].decode_err = IDEMQ_OK;
                jobs[i].celery_err = IDEMQ_OK;
                jobs[i].reason[0] = '\0';
            }
    goto out;
nomem:
    snprintf(bt->why, sizeof bt->why, "out of memory checking expired Celery tasks");
    st = STEP_SPLIT;
out:
    PQclear(r);
    free(text);
    json_decref(keys);
    return st;
}

/*
 * One transaction over jobs[0..n): claims and applies the decodable ones,
 * records failures, parks the rest, commits. Fills plans[0..n). On any
 * non-OK return the transaction is rolled back and nothing may be settled.
 */
static enum step run_txn_notices(struct batch *bt, struct job *jobs, int n, struct plan *plans);

static enum step run_txn(struct batch *bt, struct job *jobs, int n, struct plan *plans)
{
    enum step st;
    /* a server notice (RAISE NOTICE in the effect) names the job when the
     * transaction is about one */
    ledger_db_set_notice_key(n == 1 && jobs[0].has_key ? jobs[0].key : NULL);
    st = run_txn_notices(bt, jobs, n, plans);
    ledger_db_set_notice_key(NULL);
    return st;
}

static enum step run_txn_notices(struct batch *bt, struct job *jobs, int n, struct plan *plans)
{
    struct ledger_db_error e;
    int ngood = 0, nobs = 0;
    enum step st;

    for (int i = 0; i < n; i++) {
        settle_plan_clear(&plans[i]);
        if (is_observed(bt, &jobs[i])) {
            bt->obs_jobs[nobs++] = &jobs[i]; /* decoded or not: observe_txn below */
            continue;
        }
        if (jobs[i].decode_err == IDEMQ_OK && jobs[i].hold_ms > 0) {
            /* a Celery eta/countdown ahead waits on the broker (a
             * delay bucket, again until it is due), never unacknowledged
             * here; nothing is claimed for it yet */
            plans[i].how = SETTLE_DELAY;
            plans[i].delay_ms = topology_clamp_delay(bt->c, jobs[i].hold_ms);
            plans[i].attempt = 0;
            log_job(LOG_LVL_INFO, jobs[i].has_key ? jobs[i].key : NULL, jobs[i].tag, 0,
                    "celery eta in %ld ms: held on the broker for %ld ms", jobs[i].hold_ms,
                    plans[i].delay_ms);
            continue;
        }
    }
    if (ledger_txn_begin(bt->lt, &e))
        return call_failed(bt, &e, "BEGIN");
    if ((st = expired_but_claimed(bt, jobs, n)) != STEP_OK)
        goto rollback;
    for (int i = 0; i < n; i++)
        if (!is_observed(bt, &jobs[i]) && jobs[i].decode_err == IDEMQ_OK && jobs[i].hold_ms <= 0)
            bt->good[ngood++] = &jobs[i];
    if (ngood && ledger_txn_apply(bt->lt, bt->good, ngood, bt->res, &e)) {
        st = call_failed(bt, &e, "apply_batch");
        goto rollback;
    }
    for (int g = 0, i = 0; g < ngood; g++, i++) {
        struct ledger_result *r = &bt->res[g];
        struct plan *p;

        while (&jobs[i] != bt->good[g])
            i++;
        p = &plans[i];
        p->outcome = r->outcome;
        p->attempt = r->attempt;
        switch (r->outcome) {
        case LEDGER_APPLIED:
            if (jobs[i].has_order_key)
                bt->drain_hint = true; /* a deferred successor may be next */
            break;
        case LEDGER_DUPLICATE:
            if (strcmp(r->prior_state, "key_reuse") != 0)
                break;
            /* The same key with another body: no effect either way; the
             * ledger recorded it, the input says whether it also parks. */
            p->key_reuse = true;
            if (!bt->c->inputs[jobs[i].input].key_reuse_parks) {
                log_job(LOG_LVL_WARN, jobs[i].key, jobs[i].tag, r->attempt,
                        "key_reuse: the key is applied with another body (SHA-256 %s); "
                        "acknowledged without effect", jobs[i].sha256_hex);
                break;
            }
            /* parked below, with the messages that did not decode */
            jobs[i].decode_err = IDEMQ_ERR_KEY_REUSE;
            snprintf(jobs[i].reason, sizeof jobs[i].reason,
                     "the key is applied with another body (SHA-256 %.64s); on_key_reuse = park",
                     jobs[i].sha256_hex);
            break;
        case LEDGER_DEFERRED:
            if (jobs[i].deferred_id) {
                p->how = SETTLE_NONE; /* still not its turn */
                break;
            }
            if (ledger_lanes_defer(bt->db, bt->c, &jobs[i], r->message, &e)) {
                st = call_failed(bt, &e, "defer_job");
                goto rollback;
            }
            log_job(LOG_LVL_INFO, jobs[i].key, jobs[i].tag, r->attempt, "deferred: %s",
                    r->message);
            break; /* stored in the ledger: acknowledge */
        case LEDGER_HELD:
            p->how = jobs[i].deferred_id ? SETTLE_NONE : SETTLE_HOLD;
            p->delay_ms = 0;
            break;
        case LEDGER_CONFLICT: /* a provider job's key: park this copy, that job untouched */
            if (ledger_txn_park_message(bt->lt, &jobs[i], "key_conflict", r->message, true,
                                        &p->park, &e)) {
                st = call_failed(bt, &e, "park_message");
                goto rollback;
            }
            if (!p->park) {
                snprintf(bt->why, sizeof bt->why, "park_message returned no park facts");
                st = STEP_SPLIT;
                goto rollback;
            }
            p->how = SETTLE_DEAD;
            log_job(LOG_LVL_WARN, jobs[i].key, jobs[i].tag, r->attempt,
                    "parked key_conflict: %s", r->message);
            break;
        case LEDGER_EARLY:
            if (is_ordered(bt, &jobs[i])) { /* wait in place, never overtaken */
                p->how = jobs[i].deferred_id ? SETTLE_NONE : SETTLE_HOLD;
                p->delay_ms = r->delay_ms;
                break;
            }
            p->how = SETTLE_DELAY;
            p->delay_ms = topology_clamp_delay(bt->c, r->delay_ms);
            log_job(LOG_LVL_INFO, jobs[i].key, jobs[i].tag, r->attempt, "%s: waiting %ld ms more",
                    r->message[0] ? r->message : "back before its retry time", p->delay_ms);
            break;
        case LEDGER_REPARK:
            p->how = SETTLE_DEAD;
            p->park = json_incref(r->park);
            break;
        case LEDGER_ERROR:
            if ((st = plan_failure(bt, &jobs[i], r, p, IDEMQ_OK)) != STEP_OK)
                goto rollback;
            break;
        case LEDGER_OUTSIDE: /* past the dedup window: parked, never applied blindly */
            if ((st = plan_failure(bt, &jobs[i], r, p, IDEMQ_ERR_OUTSIDE_WINDOW)) != STEP_OK)
                goto rollback;
            break;
        }
    }
    for (int i = 0; i < n; i++) {
        if (!is_observed(bt, &jobs[i]) && jobs[i].decode_err != IDEMQ_OK &&
            (st = park_undecoded(bt, &jobs[i], &plans[i])))
            goto rollback;
    }
    /* after the apply call: it may have begun its transaction again */
    if (nobs && (st = observe_txn(bt, jobs, plans, nobs)) != STEP_OK)
        goto rollback;
    return commit(bt);
rollback:
    ledger_txn_rollback(bt->lt);
    return st;
}

/* Runs txn() up to CALL_RETRIES times while its whole call fails
 * transiently (not for timeouts), with a short serviced backoff. */
static enum step with_retries(struct batch *bt, enum step (*txn)(struct batch *, int), int arg)
{
    enum step st = STEP_RETRY;
    for (int tries = 0; tries < CALL_RETRIES && st == STEP_RETRY; tries++) {
        if (tries && bt->nap)
            bt->nap(bt->nap_ctx, backoff_delay_ms(tries, 20, 1000, BACKOFF_JITTER_FULL, &bt->rng));
        st = txn(bt, arg);
        if (st == STEP_RETRY && timed_out(bt))
            break;
    }
    return st;
}

static enum step whole_batch(struct batch *bt, int unused)
{
    (void)unused;
    return run_txn(bt, bt->jobs, bt->n, bt->plans);
}

static enum step one_job(struct batch *bt, int i)
{
    return run_txn(bt, &bt->jobs[i], 1, &bt->plans[i]);
}

/*
 * Rung 2: one transaction for a job whose own apply call failed as a whole
 * (e.g. a statement timeout, which PL/pgSQL cannot catch per job): claims
 * the key (inside the transaction, holding its row lock), then records the
 * failure like any effect error, so the attempt counts and the job retries
 * or parks by its class.
 */
static enum step failed_txn(struct batch *bt, int i)
{
    struct ledger_db_error e;
    struct job *j = &bt->jobs[i];
    struct plan *p = &bt->plans[i];
    struct ledger_result *r = &bt->res[0];
    enum step st;

    settle_plan_clear(p);
    ledger_db_set_notice_key(NULL); /* the claim and record functions: no effect runs */
    if (ledger_txn_begin(bt->lt, &e))
        return call_failed(bt, &e, "BEGIN");
    if (ledger_txn_claim_failed(bt->lt, j, r, &e)) {
        st = call_failed(bt, &e, "claim_failed");
        goto rollback;
    }
    p->outcome = r->outcome;
    p->attempt = r->attempt;
    if (r->outcome == LEDGER_ERROR) {
        snprintf(r->sqlstate, sizeof r->sqlstate, "%s", bt->failure.sqlstate);
        snprintf(r->message, sizeof r->message, "%s", bt->failure.message);
        if ((st = plan_failure(bt, j, r, p, IDEMQ_OK)) != STEP_OK)
            goto rollback;
    }
    return commit(bt);
rollback:
    ledger_txn_rollback(bt->lt);
    return st;
}

/*
 * Rung 3: the job failed in every mode, and even recording its failure
 * failed. Parks what can be stored: key (if any), the body prefix the
 * transport kept (its size and full SHA-256), no headers (they may be what
 * broke), the reason; its dead-letter copy is marked not redrivable when
 * the body is incomplete.
 */
static enum step unprocessable_txn(struct batch *bt, int i)
{
    struct ledger_db_error e;
    struct job *j = &bt->jobs[i];
    struct plan *p = &bt->plans[i];
    char reason[700];
    enum step st;

    settle_plan_clear(p);
    snprintf(reason, sizeof reason, "failed in every mode; last: %s", bt->why);
    if (ledger_txn_begin(bt->lt, &e))
        return call_failed(bt, &e, "BEGIN");
    if (ledger_txn_park_message(bt->lt, j, idemq_err_name(IDEMQ_ERR_UNPROCESSABLE), reason,
                                false, &p->park, &e)) {
        st = call_failed(bt, &e, "park_message (unprocessable)");
        goto rollback;
    }
    if (!p->park) {
        snprintf(bt->why, sizeof bt->why, "park_message returned no park facts");
        st = STEP_SPLIT;
        goto rollback;
    }
    if (is_ordered(bt, j) && j->has_key && ledger_lanes_parked(bt->db, bt->c, j, &e)) {
        st = call_failed(bt, &e, "lane_parked (unprocessable)");
        goto rollback;
    }
    p->how = j->wire_err == IDEMQ_ERR_UNDECODABLE ? SETTLE_REJECT : SETTLE_DEAD;
    p->attempt = 1;
    count_class(bt, CLASS_PERMANENT);
    log_job(LOG_LVL_ERROR, j->has_key ? j->key : NULL, j->tag, 1,
            "parked unprocessable: %s", reason);
    return commit(bt);
rollback:
    ledger_txn_rollback(bt->lt);
    return st;
}

static enum batch_step to_batch_step(enum step st)
{
    switch (st) {
    case STEP_OK: return BATCH_OK;
    case STEP_INFRA: return BATCH_INFRA;
    case STEP_FATAL: return BATCH_FATAL;
    case STEP_RETRY: /* contention that outlived its retries */
    case STEP_SPLIT: break;
    }
    return BATCH_REDELIVER;
}

/*
 * Isolates job i: its own transaction; then rung 2; then rung 3; then a
 * reject to the broker's dead-letter path. Returns STEP_OK with plans[i]
 * committed, or the step that stops the batch.
 */
static enum step isolate(struct batch *bt, int i)
{
    struct job *j = &bt->jobs[i];
    struct plan *p = &bt->plans[i];
    enum step st = with_retries(bt, one_job, i);

    if (st != STEP_RETRY && st != STEP_SPLIT)
        return st;
    if (is_observed(bt, j)) {
        /* Observe mode never parks: contention gives the copy back to the
         * broker; an observation that cannot be stored at all is logged
         * and acknowledged (it is a copy; the consumer beside idemq has
         * the original). */
        settle_plan_clear(p);
        if (st == STEP_RETRY) {
            p->how = SETTLE_RELEASE;
            return STEP_OK;
        }
        p->how = SETTLE_ACK;
        p->observed = OBSERVE_UNRECORDED;
        log_job(LOG_LVL_ERROR, j->has_key ? j->key : NULL, j->tag, 0,
                "observe: cannot record the observation (%s); acknowledged unrecorded", bt->why);
        return STEP_OK;
    }
    if (j->decode_err == IDEMQ_OK) { /* rung 2: record the failure as an attempt */
        bt->failure = bt->last_call;
        log_job(LOG_LVL_WARN, j->key, j->tag, 0, "call failed as a whole: %s %s",
                bt->failure.sqlstate, bt->failure.message);
        bt->ladder_depth = bt->ladder_depth > 2 ? bt->ladder_depth : 2;
        st = with_retries(bt, failed_txn, i);
        if (st == STEP_RETRY) { /* cannot even record it now: contention */
            log_job(LOG_LVL_WARN, j->key, j->tag, 0,
                    "cannot record the failure (%s): leaving it to the broker to redeliver",
                    bt->why);
            settle_plan_clear(p);
            p->how = SETTLE_RELEASE;
            return STEP_OK;
        }
        if (st != STEP_SPLIT)
            return st;
    }
    /* rung 3: park with what can be stored */
    bt->ladder_depth = bt->ladder_depth > 3 ? bt->ladder_depth : 3;
    st = with_retries(bt, unprocessable_txn, i);
    if (st == STEP_RETRY) { /* contention again: give it back */
        settle_plan_clear(p);
        p->how = SETTLE_RELEASE;
        return STEP_OK;
    }
    if (st != STEP_SPLIT)
        return st;
    /* rung 4: not even a park row: the broker dead-letters it */
    bt->ladder_depth = 4;
    settle_plan_clear(p);
    p->how = SETTLE_REJECT;
    p->attempt = 1;
    log_job(LOG_LVL_ERROR, j->has_key ? j->key : NULL, j->tag, 1,
            "cannot park in the ledger (%s): rejecting it to the queue's dead-letter exchange",
            bt->why);
    return STEP_OK;
}

enum batch_step batch_process(struct batch *bt, int *committed)
{
    enum step st;
    char released[sizeof bt->why] = "";

    *committed = 0;
    bt->ladder_depth = 0;
    bt->failed_tag = 0;
    ledger_outbox_rows_free(&bt->taken);
    bt->outbox_rest = false;
    for (int i = 0; i < bt->n; i++) {
        struct job *j = &bt->jobs[i];
        if (j->input < 0 || j->input >= bt->c->n_inputs) {
            /* the transport never hands these out; stay total anyway */
            j->input = 0;
            j->wire_err = IDEMQ_ERR_UNDECODABLE;
            snprintf(j->wire_reason, sizeof j->wire_reason, "delivery of an unknown consumer");
        }
        job_decode(j, &bt->c->inputs[j->input]);
    }
    st = with_retries(bt, whole_batch, 0);
    if (st == STEP_OK) {
        *committed = bt->n;
        return BATCH_OK;
    }
    if (st != STEP_RETRY && st != STEP_SPLIT)
        return to_batch_step(st);
    /* Isolate: each job in its own transaction, in order. A job behind a
     * held job of its own lane is held too (order within a lane). */
    log_warn("batch of %d failed as a whole (%s); isolating job by job", bt->n, bt->why);
    bt->ladder_depth = 1;
    for (int i = 0; i < bt->n; i++) {
        int lid = lane_id(&bt->jobs[i]);
        bool behind = false;
        for (int k = 0; k < i && lid; k++)
            behind = behind || bt->plans[k].held_lane == lid;
        if (behind) {
            settle_plan_clear(&bt->plans[i]);
            bt->plans[i].how = SETTLE_HOLD;
            bt->plans[i].held_lane = lid;
        } else if ((st = isolate(bt, i)) != STEP_OK) {
            if (st == STEP_RETRY)
                bt->failed_tag = bt->jobs[i].tag;
            return to_batch_step(st);
        } else if (bt->plans[i].how == SETTLE_HOLD || bt->plans[i].how == SETTLE_RELEASE) {
            bt->plans[i].held_lane = lid; /* later jobs of its lane wait behind it */
            if (bt->plans[i].how == SETTLE_RELEASE)
                snprintf(released, sizeof released, "%s", bt->why);
        }
        *committed = i + 1;
    }
    if (released[0]) {
        snprintf(bt->why, sizeof bt->why, "%s", released);
        return BATCH_REDELIVER;
    }
    return BATCH_OK;
}
