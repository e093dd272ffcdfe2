/*
 * ledger_rescue: the ledger side of retry copies. A job waiting
 * for a retry on a broker delay bucket keeps its message in
 * idemq.retry_copies (written by idemq.record_failure); this module runs one
 * rescuer pass's transaction around the publishing the caller does: take the
 * copies whose retry never came back (idemq.rescue_take, which also takes
 * the per-queue rescue locks, so one replica at a time publishes a queue's
 * copies, and cleans up old copies), then record those the broker confirmed
 * (idemq.rescue_record) and commit. See ledger/functions_rescue.sql.
 *
 * API: ledger_rescue_take -> [publish each copy, wait for the confirms] ->
 *      ledger_rescue_record -> ledger_rescue_finish(commit or not).
 */
#ifndef IDEMQ_LEDGER_RESCUE_H
#define IDEMQ_LEDGER_RESCUE_H

#include <libpq-fe.h>
#include <stdbool.h>

#include "conf.h"
#include "idemq_err.h"
#include "job.h"
#include "ledger_db.h"

/* One retry copy to publish again. */
struct ledger_rescue_copy {
    struct job job;     /* key, input, exchange, routing key, body, headers,
                         * properties of the failed delivery (job_init'ed by
                         * the caller, job_destroy'ed by the caller) */
    int generation;
    int attempt;        /* the failed attempt the retry follows */
    char run_after[40]; /* when the retry was due */
    char body_key[64];  /* the key that sealed the stored body ("": stored as sent) */
    const char *unopened; /* NULL: job.body is the message's body; else why the
                           * sealed copy could not be opened (protect_open_str):
                           * job.body is empty and the copy must not be published */
};

/*
 * Opens the pass's transaction (BEGIN) and fills out[0..*n) (at most max)
 * with the copies due on the standard inputs i of c with include[i] (NULL:
 * all) whose rescue lock this session got: the job still retrying with the
 * copy's attempt, its run_after more than c->rescue_after_s ago, and the
 * copy not rescued within rescue_after_s * 2^(its rescues so far). Copies
 * of queues not configured here are skipped. The transaction stays open (it holds the locks) until
 * ledger_rescue_finish, also when *n is 0. On failure (e filled;
 * IDEMQ_ERR_DB_CONN, IDEMQ_ERR_SQL or IDEMQ_ERR_NOMEM) the caller still calls
 * ledger_rescue_finish(db, false, ...). Outside any other transaction; the
 * thread that owns db.
 */
idemq_err_t ledger_rescue_take(PGconn *db, const struct conf *c, const bool *include,
                               struct ledger_rescue_copy *out, int max, int *n,
                               struct ledger_db_error *e) IDEMQ_MUSTCHECK;

/*
 * Inside the pass's transaction, after the broker confirmed the republish of
 * copies[0..n): records one idemq.retry_rescues row each (only for copies
 * still of that attempt) and their rescued_at. *recorded gets the rows
 * written.
 */
idemq_err_t ledger_rescue_record(PGconn *db, const struct conf *c,
                                 const struct ledger_rescue_copy *copies, int n, int *recorded,
                                 struct ledger_db_error *e) IDEMQ_MUSTCHECK;

/* Ends the pass's transaction: COMMIT when commit, else ROLLBACK (harmless
 * when none is open or the connection is gone). The COMMIT's failure is
 * returned (e filled); a ROLLBACK's is ignored. */
idemq_err_t ledger_rescue_finish(PGconn *db, bool commit,
                                 struct ledger_db_error *e) IDEMQ_MUSTCHECK;

#endif
