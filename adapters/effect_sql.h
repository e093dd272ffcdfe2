/*
 * effect_sql: the SQL-function effect. An input names a function
 * fn(key text, payload jsonb, meta jsonb) RETURNS jsonb; the ledger calls it
 * inside the claim transaction (see idemq.apply_batch). This module checks,
 * before any delivery is taken, that the function exists with that
 * signature and return type, so a bad deploy is found at start-up.
 */
#ifndef IDEMQ_EFFECT_SQL_H
#define IDEMQ_EFFECT_SQL_H

#include <libpq-fe.h>
#include <stddef.h>

#include "conf.h"
#include "idemq_err.h"
#include "ledger_db.h"

/*
 * IDEMQ_OK if in->effect_signature resolves to a function returning jsonb
 * that the session may execute, or if the input has none (a provider input
 * without SQL effect). Otherwise IDEMQ_ERR_CONFIG with errbuf
 * naming the input and the problem, or IDEMQ_ERR_DB_CONN / IDEMQ_ERR_SQL
 * with e filled. Must not run inside an open transaction.
 */
idemq_err_t effect_sql_check(PGconn *db, const struct conf_input *in, char *errbuf,
                             size_t errlen, struct ledger_db_error *e) IDEMQ_MUSTCHECK;

#endif
