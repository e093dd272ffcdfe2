/*
 * worker: the receive -> decode -> transaction -> commit -> settle loop of
 * one thread, with the pause/reconnect paths for database, broker and
 * deploy failures. Ordered lanes (partitioned inputs) add: held deliveries
 * per lane (lane.c), in-place retries, and the drain of deferred jobs.
 */
#include "worker.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "backoff.h"
#include "broker.h"
#include "classify.h"
#include "effect_sql.h"
#include "job.h"
#include "lane.h"
#include "latency.h"
#include "ledger_db.h"
#include "ledger_lanes.h"
#include "ledger_migrate.h"
#include "ledger_retention.h"
#include "ledger_txn.h"
#include "log.h"
#include "republish.h"
#include "rate_gate.h"
#include "run_report.h"
#include "sig.h"
#include "topology.h"

#define POLL_MS 200       /* longest wait between stop/idle checks */
#define BATCH_RETRIES 3   /* whole-batch transient failures retried in place */
#define PAUSE_MAX_MS 30000
#define REPUBLISH_CONFIRM_MS 10000 /* well inside the heartbeat window */
#define DRAIN_MS 1000     /* ordered lanes: look for deferred jobs at least this often */
#define DRAIN_ROUNDS 8    /* drain transactions per loop iteration at most */
#define REPORT_MS 1000    /* ordered lanes: report old deferred jobs this often */
#define FILL_TICK_MS 1    /* sleep step while a batch fills */

/* What happens to a delivery once its transaction committed. */
enum settle {
    SETTLE_ACK = 0, /* applied, duplicate: acknowledge */
    SETTLE_DELAY,   /* retry later: publish to a delay bucket, then acknowledge */
    SETTLE_DEAD,    /* parked: publish to the dead-letter exchange, then acknowledge */
    SETTLE_HOLD,    /* ordered lane: keep unacknowledged in its lane, retry in place
                     * after delay_ms (0: as soon as the lane goes on) */
    SETTLE_NONE,    /* a job taken from idemq.deferred that stays there: nothing */
};

struct plan {
    enum settle how;
    long delay_ms;    /* SETTLE_DELAY: clamped delay */
    int attempt;      /* attempt number recorded */
    json_t *park;     /* SETTLE_DEAD: park facts (owned) */
    enum ledger_outcome outcome;
    int held_lane;    /* isolating: SETTLE_HOLD's lane_id (the job moved out), else 0 */
};

/* A lane's id for comparisons: > 0 for a delivery of an ordered input. */
static int lane_id(const struct job *j)
{
    return j->lane >= 0 && !j->deferred_id ? j->input * 100 + j->lane + 1 : 0;
}

/* What a transaction or a connect step came to. */
enum step {
    STEP_OK = 0,
    STEP_INFRA,  /* database gone: reconnect, nothing acknowledged */
    STEP_FATAL,  /* deploy/config problem: stop consuming until it is fixed */
    STEP_BROKER, /* broker gone: reconnect it */
    STEP_RETRY,  /* the whole call failed transiently: try the batch again */
    STEP_SPLIT,  /* the whole call failed permanently: isolate job by job */
};

enum crash_point { CRASH_NONE = 0, CRASH_BEFORE_COMMIT, CRASH_AFTER_COMMIT };

struct session {
    struct worker *w;
    const struct conf *c;
    PGconn *db;
    struct ledger_txn *lt;
    struct broker *b;
    struct job *jobs;
    struct job **good;
    struct ledger_result *res;
    struct plan *plans;
    long long *park_ids;
    int n;
    int batch_limit; /* batch_max, or less under consumer.max_rate */
    uint64_t rng;
    /* ordered lanes */
    struct lane_set *lanes;
    bool lanes_keyed;   /* some ordered input has an ordering key */
    bool drain_hint;    /* an ordered job was applied or parked: drain soon */
    long long last_drain, last_report;
    enum crash_point crash;
    struct ledger_retention *retention; /* worker 0 with ledger.maintenance: maintenance */
    char why[512]; /* reason of the last non-OK step */
    struct ledger_db_error last_call; /* the last whole-call failure */
};

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Sleeps up to ms, waking early on a stop request. */
static void nap(long ms)
{
    long long end = now_ms() + ms;
    while (!sig_stop_requested()) {
        long long left = end - now_ms();
        struct timespec ts;
        if (left <= 0)
            return;
        if (left > 100)
            left = 100;
        ts.tv_sec = 0;
        ts.tv_nsec = left * 1000000L;
        nanosleep(&ts, NULL);
    }
}

void worker_init(struct worker *w, int id, const struct conf *conf, int until_idle_ms)
{
    memset(w, 0, sizeof *w);
    w->id = id;
    w->conf = conf;
    w->until_idle_ms = until_idle_ms;
    atomic_store(&w->stats.head_age_ms, -1);
    pthread_mutex_init(&w->lock, NULL);
    snprintf(w->status, sizeof w->status, "starting");
}

void worker_destroy(struct worker *w)
{
    pthread_mutex_destroy(&w->lock);
}

