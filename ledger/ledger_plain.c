/*
 * ledger_plain: the plain-batch statement and its pipelined runs (see
 * ledger_plain.h). The statement lives here, not in a SQL function, because
 * the effect must be named in it for it to be planned once per session: a
 * PL/pgSQL function would plan a dynamic EXECUTE on every batch and pay its
 * own interpreter and subtransaction besides.
 */
#include "ledger_plain.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ledger_doc.h"
#include "log.h"

/*
 * One run of jobs of one input. $1 keys, $2 first copy of its key in the
 * run, $3 the 32-byte body digests end to end, $4 the distinct metas, $5
 * each job's meta index, $6 payloads, $7 consumer id.
 *  b:      the batch's id and time (one idemq.batches row).
 *  ins:    claims every distinct key, in key order (concurrent claimers wait
 *          on keys in the same order), settled: state applied, attempt 1,
 *          with the first 8 bytes of its digest (sha256_head, migration 19).
 *  notnew: the distinct keys it did not claim.
 *  old:    those claimed before this statement, as of its snapshot, with
 *          the head of their digest: from the isolating path's whole digest,
 *          else the row's head, else (rows from before migration 19) the
 *          batch row's.
 *  chk:    plain unless one of them is in another state than applied, or is
 *          applied with another body (a reused key: apply_batch records it;
 *          the first 8 bytes decide, see migration 19).
 *  eff:    the effects of the claimed keys, in delivery order (the call is
 *          evaluated after the sort), only when plain; idemq.trace_meta in
 *          the call's arguments sets the job's trace context first.
 *  dup:    an attempt row per delivery of a key applied before.
 *  agg:    one pass over eff: results, which job was applied, the later
 *          copies of a key (duplicates), the positions not applied and the
 *          raced ones.
 *  bat:    the history row: keys, digests, metas and agg's arrays.
 * Returns: plain; the 1-based positions of the jobs not applied; the
 * positions of "raced" jobs, whose key a transaction claimed and committed
 * while this one waited for it (so it is not in this snapshot), for
 * idemq.record_raced to settle in the next statement; the batch's start
 * and end.
 */
