/*
 * ledger_grants: GRANT statements for the roles of a deployment: `idemq
 * run`, an operator, an application that emits (see ledger_grants.h).
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

/* The functions an operator's commands and the console call (jobs show,
 * parked list/groups/redrive/discard/archive, redrive, resolve, reconcile,
 * maintain, archive export, observe report, the redrive of a postgres
 * input's park into its queue); every overload of each. */
static const char operator_functions[] =
    "'job_info', 'key_history', 'key_batches', 'key_attempts', 'key_outbox', 'park_group', "
    "'mask_reason', "
    "'adopt_dead_letter', 'ops_close_parks', 'close_park', 'ops_action_begin', 'ops_action_moved', "
    "'ops_action_finish', 'erase_key', "
    "'provider_answer_text', 'provider_resolve', 'provider_sweep', 'provider_result', "
    "'provider_confirmed', 'provider_effect_failed', 'provider_gauges', 'provider_latency', "
    "'archive_exported', 'ledger_settings', 'maintain', 'observe_report', 'queue_redrive'";

/* Calls emit(stmt, arg) for each statement of the run role; stops at the
 * first non-zero return and passes it on. */
static int run_statements(const struct conf *c, const char *r,
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
    char stmt[GRANT_SQL_MAX];
    int rc;

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
    for (int i = 0; i < c->n_inputs; i++) /* Celery task routes */
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
    for (int t = 0; t < 2; t++) { /* PostgreSQL queue inputs, then Amazon SQS inputs */
        const struct conf_input *ins = t ? c->sqs_inputs : c->pg_inputs;
        int n = t ? c->n_sqs_inputs : c->n_pg_inputs;
        for (int i = 0; i < n; i++) {
            const char *sig = ins[i].effect_signature, *dot;
            if (!sig)
                continue;
            dot = strchr(sig, '.');
            if (dot && dot < strchr(sig, '(')) {
                snprintf(stmt, sizeof stmt, "GRANT USAGE ON SCHEMA %.*s TO %s",
                         (int)(dot - sig), sig, r);
                if ((rc = emit(stmt, arg)))
                    return rc;
            }
            snprintf(stmt, sizeof stmt, "GRANT EXECUTE ON FUNCTION %s TO %s", sig, r);
            if ((rc = emit(stmt, arg)))
                return rc;
        }
    }
    return 0;
}

/* The operator role: reads the ledger and the archive, executes the
 * functions of the operator commands; no effect, no write of its own. */
static int operator_statements(const char *r, int (*emit)(const char *stmt, void *arg),
                               void *arg)
{
    static const char *const fixed[] = {
        "GRANT USAGE ON SCHEMA idemq",
        "GRANT SELECT ON ALL TABLES IN SCHEMA idemq",
        "GRANT USAGE ON SCHEMA idemq_archive",
        "GRANT SELECT ON ALL TABLES IN SCHEMA idemq_archive",
        "ALTER DEFAULT PRIVILEGES IN SCHEMA idemq GRANT SELECT ON TABLES",
    };
    char stmt[GRANT_SQL_MAX];
    char lit[200];
    size_t o = 0;
    int rc;

    for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++) {
        snprintf(stmt, sizeof stmt, "%s TO %s", fixed[i], r);
        if ((rc = emit(stmt, arg)))
            return rc;
    }
    /* r as a string literal for format(): ' doubled */
    lit[o++] = '\'';
    for (const char *p = r; *p && o + 3 < sizeof lit; p++) {
        if (*p == '\'')
            lit[o++] = '\'';
        lit[o++] = *p;
    }
    lit[o++] = '\'';
    lit[o] = '\0';
    snprintf(stmt, sizeof stmt,
             "DO $grant$ DECLARE f regprocedure; BEGIN FOR f IN SELECT p.oid::regprocedure "
             "FROM pg_proc p WHERE p.pronamespace = 'idemq'::regnamespace AND p.proname IN (%s) "
             "LOOP EXECUTE format('GRANT EXECUTE ON FUNCTION %%s TO %%s', f, %s); END LOOP; "
             "END $grant$",
             operator_functions, lit);
    return emit(stmt, arg);
}

/* The application role: emits to the outbox (idemq.emit, both forms) and
 * enqueues into PostgreSQL queue inputs (idemq.enqueue, enqueue_raw). */
static int app_statements(const char *r, int (*emit)(const char *stmt, void *arg), void *arg)
{
    static const char *const fixed[] = {
        "GRANT USAGE ON SCHEMA idemq",
        "GRANT EXECUTE ON FUNCTION idemq.emit(text, text, text, jsonb, text, text)",
        "GRANT EXECUTE ON FUNCTION idemq.emit(text, text, bytea, jsonb, text, text)",
        /* transactional enqueue into PostgreSQL queue inputs */
        "GRANT EXECUTE ON FUNCTION idemq.enqueue(text, jsonb, text, text, timestamptz, integer)",
        "GRANT EXECUTE ON FUNCTION idemq.enqueue_raw(text, bytea, text, text, timestamptz, int)",
    };
    char stmt[GRANT_SQL_MAX];
    int rc;
    for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++) {
        snprintf(stmt, sizeof stmt, "%s TO %s", fixed[i], r);
        if ((rc = emit(stmt, arg)))
            return rc;
    }
    return 0;
}

