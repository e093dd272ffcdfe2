/*
 * ledger_db: thin, error-capturing wrappers over libpq for the ledger code,
 * every call under a client-side deadline (see ledger_db.h).
 */
#include "ledger_db.h"

#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "log.h"

/* The calling thread's deadline per call (0: none), and the deadline that
 * abandoned its last connection (for the error text). */
static _Thread_local int call_timeout_ms;
static _Thread_local int expired_ms;

void ledger_db_set_call_timeout(int ms) { call_timeout_ms = ms > 0 ? ms : 0; }

/* The key notices of this thread are about (NULL: none known). libpq calls
 * the receiver from inside the call that read the notice, on this thread. */
static _Thread_local const char *notice_key;

void ledger_db_set_notice_key(const char *key) { notice_key = key; }

/* database.keep_error_detail: written once before the workers start. */
static bool keep_detail;

void ledger_db_keep_error_detail(bool on) { keep_detail = on; }

static void on_notice(void *arg, const PGresult *r)
{
    const char *sev = PQresultErrorField(r, PG_DIAG_SEVERITY_NONLOCALIZED);
    const char *msg = PQresultErrorField(r, PG_DIAG_MESSAGE_PRIMARY);
    const char *detail = keep_detail ? PQresultErrorField(r, PG_DIAG_MESSAGE_DETAIL) : NULL;
    const char *hint = PQresultErrorField(r, PG_DIAG_MESSAGE_HINT);
    struct log_fields lf = LOG_FIELDS_NONE;
    int lvl = LOG_LVL_INFO;

    (void)arg;
    if (!sev)
        sev = PQresultErrorField(r, PG_DIAG_SEVERITY);
    if (sev && strcmp(sev, "WARNING") == 0)
        lvl = LOG_LVL_WARN;
    else if (sev && strcmp(sev, "DEBUG") == 0)
        lvl = LOG_LVL_DEBUG;
    lf.event = "db_notice";
    lf.key = notice_key;
    lf.sqlstate = PQresultErrorField(r, PG_DIAG_SQLSTATE);
    /* log_emit escapes control characters (text) or jansson does (JSON) */
    LOG_FIELDS(lvl, &lf, "PostgreSQL %s: %s%s%s%s%s", sev ? sev : "NOTICE",
               msg ? msg : PQresultErrorMessage(r), detail ? " DETAIL: " : "",
               detail ? detail : "", hint ? " HINT: " : "", hint ? hint : "");
}

void ledger_db_route_notices(PGconn *db)
{
    if (db)
        PQsetNoticeReceiver(db, on_notice, NULL);
}

PGconn *ledger_db_connect(const char *dsn, const char *app_name, int statement_timeout_ms,
                          char *errbuf, size_t errlen)
{
    /* Keywords are processed in order and the last value wins: the defaults
     * come before the DSN (dbname, expanded), so the DSN's own settings
     * (connect_timeout, keepalives, sslmode ...) override them. */
    const char *keys[] = {"connect_timeout", "keepalives", "keepalives_idle",
                          "keepalives_interval", "keepalives_count", "tcp_user_timeout",
                          "dbname", "application_name", NULL};
    const char *vals[] = {"10", "1", "10", "5", "3", "30000", dsn, app_name, NULL};
    PGconn *db = PQconnectdbParams(keys, vals, 1);
    char set[64];
    PGresult *res;

    if (!db) {
        snprintf(errbuf, errlen, "out of memory");
        return NULL;
    }
    if (PQstatus(db) != CONNECTION_OK) {
        snprintf(errbuf, errlen, "cannot connect to PostgreSQL: %s", PQerrorMessage(db));
        errbuf[strcspn(errbuf, "\n")] = '\0';
        PQfinish(db);
        return NULL;
    }
    ledger_db_route_notices(db);
    /* Nonblocking sends: a large batch to a frozen server must not block
     * in send() past the deadline. */
    PQsetnonblocking(db, 1);
    snprintf(set, sizeof set, "SET statement_timeout = %d", statement_timeout_ms);
    res = ledger_db_exec_raw(db, set);
    if (PQresultStatus(res) != PGRES_COMMAND_OK) {
        snprintf(errbuf, errlen, "cannot set statement_timeout: %s", PQerrorMessage(db));
        PQclear(res);
        PQfinish(db);
        return NULL;
    }
    PQclear(res);
    if (PQserverVersion(db) >= 170000 && statement_timeout_ms > 0 && call_timeout_ms > 0) {
        long long ms = (long long)call_timeout_ms * LEDGER_DB_TXN_DEADLINES;
        snprintf(set, sizeof set, "SET transaction_timeout = %lld", ms > INT_MAX ? INT_MAX : ms);
        res = ledger_db_exec_raw(db, set);
        if (PQresultStatus(res) != PGRES_COMMAND_OK) {
            snprintf(errbuf, errlen, "cannot set transaction_timeout: %s", PQerrorMessage(db));
            PQclear(res);
            PQfinish(db);
            return NULL;
        }
        PQclear(res);
    }
    return db;
}

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Gives up on a connection whose server did not answer in time: later
 * calls on it fail at once as a lost connection. */
