/*
 * ledger_outbox: the ledger side of the transactional outbox:
 * claim the publishable rows of idemq.outbox under a lease, then mark each
 * sent (after its confirm), failed (returned or nacked: parked at once or
 * after outbox.max_attempts) or released (not published). Each call is one
 * statement in its own implicit transaction (never inside the worker's
 * batch transaction) except ledger_outbox_take, the batch transaction's
 * last statement. See ledger/functions_outbox.sql.
 *
 * API: ledger_outbox_claim (or ledger_outbox_take in the batch transaction,
 *      then its COMMIT) -> [publish the rows, wait for their confirms] ->
 *      ledger_outbox_sent | ledger_outbox_failed | ledger_outbox_release
 *      -> ledger_outbox_rows_free. ledger_outbox_gauges for /metrics,
 *      ledger_outbox_print_* for `jobs show` and `parked list`.
 */
#ifndef IDEMQ_LEDGER_OUTBOX_H
#define IDEMQ_LEDGER_OUTBOX_H

#include <libpq-fe.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include "idemq_err.h"
#include "ledger_db.h"

/* One claimed row (strings and body owned by the rows block). */
struct outbox_row {
    long long id;
    const char *key;       /* emitting key, NULL if unknown */
    const char *exchange;
    const char *routing_key;
    unsigned char *body;   /* the message body: opened when it was stored sealed */
    size_t body_len;
    const char *headers;   /* JSON object text, NULL = none */
    const char *order_key; /* NULL = none */
    const char *message_id;
    const char *body_key;  /* key id the stored body was sealed with, NULL = stored as sent */
    const char *unopened;  /* NULL, or why the sealed body could not be opened (body NULL):
                            * never published (see outbox.c) */
    bool body_malloced;    /* body from protect_open (free) or PQunescapeBytea (PQfreemem) */
};

struct outbox_rows {
    PGresult *res;
    struct outbox_row *row;
    int n;
};

/* Claims up to limit publishable rows for holder for lease_ms. IDEMQ_OK
 * with r filled (r->n may be 0), or an error with e filled. A sealed body
 * is opened with the key its row names (claim and take alike); a row whose
 * body cannot be opened comes back with body NULL and unopened set. */
idemq_err_t ledger_outbox_claim(PGconn *db, const char *holder, int limit, int lease_ms,
                                struct outbox_rows *r, struct ledger_db_error *e) IDEMQ_MUSTCHECK;

/* Inside a batch transaction that may have emitted, as its last statement
 * before COMMIT (idemq.outbox_take): stamps the transaction's rows and
 * leases to holder, for lease_ms and this session, up to limit of them
 * that are publishable once it commits. *emitted gets how many rows the
 * transaction emitted (those not in r wait for a claim). The rows are
 * valid to publish only once the COMMIT succeeded. With a key active
 * (protection.active, protect_global) it first reads the transaction's
 * bodies stored as sent (idemq.outbox_unsealed) and seals each, and the
 * take stores them sealed: a body that cannot be sealed fails the call
 * (the transaction is rolled back, never committed in the clear). */
idemq_err_t ledger_outbox_take(PGconn *db, const char *holder, int limit, int lease_ms,
                               struct outbox_rows *r, int *emitted,
                               struct ledger_db_error *e) IDEMQ_MUSTCHECK;
void ledger_outbox_rows_free(struct outbox_rows *r);

/* Confirmed: ids[0..n) sent, in one statement (one transaction).
 * latency_ms[i] gets row ids[i]'s commit-to-confirm time (-1 when the row
 * was no longer ours: its lease had passed). */
idemq_err_t ledger_outbox_sent(PGconn *db, const char *holder, const long long *ids, int n,
                               double *latency_ms, struct ledger_db_error *e) IDEMQ_MUSTCHECK;

/* Returned (park) or nacked: *parked says whether the row is parked now. */
idemq_err_t ledger_outbox_failed(PGconn *db, const char *holder, long long id, const char *error,
                                 bool park, int max_attempts, int retry_ms, bool *parked,
                                 struct ledger_db_error *e) IDEMQ_MUSTCHECK;

/* Not published: gives up the lease of ids[0..n). */
idemq_err_t ledger_outbox_release(PGconn *db, const char *holder, const long long *ids, int n,
                                  const char *error, struct ledger_db_error *e) IDEMQ_MUSTCHECK;

/* Pending and parked rows, age in seconds of the oldest pending one. */
idemq_err_t ledger_outbox_gauges(PGconn *db, long *pending, long *parked, double *oldest_s,
                                 struct ledger_db_error *e) IDEMQ_MUSTCHECK;

/* Operator output: the outbox rows emitted by key (`jobs show`), and the
 * parked rows (`parked list`; key/since filter them, NULL = any, at most
 * limit). Print nothing when there are none; return how many were printed,
 * or -1 when the query failed. */
int ledger_outbox_print_key(PGconn *db, const char *key, FILE *out);
int ledger_outbox_print_parked(PGconn *db, const char *key, const char *since, long limit,
                               FILE *out);

#endif
