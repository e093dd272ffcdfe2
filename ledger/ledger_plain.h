/*
 * ledger_plain: the lean happy path. A plain batch (jobs of standard inputs,
 * none older than the dedup window) is applied by ONE prepared statement
 * per run of consecutive jobs of one input, planned once per session: it
 * claims each distinct key with a row inserted already settled, calls the
 * input's effect for the claimed keys in delivery order, writes one
 * idemq.batches row (the jobs' history) and an idemq.attempts row per
 * delivery of a key claimed before. Anything that is not plain (a key in
 * another state, an effect that raises) comes back as "not plain" or as
 * the statement's error, and the caller applies the batch again through
 * the isolating path (idemq.apply_batch): in a new transaction, or, when
 * the caller holds something in its transaction, after rolling back to a
 * savepoint taken just before the plain statement.
 *
 * API: ledger_plain_new (per session) -> ledger_plain_apply ... ->
 *      ledger_plain_free.
 */
#ifndef IDEMQ_LEDGER_PLAIN_H
#define IDEMQ_LEDGER_PLAIN_H

#include <libpq-fe.h>
#include <stdbool.h>

#include "conf.h"
#include "idemq_err.h"
#include "job.h"
#include "ledger_db.h"
#include "ledger_txn.h"

struct ledger_plain;

/*
 * Prepares one statement per input of c on session db. The effect is
 * named in it as the database names the function that the configured
 * signature resolves to (format('%I.%I') of pg_proc), so only an existing
 * function is ever called and no configuration text enters SQL. An input
 * whose effect does not resolve gets no statement (its batches take the
 * isolating path, which reports the missing function). Returns NULL with
 * errbuf set on failure. The caller keeps db.
 */
struct ledger_plain *ledger_plain_new(PGconn *db, const struct conf *c, char *errbuf,
                                      size_t errlen);

/* Frees lp (the prepared statements go with the session). NULL is fine. */
void ledger_plain_free(struct ledger_plain *lp);

/* True if every job of jobs[0..n) belongs to an input with a statement
 * (a standard input whose effect resolved). */
bool ledger_plain_ready(const struct ledger_plain *lp, struct job *const *jobs, int n);

/*
 * Inside txn (first, when not NULL, is a statement without parameters sent
 * before the runs in the same pipeline, one round trip for all: BEGIN, or
 * a SAVEPOINT). Applies plain jobs[0..n) (decoded, with keys, of
 * standard inputs; ledger_plain_ready). IDEMQ_OK with *plain true: res[0..n) holds every job's
 * outcome (applied, attempt 1, or a duplicate). IDEMQ_OK with *plain false:
 * some key was not new nor applied; nothing may be committed (roll back).
 * IDEMQ_ERR_SQL (e: the first error, e.g. an effect's SQLSTATE) or
 * IDEMQ_ERR_DB_CONN: the transaction is aborted. IDEMQ_ERR_NOMEM likewise.
 */
idemq_err_t ledger_plain_apply(struct ledger_plain *lp, const char *first,
                               struct job *const *jobs, int n, struct ledger_result *res, bool *plain,
                               struct ledger_db_error *e) IDEMQ_MUSTCHECK;

#endif
