/*
 * batch: the transactions of one collected batch, from decoded deliveries
 * to committed plans (settle.h). It owns the ladder that makes the worker
 * total: a batch runs as one transaction; a whole-call failure (the apply
 * call itself failed, not one job's effect) is retried, then the batch is
 * isolated job by job; a job whose own call still fails has the failure
 * recorded as an attempt (retry or park by class); a job whose failure
 * cannot even be recorded is parked with what can be stored (body prefix,
 * full SHA-256, no headers) as `unprocessable`; and a delivery that cannot
 * be parked in the ledger either is rejected to the broker's dead-letter
 * path. Only the database or the deploy being broken (infra, fatal) and
 * contention that outlives its retries (lock or statement timeouts,
 * deadlocks, serialization failures while recording a failure) do not end
 * in a commit: the first two stop the batch (nothing more is committed);
 * contention releases just that job (SETTLE_RELEASE) while its batch-mates
 * go on, and the caller then drops the broker connection so the broker
 * redelivers it, and backs off.
 *
 * Deliveries of observe-mode inputs share the transaction but
 * not the apply path: ledger_txn_observe records what apply mode would do,
 * no effect runs, nothing is parked, every one is SETTLE_ACK (contention
 * aside: SETTLE_RELEASE); see observe.h.
 *
 * API: batch_init -> per batch: fill jobs[0..n) -> batch_process ->
 *      settle plans[0..committed) -> ... -> batch_free. One worker thread.
 */
#ifndef IDEMQ_BATCH_H
#define IDEMQ_BATCH_H

#include <libpq-fe.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "conf.h"
#include "idemq_err.h"
#include "job.h"
#include "ledger_db.h"
#include "ledger_outbox.h"
#include "ledger_txn.h"
#include "settle.h"

/* What a batch (or a connect step) came to, for the worker loop. */
enum batch_step {
    BATCH_OK = 0,      /* plans[0..n) committed */
    BATCH_INFRA,       /* database gone: reconnect both, nothing more committed */
    BATCH_FATAL,       /* deploy/config problem: stop consuming until fixed */
    BATCH_REDELIVER,   /* plans[0..n) committed, but some job is SETTLE_RELEASE
                        * (contention outlived its retries): settle, then drop
                        * the broker connection (it redelivers), back off */
};

enum batch_crash { BATCH_CRASH_NONE = 0, BATCH_CRASH_BEFORE_COMMIT, BATCH_CRASH_AFTER_COMMIT };

/* Waits ms while keeping the broker serviced (heartbeats). */
typedef void (*batch_nap_fn)(void *ctx, long ms);

struct batch {
    const struct conf *c;
    PGconn *db;              /* the worker's session (not owned) */
    struct ledger_txn *lt;   /* its ledger calls (not owned) */
    struct job *jobs;        /* [cap]: the batch, jobs[0..n) */
    struct plan *plans;      /* [cap] */
    struct job **good;       /* [cap] scratch */
    struct ledger_result *res; /* [cap] scratch */
    struct job **obs_jobs;   /* [cap] scratch: the jobs of observe-mode inputs */
    struct ledger_observed *obs; /* [cap] scratch: what observe_batch made of them */
    int n, cap;
    atomic_long *by_class;   /* failed attempts by enum classify_class (5) */
    uint64_t rng;
    bool drain_hint;         /* an ordered job was applied or parked */
    enum batch_crash crash;  /* test builds: IDEMQ_TEST_CRASH */
    batch_nap_fn nap;
    void *nap_ctx;
    atomic_llong *progress;  /* liveness: set to CLOCK_MONOTONIC ms at each commit */
    int ladder_depth;        /* for tests and logs: the deepest rung used */
    char why[512];           /* reason of the last non-OK step */
    uint64_t failed_tag;     /* BATCH_REDELIVER: the delivery whose own attempt failed
                              * (contention it could not outlast), 0 if none */
    struct ledger_db_error last_call; /* the last whole-call failure */
    struct ledger_db_error failure;   /* what rung 2 records as the attempt */
    /* the relay right after commit. With outbox_holder set and a
     * job of an `emits` input in the batch, each transaction's last
     * statement before COMMIT leases its publishable outbox rows to the
     * holder (ledger_outbox_take); the first commit's rows are kept in
     * taken, for the worker to publish before it acknowledges. */
    const char *outbox_holder; /* NULL: relay off */
    int outbox_lease_ms;
    struct outbox_rows taken;  /* rows leased by a committed transaction */
    bool outbox_rest;          /* rows emitted that are not in taken: a claim's */
};

/* Allocates room for cap jobs. false when out of memory (then batch_free). */
bool batch_init(struct batch *bt, const struct conf *c, int cap, atomic_long *by_class,
                uint64_t seed);

/* Frees what batch_init allocated (jobs included). */
void batch_free(struct batch *bt);

/*
 * Decodes and processes jobs[0..n): see the ladder above. Returns BATCH_OK
 * with plans[0..n) committed, or another step with *committed set to how
 * many leading jobs were committed anyway (their plans are valid and must
 * still be settled; the rest must not be). Needs bt->db and bt->lt. Never
 * aborts on an input, a database answer or a broker event.
 */
enum batch_step batch_process(struct batch *bt, int *committed);

#endif
