/*
 * ledger_retention: the ledger's lifecycle from C. Writing the windows
 * (ledger.* settings) into the ledger, one maintenance call
 * (idemq.maintain: partitions ahead, pruning of the dedup set, archive,
 * drops; see ledger/functions_retention.sql), and the periodic caller a
 * worker drives between batches without ever waiting for the database.
 *
 * API: ledger_retention_apply (migrate) and ledger_retention_maintain
 *      (commands); for `run`: ledger_retention_new -> ledger_retention_tick
 *      ... -> ledger_retention_free, all on one thread.
 */
#ifndef IDEMQ_LEDGER_RETENTION_H
#define IDEMQ_LEDGER_RETENTION_H

#include <jansson.h>
#include <libpq-fe.h>
#include <stdbool.h>

#include "conf.h"
#include "idemq_err.h"
#include "ledger_db.h"

struct ledger_retention;

/*
 * Outside txn. Writes c's ledger.* settings into idemq.retention (the
 * windows every replica then applies). Needs UPDATE on it: `idemq migrate`
 * runs it as the ledger's owner. *changed tells whether they differed.
 */
idemq_err_t ledger_retention_apply(PGconn *db, const struct conf *c, bool *changed,
                                   struct ledger_db_error *e) IDEMQ_MUSTCHECK;

/*
 * Outside txn. One call of idemq.maintain(who, budget_ms): at most about
 * budget_ms of work, or {"busy": true} at once when another session
 * maintains. now: NULL, or a timestamp to act at (tests and drills; the
 * ledger honours it only for its owner). *result receives the answer
 * (caller json_decrefs) on IDEMQ_OK.
 */
idemq_err_t ledger_retention_maintain(PGconn *db, const char *who, int budget_ms,
                                      const char *now, json_t **result,
                                      struct ledger_db_error *e) IDEMQ_MUSTCHECK;

/* Logs (warn) each failed step of a maintenance answer ("errors": step,
 * relation, SQLSTATE, message); returns how many steps failed. */
long ledger_retention_log_failures(json_t *result);

/* The periodic caller of one process, with its own database session
 * (opened on the first tick). who names the caller in the ledger's
 * maintenance_runs. Returns NULL when out of memory. */
struct ledger_retention *ledger_retention_new(const struct conf *c, const char *who);

/* Closes the session (an unfinished call is abandoned: it commits or rolls
 * back on its own) and frees lr. NULL is fine. */
void ledger_retention_free(struct ledger_retention *lr);

/*
 * Between batches, on the thread that owns lr. Never waits for the
 * database: when a call is due it is sent on lr's own session, and its
 * answer is collected by a later tick; the next call is due 1 s later while
 * maintenance reports work left, else after min(60 s, partition interval /
 * 4). Only a (re)connect blocks, at most once per 30 s after a failure.
 * A call left unanswered for 60 s (a frozen server) is abandoned with its
 * session.
 * Failures are logged and retried; nothing here stops the worker.
 */
void ledger_retention_tick(struct ledger_retention *lr, long long now_ms);

#endif
