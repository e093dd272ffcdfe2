/*
 * pgq_worker: the threads of PostgreSQL queue inputs: one transaction per
 * batch from the row claim to the row's end (see pgq_worker.h).
 */
#include "pgq_worker.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backoff.h"
#include "classify.h"
#include "effect_sql.h"
#include "job.h"
#include "ledger_db.h"
#include "ledger_migrate.h"
#include "ledger_txn.h"
#include "log.h"
#include "pgq.h"
#include "pgq_lease.h"
#include "rate_gate.h"
#include "sig.h"
#include "trace_export.h"

/* The longest an idle worker sleeps before it looks for due retries and
 * the stop flag again (a notification wakes it at once). */
#define PGQ_IDLE_MAX_MS 1000

/* The longest a worker takes from where its last take ended before it
 * takes from the head of the claim's order again (pgq_take_from). */
#define PGQ_HEAD_EVERY_MS 1000

enum step { STEP_OK = 0, STEP_INFRA, STEP_FATAL, STEP_BACKOFF };

struct pgq_thread {
    int id;
    const struct conf *c;   /* the whole configuration */
    struct conf view;       /* its PostgreSQL inputs as the inputs (conf_pg_view) */
    long until_idle_ms;
    pthread_t thread;
    bool started;
    PGconn *db;
    struct ledger_txn *lt;
    struct job *jobs;
    struct job **good;
    struct ledger_result *res;
    enum trace_outcome *fate; /* what became of jobs[k] (its span) */
    int *attempt;             /*   and its attempt number (0: none) */
    struct pgq_settle st;
    struct pgq_pos *pos;    /* by input: where the last take ended */
    long long *head_at;     /* by input: when a take last began at the head */
    int cap;
    bool solo;              /* after a whole-call failure: one row per batch until a commit */
    uint64_t rng;
    char why[512];
    char logged[512];       /* the NOT READY reason last logged */
    atomic_long taken, applied, duplicates, retried, parked;
    struct pgq_count pend;  /* the open transaction's counts: published at its COMMIT */
    bool unready;           /* counted in g.unready */
    bool failed;
    struct pgq_lease *pl;   /* provider inputs: rows under a visible lease (pgq_lease.h) */
    struct pgq_lease_tally *lease_by; /* by input: a lease poll's settles */
};

struct pgq_workers {
    int n;
    struct pgq_thread *t;
};

/* The process's counts by input, for /metrics (a scrape may outlive the
 * threads). Set up by the first pgq_worker_start, kept for the process. */
struct pgq_in_count {
    char *input;
    atomic_long admitted, applied, duplicates, retried, parked;
};

static struct {
    atomic_bool on;
    atomic_int unready; /* threads backing off now */
    atomic_long not_ready;
    int n;
    struct pgq_in_count *in;
    struct rate_gate *gate; /* consumer.max_rate, shared with the broker workers; NULL: none */
} g;

void pgq_worker_set_gate(struct rate_gate *gate) { g.gate = gate; }

/* Rows per take: batch_max, or about 50 ms worth under consumer.max_rate
 * (as a broker worker's batch), one after a whole-call failure. */
static int take_limit(const struct pgq_thread *t)
{
    int lim = t->c->max_rate > 0 ? t->c->max_rate / 20 : t->cap;
    if (t->solo)
        return 1;
    return lim < 1 ? 1 : lim > t->cap ? t->cap : lim;
}

/* Waits until the shared rate gate grants n jobs (a stop request ends the
 * wait: the batch then runs, as a broker worker's drains). */