void worker_status(struct worker *w, char *buf, size_t len)
{
    pthread_mutex_lock(&w->lock);
    snprintf(buf, len, "%s", w->status);
    pthread_mutex_unlock(&w->lock);
}

static void set_ready(struct worker *w, bool ready, const char *why)
{
    pthread_mutex_lock(&w->lock);
    snprintf(w->status, sizeof w->status, "%s", ready ? "ready" : why);
    pthread_mutex_unlock(&w->lock);
    atomic_store(&w->ready, ready ? 1 : 0);
}

static void drop_db(struct session *s)
{
    ledger_txn_free(s->lt);
    s->lt = NULL;
    if (s->db)
        PQfinish(s->db);
    s->db = NULL;
}

static void drop_broker(struct session *s)
{
    broker_close(s->b); /* unacknowledged deliveries go back to the queue */
    s->b = NULL;
    lane_clear(s->lanes); /* held deliveries too: their tags died with the channel */
}

/* True for a job of a partitioned (ordered) input. */
static bool is_ordered(const struct session *s, const struct job *j)
{
    return CONF_INPUT_ORDERED(&s->c->inputs[j->input]);
}

/* Connects the database session and checks schema and effects. */
static enum step connect_db(struct session *s)
{
    char app[96];
    struct ledger_db_error e;
    idemq_err_t err;

    if (s->db && PQstatus(s->db) == CONNECTION_OK && s->lt)
        return STEP_OK;
    drop_db(s);
    snprintf(app, sizeof app, "idemq worker %d", s->w->id);
    s->db = ledger_db_connect(s->c->dsn, app, s->c->statement_timeout_ms, s->why, sizeof s->why);
    if (!s->db)
        return STEP_INFRA;
    err = ledger_migrate_check(s->db, s->why, sizeof s->why);
    if (err)
        return err == IDEMQ_ERR_DB_CONN ? STEP_INFRA : STEP_FATAL;
    for (int i = 0; i < s->c->n_inputs; i++) {
        err = effect_sql_check(s->db, &s->c->inputs[i], s->why, sizeof s->why, &e);
        if (err == IDEMQ_ERR_DB_CONN) {
            snprintf(s->why, sizeof s->why, "%s", e.message);
            return STEP_INFRA;
        }
        if (err == IDEMQ_ERR_SQL) {
            snprintf(s->why, sizeof s->why, "effect check failed: %s %s", e.sqlstate, e.message);
            return STEP_FATAL;
        }
        if (err)
            return STEP_FATAL;
    }
    if (!(s->lt = ledger_txn_new(s->db, s->c, s->why, sizeof s->why)))
        return PQstatus(s->db) == CONNECTION_OK ? STEP_FATAL : STEP_INFRA;
    return STEP_OK;
}

static enum step connect_broker(struct session *s)
{
    char name[256];

    if (s->b)
        return STEP_OK;
    snprintf(name, sizeof name, "idemq %s worker %d", s->c->consumer_id, s->w->id);
    if (broker_open(s->c, name, true, &s->b, s->why, sizeof s->why))
        return STEP_BROKER;
    for (int i = 0; i < s->c->n_inputs; i++) {
        if (topology_verify(s->b, s->c, &s->c->inputs[i], s->why, sizeof s->why)) {
            drop_broker(s);
            return STEP_FATAL; /* not the jobs' fault: wait until it is fixed */
        }
    }
    if (broker_qos(s->b, s->c->prefetch))
        goto fail;
    for (int i = 0; i < s->c->n_inputs; i++) {
        const struct conf_input *in = &s->c->inputs[i];
        if (!CONF_INPUT_ORDERED(in)) {
            if (broker_consume(s->b, i, in, s->c->consumer_id))
                goto fail;
            continue;
        }
        for (int k = 0; k < in->partitions; k++) { /* single active consumer each */
            char q[TOPOLOGY_NAME_MAX];
            topology_partition_queue(in, k, q, sizeof q);
            if (broker_consume_lane(s->b, i, k, q, in, s->c->consumer_id))
                goto fail;
        }
    }
    return STEP_OK;
fail:
    snprintf(s->why, sizeof s->why, "%s", broker_error(s->b));
    drop_broker(s);
    return STEP_BROKER;
}

/*
 * Brings both connections up, waiting out failures with capped, jittered
 * backoff. While anything is wrong the worker holds no AMQP connection, so
 * it takes no deliveries and holds none unacknowledged.
 * Returns false only when a stop was requested meanwhile; *reconnected
 * tells whether a connection had to be (re)made.
 */
