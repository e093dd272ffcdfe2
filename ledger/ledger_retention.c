/*
 * ledger_retention: calls idemq.set_retention and idemq.maintain with
 * parameters only; the asynchronous caller of `run` (see the header).
 */
#include "ledger_retention.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"

#define BUDGET_MS 200     /* work per maintenance call */
#define AGAIN_MS 1000     /* next call while work is left */
#define IDLE_MAX_MS 60000 /* next call otherwise, at most */
#define FAIL_MS 30000     /* after a failure */
/* A call unanswered this long (a frozen or vanished server: the kernel may
 * still answer TCP) is abandoned with its session. */
#define CALL_DEADLINE_MS 60000

struct ledger_retention {
    const struct conf *c;
    char who[256];
    PGconn *db;
    bool in_flight;
    long long sent_ms; /* when the call in flight was sent */
    long long next_ms; /* 0: at the first tick */
    long long idle_ms; /* min(IDLE_MAX_MS, partition interval / 4) */
};

idemq_err_t ledger_retention_apply(PGconn *db, const struct conf *c, bool *changed,
                                   struct ledger_db_error *e)
{
    char window[32], hot[32], retention[32], who[300];
    const char *params[5] = {window, c->partition_interval, hot, retention, who};
    PGresult *r;

    snprintf(window, sizeof window, "%.9g", c->dedup_window_days);
    snprintf(hot, sizeof hot, "%.9g", c->history_hot_days);
    snprintf(retention, sizeof retention, "%.9g", c->history_retention_days);
    snprintf(who, sizeof who, "idemq migrate (%s)", c->path);
    r = ledger_db_query(db,
                        "SELECT idemq.set_retention($1::float8 * interval '1 day', "
                        "$2::interval, $3::float8 * interval '1 day', "
                        "$4::float8 * interval '1 day', $5)",
                        5, params, e);
    if (!r)
        return ledger_db_err(e);
    *changed = strcmp(PQgetvalue(r, 0, 0), "t") == 0;
    PQclear(r);
    return IDEMQ_OK;
}

idemq_err_t ledger_retention_maintain(PGconn *db, const char *who, int budget_ms,
                                      const char *now, json_t **result,
                                      struct ledger_db_error *e)
{
    char budget[16];
    const char *params[3] = {who, budget, now};
    PGresult *r;

    *result = NULL;
    snprintf(budget, sizeof budget, "%d", budget_ms);
    /* set_config(..., true): the time override lives for this call only */
    r = ledger_db_query(db,
                        "SELECT idemq.maintain($1, $2::integer) FROM (SELECT CASE WHEN $3::text "
                        "IS NULL THEN '' ELSE set_config('idemq.maintenance_now', $3, true) END) s",
                        3, params, e);
    if (!r)
        return ledger_db_err(e);
    *result = json_loads(PQgetvalue(r, 0, 0), 0, NULL);
    PQclear(r);
    if (!*result) {
        snprintf(e->message, sizeof e->message, "idemq.maintain returned no JSON");
        snprintf(e->sqlstate, sizeof e->sqlstate, "XX000");
        e->conn_lost = false;
        return IDEMQ_ERR_SQL;
    }
    return IDEMQ_OK;
}

long ledger_retention_log_failures(json_t *result)
{
    json_t *errs = json_object_get(result, "errors"), *e;
    size_t i;

    json_array_foreach(errs, i, e) {
        log_warn("maintenance: step %s of %s failed (the other steps ran; trying again in the "
                 "next call): %s %s",
                 json_string_value(json_object_get(e, "step")),
                 json_string_value(json_object_get(e, "rel")),
                 json_string_value(json_object_get(e, "sqlstate")),
                 json_string_value(json_object_get(e, "message")));
    }
    return (long)json_integer_value(json_object_get(result, "failed"));
}

struct ledger_retention *ledger_retention_new(const struct conf *c, const char *who)
{
    struct ledger_retention *lr = calloc(1, sizeof *lr);
    if (!lr)
        return NULL;
    lr->c = c;
    snprintf(lr->who, sizeof lr->who, "%s", who);
    lr->idle_ms = (long long)(c->partition_interval_s * 1000.0 / 4.0);
    if (lr->idle_ms > IDLE_MAX_MS)
        lr->idle_ms = IDLE_MAX_MS;
    if (lr->idle_ms < AGAIN_MS)
        lr->idle_ms = AGAIN_MS;
    return lr;
}