static void gate_wait(int n)
{
    struct timespec ts;
    int64_t wait_ns;
    if (!g.gate || n == 0)
        return;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    wait_ns = rate_gate_reserve(g.gate, n, (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec);
    while (wait_ns > 0 && !sig_stop_requested()) {
        int64_t s = wait_ns > 100000000LL ? 100000000LL : wait_ns;
        struct timespec d = {(time_t)(s / 1000000000LL), (long)(s % 1000000000LL)};
        nanosleep(&d, NULL);
        wait_ns -= s;
    }
}

/* After a COMMIT: the transaction's counts become the thread's and input i's. */
static void publish(struct pgq_thread *t, int i)
{
    struct pgq_count *p = &t->pend;
    atomic_fetch_add(&t->taken, p->admitted);
    atomic_fetch_add(&t->applied, p->applied);
    atomic_fetch_add(&t->duplicates, p->duplicates);
    atomic_fetch_add(&t->retried, p->retried);
    atomic_fetch_add(&t->parked, p->parked);
    if (g.in && i < g.n) {
        atomic_fetch_add(&g.in[i].admitted, p->admitted);
        atomic_fetch_add(&g.in[i].applied, p->applied);
        atomic_fetch_add(&g.in[i].duplicates, p->duplicates);
        atomic_fetch_add(&g.in[i].retried, p->retried);
        atomic_fetch_add(&g.in[i].parked, p->parked);
    }
    memset(p, 0, sizeof *p);
}

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
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

static void drop_db(struct pgq_thread *t)
{
    ledger_txn_free(t->lt);
    t->lt = NULL;
    if (t->db)
        PQfinish(t->db);
    t->db = NULL;
}

static enum step from_error(struct pgq_thread *t, const struct ledger_db_error *e, const char *what)
{
    enum classify_class cls = classify_sqlstate(e->sqlstate, e->conn_lost, &t->c->rules);
    snprintf(t->why, sizeof t->why, "%s: %s %s", what, e->sqlstate, e->message);
    return cls == CLASS_INFRA ? STEP_INFRA : cls == CLASS_FATAL ? STEP_FATAL : STEP_BACKOFF;
}

static enum step connect(struct pgq_thread *t)
{
    char app[96];
    struct ledger_db_error e;
    idemq_err_t err;

    if (t->db && PQstatus(t->db) == CONNECTION_OK && t->lt)
        return STEP_OK;
    drop_db(t);
    snprintf(app, sizeof app, "idemq pgq worker %d", t->id);
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
    /* The rows are claimed in the transaction the apply runs in: it must
     * never be rolled back and begun again under them. */
    ledger_txn_keep_transaction(t->lt, true);
    if (pgq_listen(t->db, &e))
        return from_error(t, &e, "LISTEN");
    return STEP_OK;
}

/* Notes what became of job j of this batch, for its span. */
static void note_fate(struct pgq_thread *t, const struct job *j, enum trace_outcome o,
                      int attempt)
{
    t->fate[j - t->jobs] = o;
    t->attempt[j - t->jobs] = attempt;
}

static long long mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* After the commit: the spans of jobs[0..n) (trace_export.h), and the
 * take's receive span and its settle span ("delete": the rows leave the
 * table in the transaction that applied them, from settle_ns on), linked
 * to each row's producer span as the broker inputs' batches are. */
static void export_spans(struct pgq_thread *t, const struct conf_input *in, int n,
                         long long settle_ns)
{
    const struct trace_job **tj;
    long long now, first = 0, last = 0;
    if (!trace_export_on())
        return;
    now = mono_ns();
    tj = calloc((size_t)n, sizeof *tj); /* none: the job spans go without the batch's */
    for (int k = 0; k < n; k++) {
        trace_export_job(&t->jobs[k].trace, in, t->jobs[k].received_ns, now, t->attempt[k],
                         t->fate[k]);
        if (!tj)
            continue;
        tj[k] = &t->jobs[k].trace;
        if (!first || t->jobs[k].received_ns < first)
            first = t->jobs[k].received_ns;
        if (t->jobs[k].received_ns > last)
            last = t->jobs[k].received_ns;
    }
    if (tj)
        trace_export_batch(in, tj, n, first, last, settle_ns, now, "delete");
    free(tj);
}

/* A job's failed attempt, inside the transaction: a retry held in its row,
 * or a park (the row goes; the park holds the payload). forced: a permanent
 * code the ledger decided, or IDEMQ_OK to classify r's SQLSTATE. */