static bool ensure_connected(struct session *s, bool *reconnected)
{
    int failures = 0;
    *reconnected = !s->b || !s->db;
    for (;;) {
        enum step st = connect_db(s);
        if (st == STEP_OK)
            st = connect_broker(s);
        if (st == STEP_OK) {
            if (failures)
                log_info("worker %d: ready again after %d failed checks", s->w->id, failures);
            set_ready(s->w, true, NULL);
            return true;
        }
        drop_broker(s);
        failures++;
        set_ready(s->w, false, s->why);
        atomic_fetch_add(&s->w->stats.by_class[st == STEP_FATAL ? CLASS_FATAL : CLASS_INFRA], 1);
        if (st == STEP_FATAL)
            log_error("worker %d: NOT READY, not consuming: %s (checking again with backoff)",
                      s->w->id, s->why);
        else
            log_warn("worker %d: %s unavailable: %s (reconnecting with backoff)", s->w->id,
                     st == STEP_BROKER ? "broker" : "database", s->why);
        nap(backoff_delay_ms(failures, 250, PAUSE_MAX_MS, BACKOFF_JITTER_EQUAL, &s->rng));
        if (sig_stop_requested())
            return false;
    }
}

/* Classifies a whole-call failure into the step it leads to. */
static enum step call_failed(struct session *s, const struct ledger_db_error *e,
                             const char *what)
{
    enum classify_class cls = classify_sqlstate(e->sqlstate, e->conn_lost, &s->c->rules);
    snprintf(s->why, sizeof s->why, "%s: %s %s", what, e->sqlstate, e->message);
    s->last_call = *e;
    switch (cls) {
    case CLASS_INFRA: return STEP_INFRA;
    case CLASS_FATAL: return STEP_FATAL;
    case CLASS_TRANSIENT: return STEP_RETRY;
    case CLASS_PERMANENT: return STEP_SPLIT;
    case CLASS_NONE: break;
    }
    return STEP_SPLIT;
}

static void plan_clear(struct plan *p)
{
    json_decref(p->park);
    memset(p, 0, sizeof *p);
}

/*
 * Decides what a failed job's attempt leads to and records it (inside the
 * transaction): a durable retry schedule and a delay, or a park. forced:
 * IDEMQ_OK to classify r's SQLSTATE, or the code of a permanent failure the
 * ledger decided (outside_dedup_window).
 */
static enum step plan_failure(struct session *s, struct job *j, struct ledger_result *r,
                              struct plan *p, idemq_err_t forced)
{
    struct ledger_db_error e;
    enum classify_class cls = forced ? CLASS_PERMANENT
                                     : classify_sqlstate(r->sqlstate, false, &s->c->rules);
    int used = r->attempt - r->base; /* attempts of this generation's budget */
    idemq_err_t code = forced ? forced : IDEMQ_ERR_EFFECT;
    bool park;

    if (cls == CLASS_FATAL) {
        snprintf(s->why, sizeof s->why, "effect of %s failed with %s %s (%s)", j->key,
                 r->sqlstate, r->message, classify_name(cls));
        return STEP_FATAL;
    }
    if (cls == CLASS_INFRA || cls == CLASS_NONE)
        cls = CLASS_TRANSIENT;
    atomic_fetch_add(&s->w->stats.by_class[cls], 1);
    park = cls == CLASS_PERMANENT || used >= s->c->max_attempts;
    if (cls == CLASS_TRANSIENT && park)
        code = IDEMQ_ERR_RETRIES_EXHAUSTED;
    p->attempt = r->attempt;
    p->delay_ms = park ? 0
                       : topology_clamp_delay(s->c, backoff_delay_ms(used, s->c->base_delay_ms,
                                                                     s->c->max_delay_ms,
                                                                     s->c->jitter_mode, &s->rng));
    if (ledger_txn_record_failure(s->lt, j, r, classify_name(cls), idemq_err_name(code), park,
                                  p->delay_ms, &e))
        return call_failed(s, &e, "record_failure");
    if (park && !r->park) {
        snprintf(s->why, sizeof s->why, "record_failure returned no park facts for %s", j->key);
        return STEP_SPLIT;
    }
    if (park && is_ordered(s, j)) {
        if (ledger_lanes_parked(s->db, s->c, j, &e))
            return call_failed(s, &e, "lane_parked");
        s->drain_hint = true;
    }
    log_job(park ? LOG_LVL_WARN : LOG_LVL_INFO, j->key, j->tag, r->attempt,
            "%s error %s: %s -> %s (%ld ms)%s", classify_name(cls), r->sqlstate, r->message,
            park ? "parked" : "retry in", p->delay_ms,
            !park && is_ordered(s, j) ? (j->deferred_id ? ", from the ledger" : ", in place")
                                      : "");
    p->how = park ? SETTLE_DEAD : SETTLE_DELAY;
    if (!park && is_ordered(s, j)) /* retried in place: later jobs must not overtake it */
        p->how = j->deferred_id ? SETTLE_NONE : SETTLE_HOLD;
    if (park)
        p->park = json_incref(r->park);
    return STEP_OK;
}

/*
 * One transaction over jobs[0..n): claims and applies the decodable ones,
 * records failures, parks the rest, commits. Fills plans[0..n). On any
 * non-OK return the transaction is rolled back and nothing may be settled.
 */
static enum step run_txn(struct session *s, struct job *jobs, int n, struct plan *plans)
{
    struct ledger_db_error e;
    int ngood = 0;
    enum step st;

