/*
 * resolve: idemq resolve and the provider lines of jobs show (see resolve.h).
 */
#include "resolve.h"

#include <pwd.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ledger_db.h"
#include "ledger_provider.h"
#include "log.h"
#include "ops.h"
#include "protect.h"

bool resolve_shell_quote(const char *s, char *buf, size_t len)
{
    size_t o = 0;
    if (len < 3)
        return false;
    buf[o++] = '\'';
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c < 0x20 || c > 0x7e)
            return false; /* not for a command line an operator pastes */
        if (c == '\'') {
            if (o + 4 >= len - 1)
                return false;
            memcpy(buf + o, "'\\''", 4); /* close, an escaped quote, reopen */
            o += 4;
        } else {
            if (o + 1 >= len - 1)
                return false;
            buf[o++] = (char)c;
        }
    }
    buf[o++] = '\'';
    buf[o] = '\0';
    return true;
}

void resolve_who(char *buf, size_t len)
{
    char host[128] = "host";
    struct passwd *pw = getpwuid(getuid());
    const char *sudo = getenv("SUDO_USER");
    gethostname(host, sizeof host - 1);
    if (sudo && *sudo)
        snprintf(buf, len, "%s@%s (sudo by %s)", pw ? pw->pw_name : "?", host, sudo);
    else
        snprintf(buf, len, "%s@%s", pw ? pw->pw_name : "?", host);
}

/* The intent's message for the local effect of `resolve --applied`: *msg
 * NULL when it is stored as sent (the ledger reads it), else opened with
 * the key it names (*msg malloc'd: the caller wipes and frees it). Returns
 * 0, or an exit code with the reason on stderr (a copy that does not open
 * is never passed on empty). */
static int resolve_message(PGconn *db, const char *key, unsigned char **msg, size_t *msg_len,
                           struct ops_strs *a)
{
    struct ledger_db_error e;
    const char *params[1] = {key};
    unsigned char *stored;
    size_t stored_len = 0;
    enum protect_open_result o;
    char key_id[64];
    PGresult *r = ledger_db_query(db, "SELECT body, body_key FROM idemq.intents WHERE key = $1",
                                  1, params, &e);
    *msg = NULL;
    *msg_len = 0;
    if (!r) {
        log_error("cannot read the ledger: %s %s", e.sqlstate, e.message);
        return e.conn_lost ? 4 : 1;
    }
    if (PQntuples(r) != 1 || PQgetisnull(r, 0, 1)) { /* stored as sent */
        PQclear(r);
        return 0;
    }
    snprintf(key_id, sizeof key_id, "%s", PQgetvalue(r, 0, 1));
    stored = PQunescapeBytea((const unsigned char *)PQgetvalue(r, 0, 0), &stored_len);
    PQclear(r);
    if (!stored) {
        log_error("out of memory");
        return 1;
    }
    o = protect_open(protect_global(), key_id, stored, stored_len, msg, msg_len);
    PQfreemem(stored);
    if (o == PROTECT_OPENED)
        return 0;
    fprintf(stderr, "idemq: not resolved: the message of %s is sealed with key '%s', which "
                    "cannot be opened (%s): its local effect cannot run. List that key in "
                    "protection.keys and run this again.\n",
            ops_text(a, key), ops_text(a, key_id), protect_open_str(o));
    return 1;
}

int resolve_cmd(const struct conf *c, const char *key, const char *action, const char *ref,
                const char *reason, FILE *out)
{
    unsigned char *msg = NULL;
    size_t msg_len = 0;
    struct ledger_db_error e;
    const char *params[1] = {key};
    char err[512], who[300], prior[32], input[128];
    char *opts = NULL;
    struct ops_strs a = {NULL, 0, 0};
    PGconn *db;
    PGresult *r;
    int idx = -1, rc = 0;

    if (!reason || !*reason || (strcmp(action, "applied") == 0 && (!ref || !*ref))) {
        fprintf(stderr, "idemq: resolve needs --reason TEXT%s\n",
                strcmp(action, "applied") == 0 ? " and a reference (--applied REF)" : "");
        return 2;
    }
    if (!(db = ledger_db_connect(c->dsn, "idemq resolve", c->statement_timeout_ms, err,
                                 sizeof err))) {
        log_error("%s", err);
        return 4;
    }
    r = ledger_db_query(db, "SELECT input FROM idemq.intents WHERE key = $1", 1, params, &e);
    if (!r) {
        log_error("cannot read the ledger: %s %s", e.sqlstate, e.message);
        rc = e.conn_lost ? 4 : 1;
        goto out;
    }
    if (PQntuples(r) == 0) {
        PQclear(r);
        fprintf(stderr, "idemq: key %s has no provider intent: resolve settles parked keys of "
                        "provider inputs\n", ops_text(&a, key));
        rc = 1;
        goto out;
    }
    snprintf(input, sizeof input, "%s", PQgetvalue(r, 0, 0));
    PQclear(r);
    for (int i = 0; i < c->n_inputs; i++)
        if (strcmp(c->inputs[i].name, input) == 0 && CONF_INPUT_PROVIDER(&c->inputs[i]))
            idx = i;
    if (idx < 0) {
        fprintf(stderr, "idemq: key %s belongs to provider input %s, which %s does not "
                        "configure\n", ops_text(&a, key), ops_text(&a, input), c->path);
        rc = 1;
        goto out;
    }
    if (!(opts = ledger_provider_opts(c, idx))) {
        log_error("out of memory");
        rc = 1;
        goto out;
    }
    resolve_who(who, sizeof who);
    if (strcmp(action, "applied") == 0 &&
        (rc = resolve_message(db, key, &msg, &msg_len, &a)) != 0)
        goto out;
    if (ledger_provider_resolve(db, key, action, strcmp(action, "applied") == 0 ? ref : NULL,
                                who, reason, opts, msg, msg_len, prior, sizeof prior,
                                &e) != IDEMQ_OK) {
        fprintf(stderr, "idemq: not resolved: %s%s%s\n", ops_text(&a, e.message),
                e.sqlstate[0] ? " SQLSTATE " : "", e.sqlstate);
        rc = e.conn_lost ? 4 : 1;
        goto out;
    }
    if (strcmp(action, "applied") == 0) {
        fprintf(out, "resolved %s: applied with provider reference %s (intent was %s), by %s: "
                     "%s\n", ops_text(&a, key), ops_text(&a, ref), prior, ops_text(&a, who),
                ops_text(&a, reason));
    } else if (strcmp(action, "not_applied") == 0) {
        char quoted[4 * CONF_KEY_MAX_BYTES + 8]; /* every byte a quote: 4 each */
        fprintf(out, "resolved %s: not applied (intent was %s), by %s: %s\n", ops_text(&a, key),
                prior, ops_text(&a, who), ops_text(&a, reason));
        /* The key is the producer's: quoted for the shell, or no command. */
        if (resolve_shell_quote(key, quoted, sizeof quoted))
            fprintf(out, "A redrive of it (idemq redrive --key %s) now sends it again under the "
                         "same key.\n", quoted);
        else
            fprintf(out, "A redrive of it now sends it again under the same key (its key holds "
                         "bytes no command line here carries safely: select it with --class, "
                         "--input or --since).\n");
    } else {
        fprintf(out, "resolved %s: discarded (intent was %s), by %s: %s\nA redrive of it is "
                     "now a duplicate; nothing will be sent.\n", ops_text(&a, key), prior,
                ops_text(&a, who), ops_text(&a, reason));
    }
out:
    if (msg) {
        explicit_bzero(msg, msg_len);
        free(msg);
    }
    ops_strs_free(&a);
    free(opts);
    PQfinish(db);
    return rc;
}

