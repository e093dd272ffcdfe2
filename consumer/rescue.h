/*
 * rescue: the consumer side of retry copies. A retry waits on a
 * broker delay bucket, and the bucket's copy can be lost (a classic bucket
 * dead-letters at most once; a bucket can be purged or deleted). The ledger
 * keeps each retrying job's message (idemq.retry_copies); between batches a
 * worker calls rescue_tick, which now and then runs one rescuer pass: the
 * copies of jobs still retrying long after their retry time (more than
 * retry.rescue_after_s) are published again, straight to their work queue
 * through the default exchange, mandatory and confirmed, then recorded in
 * idemq.retry_rescues. Not while the work queue holds a backlog (more than
 * batch_max ready messages): a copy may then just be waiting at its tail. One replica at a time per queue (an advisory lock
 * held for the whole pass; ledger/ledger_rescue.h). A rescue that was not
 * needed (the bucket's copy was only slow) adds a duplicate copy, which the
 * ledger absorbs.
 *
 * API: a struct rescue zeroed with its session -> rescue_tick between
 *      batches (no transaction open, no confirm outstanding).
 */
#ifndef IDEMQ_RESCUE_H
#define IDEMQ_RESCUE_H

#include <libpq-fe.h>
#include <stddef.h>
#include <stdint.h>

#include "broker.h"
#include "conf.h"
#include "idemq_err.h"

#define RESCUE_MAX_PER_PASS 100 /* copies published again per pass at most */

/* Per worker session; all zero is the initial state (a pass at the first tick). */
struct rescue {
    long long next_ms; /* CLOCK_MONOTONIC ms of the next pass */
    uint64_t rng;      /* jitter of the pass interval */
    long rescued;      /* copies published again and recorded by this session */
    long unopened;     /* sealed copies this session could not open (reported, kept) */
};

/*
 * Runs a rescuer pass when one is due (every rescue_after_s / 10, between
 * 1 and 30 s, jittered), else returns at once. Off when c->rescue_after_s is
 * 0, or without both connections. Returns IDEMQ_OK (also when the pass
 * failed on a statement: logged, tried again next pass), IDEMQ_ERR_DB_CONN
 * when the database connection is gone, IDEMQ_ERR_BROKER when a republish
 * was not confirmed or the broker connection failed (nothing recorded; the
 * caller reconnects), with why set for both. The worker thread that owns db
 * and b; outside any transaction, with no publish awaiting its confirm.
 */
idemq_err_t rescue_tick(struct rescue *r, const struct conf *c, PGconn *db, struct broker *b,
                        char *why, size_t whylen) IDEMQ_MUSTCHECK;

#endif