static void abandon(PGconn *db)
{
    int fd = PQsocket(db);
    expired_ms = call_timeout_ms;
    if (fd >= 0)
        shutdown(fd, SHUT_RDWR);
    PQconsumeInput(db); /* reads the EOF: libpq marks the connection bad */
}

/* Sends what is queued and waits until a result can be read without
 * blocking, up to the deadline. false when the connection failed or the
 * deadline passed (then it is abandoned). */
static bool wait_result(PGconn *db)
{
    long long deadline = call_timeout_ms ? now_ms() + call_timeout_ms : 0;
    for (;;) {
        struct pollfd pfd;
        int flush = PQflush(db), rc;
        long long left;
        if (flush < 0)
            return false;
        if (flush == 0 && !PQisBusy(db))
            return true;
        pfd.fd = PQsocket(db);
        pfd.events = POLLIN | (flush ? POLLOUT : 0);
        pfd.revents = 0;
        if (pfd.fd < 0)
            return false;
        left = deadline ? deadline - now_ms() : 1000;
        if (deadline && left <= 0) {
            abandon(db);
            return false;
        }
        rc = poll(&pfd, 1, (int)(left > 1000 ? 1000 : left));
        if (rc < 0 && errno != EINTR)
            return false;
        if (rc > 0 && (pfd.revents & (POLLIN | POLLERR | POLLHUP)) && !PQconsumeInput(db))
            return false;
    }
}

PGresult *ledger_db_get_result(PGconn *db)
{
    return wait_result(db) ? PQgetResult(db) : NULL;
}

/* After a successful send: every result of the query, the last one kept. */
static PGresult *collect(PGconn *db)
{
    PGresult *last = NULL, *r;
    while ((r = ledger_db_get_result(db))) {
        PQclear(last);
        last = r;
        if (PQresultStatus(r) == PGRES_COPY_IN || PQresultStatus(r) == PGRES_COPY_OUT ||
            PQstatus(db) != CONNECTION_OK)
            break;
    }
    if (PQstatus(db) != CONNECTION_OK) {
        PQclear(last);
        return NULL;
    }
    return last;
}

PGresult *ledger_db_exec_raw(PGconn *db, const char *sql)
{
    return PQsendQuery(db, sql) ? collect(db) : NULL;
}

PGresult *ledger_db_exec_params(PGconn *db, const char *sql, int n, const Oid *types,
                                const char *const *vals, const int *lens, const int *fmts,
                                int result_fmt)
{
    return PQsendQueryParams(db, sql, n, types, vals, lens, fmts, result_fmt) ? collect(db)
                                                                             : NULL;
}

PGresult *ledger_db_exec_prepared(PGconn *db, const char *stmt, int n, const char *const *vals,
                                  const int *lens, const int *fmts, int result_fmt)
{
    return PQsendQueryPrepared(db, stmt, n, vals, lens, fmts, result_fmt) ? collect(db) : NULL;
}

PGresult *ledger_db_prepare(PGconn *db, const char *stmt, const char *sql, int n)
{
    return PQsendPrepare(db, stmt, sql, n, NULL) ? collect(db) : NULL;
}

void ledger_db_error_from(PGconn *db, const PGresult *res, struct ledger_db_error *e)
{
    const char *st = res ? PQresultErrorField(res, PG_DIAG_SQLSTATE) : NULL;
    const char *msg = res ? PQresultErrorField(res, PG_DIAG_MESSAGE_PRIMARY) : NULL;

    snprintf(e->sqlstate, sizeof e->sqlstate, "%s", st ? st : "");
    snprintf(e->message, sizeof e->message, "%s", msg ? msg : PQerrorMessage(db));
    e->message[strcspn(e->message, "\n")] = '\0';
    e->conn_lost = PQstatus(db) != CONNECTION_OK;
    if (e->conn_lost && expired_ms) {
        snprintf(e->message, sizeof e->message,
                 "PostgreSQL did not answer within %d ms (client-side deadline); connection "
                 "abandoned",
                 expired_ms);
        expired_ms = 0;
    }
}

idemq_err_t ledger_db_err(const struct ledger_db_error *e)
{
    return e->conn_lost ? IDEMQ_ERR_DB_CONN : IDEMQ_ERR_SQL;
}

idemq_err_t ledger_db_exec(PGconn *db, const char *sql, struct ledger_db_error *e)
{
    PGresult *res = ledger_db_exec_raw(db, sql);
    ExecStatusType st = PQresultStatus(res);
    idemq_err_t err = IDEMQ_OK;

    if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK) {
        ledger_db_error_from(db, res, e);
        err = ledger_db_err(e);
    }
    PQclear(res);
    return err;
}

PGresult *ledger_db_query(PGconn *db, const char *sql, int nparams, const char *const *params,
                          struct ledger_db_error *e)
{
    PGresult *res = ledger_db_exec_params(db, sql, nparams, NULL, params, NULL, NULL, 0);
    ExecStatusType st = PQresultStatus(res);

    if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK) {
        ledger_db_error_from(db, res, e);
        PQclear(res);
        return NULL;
    }
    return res;
}
