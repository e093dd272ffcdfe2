/*
 * ledger_db: PostgreSQL session plumbing for the ledger: connecting a worker
 * session (application_name, statement_timeout, TCP keepalives and user
 * timeout), running statements under a client-side deadline, and turning a
 * failed result into a struct ledger_db_error (SQLSTATE, message, whether
 * the connection is gone) for classify.
 *
 * Deadlines: a frozen server (stopped, or a peer that vanished while the
 * kernel still answers) never answers, and TCP cannot tell. Every call
 * below sends its statement asynchronously and polls the socket until a
 * deadline a little above statement_timeout; past it the connection is
 * abandoned (shut down) and the call fails as a lost connection, which the
 * worker handles as an infrastructure failure. The deadline is per thread
 * (ledger_db_set_call_timeout), so command-line tools keep waiting.
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
 * or NULL with errbuf set. statement_timeout_ms 0 means none. TCP
 * keepalives (idle 10 s, interval 5 s, 3 probes), tcp_user_timeout 30 s and
 * connect_timeout 10 s are defaults the DSN may override. Any thread; one
 * connection per thread.
 * On PostgreSQL 17 and later (PQserverVersion >= 170000), a session with a
 * statement_timeout opened by a thread with a call deadline also gets
 * transaction_timeout = LEDGER_DB_TXN_DEADLINES x the deadline: a
 * transaction the worker abandoned at its deadline (a partition that lost
 * the shutdown's FIN too) ends on the server, releasing its row locks on
 * keys, within that bound instead of when keepalives give up. Older
 * servers have no such setting; the session is the same otherwise.
 */
#define LEDGER_DB_TXN_DEADLINES 2 /* a worker transaction is one or two calls */
PGconn *ledger_db_connect(const char *dsn, const char *app_name, int statement_timeout_ms,
                          char *errbuf, size_t errlen);

/*
 * Routes the server's notices and warnings on db (RAISE NOTICE / WARNING in
 * an effect, a trigger, the ledger's own functions) through idemq's logger
 * instead of libpq's default (raw text on stderr): one escaped line in
 * either log format, event "db_notice", WARNING at warn, DEBUG at debug,
 * the rest at info, with the SQLSTATE and the key set by
 * ledger_db_set_notice_key. ledger_db_connect does it for every session it
 * opens; call it on a connection made otherwise. Any thread.
 */
void ledger_db_route_notices(PGconn *db);

/* Whether those notice lines carry the notice's DETAIL (it may quote row
 * values: a constraint's key, a payload field). Off until set; set once at
 * startup (database.keep_error_detail), before any thread connects. */
void ledger_db_keep_error_detail(bool on);

/* The job key (or NULL) the calling thread's notices are about until the
 * next call: set while statements run for one known job. The string must
 * outlive that. */
void ledger_db_set_notice_key(const char *key);

/* Sets the client-side deadline of every call below made by the calling
 * thread: ms > 0, or 0 to wait as long as libpq does. */
void ledger_db_set_call_timeout(int ms);

/* As PQexec / PQexecParams / PQexecPrepared / PQprepare / PQgetResult,
 * under the calling thread's deadline (see the top of this file): the
 * result (caller PQclears; for several statements, the last one's), or
 * NULL when the connection failed or the deadline passed (the connection
 * is then abandoned: PQstatus is CONNECTION_BAD, and ledger_db_error_from
 * says so). */
PGresult *ledger_db_exec_raw(PGconn *db, const char *sql);
PGresult *ledger_db_exec_params(PGconn *db, const char *sql, int n, const Oid *types,
                                const char *const *vals, const int *lens, const int *fmts,
                                int result_fmt);
PGresult *ledger_db_exec_prepared(PGconn *db, const char *stmt, int n, const char *const *vals,
                                  const int *lens, const int *fmts, int result_fmt);
PGresult *ledger_db_prepare(PGconn *db, const char *stmt, const char *sql, int n);
/* The next result of a query sent with PQsend* (pipelines): waits for it
 * under the deadline. NULL at the end of a query's results, or on failure
 * (then PQstatus is CONNECTION_BAD). */
PGresult *ledger_db_get_result(PGconn *db);

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
