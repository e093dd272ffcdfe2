/*
 * ledger_txn: calls the ledger's SQL functions with parameters only (no SQL
 * text is ever built from message or config content); the batch document
 * of idemq.apply_batch comes from ledger_doc, and plain batches go to
 * ledger_plain first.
 */
#include "ledger_txn.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <openssl/evp.h>

#include "classify.h"
#include "ledger_doc.h"
#include "ledger_plain.h"
#include "log.h"
#include "mask.h"
#include "protect.h"
#include "seal.h"
#include "trace.h"

struct ledger_txn {
    PGconn *db;
    const struct conf *conf;
    char *effects; /* text[] literal of the effects' OIDs (regprocedure), by input */
    double window_s; /* idemq.retention.dedup_window in seconds, as of the last
                      * batch that needed it (refresh_window) */
    struct ledger_doc doc; /* reusable batch document (isolating path) */
    struct ledger_plain *plain; /* the lean path's prepared statements */
    bool begin_pending;    /* BEGIN not sent yet: it goes with the next statement */
    bool keep_txn;         /* the caller's transaction is never rolled back: the plain
                            * path runs under a savepoint (ledger_txn_keep_transaction) */
};

/* The isolating path that owns everything the plain one does not (ordered
 * lanes, deferred jobs, failures, keys in other states); see
 * ledger/functions.sql. */
#define APPLY_SQL                                                                           \
    "SELECT r_idx, r_outcome, r_attempt, r_base, r_sqlstate, r_message, r_started, "        \
    "r_finished, r_delay_ms, r_park FROM idemq.apply_batch($1::text[], $2::jsonb, $3)"

/*
 * The effects as a text[] literal of OIDs, resolved in this session (so an
 * unqualified effect_function follows the session's search_path, while the
 * ledger functions run with theirs pinned). A signature that does not
 * resolve stays as it is: the apply call then fails naming it.
 */
static char *resolve_effects(PGconn *db, const struct conf *c, char *errbuf, size_t errlen)
{
    size_t need = 3;
    char *out;

    for (int i = 0; i < c->n_inputs; i++) {
        need += (c->inputs[i].effect_signature ? strlen(c->inputs[i].effect_signature) : 4) + 24;
        for (int k = 0; k < c->inputs[i].n_routes; k++)
            need += strlen(c->inputs[i].routes[k].signature) + 24;
    }
    if (!(out = malloc(need))) {
        snprintf(errbuf, errlen, "out of memory");
        return NULL;
    }
    strcpy(out, "{");
    /* the inputs' own effects, then every Celery task route, in
     * the order conf gave their indexes (struct conf_celery_route.effect) */
    for (int i = 0, n = c->n_inputs + c->n_routes, ri = 0, rk = 0; i < n; i++) {
        const char *params[1];
        if (i < c->n_inputs) {
            params[0] = c->inputs[i].effect_signature;
        } else {
            while (rk >= c->inputs[ri].n_routes) {
                ri++;
                rk = 0;
            }
            params[0] = c->inputs[ri].routes[rk++].signature;
        }
        PGresult *r;
        if (!params[0]) { /* a provider input without SQL effect */
            strcat(out, i ? ",NULL" : "NULL");
            continue;
        }
        r = ledger_db_exec_params(db, "SELECT to_regprocedure($1)::oid::text", 1, NULL, params,
                                  NULL, NULL, 0);
        if (PQresultStatus(r) != PGRES_TUPLES_OK || PQntuples(r) != 1) {
            snprintf(errbuf, errlen, "cannot resolve effect %s: %s", params[0],
                     PQerrorMessage(db));
            PQclear(r);
            free(out);
            return NULL;
        }
        strcat(out, i ? ",\"" : "\"");
        strcat(out, PQgetisnull(r, 0, 0) ? params[0] : PQgetvalue(r, 0, 0));
        strcat(out, "\"");
        PQclear(r);
    }
    strcat(out, "}");
    return out;
}

#define WINDOW_SQL "SELECT (idemq.ledger_settings()->>'dedup_window_s')::float8"

