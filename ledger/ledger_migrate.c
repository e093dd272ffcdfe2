/*
 * ledger_migrate: applies the embedded migrations in version order.
 */
#include "ledger_migrate.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/evp.h>
#include <pthread.h>

#include "ledger_db.h"
#include "log.h"

/* Arbitrary constant: the advisory lock that serialises migrators. */
#define MIGRATE_LOCK "SELECT pg_advisory_xact_lock(7164372135)"

int ledger_migrate_latest(void)
{
    int v = 0;
    for (int i = 0; i < ledger_migrations_count; i++)
        if (ledger_migrations[i].version > v)
            v = ledger_migrations[i].version;
    return v;
}

static int current_version(PGconn *db, struct ledger_db_error *e)
{
    PGresult *res = ledger_db_query(
        db,
        "SELECT CASE WHEN to_regclass('idemq.schema_migrations') IS NULL THEN 0 "
        "ELSE (SELECT coalesce(max(version), 0) FROM idemq.schema_migrations) END",
        0, NULL, e);
    int v;
    if (!res)
        return -1;
    v = atoi(PQgetvalue(res, 0, 0));
    PQclear(res);
    return v;
}

#define FUNCTIONS_CURRENT                                                                   \
    "SELECT EXISTS (SELECT 1 FROM idemq.schema_functions WHERE sha256 = $1)"

/* SHA-256 (hex) of this binary's ledger functions text, computed here once:
 * every session checks it at connect, and sending the whole text for the
 * database to hash cost each session more than the rest of its start. The
 * database stores the same value (sha256 of the text's UTF-8 bytes). */
static char functions_hex[65];
static pthread_once_t functions_once = PTHREAD_ONCE_INIT;

static void functions_hash(void)
{
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned len = 0;
    if (EVP_Digest(ledger_functions_sql, strlen(ledger_functions_sql), md, &len, EVP_sha256(),
                   NULL) == 1)
        for (unsigned i = 0; i < len && i < 32; i++)
            snprintf(functions_hex + 2 * i, 3, "%02x", md[i]);
}

static const char *functions_sha256(void)
{
    pthread_once(&functions_once, functions_hash); /* workers connect concurrently */
    return functions_hex;
}

/* (Re)creates the ledger functions when the database has another text. */
static idemq_err_t apply_functions(PGconn *db, char *errbuf, size_t errlen)
{
    struct ledger_db_error e;
    const char *params[1] = {ledger_functions_sql};
    const char *sha[1] = {functions_sha256()};
    PGresult *res;
    idemq_err_t err;
    bool current;

    if ((err = ledger_db_exec(db, "BEGIN; " MIGRATE_LOCK, &e)) != IDEMQ_OK)
        goto fail;
    if (!(res = ledger_db_query(db, FUNCTIONS_CURRENT, 1, sha, &e))) {
        err = ledger_db_err(&e);
        goto fail;
    }
    current = strcmp(PQgetvalue(res, 0, 0), "t") == 0;
    PQclear(res);
    if (!current) {
        if ((err = ledger_db_exec(db, ledger_functions_sql, &e)) != IDEMQ_OK)
            goto fail;
        res = ledger_db_query(db,
                              "INSERT INTO idemq.schema_functions (id, sha256) VALUES "
                              "(1, encode(sha256(convert_to($1, 'UTF8')), 'hex')) "
                              "ON CONFLICT (id) DO UPDATE SET sha256 = excluded.sha256, "
                              "applied_at = now()",
                              1, params, &e);
        if (!res) {
            err = ledger_db_err(&e);
            goto fail;
        }
        PQclear(res);
        log_info("ledger: (re)created the ledger functions");
    }
    if ((err = ledger_db_exec(db, "COMMIT", &e)) != IDEMQ_OK)
        goto fail;
    return IDEMQ_OK;
fail:
    snprintf(errbuf, errlen, "ledger functions failed: %s %s", e.sqlstate, e.message);
    PQclear(ledger_db_exec_raw(db, "ROLLBACK"));
    return err;
}

static idemq_err_t migrate_once(PGconn *db, int *applied, char *errbuf, size_t errlen,
                                struct ledger_db_error *e_out);

/* A migration that cannot get a lock within lock_timeout gives up rather
 * than queue every worker's statement behind its ACCESS EXCLUSIVE request;
 * it is tried again a few times, then reported. */
#define MIGRATE_SETTINGS                                                                   \
    "SET statement_timeout = 0; SET lock_timeout = '5s'; SET client_min_messages = warning"
#define MIGRATE_TRIES 5

idemq_err_t ledger_migrate_run(PGconn *db, int *applied, char *errbuf, size_t errlen)
{
    struct ledger_db_error e = {{0}, {0}, false};
    idemq_err_t err;

    *applied = 0;
    if ((err = ledger_db_exec(db, MIGRATE_SETTINGS, &e)) != IDEMQ_OK) {
        snprintf(errbuf, errlen, "migration settings failed: %s %s", e.sqlstate, e.message);
        return err;
    }
    for (int tries = 1;; tries++) {
        int n = 0;
        err = migrate_once(db, &n, errbuf, errlen, &e);
        *applied += n;
        if (!err || strcmp(e.sqlstate, "55P03") != 0 || tries == MIGRATE_TRIES)
            return err;
        log_warn("ledger: migration waited too long for a lock (%s); trying again (%d of %d)",
                 e.message, tries + 1, MIGRATE_TRIES);
    }
}

