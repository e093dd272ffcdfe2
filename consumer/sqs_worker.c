/*
 * sqs_worker: the threads of Amazon SQS inputs: receive, one ledger
 * transaction per batch, then delete, hold or dead-letter each message
 * (see sqs_worker.h).
 */
#include "sqs_worker.h"

#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backoff.h"
#include "batch.h"
#include "effect_sql.h"
#include "job.h"
#include "ledger_db.h"
#include "ledger_migrate.h"
#include "ledger_txn.h"
#include "log.h"
#include "seal.h"
#include "settle.h"
#include "sig.h"
#include "sqs.h"
#include "trace_export.h"

/* A request beyond its long poll: connect, send, answer. */
#define SQS_REQUEST_MS 10000

enum step { STEP_OK = 0, STEP_INFRA, STEP_FATAL, STEP_SQS, STEP_BACKOFF };

/* The lease: while a batch is in flight, its messages' visibility is
 * extended every half of the timeout, by a thread of its own (the worker
 * is inside the ledger transaction meanwhile). The mutex is held during
 * the extension calls, so once lease_release returns no extension can
 * override the visibility a retry sets afterwards. */
struct lease {
    pthread_t thread;
    bool started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool stop;
    struct sqs_client *cl; /* the input's lease client (the thread's own) */
    const char *receipts[SQS_MAX_MESSAGES];
    int n;
    long vis_s;
    long long next_ms;
    const char *input;
    atomic_long *extended;
};

/* The next receive, in flight while the worker applies the current batch
 * (a second call per worker; its own client per input). */
struct prefetch {
    pthread_t thread;
    bool started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool stop;
    int want;  /* input to receive from next, -1 = none asked */
    bool busy; /* a receive is in flight */
    int input; /* of the answer below, -1 = none */
    int wait_s;
    enum sqs_status st;
    struct sqs_message *m;
    int n;
    char err[256];
    struct sqs_client **cl;
};

struct sqs_thread {
    int id;
    const struct conf *c;
    struct conf view; /* its SQS inputs as the inputs (conf_sqs_view) */
    long until_idle_ms;
    pthread_t thread;
    bool started;
    PGconn *db;
    struct ledger_txn *lt;
    struct batch bt;
    struct sqs_client **cl;       /* per input: receive and settle */
    struct sqs_client **lease_cl; /* per input: the lease's */
    struct lease lease;
    struct prefetch pf;
    /* the batch being settled */
    struct sqs_message *msgs;
    int input;
    bool kept[SQS_MAX_MESSAGES]; /* its visibility was set for a retry: not deleted */
    const char *del[SQS_MAX_MESSAGES];
    int ndel;
    long long park_ids[SQS_MAX_MESSAGES];
    atomic_long by_class[5];
    atomic_llong progress;
    uint64_t rng;
    char why[512];
    char logged[512];
    atomic_long received, applied, duplicates, retried, parked, delete_failed, extended;
    bool unready; /* counted in g.unready */
    bool failed;
};

struct sqs_workers {
    int n;
    struct sqs_thread *t;
};

/* The process's counts for /metrics (a metrics scrape may outlive the
 * threads' own counters). */
static struct {
    atomic_bool on;
    atomic_int unready; /* threads backing off now */
    atomic_long received, applied, duplicates, retried, parked, delete_failed, extended, not_ready;
} g;

static void add(atomic_long *mine, atomic_long *global, long n)
{
    atomic_fetch_add(mine, n);
    atomic_fetch_add(global, n);
}

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

static void nap(long ms)
{
    /* in slices, so a stop request is seen within 100 ms */
    while (ms > 0 && !sig_stop_requested()) {
        long s = ms > 100 ? 100 : ms;
        struct timespec ts = {s / 1000, (s % 1000) * 1000000L};
        nanosleep(&ts, NULL);
        ms -= s;
    }
}

static void batch_nap(void *ctx, long ms)
{
    (void)ctx;
    nap(ms);
}

/* A mutex and a condition whose timed waits run on CLOCK_MONOTONIC. */
static bool sync_init(pthread_mutex_t *mu, pthread_cond_t *cv)
{
    pthread_condattr_t ca;
    bool ok;
    if (pthread_mutex_init(mu, NULL))
        return false;
    if (pthread_condattr_init(&ca)) {
        pthread_mutex_destroy(mu);
        return false;
    }
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    ok = pthread_cond_init(cv, &ca) == 0;
    pthread_condattr_destroy(&ca);
    if (!ok)
        pthread_mutex_destroy(mu);
    return ok;
}

/* ---- the lease ---- */

