/*
 * worker: the receive -> decode -> transaction -> commit -> settle loop of
 * one thread, with the pause/reconnect paths for database, broker and
 * deploy failures.
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
#include "latency.h"
#include "ledger_db.h"
#include "ledger_migrate.h"
#include "ledger_txn.h"
#include "log.h"
#include "rate_gate.h"
#include "sig.h"

#define POLL_MS 200       /* longest wait between stop/idle checks */
#define BATCH_RETRIES 3   /* whole-batch transient failures retried in place */
#define PAUSE_MAX_MS 30000
#define FILL_TICK_MS 1    /* sleep step while a batch fills */

enum settle { SETTLE_ACK = 0, SETTLE_REQUEUE };

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
    enum settle *settle;
    int n;
    int batch_limit; /* batch_max, or less under consumer.max_rate */
    uint64_t rng;
    enum crash_point crash;
    char why[512]; /* reason of the last non-OK step */
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
    if (broker_qos(s->b, s->c->prefetch))
        goto fail;
    for (int i = 0; i < s->c->n_inputs; i++)
        if (broker_consume(s->b, i, &s->c->inputs[i], s->c->consumer_id))
            goto fail;
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
            return true;
        }
        drop_broker(s);
        failures++;
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
    enum classify_class cls = classify_sqlstate(e->sqlstate, e->conn_lost, NULL);
    snprintf(s->why, sizeof s->why, "%s: %s %s", what, e->sqlstate, e->message);
    switch (cls) {
    case CLASS_INFRA: return STEP_INFRA;
    case CLASS_FATAL: return STEP_FATAL;
    case CLASS_TRANSIENT: return STEP_RETRY;
    case CLASS_PERMANENT: return STEP_SPLIT;
    case CLASS_NONE: break;
    }
    return STEP_SPLIT;
}

/*
 * One transaction over jobs[0..n): claims and applies the decodable ones,
 * records failures, parks the rest, commits. Fills s->settle. On any
 * non-OK return the transaction is rolled back and nothing may be settled.
 */
static enum step run_txn(struct session *s, struct job *jobs, int n, enum settle *settle)
{
    struct ledger_db_error e;
    int ngood = 0;
    enum step st;

