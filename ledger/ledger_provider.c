/*
 * ledger_provider: parameter-only calls of the provider-effect functions
 * (see ledger_provider.h). bytea values travel in binary format; every
 * other parameter is text.
 */
#include "ledger_provider.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "protect.h"

#define STEP_COLUMNS                                                                        \
    "r_action, r_attempt, r_lease, r_delay_ms, r_park, r_message, r_lookup, r_sqlstate, "   \
    "r_body, r_body_key"

const char *ledger_provider_action_name(enum ledger_provider_action a)
{
    switch (a) {
    case LEDGER_PROVIDER_CALL: return "call";
    case LEDGER_PROVIDER_LOOKUP: return "lookup";
    case LEDGER_PROVIDER_APPLIED: return "applied";
    case LEDGER_PROVIDER_DUPLICATE: return "duplicate";
    case LEDGER_PROVIDER_WAIT: return "wait";
    case LEDGER_PROVIDER_RETRY: return "retry";
    case LEDGER_PROVIDER_PARK: return "park";
    case LEDGER_PROVIDER_EFFECT_ERROR: return "effect_error";
    case LEDGER_PROVIDER_CONFIRMED: return "confirmed";
    }
    return "?";
}

void ledger_provider_step_clear(struct ledger_provider_step *s)
{
    json_decref(s->park);
    if (s->body && s->body_opened) {
        explicit_bzero(s->body, s->body_len);
        free(s->body);
    } else if (s->body) {
        PQfreemem(s->body);
    }
    memset(s, 0, sizeof *s);
}

char *ledger_provider_opts(const struct conf *c, int i)
{
    const struct conf_input *in = &c->inputs[i];
    const struct conf_provider *p = &in->provider;
    json_t *o = json_pack(
        "{s:s, s:s, s:b, s:i, s:i, s:i, s:b, s:b, s:i, s:i, s:i, s:i, s:i, s:i, s:s, s:s?}",
        "input", in->name, "provider", p->name[0] ? p->name : in->name, "idempotent",
        p->idempotent,
        /* The lease covers the call and the answer's transaction; a late
         * answer after it is still handled (a fencing token). */
        "lease_ms", p->timeout_ms + 5000, "timeout_ms", p->timeout_ms, "key_window_s",
        p->key_window_s, "lookup_key", p->lookup_key_path[0] != '\0', "lookup_ref",
        p->lookup_reference_path[0] != '\0', "max_attempts", c->max_attempts, "wait_max",
        p->wait_max, "base_delay_ms", c->base_delay_ms, "max_delay_ms", c->max_delay_ms,
        "retry_after_max_ms", p->retry_after_max_ms, "reconcile_after_s",
        p->reconcile_after_s, "reference_field", p->reference_field, "effect",
        in->effect_signature);
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    return s;
}

/* Reads row i's r_body into s (opened with the key r_body_key names when
 * it was sealed at rest). A copy whose key is not listed, or that does
 * not open, leaves s->body NULL and s->unopened set: it is never sent.
 * False (e filled) when memory runs out. */
static bool take_body(PGresult *r, int i, int off, struct ledger_provider_step *s,
                      struct ledger_db_error *e)
{
    unsigned char *stored, *plain = NULL;
    size_t stored_len = 0, plain_len = 0;
    enum protect_open_result o;

    stored = PQunescapeBytea((const unsigned char *)PQgetvalue(r, i, off + 8), &stored_len);
    if (!stored)
        goto nomem;
    if (PQgetisnull(r, i, off + 9)) { /* stored as sent */
        s->body = stored;
        s->body_len = stored_len;
        return true;
    }
    snprintf(s->body_key, sizeof s->body_key, "%s", PQgetvalue(r, i, off + 9));
    o = protect_open(protect_global(), s->body_key, stored, stored_len, &plain, &plain_len);
    PQfreemem(stored);
    if (o == PROTECT_FAILED)
        goto nomem;
    if (o != PROTECT_OPENED) {
        s->unopened = protect_open_str(o);
        return true;
    }
    /* protect's buffer (malloc'd): ledger_provider_step_clear wipes and
     * frees it, not PQfreemem */
    s->body = plain;
    s->body_len = plain_len;
    s->body_opened = true;
    return true;
nomem:
    snprintf(e->sqlstate, sizeof e->sqlstate, "XX000");
    snprintf(e->message, sizeof e->message, "out of memory reading a request body");
    e->conn_lost = false;
    return false;
}

/* Runs sql with params (formats: 1 = binary for bytea) and reads the step
 * rows into out[0..max). */
