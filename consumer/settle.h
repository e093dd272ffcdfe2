/*
 * settle: what happens on the broker to the deliveries of a committed
 * transaction. Each job has a plan; settling a batch carries the plans out
 * in the only safe order: republish what must be republished (delay bucket
 * or dead-letter exchange, mandatory and confirmed), reject what the broker
 * must dead-letter itself, and acknowledge a delivery only once its
 * transaction committed and its republish, if any, was confirmed. The
 * broker operations come through struct settle_io, so the rules are unit
 * tested with a fake broker (tests/unit/check_settle.c).
 *
 * The total state machine: every result of every step ends in exactly one
 * of these plans (or, before any commit, in dropping the connection so the
 * broker redelivers):
 *   SETTLE_ACK    commit, then ack (applied, duplicate, deferred, stale;
 *                 every delivery of an observe-mode input)
 *   SETTLE_DELAY  commit, publish to a delay bucket, confirmed, then ack
 *   SETTLE_DEAD   commit (park row), publish to the dead-letter exchange,
 *                 confirmed, then ack
 *   SETTLE_REJECT commit (park row), then basic.reject without requeue: the
 *                 broker dead-letters what idemq could not decode
 *   SETTLE_HOLD   hold in place, unacknowledged (an ordered lane's retry)
 *   SETTLE_RELEASE nothing committed for it (contention outlived its
 *                 retries): left unacknowledged; the caller then drops the
 *                 connection so the broker redelivers it, and backs off
 *   SETTLE_NONE   nothing on the broker (a job taken from the ledger)
 *
 * API: settle_batch (after the commit) -> settle_count.
 */
#ifndef IDEMQ_SETTLE_H
#define IDEMQ_SETTLE_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "idemq_err.h"
#include "job.h"

enum settle_how {
    SETTLE_ACK = 0,
    SETTLE_DELAY,
    SETTLE_DEAD,
    SETTLE_REJECT,
    SETTLE_HOLD,
    SETTLE_RELEASE,
    SETTLE_NONE,
};

/* What a committed job's delivery is to become (filled by batch.c). */
struct plan {
    enum settle_how how;
    long delay_ms;   /* SETTLE_DELAY: clamped delay; SETTLE_HOLD: wait in place */
    int attempt;     /* attempt number recorded */
    json_t *park;    /* SETTLE_DEAD/REJECT: park facts (owned) */
    int outcome;     /* enum ledger_outcome of the job's claim */
    int held_lane;   /* isolating: the lane a SETTLE_HOLD job held, else 0 */
    bool key_reuse;  /* its key is applied with another body (counted) */
    int observed;    /* observe mode: its enum observe_outcome, 0 = applied
                      * mode; such a plan is SETTLE_ACK */
    int observe_code; /* observe mode: the would-park code (idemq_err_t), 0 = none */
};

/* Releases what a plan owns and zeroes it. */
void settle_plan_clear(struct plan *p);

/* The broker operations settling needs (adapters/broker.c in the daemon, a
 * model broker in tests). Each returns IDEMQ_OK or an error. */
struct settle_io {
    void *ctx;
    idemq_err_t (*publish_delay)(void *ctx, const struct job *j, long delay_ms, int attempt);
    idemq_err_t (*publish_dead)(void *ctx, const struct job *j, const json_t *park);
    idemq_err_t (*wait_confirms)(void *ctx); /* every publish since the last wait */
    idemq_err_t (*settle)(void *ctx, uint64_t tag); /* mark settled, ack later */
    idemq_err_t (*reject)(void *ctx, uint64_t tag);
    idemq_err_t (*flush)(void *ctx); /* send the acks the settled tags allow */
};

enum settle_result {
    SETTLE_DONE = 0,      /* every plan carried out */
    SETTLE_UNCONFIRMED,   /* a republish was not confirmed: those originals stay
                           * unacknowledged; drop the connection */
    SETTLE_BROKER_FAILED, /* the connection failed: drop it */
};

/*
 * Carries out plans[0..n) for jobs[0..n) (their transaction committed;
 * SETTLE_HOLD jobs were already moved back into their lanes by the caller,
 * their slots are empty). Deliveries needing no republish are settled at
 * once; republished ones only after every confirm arrived; then the acks go
 * out. SETTLE_DONE means every SETTLE_DEAD copy was confirmed (its park can
 * be noted as dead-lettered). why[] says what failed.
 */
enum settle_result settle_batch(const struct settle_io *io, struct job *jobs,
                                const struct plan *plans, int n, char *why, size_t whylen);

#endif
