/*
 * celery_reply: the results of a committed batch's Celery tasks, sent the
 * way Celery's rpc:// backend reads them, to Celery's reply queues and
 * nowhere else. A reply_to is answered only when it is shaped like the
 * queue an rpc:// client consumes (a UUID, celery_reply_queue_ok); that
 * queue is bound to idemq's replies exchange (CELERY_REPLIES_EXCHANGE,
 * binding key = the queue's name) before its first reply, and the reply
 * is published there, never to the default exchange. An applied or
 * duplicate task is answered with the effect's first result (SUCCESS); a
 * parked one with FAILURE (exc_type IdemqParked, "idemq parked the task:
 * <code>: <reason>"); an expired one with REVOKED. A task retrying, held
 * for its eta, asking ignore_result, or taken by an observe-mode input gets
 * none. Replies go out after the batch's acknowledgements: the job is
 * committed, so a reply is best effort (a refused, nacked or unconfirmed
 * one is logged and counted, never retried, never holds a delivery).
 *
 * API: celery_reply_cache_init -> celery_reply_batch (per batch);
 *      celery_reply_queue_ok (pure).
 */
#ifndef IDEMQ_CELERY_REPLY_H
#define IDEMQ_CELERY_REPLY_H

#include <libpq-fe.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>

#include "broker.h"
#include "conf.h"
#include "idemq_err.h"
#include "job.h"
#include "settle.h"

/* Reply queues whose binding is remembered (per worker), and for how long. */
#define CELERY_REPLY_BOUND_MAX 256
#define CELERY_REPLY_BOUND_MS (10 * 60 * 1000)

/* What became of the replies (counters shared with /metrics; any thread reads). */
struct celery_reply_counts {
    atomic_long sent;      /* published and confirmed */
    atomic_long refused;   /* reply_to is not a Celery reply queue: not answered */
    atomic_long failed;    /* bind refused, publish nacked or unconfirmed, result unread */
    atomic_long observe;   /* due on an observe-mode input: never answered */
};

/* The reply queues this worker bound (a bounded cache, oldest replaced). */
struct celery_reply_cache {
    char name[CELERY_REPLY_BOUND_MAX][40];
    long long at_ms[CELERY_REPLY_BOUND_MAX];
    int n;
};

/* Empties r. Cannot fail. */
void celery_reply_cache_init(struct celery_reply_cache *r);

/*
 * True if reply_to names a queue Celery's rpc:// backend consumes: its
 * app's thread oid, a UUID in Python's str() form (8-4-4-4-12 lowercase
 * hex, 36 bytes). Pure.
 */
bool celery_reply_queue_ok(const char *reply_to);

/*
 * Answers the due jobs of jobs[0..n) (committed, with their plans, and
 * already acknowledged): reads their results back (idemq.job_info), binds
 * each reply queue not bound in the last CELERY_REPLY_BOUND_MS to the
 * replies exchange (on a channel of its own: a refusal closes nothing that
 * holds deliveries), publishes, and waits up to confirm_ms for the
 * confirms. Every failure is logged and counted in counts and the reply
 * dropped. IDEMQ_OK, or IDEMQ_ERR_BROKER / _TIMEOUT when the connection
 * failed or a confirm did not come (drop it: nothing is held for it), or
 * IDEMQ_ERR_DB_CONN when the database session is gone; why says what.
 * The worker's thread, outside any transaction.
 */
idemq_err_t celery_reply_batch(struct celery_reply_cache *bound, struct broker *b, PGconn *db,
                               const struct conf *c, const struct job *jobs,
                               const struct plan *plans, int n, int confirm_ms,
                               struct celery_reply_counts *counts, char *why,
                               size_t whylen) IDEMQ_MUSTCHECK;

#endif