/* The dedup window (seconds) of the ledger's idemq.retention. */
static bool read_window(PGconn *db, double *window_s, char *errbuf, size_t errlen)
{
    PGresult *r = ledger_db_exec_raw(db, WINDOW_SQL);
    bool ok = PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1 && !PQgetisnull(r, 0, 0);
    if (ok)
        *window_s = strtod(PQgetvalue(r, 0, 0), NULL);
    else
        snprintf(errbuf, errlen, "cannot read the dedup window: %s", PQerrorMessage(db));
    PQclear(r);
    return ok;
}

/* The ledger's redrive secret (idemq.redrive_seal) into seal.c. */
static bool read_seal(PGconn *db, char *errbuf, size_t errlen)
{
    PGresult *r = ledger_db_exec_raw(db, "SELECT secret FROM idemq.redrive_seal WHERE id = 1");
    bool ok = PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1 &&
              seal_set_secret_hex(PQgetvalue(r, 0, 0));
    if (!ok)
        snprintf(errbuf, errlen, "cannot read the redrive secret (idemq.redrive_seal; run idemq "
                                 "migrate): %s", PQerrorMessage(db));
    PQclear(r);
    return ok;
}

struct ledger_txn *ledger_txn_new(PGconn *db, const struct conf *c, char *errbuf, size_t errlen)
{
    struct ledger_txn *lt = calloc(1, sizeof *lt);
    PGresult *res;

    if (!lt) {
        snprintf(errbuf, errlen, "out of memory");
        return NULL;
    }
    lt->db = db;
    lt->conf = c;
    ledger_doc_init(&lt->doc);
    if (!(lt->effects = resolve_effects(db, c, errbuf, errlen)) ||
        !read_window(db, &lt->window_s, errbuf, errlen) || !read_seal(db, errbuf, errlen) ||
        !(lt->plain = ledger_plain_new(db, c, errbuf, errlen))) {
        ledger_txn_free(lt);
        return NULL;
    }
    res = ledger_db_prepare(db, "idemq_apply", APPLY_SQL, 3);
    if (PQresultStatus(res) != PGRES_COMMAND_OK) {
        snprintf(errbuf, errlen, "cannot prepare the apply statement: %s", PQerrorMessage(db));
        PQclear(res);
        ledger_txn_free(lt);
        return NULL;
    }
    PQclear(res);
    return lt;
}

void ledger_txn_free(struct ledger_txn *lt)
{
    if (!lt)
        return;
    free(lt->effects);
    ledger_doc_free(&lt->doc);
    ledger_plain_free(lt->plain);
    free(lt);
}

void ledger_txn_keep_transaction(struct ledger_txn *lt, bool on) { lt->keep_txn = on; }

idemq_err_t ledger_txn_begin(struct ledger_txn *lt, struct ledger_db_error *e)
{
    /* Sent with the transaction's first statement: pipelined with the apply
     * call, that saves a round trip per batch. */
    (void)e;
    lt->begin_pending = true;
    return IDEMQ_OK;
}

/* Sends a pending BEGIN on its own (before a statement that is not the
 * pipelined apply call). */
static idemq_err_t flush_begin(struct ledger_txn *lt, struct ledger_db_error *e)
{
    if (!lt->begin_pending)
        return IDEMQ_OK;
    lt->begin_pending = false;
    return ledger_db_exec(lt->db, LEDGER_TXN_BEGIN, e);
}

idemq_err_t ledger_txn_commit(struct ledger_txn *lt, struct ledger_db_error *e)
{
    PGresult *res;
    idemq_err_t err = IDEMQ_OK;
    if (lt->begin_pending) { /* nothing was sent: nothing to commit */
        lt->begin_pending = false;
        return IDEMQ_OK;
    }
    res = ledger_db_exec_raw(lt->db, "COMMIT");
    /* A COMMIT of an aborted transaction answers ROLLBACK without error. */
    if (PQresultStatus(res) != PGRES_COMMAND_OK || strcmp(PQcmdStatus(res), "COMMIT") != 0) {
        ledger_db_error_from(lt->db, res, e);
        if (!e->conn_lost && !e->sqlstate[0]) {
            snprintf(e->sqlstate, sizeof e->sqlstate, "25P02");
            snprintf(e->message, sizeof e->message, "transaction was rolled back at commit");
        }
        err = ledger_db_err(e);
    }
    PQclear(res);
    return err;
}

