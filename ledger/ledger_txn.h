/*
 * ledger_txn: the claim/apply/record/park transactions of one worker
 * session. The worker opens a transaction, applies a batch of decoded jobs
 * (one round trip: idemq.apply_batch claims each key and runs the effect in
 * a subtransaction), records failures and parks undecodable messages, then
 * commits; only after the commit does it acknowledge.
 *
 * API: ledger_txn_new -> [ledger_txn_begin -> ledger_txn_apply ->
 *      ledger_txn_record_failure / ledger_txn_park_message ->
 *      ledger_txn_commit | ledger_txn_rollback]* -> ledger_txn_free.
 * Functions marked "inside txn" must run between begin and commit.
 */
#ifndef IDEMQ_LEDGER_TXN_H
#define IDEMQ_LEDGER_TXN_H

#include <libpq-fe.h>
#include <stdbool.h>

#include "conf.h"
#include "idemq_err.h"
#include "job.h"
#include "ledger_db.h"

struct ledger_txn;

enum ledger_outcome {
    LEDGER_APPLIED = 0, /* effect ran and committed with the claim */
    LEDGER_DUPLICATE,   /* key already settled: no effect, attempt recorded */
    LEDGER_ERROR,       /* effect raised: classify, then record_failure */
};

struct ledger_result {
    enum ledger_outcome outcome;
    int attempt;
    char sqlstate[6];
    char message[512];
    char prior_state[16]; /* for duplicates: "applied" or "parked" */
    char started_at[40];
    char finished_at[40];
};

/* Binds a session to a configuration and prepares its statements.
 * Returns NULL with errbuf set on failure. The caller keeps db. */
struct ledger_txn *ledger_txn_new(PGconn *db, const struct conf *c, char *errbuf, size_t errlen);

/* Frees lt (not the connection). NULL is fine. */
void ledger_txn_free(struct ledger_txn *lt);

/* Opens a transaction. BEGIN is not sent at once: it goes out with the
 * transaction's first statement (pipelined with ledger_txn_apply, one round
 * trip for both), so its failure shows up as that statement's. */
idemq_err_t ledger_txn_begin(struct ledger_txn *lt, struct ledger_db_error *e) IDEMQ_MUSTCHECK;
idemq_err_t ledger_txn_commit(struct ledger_txn *lt, struct ledger_db_error *e) IDEMQ_MUSTCHECK;
/* Rolls back; harmless when no transaction is open or the connection is gone. */
void ledger_txn_rollback(struct ledger_txn *lt);

/*
 * Inside txn. Claims and applies jobs[0..n) (all decoded without error), in
 * order, writing one result per job to res. IDEMQ_OK when the call ran (per
 * job errors are in res); otherwise the whole call failed (e filled;
 * IDEMQ_ERR_DB_CONN or IDEMQ_ERR_SQL) and the transaction is aborted.
 */
idemq_err_t ledger_txn_apply(struct ledger_txn *lt, struct job *const *jobs, int n,
                             struct ledger_result *res,
                             struct ledger_db_error *e) IDEMQ_MUSTCHECK;

/*
 * Inside txn. Records the failed attempt r of claimed job j with its class
 * and code; the job becomes 'retrying', or 'parked' with a park row holding
 * the raw message when park is true.
 */
idemq_err_t ledger_txn_record_failure(struct ledger_txn *lt, const struct job *j,
                                      const struct ledger_result *r, const char *error_class,
                                      const char *error_code, bool park,
                                      struct ledger_db_error *e) IDEMQ_MUSTCHECK;

/* Inside txn. Parks a message that failed decoding (j->decode_err), keeping
 * its raw body, headers, properties, key if any and reason. */
idemq_err_t ledger_txn_park_message(struct ledger_txn *lt, const struct job *j,
                                    struct ledger_db_error *e) IDEMQ_MUSTCHECK;

#endif
