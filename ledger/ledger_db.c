/*
 * ledger_db: thin, error-capturing wrappers over libpq for the ledger code.
 */
#include "ledger_db.h"

#include <stdio.h>
#include <string.h>

PGconn *ledger_db_connect(const char *dsn, const char *app_name, int statement_timeout_ms,
                          char *errbuf, size_t errlen)
{
    const char *keys[] = {"dbname", "application_name", "connect_timeout", NULL};
    const char *vals[] = {dsn, app_name, "10", NULL};
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
    snprintf(set, sizeof set, "SET statement_timeout = %d", statement_timeout_ms);
    res = PQexec(db, set);
    if (PQresultStatus(res) != PGRES_COMMAND_OK) {
        snprintf(errbuf, errlen, "cannot set statement_timeout: %s", PQerrorMessage(db));
        PQclear(res);
        PQfinish(db);
        return NULL;
    }
    PQclear(res);
    return db;
}

void ledger_db_error_from(PGconn *db, const PGresult *res, struct ledger_db_error *e)
{
    const char *st = res ? PQresultErrorField(res, PG_DIAG_SQLSTATE) : NULL;
    const char *msg = res ? PQresultErrorField(res, PG_DIAG_MESSAGE_PRIMARY) : NULL;

    snprintf(e->sqlstate, sizeof e->sqlstate, "%s", st ? st : "");
    snprintf(e->message, sizeof e->message, "%s", msg ? msg : PQerrorMessage(db));
    e->message[strcspn(e->message, "\n")] = '\0';
    e->conn_lost = PQstatus(db) != CONNECTION_OK;
}

idemq_err_t ledger_db_err(const struct ledger_db_error *e)
{
    return e->conn_lost ? IDEMQ_ERR_DB_CONN : IDEMQ_ERR_SQL;
}

idemq_err_t ledger_db_exec(PGconn *db, const char *sql, struct ledger_db_error *e)
{
    PGresult *res = PQexec(db, sql);
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
    PGresult *res = PQexecParams(db, sql, nparams, NULL, params, NULL, NULL, 0);
    ExecStatusType st = PQresultStatus(res);

    if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK) {
        ledger_db_error_from(db, res, e);
        PQclear(res);
        return NULL;
    }
    return res;
}
