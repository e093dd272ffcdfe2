/*
 * ledger_grants: the least-privileged PostgreSQL role of `idemq run`. The
 * statements that let a role run idemq and nothing more (USAGE on schema
 * idemq, SELECT on its tables, EXECUTE on its functions, which write as
 * their owner, and EXECUTE on each input's effect; no INSERT, UPDATE,
 * DELETE or DDL), printed for review or applied by `idemq migrate --grant`.
 * The role-independent half (SECURITY DEFINER with a pinned search_path,
 * no EXECUTE for PUBLIC) is ledger/privileges.sql, applied by every migrate.
 *
 * API: ledger_grants_print (no database) | ledger_grants_apply.
 */
#ifndef IDEMQ_LEDGER_GRANTS_H
#define IDEMQ_LEDGER_GRANTS_H

#include <libpq-fe.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include "conf.h"
#include "idemq_err.h"

/* True if role is a usable role name (1-63 bytes, no NUL or control
 * characters); it is quoted as an identifier either way. Pure. */
bool ledger_grants_role_ok(const char *role);

/*
 * Writes the GRANT statements for role and the inputs of c to out, one per
 * line, as SQL a DBA can review and run. Pure (writes only to out).
 */
void ledger_grants_print(const struct conf *c, const char *role, FILE *out);

/*
 * Runs those statements in one transaction on db (a session of the
 * migrating role, which owns schema idemq; the role must exist).
 * IDEMQ_OK, or IDEMQ_ERR_SQL / IDEMQ_ERR_DB_CONN with errbuf set (rolled
 * back). Not inside an open transaction.
 */
idemq_err_t ledger_grants_apply(PGconn *db, const struct conf *c, const char *role, char *errbuf,
                                size_t errlen) IDEMQ_MUSTCHECK;

#endif
