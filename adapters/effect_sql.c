/*
 * effect_sql: start-up and recovery check of an input's SQL effect function.
 */
#include "effect_sql.h"

#include <stdio.h>
#include <string.h>

static idemq_err_t check_one(PGconn *db, const struct conf_input *in, const char *sig,
                             char *errbuf, size_t errlen, struct ledger_db_error *e);

idemq_err_t effect_sql_check(PGconn *db, const struct conf_input *in, char *errbuf,
                             size_t errlen, struct ledger_db_error *e)
{
    idemq_err_t err = check_one(db, in, in->effect_signature, errbuf, errlen, e);
    for (int k = 0; !err && k < in->n_routes; k++) /* Celery task routes */
        err = check_one(db, in, in->routes[k].signature, errbuf, errlen, e);
    return err;
}

static idemq_err_t check_one(PGconn *db, const struct conf_input *in, const char *sig,
                             char *errbuf, size_t errlen, struct ledger_db_error *e)
{
    const char *params[1] = {sig};
    PGresult *r;
    idemq_err_t err = IDEMQ_OK;

    if (!sig)
        return IDEMQ_OK; /* a provider input without SQL effect */
    r = ledger_db_query(
        db,
        "SELECT p.oid IS NOT NULL, "
        "       coalesce(format_type(pr.prorettype, NULL), ''), "
        "       coalesce(has_function_privilege(p.oid, 'EXECUTE'), false) "
        "FROM (SELECT to_regprocedure($1)::oid AS oid) p "
        "LEFT JOIN pg_proc pr ON pr.oid = p.oid",
        1, params, e);
    if (!r)
        return ledger_db_err(e);
    if (strcmp(PQgetvalue(r, 0, 0), "t") != 0) {
        snprintf(errbuf, errlen, "input %s: effect function %s does not exist", in->name,
                 sig);
        err = IDEMQ_ERR_CONFIG;
    } else if (strcmp(PQgetvalue(r, 0, 1), "jsonb") != 0) {
        snprintf(errbuf, errlen, "input %s: effect function %s returns %s, not jsonb", in->name,
                 sig, PQgetvalue(r, 0, 1));
        err = IDEMQ_ERR_CONFIG;
    } else if (strcmp(PQgetvalue(r, 0, 2), "t") != 0) {
        snprintf(errbuf, errlen, "input %s: no EXECUTE privilege on %s", in->name,
                 sig);
        err = IDEMQ_ERR_CONFIG;
    }
    PQclear(r);
    return err;
}