    for (int i = 0; i < n; i++) {
        plan_clear(&plans[i]);
        if (jobs[i].decode_err == IDEMQ_OK)
            s->good[ngood++] = &jobs[i];
    }
    if (ledger_txn_begin(s->lt, &e))
        return call_failed(s, &e, "BEGIN");
    if (ngood && ledger_txn_apply(s->lt, s->good, ngood, s->res, &e)) {
        st = call_failed(s, &e, "apply_batch");
        goto rollback;
    }
    for (int g = 0, i = 0; g < ngood; g++, i++) {
        struct ledger_result *r = &s->res[g];
        struct plan *p;

        while (&jobs[i] != s->good[g])
            i++;
        p = &plans[i];
        p->outcome = r->outcome;
        p->attempt = r->attempt;
        switch (r->outcome) {
        case LEDGER_APPLIED:
            if (jobs[i].has_order_key)
                s->drain_hint = true; /* a deferred successor may be next */
            break;
        case LEDGER_DUPLICATE:
            break;
        case LEDGER_DEFERRED:
            if (jobs[i].deferred_id) {
                p->how = SETTLE_NONE; /* still not its turn */
                break;
            }
            if (ledger_lanes_defer(s->db, s->c, &jobs[i], r->message, &e)) {
                st = call_failed(s, &e, "defer_job");
                goto rollback;
            }
            log_job(LOG_LVL_INFO, jobs[i].key, jobs[i].tag, r->attempt, "deferred: %s",
                    r->message);
            break; /* stored in the ledger: acknowledge */
        case LEDGER_HELD:
            p->how = jobs[i].deferred_id ? SETTLE_NONE : SETTLE_HOLD;
            p->delay_ms = 0;
            break;
        case LEDGER_EARLY:
            if (is_ordered(s, &jobs[i])) { /* wait in place, never overtaken */
                p->how = jobs[i].deferred_id ? SETTLE_NONE : SETTLE_HOLD;
                p->delay_ms = r->delay_ms;
                break;
            }
            p->how = SETTLE_DELAY;
            p->delay_ms = topology_clamp_delay(s->c, r->delay_ms);
            log_job(LOG_LVL_INFO, jobs[i].key, jobs[i].tag, r->attempt,
                    "back before its retry time: waiting %ld ms more", p->delay_ms);
            break;
        case LEDGER_REPARK:
            p->how = SETTLE_DEAD;
            p->park = json_incref(r->park);
            break;
        case LEDGER_ERROR:
            if ((st = plan_failure(s, &jobs[i], r, p, IDEMQ_OK)) != STEP_OK)
                goto rollback;
            break;
        case LEDGER_OUTSIDE: /* past the dedup window: parked, never applied blindly */
            if ((st = plan_failure(s, &jobs[i], r, p, IDEMQ_ERR_OUTSIDE_WINDOW)) != STEP_OK)
                goto rollback;
            break;
        }
    }
    for (int i = 0; i < n; i++) {
        if (jobs[i].decode_err == IDEMQ_OK)
            continue;
        if (ledger_txn_park_message(s->lt, &jobs[i], &plans[i].park, &e)) {
            st = call_failed(s, &e, "park_message");
            goto rollback;
        }
        if (!plans[i].park) {
            snprintf(s->why, sizeof s->why, "park_message returned no park facts");
            st = STEP_SPLIT;
            goto rollback;
        }
        if (is_ordered(s, &jobs[i]) && jobs[i].has_key &&
            ledger_lanes_parked(s->db, s->c, &jobs[i], &e)) { /* drops a deferred copy */
            st = call_failed(s, &e, "lane_parked");
            goto rollback;
        }
        plans[i].how = SETTLE_DEAD;
        plans[i].attempt = 1;
        log_job(LOG_LVL_WARN, jobs[i].has_key ? jobs[i].key : NULL, jobs[i].tag, 1,
                "parked %s: %s", idemq_err_name(jobs[i].decode_err), jobs[i].reason);
    }
#ifdef IDEMQ_TEST_HOOKS
    if (s->crash == CRASH_BEFORE_COMMIT) {
        log_warn("test hook: SIGKILL before commit");
        kill(getpid(), SIGKILL);
    }
#endif
    if (ledger_txn_commit(s->lt, &e))
        return call_failed(s, &e, "COMMIT");
    return STEP_OK;
rollback:
    ledger_txn_rollback(s->lt);
    return st;
}

/*
 * One transaction for a job whose own apply call failed as a whole (e.g. a
 * statement timeout, which PL/pgSQL cannot catch per job): claims the key,
 * then records the failure like any effect error, so the attempt counts and
 * the job retries or parks by its class.
 */