static const char plain_sql[] =
    "WITH b AS MATERIALIZED ("
    "  SELECT nextval('idemq.batches_id_seq') AS id, clock_timestamp() AS t0"
    "), ins AS ("
    "  INSERT INTO idemq.jobs AS j (key, state, attempts, first_seen_at, applied_at, batch_id,"
    "                              sha256_head)"
    "  SELECT u.k, 'applied', 1, b.t0, b.t0, b.id,"
    "         substring($3::bytea FROM (u.o::integer - 1) * 32 + 1 FOR 8)"
    "    FROM unnest($1::text[], $2::boolean[]) WITH ORDINALITY AS u(k, f, o), b"
    "   WHERE u.f ORDER BY 1"
    "  ON CONFLICT (key) DO NOTHING"
    "  RETURNING j.key"
    "), notnew AS MATERIALIZED ("
    "  SELECT u.k FROM unnest($1::text[], $2::boolean[]) AS u(k, f) WHERE u.f"
    "  EXCEPT ALL SELECT ins.key FROM ins"
    "), old AS MATERIALIZED (" /* a lookup by key each (OFFSET 0 keeps it a nested loop) */
    "  SELECT t.key, t.state, t.attempts, t.generation, t.sha FROM notnew n"
    "   CROSS JOIN LATERAL (SELECT j.key, j.state, j.attempts, j.generation,"
    "                              CASE WHEN j.payload_sha256 IS NOT NULL"
    "                                   THEN substring(decode(j.payload_sha256, 'hex') FOR 8)"
    "                                   WHEN j.sha256_head IS NOT NULL THEN j.sha256_head"
    "                                   ELSE (SELECT substring(h.sha256 FROM"
    "                                           (array_position(h.keys, j.key) - 1) * 32 + 1 FOR 8)"
    "                                           FROM idemq.batches h"
    "                                          WHERE h.at = j.applied_at AND h.id = j.batch_id)"
    "                              END AS sha"
    "                         FROM idemq.jobs j WHERE j.key = n.k OFFSET 0) t"
    "), chk AS MATERIALIZED (" /* a key reused with another body: the isolating path */
    "  SELECT NOT EXISTS (SELECT 1 FROM old WHERE old.state <> 'applied')"
    "     AND NOT EXISTS (SELECT 1 FROM unnest($1::text[]) WITH ORDINALITY AS x(k, o)"
    "                       JOIN old ON old.key = x.k"
    "                      WHERE old.sha <>"
    "                            substring($3::bytea FROM (x.o::integer - 1) * 32 + 1 FOR 8))"
    "       AS plain"
    "), eff AS MATERIALIZED ("
    "  SELECT x.o, x.k, x.f, c.key IS NOT NULL AS claimed,"
    "         CASE WHEN x.f AND c.key IS NOT NULL THEN %s(x.k, x.p,"
    "                                   idemq.trace_meta(($4::jsonb[])[x.mi])) END AS r"
    "    FROM unnest($1::text[], $6::jsonb[], $5::integer[], $2::boolean[])"
    "         WITH ORDINALITY AS x(k, p, mi, f, o)"
    "    LEFT JOIN ins c ON c.key = x.k"
    "   WHERE (SELECT chk.plain FROM chk)"
    "   ORDER BY x.o"
    "), dup AS ("
    "  INSERT INTO idemq.attempts (key, attempt, generation, outcome, started_at, finished_at,"
    "      queue, routing_key, redelivered, delivery_count, acquired_count, consumer_id,"
    "      message)"
    "  SELECT x.k, old.attempts, old.generation, 'duplicate', b.t0, clock_timestamp(),"
    "         ($4::jsonb[])[x.mi]->>'queue', ($4::jsonb[])[x.mi]->>'routing_key',"
    "         (($4::jsonb[])[x.mi]->>'redelivered')::boolean,"
    "         (($4::jsonb[])[x.mi]->>'delivery_count')::integer,"
    "         (($4::jsonb[])[x.mi]->>'acquired_count')::integer, $7::text, 'applied'"
    "    FROM unnest($1::text[], $5::integer[]) WITH ORDINALITY AS x(k, mi, o)"
    "    JOIN old ON old.key = x.k, b"
    "   WHERE (SELECT chk.plain FROM chk)"
    "   ORDER BY x.o"
    "), agg AS MATERIALIZED (" /* one pass over eff, in its (delivery) order */
    "  SELECT array_agg(e.r) AS r, array_agg(e.f AND e.claimed) AS applied,"
    "         coalesce(array_agg(e.o::integer) FILTER (WHERE NOT e.f AND e.claimed), '{}') AS dups,"
    "         coalesce(string_agg(e.o::text, ',') FILTER (WHERE NOT (e.f AND e.claimed)), '')"
    "           AS skipped,"
    "         coalesce(string_agg(e.o::text, ',') FILTER (WHERE NOT e.claimed AND e.k IN"
    "           (SELECT notnew.k FROM notnew EXCEPT ALL SELECT old.key FROM old)), '') AS raced,"
    "         bool_or(e.f AND e.claimed) AS some_applied"
    "    FROM eff e"
    "), bat AS ("
    "  INSERT INTO idemq.batches (id, at, finished_at, consumer_id, keys, sha256, metas,"
    "                             meta_idx, results, applied, dups)"
    "  SELECT b.id, b.t0, clock_timestamp(), $7::text, $1::text[], $3::bytea, $4::jsonb[],"
    "         $5::integer[], a.r, a.applied, a.dups"
    "    FROM b, agg a WHERE a.some_applied"
    ")"
    "SELECT c.plain, a.skipped, a.raced, b.t0, clock_timestamp() FROM b, chk c, agg a";

#define PLAIN_NPARAMS 7
#define RACED_SQL "SELECT idemq.record_raced($1::jsonb, $2, $3::timestamptz)"

struct ledger_plain {
    PGconn *db;
    const struct conf *conf;
    bool *prepared; /* by input: has a statement idemq_plain_<i> */
    struct ledger_cols cols;
    struct ledger_doc raced; /* jobs for idemq.record_raced */
};

/* The effect's name as the database quotes it ("schema"."fn"), or "" if
 * the signature resolves to no function. */