static enum step failure(struct pgq_thread *t, struct job *j, struct ledger_result *r,
                         idemq_err_t forced)
{
    struct ledger_db_error e;
    enum classify_class cls = forced ? CLASS_PERMANENT
                                     : classify_sqlstate(r->sqlstate, false, &t->c->rules);
    int used = r->attempt - r->base;
    idemq_err_t code = forced ? forced : IDEMQ_ERR_EFFECT;
    long delay = 0;
    bool park;

    if (cls == CLASS_FATAL) {
        snprintf(t->why, sizeof t->why, "effect failed with %s %s (%s; first job %s)",
                 r->sqlstate, r->message, classify_name(cls), j->key);
        return STEP_FATAL;
    }
    if (cls == CLASS_INFRA || cls == CLASS_NONE)
        cls = CLASS_TRANSIENT;
    park = cls == CLASS_PERMANENT || used >= t->c->max_attempts;
    if (cls == CLASS_TRANSIENT && park)
        code = IDEMQ_ERR_RETRIES_EXHAUSTED;
    if (!park)
        delay = backoff_delay_ms(used, t->c->base_delay_ms, t->c->max_delay_ms,
                                 (enum backoff_jitter)t->c->jitter_mode, &t->rng);
    if (ledger_txn_record_failure(t->lt, j, r, classify_name(cls), idemq_err_name(code), park,
                                  delay, &e))
        return from_error(t, &e, "record_failure");
    if (park) {
        json_int_t pid = json_integer_value(json_object_get(r->park, "park_id"));
        pgq_settle_done(&t->st, (long long)j->tag, (long long)pid);
        t->pend.parked++;
        note_fate(t, j, TRACE_PARKED, r->attempt);
    } else {
        char err[600];
        snprintf(err, sizeof err, "%s %s", r->sqlstate, r->message);
        if (!pgq_settle_retry(&t->st, (long long)j->tag, j->key, delay, true, err)) {
            snprintf(t->why, sizeof t->why, "out of memory");
            return STEP_BACKOFF;
        }
        t->pend.retried++;
        note_fate(t, j, TRACE_RETRY, r->attempt);
    }
    log_job(park ? LOG_LVL_WARN : LOG_LVL_INFO, j->key, j->tag, r->attempt,
            "%s error %s: %s -> %s (%ld ms)", classify_name(cls), r->sqlstate, r->message,
            park ? "parked" : "retry in", delay);
    return STEP_OK;
}

/* A row that did not decode, inside the transaction: parked, row gone. */
static enum step park_undecoded(struct pgq_thread *t, struct job *j, const char *code,
                                const char *reason)
{
    struct ledger_db_error e;
    json_t *park = NULL;
    json_int_t pid;
    if (ledger_txn_park_message(t->lt, j, code, reason, true, &park, &e))
        return from_error(t, &e, "park_message");
    pid = json_integer_value(json_object_get(park, "park_id"));
    json_decref(park);
    pgq_settle_done(&t->st, (long long)j->tag, (long long)pid);
    t->pend.parked++;
    note_fate(t, j, TRACE_PARKED, 1);
    log_job(LOG_LVL_WARN, j->has_key ? j->key : NULL, j->tag, 1, "parked %s: %s", code, reason);
    return STEP_OK;
}

/* What the ledger made of one applied job, inside the transaction. */
static enum step settle_one(struct pgq_thread *t, struct job *j, struct ledger_result *r)
{
    json_int_t pid;
    switch (r->outcome) {
    case LEDGER_APPLIED:
        pgq_settle_done(&t->st, (long long)j->tag, 0);
        t->pend.applied++;
        note_fate(t, j, TRACE_APPLIED, r->attempt);
        return STEP_OK;
    case LEDGER_DUPLICATE:
        pgq_settle_done(&t->st, (long long)j->tag, 0);
        t->pend.duplicates++;
        note_fate(t, j, TRACE_DUPLICATE, 0);
        return STEP_OK;
    case LEDGER_REPARK: /* parked before: the park row is its dead letter */
        pid = json_integer_value(json_object_get(r->park, "park_id"));
        pgq_settle_done(&t->st, (long long)j->tag, (long long)pid);
        t->pend.duplicates++;
        note_fate(t, j, TRACE_DUPLICATE, 0);
        return STEP_OK;
    case LEDGER_EARLY:   /* its key waits for a retry: this row waits as long, no attempt */
    case LEDGER_DEFERRED: /* lanes only: not an input of this transport; look again later */
    case LEDGER_HELD:
        if (!pgq_settle_retry(&t->st, (long long)j->tag, j->key,
                              r->outcome == LEDGER_EARLY ? r->delay_ms : 1000, false,
                              r->message[0] ? r->message : "back before its retry time")) {
            snprintf(t->why, sizeof t->why, "out of memory");
            return STEP_BACKOFF;
        }
        return STEP_OK;
    case LEDGER_CONFLICT:
        return park_undecoded(t, j, "key_conflict", r->message);
    case LEDGER_ERROR:
        return failure(t, j, r, IDEMQ_OK);
    case LEDGER_OUTSIDE:
        return failure(t, j, r, IDEMQ_ERR_OUTSIDE_WINDOW);
    }
    return STEP_OK;
}

