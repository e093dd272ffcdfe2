/*
 * console_pages: a parked message, a key's timeline and the jobs retrying
 * now (see console_pages.h).
 */
#include "console_pages.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "mask.h"
#include "protect.h"

/* A query; NULL (logged) on failure or without a session. */
static PGresult *query(PGconn *db, const char *sql, int np, const char *const *params)
{
    PGresult *r;
    if (!db)
        return NULL;
    r = PQexecParams(db, sql, np, NULL, params, NULL, NULL, 0);
    if (PQresultStatus(r) != PGRES_TUPLES_OK) {
        log_warn("console: query failed: %s", PQerrorMessage(db));
        PQclear(r);
        return NULL;
    }
    return r;
}

static void unavailable(struct html *b, const char *what)
{
    html_raw(b, "<p class=\"bad\">");
    html_text(b, what);
    html_raw(b, ": the ledger did not answer (see the log)</p>");
}

static const char *input_of(const struct conf *c, const char *queue)
{
    for (int i = 0; i < c->n_inputs; i++)
        if (strcmp(c->inputs[i].queue, queue) == 0)
            return c->inputs[i].name;
    return queue;
}

/* A key as a link to its page (capped), or "(no key)". */
static void key_link(struct html *b, const char *key)
{
    if (!key) {
        html_raw(b, "<span class=\"mut\">(no key)</span>");
        return;
    }
    html_raw(b, "<a href=\"/key?k=");
    html_url(b, key);
    html_raw(b, "\">");
    html_text_capped(b, key, CONSOLE_PAGES_TEXT_SHOWN);
    html_raw(b, "</a>");
}

void console_pages_actions(struct html *b, const char *csrf, const char *field,
                           const char *value)
{
    static const char *const acts[] = {"redrive", "discard", "archive"};
    if (!csrf || !csrf[0])
        return;
    html_raw(b, "<div class=\"actions\">");
    bool hex = strcmp(field, "key") == 0; /* any bytes, unchanged by the escaping */
    for (int a = 0; a < 3; a++) {
        html_printf(b, "<form class=\"inline\" method=\"post\" action=\"/confirm\">"
                       "<input type=\"hidden\" name=\"csrf\" value=\"%s\">"
                       "<input type=\"hidden\" name=\"action\" value=\"%s\">"
                       "<input type=\"hidden\" name=\"%s%s\" value=\"",
                    csrf, acts[a], field, hex ? "hex" : "");
        if (hex)
            for (const unsigned char *p = (const unsigned char *)value; *p; p++)
                html_printf(b, "%02x", *p);
        else
            html_text(b, value);
        html_printf(b, "\"><button class=\"%s\" name=\"go\" value=\"1\">%s</button></form> ",
                    a == 0 ? "" : "sec", acts[a]);
    }
    html_raw(b, "</div>");
}

/* A definition row: th name, td value (html_text), skipped when NULL. */
static void row(struct html *b, const char *name, const char *v)
{
    html_printf(b, "<tr><th>%s</th><td>", name);
    html_text(b, v);
    html_raw(b, "</td></tr>");
}

/* The body raw[0..n) (of size bytes on the wire): pretty JSON when it is
 * JSON, else the text; capped. When its input declares sensitive fields
 * (np > 0), only the masked form (mask.h). */