static bool quoted_name(PGconn *db, const char *signature, char *out, size_t len, char *errbuf,
                        size_t errlen)
{
    const char *params[1] = {signature};
    PGresult *r = ledger_db_exec_params(
        db,
        "SELECT format('%I.%I', n.nspname, p.proname) FROM pg_catalog.pg_proc p "
        "JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace "
        "WHERE p.oid = pg_catalog.to_regprocedure($1)",
        1, NULL, params, NULL, NULL, 0);
    bool ok = PQresultStatus(r) == PGRES_TUPLES_OK;
    if (!ok)
        snprintf(errbuf, errlen, "cannot resolve effect %s: %s", signature, PQerrorMessage(db));
    else
        snprintf(out, len, "%s", PQntuples(r) == 1 ? PQgetvalue(r, 0, 0) : "");
    PQclear(r);
    return ok;
}

/* Whether this session's role may write what the plain statement writes.
 * A least-privilege role (`idemq migrate --grant`: EXECUTE and SELECT only)
 * may not: every batch then takes the isolating path, whose functions run
 * with their owner's rights. */
static bool may_write(PGconn *db, char *errbuf, size_t errlen)
{
    PGresult *r = ledger_db_exec_raw(
        db, "SELECT has_table_privilege('idemq.jobs', 'INSERT') "
            "AND has_table_privilege('idemq.batches', 'INSERT') "
            "AND has_table_privilege('idemq.attempts', 'INSERT') "
            "AND has_sequence_privilege('idemq.batches_id_seq', 'USAGE') "
            "AND has_sequence_privilege('idemq.attempts_id_seq', 'USAGE') "
            "AND has_function_privilege('idemq.record_raced(jsonb, text, timestamptz)', "
            "'EXECUTE')");
    bool ok = PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1;
    bool yes = ok && strcmp(PQgetvalue(r, 0, 0), "t") == 0;
    if (!ok)
        snprintf(errbuf, errlen, "cannot read the session's privileges: %s", PQerrorMessage(db));
    PQclear(r);
    if (ok && !yes)
        log_info("this role may not write the ledger tables (least privilege): every batch "
                 "takes the isolating path (idemq.apply_batch)");
    return yes;
}

struct ledger_plain *ledger_plain_new(PGconn *db, const struct conf *c, char *errbuf,
                                      size_t errlen)
{
    struct ledger_plain *lp = calloc(1, sizeof *lp);
    char *sql = NULL;

    if (!lp || !(lp->prepared = calloc((size_t)c->n_inputs, sizeof *lp->prepared)) ||
        !(sql = malloc(sizeof plain_sql + 300))) {
        snprintf(errbuf, errlen, "out of memory");
        goto fail;
    }
    lp->db = db;
    lp->conf = c;
    ledger_doc_cols_init(&lp->cols);
    ledger_doc_init(&lp->raced);
    errbuf[0] = '\0';
    if (!may_write(db, errbuf, errlen)) {
        if (errbuf[0])
            goto fail;
        free(sql);
        return lp; /* no statement: ledger_plain_ready is false for every batch */
    }
    for (int i = 0; i < c->n_inputs; i++) {
        char name[300], stmt[32];
        PGresult *r;
        if (CONF_INPUT_ORDERED(&c->inputs[i]) || !c->inputs[i].effect_signature)
            continue; /* ordered lanes and provider inputs never take this path */
        if (!quoted_name(db, c->inputs[i].effect_signature, name, sizeof name, errbuf, errlen))
            goto fail;
        if (!name[0])
            continue;
        snprintf(sql, sizeof plain_sql + 300, plain_sql, name);
        snprintf(stmt, sizeof stmt, "idemq_plain_%d", i);
        r = ledger_db_prepare(db, stmt, sql, PLAIN_NPARAMS);
        if (PQresultStatus(r) != PGRES_COMMAND_OK) {
            snprintf(errbuf, errlen, "cannot prepare the plain apply of input %s: %s",
                     c->inputs[i].name, PQerrorMessage(db));
            PQclear(r);
            goto fail;
        }
        PQclear(r);
        lp->prepared[i] = true;
    }
    free(sql);
    return lp;
fail:
    free(sql);
    ledger_plain_free(lp);
    return NULL;
}

void ledger_plain_free(struct ledger_plain *lp)
{
    if (!lp)
        return;
    ledger_doc_cols_free(&lp->cols);
    ledger_doc_free(&lp->raced);
    free(lp->prepared);
    free(lp);
}