void ledger_txn_rollback(struct ledger_txn *lt)
{
    if (lt->begin_pending) {
        lt->begin_pending = false;
        return;
    }
    if (PQstatus(lt->db) == CONNECTION_OK)
        PQclear(ledger_db_exec_raw(lt->db, "ROLLBACK"));
}

/*
 * Runs a prepared apply call (n params; lens/fmts may be NULL for text),
 * with a pending BEGIN in the same pipeline (one round trip for both).
 * Returns the apply call's result (the caller PQclears it; NULL only if
 * the connection failed) or, when BEGIN itself failed, that error result.
 */
static PGresult *exec_apply(struct ledger_txn *lt, const char *stmt, int n,
                            const char *const *params, const int *lens, const int *fmts)
{
    PGresult *r, *out = NULL;
    int nth = 0;

    if (!lt->begin_pending)
        return ledger_db_exec_prepared(lt->db, stmt, n, params, lens, fmts, 0);
    lt->begin_pending = false;
    if (!PQenterPipelineMode(lt->db) ||
        !PQsendQueryParams(lt->db, LEDGER_TXN_BEGIN, 0, NULL, NULL, NULL, NULL, 0) ||
        !PQsendQueryPrepared(lt->db, stmt, n, params, lens, fmts, 0) ||
        !PQpipelineSync(lt->db)) {
        PQexitPipelineMode(lt->db);
        return NULL;
    }
    /* Results: BEGIN, NULL, apply, NULL, then the sync. After an error the
     * rest come as PGRES_PIPELINE_ABORTED; the first error is kept. */
    for (;;) {
        ExecStatusType st;
        if (!(r = ledger_db_get_result(lt->db))) {
            if (PQstatus(lt->db) != CONNECTION_OK || ++nth > 2)
                break;
            continue;
        }
        st = PQresultStatus(r);
        if (st == PGRES_PIPELINE_SYNC) {
            PQclear(r);
            break;
        }
        if (!out && (nth == 1 || (st != PGRES_COMMAND_OK && st != PGRES_PIPELINE_ABORTED))) {
            out = r;
        } else {
            PQclear(r);
        }
    }
    PQexitPipelineMode(lt->db);
    return out;
}

static void copy_field(char *dst, size_t n, const PGresult *res, int row, int col)
{
    snprintf(dst, n, "%s", PQgetisnull(res, row, col) ? "" : PQgetvalue(res, row, col));
}

/*
 * Reads the dedup window again, for a batch that holds a job with a
 * (plausible) timestamp: `idemq migrate` may have changed it since the
 * session began, and pruning uses the ledger's value at once, so a replica
 * must not judge "old" by a longer window it read earlier. One short
 * statement (autocommit, or inside the open transaction); batches without
 * timestamps never pay it.
 */
static idemq_err_t refresh_window(struct ledger_txn *lt, struct ledger_db_error *e)
{
    PGresult *r = ledger_db_exec_raw(lt->db, WINDOW_SQL);
    if (PQresultStatus(r) != PGRES_TUPLES_OK || PQntuples(r) != 1 || PQgetisnull(r, 0, 0)) {
        ledger_db_error_from(lt->db, r, e);
        if (!e->conn_lost && !e->sqlstate[0]) {
            snprintf(e->sqlstate, sizeof e->sqlstate, "XX000");
            snprintf(e->message, sizeof e->message, "the ledger has no dedup window");
        }
        PQclear(r);
        return ledger_db_err(e);
    }
    lt->window_s = strtod(PQgetvalue(r, 0, 0), NULL);
    PQclear(r);
    return IDEMQ_OK;
}

/* Old: past the dedup window by its AMQP timestamp (seconds); none, or an
 * implausible one (job_timestamp): new. */
static bool is_old(const struct ledger_txn *lt, const struct job *j, time_t now)
{
    long long age = job_age_s(j, (long long)now);
    return age >= 0 && (double)age > lt->window_s;
}

/* msg (NUL-terminated, in cap bytes) with each sensitive value of j's body
 * replaced (mask.h): what idemq stores, logs and replies quotes no such
 * value. */
static void mask_message(const struct conf_input *in, const struct job *j, char *msg,
                         size_t cap)
{
    char *m;
    if (in->sensitive.n == 0 || !msg[0] || !j->body)
        return;
    if ((m = mask_text((const char *const *)in->sensitive.v, in->sensitive.n, j->body,
                       j->body_len, msg))) {
        snprintf(msg, cap, "%s", m);
        free(m);
    }
}

