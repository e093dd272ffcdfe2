/*
 * sqs_worker: the worker threads of Amazon SQS inputs (transport = "sqs").
 * Each thread owns one PostgreSQL session and one SQS client per input,
 * and runs
 *   ReceiveMessage (long poll, up to 10) -> jobs -> batch_process (claim and
 *   apply each key in the ledger, record failures, park; COMMIT) ->
 *   settle: DeleteMessageBatch what is done, ChangeMessageVisibility what
 *   is retried (the backoff), SendMessage to the dead-letter queue what is
 *   parked (confirmed, then deleted)
 * so a message is deleted only after its transaction committed. While a
 * batch is in flight a second thread (the lease) extends the messages'
 * visibility every half of visibility_timeout_s, so a slow effect is never
 * raced by a redelivery; a crashed worker's messages reappear after it.
 * SQS's own failures (throttling, 5xx, an endpoint down, refused
 * credentials) use no attempt and delete nothing: NOT READY, back off.
 *
 * API: sqs_worker_start (main thread, after sig_install) -> ... ->
 *      sqs_worker_join (main thread: waits, sums the counts, frees).
 */
#ifndef IDEMQ_SQS_WORKER_H
#define IDEMQ_SQS_WORKER_H

#include <stdbool.h>

#include "conf.h"
#include "idemq_err.h"

struct sqs_workers;

/* What the threads did, summed at join. */
struct sqs_worker_totals {
    long received, applied, duplicates, retried, parked;
    long delete_failed; /* deletes SQS refused (an expired receipt): a later duplicate */
    long extended;      /* visibility extensions of messages in flight */
    int failed;         /* threads that ended with an error */
};

/*
 * Starts conf.workers threads over c's SQS inputs (none: *out is NULL and
 * IDEMQ_OK). until_idle_ms > 0: each thread returns once no message came
 * for that long. c must outlive the threads. IDEMQ_OK, or IDEMQ_ERR_NOMEM
 * / IDEMQ_ERR_CONFIG (no credentials) / IDEMQ_ERR_INTERNAL with errbuf set
 * (nothing left running).
 */
idemq_err_t sqs_worker_start(const struct conf *c, long until_idle_ms, struct sqs_workers **out,
                             char *errbuf, size_t errlen) IDEMQ_MUSTCHECK;

/* Waits for every thread, fills *t and frees w. NULL is fine (zero
 * totals). Main thread. */
void sqs_worker_join(struct sqs_workers *w, struct sqs_worker_totals *t);

/* The counts of every SQS worker of the process so far, and how many times
 * one was NOT READY (a receive or the database failed); false (all zero)
 * when no SQS worker ever started. Thread-safe: for /metrics. */
bool sqs_worker_counts(struct sqs_worker_totals *t, long *not_ready);

/* How many SQS worker threads are backing off (NOT READY) now. For /ready. */
int sqs_worker_unready(void);

#endif