static enum step run_failed_txn(struct session *s, struct job *j, struct plan *p,
                                const struct ledger_db_error *failure)
{
    struct ledger_db_error e;
    struct ledger_result *r = &s->res[0];
    enum step st;

    plan_clear(p);
    if (ledger_txn_begin(s->lt, &e))
        return call_failed(s, &e, "BEGIN");
    if (ledger_txn_claim_failed(s->lt, j, r, &e)) {
        st = call_failed(s, &e, "claim_failed");
        goto rollback;
    }
    p->outcome = r->outcome;
    p->attempt = r->attempt;
    if (r->outcome == LEDGER_ERROR) {
        snprintf(r->sqlstate, sizeof r->sqlstate, "%s", failure->sqlstate);
        snprintf(r->message, sizeof r->message, "%s", failure->message);
        if ((st = plan_failure(s, j, r, p, IDEMQ_OK)) != STEP_OK)
            goto rollback;
    }
    if (ledger_txn_commit(s->lt, &e))
        return call_failed(s, &e, "COMMIT");
    return STEP_OK;
rollback:
    ledger_txn_rollback(s->lt);
    return st;
}

/* Waits ms while keeping the broker connection serviced (heartbeats). */
static void serviced_nap(struct session *s, long ms)
{
    if (!s->b || broker_service(s->b, (int)ms) != IDEMQ_OK)
        nap(ms);
}

static void count(struct session *s, const struct plan *plans, int n)
{
    struct worker_stats *ws = &s->w->stats;
    for (int i = 0; i < n; i++) {
        switch (plans[i].how) {
        case SETTLE_DELAY: atomic_fetch_add(&ws->retried, 1); break;
        case SETTLE_DEAD: atomic_fetch_add(&ws->parked, 1); break;
        case SETTLE_HOLD:
        case SETTLE_NONE:
            if (plans[i].outcome == LEDGER_ERROR)
                atomic_fetch_add(&ws->retried, 1);
            break;
        case SETTLE_ACK:
            if (plans[i].outcome == LEDGER_APPLIED)
                atomic_fetch_add(&ws->applied, 1);
            else
                atomic_fetch_add(&ws->duplicates, 1);
            break;
        }
    }
}

/*
 * Settles a committed transaction's deliveries: publishes the retries and
 * parks (mandatory, confirmed), and only when every confirm arrived
 * acknowledges the lot with one multiple ack. If a republish is not
 * confirmed, only the deliveries that needed none are acknowledged; the
 * others stay unacknowledged and return to the queue when the connection is
 * dropped (the ledger makes the redelivery harmless).
 */
static enum step settle_batch(struct session *s, struct job *jobs, int n, struct plan *plans)
{
    uint64_t top = 0;
    int republished = 0, parks = 0;
    struct ledger_db_error e;

#ifdef IDEMQ_TEST_HOOKS
    if (s->crash == CRASH_AFTER_COMMIT) {
        log_warn("test hook: SIGKILL after commit, before ack");
        kill(getpid(), SIGKILL);
    }
#endif
    /* Ordered lanes first: held deliveries go back to their lane, in order,
     * unacknowledged (before the ack below can cover them). */
    for (int i = 0; i < n; i++) {
        if (plans[i].how != SETTLE_HOLD)
            continue;
        if (lane_putback(s->lanes, &jobs[i], now_ms() + plans[i].delay_ms)) {
            snprintf(s->why, sizeof s->why, "out of memory holding a lane");
            return STEP_BROKER;
        }
    }
    for (int i = 0; i < n; i++) {
        const struct conf_input *in = &s->c->inputs[jobs[i].input];
        idemq_err_t err = IDEMQ_OK;
        if (plans[i].how == SETTLE_HOLD || plans[i].how == SETTLE_NONE)
            continue;
        if (jobs[i].tag > top)
            top = jobs[i].tag;
        if (plans[i].how == SETTLE_DELAY)
            err = republish_delay(s->b, in, &jobs[i], plans[i].delay_ms, plans[i].attempt);
        else if (plans[i].how == SETTLE_DEAD)
            err = republish_dead(s->b, in, &jobs[i], plans[i].park);
        else
            continue;
        republished++;
        if (err)
            goto unconfirmed;
    }
    if (republished && broker_wait_confirms(s->b, REPUBLISH_CONFIRM_MS))
        goto unconfirmed;
    if (top && lane_min_tag(s->lanes) && lane_min_tag(s->lanes) < top) {
        /* a lane holds an earlier delivery: a multiple ack would cover it */
        for (int i = 0; i < n; i++) {
            if (!jobs[i].tag || plans[i].how == SETTLE_HOLD || plans[i].how == SETTLE_NONE)
                continue;
            if (broker_ack(s->b, jobs[i].tag, false)) {
                snprintf(s->why, sizeof s->why, "ack after commit: %s", broker_error(s->b));
                return STEP_BROKER;
            }
        }
    } else if (top && broker_ack(s->b, top, true)) {
        snprintf(s->why, sizeof s->why, "ack after commit: %s", broker_error(s->b));
        return STEP_BROKER;
    }
    atomic_fetch_add(&s->w->stats.settled, n);
    for (int i = 0; i < n; i++)
        if (plans[i].how == SETTLE_DEAD && plans[i].park)
            s->park_ids[parks++] =
                (long long)json_integer_value(json_object_get(plans[i].park, "park_id"));
    if (parks && ledger_txn_mark_dead_lettered(s->lt, s->park_ids, parks, &e))
        log_warn("worker %d: dead-letter publish confirmed but not noted in the ledger (%s); "
                 "a later duplicate would publish it again", s->w->id, e.message);
    return STEP_OK;
unconfirmed:
    snprintf(s->why, sizeof s->why, "republish not confirmed (%s): originals left "
             "unacknowledged for redelivery", broker_error(s->b));
    for (int i = 0; i < n; i++)
        if (plans[i].how == SETTLE_ACK && jobs[i].tag && broker_ack(s->b, jobs[i].tag, false))
            break;
    return STEP_BROKER;
}