idemq_err_t ledger_txn_apply(struct ledger_txn *lt, struct job *const *jobs, int n,
                             struct ledger_result *res, struct ledger_db_error *e)
{
    const char *params[3];
    PGresult *r;
    bool plain = true; /* standard inputs, none too old: the plain path may take it */
    time_t now = time(NULL);
    idemq_err_t werr;

    for (int i = 0; i < n; i++)
        if (job_age_s(jobs[i], (long long)now) >= 0) {
            if ((werr = refresh_window(lt, e)) != IDEMQ_OK)
                return werr;
            break;
        }
    for (int i = 0; i < n && plain; i++) {
        const struct job *j = jobs[i];
        IDEMQ_ASSERT(j->decode_err == IDEMQ_OK && j->has_key);
        if (j->lane >= 0 || j->has_order_key || j->deferred_id > 0 || j->effect >= 0 ||
            is_old(lt, j, now))
            plain = false;
    }
    if (plain && ledger_plain_ready(lt->plain, jobs, n)) {
        /* Kept transaction: the plain statement runs after a savepoint,
         * and a fallback rolls back to it, so what the caller holds in the
         * transaction (claimed queue rows) stays held. The savepoint is
         * left open on success: the commit releases it, and releasing it
         * here would cost a round trip. */
        const char *first = lt->keep_txn ? "SAVEPOINT idemq_plain"
                            : lt->begin_pending ? LEDGER_TXN_BEGIN
                                                : NULL;
        bool ok = false;
        idemq_err_t err;
        if (lt->keep_txn && (err = flush_begin(lt, e)) != IDEMQ_OK)
            return err;
        lt->begin_pending = false;
        err = ledger_plain_apply(lt->plain, first, jobs, n, res, &ok, e);
        if (err == IDEMQ_OK && ok)
            return IDEMQ_OK;
        /* A timeout, a lost connection: the whole call failed, as one. */
        if (err == IDEMQ_ERR_DB_CONN || err == IDEMQ_ERR_NOMEM ||
            (err == IDEMQ_ERR_SQL && strcmp(e->sqlstate, "57014") == 0))
            return err;
        /* Not plain, or an effect raised: nothing of it stays. Apply the
         * batch again, isolating each job: in a new transaction, or in the
         * kept one from the savepoint. */
        log_debug("plain apply of %d jobs: %s; isolating each job", n,
                  err ? e->message : "a key is neither new nor applied");
        r = ledger_db_exec_raw(lt->db, lt->keep_txn ? "ROLLBACK TO SAVEPOINT idemq_plain"
                                                    : "ROLLBACK");
        if (PQresultStatus(r) != PGRES_COMMAND_OK) {
            ledger_db_error_from(lt->db, r, e);
            PQclear(r);
            return ledger_db_err(e);
        }
        PQclear(r);
        lt->begin_pending = !lt->keep_txn;
    }
    ledger_doc_begin(&lt->doc);
    for (int i = 0; i < n; i++)
        ledger_doc_add_job(&lt->doc, jobs[i], &lt->conf->inputs[jobs[i]->input], jobs[i]->input,
                           is_old(lt, jobs[i], now));
    if (!ledger_doc_end(&lt->doc))
        goto nomem;
    params[0] = lt->effects;
    params[1] = lt->doc.buf;
    params[2] = lt->conf->consumer_id;
    r = exec_apply(lt, "idemq_apply", 3, params, NULL, NULL);
    if (PQresultStatus(r) != PGRES_TUPLES_OK) {
        ledger_db_error_from(lt->db, r, e);
        PQclear(r);
        return ledger_db_err(e);
    }
    if (PQntuples(r) != n) {
        snprintf(e->message, sizeof e->message, "apply_batch returned %d rows for %d jobs",
                 PQntuples(r), n);
        snprintf(e->sqlstate, sizeof e->sqlstate, "XX000");
        e->conn_lost = false;
        PQclear(r);
        return IDEMQ_ERR_SQL;
    }
    for (int row = 0; row < n; row++) {
        int idx = atoi(PQgetvalue(r, row, 0)) - 1;
        const char *outcome = PQgetvalue(r, row, 1);
        struct ledger_result *x;
        if (idx < 0 || idx >= n) { /* a database answer: an error, never an abort */
            snprintf(e->message, sizeof e->message, "apply_batch returned index %d of %d",
                     idx + 1, n);
            snprintf(e->sqlstate, sizeof e->sqlstate, "XX000");
            e->conn_lost = false;
            PQclear(r);
            return IDEMQ_ERR_SQL;
        }
        x = &res[idx];
        ledger_txn_result_clear(x);
        x->outcome = strcmp(outcome, "applied") == 0     ? LEDGER_APPLIED
                     : strcmp(outcome, "duplicate") == 0 ? LEDGER_DUPLICATE
                     : strcmp(outcome, "early") == 0     ? LEDGER_EARLY
                     : strcmp(outcome, "repark") == 0    ? LEDGER_REPARK
                     : strcmp(outcome, "deferred") == 0  ? LEDGER_DEFERRED
                     : strcmp(outcome, "held") == 0      ? LEDGER_HELD
                     : strcmp(outcome, "outside") == 0   ? LEDGER_OUTSIDE
                     : strcmp(outcome, "conflict") == 0  ? LEDGER_CONFLICT
                                                         : LEDGER_ERROR;
        x->attempt = atoi(PQgetvalue(r, row, 2));
        x->base = atoi(PQgetvalue(r, row, 3));
        copy_field(x->sqlstate, sizeof x->sqlstate, r, row, 4);
        if (x->outcome == LEDGER_DUPLICATE || x->outcome == LEDGER_REPARK)
            copy_field(x->prior_state, sizeof x->prior_state, r, row, 5);
        else
            copy_field(x->message, sizeof x->message, r, row, 5);
        mask_message(&lt->conf->inputs[jobs[idx]->input], jobs[idx], x->message,
                     sizeof x->message);
        copy_field(x->started_at, sizeof x->started_at, r, row, 6);
        copy_field(x->finished_at, sizeof x->finished_at, r, row, 7);
        x->delay_ms = PQgetisnull(r, row, 8) ? 0 : atol(PQgetvalue(r, row, 8));
        if (!PQgetisnull(r, row, 9))
            x->park = json_loads(PQgetvalue(r, row, 9), 0, NULL);
    }
    PQclear(r);
    return IDEMQ_OK;
nomem:
    snprintf(e->message, sizeof e->message, "out of memory building the batch");
    e->sqlstate[0] = '\0';
    e->conn_lost = false;
    return IDEMQ_ERR_NOMEM;
}