static void show_plain(struct html *b, const char **paths, int np, const unsigned char *raw,
                       size_t n, long long size)
{
    json_t *j;
    char *pretty = NULL;

    if (np > 0) {
        /* a stored prefix is not a whole document: hidden */
        pretty = (long long)n < size ? strdup("(body hidden: only a prefix is stored, and its "
                                              "input declares sensitive fields)")
                                     : mask_body(paths, np, raw, n, true);
    } else if ((j = json_loadb((const char *)raw, n, JSON_DECODE_ANY, NULL)) != NULL) {
        pretty = json_dumps(j, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
        json_decref(j);
    }
    html_raw(b, "<pre id=\"body\" class=\"body\">");
    if (np > 0)
        html_text_capped(b, pretty ? pretty : "(body hidden)", CONSOLE_PAGES_BODY_SHOWN);
    else if (pretty && strlen(pretty) <= CONSOLE_PAGES_BODY_SHOWN)
        html_text(b, pretty);
    else
        html_text_n(b, (const char *)raw, n);
    html_raw(b, "</pre>");
    if (size > (long long)n)
        html_printf(b, "<p class=\"mut\">the first %zu of %lld bytes</p>", n, size);
    free(pretty);
}

/* The body of a park from queue, as stored (hex: bytea text), sealed with
 * key_id (protect.h) or NULL when stored as sent. A copy that cannot be
 * opened is said so, with the key it names. */
static void show_body(struct html *b, const struct conf *c, const char *queue, const char *hex,
                      long long size, const char *key_id)
{
    size_t n = 0;
    unsigned char *raw = PQunescapeBytea((const unsigned char *)hex, &n), *plain = NULL;
    size_t pn = 0;
    int np = 0;
    const char **paths = conf_sensitive_paths(c, queue, &np);
    enum protect_open_result r = PROTECT_OPENED;

    if (!raw || np < 0)
        html_raw(b, "<p class=\"bad\">out of memory</p>");
    else if (!key_id)
        show_plain(b, paths, np, raw, n, size);
    else if ((r = protect_open(protect_global(), key_id, raw, n, &plain, &pn)) == PROTECT_OPENED)
        show_plain(b, paths, np, plain, pn, size);
    else {
        html_raw(b, "<p class=\"bad\" id=\"body-sealed\">the body is sealed with key ");
        html_text(b, key_id);
        html_raw(b, " and cannot be opened: ");
        html_text(b, protect_open_str(r));
        html_raw(b, "</p>");
    }
    free(plain);
    free(paths);
    PQfreemem(raw);
}

/* The attempts of key (or "" for none), newest last. */
static void attempts_table(PGconn *db, struct html *b, const char *key)
{
    const char *p[1] = {key};
    PGresult *r = query(db,
                        "SELECT attempt, generation, outcome, started_at, finished_at,"
                        " concat_ws(' ', error_class, error_code, 'SQLSTATE ' || sqlstate),"
                        " left(message, 300), consumer_id"
                        " FROM idemq.key_attempts($1) ORDER BY id DESC LIMIT 50",
                        1, p);
    html_raw(b, "<h2>Attempts</h2>");
    if (!r) {
        unavailable(b, "the attempts");
        return;
    }
    if (PQntuples(r) == 0) {
        html_raw(b, "<p class=\"mut\">none recorded for this key</p>");
        PQclear(r);
        return;
    }
    html_raw(b, "<div class=\"wrap\"><table class=\"rows\" id=\"attempts\"><tr><th>#</th>"
                "<th>outcome</th><th>error</th><th class=\"hide-s\">started</th>"
                "<th class=\"hide-s\">consumer</th></tr>");
    for (int i = PQntuples(r) - 1; i >= 0; i--) {
        html_raw(b, "<tr><td>");
        html_text(b, PQgetvalue(r, i, 0));
        html_raw(b, " <span class=\"mut\">g");
        html_text(b, PQgetvalue(r, i, 1));
        html_raw(b, "</span></td><td>");
        html_text(b, PQgetvalue(r, i, 2));
        html_raw(b, "</td><td class=\"txt\">");
        html_text(b, PQgetvalue(r, i, 5));
        html_raw(b, "<br><span class=\"mut\">");
        html_text_capped(b, PQgetvalue(r, i, 6), CONSOLE_PAGES_TEXT_SHOWN);
        html_raw(b, "</span></td><td class=\"hide-s\">");
        html_text(b, PQgetvalue(r, i, 3));
        html_raw(b, "</td><td class=\"hide-s\">");
        html_text(b, PQgetvalue(r, i, 7));
        html_raw(b, "</td></tr>");
    }
    html_raw(b, "</table></div>");
    PQclear(r);
}

unsigned console_pages_park(PGconn *db, const struct conf *c, const char *id, const char *csrf,
                            struct html *b)
{
    const char *p[1] = {id};
    PGresult *r;
    const char *key;
    html_page_start(b, "park", "parked");
    if (!id || strlen(id) > 18 || strspn(id, "0123456789") != strlen(id)) {
        html_raw(b, "<h1>Park</h1><p class=\"bad\">give a park number: /park?id=N</p>");
        html_page_end(b);
        return 400;
    }
    html_raw(b, "<h1>Park <code id=\"park-id\">#");
    html_text(b, id);
    html_raw(b, "</code></h1>");
    r = query(db,
              "SELECT key, source_queue, exchange, routing_key,"
              " CASE WHEN body_key IS NULL THEN substring(body FROM 1 FOR " "65536" ") ELSE body END,"
              " coalesce(body_size, octet_length(body)),"
              " jsonb_pretty(headers), jsonb_pretty(properties), payload_sha256, error_class,"
              " error_code, coalesce(sqlstate, '-'), reason, attempts, first_attempt_at,"
              " last_attempt_at, parked_at, consumer_id, redrivable, generation,"
              " coalesce(dlq_published_at::text, 'not confirmed yet'), body_key"
              " FROM idemq.parked WHERE id = $1::bigint",
              1, p);
    if (!r) {
        unavailable(b, "the park");
        html_page_end(b);
        return 503;
    }
    if (PQntuples(r) == 0) {
        PQclear(r);
        r = query(db,
                  "SELECT key, resolved_at, coalesce(resolved_by, '-'), resolution"
                  " FROM idemq.park_history WHERE id = $1::bigint",
                  1, p);
        if (r && PQntuples(r) == 1) {
            html_raw(b, "<p class=\"note\" id=\"park-closed\">closed at ");
            html_text(b, PQgetvalue(r, 0, 1));
            html_raw(b, " by ");
            html_text(b, PQgetvalue(r, 0, 2));
            html_raw(b, ": ");
            html_text_capped(b, PQgetvalue(r, 0, 3), CONSOLE_PAGES_TEXT_SHOWN);
            html_raw(b, "</p><p>key: ");
            key_link(b, PQgetisnull(r, 0, 0) ? NULL : PQgetvalue(r, 0, 0));
            html_raw(b, "</p>");
            PQclear(r);
            html_page_end(b);
            return 200;
        }
        PQclear(r);
        html_raw(b, "<p class=\"bad\">no such park</p>");
        html_page_end(b);
        return 404;
    }
    key = PQgetisnull(r, 0, 0) ? NULL : PQgetvalue(r, 0, 0);
    html_raw(b, "<div class=\"cards\"><div class=\"card\"><table class=\"kv\" id=\"park\">");
    html_raw(b, "<tr><th>key</th><td class=\"k\">");
    key_link(b, key);
    html_raw(b, "</td></tr>");
    row(b, "input", input_of(c, PQgetvalue(r, 0, 1)));
    html_raw(b, "<tr><th>failure</th><td>");
    html_text(b, PQgetvalue(r, 0, 9));
    html_raw(b, " ");
    html_text(b, PQgetvalue(r, 0, 10));
    html_raw(b, " SQLSTATE ");
    html_text(b, PQgetvalue(r, 0, 11));
    html_raw(b, "</td></tr><tr><th>reason</th><td class=\"txt\" id=\"park-reason\">");
    html_text(b, PQgetvalue(r, 0, 12));
    html_raw(b, "</td></tr>");
    row(b, "attempts", PQgetvalue(r, 0, 13));
    row(b, "generation", PQgetvalue(r, 0, 19));
    row(b, "parked at", PQgetvalue(r, 0, 16));
    row(b, "first / last attempt", PQgetvalue(r, 0, 14));
    row(b, "", PQgetvalue(r, 0, 15));
    row(b, "dead-lettered", PQgetvalue(r, 0, 20));
    row(b, "redrivable", strcmp(PQgetvalue(r, 0, 18), "t") == 0 ? "yes" : "no");
    row(b, "exchange / routing key", PQgetvalue(r, 0, 2));
    row(b, "", PQgetvalue(r, 0, 3));
    row(b, "body SHA-256", PQgetvalue(r, 0, 8));
    row(b, "consumer", PQgetvalue(r, 0, 17));
    html_raw(b, "</table>");
    console_pages_actions(b, csrf, "park", id);
    html_raw(b, "</div></div><h2>Body</h2>");
    show_body(b, c, PQgetvalue(r, 0, 1), PQgetvalue(r, 0, 4), atoll(PQgetvalue(r, 0, 5)),
              PQgetisnull(r, 0, 21) ? NULL : PQgetvalue(r, 0, 21));
    html_raw(b, "<div class=\"cards\"><div class=\"card\"><h2>Headers</h2><pre id=\"headers\">");
    html_text(b, PQgetisnull(r, 0, 6) ? "(none)" : PQgetvalue(r, 0, 6));
    html_raw(b, "</pre></div><div class=\"card\"><h2>Properties</h2><pre id=\"properties\">");
    html_text(b, PQgetisnull(r, 0, 7) ? "(none)" : PQgetvalue(r, 0, 7));
    html_raw(b, "</pre></div></div>");
    if (key)
        attempts_table(db, b, key);
    else
        html_raw(b, "<h2>Attempts</h2><p class=\"mut\">the message had no key: no job, no "
                    "attempt rows</p>");
    PQclear(r);
    html_page_end(b);
    return 200;
}

/* One timeline row. */
static void tl_row(struct html *b, const char *at, const char *kind, const char *cls,
                   const char *what, const char *park_id)
{
    html_raw(b, "<tr><td class=\"hide-s\">");
    html_text(b, at);
    html_printf(b, "</td><td><span class=\"tag %s\">", cls);
    html_text(b, kind);
    html_raw(b, "</span></td><td class=\"txt\">");
    if (park_id) {
        html_raw(b, "<a href=\"/park?id=");
        html_url(b, park_id);
        html_raw(b, "\">#");
        html_text(b, park_id);
        html_raw(b, "</a> ");
    }
    html_text_capped(b, what, 4 * CONSOLE_PAGES_TEXT_SHOWN);
    html_raw(b, "</td></tr>");
}

unsigned console_pages_key(PGconn *db, const struct conf *c, const char *key, const char *csrf,
                           struct html *b)
{
    const char *p[1] = {key};
    PGresult *r;
    int open_parks = 0;
    (void)c;
    html_page_start(b, key ? key : "key", "");
    html_raw(b, "<h1>Key <code id=\"key\">");
    html_text(b, key ? key : "");
    html_raw(b, "</code></h1>");
    if (!key) {
        html_raw(b, "<p>Give a key (the box at the top).</p>");
        html_page_end(b);
        return 400;
    }
    r = query(db,
              "SELECT state, attempts, generation, coalesce(last_error, ''), source_queue,"
              " (SELECT count(*) FROM idemq.parked k WHERE k.key = $1)"
              " FROM idemq.job_info($1)",
              1, p);
    if (!r) {
        unavailable(b, "the key");
        html_page_end(b);
        return 503;
    }
    if (PQntuples(r) == 0) {
        PQclear(r);
        r = query(db, "SELECT count(*) FROM idemq.parked WHERE key = $1", 1, p);
        open_parks = r ? atoi(PQgetvalue(r, 0, 0)) : 0;
        html_raw(b, "<p id=\"key-state\">no job row: the ledger claimed no attempt of this "
                    "key</p>");
    } else {
        open_parks = atoi(PQgetvalue(r, 0, 5));
        html_raw(b, "<p id=\"key-state\">state <b>");
        html_text(b, PQgetvalue(r, 0, 0));
        html_raw(b, "</b>, ");
        html_text(b, PQgetvalue(r, 0, 1));
        html_raw(b, " attempts, generation ");
        html_text(b, PQgetvalue(r, 0, 2));
        if (*PQgetvalue(r, 0, 3)) {
            html_raw(b, "; last error: <span class=\"txt\">");
            html_text_capped(b, PQgetvalue(r, 0, 3), CONSOLE_PAGES_TEXT_SHOWN);
            html_raw(b, "</span>");
        }
        html_raw(b, "</p>");
    }
    PQclear(r);
    if (open_parks > 0) {
        html_printf(b, "<p>%d open park%s: <a href=\"/parked?key=", open_parks,
                    open_parks == 1 ? "" : "s");
        html_url(b, key);
        html_raw(b, "\">list</a></p>");
        console_pages_actions(b, csrf, "key", key);
    }
    html_raw(b, "<h2>Timeline</h2><div class=\"wrap\"><table class=\"rows\" id=\"timeline\">"
                "<tr><th class=\"hide-s\">at</th><th>what</th><th></th></tr>");
    r = query(db,
              "SELECT at, kind, coalesce(outcome, ''), id, what, ord FROM idemq.key_history($1)"
              " UNION ALL SELECT k.at, 'operator', k.outcome, a.id,"
              " format('operator action #%s: %s, park #%s %s, by %s: %s', a.id, a.action,"
              " k.park_id, k.outcome, a.actor, coalesce(a.reason, '-')), 5"
              " FROM idemq.operator_action_keys k JOIN idemq.operator_actions a"
              " ON a.id = k.action_id WHERE k.key = $1"
              " ORDER BY 1, 6, 4 LIMIT 500",
              1, p);
    if (!r) {
        html_raw(b, "</table></div>");
        unavailable(b, "the story");
        html_page_end(b);
        return 503;
    }
    for (int i = 0; i < PQntuples(r); i++) {
        const char *kind = PQgetvalue(r, i, 1), *out = PQgetvalue(r, i, 2);
        const char *cls = !strcmp(out, "applied") ? "ok"
                          : !strcmp(kind, "park") || strstr(out, "error") ? "bad"
                                                                           : "";
        tl_row(b, PQgetvalue(r, i, 0), *out ? out : kind, cls, PQgetvalue(r, i, 4),
               !strcmp(kind, "park") && !strcmp(out, "parked") ? PQgetvalue(r, i, 3) : NULL);
    }
    if (PQntuples(r) == 0)
        html_raw(b, "<tr><td colspan=\"3\" class=\"mut\">the ledger knows nothing of this key"
                    "</td></tr>");
    PQclear(r);
    html_raw(b, "</table></div>");
    r = query(db, "SELECT provider, state, generation, requests, coalesce(provider_ref, '-'),"
                  " coalesce(last_status::text, '-'), coalesce(last_class, '-')"
                  " FROM idemq.intents WHERE key = $1",
              1, p);
    if (r && PQntuples(r) == 1) {
        html_raw(b, "<h2>Provider intent</h2><table class=\"kv\" id=\"intent\">");
        row(b, "provider", PQgetvalue(r, 0, 0));
        row(b, "state", PQgetvalue(r, 0, 1));
        row(b, "generation", PQgetvalue(r, 0, 2));
        row(b, "requests", PQgetvalue(r, 0, 3));
        row(b, "reference", PQgetvalue(r, 0, 4));
        row(b, "last status / class", PQgetvalue(r, 0, 5));
        row(b, "", PQgetvalue(r, 0, 6));
        html_raw(b, "</table>");
    }
    PQclear(r);
    /* a PostgreSQL queue row under a visible lease (a provider call) */
    r = query(db, "SELECT r_queue, r_id, r_leased_by, r_lease_until,"
                  " CASE WHEN r_expired THEN 'expired: taken again by the next take'"
                  " ELSE 'held: its provider call may be in flight' END"
                  " FROM idemq.queue_lease_of($1)",
              1, p);
    for (int i = 0; r && i < PQntuples(r); i++) {
        html_raw(b, "<h2>Queue lease</h2><table class=\"kv\" id=\"lease\">");
        row(b, "queue", PQgetvalue(r, i, 0));
        row(b, "row", PQgetvalue(r, i, 1));
        row(b, "holder", PQgetvalue(r, i, 2));
        row(b, "until", PQgetvalue(r, i, 3));
        row(b, "", PQgetvalue(r, i, 4));
        html_raw(b, "</table>");
    }
    PQclear(r);
    r = query(db, "SELECT id, state, exchange, routing_key, attempts, at, coalesce(last_error, '')"
                  " FROM idemq.key_outbox($1) ORDER BY id LIMIT 100",
              1, p);
    if (r && PQntuples(r) > 0) {
        html_raw(b, "<h2>Outbox rows</h2><div class=\"wrap\"><table class=\"rows\" id=\"outbox\">"
                    "<tr><th>#</th><th>state</th><th>to</th><th>attempts</th><th>error</th></tr>");
        for (int i = 0; i < PQntuples(r); i++) {
            html_raw(b, "<tr><td>");
            html_text(b, PQgetvalue(r, i, 0));
            html_raw(b, "</td><td>");
            html_text(b, PQgetvalue(r, i, 1));
            html_raw(b, "</td><td class=\"k\">");
            html_text(b, PQgetvalue(r, i, 2));
            html_raw(b, " / ");
            html_text_capped(b, PQgetvalue(r, i, 3), CONSOLE_PAGES_TEXT_SHOWN);
            html_raw(b, "</td><td>");
            html_text(b, PQgetvalue(r, i, 4));
            html_raw(b, "</td><td class=\"txt\">");
            html_text_capped(b, PQgetvalue(r, i, 6), CONSOLE_PAGES_TEXT_SHOWN);
            html_raw(b, "</td></tr>");
        }
        html_raw(b, "</table></div>");
    }
    PQclear(r);
    html_raw(b, "<p class=\"mut\">The text form: <code>idemq jobs show KEY</code>.</p>");
    html_page_end(b);
    return 200;
}

unsigned console_pages_retrying(PGconn *db, const struct conf *c, struct html *b)
{
    PGresult *r;
    html_page_start(b, "retrying", "retrying");
    html_raw(b, "<h1>Retrying now</h1><p class=\"mut\">Keys whose last attempt, within the "
                "hour, failed transiently and that wait for their retry (newest first, 100 at "
                "most).</p>");
    r = query(db,
              "SELECT j.key, j.source_queue, j.attempts, a.finished_at,"
              " concat_ws(' ', a.error_class, a.error_code, 'SQLSTATE ' || a.sqlstate),"
              " left(a.message, 300), a.delay_ms"
              " FROM (SELECT DISTINCT ON (x.key) x.* FROM idemq.attempts x"
              "  WHERE x.started_at > now() - interval '1 hour'"
              "  ORDER BY x.key, x.id DESC) a"
              " JOIN idemq.jobs j ON j.key = a.key"
              " WHERE a.outcome = 'transient_error' AND j.state = 'retrying'"
              " ORDER BY a.finished_at DESC LIMIT 100",
              0, NULL);
    if (!r) {
        unavailable(b, "the retrying jobs");
        html_page_end(b);
        return 503;
    }
    html_printf(b, "<p id=\"retrying-total\">%d retrying</p>", PQntuples(r));
    html_raw(b, "<div class=\"wrap\"><table class=\"rows\" id=\"retrying\"><tr><th>key</th>"
                "<th class=\"hide-s\">input</th><th>attempts</th><th>last error</th>"
                "<th class=\"hide-s\">at</th></tr>");
    for (int i = 0; i < PQntuples(r); i++) {
        html_raw(b, "<tr><td class=\"k keys\">");
        key_link(b, PQgetvalue(r, i, 0));
        html_raw(b, "</td><td class=\"hide-s\">");
        html_text(b, input_of(c, PQgetvalue(r, i, 1)));
        html_raw(b, "</td><td>");
        html_text(b, PQgetvalue(r, i, 2));
        html_raw(b, "</td><td class=\"txt\">");
        html_text(b, PQgetvalue(r, i, 4));
        html_raw(b, "<br><span class=\"mut\">");
        html_text_capped(b, PQgetvalue(r, i, 5), CONSOLE_PAGES_TEXT_SHOWN);
        html_raw(b, "</span></td><td class=\"hide-s\">");
        html_text(b, PQgetvalue(r, i, 3));
        html_printf(b, "<br><span class=\"mut\">retry after %s ms</span></td></tr>",
                    PQgetvalue(r, i, 6));
    }
    html_raw(b, "</table></div>");
    PQclear(r);
    html_page_end(b);
    return 200;
}
