/*
 * ledger_grants: GRANT statements for the role of `idemq run` (see
 * ledger_grants.h).
 */
#include "ledger_grants.h"

#include <stdlib.h>
#include <string.h>

#include "ledger_db.h"

#define GRANT_SQL_MAX 1024

bool ledger_grants_role_ok(const char *role)
{
    size_t n = role ? strlen(role) : 0;
    if (n < 1 || n > 63)
        return false;
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)role[i] < 0x20 || role[i] == 0x7f)
            return false;
    return true;
}

/* s as a double-quoted SQL identifier into buf ("" doubles). */
static const char *ident(const char *s, char *buf, size_t len)
{
    size_t o = 0;
    if (o + 1 < len)
        buf[o++] = '"';
    for (; *s && o + 3 < len; s++) {
        if (*s == '"')
            buf[o++] = '"';
        buf[o++] = *s;
    }
    buf[o++] = '"';
    buf[o] = '\0';
    return buf;
}

/* Calls emit(stmt, arg) for each statement; stops at the first non-zero
 * return and passes it on. */
static int each_statement(const struct conf *c, const char *role,
                          int (*emit)(const char *stmt, void *arg), void *arg)
{
    static const char *const fixed[] = {
        "GRANT USAGE ON SCHEMA idemq",
        "GRANT SELECT ON ALL TABLES IN SCHEMA idemq",
        "GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA idemq",
        /* archived history (`archive export`, `jobs show`): read only */
        "GRANT USAGE ON SCHEMA idemq_archive",
        "GRANT SELECT ON ALL TABLES IN SCHEMA idemq_archive",
        /* tables and functions later migrations create (by this role) */
        "ALTER DEFAULT PRIVILEGES IN SCHEMA idemq GRANT SELECT ON TABLES",
        "ALTER DEFAULT PRIVILEGES IN SCHEMA idemq GRANT EXECUTE ON FUNCTIONS",
    };
    char r[160], stmt[GRANT_SQL_MAX];
    int rc;

    ident(role, r, sizeof r);
    for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++) {
        snprintf(stmt, sizeof stmt, "%s TO %s", fixed[i], r);
        if ((rc = emit(stmt, arg)))
            return rc;
    }
    for (int i = 0; i < c->n_inputs; i++) {
        const char *fn = c->inputs[i].effect_function;
        const char *dot = strchr(fn, '.');
        bool seen = false;
        for (int k = 0; k < i; k++)
            seen = seen || strcmp(c->inputs[k].effect_function, fn) == 0;
        if (seen)
            continue;
        /* the config validated fn as a lowercase identifier, maybe qualified */
        if (dot) {
            snprintf(stmt, sizeof stmt, "GRANT USAGE ON SCHEMA %.*s TO %s", (int)(dot - fn), fn,
                     r);
            if ((rc = emit(stmt, arg)))
                return rc;
        }
        if (!c->inputs[i].effect_signature)
            continue; /* a Celery input's effects are its routes, below */
        snprintf(stmt, sizeof stmt, "GRANT EXECUTE ON FUNCTION %s TO %s",
                 c->inputs[i].effect_signature, r);
        if ((rc = emit(stmt, arg)))
            return rc;
    }
    for (int i = 0; i < c->n_inputs; i++) /* issue 19: Celery task routes */
        for (int k = 0; k < c->inputs[i].n_routes; k++) {
            const char *sig = c->inputs[i].routes[k].signature, *dot = strchr(sig, '.');
            const char *par = strchr(sig, '(');
            if (dot && par && dot < par) {
                snprintf(stmt, sizeof stmt, "GRANT USAGE ON SCHEMA %.*s TO %s",
                         (int)(dot - sig), sig, r);
                if ((rc = emit(stmt, arg)))
                    return rc;
            }
            snprintf(stmt, sizeof stmt, "GRANT EXECUTE ON FUNCTION %s TO %s", sig, r);
            if ((rc = emit(stmt, arg)))
                return rc;
        }
    for (int i = 0; i < c->n_pg_inputs; i++) { /* PostgreSQL queue inputs */
        const char *sig = c->pg_inputs[i].effect_signature, *dot;
        if (!sig)
            continue;
        dot = strchr(sig, '.');
        if (dot && dot < strchr(sig, '(')) {
            snprintf(stmt, sizeof stmt, "GRANT USAGE ON SCHEMA %.*s TO %s", (int)(dot - sig),
                     sig, r);
            if ((rc = emit(stmt, arg)))
                return rc;
        }
        snprintf(stmt, sizeof stmt, "GRANT EXECUTE ON FUNCTION %s TO %s", sig, r);
        if ((rc = emit(stmt, arg)))
            return rc;
    }
    return 0;
}

static int print_one(const char *stmt, void *arg)
{
    fprintf((FILE *)arg, "%s;\n", stmt);
    return 0;
}

void ledger_grants_print(const struct conf *c, const char *role, FILE *out)
{
    char r[160];
    fprintf(out,
            "-- The role of `idemq run`: reads the ledger, writes only through idemq's\n"
            "-- functions (SECURITY DEFINER, owned by the migrating role), executes the\n"
            "-- effects; no INSERT, UPDATE, DELETE or DDL. Run as the migrating role after\n"
            "-- `idemq migrate`. Create the role first, e.g.:\n"
            "--   CREATE ROLE %s LOGIN PASSWORD '...';\n"
            "BEGIN;\n",
            ident(role, r, sizeof r));
    each_statement(c, role, print_one, out);
    fprintf(out, "COMMIT;\n");
}

struct apply_ctx {
    PGconn *db;
    struct ledger_db_error e;
};

static int apply_one(const char *stmt, void *arg)
{
    struct apply_ctx *a = arg;
    return ledger_db_exec(a->db, stmt, &a->e) != IDEMQ_OK;
}

idemq_err_t ledger_grants_apply(PGconn *db, const struct conf *c, const char *role, char *errbuf,
                                size_t errlen)
{
    struct apply_ctx a = {db, {"", "", false}};
    idemq_err_t err;

    if ((err = ledger_db_exec(db, "BEGIN", &a.e)) != IDEMQ_OK)
        goto fail;
    if (each_statement(c, role, apply_one, &a)) {
        err = ledger_db_err(&a.e);
        goto fail;
    }
    if ((err = ledger_db_exec(db, "COMMIT", &a.e)) != IDEMQ_OK)
        goto fail;
    return IDEMQ_OK;
fail:
    snprintf(errbuf, errlen, "granting to role %s failed: %s %s", role, a.e.sqlstate,
             a.e.message);
    PQclear(PQexec(db, "ROLLBACK"));
    return err;
}