static idemq_err_t run_steps(PGconn *db, const char *sql, int n, const char *const *vals,
                             const int *lens, const int *fmts, bool with_key,
                             struct ledger_provider_step *out, int max, int *got,
                             struct ledger_db_error *e)
{
    PGresult *r = ledger_db_exec_params(db, sql, n, NULL, vals, lens, fmts, 0);
    int rows, off = with_key ? 1 : 0;

    *got = 0;
    if (PQresultStatus(r) != PGRES_TUPLES_OK) {
        ledger_db_error_from(db, r, e);
        PQclear(r);
        return ledger_db_err(e);
    }
    rows = PQntuples(r);
    for (int i = 0; i < rows && i < max; i++) {
        struct ledger_provider_step *s = &out[i];
        const char *a = PQgetvalue(r, i, off + 0);
        memset(s, 0, sizeof *s);
        if (with_key)
            snprintf(s->key, sizeof s->key, "%s", PQgetvalue(r, i, 0));
        s->action = strcmp(a, "call") == 0        ? LEDGER_PROVIDER_CALL
                    : strcmp(a, "lookup") == 0    ? LEDGER_PROVIDER_LOOKUP
                    : strcmp(a, "applied") == 0   ? LEDGER_PROVIDER_APPLIED
                    : strcmp(a, "duplicate") == 0 ? LEDGER_PROVIDER_DUPLICATE
                    : strcmp(a, "wait") == 0      ? LEDGER_PROVIDER_WAIT
                    : strcmp(a, "retry") == 0     ? LEDGER_PROVIDER_RETRY
                    : strcmp(a, "park") == 0      ? LEDGER_PROVIDER_PARK
                    : strcmp(a, "confirmed") == 0 ? LEDGER_PROVIDER_CONFIRMED
                                                  : LEDGER_PROVIDER_EFFECT_ERROR;
        if (s->action == LEDGER_PROVIDER_EFFECT_ERROR && strcmp(a, "effect_error") != 0) {
            snprintf(e->sqlstate, sizeof e->sqlstate, "XX000");
            snprintf(e->message, sizeof e->message, "the ledger answered action '%s'", a);
            e->conn_lost = false;
            PQclear(r);
            return IDEMQ_ERR_SQL;
        }
        s->attempt = PQgetisnull(r, i, off + 1) ? 0 : atoi(PQgetvalue(r, i, off + 1));
        s->lease = PQgetisnull(r, i, off + 2) ? 0 : atoi(PQgetvalue(r, i, off + 2));
        s->delay_ms = PQgetisnull(r, i, off + 3) ? 0 : atol(PQgetvalue(r, i, off + 3));
        if (!PQgetisnull(r, i, off + 4))
            s->park = json_loads(PQgetvalue(r, i, off + 4), 0, NULL);
        snprintf(s->message, sizeof s->message, "%s", PQgetvalue(r, i, off + 5));
        s->by_reference = strcmp(PQgetvalue(r, i, off + 6), "reference") == 0;
        snprintf(s->sqlstate, sizeof s->sqlstate, "%s", PQgetvalue(r, i, off + 7));
        if (!PQgetisnull(r, i, off + 8) && !take_body(r, i, off, s, e)) {
            PQclear(r);
            return IDEMQ_ERR_SQL;
        }
        if (s->action == LEDGER_PROVIDER_PARK && !s->park) {
            snprintf(e->sqlstate, sizeof e->sqlstate, "XX000");
            snprintf(e->message, sizeof e->message, "the ledger parked %s without park facts",
                     with_key ? s->key : "a job");
            e->conn_lost = false;
            PQclear(r);
            return IDEMQ_ERR_SQL;
        }
        (*got)++;
    }
    PQclear(r);
    return IDEMQ_OK;
}

/* Exactly one step row. */
static idemq_err_t run_step(PGconn *db, const char *sql, int n, const char *const *vals,
                            const int *lens, const int *fmts, struct ledger_provider_step *s,
                            struct ledger_db_error *e)
{
    int got = 0;
    idemq_err_t err = run_steps(db, sql, n, vals, lens, fmts, false, s, 1, &got, e);
    if (err == IDEMQ_OK && got != 1) {
        snprintf(e->sqlstate, sizeof e->sqlstate, "XX000");
        snprintf(e->message, sizeof e->message, "the ledger returned %d steps, not 1", got);
        e->conn_lost = false;
        return IDEMQ_ERR_SQL;
    }
    return err;
}