#define OBSERVE_SQL "SELECT r_idx, r_outcome, r_code FROM idemq.observe_batch($1::jsonb, $2)"

static idemq_err_t observe_bad(struct ledger_db_error *e, const char *what)
{
    snprintf(e->message, sizeof e->message, "observe_batch: %s", what);
    snprintf(e->sqlstate, sizeof e->sqlstate, "XX000");
    e->conn_lost = false;
    return IDEMQ_ERR_SQL;
}

idemq_err_t ledger_txn_observe(struct ledger_txn *lt, struct job *const *jobs, int n,
                               struct ledger_observed *res, struct ledger_db_error *e)
{
    bool *old = calloc((size_t)(n > 0 ? n : 1), sizeof *old);
    time_t now = time(NULL);
    const char *params[2];
    char *doc;
    PGresult *r;
    idemq_err_t err;

    if (!old)
        goto nomem;
    for (int i = 0; i < n; i++)
        if (job_age_s(jobs[i], (long long)now) >= 0) {
            if ((err = refresh_window(lt, e)) != IDEMQ_OK) {
                free(old);
                return err;
            }
            break;
        }
    for (int i = 0; i < n; i++)
        old[i] = is_old(lt, jobs[i], now);
    doc = ledger_observe_doc(lt->conf, jobs, old, n);
    free(old);
    if (!doc) {
nomem:
        snprintf(e->message, sizeof e->message, "out of memory building the observations");
        e->sqlstate[0] = '\0';
        e->conn_lost = false;
        return IDEMQ_ERR_NOMEM;
    }
    if ((err = flush_begin(lt, e)) != IDEMQ_OK) {
        free(doc);
        return err;
    }
    params[0] = doc;
    params[1] = lt->conf->consumer_id;
    r = ledger_db_exec_params(lt->db, OBSERVE_SQL, 2, NULL, params, NULL, NULL, 0);
    free(doc);
    if (PQresultStatus(r) != PGRES_TUPLES_OK) {
        ledger_db_error_from(lt->db, r, e);
        PQclear(r);
        return ledger_db_err(e);
    }
    if (PQntuples(r) != n) {
        PQclear(r);
        return observe_bad(e, "a row count that is not the job count");
    }
    for (int row = 0; row < n; row++) {
        int idx = atoi(PQgetvalue(r, row, 0)) - 1;
        struct ledger_observed *x;
        if (idx < 0 || idx >= n) { /* a database answer: an error, never an abort */
            PQclear(r);
            return observe_bad(e, "an index out of range");
        }
        x = &res[idx];
        memset(x, 0, sizeof *x);
        x->outcome = ledger_observe_outcome_parse(PQgetvalue(r, row, 1));
        copy_field(x->code_name, sizeof x->code_name, r, row, 2);
        x->code = ledger_observe_code_parse(x->code_name);
        if (x->outcome == OBSERVE_NONE) {
            PQclear(r);
            return observe_bad(e, "an unknown outcome");
        }
    }
    PQclear(r);
    return IDEMQ_OK;
}

