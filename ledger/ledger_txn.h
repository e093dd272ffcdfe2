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
#include "ledger_observe.h"

struct ledger_txn;

enum ledger_outcome {
    LEDGER_APPLIED = 0, /* effect ran and committed with the claim */
    LEDGER_DUPLICATE,   /* key already settled: no effect, attempt recorded */
    LEDGER_ERROR,       /* effect raised: classify, then record_failure */
    LEDGER_EARLY,       /* retrying job back before run_after: delay_ms to go */
    LEDGER_REPARK,      /* parked job whose dead-letter publish was never
                         * confirmed: publish it again (park holds the facts) */
    LEDGER_DEFERRED,    /* ordered input: before its predecessor, or its
                         * ordering key is held: store it (ledger_lanes_defer),
                         * then acknowledge; message says why */
    LEDGER_HELD,        /* ordered lane: an earlier job of its lane failed in
                         * this batch; nothing recorded, keep it in order */
    LEDGER_OUTSIDE,     /* claimed now, but its message is older than the dedup
                         * window (its key may have been applied and pruned):
                         * park it (outside_dedup_window); message says why */
    LEDGER_CONFLICT,    /* the key belongs to a job of another kind of input (a
                         * provider job): park this copy as key_conflict
                         * (ledger_txn_park_message), the job untouched */
};

struct ledger_result {
    enum ledger_outcome outcome;
    int attempt;          /* attempt number (all generations) */
    int base;             /* attempts before the last redrive: budget base */
    long delay_ms;        /* LEDGER_EARLY */
    json_t *park;         /* LEDGER_REPARK, or after a park: idemq.park_info
                           * (owned by the result; ledger_txn_result_clear) */
    char sqlstate[6];
    char message[512];
    char prior_state[16]; /* for duplicates: "applied" or "parked" */
    char started_at[40];
    char finished_at[40];
};

/* Releases what a result owns (its park facts) and zeroes it. */
void ledger_txn_result_clear(struct ledger_result *r);

/* Binds a session to a configuration: resolves the effects' OIDs in this
 * session, reads the ledger's dedup window (a message whose AMQP timestamp
 * is older goes to the ledger marked "w"; ledger_txn_apply reads it again
 * for each batch that holds a timestamp) and prepares its statements.
 * Returns NULL with errbuf set on failure. The caller keeps db. */
struct ledger_txn *ledger_txn_new(PGconn *db, const struct conf *c, char *errbuf, size_t errlen);

/* on: ledger_txn_apply never rolls the transaction back nor begins
 * another. The plain path runs after a savepoint (SAVEPOINT idemq_plain,
 * in the same round trip); when it does not fit (a key neither new nor
 * applied, an effect that raises) the transaction is rolled back to the
 * savepoint and the batch goes through idemq.apply_batch, where a failing
 * effect undoes only its own subtransaction. For a caller that opened the
 * transaction itself and holds something in it (the PostgreSQL queue
 * input's claimed rows). */
void ledger_txn_keep_transaction(struct ledger_txn *lt, bool on);

/* Frees lt (not the connection). NULL is fine. */
void ledger_txn_free(struct ledger_txn *lt);

/* How a batch transaction begins (here and in ledger_plain): at READ
 * COMMITTED whatever default_transaction_isolation the database or role
 * sets. idemq.outbox_take, its last statement, must see what committed
 * while it waited for an order key's lock (a snapshot per statement), or
 * two batches could lease rows of one key at once. */
#define LEDGER_TXN_BEGIN "BEGIN ISOLATION LEVEL READ COMMITTED"

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
 * and code. When park is false the job becomes 'retrying' with run_after =
 * now + delay_ms (the durable schedule); when true it becomes 'parked' with
 * a park row holding the raw message, and r->park receives the park's facts.
 */
idemq_err_t ledger_txn_record_failure(struct ledger_txn *lt, const struct job *j,
                                      struct ledger_result *r, const char *error_class,
                                      const char *error_code, bool park, long delay_ms,
                                      struct ledger_db_error *e) IDEMQ_MUSTCHECK;

/*
 * Inside txn. Claims j's key (and takes its row lock) for recording a
 * failure that happened outside the effect's subtransaction. r becomes
 * LEDGER_DUPLICATE if the key is settled (applied or parked), else
 * LEDGER_ERROR with the next attempt number and budget base (sqlstate and
 * message are the caller's to fill).
 */
idemq_err_t ledger_txn_claim_failed(struct ledger_txn *lt, const struct job *j,
                                    struct ledger_result *r,
                                    struct ledger_db_error *e) IDEMQ_MUSTCHECK;

/*
 * Inside txn. Parks message j without claiming its key: one that failed
 * decoding, or one that failed in every mode. Keeps what is known: the key
 * if any, the body as held (a prefix when body_size is larger), the full
 * body's size and SHA-256, properties, the headers when with_headers, the
 * code (an idemq_err_name) and reason. The park is redrivable only if the
 * whole body is held and the delivery was decodable. *park receives the
 * park's facts (caller json_decrefs).
 */
idemq_err_t ledger_txn_park_message(struct ledger_txn *lt, const struct job *j, const char *code,
                                    const char *reason, bool with_headers, json_t **park,
                                    struct ledger_db_error *e) IDEMQ_MUSTCHECK;

/* What observe_batch made of one delivery of an observe-mode input. */
struct ledger_observed {
    enum observe_outcome outcome;
    idemq_err_t code;   /* the would-park (or late replay) code; IDEMQ_OK if none */
    char code_name[32]; /* as stored: also "key_reuse" of a duplicate */
};

/*
 * Inside txn. Observe mode: for jobs[0..n) of observe-mode
 * inputs, decoded or not, decides what apply mode would do without running
 * any effect (idemq.observe_batch: claims new keys as applied by the
 * consumer running beside idemq, records each delivery in
 * idemq.observations) and writes one result per job to res. IDEMQ_OK when
 * the call ran; otherwise the whole call failed (e filled) and the
 * transaction is aborted.
 */
idemq_err_t ledger_txn_observe(struct ledger_txn *lt, struct job *const *jobs, int n,
                               struct ledger_observed *res,
                               struct ledger_db_error *e) IDEMQ_MUSTCHECK;

/* Outside txn (autocommit). Notes that the broker confirmed the dead-letter
 * publish of these parks. */
idemq_err_t ledger_txn_mark_dead_lettered(struct ledger_txn *lt, const long long *park_ids,
                                          int n, struct ledger_db_error *e) IDEMQ_MUSTCHECK;

#endif