/*
 * Records a whole-call failure (call, e.g. a statement timeout, which no
 * subtransaction catches) as the attempt of the one row (id) whose apply
 * it was, in a transaction of its own: the row taken again, its key
 * claimed (ledger_txn_claim_failed), then retried or parked by class like
 * any failure. Without this a job that always outlives the statement
 * timeout would be taken again forever and never parked.
 */
static enum step record_call_failure(struct pgq_thread *t, int i, long long id,
                                     const struct ledger_db_error *call)
{
    const struct conf_input *in = &t->view.inputs[i];
    struct job *j = &t->jobs[0];
    struct ledger_result *r = &t->res[0];
    struct ledger_db_error e;
    enum step s = STEP_OK;
    bool found = false;
    long long settle_ns;

    pgq_settle_reset(&t->st);
    memset(&t->pend, 0, sizeof t->pend);
    if (ledger_db_exec(t->db, "BEGIN", &e))
        return from_error(t, &e, "BEGIN");
    if (pgq_take_row(t->db, in, i, id, j, &found, &e)) {
        s = from_error(t, &e, "queue_take_row");
        goto rollback;
    }
    if (!found) /* gone, or another worker has it */
        goto rollback;
    note_fate(t, j, TRACE_HELD, 0);
    if (j->decode_err != IDEMQ_OK) {
        s = park_undecoded(t, j, idemq_err_name(j->decode_err), j->reason);
    } else if (ledger_txn_claim_failed(t->lt, j, r, &e)) {
        s = from_error(t, &e, "claim_failed");
    } else if (r->outcome == LEDGER_ERROR) {
        snprintf(r->sqlstate, sizeof r->sqlstate, "%s", call->sqlstate);
        snprintf(r->message, sizeof r->message, "%s", call->message);
        s = failure(t, j, r, IDEMQ_OK);
    } else { /* settled meanwhile: nothing to run */
        pgq_settle_done(&t->st, (long long)j->tag, 0);
        t->pend.duplicates++;
        note_fate(t, j, TRACE_DUPLICATE, 0);
    }
    if (s != STEP_OK)
        goto rollback;
    settle_ns = mono_ns();
    if (pgq_settle(t->db, &t->st, &e)) {
        s = from_error(t, &e, "queue_settle");
        goto rollback;
    }
    if (ledger_db_exec(t->db, "COMMIT", &e)) {
        s = from_error(t, &e, "COMMIT");
        goto rollback;
    }
    t->pend.admitted = 1;
    publish(t, i);
    export_spans(t, in, 1, settle_ns);
    ledger_txn_result_clear(r);
    return STEP_OK;
rollback:
    ledger_txn_result_clear(r);
    if (PQstatus(t->db) == CONNECTION_OK)
        PQclear(ledger_db_exec_raw(t->db, "ROLLBACK"));
    return s;
}

/*
 * One take of provider input i (pgq_lease.h): rows leased in a committed
 * statement, each decoded job handed to the provider flow (its decision
 * comes from lease_poll); a row that did not decode is parked and deleted
 * in a transaction of its own, as batch() parks one.
 */
static enum step lease_batch(struct pgq_thread *t, int i, int *took)
{
    const struct conf_input *in = &t->view.inputs[i];
    struct ledger_db_error e;
    enum step s = STEP_OK;
    int room = pgq_lease_room(t->pl, i), n = 0, bad = 0, expired = 0;
    idemq_err_t err;