idemq_err_t ledger_provider_begin(PGconn *db, const char *doc, const char *opts,
                                  const char *consumer, const void *body, size_t body_len,
                                  const char *props, const char *request_sha,
                                  const void *req_body, size_t req_len,
                                  struct ledger_provider_step *s, struct ledger_db_error *e)
{
    unsigned char *sealed = NULL, *msg = NULL;
    size_t sealed_len = 0, msg_len = 0;
    const char *key = NULL, *msg_key = NULL;
    char size[24];
    const char *vals[10] = {doc, opts, consumer, body, props, request_sha, req_body, NULL,
                            NULL, NULL};
    int lens[10] = {0, 0, 0, (int)body_len, 0, 0, (int)req_len, 0, 0, 0};
    int fmts[10] = {0, 0, 0, 1, 0, 0, 1, 0, 0, 0};
    const char *what = "request body";
    idemq_err_t err;

    /* both copies sealed at rest with the active key, never stored in the
     * clear: the request, and the message (parks, the local effect) */
    if ((err = protect_seal_stored(req_body, req_len, &sealed, &sealed_len, &key)) == IDEMQ_OK) {
        what = "message";
        err = protect_seal_stored(body, body_len, &msg, &msg_len, &msg_key);
    }
    if (err != IDEMQ_OK) {
        free(sealed);
        snprintf(e->sqlstate, sizeof e->sqlstate, "XX000");
        snprintf(e->message, sizeof e->message, "cannot seal the %s: %s", what,
                 idemq_err_str(err));
        e->conn_lost = false;
        return IDEMQ_ERR_SQL;
    }
    if (sealed) {
        vals[6] = (const char *)sealed;
        lens[6] = (int)sealed_len;
        vals[7] = key;
    }
    if (msg) {
        snprintf(size, sizeof size, "%zu", body_len);
        vals[3] = (const char *)msg;
        lens[3] = (int)msg_len;
        vals[8] = msg_key;
        vals[9] = size;
    }
    err = run_step(db,
                   "SELECT " STEP_COLUMNS " FROM idemq.provider_begin(($1::jsonb)->0, "
                   "$2::jsonb, $3, $4::bytea, $5::jsonb, $6, $7::bytea, $8, $9, $10::bigint)",
                   10, vals, lens, fmts, s, e);
    free(sealed);
    free(msg);
    return err;
}

/* Whether s[0..len) is well-formed UTF-8 (no overlongs, no surrogates). */
static bool utf8_valid(const unsigned char *s, size_t len)
{
    size_t i = 0;
    while (i < len) {
        unsigned char c = s[i];
        size_t n = c < 0x80 ? 0 : (c & 0xe0) == 0xc0 ? 1 : (c & 0xf0) == 0xe0 ? 2
                               : (c & 0xf8) == 0xf0 ? 3 : 4;
        unsigned long cp = n == 0 ? c : n == 1 ? c & 0x1fu : n == 2 ? c & 0x0fu : c & 0x07u;
        if (n == 4 || (n == 1 && c < 0xc2) || n > len - i - 1) /* bad lead byte, or cut */
            return false;
        for (size_t k = 1; k <= n; k++) {
            if ((s[i + k] & 0xc0) != 0x80)
                return false;
            cp = (cp << 6) | (s[i + k] & 0x3fu);
        }
        if ((n == 2 && (cp < 0x800 || (cp >= 0xd800 && cp <= 0xdfff))) ||
            (n == 3 && (cp < 0x10000 || cp > 0x10ffff)))
            return false;
        i += n + 1;
    }
    return true;
}

idemq_err_t ledger_provider_result(PGconn *db, const char *key, int lease, const char *op,
                                   const char *cls, long status, const char *answer,
                                   const char *ref, long retry_after_ms, const char *detail,
                                   const char *opts, const char *doc, const char *consumer,
                                   bool sweep, struct ledger_provider_step *s,
                                   struct ledger_db_error *e)
{
    char lease_s[16], status_s[16], ra[24], why[160];
    size_t ref_len = strlen(ref);
    const char *vals[13] = {key,  lease_s, op,     cls, status_s, answer, ref,
                            ra,   detail,  opts,   doc, consumer, sweep ? "true" : "false"};
    snprintf(lease_s, sizeof lease_s, "%d", lease);
    snprintf(status_s, sizeof status_s, "%ld", status);
    /* p_retry_after_ms is an integer: any longer wait is "too long" alike */
    snprintf(ra, sizeof ra, "%ld", retry_after_ms > INT_MAX ? (long)INT_MAX : retry_after_ms);
    if (ref_len > LEDGER_PROVIDER_REF_MAX ||
        !utf8_valid((const unsigned char *)ref, ref_len)) {
        /* Never cut, never sent to PostgreSQL invalid: no usable reference
         * (a 2xx without one parks as a bad response, the answer kept). */
        snprintf(why, sizeof why, "the reference field holds %s (%zu bytes; at most %d bytes "
                 "of UTF-8): not recorded", ref_len > LEDGER_PROVIDER_REF_MAX ? "too much"
                 : "invalid UTF-8", ref_len, LEDGER_PROVIDER_REF_MAX);
        vals[6] = "";
        vals[8] = why;
    }
    return run_step(db,
                    "SELECT " STEP_COLUMNS " FROM idemq.provider_result($1, $2::integer, $3, $4, "
                    "$5::integer, $6::jsonb, $7, $8::integer, $9, $10::jsonb, "
                    "coalesce(($11::jsonb)->0->'m', '{\"reconciler\": true}'), $12, "
                    "$13::boolean)",
                    13, vals, NULL, NULL, s, e);
}

