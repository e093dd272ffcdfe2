/*
 * pgq: the PostgreSQL queue transport (inputs with transport = "postgres").
 * It owns what a transport does (adapters/PORT.md): take work (ready rows
 * of idemq.queue_jobs, claimed with FOR UPDATE SKIP LOCKED inside the
 * worker's transaction, each turned into a struct job), give the results
 * back in the same transaction (done rows deleted, a retry held in its row,
 * parks noted as dead-lettered), and wait for work (LISTEN/NOTIFY). Decoding,
 * the ledger and classifying are the port's, below it.
 *
 * API: pgq_listen (once per session, outside a transaction) ->
 *      [inside txn: pgq_take -> the port's apply -> pgq_settle_add* ->
 *      pgq_settle] -> pgq_wait (outside a transaction) ... -> pgq_settle_free.
 * One worker thread per session.
 */
#ifndef IDEMQ_PGQ_H
#define IDEMQ_PGQ_H

#include <libpq-fe.h>
#include <stdbool.h>

#include "conf.h"
#include "idemq_err.h"
#include "job.h"
#include "ledger_db.h"

/* The NOTIFY channel idemq.enqueue signals (the payload is the queue). */
#define PGQ_CHANNEL "idemq_queue"

/* Outside a transaction: LISTEN on PGQ_CHANNEL. IDEMQ_OK or the error. */
idemq_err_t pgq_listen(PGconn *db, struct ledger_db_error *e) IDEMQ_MUSTCHECK;

/* One claimed row of idemq.queue_jobs, as plain values (pgq_row_job). */
struct pgq_row {
    long long id;
    const char *key;        /* the enqueue's key, or NULL */
    const char *order_key;  /* or NULL */
    const unsigned char *payload;
    size_t payload_len;
    int attempts;           /* failed attempts held in the row */
    bool has_redrive;       /* put back by idemq.queue_redrive: */
    long long redrive_gen;  /*   the park's generation */
    long long park_id;      /*   and the park (0 = none) */
    const char *enqueued_at; /* text, or NULL */
    const char *traceparent; /* the enqueue's trace context, or NULL */
    const char *tracestate;  /*   (checked as a header's is: trace.h) */
};

/*
 * Turns a row into job j of input in (index input_idx), reset first: the
 * payload as the body, the row id as the tag, the key as the message id
 * (a key longer than a message id holds is a key_too_long decode error,
 * never a cut key), the row's facts as properties, then job_decode; a
 * redriven row carries its generation as the redrive header, set only
 * after decoding succeeded. The row's traceparent and tracestate become
 * the headers of those names, read by job_decode as a broker message's
 * are (an invalid one is dropped). false when out of memory. Pure but for the
 * clock and the process's redrive seal secret (job_decode).
 */
bool pgq_row_job(const struct pgq_row *row, const struct conf_input *in, int input_idx,
                 struct job *j);

/* Row i of a take's result (its first ten columns in the order of
 * idemq.queue_take: id, key, order key, payload, attempts, redrive
 * generation, park id, enqueued at, traceparent, tracestate) into job j
 * through pgq_row_job. false when out of memory. */
bool pgq_result_row_job(const PGresult *r, int i, const struct conf_input *in, int input_idx,
                        struct job *j);

/*
 * Inside txn: claims up to cap ready rows of input in (index input_idx of
 * the worker's conf) and fills jobs[0..*n) (each job_init'ed by the caller;
 * reset here): the payload as the body, the row id as the delivery tag, the
 * enqueue's key as the message id, the row's facts as properties
 * ({"transport": "postgres", "queue", "queue_row", "enqueue_key",
 * "order_key", "enqueued_at", "attempts"}), then job_decode. A row that a
 * redrive put back (idemq.queue_redrive) carries its generation as the
 * redrive header the ledger reads. Returns IDEMQ_OK, IDEMQ_ERR_NOMEM, or a
 * database error (e filled; the transaction is then aborted).
 */
idemq_err_t pgq_take(PGconn *db, const struct conf_input *in, int input_idx, struct job *jobs,
                     int cap, int *n, struct ledger_db_error *e) IDEMQ_MUSTCHECK;

/* Where a worker's last take of an input ended, in the claim's order
 * (run_after, priority, id). */
struct pgq_pos {
    bool set;
    char run_after[48]; /* timestamptz as text */
    int priority;
    long long id;
};

/* pgq_take from a position (idemq.queue_take_after): only rows after *pos
 * (all rows if !pos->set), and *pos moved to the last row taken. A take
 * from a position does not see rows that became ready behind it; the
 * caller takes from the head (pos->set false) when one finds nothing, and
 * now and then. */
idemq_err_t pgq_take_from(PGconn *db, const struct conf_input *in, int input_idx,
                          struct pgq_pos *pos, struct job *jobs, int cap, int *n,
                          struct ledger_db_error *e) IDEMQ_MUSTCHECK;

/* Inside txn: takes row id of input in again into *j, as pgq_take does,
 * if it is still there and no other worker holds it (*found false
 * otherwise): the row whose apply call failed as a whole, to record that
 * failure as its attempt. */
idemq_err_t pgq_take_row(PGconn *db, const struct conf_input *in, int input_idx, long long id,
                         struct job *j, bool *found, struct ledger_db_error *e) IDEMQ_MUSTCHECK;

/* What becomes of the rows taken in one transaction. */
struct pgq_settle {
    int n_done, n_retry, n_parks, cap;
    long long *done;      /* rows to delete */
    long long *retry;     /* rows to hold for a retry */
    long *delay_ms;
    bool *counts;         /* the retry used an attempt */
    char **errors;        /* owned */
    char **keys;          /* owned: the retried keys (their ledger copy goes) */
    long long *parks;     /* parks to note as dead-lettered */
};

/* Prepares s for up to cap rows. false when out of memory (then
 * pgq_settle_free). */
bool pgq_settle_init(struct pgq_settle *s, int cap);
/* Forgets the rows noted (frees their texts), for the next transaction. */
void pgq_settle_reset(struct pgq_settle *s);
/* Frees what pgq_settle_init allocated; s is zeroed. */
void pgq_settle_free(struct pgq_settle *s);

/* Notes one row's end. At most cap calls of each kind between resets.
 * park_id 0: none. false when out of memory. */
void pgq_settle_done(struct pgq_settle *s, long long row, long long park_id);
bool pgq_settle_retry(struct pgq_settle *s, long long row, const char *key, long delay_ms,
                      bool counts, const char *error);

/* Inside txn, the last statement before COMMIT: carries s out
 * (idemq.queue_settle). IDEMQ_OK or the error (e filled). */
idemq_err_t pgq_settle(PGconn *db, const struct pgq_settle *s,
                       struct ledger_db_error *e) IDEMQ_MUSTCHECK;

/*
 * Outside a transaction: waits up to max_ms for a notification on
 * PGQ_CHANNEL (any queue: the caller looks at all its inputs) without
 * using the CPU, and drains the ones that came. Returns true when one came,
 * false on timeout; a lost connection shows in PQstatus.
 */
bool pgq_wait(PGconn *db, long max_ms);

/*
 * Outside a transaction: milliseconds until the earliest row of these
 * queues is due (0 if one is ready; -1 if they are empty or on failure).
 */
long pgq_next_due_ms(PGconn *db, const struct conf *c);

#endif
