/*
 * worker: the loop of one thread: connect (with the pause/reconnect paths
 * for database, broker and deploy failures), collect a batch, wait for the
 * rate gate, run its transactions (batch.c), settle it on the broker
 * (settle.c), and for ordered lanes hold deliveries per lane (lane.c) and
 * drain deferred jobs from the ledger. Every result of every step maps to
 * one action: settle what committed, or drop a connection so the broker
 * redelivers (with backoff and readiness off while anything is wrong).
 */
#include "worker.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backoff.h"
#include "batch.h"
#include "broker.h"
#include "celery_reply.h"
#include "classify.h"
#include "effect_sql.h"
#include "lane.h"
#include "latency.h"
#include "ledger_db.h"
#include "ledger_lanes.h"
#include "ledger_migrate.h"
#include "ledger_retention.h"
#include "ledger_txn.h"
#include "outbox.h"
#include "log.h"
#include "observe.h"
#include "provider_run.h"
#include "rate_gate.h"
#include "republish.h"
#include "rescue.h"
#include "run_report.h"
#include "settle.h"
#include "sig.h"
#include "topology.h"
#include "trace_export.h"

#define POLL_MS 200       /* longest wait between stop/idle checks */
#define PAUSE_MIN_MS 250  /* first reconnect backoff */
#define REPUBLISH_CONFIRM_MS 10000 /* well inside the heartbeat window */
#define DRAIN_MS 1000     /* ordered lanes: look for deferred jobs at least this often */
#define DRAIN_ROUNDS 8    /* drain transactions per loop iteration at most */
#define REPORT_MS 1000    /* ordered lanes: report old deferred jobs this often */
#define FILL_TICK_MS 1    /* sleep step while a batch fills */
#define PROVIDER_POLL_MS 20 /* provider answers waited for per loop, at most */
#define PROVIDER_DRAIN_MS 30000 /* a stop waits this long for provider answers */
#define QUIESCE_MS 30000  /* --until-idle: the broker's cancel-oks may take this long */

/* What a loop step came to. */
enum step {
    STEP_OK = 0,
    STEP_INFRA,      /* database gone: reconnect both, nothing more acknowledged */
    STEP_FATAL,      /* deploy/config problem: stop consuming until it is fixed */
    STEP_BROKER,     /* broker gone (or a republish unconfirmed): reconnect it */
    STEP_REDELIVER,  /* a job met contention it could not outlast: give it back to
                      * the broker (drop the connection), back off, not ready */
};