    *took = 0;
    if (room <= 0)
        return STEP_OK;
    if ((err = pgq_lease_take(t->pl, t->db, in, i, t->jobs,
                              room < take_limit(t) ? room : take_limit(t), &n, &expired, &e)))
        return err == IDEMQ_ERR_NOMEM ? (snprintf(t->why, sizeof t->why, "%s", e.message),
                                         STEP_BACKOFF)
                                      : from_error(t, &e, "queue_lease");
    gate_wait(n); /* consumer.max_rate: before the calls (the leases run meanwhile) */
    for (int k = 0; k < n; k++) {
        struct job *j = &t->jobs[k];
        note_fate(t, j, TRACE_HELD, 0);
        if (j->decode_err != IDEMQ_OK) {
            pgq_lease_forget(t->pl, (long long)j->tag);
            bad++;
        } else if (pgq_lease_start(t->pl, t->db, j) != IDEMQ_OK) {
            log_job(LOG_LVL_WARN, j->key, j->tag, 0,
                    "provider flow could not take the job (out of memory): its lease runs out");
        }
    }
    *took = n;
    memset(&t->pend, 0, sizeof t->pend);
    t->pend.admitted = n; /* the lease's statement committed */
    publish(t, i);
    if (!bad)
        return STEP_OK;
    pgq_settle_reset(&t->st);
    if (ledger_db_exec(t->db, "BEGIN", &e))
        return from_error(t, &e, "BEGIN");
    for (int k = 0; k < n && s == STEP_OK; k++)
        if (t->jobs[k].decode_err != IDEMQ_OK)
            s = park_undecoded(t, &t->jobs[k], idemq_err_name(t->jobs[k].decode_err),
                               t->jobs[k].reason);
    if (s == STEP_OK && pgq_settle(t->db, &t->st, &e))
        s = from_error(t, &e, "queue_settle");
    if (s == STEP_OK && ledger_db_exec(t->db, "COMMIT", &e))
        s = from_error(t, &e, "COMMIT");
    if (s == STEP_OK)
        publish(t, i); /* the undecodable rows' parks */
    memset(&t->pend, 0, sizeof t->pend);
    if (s != STEP_OK && PQstatus(t->db) == CONNECTION_OK)
        PQclear(ledger_db_exec_raw(t->db, "ROLLBACK"));
    return s; /* rolled back: their leases run out, and they are taken again */
}

/* Drives the provider calls of leased rows for up to wait_ms and settles
 * the rows decided; *did counts them. */
static enum step lease_poll(struct pgq_thread *t, int wait_ms, int *did)
{
    struct pgq_lease_counts c;
    struct ledger_db_error e;
    enum classify_class fail;
    idemq_err_t err;

    *did = 0;
    c.by = t->lease_by;
    c.n_by = t->view.n_inputs;
    err = pgq_lease_poll(t->pl, t->db, wait_ms, &c, &fail, t->why, sizeof t->why, &e);
    /* each settle committed on its own: published by input */
    for (int i = 0; i < t->view.n_inputs; i++) {
        const struct pgq_lease_tally *b = &t->lease_by[i];
        if (!(b->applied | b->duplicates | b->retried | b->parked))
            continue;
        memset(&t->pend, 0, sizeof t->pend);
        t->pend.applied = b->applied;
        t->pend.duplicates = b->duplicates;
        t->pend.retried = b->retried;
        t->pend.parked = b->parked;
        publish(t, i);
    }
    *did = (int)(c.applied + c.duplicates + c.retried + c.parked);
    if (err)
        return err == IDEMQ_ERR_NOMEM ? (snprintf(t->why, sizeof t->why, "%s", e.message),
                                         STEP_BACKOFF)
                                      : from_error(t, &e, "queue_lease_settle");
    return fail == CLASS_FATAL ? STEP_FATAL : fail == CLASS_INFRA ? STEP_INFRA : STEP_OK;
}

/* One batch of input i: *took rows committed. */
static enum step batch(struct pgq_thread *t, int i, int *took)
{
    const struct conf_input *in = &t->view.inputs[i];
    struct ledger_db_error e;
    enum step s = STEP_OK;
    int n = 0, ng = 0;
    long long settle_ns;