idemq_err_t ledger_provider_confirmed(PGconn *db, const char *key, const char *how,
                                      const char *opts, const char *doc, const char *consumer,
                                      const struct ledger_provider_step *confirmed,
                                      struct ledger_provider_step *s, struct ledger_db_error *e)
{
    const char *vals[6] = {key, how, opts, doc, consumer, (const char *)confirmed->body};
    int lens[6] = {0, 0, 0, 0, 0, (int)confirmed->body_len};
    int fmts[6] = {0, 0, 0, 0, 0, 1};
    return run_step(db,
                    "SELECT " STEP_COLUMNS " FROM idemq.provider_confirmed($1, $2, $3::jsonb, "
                    "coalesce(($4::jsonb)->0->'m', '{\"reconciler\": true}'), $5, $6::bytea)",
                    6, vals, lens, fmts, s, e);
}

idemq_err_t ledger_provider_unopened(PGconn *db, const char *key,
                                     const struct ledger_provider_step *confirmed,
                                     const char *opts, const char *doc, const char *consumer,
                                     struct ledger_provider_step *s, struct ledger_db_error *e)
{
    char why[256];
    snprintf(why, sizeof why, "the message is sealed with key '%s' and cannot be opened (%s): "
             "the local effect did not run", confirmed->body_key, confirmed->unopened);
    return ledger_provider_effect_failed(db, key, "transient", idemq_err_name(IDEMQ_ERR_CONFIG),
                                         NULL, why, opts, doc, consumer, s, e);
}

idemq_err_t ledger_provider_effect_failed(PGconn *db, const char *key, const char *cls,
                                          const char *code, const char *sqlstate,
                                          const char *message, const char *opts,
                                          const char *doc, const char *consumer,
                                          struct ledger_provider_step *s,
                                          struct ledger_db_error *e)
{
    const char *vals[8] = {key, cls, code, sqlstate, message, opts, doc, consumer};
    return run_step(db,
                    "SELECT " STEP_COLUMNS " FROM idemq.provider_effect_failed($1, $2, $3, $4, "
                    "$5, $6::jsonb, coalesce(($7::jsonb)->0->'m', '{\"reconciler\": true}'), $8)",
                    8, vals, NULL, NULL, s, e);
}

idemq_err_t ledger_provider_sweep(PGconn *db, const char *opts, int age_s, int max,
                                  const char *consumer, struct ledger_provider_step *out,
                                  int *n, struct ledger_db_error *e)
{
    char age[16], lim[16];
    const char *vals[4] = {opts, age, lim, consumer};
    snprintf(age, sizeof age, "%d", age_s);
    snprintf(lim, sizeof lim, "%d", max);
    return run_steps(db,
                     "SELECT r_key, " STEP_COLUMNS " FROM idemq.provider_sweep($1::jsonb, "
                     "$2::integer, $3::integer, $4)",
                     4, vals, NULL, NULL, true, out, max, n, e);
}

idemq_err_t ledger_provider_resolve(PGconn *db, const char *key, const char *action,
                                    const char *ref, const char *by, const char *reason,
                                    const char *opts, const void *msg, size_t msg_len,
                                    char *prior, size_t priorlen, struct ledger_db_error *e)
{
    const char *vals[7] = {key, action, ref, by, reason, opts, msg};
    int lens[7] = {0, 0, 0, 0, 0, 0, (int)msg_len};
    int fmts[7] = {0, 0, 0, 0, 0, 0, 1};
    PGresult *r = ledger_db_exec_params(db,
                                        "SELECT idemq.provider_resolve($1, $2, $3, $4, $5, "
                                        "$6::jsonb, $7::bytea)",
                                        7, NULL, vals, lens, fmts, 0);
    if (PQresultStatus(r) != PGRES_TUPLES_OK) {
        ledger_db_error_from(db, r, e);
        PQclear(r);
        return ledger_db_err(e);
    }
    snprintf(prior, priorlen, "%s", PQgetvalue(r, 0, 0));
    PQclear(r);
    return IDEMQ_OK;
}