bool ledger_plain_ready(const struct ledger_plain *lp, struct job *const *jobs, int n)
{
    for (int i = 0; i < n; i++)
        if (!lp->prepared[jobs[i]->input])
            return false;
    return true;
}

static void copy_field(char *dst, size_t n, const PGresult *res, int row, int col)
{
    snprintf(dst, n, "%s", PQgetisnull(res, row, col) ? "" : PQgetvalue(res, row, col));
}

/* Sets outcome o on the listed positions (1-based, comma-separated) of
 * res[0..n); false if the list is not one. */
static bool mark(const char *p, int n, struct ledger_result *res, enum ledger_outcome o)
{
    while (*p) {
        char *end;
        long pos = strtol(p, &end, 10);
        if (end == p || pos < 1 || pos > n)
            return false;
        res[pos - 1].outcome = o;
        snprintf(res[pos - 1].prior_state, sizeof res[pos - 1].prior_state, "applied");
        p = *end == ',' ? end + 1 : end;
    }
    return true;
}

/* Fills res[0..n) of one run from its row: every job applied (attempt 1)
 * except the listed positions, duplicates of an applied key; raced ones
 * are LEDGER_HELD until idemq.record_raced settles them. */
static bool fill_run(const PGresult *r, int n, struct ledger_result *res)
{
    for (int i = 0; i < n; i++) {
        ledger_txn_result_clear(&res[i]);
        res[i].outcome = LEDGER_APPLIED;
        res[i].attempt = 1;
        copy_field(res[i].started_at, sizeof res[i].started_at, r, 0, 3);
        copy_field(res[i].finished_at, sizeof res[i].finished_at, r, 0, 4);
    }
    return mark(PQgetvalue(r, 0, 1), n, res, LEDGER_DUPLICATE) &&
           mark(PQgetvalue(r, 0, 2), n, res, LEDGER_HELD);
}

/* After the runs: the raced jobs (LEDGER_HELD in res) are duplicates if
 * their keys are applied (idemq.record_raced writes their attempt rows);
 * *plain becomes false if one is not. */
static idemq_err_t settle_raced(struct ledger_plain *lp, struct job *const *jobs, int n,
                                struct ledger_result *res, bool *plain, struct ledger_db_error *e)
{
    const char *params[3];
    PGresult *r;
    int raced = 0;

    ledger_doc_begin(&lp->raced);
    for (int i = 0; i < n; i++)
        if (res[i].outcome == LEDGER_HELD) {
            ledger_doc_add_job(&lp->raced, jobs[i], &lp->conf->inputs[jobs[i]->input],
                               jobs[i]->input, false);
            raced++;
        }
    if (!raced)
        return IDEMQ_OK;
    if (!ledger_doc_end(&lp->raced)) {
        snprintf(e->message, sizeof e->message, "out of memory building the batch");
        e->sqlstate[0] = '\0';
        e->conn_lost = false;
        return IDEMQ_ERR_NOMEM;
    }
    params[0] = lp->raced.buf;
    params[1] = lp->conf->consumer_id;
    params[2] = res[0].started_at;
    if (!(r = ledger_db_query(lp->db, RACED_SQL, 3, params, e)))
        return ledger_db_err(e);
    if (strcmp(PQgetvalue(r, 0, 0), "t") == 0) {
        for (int i = 0; i < n; i++)
            if (res[i].outcome == LEDGER_HELD)
                res[i].outcome = LEDGER_DUPLICATE;
    } else {
        *plain = false;
    }
    PQclear(r);
    return IDEMQ_OK;
}