    if (CONF_INPUT_PROVIDER(in))
        return lease_batch(t, i, took);
    *took = 0;
    pgq_settle_reset(&t->st);
    memset(&t->pend, 0, sizeof t->pend);
    if (ledger_db_exec(t->db, "BEGIN", &e))
        return from_error(t, &e, "BEGIN");
    /* While a backlog drains (the last take was full), from where the
     * last take ended, which skips the index entries of rows settled since
     * (dead, and kept while some transaction holds the xmin horizon).
     * From the head otherwise, when that finds nothing, and at least once
     * every PGQ_HEAD_EVERY_MS: rows become ready behind the position (a
     * producer's transaction that began earlier commits later). */
    if (t->pos[i].set && now_ms() - t->head_at[i] >= PGQ_HEAD_EVERY_MS)
        t->pos[i].set = false;
    for (;;) {
        bool from_head = !t->pos[i].set;
        if (from_head)
            t->head_at[i] = now_ms();
        if (pgq_take_from(t->db, in, i, &t->pos[i], t->jobs, take_limit(t), &n, &e)) {
            t->pos[i].set = false;
            s = from_error(t, &e, "queue_take");
            goto rollback;
        }
        if (n > 0 || from_head)
            break;
        t->pos[i].set = false;
    }
    if (n < take_limit(t))
        t->pos[i].set = false; /* caught up: the next take looks from the head */
    if (n == 0) {
        if (ledger_db_exec(t->db, "COMMIT", &e))
            return from_error(t, &e, "COMMIT");
        return STEP_OK;
    }
    gate_wait(n); /* the rows stay locked by this transaction meanwhile */
    for (int k = 0; k < n; k++) {
        note_fate(t, &t->jobs[k], TRACE_HELD, 0);
        if (t->jobs[k].decode_err == IDEMQ_OK)
            t->good[ng++] = &t->jobs[k];
    }
    if (ng) {
        if (ledger_txn_apply(t->lt, t->good, ng, t->res, &e)) {
            s = from_error(t, &e, "apply_batch");
            if (s == STEP_BACKOFF && n > 1) {
                t->solo = true; /* one row at a time, so one bad job holds back no other */
            } else if (s == STEP_BACKOFF) { /* this row's own call failed: its attempt */
                long long id = (long long)t->jobs[0].tag;
                for (int k = 0; k < ng; k++)
                    ledger_txn_result_clear(&t->res[k]);
                if (PQstatus(t->db) == CONNECTION_OK)
                    PQclear(ledger_db_exec_raw(t->db, "ROLLBACK"));
                t->pos[i].set = false;
                s = record_call_failure(t, i, id, &e);
                if (s == STEP_OK)
                    *took = 1;
                return s;
            }
            goto rollback;
        }
        for (int k = 0; k < ng; k++)
            if ((s = settle_one(t, t->good[k], &t->res[k])) != STEP_OK)
                goto rollback;
    }
    for (int k = 0; k < n; k++)
        if (t->jobs[k].decode_err != IDEMQ_OK &&
            (s = park_undecoded(t, &t->jobs[k], idemq_err_name(t->jobs[k].decode_err),
                                t->jobs[k].reason)) != STEP_OK)
            goto rollback;
    settle_ns = mono_ns();
    if (pgq_settle(t->db, &t->st, &e)) {
        s = from_error(t, &e, "queue_settle");
        goto rollback;
    }
    if (ledger_db_exec(t->db, "COMMIT", &e)) {
        /* an ambiguous commit: the ledger absorbs a second apply of a key */
        s = from_error(t, &e, "COMMIT");
        goto rollback;
    }
    t->solo = false;
    *took = n;
    t->pend.admitted = n;
    publish(t, i);
    export_spans(t, in, n, settle_ns);
    for (int k = 0; k < ng; k++)
        ledger_txn_result_clear(&t->res[k]);
    return STEP_OK;
rollback:
    t->pos[i].set = false; /* the rows taken are free again, behind the position */
    for (int k = 0; k < ng; k++)
        ledger_txn_result_clear(&t->res[k]);
    if (PQstatus(t->db) == CONNECTION_OK)
        PQclear(ledger_db_exec_raw(t->db, "ROLLBACK"));
    return s;
}

/* Whether why differs from the NOT READY reason logged last (then it is
 * remembered): each reason is logged once. */
