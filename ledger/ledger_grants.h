/*
 * ledger_grants: the least-privileged PostgreSQL roles of a deployment.
 * - run: USAGE on schema idemq, SELECT on its tables, EXECUTE on its
 *   functions (which write as their owner) and on each input's effect;
 * - operator: SELECT on the ledger and the archive, EXECUTE on the
 *   functions of the operator commands and the console only;
 * - app: EXECUTE on idemq.emit only.
 * None gets INSERT, UPDATE, DELETE or DDL. Printed for review or applied
 * by `idemq migrate --grant`, `--grant-operator`, `--grant-app` (which
 * create a missing role). The role-independent half (SECURITY DEFINER
 * with a pinned search_path, no EXECUTE for PUBLIC on any function) is
 * ledger/privileges.sql, applied by every migrate.
 *
 * API: ledger_grants_print[_kind] (no database) | ledger_grants_apply[_kind].
 */
#ifndef IDEMQ_LEDGER_GRANTS_H
#define IDEMQ_LEDGER_GRANTS_H

#include <libpq-fe.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include "conf.h"
#include "idemq_err.h"

enum ledger_grants_kind { LEDGER_GRANTS_RUN, LEDGER_GRANTS_OPERATOR, LEDGER_GRANTS_APP };

/* "run", "operator" or "app". Pure. */
const char *ledger_grants_kind_name(enum ledger_grants_kind kind);

/* True if role is a usable role name (1-63 bytes, no NUL or control
 * characters); it is quoted as an identifier either way. Pure. */
bool ledger_grants_role_ok(const char *role);

/*
 * Writes the GRANT statements for role and the inputs of c to out, one per
 * line, as SQL a DBA can review and run. Pure (writes only to out).
 */
void ledger_grants_print(const struct conf *c, const char *role, FILE *out);
/* The same for the role of kind (c is used by the run role only). */
void ledger_grants_print_kind(const struct conf *c, enum ledger_grants_kind kind,
                              const char *role, FILE *out);

/*
 * Runs those statements in one transaction on db (a session of the
 * migrating role, which owns schema idemq; a missing role is created).
 * IDEMQ_OK, or IDEMQ_ERR_SQL / IDEMQ_ERR_DB_CONN with errbuf set (rolled
 * back). Not inside an open transaction.
 */
idemq_err_t ledger_grants_apply(PGconn *db, const struct conf *c, const char *role, char *errbuf,
                                size_t errlen) IDEMQ_MUSTCHECK;
/* The same for the role of kind; creates the role (LOGIN, no password)
 * when it does not exist, which needs CREATEROLE, and says so in *created
 * (may be NULL). */
idemq_err_t ledger_grants_apply_kind(PGconn *db, const struct conf *c,
                                     enum ledger_grants_kind kind, const char *role,
                                     bool *created, char *errbuf,
                                     size_t errlen) IDEMQ_MUSTCHECK;

#endif