/* Stored text of (row, col), escaped for the terminal (ops_text). */
#define v(r, row, col) ops_tval(&a, r, row, col)

void resolve_show(PGconn *db, const char *key, FILE *out)
{
    const char *params[1] = {key};
    struct ops_strs a = {NULL, 0, 0};
    PGresult *r = PQexecParams(
        db,
        "SELECT state, provider, input, idempotent, generation, requests, unknowns, waits, "
        "lookups, lease_no, first_request_at, last_request_at, lease_until, run_after, "
        "provider_ref, confirmed_at, idemq.provider_answer_text(last_response), "
        "request_sha256, resolved_by, resolved_at, resolve_reason, uncertain "
        "FROM idemq.intents WHERE key = $1",
        1, NULL, params, NULL, NULL, 0);
    if (PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1) {
        /* uncertain stays set on an intent whose unknown outcome the
         * provider later answered (a lookup or a resend under the key
         * adopted its reference): that answer about the key makes it
         * certain */
        bool uncertain = strcmp(v(r, 0, 21), "t") == 0;
        bool answered = !PQgetisnull(r, 0, 14) &&
                        (strcmp(v(r, 0, 0), "confirmed") == 0 || strcmp(v(r, 0, 0), "applied") == 0);
        char label[160];
        if (uncertain && answered)
            snprintf(label, sizeof label, "certain: confirmed by the provider after %s unknown "
                                          "outcome(s)",
                     v(r, 0, 6));
        else
            snprintf(label, sizeof label, "%s", uncertain ? "outcome uncertain" : "certain");
        fprintf(out, "provider intent: %s (%s), provider %s of input %s, idempotent %s\n",
                v(r, 0, 0), label, v(r, 0, 1), v(r, 0, 2),
                strcmp(v(r, 0, 3), "t") == 0 ? "yes" : "no");
        fprintf(out, "  %s requests, %s unknown outcomes, %s waits (409/429), %s lookups; "
                     "lease %s until %s; next step after %s\n",
                v(r, 0, 5), v(r, 0, 6), v(r, 0, 7), v(r, 0, 8), v(r, 0, 9), v(r, 0, 12),
                v(r, 0, 13));
        fprintf(out, "  first request %s (the key window counts from here), last request %s\n",
                v(r, 0, 10), v(r, 0, 11));
        fprintf(out, "  provider reference %s, confirmed %s; request sha256 %s\n", v(r, 0, 14),
                v(r, 0, 15), v(r, 0, 17));
        fprintf(out, "  last answer: %s\n", v(r, 0, 16));
        if (!PQgetisnull(r, 0, 18))
            fprintf(out, "  resolved by %s at %s: %s\n", v(r, 0, 18), v(r, 0, 19), v(r, 0, 20));
    }
    PQclear(r);
    r = PQexecParams(db,
                     "SELECT resolved_at, action, coalesce(provider_ref, '-'), prior_state, "
                     "resolved_by, reason FROM idemq.resolutions WHERE key = $1 ORDER BY id",
                     1, NULL, params, NULL, NULL, 0);
    if (PQresultStatus(r) == PGRES_TUPLES_OK)
        for (int i = 0; i < PQntuples(r); i++)
            fprintf(out, "  resolution %s: %s (reference %s; was %s) by %s: %s\n", v(r, i, 0),
                    v(r, i, 1), v(r, i, 2), v(r, i, 3), v(r, i, 4), v(r, i, 5));
    PQclear(r);
    ops_strs_free(&a);
}
#undef v