void ledger_txn_result_clear(struct ledger_result *r)
{
    json_decref(r->park);
    memset(r, 0, sizeof *r);
}

/* Runs a statement whose parameters are text except those in fmts[] = 1.
 * If out is given, the first column of the first row is parsed as JSON into
 * it (NULL for SQL NULL). */
static idemq_err_t exec_params(struct ledger_txn *lt, const char *sql, int n,
                               const char *const *vals, const int *lens, const int *fmts,
                               json_t **out, struct ledger_db_error *e)
{
    PGresult *r;
    idemq_err_t err = flush_begin(lt, e);
    if (err)
        return err;
    r = ledger_db_exec_params(lt->db, sql, n, NULL, vals, lens, fmts, 0);
    if (PQresultStatus(r) != PGRES_TUPLES_OK && PQresultStatus(r) != PGRES_COMMAND_OK) {
        ledger_db_error_from(lt->db, r, e);
        err = ledger_db_err(e);
    } else if (out) {
        *out = NULL;
        if (PQntuples(r) == 1 && !PQgetisnull(r, 0, 0))
            *out = json_loads(PQgetvalue(r, 0, 0), 0, NULL);
    }
    PQclear(r);
    return err;
}

static char *dump(json_t *v) { return json_dumps(v, JSON_COMPACT); }

/* Seals body[0..n) with the process's active key into *sealed (NULL, and
 * IDEMQ_OK, when no key is active: stored as sent). A copy that cannot be
 * sealed is never stored in the clear: the error fails the call. */
static idemq_err_t seal_body(const unsigned char *body, size_t n, unsigned char **sealed,
                             size_t *sealed_len, struct ledger_db_error *e)
{
    const struct protect *p = protect_global();
    idemq_err_t err;

    *sealed = NULL;
    *sealed_len = 0;
    if (!protect_active(p))
        return IDEMQ_OK;
    if ((err = protect_seal(p, body ? body : (const unsigned char *)"", body ? n : 0, sealed,
                            sealed_len)) != IDEMQ_OK) {
        snprintf(e->message, sizeof e->message, "cannot seal the stored body: %s",
                 idemq_err_str(err));
        e->sqlstate[0] = '\0';
        e->conn_lost = false;
    }
    return err;
}

idemq_err_t ledger_txn_record_failure(struct ledger_txn *lt, const struct job *j,
                                      struct ledger_result *r, const char *error_class,
                                      const char *error_code, bool park, long delay_ms,
                                      struct ledger_db_error *e)
{
    const struct conf_input *in = &lt->conf->inputs[j->input];
    char attempt[16], delay[24];
    char *headers = dump(j->headers), *props = dump(j->props);
    const char *vals[20];
    int lens[20] = {0}, fmts[20] = {0};
    idemq_err_t err;
    unsigned char *sealed = NULL;
    size_t sealed_len = 0;
    json_t *meta = json_pack("{s:s,s:b}", "routing_key", j->routing_key, "redelivered",
                             j->redelivered);
    char *meta_s;