    for (int i = 0; i < n; i++) {
        settle[i] = SETTLE_ACK;
        if (jobs[i].decode_err == IDEMQ_OK)
            s->good[ngood++] = &jobs[i];
    }
    if (ledger_txn_begin(s->lt, &e))
        return call_failed(s, &e, "BEGIN");
    if (ngood && ledger_txn_apply(s->lt, s->good, ngood, s->res, &e)) {
        st = call_failed(s, &e, "apply_batch");
        goto rollback;
    }
    for (int g = 0, i = 0; g < ngood; g++) {
        struct job *j = s->good[g];
        struct ledger_result *r = &s->res[g];
        enum classify_class cls;
        bool park;

        while (&jobs[i] != j)
            i++;
        if (r->outcome != LEDGER_ERROR)
            continue;
        cls = classify_sqlstate(r->sqlstate, false, NULL);
        if (cls == CLASS_FATAL) {
            snprintf(s->why, sizeof s->why, "effect of %s failed with %s %s (%s)", j->key,
                     r->sqlstate, r->message, classify_name(cls));
            st = STEP_FATAL;
            goto rollback;
        }
        if (cls == CLASS_INFRA || cls == CLASS_NONE)
            cls = CLASS_TRANSIENT;
        park = cls == CLASS_PERMANENT || r->attempt >= s->c->max_attempts;
        if (ledger_txn_record_failure(s->lt, j, r, classify_name(cls),
                                      idemq_err_name(IDEMQ_ERR_EFFECT), park, &e)) {
            st = call_failed(s, &e, "record_failure");
            goto rollback;
        }
        log_job(park ? LOG_LVL_WARN : LOG_LVL_INFO, j->key, j->tag, r->attempt,
                "%s error %s: %s -> %s", classify_name(cls), r->sqlstate, r->message,
                park ? "parked" : "retry");
        settle[i] = park ? SETTLE_ACK : SETTLE_REQUEUE;
    }
    for (int i = 0; i < n; i++) {
        if (jobs[i].decode_err == IDEMQ_OK)
            continue;
        if (ledger_txn_park_message(s->lt, &jobs[i], &e)) {
            st = call_failed(s, &e, "park_message");
            goto rollback;
        }
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

static void count(struct session *s, struct job *jobs, int n, const enum settle *settle)
{
    struct worker_stats *ws = &s->w->stats;
    for (int i = 0, g = 0; i < n; i++) {
        if (jobs[i].decode_err != IDEMQ_OK) {
            atomic_fetch_add(&ws->parked, 1);
            continue;
        }
        if (settle[i] == SETTLE_REQUEUE)
            atomic_fetch_add(&ws->retried, 1);
        else if (s->res[g].outcome == LEDGER_APPLIED)
            atomic_fetch_add(&ws->applied, 1);
        else if (s->res[g].outcome == LEDGER_DUPLICATE)
            atomic_fetch_add(&ws->duplicates, 1);
        else
            atomic_fetch_add(&ws->parked, 1);
        g++;
    }
}

/* Acknowledges a committed transaction's deliveries: requeues first, then
 * one multiple ack up to the highest tag to acknowledge. */
static enum step settle_batch(struct session *s, struct job *jobs, int n, const enum settle *st)
{
    uint64_t top = 0;
#ifdef IDEMQ_TEST_HOOKS
    if (s->crash == CRASH_AFTER_COMMIT) {
        log_warn("test hook: SIGKILL after commit, before ack");
        kill(getpid(), SIGKILL);
    }
#endif
    for (int i = 0; i < n; i++) {
        if (st[i] == SETTLE_REQUEUE) {
            if (broker_nack(s->b, jobs[i].tag, true))
                goto fail;
        } else if (jobs[i].tag > top) {
            top = jobs[i].tag;
        }
    }
    if (top && broker_ack(s->b, top, true))
        goto fail;
    return STEP_OK;
fail:
    snprintf(s->why, sizeof s->why, "settling after commit: %s", broker_error(s->b));
    return STEP_BROKER;
}

/* Decodes and processes the collected batch s->jobs[0..s->n). */
static enum step process_batch(struct session *s)
{
    enum step st = STEP_RETRY;

    for (int i = 0; i < s->n; i++) {
        struct job *j = &s->jobs[i];
        if (j->input < 0 || j->input >= s->c->n_inputs)
            IDEMQ_PANIC("delivery tag %llu from an unknown consumer", (unsigned long long)j->tag);
        job_decode(j, &s->c->inputs[j->input]);
    }
    for (int tries = 0; tries < BATCH_RETRIES && st == STEP_RETRY; tries++) {
        if (tries)
            nap(backoff_delay_ms(tries, 20, 1000, BACKOFF_JITTER_FULL, &s->rng));
        st = run_txn(s, s->jobs, s->n, s->settle);
    }
    if (st == STEP_OK) {
        atomic_fetch_add(&s->w->stats.batches, 1);
        count(s, s->jobs, s->n, s->settle);
        return settle_batch(s, s->jobs, s->n, s->settle);
    }
    if (st != STEP_RETRY && st != STEP_SPLIT)
        return st;
    /* Isolate: each job in its own transaction; one that still fails the
     * whole call is parked with the database's reason. */
    log_warn("worker %d: batch of %d failed as a whole (%s); isolating job by job", s->w->id,
             s->n, s->why);
    for (int i = 0; i < s->n; i++) {
        struct job *j = &s->jobs[i];
        enum settle one;
        st = STEP_RETRY;
        for (int tries = 0; tries < BATCH_RETRIES && st == STEP_RETRY; tries++)
            st = run_txn(s, j, 1, &one);
        if (st == STEP_RETRY || st == STEP_SPLIT) {
            j->decode_err = IDEMQ_ERR_SQL;
            snprintf(j->reason, sizeof j->reason, "%s", s->why);
            st = run_txn(s, j, 1, &one);
        }
        if (st != STEP_OK)
            return st;
        atomic_fetch_add(&s->w->stats.batches, 1);
        count(s, j, 1, &one);
        if ((st = settle_batch(s, j, 1, &one)) != STEP_OK)
            return st;
    }
    return STEP_OK;
}

/* Collects up to batch_max deliveries: waits up to wait_ms for the first,
 * then up to batch_wait_ms for the rest. */
static enum step collect(struct session *s, int wait_ms)
{
    long long fill_deadline = 0;
    s->n = 0;
    while (s->n < s->batch_limit) {
        /* After the first delivery, take what has arrived and sleep in
         * FILL_TICK_MS steps until the deadline: one wake-up per tick, not
         * one per delivery. */
        idemq_err_t err = broker_next(s->b, &s->jobs[s->n], s->n == 0 ? wait_ms : 0);
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
        s->jobs[s->n].received_ns = now_ns();
        if (s->n == 0)
            fill_deadline = now_ms() + s->c->batch_wait_ms;
        s->n++;
        atomic_fetch_add(&s->w->stats.received, 1);
    }
    return STEP_OK;
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
        latency_record(&s->w->latency, (uint64_t)(now - s->jobs[i].received_ns) / 1000u);
    if (!s->w->first_delivery_ns || s->jobs[0].received_ns < s->w->first_delivery_ns)
        s->w->first_delivery_ns = s->jobs[0].received_ns;
    s->w->last_ack_ns = now;
}

static bool session_alloc(struct session *s)
{
    int m = s->c->batch_max;
    s->jobs = calloc((size_t)m, sizeof *s->jobs);
    s->good = calloc((size_t)m, sizeof *s->good);
    s->res = calloc((size_t)m, sizeof *s->res);
    s->settle = calloc((size_t)m, sizeof *s->settle);
    if (!s->jobs || !s->good || !s->res || !s->settle)
        return false;
    for (int i = 0; i < m; i++)
        job_init(&s->jobs[i]);
    return true;
}

static void session_free(struct session *s)
{
    drop_broker(s);
    drop_db(s);
    if (s->jobs)
        for (int i = 0; i < s->c->batch_max; i++)
            job_destroy(&s->jobs[i]);
    free(s->jobs);
    free(s->good);
    free(s->res);
    free(s->settle);
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
        if (w->until_idle_ms > 0 && now_ms() - last_delivery >= w->until_idle_ms) {
            log_info("worker %d: idle for %d ms, finishing", w->id, w->until_idle_ms);
            break;
        }
        st = collect(&s, POLL_MS);
        if (st == STEP_OK && s.n > 0) {
            last_delivery = now_ms();
            gate_wait(&s);
            st = process_batch(&s);
            if (st == STEP_OK)
                note_acked(&s);
        }
        switch (st) {
        case STEP_OK:
            break;
        case STEP_BROKER:
            log_warn("worker %d: broker failure: %s; reconnecting (unacked deliveries return "
                     "to the queue)", w->id, s.why);
            drop_broker(&s);
            break;
        case STEP_INFRA:
            log_warn("worker %d: database failure: %s; nothing acknowledged, reconnecting",
                     w->id, s.why);
            drop_broker(&s);
            drop_db(&s);
            break;
        case STEP_FATAL:
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
    session_free(&s);
    return w->result;
}

void *worker_thread(void *arg)
{
    struct worker *w = arg;
    worker_run(w);
    return NULL;
}
