/*
 * celery_reply: the results of a committed batch's Celery tasks (issue 19),
 * sent the way Celery's rpc:// backend expects them: to the default
 * exchange with routing key reply_to and the task's correlation_id, before
 * the deliveries are acknowledged. An applied or duplicate task is answered
 * with the effect's first result (SUCCESS, read back from the ledger); a
 * parked one with FAILURE (exc_type IdemqParked); an expired one with
 * REVOKED (celery.exceptions.TaskRevokedError). A task retrying, held for
 * its eta, or asking ignore_result gets none. Replies are confirmed but not
 * mandatory: a client gone is no reason to hold the batch.
 *
 * API: celery_reply_batch (one worker thread, after the commit, outside any
 * transaction).
 */
#ifndef IDEMQ_CELERY_REPLY_H
#define IDEMQ_CELERY_REPLY_H

#include <libpq-fe.h>
#include <stddef.h>

#include "broker.h"
#include "conf.h"
#include "idemq_err.h"
#include "job.h"
#include "settle.h"

/*
 * Publishes and waits for the confirms of the replies of jobs[0..n) (with
 * their committed plans). IDEMQ_OK when every reply was confirmed (or none
 * was due); IDEMQ_ERR_BROKER / _TIMEOUT (drop the connection: nothing is
 * acknowledged, the redeliveries are duplicates answered again);
 * IDEMQ_ERR_DB_CONN / _SQL when the results could not be read back (the
 * same); IDEMQ_ERR_NOMEM. why says what failed.
 */
idemq_err_t celery_reply_batch(struct broker *b, PGconn *db, const struct conf *c,
                               const struct job *jobs, const struct plan *plans, int n,
                               int confirm_ms, char *why, size_t whylen) IDEMQ_MUSTCHECK;

#endif