struct session {
    struct worker *w;
    const struct conf *c;
    PGconn *db;
    struct ledger_txn *lt;
    struct broker *b;
    long long settle_ns;      /* CLOCK_MONOTONIC when the batch's settlement began */
    uint64_t failed_tag;      /* given back with basic.reject by drop_broker, 0: none */
    struct batch bt;          /* the batch: jobs, plans, the transaction ladder */
    long long *park_ids;
    uint64_t rng;
    int batch_limit;          /* batch_max, or less under consumer.max_rate */
    int redelivers;           /* consecutive STEP_REDELIVER, for the backoff */
    int fatals;               /* deploy errors since the last committed batch or idle poll:
                               * the backoff, and not ready until a batch goes through */
    char logged[512];         /* the NOT READY reason last logged (each is logged once) */
    /* ordered lanes */
    struct lane_set *lanes;
    bool lanes_keyed;         /* some ordered input has an ordering key */
    long long last_drain, last_report;
    struct provider_run *pr;  /* provider inputs; NULL without them */
    struct rescue rescue;     /* lost retry copies (consumer/rescue.h) */
    struct ledger_retention *retention; /* worker 0 with ledger.maintenance */
    struct outbox outbox;     /* the relay of idemq.outbox rows */
    struct celery_reply_cache replies; /* Celery reply queues bound to the replies exchange */
    char why[512];            /* reason of the last non-OK step */
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
    worker_progress(w);
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

/* Whether why is not the reason last logged as NOT READY (then it is
 * now). A job's key in a batch's reason ("; first job ...") is not part of
 * it: the same deploy error on the next redelivery is not news. */
static bool news(struct session *s, const char *why)
{
    const char *cut = strstr(why, "; first job ");
    size_t n = cut ? (size_t)(cut - why) : strlen(why);
    if (n < sizeof s->logged && strncmp(s->logged, why, n) == 0 && s->logged[n] == '\0')
        return false;
    snprintf(s->logged, sizeof s->logged, "%.*s", (int)n, why);
    return true;
}

/* Ready again after a deploy error: a batch committed, or nothing failed
 * in a poll round. */
static void deploy_fixed(struct session *s)
{
    if (!s->fatals)
        return;
    log_info("worker %d: ready again after %d deploy errors", s->w->id, s->fatals);
    s->fatals = 0;
    s->logged[0] = '\0';
    set_ready(s->w, true, NULL);
}

/* Backing off is waiting by design, not being stuck: naps in 1 s steps,
 * noting progress (liveness) after each. Provider calls in flight keep
 * being driven meanwhile (100 ms steps), so their answers are read before
 * their timeouts and recorded once the worker is connected again. */
static void progressing_nap(struct session *s, long ms)
{
    for (long left = ms; left > 0 && !sig_stop_requested();) {
        long step = provider_run_pending(s->pr) ? 100 : 1000;
        step = left < step ? left : step;
        nap(step);
        left -= step;
        provider_run_pump(s->pr);
        worker_progress(s->w);
    }
}

static void drop_db(struct session *s)
{
    ledger_txn_free(s->lt);
    s->lt = NULL;
    if (s->db)
        PQfinish(s->db);
    s->db = NULL;
    s->bt.db = NULL;
    s->bt.lt = NULL;
}

static void drop_broker(struct session *s)
{
    /* Unacknowledged deliveries go back to the queue one at a time before
     * the close, so RabbitMQ 4.3 charges its delivery limit only with the
     * one that failed (adapters/giveback.h); if the connection is gone
     * already they are back anyway. */
    if (s->b)
        (void)broker_give_back(s->b, s->failed_tag);
    s->failed_tag = 0;
    broker_close(s->b);
    s->b = NULL;
    lane_clear(s->lanes); /* held deliveries too: their tags died with the channel */
    provider_run_abandon(s->pr); /* and provider deliveries (their calls go on) */
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
    s->bt.db = s->db;
    s->bt.lt = s->lt;
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
            /* A queue whose home node is down (a cluster node restarting)
             * is an outage, not a broken deploy. */
            bool outage = strstr(s->why, "home node") != NULL;
            drop_broker(s);
            return outage ? STEP_BROKER : STEP_FATAL; /* fatal: wait until it is fixed */
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
 * backoff (broker.reconnect_max_ms). While anything is wrong the worker
 * holds no AMQP connection, so it takes no deliveries and holds none
 * unacknowledged. Returns false only when a stop was requested meanwhile;
 * *reconnected tells whether a connection had to be (re)made.
 */
static bool ensure_connected(struct session *s, bool *reconnected)
{
    int failures = 0;
    *reconnected = !s->b || !s->db;
    for (;;) {
        enum step st;
        worker_progress(s->w); /* a reconnect attempt is progress */
        st = connect_db(s);
        if (st == STEP_OK)
            st = connect_broker(s);
        if (st == STEP_OK) {
            if (failures)
                log_info("worker %d: %s after %d failed checks", s->w->id,
                         s->fatals ? "connected again (ready once a batch goes through)"
                                   : "ready again",
                         failures);
            if (!s->fatals) { /* after a deploy error: ready once a batch goes through */
                s->logged[0] = '\0';
                set_ready(s->w, true, NULL);
            }
            return true;
        }
        drop_broker(s);
        failures++;
        set_ready(s->w, false, s->why);
        atomic_fetch_add(&s->w->stats.by_class[st == STEP_FATAL ? CLASS_FATAL : CLASS_INFRA], 1);
        if (!news(s, s->why)) /* the same reason as the last check: said already */
            log_debug("worker %d: still not ready: %s", s->w->id, s->why);
        else if (st == STEP_FATAL)
            log_error("worker %d: NOT READY, not consuming: %s (checking again with backoff)",
                      s->w->id, s->why);
        else
            log_warn("worker %d: NOT READY: %s unavailable: %s (reconnecting with backoff)",
                     s->w->id, st == STEP_BROKER ? "broker" : "database", s->why);
        progressing_nap(s, backoff_delay_ms(failures, PAUSE_MIN_MS, s->c->reconnect_max_ms,
                                            BACKOFF_JITTER_EQUAL, &s->rng));
        if (sig_stop_requested())
            return false;
    }
}

/* ---- settling on the broker (settle.c's io) ---- */

static idemq_err_t io_delay(void *ctx, const struct job *j, long delay_ms, int attempt)
{
    struct session *s = ctx;
    return republish_delay(s->b, &s->c->inputs[j->input], j, delay_ms, attempt);
}

static idemq_err_t io_dead(void *ctx, const struct job *j, const json_t *park)
{
    struct session *s = ctx;
    return republish_dead(s->b, &s->c->inputs[j->input], j, park);
}

static idemq_err_t io_wait(void *ctx)
{
    struct session *s = ctx;
    return broker_wait_confirms(s->b, REPUBLISH_CONFIRM_MS);
}

static idemq_err_t io_settle(void *ctx, uint64_t tag)
{
    struct session *s = ctx;
    return broker_settle(s->b, tag);
}

static idemq_err_t io_reject(void *ctx, uint64_t tag)
{
    struct session *s = ctx;
    return broker_reject(s->b, tag);
}

static idemq_err_t io_flush(void *ctx)
{
    struct session *s = ctx;
    return broker_flush_acks(s->b);
}

static void count(struct session *s, const struct plan *plans, int n)
{
    struct worker_stats *ws = &s->w->stats;
    for (int i = 0; i < n; i++) {
        if (plans[i].observed) { /* observe mode: its own counters, none of apply's */
            observe_count(s->bt.jobs[i].input, (enum observe_outcome)plans[i].observed,
                          (idemq_err_t)plans[i].observe_code);
            continue;
        }
        if (plans[i].key_reuse)
            atomic_fetch_add(&ws->key_reuse, 1);
        switch (plans[i].how) {
        case SETTLE_DELAY: atomic_fetch_add(&ws->retried, 1); break;
        case SETTLE_DEAD:
        case SETTLE_REJECT: atomic_fetch_add(&ws->parked, 1); break;
        case SETTLE_RELEASE:
            break;
        case SETTLE_HOLD:
        case SETTLE_NONE:
            if (plans[i].outcome == LEDGER_ERROR)
                atomic_fetch_add(&ws->retried, 1);
            break;
        case SETTLE_ACK:
            if (plans[i].outcome == LEDGER_APPLIED)
                atomic_fetch_add(&ws->applied, 1);
            else if (plans[i].outcome == LEDGER_DEFERRED)
                atomic_fetch_add(&ws->deferred, 1);
            else
                atomic_fetch_add(&ws->duplicates, 1);
            break;
        }
    }
}

/*
 * Settles the committed jobs[0..n): held deliveries go back to their lanes
 * (unacknowledged, in order), the rest through settle_batch. Then notes the
 * confirmed dead-letter copies in the ledger.
 */
static enum step settle_committed(struct session *s, int n)
{
    struct job *jobs = s->bt.jobs;
    struct plan *plans = s->bt.plans;
    struct settle_io io = {s, io_delay, io_dead, io_wait, io_settle, io_reject, io_flush};
    struct ledger_db_error e;
    int parks = 0;

    enum step relayed = STEP_OK;

    /* rows the batch's effects emitted are published before its
     * deliveries are acknowledged (a failure leaves them to the recovery
     * poll; they are committed): the rows its transaction leased to this
     * worker before COMMIT, then, only if it emitted more than those (a
     * row behind another of its order key, a batch split into several
     * transactions), a claim */
    if (s->c->outbox_relay) {
        bool more = false;
        /* outbox_rest is set only for a batch with a job of an `emits` input */
        idemq_err_t oerr = outbox_publish_taken(&s->outbox, s->c, s->db, s->b, &s->bt.taken,
                                                s->why, sizeof s->why);
        if (!oerr && s->bt.outbox_rest)
            oerr = outbox_relay(&s->outbox, s->c, s->db, s->b, &more, s->why, sizeof s->why);
        if (oerr == IDEMQ_ERR_BROKER)
            return STEP_BROKER;
        if (oerr)
            relayed = STEP_INFRA; /* the deliveries are still acknowledged below */
        if (more)
            s->outbox.next_poll_ms = 0; /* the rest at the next tick */
    }
    count(s, plans, n);
    atomic_fetch_add(&s->w->stats.batches, 1);
    lane_settle_begin(s->lanes);
    for (int i = 0; i < n; i++) {
        if (plans[i].how != SETTLE_HOLD)
            continue;
        if (lane_putback(s->lanes, &jobs[i], now_ms() + plans[i].delay_ms)) {
            snprintf(s->why, sizeof s->why, "out of memory holding a lane");
            return STEP_BROKER;
        }
    }
    s->settle_ns = now_ns();
    switch (settle_batch(&io, jobs, plans, n, s->why, sizeof s->why)) {
    case SETTLE_DONE:
        break;
    case SETTLE_UNCONFIRMED:
    case SETTLE_BROKER_FAILED:
        snprintf(s->why + strlen(s->why), sizeof s->why - strlen(s->why), " (%s)",
                 broker_error(s->b));
        return STEP_BROKER;
    }
    atomic_fetch_add(&s->w->stats.settled, n);
    for (int i = 0; i < n; i++)
        if (plans[i].how == SETTLE_DEAD && plans[i].park)
            s->park_ids[parks++] =
                (long long)json_integer_value(json_object_get(plans[i].park, "park_id"));
#ifdef IDEMQ_TEST_HOOKS
    if (parks && getenv("IDEMQ_TEST_MARK_DELAY_MS")) /* widens the S7 window in tests */
        nap(atol(getenv("IDEMQ_TEST_MARK_DELAY_MS")));
#endif
    if (parks && ledger_txn_mark_dead_lettered(s->lt, s->park_ids, parks, &e))
        log_warn("worker %d: dead-letter publish confirmed but not noted in the ledger (%s); "
                 "a later duplicate would publish it again", s->w->id, e.message);
    if (s->c->n_routes) {
        /* Celery results, after the acknowledgements: the jobs are committed,
         * so a reply is best effort (celery_reply.h); a failure holds no
         * delivery and is never answered again */
        char why[512] = "";
        idemq_err_t rerr = celery_reply_batch(&s->replies, s->b, s->db, s->c, jobs, plans, n,
                                              REPUBLISH_CONFIRM_MS, &s->w->stats.celery, why,
                                              sizeof why);
        if (rerr == IDEMQ_ERR_DB_CONN) {
            snprintf(s->why, sizeof s->why, "%s", why);
            return STEP_INFRA;
        }
        if (rerr) {
            snprintf(s->why, sizeof s->why, "%s", why);
            return STEP_BROKER;
        }
    }
    return relayed;
}

/* Waits ms while keeping the broker connection serviced (heartbeats). */
static void serviced_nap(void *ctx, long ms)
{
    struct session *s = ctx;
    if (!s->b || broker_service(s->b, (int)ms) != IDEMQ_OK)
        nap(ms);
}

/* ---- provider inputs: provider_run decides, the worker settles ---- */

static void export_span(const struct session *s, const struct job *j, const struct plan *p,
                        long long now_mono);

/*
 * Polls the provider jobs (up to wait_ms) and settles the deliveries
 * decided, through the same settle rules as a batch. A database failure
 * stops like a failed transaction (infra or fatal).
 */
static enum step provider_settle(struct session *s, int wait_ms)
{
    struct settle_io io = {s, io_delay, io_dead, io_wait, io_settle, io_reject, io_flush};
    struct job jobs[PROVIDER_RUN_MAX];
    struct plan plans[PROVIDER_RUN_MAX];
    struct ledger_db_error e;
    enum classify_class fail;
    enum step st;
    int n, parks = 0;
    long long now = now_ns();

    n = provider_run_poll(s->pr, s->db, wait_ms, jobs, plans, &fail, s->why, sizeof s->why);
    st = fail == CLASS_FATAL ? STEP_FATAL : fail == CLASS_INFRA ? STEP_INFRA : STEP_OK;
    if (n && s->b) {
        count(s, plans, n);
        switch (settle_batch(&io, jobs, plans, n, s->why, sizeof s->why)) {
        case SETTLE_DONE:
            for (int i = 0; i < n; i++) {
                if (plans[i].how == SETTLE_DEAD && plans[i].park)
                    s->park_ids[parks++] = (long long)json_integer_value(
                        json_object_get(plans[i].park, "park_id"));
                if (plans[i].how != SETTLE_RELEASE && jobs[i].received_ns) {
                    latency_record(&s->w->latency,
                                   (uint64_t)(now - jobs[i].received_ns) / 1000u);
                    export_span(s, &jobs[i], &plans[i], now); /* its calls are children */
                }
            }
            atomic_fetch_add(&s->w->stats.settled, n);
            s->w->last_ack_ns = now;
            break;
        case SETTLE_UNCONFIRMED:
        case SETTLE_BROKER_FAILED:
            if (st == STEP_OK)
                st = STEP_BROKER;
            break;
        }
    }
    if (parks && ledger_txn_mark_dead_lettered(s->lt, s->park_ids, parks, &e))
        log_warn("worker %d: dead-letter publish confirmed but not noted in the ledger (%s)",
                 s->w->id, e.message);
    provider_run_done(s->pr, plans, st == STEP_OK);
    return st;
}

/* The reconciler's short step (worker 0): overdue intents looked up. */
static enum step sweep_step(struct session *s)
{
    struct ledger_db_error e;
    if (provider_run_sweep(s->pr, s->db, &e) == IDEMQ_OK)
        return STEP_OK;
    snprintf(s->why, sizeof s->why, "reconciler: %s %s", e.sqlstate, e.message);
    if (e.conn_lost)
        return STEP_INFRA;
    log_warn("worker %d: %s", s->w->id, s->why);
    return STEP_OK;
}

/* Runs the collected batch s->bt.jobs[0..n) and settles what committed. */
static enum step process(struct session *s)
{
    int committed = 0;
    enum batch_step bs = BATCH_OK;
    enum step st = STEP_OK;
    bool release = false;

    /* provider jobs leave the batch: their decisions come later */
    provider_run_take(s->pr, s->db, s->bt.jobs, &s->bt.n, &release, s->why, sizeof s->why);
    s->failed_tag = 0;
    if (s->bt.n && (bs = batch_process(&s->bt, &committed)) == BATCH_REDELIVER)
        s->failed_tag = s->bt.failed_tag; /* given back with basic.reject */
    if (release && bs == BATCH_OK) {
        bs = BATCH_REDELIVER;
        snprintf(s->bt.why, sizeof s->bt.why, "%s", s->why);
    }
    if (bs != BATCH_OK)
        snprintf(s->why, sizeof s->why, "%s", s->bt.why);
    /* What committed is settled even when the batch stopped part way. */
    if (committed && s->b && (st = settle_committed(s, committed)) != STEP_OK)
        return st;
    switch (bs) {
    case BATCH_OK: s->redelivers = 0; return STEP_OK;
    case BATCH_INFRA: return STEP_INFRA;
    case BATCH_FATAL: return STEP_FATAL;
    case BATCH_REDELIVER: return STEP_REDELIVER;
    }
    return STEP_REDELIVER;
}

/* Deliveries come from the head of their queue: the age of the one just
 * taken (by its timestamp property, in seconds) is the oldest-ready age. */
static void note_age(struct worker *w, const struct job *j)
{
    struct timespec now;
    long long age;
    clock_gettime(CLOCK_REALTIME, &now);
    if ((age = job_age_s(j, (long long)now.tv_sec)) < 0)
        return; /* none, or implausible (job_timestamp) */
    atomic_store(&w->stats.head_age_ms, (long)(age * 1000LL));
}

/* Collects up to batch_max deliveries: waits up to wait_ms for the first,
 * then up to batch_wait_ms for the rest. A delivery the library could not
 * decode ends the batch (the connection cannot read past it). */
static enum step collect(struct session *s, int wait_ms)
{
    struct batch *bt = &s->bt;
    /* bt->n may start above 0: held deliveries of lanes whose wait is over */
    long long fill_deadline = bt->n ? now_ms() + s->c->batch_wait_ms : 0;
    long long first_deadline = now_ms() + wait_ms;
    while (bt->n < s->batch_limit) {
        /* After the first delivery, take what has arrived and sleep in
         * FILL_TICK_MS steps until the deadline: one wake-up per tick, not
         * one per delivery. */
        long long first_left = first_deadline - now_ms();
        struct job *j = &bt->jobs[bt->n];
        idemq_err_t err = broker_next(s->b, j, bt->n == 0 ? (int)(first_left > 0 ? first_left : 0)
                                                          : 0);
        if (err == IDEMQ_ERR_TIMEOUT) {
            long long left = bt->n ? fill_deadline - now_ms() : 0;
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
        j->received_ns = now_ns();
        if (lane_blocked(s->lanes, j, now_ms())) {
            /* its lane waits: keep it behind the lane's earlier deliveries */
            if (lane_append(s->lanes, j)) {
                snprintf(s->why, sizeof s->why, "out of memory holding a lane");
                return STEP_BROKER;
            }
            continue;
        }
        if (bt->n == 0)
            fill_deadline = now_ms() + s->c->batch_wait_ms;
        note_age(s->w, j);
        bt->n++;
        if (!broker_readable(s->b))
            break; /* an undecodable delivery: process what we have */
    }
    return STEP_OK;
}

/* ---- throughput: shared rate gate, delivery -> ack latency ---- */

/* Largest batch under consumer.max_rate: about 50 ms worth of jobs, so the
 * wait for one batch's tokens stays short (and heartbeats stay serviced). */
static int batch_limit(const struct conf *c)
{
    int lim = c->max_rate > 0 ? c->max_rate / 20 : c->batch_max;
    return lim < 1 ? 1 : lim > c->batch_max ? c->batch_max : lim;
}

/* Waits until the shared gate grants n jobs, keeping the broker serviced
 * (wakes on stop: the batch in flight is then still processed, as a
 * drain). */
static void gate_wait(struct session *s, int n)
{
    int64_t wait_ns;
    if (!s->w->gate || n == 0)
        return;
    wait_ns = rate_gate_reserve(s->w->gate, n, now_ns());
    if (wait_ns > 0)
        serviced_nap(s, (long)((wait_ns + 999999) / 1000000));
}

/*
 * Ordered lanes, between batches: applies deferred jobs whose predecessor
 * was applied (taken from the ledger, applied like deliveries, in order),
 * and reports deferred jobs that wait too long. Runs after a batch applied
 * or parked an ordered job, and every DRAIN_MS anyway (another replica may
 * have applied the predecessor). Between its transactions the broker is
 * serviced (heartbeats) and the rate gate is honoured.
 */
static enum step lanes_housekeeping(struct session *s)
{
    struct ledger_db_error e;
    long long now = now_ms();
    enum step st = STEP_OK;
    int reported;

    if (!s->lanes_keyed)
        return STEP_OK;
    if (s->bt.drain_hint || now - s->last_drain >= DRAIN_MS) {
        s->last_drain = now;
        for (int round = 0; round < DRAIN_ROUNDS && !sig_stop_requested(); round++) {
            s->bt.drain_hint = false;
            if (round && s->b && broker_service(s->b, 1) != IDEMQ_OK) {
                snprintf(s->why, sizeof s->why, "%s", broker_error(s->b));
                st = STEP_BROKER;
                break;
            }
            if (ledger_lanes_take(s->db, s->c, s->bt.jobs, s->batch_limit, &s->bt.n, &e)) {
                snprintf(s->why, sizeof s->why, "take_deferred: %s %s", e.sqlstate, e.message);
                st = e.conn_lost ? STEP_INFRA : STEP_OK;
                if (st == STEP_OK)
                    log_warn("worker %d: deferred jobs: %s", s->w->id, s->why);
                break;
            }
            if (s->bt.n == 0)
                break;
            atomic_fetch_add(&s->w->stats.from_ledger, s->bt.n);
            gate_wait(s, s->bt.n);
            if ((st = process(s)) != STEP_OK || !s->bt.drain_hint)
                break;
        }
        s->bt.n = 0;
    }
    if (st == STEP_OK && now - s->last_report >= REPORT_MS) {
        s->last_report = now;
        if (ledger_lanes_report(s->db, s->c, &reported, &e)) {
            if (e.conn_lost) {
                snprintf(s->why, sizeof s->why, "report_deferred: %s", e.message);
                return STEP_INFRA;
            }
            log_warn("worker %d: reporting deferred jobs: %s %s", s->w->id, e.sqlstate,
                     e.message);
        }
    }
    return st;
}

/* Records delivery -> settlement (the ack, or the requeue of a transient
 * failure) of a batch s->bt.jobs[0..n) that was settled. */
/* The span of a settled job (trace_export.h): from its delivery to now. */
static void export_span(const struct session *s, const struct job *j, const struct plan *p,
                        long long now_mono)
{
    enum trace_outcome o = p->observed                           ? TRACE_OBSERVED
                         : p->how == SETTLE_DEAD || p->how == SETTLE_REJECT ? TRACE_PARKED
                         : p->how == SETTLE_DELAY                           ? TRACE_RETRY
                         : p->how != SETTLE_ACK                             ? TRACE_HELD
                         : p->outcome == LEDGER_APPLIED                     ? TRACE_APPLIED
                         : p->outcome == LEDGER_DUPLICATE                   ? TRACE_DUPLICATE
                                                                            : TRACE_HELD;
    if (j->trace.span)
        trace_export_job(&j->trace, &s->c->inputs[j->input], j->received_ns, now_mono,
                         p->attempt, o);
}

/* The receive and settle spans of the settled batch (trace_export.h). */
static void export_batch(const struct session *s, long long now_mono)
{
    const struct job *jobs = s->bt.jobs;
    const struct trace_job **t = calloc((size_t)s->bt.n, sizeof *t);
    long long first = 0, last = 0;
    int m = 0, input = -1;
    if (!t)
        return;
    for (int i = 0; i < s->bt.n; i++) {
        if (!jobs[i].received_ns)
            continue;
        if (input < 0)
            input = jobs[i].input;
        if (jobs[i].input != input) /* one input's messages per batch span */
            continue;
        t[m++] = &jobs[i].trace;
        if (!first || jobs[i].received_ns < first)
            first = jobs[i].received_ns;
        if (jobs[i].received_ns > last)
            last = jobs[i].received_ns;
    }
    if (m)
        trace_export_batch(&s->c->inputs[input], t, m, first, last,
                           s->settle_ns ? s->settle_ns : now_mono, now_mono, "ack");
    free(t);
}

static void note_acked(struct session *s)
{
    long long now = now_ns();
    struct job *jobs = s->bt.jobs;
    for (int i = 0; i < s->bt.n; i++)
        if (jobs[i].received_ns) { /* 0: held in its lane (moved out), not settled yet */
            latency_record(&s->w->latency, (uint64_t)(now - jobs[i].received_ns) / 1000u);
            latency_record(&s->w->interval, (uint64_t)(now - jobs[i].received_ns) / 1000u);
            export_span(s, &jobs[i], &s->bt.plans[i], now);
        }
    if (trace_export_on())
        export_batch(s, now);
    if (jobs[0].received_ns &&
        (!s->w->first_delivery_ns || jobs[0].received_ns < s->w->first_delivery_ns))
        s->w->first_delivery_ns = jobs[0].received_ns;
    s->w->last_ack_ns = now;
}

static bool session_alloc(struct session *s)
{
    int m = s->c->batch_max;
    if (!batch_init(&s->bt, s->c, m, s->w->stats.by_class, s->rng ^ 0x5bd1e995u))
        return false;
    s->bt.nap = serviced_nap;
    s->bt.nap_ctx = s;
    s->bt.progress = &s->w->progress_ms;
    if (s->c->outbox_relay) { /* batch transactions lease what they emit */
        s->bt.outbox_holder = s->outbox.holder;
        s->bt.outbox_lease_ms = s->c->outbox_lease_s * 1000;
    }
    if (!(s->park_ids = calloc((size_t)m, sizeof *s->park_ids)))
        return false;
    if (!(s->lanes = lane_set_new(s->c)))
        return false;
    s->lanes_keyed = ledger_lanes_any(s->c);
    /* One maintenance caller per process, on its own session. */
    if (s->w->id == 0 && s->c->maintenance && !(s->retention = ledger_retention_new(
                                                    s->c, s->c->consumer_id)))
        return false;
    return true;
}

static void session_free(struct session *s)
{
    drop_broker(s);
    provider_run_free(s->pr);
    s->pr = NULL;
    drop_db(s);
    batch_free(&s->bt);
    free(s->park_ids);
    lane_set_free(s->lanes);
    ledger_retention_free(s->retention);
}

/* What the loop does after a step that was not OK. */
static void recover(struct session *s, enum step st)
{
    struct worker *w = s->w;
    long pause;

    switch (st) {
    case STEP_OK:
        break;
    case STEP_BROKER:
        set_ready(w, false, s->why); /* e.g. a consumer the broker cancelled */
        log_warn("worker %d: broker failure: %s; reconnecting (unacked deliveries return "
                 "to the queue)", w->id, s->why);
        drop_broker(s);
        break;
    case STEP_INFRA:
        set_ready(w, false, s->why);
        atomic_fetch_add(&w->stats.by_class[CLASS_INFRA], 1);
        log_warn("worker %d: NOT READY: database failure: %s; unacknowledged deliveries "
                 "return to the queue, reconnecting", w->id, s->why);
        drop_broker(s);
        drop_db(s);
        break;
    case STEP_FATAL:
        /* A deploy error (a missing or replaced effect, a dropped table, a
         * privilege): nothing parked, the deliveries go back; the session
         * is made again (resolving the effects again) after a backoff, and
         * the worker stays not ready until a batch goes through. */
        s->fatals++;
        pause = backoff_delay_ms(s->fatals, PAUSE_MIN_MS, s->c->reconnect_max_ms,
                                 BACKOFF_JITTER_EQUAL, &s->rng);
        set_ready(w, false, s->why);
        atomic_fetch_add(&w->stats.by_class[CLASS_FATAL], 1);
        if (news(s, s->why))
            log_error("worker %d: NOT READY: %s: deploy or configuration problem, no job "
                      "parked; giving the deliveries back and checking again with backoff",
                      w->id, s->why);
        else
            log_debug("worker %d: still not ready (try %d): %s", w->id, s->fatals, s->why);
        drop_broker(s);
        drop_db(s);
        progressing_nap(s, pause);
        break;
    case STEP_REDELIVER:
        s->redelivers++;
        pause = backoff_delay_ms(s->redelivers, PAUSE_MIN_MS, s->c->reconnect_max_ms,
                                 BACKOFF_JITTER_EQUAL, &s->rng);
        set_ready(w, false, s->why);
        atomic_fetch_add(&w->stats.by_class[CLASS_TRANSIENT], 1);
        log_warn("worker %d: NOT READY: %s; giving the unsettled deliveries back to the broker "
                 "and pausing %ld ms", w->id, s->why, pause);
        drop_broker(s);
        progressing_nap(s, pause);
        break;
    }
}

/*
 * --until-idle: no delivery came for until_idle_ms, but one may still be on
 * its way (RabbitMQ 4.0 took about 4 s to hand over a message with headers
 * nested 17,000 deep, with the deliveries behind it waiting). True when the
 * broker confirms nothing was dispatched to this worker and its queues hold
 * nothing ready (broker_quiesce); false, and the worker goes on, otherwise.
 */
static bool broker_idle(struct session *s)
{
    bool idle = false;
    if (!s->b)
        return true;
    if (broker_quiesce(s->b, QUIESCE_MS, &idle) != IDEMQ_OK) {
        log_warn("worker %d: cannot confirm the queues are idle (%s): not finishing yet",
                 s->w->id, broker_error(s->b));
        return false;
    }
    if (!idle)
        log_info("worker %d: no delivery for %d ms, but the broker still had messages for it: "
                 "going on",
                 s->w->id, s->w->until_idle_ms);
    return idle;
}

idemq_err_t worker_run(struct worker *w)
{
    struct session s;
    long long last_delivery = now_ms();

    memset(&s, 0, sizeof s);
    log_set_worker(w->id); /* JSON lines of this thread carry "worker" */
    s.w = w;
    s.c = w->conf;
    s.rng = (uint64_t)now_ms() * 2654435761u + (uint64_t)w->id + 1;
    s.batch_limit = batch_limit(s.c);
    outbox_init(&s.outbox, w->id);
    celery_reply_cache_init(&s.replies);
    ledger_db_set_call_timeout(s.c->call_timeout_ms); /* this thread's sessions */
    w->result = IDEMQ_OK;
    if (!session_alloc(&s)) {
        snprintf(w->error, sizeof w->error, "out of memory allocating a batch of %d",
                 s.c->batch_max);
        w->result = IDEMQ_ERR_NOMEM;
        goto out;
    }
    if ((w->result = provider_run_new(s.c, w->id, &s.pr, w->error, sizeof w->error))) {
        log_error("worker %d: provider inputs: %s", w->id, w->error);
        goto out;
    }
#ifdef IDEMQ_TEST_HOOKS
    {
        const char *crash = getenv("IDEMQ_TEST_CRASH");
        if (crash && strcmp(crash, "after_commit") == 0)
            s.bt.crash = BATCH_CRASH_AFTER_COMMIT;
        else if (crash && strcmp(crash, "before_commit") == 0)
            s.bt.crash = BATCH_CRASH_BEFORE_COMMIT;
    }
#endif
    while (!sig_stop_requested()) {
        enum step st;
        bool reconnected;
        worker_progress(w); /* each round polls the broker (a frame read or a timeout) */
        if (!ensure_connected(&s, &reconnected))
            break;
        if (reconnected)
            last_delivery = now_ms(); /* an outage does not count as idle time */
        if (provider_run_busy(s.pr))
            last_delivery = now_ms(); /* provider calls or lookups in flight: not idle */
        if (w->until_idle_ms > 0 && now_ms() - last_delivery >= w->until_idle_ms &&
            !lane_held(s.lanes)) {
            struct ledger_db_error e;
            bool pending = false;
            if (s.lanes_keyed && ledger_lanes_retry_pending(s.db, s.c, &pending, &e) == IDEMQ_OK &&
                pending) {
                last_delivery = now_ms(); /* a deferred job retries from the ledger: not idle */
            } else if (s.c->outbox_relay && outbox_retry_pending()) {
                last_delivery = now_ms(); /* a refused outbox row is tried again soon */
            } else if (!broker_idle(&s)) {
                last_delivery = now_ms(); /* deliveries were still coming: not idle */
            } else {
                log_info("worker %d: idle for %d ms, finishing", w->id, w->until_idle_ms);
                break;
            }
        }
        {
            long long now = now_ms(), ready;
            int wait = POLL_MS;
            s.bt.n = lane_take_ready(s.lanes, s.bt.jobs, s.batch_limit, now);
            ready = lane_next_ready(s.lanes);
            if (ready && ready - now < wait)
                wait = ready > now ? (int)(ready - now) : 0;
            if (provider_run_pending(s.pr))
                wait = 0; /* provider answers are waited for below */
            st = collect(&s, wait);
        }
        if (st == STEP_OK && s.bt.n == 0) {
            atomic_store(&w->stats.head_age_ms, 0); /* nothing ready: the queue is idle */
            deploy_fixed(&s);
        }
        if (st == STEP_OK && s.bt.n > 0) {
            last_delivery = now_ms();
            gate_wait(&s, s.bt.n);
            st = process(&s);
            if (st == STEP_OK) {
                note_acked(&s);
                deploy_fixed(&s);
            }
        }
        if (st == STEP_OK && s.b && !broker_readable(s.b)) {
            /* an undecodable delivery was rejected: the connection cannot
             * read past it, a new one continues after it */
            log_info("worker %d: reconnecting after an undecodable delivery", w->id);
            drop_broker(&s);
            continue;
        }
        if (st == STEP_OK)
            st = lanes_housekeeping(&s);
        if (st == STEP_OK)
            st = provider_settle(&s, PROVIDER_POLL_MS);
        if (st == STEP_OK)
            st = sweep_step(&s);
        if (st == STEP_OK) { /* republish retry copies lost on the broker */
            idemq_err_t rerr = rescue_tick(&s.rescue, s.c, s.db, s.b, s.why, sizeof s.why);
            st = rerr == IDEMQ_ERR_BROKER ? STEP_BROKER : rerr ? STEP_INFRA : st;
        }
        if (st == STEP_OK && w->id == 0) { /* the outbox's recovery poll */
            idemq_err_t oerr = outbox_tick(&s.outbox, s.c, s.db, s.b, s.why, sizeof s.why);
            st = oerr == IDEMQ_ERR_BROKER ? STEP_BROKER : oerr ? STEP_INFRA : st;
        }
        if (st == STEP_OK && s.retention) /* never waits: see ledger_retention.h */
            ledger_retention_tick(s.retention, now_ms());
        if (s.c->perf_interval_s > 0)
            run_report_interval(w, now_ns(), s.c->perf_interval_s);
        recover(&s, st);
    }
    /* A drain: provider jobs not started go back to the broker (with the
     * connection); calls in flight get their answers (within their lease)
     * and are settled before the connections close. Without a broker the
     * answers are still recorded. */
    provider_run_drain(s.pr);
    for (long long end = now_ms() + PROVIDER_DRAIN_MS;
         s.db && provider_run_pending(s.pr) && now_ms() < end;) {
        enum step st = provider_settle(&s, 100);
        if (st == STEP_BROKER)
            drop_broker(&s); /* the rest is recorded without settling */
        else if (st != STEP_OK)
            break;
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
