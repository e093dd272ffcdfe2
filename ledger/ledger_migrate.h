/*
 * ledger_migrate: the versioned ledger schema. Migrations are the SQL files
 * in ledger/migrations/, embedded at build time; each runs once, in order,
 * recorded in idemq.schema_migrations, under an advisory lock so replicas
 * starting together do not race.
 */
#ifndef IDEMQ_LEDGER_MIGRATE_H
#define IDEMQ_LEDGER_MIGRATE_H

#include <libpq-fe.h>
#include <stddef.h>

#include "idemq_err.h"

struct ledger_migration {
    int version;
    const char *name;
    const char *sql;
};

/* Generated from ledger/migrations/ and ledger/functions.sql by
 * ledger/embed_sql.cmake. */
extern const struct ledger_migration ledger_migrations[];
extern const int ledger_migrations_count;
extern const char *const ledger_functions_sql;

/*
 * Applies every migration not yet applied, each in its own transaction,
 * then (re)creates the ledger functions if their text changed.
 * *applied receives how many migrations ran (0 when up to date: running
 * twice is a no-op). IDEMQ_OK, or IDEMQ_ERR_SQL / IDEMQ_ERR_DB_CONN with errbuf set.
 * Must not run inside an open transaction.
 */
idemq_err_t ledger_migrate_run(PGconn *db, int *applied, char *errbuf,
                               size_t errlen) IDEMQ_MUSTCHECK;

/*
 * Checks that the database holds exactly the schema version and ledger
 * functions this binary expects. IDEMQ_OK, or IDEMQ_ERR_CONFIG ("run idemq migrate") /
 * IDEMQ_ERR_DB_CONN with errbuf set.
 */
idemq_err_t ledger_migrate_check(PGconn *db, char *errbuf, size_t errlen) IDEMQ_MUSTCHECK;

/* Highest version this binary knows. */
int ledger_migrate_latest(void);

#endif
