/*
 * pgq_lease: provider inputs over PostgreSQL queue inputs, one worker
 * thread's share. It owns the visible leases of the rows whose effect is a
 * provider call (a call outlives any transaction a worker may hold open):
 * it takes rows and leases them in one committed statement
 * (idemq.queue_lease: holder and expiry in the row), hands each decoded
 * job to the worker's provider_flow (the same state machine, uncertainty
 * rules and lookups as a broker input's), extends the leases while their
 * calls run, and settles each row in a transaction of its own once the
 * flow has decided it (idemq.queue_lease_settle: deleted, given back for a
 * retry or a wait, or deleted as parked). A holder that dies stops
 * extending: its rows are taken again when their leases end, and the
 * ledger (a pending intent whose own lease ran out) sends that job to a
 * lookup of the key, never to a blind second call.
 *
 * API: pgq_lease_new -> each loop [pgq_lease_room -> pgq_lease_take ->
 *      pgq_lease_start (decoded) / pgq_lease_forget (parked by the caller)]
 *      -> pgq_lease_poll ... -> [stop: pgq_lease_drain -> pgq_lease_poll
 *      until pgq_lease_pending is 0 -> pgq_lease_release] -> pgq_lease_free.
 * One worker thread, its own PGconn, never inside a transaction.
 */
#ifndef IDEMQ_PGQ_LEASE_H
#define IDEMQ_PGQ_LEASE_H

#include <libpq-fe.h>
#include <stdbool.h>
#include <stddef.h>

#include "classify.h"
#include "conf.h"
#include "idemq_err.h"
#include "job.h"
#include "ledger_db.h"

struct pgq_lease;

/* What the decisions of one poll came to. */
struct pgq_lease_tally {
    long applied, duplicates, retried, parked;
};
struct pgq_lease_counts {
    long applied, duplicates, retried, parked;
    /* the same by input (the view's index), when the caller sets by to an
     * array of n_by (pgq_lease_poll keeps both fields, zeroes the array) */
    struct pgq_lease_tally *by;
    int n_by;
};

/*
 * *out becomes the lease holder of worker worker_id for the inputs of
 * view (the worker's PostgreSQL inputs as its inputs; it must outlive
 * *out), or NULL when none of them is a provider input. IDEMQ_OK, or
 * IDEMQ_ERR_CONFIG / IDEMQ_ERR_NOMEM with errbuf set (provider_flow_new).
 */
idemq_err_t pgq_lease_new(const struct conf *view, int worker_id, struct pgq_lease **out,
                          char *errbuf, size_t errlen) IDEMQ_MUSTCHECK;

/* Cancels the calls in flight (their rows' leases run out) and frees pl.
 * NULL is fine. */
void pgq_lease_free(struct pgq_lease *pl);

/* The holder's name written into its rows: "host:pid:wN". */
const char *pgq_lease_holder(const struct pgq_lease *pl);

/* The lease a row gets, and each extension, in ms: the longest
 * provider.timeout_ms of the inputs plus PGQ_LEASE_EXTRA_MS. */
int pgq_lease_ms(const struct pgq_lease *pl);

/* Rows input may still take: its provider.max_in_flight less its rows
 * held; 0 for an input that is not a provider input, or while draining. */
int pgq_lease_room(const struct pgq_lease *pl, int input);

/*
 * Outside a transaction: takes and leases up to cap ready rows of input
 * in (index input) in one committed statement and fills jobs[0..*n)
 * (each job_init'ed by the caller), decoded as pgq_take's are. Every row
 * taken is held (extended) until pgq_lease_start's decision or
 * pgq_lease_forget. *expired: how many of them were taken from a holder
 * whose lease ran out. IDEMQ_OK, IDEMQ_ERR_NOMEM, or the database error (e).
 */
idemq_err_t pgq_lease_take(struct pgq_lease *pl, PGconn *db, const struct conf_input *in,
                           int input, struct job *jobs, int cap, int *n, int *expired,
                           struct ledger_db_error *e) IDEMQ_MUSTCHECK;

/* Hands the decoded job of a row taken by pgq_lease_take to the flow
 * (transaction 1 may run at once). On an error the row is forgotten (its
 * lease runs out). */
idemq_err_t pgq_lease_start(struct pgq_lease *pl, PGconn *db, const struct job *j)
    IDEMQ_MUSTCHECK;

/* Stops holding row id (the caller settles it itself: a row that did not
 * decode is parked and deleted in the caller's transaction). */
void pgq_lease_forget(struct pgq_lease *pl, long long id);

/*
 * Extends the leases held when a third of the lease has passed since the
 * last extension, waits up to wait_ms for the flow's decisions, and
 * settles each decided row (idemq.queue_lease_settle); c counts what they
 * came to. A decision the database failed (provider_flow's FAIL) leaves
 * its row to its lease and sets *fail to its class (else CLASS_NONE).
 * Returns IDEMQ_OK or the database error of an extension or a settle (e
 * filled; that row's lease runs out and its next take finds what the
 * ledger recorded). Returns at once when nothing is held.
 */
idemq_err_t pgq_lease_poll(struct pgq_lease *pl, PGconn *db, int wait_ms,
                           struct pgq_lease_counts *c, enum classify_class *fail, char *why,
                           size_t whylen, struct ledger_db_error *e) IDEMQ_MUSTCHECK;

/* Rows held (taken and not yet settled or forgotten). */
int pgq_lease_pending(const struct pgq_lease *pl);

/* Jobs in the flow (started or queued and not yet decided). */
int pgq_lease_in_flow(const struct pgq_lease *pl);

/* A stop: nothing new is taken or sent (provider_flow_drain); poll until
 * pgq_lease_in_flow is 0, then pgq_lease_release. */
void pgq_lease_drain(struct pgq_lease *pl);

/* Gives back the leases still held (rows taken and never started: ready
 * again at once). Best effort: a failure leaves them to run out. */
void pgq_lease_release(struct pgq_lease *pl, PGconn *db);

#endif