void ledger_retention_free(struct ledger_retention *lr)
{
    if (!lr)
        return;
    if (lr->db)
        PQfinish(lr->db);
    free(lr);
}

static void drop(struct ledger_retention *lr, long long now_ms, const char *why)
{
    log_warn("maintenance: %s (trying again in %d s)", why, FAIL_MS / 1000);
    if (lr->db)
        PQfinish(lr->db);
    lr->db = NULL;
    lr->in_flight = false;
    lr->next_ms = now_ms + FAIL_MS;
}

/* Reads the finished call's answer and schedules the next one. */
static void collect(struct ledger_retention *lr, long long now_ms)
{
    PGresult *r, *first = NULL;
    json_t *v = NULL;
    bool more = false;
    long failed = 0;

    while ((r = PQgetResult(lr->db))) {
        if (!first)
            first = r;
        else
            PQclear(r);
    }
    lr->in_flight = false;
    if (PQresultStatus(first) != PGRES_TUPLES_OK || PQntuples(first) != 1) {
        char why[600];
        const char *state = first ? PQresultErrorField(first, PG_DIAG_SQLSTATE) : NULL;
        snprintf(why, sizeof why, "idemq.maintain failed: %s %s", state ? state : "",
                 first ? PQresultErrorMessage(first) : PQerrorMessage(lr->db));
        PQclear(first);
        if (PQstatus(lr->db) != CONNECTION_OK) {
            drop(lr, now_ms, why);
        } else {
            log_warn("maintenance: %s (trying again in %d s)", why, FAIL_MS / 1000);
            lr->next_ms = now_ms + FAIL_MS;
        }
        return;
    }
    v = json_loads(PQgetvalue(first, 0, 0), 0, NULL);
    PQclear(first);
    more = json_is_true(json_object_get(v, "more"));
    if (json_is_true(json_object_get(v, "busy"))) {
        log_debug("maintenance: another replica is at it");
    } else {
        long long created = json_integer_value(json_object_get(v, "created"));
        long long pruned = json_integer_value(json_object_get(v, "pruned"));
        long long archived = json_integer_value(json_object_get(v, "archived"));
        long long dropped = json_integer_value(json_object_get(v, "dropped"));
        long long rescued = json_integer_value(json_object_get(v, "rescued"));
        failed = ledger_retention_log_failures(v);
        if (created || archived || dropped || rescued)
            log_info("maintenance: %lld partitions created, %lld archived, %lld dropped, "
                     "%lld rows moved out of default partitions, %lld keys pruned%s",
                     created, archived, dropped, rescued, pruned, more ? " (more to do)" : "");
        else if (pruned)
            log_debug("maintenance: %lld keys pruned%s", pruned, more ? " (more to do)" : "");
    }
    json_decref(v);
    /* a step that failed is tried again after FAIL_MS, as a failed call */
    lr->next_ms = now_ms + (failed ? FAIL_MS : more ? AGAIN_MS : lr->idle_ms);
}

void ledger_retention_tick(struct ledger_retention *lr, long long now_ms)
{
    char budget[16], err[512];
    const char *params[2] = {lr->who, budget};

    if (lr->in_flight) {
        if (!PQconsumeInput(lr->db)) {
            drop(lr, now_ms, PQerrorMessage(lr->db));
            return;
        }
        if (!PQisBusy(lr->db))
            collect(lr, now_ms);
        else if (now_ms - lr->sent_ms > CALL_DEADLINE_MS)
            drop(lr, now_ms, "idemq.maintain unanswered for 60 s; abandoning its session");
        return;
    }
    if (now_ms < lr->next_ms)
        return;
    if (!lr->db || PQstatus(lr->db) != CONNECTION_OK) {
        if (lr->db)
            PQfinish(lr->db);
        /* no statement_timeout beyond the server's: a call is bounded by its budget */
        lr->db = ledger_db_connect(lr->c->dsn, "idemq maintenance", 0, err, sizeof err);
        if (!lr->db) {
            drop(lr, now_ms, err);
            return;
        }
    }
    snprintf(budget, sizeof budget, "%d", BUDGET_MS);
    if (!PQsendQueryParams(lr->db, "SELECT idemq.maintain($1, $2::integer)", 2, NULL, params,
                           NULL, NULL, 0)) {
        drop(lr, now_ms, PQerrorMessage(lr->db));
        return;
    }
    lr->in_flight = true;
    lr->sent_ms = now_ms;
}