    if (meta && j->delivery_count >= 0)
        json_object_set_new(meta, "delivery_count", json_integer(j->delivery_count));
    if (meta && j->acquired_count >= 0)
        json_object_set_new(meta, "acquired_count", json_integer(j->acquired_count));
    {
        /* the job's trace, recorded with the attempt (its trace id) */
        char tp[TRACE_PARENT_LEN + 1];
        trace_job_parent(&j->trace, tp);
        if (meta && tp[0])
            json_object_set_new(meta, "traceparent", json_string(tp));
    }
    meta_s = meta ? dump(meta) : NULL;
    json_decref(meta);
    if (!headers || !props || !meta_s) {
        free(headers);
        free(props);
        free(meta_s);
        snprintf(e->message, sizeof e->message, "out of memory");
        e->sqlstate[0] = '\0';
        e->conn_lost = false;
        return IDEMQ_ERR_NOMEM;
    }
    mask_message(in, j, r->message, sizeof r->message);
    snprintf(attempt, sizeof attempt, "%d", r->attempt);
    snprintf(delay, sizeof delay, "%ld", delay_ms);
    vals[0] = j->key;
    vals[1] = attempt;
    vals[2] = error_class;
    vals[3] = error_code;
    vals[4] = r->sqlstate[0] ? r->sqlstate : NULL;
    vals[5] = r->message;
    vals[6] = park ? "true" : "false";
    vals[7] = delay;
    vals[8] = r->started_at[0] ? r->started_at : NULL;
    vals[9] = r->finished_at[0] ? r->finished_at : NULL;
    vals[10] = in->queue;
    vals[11] = j->exchange;
    vals[12] = j->routing_key;
    vals[13] = meta_s;
    vals[14] = lt->conf->consumer_id;
    vals[15] = (const char *)j->body;
    lens[15] = (int)j->body_len;
    fmts[15] = 1;
    vals[16] = headers;
    vals[17] = props;
    vals[18] = NULL;
    vals[19] = NULL;
    json_decref(r->park);
    r->park = NULL;
    /* a park's body and a retry's copy alike */
    if ((err = seal_body(j->body, j->body_len, &sealed, &sealed_len, e)) != IDEMQ_OK)
        goto out;
    if (sealed) {
        vals[18] = (const char *)sealed;
        lens[18] = (int)sealed_len;
        fmts[18] = 1;
        vals[19] = protect_active(protect_global());
    }
    err = exec_params(lt,
                      "SELECT idemq.record_failure($1, $2, $3, $4, $5, $6, $7, $8, "
                      "coalesce($9::timestamptz, clock_timestamp()), "
                      "coalesce($10::timestamptz, clock_timestamp()), $11, $12, $13, $14, "
                      "$15, $16, $17, $18, $19, $20)",
                      20, vals, lens, fmts, &r->park, e);
out:
    free(sealed);
    free(headers);
    free(props);
    free(meta_s);
    return err;
}

idemq_err_t ledger_txn_park_message(struct ledger_txn *lt, const struct job *j, const char *code,
                                    const char *reason, bool with_headers, json_t **park,
                                    struct ledger_db_error *e)
{
    const struct conf_input *in = &lt->conf->inputs[j->input];
    char *headers = with_headers ? dump(j->headers) : NULL, *props = dump(j->props);
    char size[24];
    char *shown = reason && j->body ? mask_text((const char *const *)in->sensitive.v,
                                                in->sensitive.n, j->body, j->body_len, reason)
                                    : NULL;
    bool whole = j->body_size <= j->body_len && j->wire_err != IDEMQ_ERR_UNDECODABLE;
    const char *vals[14];
    int lens[14] = {0}, fmts[14] = {0};
    idemq_err_t err;
    unsigned char *sealed = NULL;
    size_t sealed_len = 0;
    char sha[65];

