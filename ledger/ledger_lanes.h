/*
 * ledger_lanes: the ledger side of ordered lanes: storing a job the
 * sequence guard deferred, noting a park on an ordered input (on_park),
 * taking deferred jobs whose turn has come, and reporting deferred jobs that
 * wait too long. The guard itself runs inside idemq.apply_batch.
 *
 * API (one worker session): inside the batch txn ledger_lanes_defer /
 *      ledger_lanes_parked; between batches ledger_lanes_take (then apply
 *      the jobs like deliveries) and ledger_lanes_report.
 */
#ifndef IDEMQ_LEDGER_LANES_H
#define IDEMQ_LEDGER_LANES_H

#include <libpq-fe.h>

#include "conf.h"
#include "idemq_err.h"
#include "job.h"
#include "ledger_db.h"

/* True if some input of c has an ordering key (deferred jobs can exist). */
bool ledger_lanes_any(const struct conf *c);

/*
 * Inside txn. Stores decoded job j (apply_batch said 'deferred' for it,
 * with why) in idemq.deferred with its raw body, headers and properties,
 * so its delivery may be acknowledged after the commit.
 */
idemq_err_t ledger_lanes_defer(PGconn *db, const struct conf *c, const struct job *j,
                               const char *why, struct ledger_db_error *e) IDEMQ_MUSTCHECK;

/* Inside txn, after job j of an ordered input parked: applies the input's
 * on_park to its ordering key (hold it, or skip the parked sequence) and
 * drops a deferred copy. */
idemq_err_t ledger_lanes_parked(PGconn *db, const struct conf *c, const struct job *j,
                                struct ledger_db_error *e) IDEMQ_MUSTCHECK;

/*
 * Outside txn. Reads up to max deferred jobs of c's ordered inputs whose
 * turn has come, in apply order, into jobs[0..*n) (each job_reset first):
 * body, headers, properties, exchange, routing key, input, lane,
 * deferred_id; tag 0 (there is no delivery). Decode them, then apply them
 * like deliveries: apply_batch decides again under the ordering key's lock.
 */
idemq_err_t ledger_lanes_take(PGconn *db, const struct conf *c, struct job *jobs, int max,
                              int *n, struct ledger_db_error *e) IDEMQ_MUSTCHECK;

/* Outside txn. *pending becomes true if a deferred job of c's ordered
 * inputs is due or scheduled (a ledger-driven retry, or a predecessor was
 * applied): work that comes back without any delivery, so
 * `run --until-idle` must wait. */
idemq_err_t ledger_lanes_retry_pending(PGconn *db, const struct conf *c, bool *pending,
                                       struct ledger_db_error *e) IDEMQ_MUSTCHECK;

/* Outside txn. Logs (warn) every deferred job older than its input's
 * deferred_report_after_s that was not reported yet, and marks it reported.
 * *reported receives the count. */
idemq_err_t ledger_lanes_report(PGconn *db, const struct conf *c, int *reported,
                                struct ledger_db_error *e) IDEMQ_MUSTCHECK;

#endif