static int each_statement(const struct conf *c, enum ledger_grants_kind kind, const char *role,
                          int (*emit)(const char *stmt, void *arg), void *arg)
{
    char r[160];
    ident(role, r, sizeof r);
    switch (kind) {
    case LEDGER_GRANTS_RUN: return run_statements(c, r, emit, arg);
    case LEDGER_GRANTS_OPERATOR: return operator_statements(r, emit, arg);
    case LEDGER_GRANTS_APP: return app_statements(r, emit, arg);
    }
    return 0;
}

static int print_one(const char *stmt, void *arg)
{
    fprintf((FILE *)arg, "%s;\n", stmt);
    return 0;
}

const char *ledger_grants_kind_name(enum ledger_grants_kind kind)
{
    switch (kind) {
    case LEDGER_GRANTS_RUN: return "run";
    case LEDGER_GRANTS_OPERATOR: return "operator";
    case LEDGER_GRANTS_APP: return "app";
    }
    return "?";
}

void ledger_grants_print_kind(const struct conf *c, enum ledger_grants_kind kind,
                              const char *role, FILE *out)
{
    static const char *const what[] = {
        [LEDGER_GRANTS_RUN] =
            "-- The role of `idemq run`: reads the ledger, writes only through idemq's\n"
            "-- functions (SECURITY DEFINER, owned by the migrating role), executes the\n"
            "-- effects; no INSERT, UPDATE, DELETE or DDL.",
        [LEDGER_GRANTS_OPERATOR] =
            "-- The operator role (jobs show, parked, redrive, resolve, reconcile, maintain,\n"
            "-- archive, observe report, the console): reads the ledger and the archive,\n"
            "-- writes only through the operator functions; no effect, no INSERT, UPDATE,\n"
            "-- DELETE or DDL.",
        [LEDGER_GRANTS_APP] =
            ("-- The role of an application that emits to the outbox and enqueues jobs:\n"
             "-- idemq.emit and idemq.enqueue, nothing else of schema idemq (no reader\n"
             "-- of a key's story or result)."),
    };
    char r[160];
    fprintf(out,
            "%s\n"
            "-- Run as the migrating role after `idemq migrate`. `idemq migrate --grant`\n"
            "-- creates the role when it does not exist, as:\n"
            "--   CREATE ROLE %s LOGIN;  -- then ALTER ROLE ... PASSWORD '...'\n"
            "BEGIN;\n",
            what[kind], ident(role, r, sizeof r));
    each_statement(c, kind, role, print_one, out);
    fprintf(out, "COMMIT;\n");
}

void ledger_grants_print(const struct conf *c, const char *role, FILE *out)
{
    ledger_grants_print_kind(c, LEDGER_GRANTS_RUN, role, out);
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

/* Creates role (LOGIN, no password) unless it exists; inside the caller's
 * transaction. *created says which. */
static idemq_err_t ensure_role(struct apply_ctx *a, const char *role, bool *created)
{
    const char *params[1] = {role};
    char r[160], stmt[256];
    PGresult *res = ledger_db_query(a->db, "SELECT EXISTS (SELECT 1 FROM pg_roles "
                                           "WHERE rolname = $1)",
                                    1, params, &a->e);
    bool exists;
    if (!res)
        return ledger_db_err(&a->e);
    exists = strcmp(PQgetvalue(res, 0, 0), "t") == 0;
    PQclear(res);
    *created = !exists;
    if (exists)
        return IDEMQ_OK;
    snprintf(stmt, sizeof stmt, "CREATE ROLE %s LOGIN", ident(role, r, sizeof r));
    return ledger_db_exec(a->db, stmt, &a->e);
}

idemq_err_t ledger_grants_apply_kind(PGconn *db, const struct conf *c,
                                     enum ledger_grants_kind kind, const char *role,
                                     bool *created, char *errbuf, size_t errlen)
{
    struct apply_ctx a = {db, {"", "", false}};
    idemq_err_t err;
    bool made = false;

    if ((err = ledger_db_exec(db, "BEGIN", &a.e)) != IDEMQ_OK)
        goto fail;
    if ((err = ensure_role(&a, role, &made)) != IDEMQ_OK)
        goto fail;
    if (each_statement(c, kind, role, apply_one, &a)) {
        err = ledger_db_err(&a.e);
        goto fail;
    }
    if ((err = ledger_db_exec(db, "COMMIT", &a.e)) != IDEMQ_OK)
        goto fail;
    if (created)
        *created = made;
    return IDEMQ_OK;
fail:
    snprintf(errbuf, errlen, "granting to %s role %s failed: %s %s",
             ledger_grants_kind_name(kind), role, a.e.sqlstate, a.e.message);
    PQclear(PQexec(db, "ROLLBACK"));
    return err;
}

idemq_err_t ledger_grants_apply(PGconn *db, const struct conf *c, const char *role, char *errbuf,
                                size_t errlen)
{
    return ledger_grants_apply_kind(db, c, LEDGER_GRANTS_RUN, role, NULL, errbuf, errlen);
}
