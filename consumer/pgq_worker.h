/*
 * pgq_worker: the worker threads of PostgreSQL queue inputs (transport =
 * "postgres"). Each thread owns one PostgreSQL session and runs
 *   BEGIN -> take ready rows (pgq_take: FOR UPDATE SKIP LOCKED) -> claim
 *   and apply each key in the ledger (idemq.apply_batch) -> classify and
 *   record failures (retry held in the row, or park) -> settle the rows ->
 *   COMMIT
 * so the claim of the row, the claim of the key, the effect and the row's
 * end share one transaction: a crash rolls all of it back and the rows are
 * free again. Idle, it waits on LISTEN/NOTIFY (and on the earliest held
 * retry's due time) without polling.
 *
 * API: pgq_worker_start (main thread, after sig_install) -> ... ->
 *      pgq_worker_join (main thread: waits, sums the counts, frees).
 */
#ifndef IDEMQ_PGQ_WORKER_H
#define IDEMQ_PGQ_WORKER_H

#include "conf.h"
#include "idemq_err.h"

struct pgq_workers;

/* What the threads did, summed at join. */
struct pgq_worker_totals {
    long taken, applied, duplicates, retried, parked;
    int failed; /* threads that ended with an error */
};

/* One transaction's or one input's counts: rows taken (admitted), and what
 * became of them: applied, duplicates, retried (held in the row), parked.
 * Rows whose key waits (taken, put back without an attempt) are admitted
 * and nothing else. */
struct pgq_count {
    long admitted, applied, duplicates, retried, parked;
};

/* An input's counts for /metrics: completed = applied + duplicates + parked
 * (the rows that left the queue). */
struct pgq_input_counts {
    const char *input;
    long admitted, completed, applied, duplicates, retried, parked;
};

/*
 * Starts conf.workers threads over c's PostgreSQL queue inputs (none: *out
 * is NULL and IDEMQ_OK). until_idle_ms > 0: each thread returns once no row
 * came for that long. c must outlive the threads. IDEMQ_OK, or
 * IDEMQ_ERR_NOMEM / IDEMQ_ERR_INTERNAL with errbuf set (nothing left
 * running).
 */
idemq_err_t pgq_worker_start(const struct conf *c, long until_idle_ms, struct pgq_workers **out,
                             char *errbuf, size_t errlen) IDEMQ_MUSTCHECK;

/* Waits for every thread (they stop on sig_stop_requested or when idle),
 * fills *t and frees w. NULL is fine (zero totals). Main thread. */
void pgq_worker_join(struct pgq_workers *w, struct pgq_worker_totals *t);

struct rate_gate;

/* The token bucket of consumer.max_rate the broker workers share (NULL:
 * no limit), for the threads pgq_worker_start starts next: each reserves
 * one token per row taken before it applies them. Main thread, before
 * pgq_worker_start. */
void pgq_worker_set_gate(struct rate_gate *gate);

/* Fills out[0..] with up to max inputs' counts so far (committed
 * transactions only); returns how many (0 when no PostgreSQL queue worker
 * ever started). *not_ready: times a worker became NOT READY.
 * Thread-safe: for /metrics. */
int pgq_worker_counts(struct pgq_input_counts *out, int max, long *not_ready);

/* How many PostgreSQL queue worker threads are NOT READY now (backing off:
 * the database down, an effect check failing). For /ready. */
int pgq_worker_unready(void);

#endif