static bool new_reason(struct pgq_thread *t)
{
    if (strcmp(t->why, t->logged) == 0)
        return false;
    snprintf(t->logged, sizeof t->logged, "%s", t->why);
    return true;
}

/* A stop: nothing new is sent; the calls in flight are recorded and their
 * rows settled (within the longest lease), then the leases of rows never
 * started are given back. */
static void lease_stop(struct pgq_thread *t)
{
    long long until;
    if (!t->pl)
        return;
    until = now_ms() + pgq_lease_ms(t->pl);
    pgq_lease_drain(t->pl);
    while (pgq_lease_in_flow(t->pl) > 0 && now_ms() < until && t->db &&
           PQstatus(t->db) == CONNECTION_OK) {
        int settled;
        if (lease_poll(t, 100, &settled) != STEP_OK)
            break;
    }
    if (pgq_lease_in_flow(t->pl) == 0)
        pgq_lease_release(t->pl, t->db);
}

static void *run(void *arg)
{
    struct pgq_thread *t = arg;
    long long last_work = now_ms();
    long backoff_ms = 250;

    log_set_worker(t->id);
    ledger_db_set_call_timeout(t->c->call_timeout_ms);
    while (!sig_stop_requested()) {
        enum step s = connect(t);
        int did = 0;
        for (int i = 0; s == STEP_OK && i < t->view.n_inputs && !sig_stop_requested(); i++) {
            int took;
            s = batch(t, i, &took);
            did += took;
        }
        if (s == STEP_OK && pgq_lease_pending(t->pl) > 0) {
            int settled;
            s = lease_poll(t, did ? 0 : 100, &settled);
            did += settled;
        }
        if (s != STEP_OK) {
            if (!t->unready) {
                t->unready = true;
                atomic_fetch_add(&g.unready, 1);
                atomic_fetch_add(&g.not_ready, 1);
            }
            if (new_reason(t))
                log_warn("pgq worker %d: NOT READY: %s (trying again with backoff)", t->id,
                         t->why);
            if (s == STEP_INFRA || s == STEP_FATAL)
                drop_db(t);
            nap(backoff_ms);
            backoff_ms = backoff_ms * 2 > t->c->reconnect_max_ms ? t->c->reconnect_max_ms
                                                                  : backoff_ms * 2;
            continue;
        }
        if (t->unready) {
            t->unready = false;
            atomic_fetch_sub(&g.unready, 1);
        }
        if (t->logged[0]) {
            log_info("pgq worker %d: ready", t->id);
            t->logged[0] = '\0';
        }
        backoff_ms = 250;
        if (did) {
            last_work = now_ms();
            continue;
        }
        if (pgq_lease_in_flow(t->pl) > 0) /* calls in flight: lease_poll waits */
            continue;
        if (t->until_idle_ms > 0 && now_ms() - last_work >= t->until_idle_ms)
            break;
        {
            long due = pgq_next_due_ms(t->db, &t->view);
            long wait = due < 0 || due > PGQ_IDLE_MAX_MS ? PGQ_IDLE_MAX_MS : due;
            if (wait > 0)
                pgq_wait(t->db, wait);
        }
    }
    lease_stop(t);
    if (t->unready)
        atomic_fetch_sub(&g.unready, 1);
    drop_db(t);
    return NULL;
}