/* Decodes and processes the collected batch s->jobs[0..s->n). */
static enum step process_batch(struct session *s)
{
    enum step st = STEP_RETRY;

    lane_settle_begin(s->lanes);
    for (int i = 0; i < s->n; i++) {
        struct job *j = &s->jobs[i];
        if (j->input < 0 || j->input >= s->c->n_inputs)
            IDEMQ_PANIC("delivery tag %llu from an unknown consumer", (unsigned long long)j->tag);
        job_decode(j, &s->c->inputs[j->input]);
    }
    for (int tries = 0; tries < BATCH_RETRIES && st == STEP_RETRY; tries++) {
        if (tries)
            serviced_nap(s, backoff_delay_ms(tries, 20, 1000, BACKOFF_JITTER_FULL, &s->rng));
        st = run_txn(s, s->jobs, s->n, s->plans);
        if (st == STEP_RETRY && strcmp(s->last_call.sqlstate, "57014") == 0)
            break; /* a timeout will not pass by retrying the whole batch */
    }
    if (st == STEP_OK) {
        atomic_fetch_add(&s->w->stats.batches, 1);
        count(s, s->plans, s->n);
        return settle_batch(s, s->jobs, s->n, s->plans);
    }
    if (st != STEP_RETRY && st != STEP_SPLIT)
        return st;
    /* Isolate: each job in its own transaction; one whose call still fails
     * as a whole has that failure recorded as its attempt (retry or park by
     * class). Settling one by one keeps earlier deliveries settled first. */
    log_warn("worker %d: batch of %d failed as a whole (%s); isolating job by job", s->w->id,
             s->n, s->why);
    for (int i = 0; i < s->n; i++) {
        struct job *j = &s->jobs[i];
        struct plan *p = &s->plans[i];
        int lid = lane_id(j);
        bool behind = false; /* an earlier job of its lane was held here */
        for (int k = 0; k < i && lid; k++)
            behind = behind || s->plans[k].held_lane == lid;
        if (behind) {
            plan_clear(p);
            p->how = SETTLE_HOLD;
            p->held_lane = lid;
            if ((st = settle_batch(s, j, 1, p)) != STEP_OK)
                return st;
            continue;
        }
        st = STEP_RETRY;
        for (int tries = 0; tries < BATCH_RETRIES && st == STEP_RETRY; tries++) {
            if (tries)
                serviced_nap(s, backoff_delay_ms(tries, 20, 1000, BACKOFF_JITTER_FULL, &s->rng));
            st = run_txn(s, j, 1, p);
            if (st == STEP_RETRY && strcmp(s->last_call.sqlstate, "57014") == 0)
                break;
        }
        if ((st == STEP_RETRY || st == STEP_SPLIT) && j->decode_err == IDEMQ_OK) {
            struct ledger_db_error failure = s->last_call;
            log_job(LOG_LVL_WARN, j->key, j->tag, 0, "call failed as a whole: %s %s",
                    failure.sqlstate, failure.message);
            st = run_failed_txn(s, j, p, &failure);
        }
        if (st != STEP_OK)
            return st;
        atomic_fetch_add(&s->w->stats.batches, 1);
        count(s, p, 1);
        if (p->how == SETTLE_HOLD) /* remember its lane (the job moves out) */
            p->held_lane = lid;
        if ((st = settle_batch(s, j, 1, p)) != STEP_OK)
            return st;
    }
    return STEP_OK;
}

/* Deliveries come from the head of their queue: the age of the one just
 * taken (by its timestamp property, in seconds) is the oldest-ready age. */
static void note_age(struct worker *w, const struct job *j)
{
    json_t *ts = json_object_get(j->props, "timestamp");
    struct timespec now;
    if (!json_is_integer(ts))
        return;
    clock_gettime(CLOCK_REALTIME, &now);
    atomic_store(&w->stats.head_age_ms,
                 (long)((now.tv_sec - (time_t)json_integer_value(ts)) * 1000L));
}

/* Collects up to batch_max deliveries: waits up to wait_ms for the first,
 * then up to batch_wait_ms for the rest. */
