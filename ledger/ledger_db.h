/*
 * ledger_db: PostgreSQL session plumbing for the ledger: connecting a worker
 * session (application_name, statement_timeout), running statements, and
 * turning a failed result into a struct ledger_db_error (SQLSTATE, message,
 * whether the connection is gone) for classify.
 */
#ifndef IDEMQ_LEDGER_DB_H
#define IDEMQ_LEDGER_DB_H

#include <libpq-fe.h>
#include <stdbool.h>
#include <stddef.h>

#include "idemq_err.h"

struct ledger_db_error {
    char sqlstate[6];   /* "" when there was no server answer */
    char message[512];
    bool conn_lost;
};

/*
 * Opens a session. Returns the connection (the caller owns it; PQfinish),
 * or NULL with errbuf set. statement_timeout_ms 0 means none. Any thread;
 * one connection per thread.
 */
PGconn *ledger_db_connect(const char *dsn, const char *app_name, int statement_timeout_ms,
                          char *errbuf, size_t errlen);

/* Fills e from a failed result (res may be NULL) and the connection state. */
void ledger_db_error_from(PGconn *db, const PGresult *res, struct ledger_db_error *e);

/* Runs a statement without parameters and discards its result.
 * IDEMQ_OK, or IDEMQ_ERR_SQL / IDEMQ_ERR_DB_CONN with e filled. */
idemq_err_t ledger_db_exec(PGconn *db, const char *sql, struct ledger_db_error *e) IDEMQ_MUSTCHECK;

/* Runs a parameterised statement (text parameters, NULL = SQL NULL).
 * Returns the result (caller PQclears) when it succeeded, else NULL with e
 * filled. */
PGresult *ledger_db_query(PGconn *db, const char *sql, int nparams, const char *const *params,
                          struct ledger_db_error *e);

/* idemq_err_t for a filled error: IDEMQ_ERR_DB_CONN if the connection is
 * lost, else IDEMQ_ERR_SQL. */
idemq_err_t ledger_db_err(const struct ledger_db_error *e);

#endif