static idemq_err_t migrate_once(PGconn *db, int *applied, char *errbuf, size_t errlen,
                                struct ledger_db_error *e_out)
{
    struct ledger_db_error e = {{0}, {0}, false};
    idemq_err_t err;

    *applied = 0;
    if ((err = ledger_db_exec(db,
                              "BEGIN; " MIGRATE_LOCK "; "
                              "CREATE SCHEMA IF NOT EXISTS idemq; "
                              "CREATE TABLE IF NOT EXISTS idemq.schema_migrations ("
                              " version integer PRIMARY KEY, name text NOT NULL,"
                              " applied_at timestamptz NOT NULL DEFAULT now()); "
                              "CREATE TABLE IF NOT EXISTS idemq.schema_functions ("
                              " id integer PRIMARY KEY CHECK (id = 1), sha256 text NOT NULL,"
                              " applied_at timestamptz NOT NULL DEFAULT now()); COMMIT",
                              &e)) != IDEMQ_OK)
        goto fail;
    for (int i = 0; i < ledger_migrations_count; i++) {
        const struct ledger_migration *m = &ledger_migrations[i];
        char ver[16];
        const char *params[2] = {ver, m->name};
        PGresult *res;
        int have;

        snprintf(ver, sizeof ver, "%d", m->version);
        if ((err = ledger_db_exec(db, "BEGIN; " MIGRATE_LOCK, &e)) != IDEMQ_OK)
            goto fail;
        res = ledger_db_query(db, "SELECT 1 FROM idemq.schema_migrations WHERE version = $1", 1,
                              params, &e);
        if (!res) {
            err = ledger_db_err(&e);
            goto rollback;
        }
        have = PQntuples(res);
        PQclear(res);
        if (have) {
            if ((err = ledger_db_exec(db, "COMMIT", &e)) != IDEMQ_OK)
                goto fail;
            continue;
        }
        if ((err = ledger_db_exec(db, m->sql, &e)) != IDEMQ_OK) {
            snprintf(errbuf, errlen, "migration %s failed: %s%s%s", m->name, e.sqlstate,
                     e.sqlstate[0] ? " " : "", e.message);
            goto rollback_kept;
        }
        res = ledger_db_query(db, "INSERT INTO idemq.schema_migrations (version, name) "
                                  "VALUES ($1, $2)", 2, params, &e);
        if (!res) {
            err = ledger_db_err(&e);
            goto rollback;
        }
        PQclear(res);
        if ((err = ledger_db_exec(db, "COMMIT", &e)) != IDEMQ_OK)
            goto fail;
        log_info("ledger: applied migration %s", m->name);
        (*applied)++;
    }
    return apply_functions(db, errbuf, errlen);
rollback:
    snprintf(errbuf, errlen, "migration failed: %s %s", e.sqlstate, e.message);
rollback_kept:
    *e_out = e;
    PQclear(ledger_db_exec_raw(db, "ROLLBACK"));
    return err;
fail:
    snprintf(errbuf, errlen, "migration failed: %s %s", e.sqlstate, e.message);
    *e_out = e;
    PQclear(ledger_db_exec_raw(db, "ROLLBACK"));
    return err;
}

idemq_err_t ledger_migrate_check(PGconn *db, char *errbuf, size_t errlen)
{
    struct ledger_db_error e;
    int v = current_version(db, &e);
    int want = ledger_migrate_latest();

    if (v < 0) {
        snprintf(errbuf, errlen, "cannot read the ledger schema version: %s", e.message);
        return ledger_db_err(&e) == IDEMQ_ERR_DB_CONN ? IDEMQ_ERR_DB_CONN : IDEMQ_ERR_CONFIG;
    }
    if (v < want) {
        snprintf(errbuf, errlen,
                 "ledger schema is at version %d, this idemq needs %d: run `idemq migrate`", v,
                 want);
        return IDEMQ_ERR_CONFIG;
    }
    if (v > want) {
        snprintf(errbuf, errlen,
                 "ledger schema is at version %d, newer than this idemq (%d): upgrade idemq", v,
                 want);
        return IDEMQ_ERR_CONFIG;
    }
    {
        const char *params[1] = {functions_sha256()};
        PGresult *res = ledger_db_query(db, FUNCTIONS_CURRENT, 1, params, &e);
        bool current;
        if (!res) {
            snprintf(errbuf, errlen, "cannot read the ledger functions' version: %s", e.message);
            return e.conn_lost ? IDEMQ_ERR_DB_CONN : IDEMQ_ERR_CONFIG;
        }
        current = strcmp(PQgetvalue(res, 0, 0), "t") == 0;
        PQclear(res);
        if (!current) {
            snprintf(errbuf, errlen,
                     "the ledger functions in the database differ from this idemq's: "
                     "run `idemq migrate`");
            return IDEMQ_ERR_CONFIG;
        }
    }
    return IDEMQ_OK;
}