static enum step collect(struct session *s, int wait_ms)
{
    /* s->n may start above 0: held deliveries of lanes whose wait is over */
    long long fill_deadline = s->n ? now_ms() + s->c->batch_wait_ms : 0;
    long long first_deadline = now_ms() + wait_ms;
    while (s->n < s->batch_limit) {
        /* After the first delivery, take what has arrived and sleep in
         * FILL_TICK_MS steps until the deadline: one wake-up per tick, not
         * one per delivery. */
        long long first_left = first_deadline - now_ms();
        idemq_err_t err = broker_next(s->b, &s->jobs[s->n],
                                      s->n == 0 ? (int)(first_left > 0 ? first_left : 0) : 0);
        if (err == IDEMQ_ERR_TIMEOUT) {
            long long left = s->n ? fill_deadline - now_ms() : 0;
            struct timespec ts = {0, 0};
            if (left <= 0)
                break;
            ts.tv_nsec = (left < FILL_TICK_MS ? left : FILL_TICK_MS) * 1000000L;
            nanosleep(&ts, NULL);
            continue;
        }
        if (err) {
            snprintf(s->why, sizeof s->why, "%s", broker_error(s->b));
            return STEP_BROKER;
        }
        atomic_fetch_add(&s->w->stats.received, 1);
        s->jobs[s->n].received_ns = now_ns();
        if (lane_blocked(s->lanes, &s->jobs[s->n], now_ms())) {
            /* its lane waits: keep it behind the lane's earlier deliveries */
            if (lane_append(s->lanes, &s->jobs[s->n])) {
                snprintf(s->why, sizeof s->why, "out of memory holding a lane");
                return STEP_BROKER;
            }
            continue;
        }
        if (s->n == 0)
            fill_deadline = now_ms() + s->c->batch_wait_ms;
        note_age(s->w, &s->jobs[s->n]);
        s->n++;
    }
    return STEP_OK;
}

/*
 * Ordered lanes, between batches: applies deferred jobs whose predecessor
 * was applied (taken from the ledger, applied like deliveries, in order),
 * and reports deferred jobs that wait too long. Runs after a batch applied
 * or parked an ordered job, and every DRAIN_MS anyway (another replica may
 * have applied the predecessor).
 */
static enum step lanes_housekeeping(struct session *s)
{
    struct ledger_db_error e;
    long long now = now_ms();
    enum step st = STEP_OK;
    int reported;

    if (!s->lanes_keyed)
        return STEP_OK;
    if (s->drain_hint || now - s->last_drain >= DRAIN_MS) {
        s->last_drain = now;
        for (int round = 0; round < DRAIN_ROUNDS && !sig_stop_requested(); round++) {
            s->drain_hint = false;
            if (ledger_lanes_take(s->db, s->c, s->jobs, s->c->batch_max, &s->n, &e)) {
                st = call_failed(s, &e, "take_deferred");
                break;
            }
            if (s->n == 0)
                break;
            if ((st = process_batch(s)) != STEP_OK || !s->drain_hint)
                break;
        }
        s->n = 0;
    }
    if (st == STEP_OK && now - s->last_report >= REPORT_MS) {
        s->last_report = now;
        if (ledger_lanes_report(s->db, s->c, &reported, &e))
            st = call_failed(s, &e, "report_deferred");
    }
    if (st == STEP_RETRY || st == STEP_SPLIT) { /* try again on the next round */
        log_warn("worker %d: deferred jobs: %s", s->w->id, s->why);
        st = STEP_OK;
    }
    return st;
}

/* ---- throughput (issue 5): shared rate gate, delivery -> ack latency ---- */

/* Largest batch under consumer.max_rate: about 50 ms worth of jobs, so the
 * wait for one batch's tokens stays short (and heartbeats stay serviced). */
static int batch_limit(const struct conf *c)
{
    int lim = c->max_rate > 0 ? c->max_rate / 20 : c->batch_max;
    return lim < 1 ? 1 : lim > c->batch_max ? c->batch_max : lim;
}

/* Waits until the shared gate grants the collected batch (wakes on stop:
 * the batch in flight is then still processed, as a drain). */
static void gate_wait(struct session *s)
{
    int64_t wait_ns;
    if (!s->w->gate || s->n == 0)
        return;
    wait_ns = rate_gate_reserve(s->w->gate, s->n, now_ns());
    if (wait_ns > 0)
        nap((long)((wait_ns + 999999) / 1000000));
}

/* Records delivery -> settlement (the ack, or the requeue of a transient
 * failure) of a batch s->jobs[0..n) that process_batch settled. */
static void note_acked(struct session *s)
{
    long long now = now_ns();
    for (int i = 0; i < s->n; i++)
        if (s->jobs[i].received_ns) { /* 0: held in its lane (moved out), not settled yet */
            latency_record(&s->w->latency, (uint64_t)(now - s->jobs[i].received_ns) / 1000u);
            latency_record(&s->w->interval, (uint64_t)(now - s->jobs[i].received_ns) / 1000u);
        }
    if (s->jobs[0].received_ns &&
        (!s->w->first_delivery_ns || s->jobs[0].received_ns < s->w->first_delivery_ns))
        s->w->first_delivery_ns = s->jobs[0].received_ns;
    s->w->last_ack_ns = now;
}