/* Sends the statement of one run: jobs[0..n) of one input. */
static bool send_run(struct ledger_plain *lp, struct job *const *jobs, int n)
{
    const struct conf_input *in = &lp->conf->inputs[jobs[0]->input];
    static const int cols[] = {0, LEDGER_COL_KEYS,    1, LEDGER_COL_FIRST,
                               2, LEDGER_COL_SHA,     3, LEDGER_COL_METAS,
                               4, LEDGER_COL_META_IDX, 5, LEDGER_COL_PAYLOADS};
    const char *params[PLAIN_NPARAMS];
    int lens[PLAIN_NPARAMS] = {0}, fmts[PLAIN_NPARAMS] = {0};
    char stmt[32];

    ledger_doc_cols_begin(&lp->cols);
    for (int i = 0; i < n; i++)
        ledger_doc_cols_add_job(&lp->cols, jobs[i], in, jobs[i]->input);
    if (!ledger_doc_cols_end(&lp->cols))
        return false;
    for (size_t k = 0; k < sizeof cols / sizeof cols[0]; k += 2) {
        params[cols[k]] = lp->cols.col[cols[k + 1]].buf;
        lens[cols[k]] = (int)lp->cols.col[cols[k + 1]].len;
        fmts[cols[k]] = 1;
    }
    params[6] = lp->conf->consumer_id;
    snprintf(stmt, sizeof stmt, "idemq_plain_%d", jobs[0]->input);
    return PQsendQueryPrepared(lp->db, stmt, PLAIN_NPARAMS, params, lens, fmts, 0) == 1;
}

idemq_err_t ledger_plain_apply(struct ledger_plain *lp, const char *first,
                               struct job *const *jobs, int n, struct ledger_result *res, bool *plain,
                               struct ledger_db_error *e)
{
    PGresult *r;
    idemq_err_t err = IDEMQ_OK;
    bool nomem = false, failed = false;
    int runs = 0, nth = 0;

    *plain = true;
    IDEMQ_ASSERT(ledger_plain_ready(lp, jobs, n));
    if (!PQenterPipelineMode(lp->db))
        goto conn;
    if (first && !PQsendQueryParams(lp->db, first, 0, NULL, NULL, NULL, NULL, 0))
        goto conn_pipe;
    for (int lo = 0; lo < n;) {
        int hi = lo + 1;
        while (hi < n && jobs[hi]->input == jobs[lo]->input)
            hi++;
        if (!send_run(lp, jobs + lo, hi - lo)) {
            if (lp->cols.nomem) {
                nomem = true;
                break;
            }
            goto conn_pipe;
        }
        runs++;
        lo = hi;
    }
    if (!PQpipelineSync(lp->db))
        goto conn_pipe;
    /* Results: [first,] each run's rows, each followed by NULL, then the
     * sync. After an error the rest come as PGRES_PIPELINE_ABORTED; the
     * first error is kept. */
    for (int lo = 0, idx = first ? -1 : 0;;) {
        ExecStatusType st;
        if (!(r = ledger_db_get_result(lp->db))) {
            if (PQstatus(lp->db) != CONNECTION_OK || ++nth > runs + (first ? 1 : 0))
                break;
            continue;
        }
        st = PQresultStatus(r);
        if (st == PGRES_PIPELINE_SYNC) {
            PQclear(r);
            break;
        }
        if (st == PGRES_TUPLES_OK && idx >= 0 && !failed) {
            int hi = lo + 1;
            while (hi < n && jobs[hi]->input == jobs[lo]->input)
                hi++;
            if (PQntuples(r) != 1 || strcmp(PQgetvalue(r, 0, 0), "t") != 0)
                *plain = false;
            else if (!fill_run(r, hi - lo, res + lo) && !failed) {
                /* a database answer: an error, never an abort */
                snprintf(e->message, sizeof e->message,
                         "the plain apply returned a bad position list");
                snprintf(e->sqlstate, sizeof e->sqlstate, "XX000");
                e->conn_lost = false;
                err = IDEMQ_ERR_SQL;
                failed = true;
            }
            lo = hi;
            idx++;
        } else if (st == PGRES_COMMAND_OK && idx < 0) {
            idx = 0; /* first */
        } else if (st != PGRES_PIPELINE_ABORTED && !failed) {
            ledger_db_error_from(lp->db, r, e);
            err = ledger_db_err(e);
            failed = true;
        }
        PQclear(r);
    }
    PQexitPipelineMode(lp->db);
    if (PQstatus(lp->db) != CONNECTION_OK)
        goto conn;
    if (nomem) {
        snprintf(e->message, sizeof e->message, "out of memory building the batch");
        e->sqlstate[0] = '\0';
        e->conn_lost = false;
        return IDEMQ_ERR_NOMEM;
    }
    if (err == IDEMQ_OK && *plain)
        err = settle_raced(lp, jobs, n, res, plain, e);
    return err;
conn_pipe:
    PQexitPipelineMode(lp->db);
conn:
    ledger_db_error_from(lp->db, NULL, e);
    return ledger_db_err(e);
}