idemq_err_t pgq_worker_start(const struct conf *c, long until_idle_ms, struct pgq_workers **out,
                             char *errbuf, size_t errlen)
{
    struct pgq_workers *w;
    int cap = c->batch_max > 0 ? c->batch_max : 1;

    *out = NULL;
    if (c->n_pg_inputs == 0)
        return IDEMQ_OK;
    if (!(w = calloc(1, sizeof *w)) || !(w->t = calloc((size_t)c->workers, sizeof *w->t))) {
        free(w);
        snprintf(errbuf, errlen, "out of memory");
        return IDEMQ_ERR_NOMEM;
    }
    w->n = c->workers;
    if (!g.in) { /* the first start: the inputs /metrics shows */
        struct conf v = conf_pg_view(c);
        if (!(g.in = calloc((size_t)v.n_inputs, sizeof *g.in))) {
            free(w->t);
            free(w);
            snprintf(errbuf, errlen, "out of memory");
            return IDEMQ_ERR_NOMEM;
        }
        for (int i = 0; i < v.n_inputs; i++)
            g.in[i].input = v.inputs[i].name;
        g.n = v.n_inputs;
        atomic_store(&g.on, true);
    }
    for (int i = 0; i < w->n; i++) {
        struct pgq_thread *t = &w->t[i];
        t->id = i;
        t->c = c;
        t->view = conf_pg_view(c);
        t->until_idle_ms = until_idle_ms;
        t->cap = cap;
        t->rng = 0x9E3779B97F4A7C15ULL ^ ((uint64_t)now_ms() << 8) ^ (uint64_t)(i + 1);
        if (!(t->jobs = calloc((size_t)cap, sizeof *t->jobs)) ||
            !(t->good = calloc((size_t)cap, sizeof *t->good)) ||
            !(t->res = calloc((size_t)cap, sizeof *t->res)) ||
            !(t->fate = calloc((size_t)cap, sizeof *t->fate)) ||
            !(t->attempt = calloc((size_t)cap, sizeof *t->attempt)) ||
            !(t->pos = calloc((size_t)t->view.n_inputs, sizeof *t->pos)) ||
            !(t->head_at = calloc((size_t)t->view.n_inputs, sizeof *t->head_at)) ||
            !(t->lease_by = calloc((size_t)t->view.n_inputs, sizeof *t->lease_by)) ||
            !pgq_settle_init(&t->st, cap)) {
            snprintf(errbuf, errlen, "out of memory");
            goto fail;
        }
        for (int k = 0; k < cap; k++)
            job_init(&t->jobs[k]);
        if (pgq_lease_new(&t->view, i, &t->pl, errbuf, errlen) != IDEMQ_OK)
            goto fail;
    }
    for (int i = 0; i < w->n; i++) {
        if (pthread_create(&w->t[i].thread, NULL, run, &w->t[i]) != 0) {
            snprintf(errbuf, errlen, "cannot start PostgreSQL queue worker thread %d", i);
            sig_request_stop();
            goto fail;
        }
        w->t[i].started = true;
    }
    *out = w;
    return IDEMQ_OK;
fail:
    pgq_worker_join(w, NULL);
    return IDEMQ_ERR_INTERNAL;
}

void pgq_worker_join(struct pgq_workers *w, struct pgq_worker_totals *tot)
{
    if (tot)
        memset(tot, 0, sizeof *tot);
    if (!w)
        return;
    for (int i = 0; i < w->n; i++) {
        struct pgq_thread *t = &w->t[i];
        if (t->started)
            pthread_join(t->thread, NULL);
        if (tot) {
            tot->taken += atomic_load(&t->taken);
            tot->applied += atomic_load(&t->applied);
            tot->duplicates += atomic_load(&t->duplicates);
            tot->retried += atomic_load(&t->retried);
            tot->parked += atomic_load(&t->parked);
            tot->failed += t->failed;
        }
        if (t->jobs)
            for (int k = 0; k < t->cap; k++)
                job_destroy(&t->jobs[k]);
        free(t->jobs);
        free(t->good);
        free(t->res);
        free(t->fate);
        free(t->attempt);
        free(t->pos);
        free(t->head_at);
        free(t->lease_by);
        pgq_settle_free(&t->st);
        pgq_lease_free(t->pl);
    }
    free(w->t);
    free(w);
}

int pgq_worker_unready(void) { return atomic_load(&g.unready); }

int pgq_worker_counts(struct pgq_input_counts *out, int max, long *not_ready)
{
    int n;
    *not_ready = atomic_load(&g.not_ready);
    if (!atomic_load(&g.on))
        return 0;
    n = g.n < max ? g.n : max;
    for (int i = 0; i < n; i++) {
        struct pgq_input_counts *o = &out[i];
        o->input = g.in[i].input;
        o->admitted = atomic_load(&g.in[i].admitted);
        o->applied = atomic_load(&g.in[i].applied);
        o->duplicates = atomic_load(&g.in[i].duplicates);
        o->retried = atomic_load(&g.in[i].retried);
        o->parked = atomic_load(&g.in[i].parked);
        o->completed = o->applied + o->duplicates + o->parked;
    }
    return n;
}