static bool session_alloc(struct session *s)
{
    int m = s->c->batch_max;
    s->jobs = calloc((size_t)m, sizeof *s->jobs);
    s->good = calloc((size_t)m, sizeof *s->good);
    s->res = calloc((size_t)m, sizeof *s->res);
    s->plans = calloc((size_t)m, sizeof *s->plans);
    s->park_ids = calloc((size_t)m, sizeof *s->park_ids);
    if (!s->jobs || !s->good || !s->res || !s->plans || !s->park_ids)
        return false;
    for (int i = 0; i < m; i++)
        job_init(&s->jobs[i]);
    if (!(s->lanes = lane_set_new(s->c)))
        return false;
    s->lanes_keyed = ledger_lanes_any(s->c);
    /* One maintenance caller per process, on its own session (issue 10). */
    if (s->w->id == 0 && s->c->maintenance && !(s->retention = ledger_retention_new(
                                                    s->c, s->c->consumer_id)))
        return false;
    return true;
}

static void session_free(struct session *s)
{
    drop_broker(s);
    drop_db(s);
    for (int i = 0; s->jobs && i < s->c->batch_max; i++) {
        job_destroy(&s->jobs[i]);
        ledger_txn_result_clear(&s->res[i]);
        plan_clear(&s->plans[i]);
    }
    free(s->jobs);
    free(s->good);
    free(s->res);
    free(s->plans);
    free(s->park_ids);
    lane_set_free(s->lanes);
    ledger_retention_free(s->retention);
}

idemq_err_t worker_run(struct worker *w)
{
    struct session s;
    long long last_delivery = now_ms();
    const char *crash = getenv("IDEMQ_TEST_CRASH");

    memset(&s, 0, sizeof s);
    s.w = w;
    s.c = w->conf;
    s.rng = (uint64_t)now_ms() * 2654435761u + (uint64_t)w->id + 1;
    s.batch_limit = batch_limit(s.c);
    if (crash && strcmp(crash, "after_commit") == 0)
        s.crash = CRASH_AFTER_COMMIT;
    else if (crash && strcmp(crash, "before_commit") == 0)
        s.crash = CRASH_BEFORE_COMMIT;
    w->result = IDEMQ_OK;
    if (!session_alloc(&s)) {
        snprintf(w->error, sizeof w->error, "out of memory allocating a batch of %d",
                 s.c->batch_max);
        w->result = IDEMQ_ERR_NOMEM;
        goto out;
    }
    while (!sig_stop_requested()) {
        enum step st;
        bool reconnected;
        if (!ensure_connected(&s, &reconnected))
            break;
        if (reconnected)
            last_delivery = now_ms(); /* an outage does not count as idle time */
        if (w->until_idle_ms > 0 && now_ms() - last_delivery >= w->until_idle_ms &&
            !lane_held(s.lanes)) {
            struct ledger_db_error e;
            bool pending = false;
            if (s.lanes_keyed && ledger_lanes_retry_pending(s.db, s.c, &pending, &e) == IDEMQ_OK &&
                pending) {
                last_delivery = now_ms(); /* a deferred job retries from the ledger: not idle */
            } else {
                log_info("worker %d: idle for %d ms, finishing", w->id, w->until_idle_ms);
                break;
            }
        }
        {
            long long now = now_ms(), ready;
            int wait = POLL_MS;
            s.n = lane_take_ready(s.lanes, s.jobs, s.batch_limit, now);
            ready = lane_next_ready(s.lanes);
            if (ready && ready - now < wait)
                wait = ready > now ? (int)(ready - now) : 0;
            st = collect(&s, wait);
        }
        if (st == STEP_OK && s.n > 0) {
            last_delivery = now_ms();
            gate_wait(&s);
            st = process_batch(&s);
            if (st == STEP_OK)
                note_acked(&s);
        }
        if (st == STEP_OK)
            st = lanes_housekeeping(&s);
        if (st == STEP_OK && s.retention) /* never waits: see ledger_retention.h */
            ledger_retention_tick(s.retention, now_ms());
        if (s.c->perf_interval_s > 0)
            run_report_interval(w, now_ns(), s.c->perf_interval_s);
        switch (st) {
        case STEP_OK:
            break;
        case STEP_BROKER:
            log_warn("worker %d: broker failure: %s; reconnecting (unacked deliveries return "
                     "to the queue)", w->id, s.why);
            drop_broker(&s);
            break;
        case STEP_INFRA:
            set_ready(w, false, s.why);
            atomic_fetch_add(&w->stats.by_class[CLASS_INFRA], 1);
            log_warn("worker %d: database failure: %s; nothing acknowledged, reconnecting",
                     w->id, s.why);
            drop_broker(&s);
            drop_db(&s);
            break;
        case STEP_FATAL:
            set_ready(w, false, s.why);
            atomic_fetch_add(&w->stats.by_class[CLASS_FATAL], 1);
            log_error("worker %d: %s: deploy or configuration problem, no job parked; "
                      "stopping consumption until it is fixed", w->id, s.why);
            drop_broker(&s);
            drop_db(&s);
            break;
        case STEP_RETRY:
        case STEP_SPLIT:
            IDEMQ_PANIC("unhandled step %d", (int)st);
        }
    }
out:
    set_ready(w, false, "stopped");
    session_free(&s);
    return w->result;
}

void *worker_thread(void *arg)
{
    struct worker *w = arg;
    worker_run(w);
    return NULL;
}