    snprintf(size, sizeof size, "%llu", (unsigned long long)j->body_size);
    vals[0] = j->has_key ? j->key : NULL;
    vals[1] = in->queue;
    vals[2] = j->exchange;
    vals[3] = j->routing_key;
    vals[4] = (const char *)(j->body ? j->body : (const unsigned char *)"");
    lens[4] = (int)j->body_len;
    fmts[4] = 1;
    vals[5] = headers;
    vals[6] = props;
    vals[7] = code;
    vals[8] = shown ? shown : reason;
    vals[9] = lt->conf->consumer_id;
    vals[10] = j->sha256_hex[0] ? j->sha256_hex : NULL;
    vals[11] = size;
    vals[12] = whole ? "true" : "false";
    vals[13] = NULL;
    if ((err = seal_body(j->body, j->body_len, &sealed, &sealed_len, e)) != IDEMQ_OK)
        goto out;
    if (sealed) {
        if (!vals[10]) { /* the hash of what is held, not of the sealed copy */
            unsigned char md[EVP_MAX_MD_SIZE];
            unsigned mdlen = 0;
            if (EVP_Digest(j->body ? j->body : (const unsigned char *)"",
                           j->body ? j->body_len : 0, md, &mdlen, EVP_sha256(), NULL) != 1) {
                snprintf(e->message, sizeof e->message, "cannot hash the parked body");
                e->sqlstate[0] = '\0';
                e->conn_lost = false;
                err = IDEMQ_ERR_INTERNAL;
                goto out;
            }
            for (unsigned i = 0; i < mdlen && i < 32; i++)
                snprintf(sha + 2 * i, 3, "%02x", md[i]);
            vals[10] = sha;
        }
        vals[4] = (const char *)sealed;
        lens[4] = (int)sealed_len;
        vals[13] = protect_active(protect_global());
    }
    err = exec_params(lt,
                      "SELECT idemq.park_message($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, "
                      "$12, $13, $14)",
                      14, vals, lens, fmts, park, e);
out:
    free(sealed);
    free(headers);
    free(shown);
    free(props);
    return err;
}

idemq_err_t ledger_txn_mark_dead_lettered(struct ledger_txn *lt, const long long *park_ids,
                                          int n, struct ledger_db_error *e)
{
    size_t cap = (size_t)n * 24 + 3;
    char *arr = malloc(cap);
    size_t off = 0;
    const char *vals[1];
    idemq_err_t err;

    if (!arr) {
        snprintf(e->message, sizeof e->message, "out of memory");
        e->sqlstate[0] = '\0';
        e->conn_lost = false;
        return IDEMQ_ERR_NOMEM;
    }
    arr[off++] = '{';
    for (int i = 0; i < n; i++)
        off += (size_t)snprintf(arr + off, cap - off, "%s%lld", i ? "," : "", park_ids[i]);
    arr[off++] = '}';
    arr[off] = '\0';
    vals[0] = arr;
    err = exec_params(lt, "SELECT idemq.mark_dead_lettered($1::bigint[])", 1, vals, NULL, NULL,
                      NULL, e);
    free(arr);
    return err;
}

idemq_err_t ledger_txn_claim_failed(struct ledger_txn *lt, const struct job *j,
                                    struct ledger_result *r, struct ledger_db_error *e)
{
    const char *vals[3] = {j->key, lt->conf->inputs[j->input].queue, j->sha256_hex};
    PGresult *res;
    const char *state;
    /* The claim belongs to the transaction that records the failure: a
     * pending BEGIN goes first, or the claim would commit on its own and
     * release its row lock before the failure is recorded. */
    idemq_err_t err = flush_begin(lt, e);

    if (err)
        return err;
    res = ledger_db_exec_params(lt->db,
                       "SELECT r_state, r_attempt, r_base, clock_timestamp() "
                       "FROM idemq.claim_failed($1, $2, $3)",
                       3, NULL, vals, NULL, NULL, 0);
    if (PQresultStatus(res) != PGRES_TUPLES_OK || PQntuples(res) != 1) {
        ledger_db_error_from(lt->db, res, e);
        PQclear(res);
        return ledger_db_err(e);
    }
    ledger_txn_result_clear(r);
    state = PQgetvalue(res, 0, 0);
    r->outcome = strcmp(state, "applied") == 0 || strcmp(state, "parked") == 0
                     ? LEDGER_DUPLICATE
                     : LEDGER_ERROR;
    snprintf(r->prior_state, sizeof r->prior_state, "%s", state);
    r->attempt = atoi(PQgetvalue(res, 0, 1));
    r->base = atoi(PQgetvalue(res, 0, 2));
    copy_field(r->started_at, sizeof r->started_at, res, 0, 3);
    copy_field(r->finished_at, sizeof r->finished_at, res, 0, 3);
    PQclear(res);
    return IDEMQ_OK;
}