static void *lease_run(void *arg)
{
    struct lease *l = arg;
    pthread_mutex_lock(&l->mu);
    while (!l->stop) {
        long long now = now_ms();
        if (l->n == 0 || now < l->next_ms) {
            struct timespec ts;
            long long at = l->n == 0 ? now + 1000 : l->next_ms;
            clock_gettime(CLOCK_MONOTONIC, &ts);
            at = (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000 + (at - now);
            ts.tv_sec = (time_t)(at / 1000);
            ts.tv_nsec = (long)(at % 1000) * 1000000L;
            pthread_cond_timedwait(&l->cv, &l->mu, &ts);
            continue;
        }
        for (int i = 0; i < l->n; i++) {
            char err[256];
            enum sqs_status st = sqs_change_visibility(l->cl, l->receipts[i], l->vis_s, err,
                                                       sizeof err);
            if (st == SQS_OK)
                add(l->extended, &g.extended, 1);
            else /* the message may come back while its job runs: a duplicate then */
                log_warn("input %s: extending a message's visibility failed: %s (%s)", l->input,
                         sqs_status_name(st), err);
        }
        l->next_ms = now_ms() + l->vis_s * 500;
    }
    pthread_mutex_unlock(&l->mu);
    return NULL;
}

static bool lease_start(struct lease *l, atomic_long *extended)
{
    l->extended = extended;
    if (!sync_init(&l->mu, &l->cv))
        return false;
    l->started = pthread_create(&l->thread, NULL, lease_run, l) == 0;
    return l->started;
}

static void lease_stop(struct lease *l)
{
    if (!l->started)
        return;
    pthread_mutex_lock(&l->mu);
    l->stop = true;
    pthread_cond_signal(&l->cv);
    pthread_mutex_unlock(&l->mu);
    pthread_join(l->thread, NULL);
    pthread_cond_destroy(&l->cv);
    pthread_mutex_destroy(&l->mu);
    l->started = false;
}

static void lease_hold(struct lease *l, struct sqs_client *cl, const char *input,
                       const struct sqs_message *m, int n, long vis_s)
{
    pthread_mutex_lock(&l->mu);
    l->cl = cl;
    l->input = input;
    for (int i = 0; i < n; i++)
        l->receipts[i] = m[i].receipt;
    l->n = n;
    l->vis_s = vis_s;
    l->next_ms = now_ms() + vis_s * 500;
    pthread_cond_signal(&l->cv);
    pthread_mutex_unlock(&l->mu);
}

/* Ends the extensions of one message (about to be settled); waits for one
 * in progress. */
static void lease_drop(struct lease *l, const char *receipt)
{
    pthread_mutex_lock(&l->mu);
    for (int i = 0; i < l->n; i++) {
        if (l->receipts[i] == receipt) {
            l->receipts[i] = l->receipts[--l->n];
            break;
        }
    }
    pthread_mutex_unlock(&l->mu);
}

/* Ends the extensions; waits for one in progress. */
static void lease_release(struct lease *l)
{
    pthread_mutex_lock(&l->mu);
    l->n = 0;
    pthread_mutex_unlock(&l->mu);
}

/* ---- the prefetch ---- */

static void *prefetch_run(void *arg)
{
    struct prefetch *p = arg;
    pthread_mutex_lock(&p->mu);
    while (!p->stop) {
        int in;
        struct sqs_message *m = NULL;
        int n = 0;
        char err[256] = "";
        enum sqs_status st;
        if (p->want < 0) {
            pthread_cond_wait(&p->cv, &p->mu);
            continue;
        }
        in = p->want;
        p->want = -1;
        p->busy = true;
        pthread_mutex_unlock(&p->mu);
        st = sqs_receive(p->cl[in], SQS_MAX_MESSAGES, p->wait_s, &m, &n, err, sizeof err);
        pthread_mutex_lock(&p->mu);
        p->busy = false;
        p->st = st;
        p->m = m;
        p->n = n;
        snprintf(p->err, sizeof p->err, "%s", err);
        p->input = in;
        pthread_cond_broadcast(&p->cv);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

static bool prefetch_start(struct prefetch *p, int wait_s)
{
    p->want = p->input = -1;
    p->wait_s = wait_s;
    if (!sync_init(&p->mu, &p->cv))
        return false;
    p->started = pthread_create(&p->thread, NULL, prefetch_run, p) == 0;
    return p->started;
}

/* Asks for a receive of input i, unless one is asked, in flight or held
 * already (one answer at a time: a second would overwrite the first). */
static void prefetch_ask(struct prefetch *p, int i)
{
    pthread_mutex_lock(&p->mu);
    if (p->want < 0 && !p->busy && p->input < 0) {
        p->want = i;
        pthread_cond_broadcast(&p->cv);
    }
    pthread_mutex_unlock(&p->mu);
}

/* The answer of input i's receive: asks for it if nobody has, then waits
 * for it (a long poll at most, and its request timeout). An answer of
 * another input asked before is taken back first (handed back at once). */
static enum sqs_status prefetch_take(struct prefetch *p, int i, struct sqs_message **m, int *n,
                                     char *err, size_t errlen)
{
    enum sqs_status st;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        if (p->input == i)
            break;
        if (p->input >= 0) { /* another input's: hand its messages back */
            for (int k = 0; k < p->n; k++) {
                char e[256];
                (void)sqs_change_visibility(p->cl[p->input], p->m[k].receipt, 0, e, sizeof e);
            }
            sqs_messages_free(p->m, p->n);
            p->m = NULL;
            p->n = 0;
            p->input = -1;
        }
        if (p->want < 0 && !p->busy && p->input < 0) {
            p->want = i;
            pthread_cond_broadcast(&p->cv);
        }
        pthread_cond_wait(&p->cv, &p->mu);
    }
    st = p->st;
    *m = p->m;
    *n = p->n;
    snprintf(err, errlen, "%s", p->err);
    p->m = NULL;
    p->n = 0;
    p->input = -1;
    pthread_mutex_unlock(&p->mu);
    return st;
}

/* Stops the thread: a receive in flight ends at once (the long poll
 * watches the stop flag); messages it received are handed back. */
static void prefetch_stop(struct prefetch *p)
{
    if (!p->started)
        return;
    pthread_mutex_lock(&p->mu);
    p->stop = true;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    pthread_join(p->thread, NULL);
    for (int k = 0; k < p->n; k++) {
        char e[256];
        (void)sqs_change_visibility(p->cl[p->input], p->m[k].receipt, 0, e, sizeof e);
    }
    sqs_messages_free(p->m, p->n);
    p->m = NULL;
    p->n = 0;
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    p->started = false;
}

/* ---- the ledger session ---- */

static void drop_db(struct sqs_thread *t)
{
    ledger_txn_free(t->lt);
    t->lt = NULL;
    if (t->db)
        PQfinish(t->db);
    t->db = NULL;
    t->bt.db = NULL;
    t->bt.lt = NULL;
}

static enum step connect_db(struct sqs_thread *t)
{
    char app[96];
    struct ledger_db_error e;
    idemq_err_t err;

    if (t->db && PQstatus(t->db) == CONNECTION_OK && t->lt)
        return STEP_OK;
    drop_db(t);
    snprintf(app, sizeof app, "idemq sqs worker %d", t->id);
    if (!(t->db = ledger_db_connect(t->c->dsn, app, t->c->statement_timeout_ms, t->why,
                                    sizeof t->why)))
        return STEP_INFRA;
    if ((err = ledger_migrate_check(t->db, t->why, sizeof t->why)))
        return err == IDEMQ_ERR_DB_CONN ? STEP_INFRA : STEP_FATAL;
    for (int i = 0; i < t->view.n_inputs; i++) {
        err = effect_sql_check(t->db, &t->view.inputs[i], t->why, sizeof t->why, &e);
        if (err == IDEMQ_ERR_DB_CONN) {
            snprintf(t->why, sizeof t->why, "%s", e.message);
            return STEP_INFRA;
        }
        if (err == IDEMQ_ERR_SQL) /* e.g. no EXECUTE on the effect for this role */
            snprintf(t->why, sizeof t->why, "input %s: effect check failed: %s %s",
                     t->view.inputs[i].name, e.sqlstate, e.message);
        if (err)
            return STEP_FATAL;
    }
    if (!(t->lt = ledger_txn_new(t->db, &t->view, t->why, sizeof t->why)))
        return PQstatus(t->db) == CONNECTION_OK ? STEP_FATAL : STEP_INFRA;
    t->bt.db = t->db;
    t->bt.lt = t->lt;
    return STEP_OK;
}

/* ---- settling on SQS (settle.c's io) ---- */

static const struct sqs_message *msg_of(struct sqs_thread *t, const struct job *j)
{
    return &t->msgs[j->tag - 1];
}

/* A retry: the message stays hidden for the backoff (whole seconds, up,
 * so it is not back before its run_after; at most 12 h: a longer delay
 * comes back early and the ledger holds it again for the rest). */
static idemq_err_t io_delay(void *ctx, const struct job *j, long delay_ms, int attempt)
{
    struct sqs_thread *t = ctx;
    char err[256];
    long s = (delay_ms + 999) / 1000;
    enum sqs_status st;
    (void)attempt;
    st = sqs_change_visibility(t->cl[t->input], msg_of(t, j)->receipt, s, err, sizeof err);
    if (st != SQS_OK) {
        log_warn("input %s: holding a retry failed: %s (%s); it comes back after its "
                 "visibility timeout", t->view.inputs[t->input].name, sqs_status_name(st), err);
        return IDEMQ_ERR_BROKER;
    }
    t->kept[j->tag - 1] = true;
    return IDEMQ_OK;
}

static void put_str(json_t *a, const char *name, const json_t *park, const char *field)
{
    const json_t *v = json_object_get(park, field);
    if (json_is_string(v) && json_string_length(v) > 0)
        json_object_set_new(a, name, json_string(json_string_value(v)));
}

static void put_int(json_t *a, const char *name, const json_t *park, const char *field)
{
    const json_t *v = json_object_get(park, field);
    if (json_is_integer(v))
        json_object_set_new(a, name, json_integer(json_integer_value(v)));
}

/* Sends j's body to the input's dead-letter queue with attrs, confirmed
 * by SQS's answer. No dead-letter queue: IDEMQ_OK, nothing sent. */
static idemq_err_t send_dead(struct sqs_thread *t, const struct job *j, const json_t *attrs,
                             long long park_id)
{
    const struct conf_input *in = &t->view.inputs[t->input];
    const struct sqs_message *m = msg_of(t, j);
    char dedup[64], err[256], *id = NULL;
    enum sqs_status st;
    if (!in->dead_letter_queue_url[0])
        return IDEMQ_OK;
    /* a FIFO dead-letter queue keeps the group; its dedup id names the
     * park, so a second send of one park (after a crash) is dropped by SQS */
    snprintf(dedup, sizeof dedup, "idemq-park-%lld-%s", park_id, m->id);
    dedup[strspn(dedup, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")] =
        '\0';
    st = sqs_send(t->cl[t->input], in->dead_letter_queue_url, m->body,
                  in->sqs_fifo ? (m->group_id ? m->group_id : "idemq") : NULL,
                  in->sqs_fifo ? dedup : NULL, attrs, &id, err, sizeof err);
    free(id);
    if (st != SQS_OK) {
        log_warn("input %s: sending a parked message to the dead-letter queue failed: %s (%s); "
                 "it stays in the queue and is sent when it comes back",
                 in->name, sqs_status_name(st), err);
        return IDEMQ_ERR_BROKER;
    }
    return IDEMQ_OK;
}

/* A park: the story in message attributes (the names of the RabbitMQ
 * dead-letter copy's headers, at most 10), sealed, so a move back is
 * recognised as a redrive. */
static idemq_err_t io_dead(void *ctx, const struct job *j, const json_t *park)
{
    struct sqs_thread *t = ctx;
    json_t *a = json_object();
    const json_t *tp = json_object_get(j->headers, "traceparent");
    json_int_t pid = json_integer_value(json_object_get(park, "park_id"));
    idemq_err_t err;
    if (!a)
        return IDEMQ_ERR_NOMEM;
    put_str(a, "x-idemq-key", park, "key");
    put_str(a, "x-idemq-error-class", park, "error_class");
    put_str(a, "x-idemq-error-code", park, "error_code");
    put_int(a, "x-idemq-attempts", park, "attempts");
    put_int(a, "x-idemq-generation", park, "generation");
    put_int(a, "x-idemq-park-id", park, "park_id");
    put_str(a, "x-idemq-first-attempt-at", park, "first_attempt_at");
    put_str(a, "x-idemq-parked-at", park, "parked_at");
    if (json_object_get(a, "x-idemq-key") && json_object_get(a, "x-idemq-generation")) {
        char seal[SEAL_HEX];
        if (seal_park(json_string_value(json_object_get(a, "x-idemq-key")),
                      (long long)json_integer_value(json_object_get(a, "x-idemq-generation")),
                      (long long)pid, seal))
            json_object_set_new(a, "x-idemq-seal", json_string(seal));
    }
    if (json_is_string(tp))
        json_object_set_new(a, "traceparent", json_string(json_string_value(tp)));
    err = send_dead(t, j, a, (long long)pid);
    json_decref(a);
    return err;
}

static idemq_err_t io_wait(void *ctx)
{
    (void)ctx; /* every send was confirmed by its own answer */
    return IDEMQ_OK;
}

static idemq_err_t io_settle(void *ctx, uint64_t tag)
{
    struct sqs_thread *t = ctx;
    if (!t->kept[tag - 1])
        t->del[t->ndel++] = t->msgs[tag - 1].receipt;
    return IDEMQ_OK;
}

/* A delivery the ledger could not even park: to the dead-letter queue
 * with what is known, then deleted; with none it stays in the queue (its
 * redrive policy, if any, moves it after maxReceiveCount receives). */
static idemq_err_t io_reject(void *ctx, uint64_t tag)
{
    struct sqs_thread *t = ctx;
    const struct job *j = NULL;
    json_t *a;
    idemq_err_t err;
    for (int k = 0; k < t->bt.n && !j; k++)
        if (t->bt.jobs[k].tag == tag)
            j = &t->bt.jobs[k];
    if (!j || !t->view.inputs[t->input].dead_letter_queue_url[0])
        return IDEMQ_OK;
    if (!(a = json_pack("{s:s}", "x-idemq-error-code", idemq_err_name(j->decode_err ? j->decode_err
                                                                     : IDEMQ_ERR_UNDECODABLE))))
        return IDEMQ_ERR_NOMEM;
    err = send_dead(t, j, a, 0);
    json_decref(a);
    if (!err)
        t->del[t->ndel++] = t->msgs[tag - 1].receipt;
    return err;
}

static idemq_err_t io_flush(void *ctx)
{
    struct sqs_thread *t = ctx;
    int failed[SQS_MAX_MESSAGES], nf = 0;
    char err[256];
    enum sqs_status st;
    if (t->ndel == 0)
        return IDEMQ_OK;
    st = sqs_delete_batch(t->cl[t->input], t->del, t->ndel, failed, &nf, err, sizeof err);
    t->ndel = 0;
    if (st != SQS_OK) {
        log_warn("input %s: deleting settled messages failed: %s (%s); they come back and are "
                 "duplicates then", t->view.inputs[t->input].name, sqs_status_name(st), err);
        return IDEMQ_ERR_BROKER;
    }
    if (nf) {
        add(&t->delete_failed, &g.delete_failed, nf);
        log_warn("input %s: SQS did not delete %d settled message(s) (an expired receipt): "
                 "they come back and are duplicates then", t->view.inputs[t->input].name, nf);
    }
    return IDEMQ_OK;
}

static void count(struct sqs_thread *t, const struct plan *plans, int n)
{
    for (int i = 0; i < n; i++) {
        switch (plans[i].how) {
        case SETTLE_DELAY: add(&t->retried, &g.retried, 1); break;
        case SETTLE_DEAD:
        case SETTLE_REJECT: add(&t->parked, &g.parked, 1); break;
        case SETTLE_ACK:
            if (plans[i].outcome == LEDGER_APPLIED)
                add(&t->applied, &g.applied, 1);
            else
                add(&t->duplicates, &g.duplicates, 1);
            break;
        default: break;
        }
    }
}

/* The receive and settle (delete) spans of the settled jobs[0..n) of one
 * input (trace_export.h). */
static void export_batch(const struct sqs_thread *t, int n, long long settle_start)
{
    const struct trace_job **tj = calloc((size_t)n, sizeof *tj);
    long long first = 0, last = 0;
    if (!tj)
        return;
    for (int i = 0; i < n; i++) {
        const struct job *j = &t->bt.jobs[i];
        tj[i] = &j->trace;
        if (!first || j->received_ns < first)
            first = j->received_ns;
        if (j->received_ns > last)
            last = j->received_ns;
    }
    trace_export_batch(&t->view.inputs[t->input], tj, n, first, last, settle_start, now_ns(),
                       "delete");
    free(tj);
}

/* Carries out the plans of the committed jobs[0..n). */
static enum step settle(struct sqs_thread *t, int n)
{
    struct settle_io io = {t, io_delay, io_dead, io_wait, io_settle, io_reject, io_flush};
    struct ledger_db_error e;
    int parks = 0;
    long long settle_start = now_ns();
    memset(t->kept, 0, sizeof t->kept);
    t->ndel = 0;
    count(t, t->bt.plans, n);
    if (settle_batch(&io, t->bt.jobs, t->bt.plans, n, t->why, sizeof t->why) != SETTLE_DONE)
        return STEP_SQS; /* what was not settled comes back after its visibility */
    if (trace_export_on() && n > 0) /* the batch's receive and settle spans */
        export_batch(t, n, settle_start);
    for (int i = 0; i < n; i++) { /* the span of each settled job (trace_export.h) */
        const struct job *j = &t->bt.jobs[i];
        const struct plan *p = &t->bt.plans[i];
        if (j->trace.span)
            trace_export_job(&j->trace, &t->view.inputs[j->input], j->received_ns, now_ns(),
                             p->attempt,
                             p->how == SETTLE_DEAD || p->how == SETTLE_REJECT ? TRACE_PARKED
                             : p->how == SETTLE_DELAY                         ? TRACE_RETRY
                             : p->how != SETTLE_ACK                           ? TRACE_HELD
                             : p->outcome == LEDGER_APPLIED                   ? TRACE_APPLIED
                                                                              : TRACE_DUPLICATE);
    }
    for (int i = 0; i < n; i++)
        if (t->bt.plans[i].how == SETTLE_DEAD && t->bt.plans[i].park &&
            t->view.inputs[t->input].dead_letter_queue_url[0])
            t->park_ids[parks++] =
                (long long)json_integer_value(json_object_get(t->bt.plans[i].park, "park_id"));
    if (parks && ledger_txn_mark_dead_lettered(t->lt, t->park_ids, parks, &e))
        log_warn("sqs worker %d: dead-letter send confirmed but not noted in the ledger (%s); "
                 "a later duplicate would send it again", t->id, e.message);
    return STEP_OK;
}

/* ---- receive ---- */

/* Job k of the batch from message mi of the receive (its tag: mi + 1). */
static void fill_job(struct sqs_thread *t, int input, int k, int mi)
{
    const struct sqs_message *m = &t->msgs[mi];
    struct job *j = &t->bt.jobs[k];
    job_reset(j);
    j->tag = (uint64_t)mi + 1;
    j->input = input;
    j->received_ns = now_ns();
    j->redelivered = m->receive_count > 1;
    j->delivery_count = m->receive_count > INT_MAX ? INT_MAX : (int)m->receive_count;
    snprintf(j->message_id, sizeof j->message_id, "%s", m->id);
    j->has_message_id = true;
    snprintf(j->routing_key, sizeof j->routing_key, "%s", t->view.inputs[input].queue);
    if (m->group_id)
        json_object_set_new(j->props, "message_group_id", json_string(m->group_id));
    if (m->attributes)
        sqs_attributes_to_headers(m->attributes, j->headers);
    if (job_set_body(j, m->body, m->body_len) != IDEMQ_OK) {
        j->wire_err = IDEMQ_ERR_NOMEM;
        snprintf(j->wire_reason, sizeof j->wire_reason, "out of memory taking the body");
    }
}

/* One transaction over messages idx[0..n) of the receive, then their
 * settling; *committed of them committed (in order). */
static enum step run_batch(struct sqs_thread *t, int i, const int *idx, int n, int *committed)
{
    enum batch_step bs;
    enum step s = STEP_OK;
    for (int k = 0; k < n; k++)
        fill_job(t, i, k, idx[k]);
    t->bt.n = n;
    bs = batch_process(&t->bt, committed);
    for (int k = 0; k < n; k++) /* settled now, or left to their visibility */
        lease_drop(&t->lease, t->msgs[idx[k]].receipt);
    if (*committed > 0)
        s = settle(t, *committed);
    switch (bs) {
    case BATCH_OK:
        break;
    case BATCH_INFRA: /* the rest come back after their visibility */
        snprintf(t->why, sizeof t->why, "%s", t->bt.why);
        s = STEP_INFRA;
        break;
    case BATCH_FATAL:
        snprintf(t->why, sizeof t->why, "%s", t->bt.why);
        s = STEP_FATAL;
        break;
    case BATCH_REDELIVER: /* a job whose contention outlived its retries: it comes
                           * back after its visibility; back off meanwhile */
        snprintf(t->why, sizeof t->why, "%s", t->bt.why);
        s = s == STEP_OK ? STEP_BACKOFF : s;
        break;
    }
    return s;
}

static bool same_group(const struct sqs_message *a, const struct sqs_message *b)
{
    return strcmp(a->group_id ? a->group_id : "", b->group_id ? b->group_id : "") == 0;
}

/*
 * A FIFO queue's receive, in rounds: each round one transaction over the
 * first unsettled message of each group. A group whose message was not
 * done (a retry held by its visibility, or not committed) takes no part in
 * later rounds: its later messages are handed back at once (visibility 0),
 * and SQS hands them out again only after that message, so a retry holds
 * its group (head-of-line) and no later job of the group overtakes it.
 */
static enum step fifo_rounds(struct sqs_thread *t, int i, int nmsg)
{
    bool done[SQS_MAX_MESSAGES] = {false}, blocked[SQS_MAX_MESSAGES] = {false};
    enum step s = STEP_OK;
    for (;;) {
        int idx[SQS_MAX_MESSAGES], n = 0, committed = 0;
        for (int m = 0; m < nmsg; m++) {
            bool earlier = false, held = false; /* of its group: unsettled, not done */
            if (done[m])
                continue;
            for (int k = 0; k < m; k++) {
                if (!same_group(&t->msgs[k], &t->msgs[m]))
                    continue;
                held = held || blocked[k];
                earlier = earlier || !done[k];
            }
            if (held) {
                char err[256];
                lease_drop(&t->lease, t->msgs[m].receipt);
                (void)sqs_change_visibility(t->cl[i], t->msgs[m].receipt, 0, err, sizeof err);
                done[m] = blocked[m] = true;
            } else if (!earlier) {
                idx[n++] = m;
            }
        }
        if (n == 0 || s != STEP_OK)
            break;
        s = run_batch(t, i, idx, n, &committed);
        for (int k = 0; k < n; k++) {
            done[idx[k]] = true;
            blocked[idx[k]] = k >= committed || t->bt.plans[k].how == SETTLE_DELAY ||
                              t->bt.plans[k].how == SETTLE_RELEASE;
        }
    }
    return s;
}

/* One receive of input i and its batch: *took messages. */
static enum step one_input(struct sqs_thread *t, int i, int *took)
{
    const struct conf_input *in = &t->view.inputs[i];
    struct sqs_message *m = NULL;
    int n = 0, committed = 0, idx[SQS_MAX_MESSAGES];
    int wait_s = t->until_idle_ms > 0 ? 1 : t->view.n_inputs > 1 ? 2 : 20;
    char err[256];
    enum sqs_status st;
    enum step s;

    *took = 0;
    (void)wait_s;
    st = prefetch_take(&t->pf, i, &m, &n, err, sizeof err);
    if (st != SQS_OK) {
        snprintf(t->why, sizeof t->why, "input %s: ReceiveMessage %s: %s", in->name,
                 sqs_status_name(st), err);
        return STEP_SQS;
    }
    if (n == 0)
        return STEP_OK;
    *took = n;
    add(&t->received, &g.received, n);
    /* the next receive runs while this batch is applied */
    prefetch_ask(&t->pf, (i + 1) % t->view.n_inputs);
    t->msgs = m;
    t->input = i;
    lease_hold(&t->lease, t->lease_cl[i], in->name, m, n, in->visibility_timeout_s);
    if (in->sqs_fifo) {
        s = fifo_rounds(t, i, n);
    } else {
        for (int k = 0; k < n; k++)
            idx[k] = k;
        s = run_batch(t, i, idx, n, &committed);
    }
    lease_release(&t->lease);
    t->msgs = NULL;
    sqs_messages_free(m, n);
    return s;
}

static bool new_reason(struct sqs_thread *t)
{
    if (strcmp(t->why, t->logged) == 0)
        return false;
    snprintf(t->logged, sizeof t->logged, "%s", t->why);
    return true;
}

static void *run(void *arg)
{
    struct sqs_thread *t = arg;
    long long last_work = now_ms();
    long backoff_ms = 250;
    int next = 0;

    log_set_worker(t->id);
    ledger_db_set_call_timeout(t->c->call_timeout_ms);
    while (!sig_stop_requested()) {
        enum step s = connect_db(t);
        int took = 0;
        if (s == STEP_OK) {
            s = one_input(t, next, &took);
            next = (next + 1) % t->view.n_inputs;
        }
        if (took)
            last_work = now_ms();
        if (s != STEP_OK) {
            atomic_fetch_add(&g.not_ready, 1);
            if (!t->unready) {
                t->unready = true;
                atomic_fetch_add(&g.unready, 1);
            }
            if (new_reason(t))
                log_warn("sqs worker %d: NOT READY: %s (trying again with backoff)", t->id,
                         t->why);
            if (s == STEP_INFRA || s == STEP_FATAL)
                drop_db(t);
            nap(backoff_delay_ms(1, backoff_ms, backoff_ms, BACKOFF_JITTER_EQUAL, &t->rng));
            backoff_ms = backoff_ms * 2 > t->c->reconnect_max_ms ? t->c->reconnect_max_ms
                                                                  : backoff_ms * 2;
            continue;
        }
        if (t->unready) {
            t->unready = false;
            atomic_fetch_sub(&g.unready, 1);
        }
        if (t->logged[0]) {
            log_info("sqs worker %d: ready", t->id);
            t->logged[0] = '\0';
        }
        backoff_ms = 250;
        if (!took && t->until_idle_ms > 0 && now_ms() - last_work >= t->until_idle_ms)
            break;
    }
    if (t->unready)
        atomic_fetch_sub(&g.unready, 1);
    drop_db(t);
    return NULL;
}

static bool should_stop(void) { return sig_stop_requested(); }

static idemq_err_t thread_init(struct sqs_thread *t, char *errbuf, size_t errlen)
{
    int n = t->view.n_inputs;
    if (!(t->cl = calloc((size_t)n, sizeof *t->cl)) ||
        !(t->lease_cl = calloc((size_t)n, sizeof *t->lease_cl)) ||
        !batch_init(&t->bt, &t->view, SQS_MAX_MESSAGES, t->by_class, t->rng ^ 0x5bd1e995u)) {
        snprintf(errbuf, errlen, "out of memory");
        return IDEMQ_ERR_NOMEM;
    }
    t->bt.nap = batch_nap;
    t->bt.progress = &t->progress;
    for (int i = 0; i < n; i++) {
        const struct conf_input *in = &t->view.inputs[i];
        struct sqs_client_config cfg = {in->queue_url, in->region, in->endpoint, SQS_REQUEST_MS,
                                        in->visibility_timeout_s, should_stop};
        char err[256];
        if (sqs_client_new(&cfg, &t->cl[i], err, sizeof err) ||
            sqs_client_new(&cfg, &t->lease_cl[i], err, sizeof err)) {
            snprintf(errbuf, errlen, "input %s: %s", in->name, err);
            return IDEMQ_ERR_CONFIG;
        }
    }
    if (!(t->pf.cl = calloc((size_t)n, sizeof *t->pf.cl))) {
        snprintf(errbuf, errlen, "out of memory");
        return IDEMQ_ERR_NOMEM;
    }
    for (int i = 0; i < n; i++) {
        const struct conf_input *in = &t->view.inputs[i];
        struct sqs_client_config cfg = {in->queue_url, in->region, in->endpoint, SQS_REQUEST_MS,
                                        in->visibility_timeout_s, should_stop};
        char err[256];
        if (sqs_client_new(&cfg, &t->pf.cl[i], err, sizeof err)) {
            snprintf(errbuf, errlen, "input %s: %s", in->name, err);
            return IDEMQ_ERR_CONFIG;
        }
    }
    if (!prefetch_start(&t->pf, t->until_idle_ms > 0 ? 1 : n > 1 ? 2 : 20)) {
        snprintf(errbuf, errlen, "cannot start the receive thread of SQS worker %d", t->id);
        return IDEMQ_ERR_INTERNAL;
    }
    if (!lease_start(&t->lease, &t->extended)) {
        snprintf(errbuf, errlen, "cannot start the lease thread of SQS worker %d", t->id);
        return IDEMQ_ERR_INTERNAL;
    }
    return IDEMQ_OK;
}

idemq_err_t sqs_worker_start(const struct conf *c, long until_idle_ms, struct sqs_workers **out,
                             char *errbuf, size_t errlen)
{
    struct sqs_workers *w;
    idemq_err_t err = IDEMQ_OK;

    *out = NULL;
    if (c->n_sqs_inputs == 0)
        return IDEMQ_OK;
    if (!(w = calloc(1, sizeof *w)) || !(w->t = calloc((size_t)c->workers, sizeof *w->t))) {
        free(w);
        snprintf(errbuf, errlen, "out of memory");
        return IDEMQ_ERR_NOMEM;
    }
    w->n = c->workers;
    for (int i = 0; i < w->n && !err; i++) {
        struct sqs_thread *t = &w->t[i];
        t->id = i;
        t->c = c;
        t->view = conf_sqs_view(c);
        t->until_idle_ms = until_idle_ms;
        t->rng = 0x9E3779B97F4A7C15ULL ^ ((uint64_t)now_ms() << 8) ^ (uint64_t)(i + 1);
        err = thread_init(t, errbuf, errlen);
    }
    for (int i = 0; i < w->n && !err; i++) {
        if (pthread_create(&w->t[i].thread, NULL, run, &w->t[i]) != 0) {
            snprintf(errbuf, errlen, "cannot start SQS worker thread %d", i);
            sig_request_stop();
            err = IDEMQ_ERR_INTERNAL;
            break;
        }
        w->t[i].started = true;
    }
    if (err) {
        sqs_worker_join(w, NULL);
        return err;
    }
    atomic_store(&g.on, true);
    *out = w;
    return IDEMQ_OK;
}

int sqs_worker_unready(void) { return atomic_load(&g.unready); }

bool sqs_worker_counts(struct sqs_worker_totals *t, long *not_ready)
{
    memset(t, 0, sizeof *t);
    t->received = atomic_load(&g.received);
    t->applied = atomic_load(&g.applied);
    t->duplicates = atomic_load(&g.duplicates);
    t->retried = atomic_load(&g.retried);
    t->parked = atomic_load(&g.parked);
    t->delete_failed = atomic_load(&g.delete_failed);
    t->extended = atomic_load(&g.extended);
    *not_ready = atomic_load(&g.not_ready);
    return atomic_load(&g.on);
}

void sqs_worker_join(struct sqs_workers *w, struct sqs_worker_totals *tot)
{
    if (tot)
        memset(tot, 0, sizeof *tot);
    if (!w)
        return;
    for (int i = 0; i < w->n; i++) {
        struct sqs_thread *t = &w->t[i];
        if (t->started)
            pthread_join(t->thread, NULL);
        prefetch_stop(&t->pf);
        lease_stop(&t->lease);
        if (tot) {
            tot->received += atomic_load(&t->received);
            tot->applied += atomic_load(&t->applied);
            tot->duplicates += atomic_load(&t->duplicates);
            tot->retried += atomic_load(&t->retried);
            tot->parked += atomic_load(&t->parked);
            tot->delete_failed += atomic_load(&t->delete_failed);
            tot->extended += atomic_load(&t->extended);
            tot->failed += t->failed;
        }
        for (int k = 0; k < t->view.n_inputs; k++) {
            if (t->cl)
                sqs_client_free(t->cl[k]);
            if (t->lease_cl)
                sqs_client_free(t->lease_cl[k]);
        }
        for (int k = 0; t->pf.cl && k < t->view.n_inputs; k++)
            sqs_client_free(t->pf.cl[k]);
        free(t->pf.cl);
        free(t->cl);
        free(t->lease_cl);
        batch_free(&t->bt);
    }
    free(w->t);
    free(w);
}
