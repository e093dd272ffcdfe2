/*
 * console: the web console of `idemq run` (see console.h).
 */
#include "console.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <math.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <libpq-fe.h>

#include "broker.h"
#include "broker_admin.h"
#include "groups.h"
#include "html.h"
#include "liveness.h"
#include "log.h"
#include "observe.h"
#include "ops.h"
#include "topology.h"

#define CONN_TIMEOUT_S 10   /* an idle connection is closed after this */
#define CONN_MAX 32         /* connections at a time */
#define CONN_PER_IP 16      /* of them from one address */
#define BODY_MAX 8192       /* the largest form body read */
#define FIELD_MAX 1024      /* the longest form field kept */
#define PAGE_ROWS 50        /* parked rows per page */
#define CSRF_SLOTS 128      /* form tokens outstanding at once (oldest reused) */
#define CSRF_TTL_MS (30 * 60 * 1000)
#define REASON_SHOWN 400    /* bytes of a reason shown in a table */

struct csrf {
    char v[33];       /* 32 hex digits, "" = free */
    long long exp_ms; /* CLOCK_MONOTONIC */
};

struct console {
    struct MHD_Daemon *d;
    const struct conf *c;
    struct conf cc; /* c with the console's statement timeout, for ops and groups */
    struct worker *ws;
    int n;
    struct gauges *g;
    PGconn *db; /* the server thread's own session; NULL until first used */
    char token[256];
    bool has_token;
    struct csrf csrf[CSRF_SLOTS];
    int csrf_next;
};

/* One request: its form body, read in pieces. */
struct req {
    char body[BODY_MAX];
    size_t len;
    bool too_big;
};

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* a and b equal, in time that depends on their lengths only. */
static bool same_secret(const char *a, const char *b)
{
    size_t la = strlen(a), lb = strlen(b);
    unsigned char d = la != lb;
    for (size_t i = 0; i < la && i < lb; i++)
        d |= (unsigned char)(a[i] ^ b[i]);
    return d == 0 && la > 0;
}

/* A fresh one-time form token into out[33]; "" if no randomness. */
static void csrf_issue(struct console *k, char *out)
{
    unsigned char r[16];
    struct csrf *s = &k->csrf[k->csrf_next];
    out[0] = '\0';
    if (getrandom(r, sizeof r, 0) != (ssize_t)sizeof r)
        return;
    for (int i = 0; i < 16; i++)
        snprintf(out + 2 * i, 3, "%02x", r[i]);
    snprintf(s->v, sizeof s->v, "%s", out);
    s->exp_ms = now_ms() + CSRF_TTL_MS;
    k->csrf_next = (k->csrf_next + 1) % CSRF_SLOTS;
}

/* True if t is an outstanding form token; it is used up. */
static bool csrf_take(struct console *k, const char *t)
{
    long long now = now_ms();
    if (strlen(t) != 32)
        return false;
    for (int i = 0; i < CSRF_SLOTS; i++) {
        struct csrf *s = &k->csrf[i];
        if (s->v[0] && same_secret(s->v, t)) {
            bool ok = s->exp_ms > now;
            s->v[0] = '\0';
            return ok;
        }
    }
    return false;
}

/* The console's session, (re)connected when needed; NULL if unreachable. */
static PGconn *db_of(struct console *k)
{
    if (k->db && PQstatus(k->db) == CONNECTION_OK)
        return k->db;
    if (k->db)
        PQfinish(k->db);
    k->db = ops_connect(k->c, "idemq console", k->c->console_statement_timeout_ms);
    return k->db;
}

/* A query on the console's session; NULL (logged, shown as unavailable) on
 * failure. */
static PGresult *query(struct console *k, const char *sql, int np, const char *const *params)
{
    PGconn *db = db_of(k);
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

static const char *input_of(const struct conf *c, const char *queue)
{
    for (int i = 0; i < c->n_inputs; i++)
        if (strcmp(c->inputs[i].queue, queue) == 0)
            return c->inputs[i].name;
    return queue;
}

static const char *queue_of(const struct conf *c, const char *input)
{
    for (int i = 0; i < c->n_inputs; i++)
        if (strcmp(c->inputs[i].name, input) == 0)
            return c->inputs[i].queue;
    return NULL;
}

/* A GET argument, NULL when absent or empty. */
static const char *arg(struct MHD_Connection *conn, const char *name)
{
    const char *v = MHD_lookup_connection_value(conn, MHD_GET_ARGUMENT_KIND, name);
    return v && *v ? v : NULL;
}

static bool is_group_id(const char *g)
{
    return g && strlen(g) == 12 && strspn(g, "0123456789abcdef") == 12;
}

static void unavailable(struct html *b, const char *what)
{
    html_raw(b, "<p class=\"bad\">");
    html_text(b, what);
    html_raw(b, ": the ledger did not answer (see the log)</p>");
}

/* ---- overview ---- */

/* Applied keys per minute and the p95 commit time (ms) of the transactions
 * that applied them, over the last hour: batches of the plain path and
 * applies of the isolating path (idemq.attempts), oldest minute first. */
static const char *const PLOT_SQL =
    "WITH m AS (SELECT generate_series(0, 59) AS i),"
    " a AS (SELECT floor(extract(epoch FROM now() - at) / 60)::int AS i,"
    "   (SELECT count(*) FROM unnest(applied) x WHERE x) AS n,"
    "   extract(epoch FROM finished_at - at) * 1000 AS ms"
    "   FROM idemq.batches WHERE at > now() - interval '1 hour'"
    "  UNION ALL"
    "  SELECT floor(extract(epoch FROM now() - finished_at) / 60)::int, 1,"
    "   extract(epoch FROM finished_at - started_at) * 1000"
    "   FROM idemq.attempts WHERE started_at > now() - interval '65 minutes'"
    "   AND finished_at > now() - interval '1 hour' AND outcome = 'applied')"
    " SELECT m.i, coalesce(sum(a.n), 0), percentile_cont(0.95) WITHIN GROUP (ORDER BY a.ms)"
    " FROM m LEFT JOIN a ON a.i = m.i GROUP BY m.i ORDER BY m.i DESC";

static void overview_plots(struct console *k, struct html *b)
{
    double tp[60], lat[60];
    double total = 0;
    PGresult *r = query(k, PLOT_SQL, 0, NULL);
    html_raw(b, "<h2>Last hour</h2>");
    if (!r || PQntuples(r) != 60) {
        PQclear(r);
        unavailable(b, "throughput");
        return;
    }
    for (int i = 0; i < 60; i++) {
        tp[i] = atof(PQgetvalue(r, i, 1));
        lat[i] = PQgetisnull(r, i, 2) ? NAN : atof(PQgetvalue(r, i, 2));
        total += tp[i];
    }
    PQclear(r);
    html_raw(b, "<div class=\"cards\"><div class=\"card\" id=\"plot-throughput\">");
    html_plot(b, "applied", tp, 60, "per minute", "60 min ago");
    html_printf(b, "<p class=\"mut\">%.0f applied in the last hour</p></div>"
                   "<div class=\"card\" id=\"plot-latency\">", total);
    html_plot(b, "commit time p95", lat, 60, "ms", "60 min ago");
    html_raw(b, "<p class=\"mut\">of the transactions that applied them (a gap: none that minute)</p>"
                "</div></div>");
}

static void overview_depth(struct console *k, struct html *b)
{
    struct broker *br = NULL;
    char err[256];
    PGresult *r;
    html_raw(b, "<h2>Queues</h2><div class=\"wrap\"><table><tr><th>input</th><th>queue</th>"
                "<th>ready</th><th>consumers</th><th>dead-lettered</th></tr>");
    if (broker_open(k->c, "idemq console", false, &br, err, sizeof err))
        log_warn("console: %s", err);
    for (int i = 0; i < k->c->n_inputs; i++) {
        const struct conf_input *in = &k->c->inputs[i];
        char dlq[300];
        uint32_t m = 0, cons = 0, dm = 0, dc = 0;
        bool ok = br && broker_admin_queue_counts(br, in->queue, &m, &cons) == IDEMQ_OK;
        bool dok;
        topology_dlq(in, dlq, sizeof dlq);
        dok = br && broker_admin_queue_counts(br, dlq, &dm, &dc) == IDEMQ_OK;
        html_raw(b, "<tr><td>");
        html_text(b, in->name);
        html_raw(b, "</td><td class=\"k\">");
        html_text(b, in->queue);
        if (ok)
            html_printf(b, "</td><td>%u</td><td>%u</td>", m, cons);
        else
            html_raw(b, "</td><td class=\"mut\">?</td><td class=\"mut\">?</td>");
        if (dok)
            html_printf(b, "<td>%u</td></tr>", dm);
        else
            html_raw(b, "<td class=\"mut\">?</td></tr>");
    }
    html_raw(b, "</table></div>");
    if (!br)
        html_raw(b, "<p class=\"bad\">the broker did not answer (see the log)</p>");
    broker_close(br);
    r = query(k, "SELECT (SELECT count(*) FROM idemq.outbox WHERE state = 'pending'),"
                 " (SELECT count(*) FROM idemq.outbox WHERE state = 'parked'),"
                 " (SELECT count(*) FROM idemq.deferred)",
              0, NULL);
    if (r) {
        html_printf(b, "<p>outbox: <b id=\"outbox-pending\">%s</b> pending, %s parked; "
                       "deferred jobs (ordered lanes): %s</p>",
                    PQgetvalue(r, 0, 0), PQgetvalue(r, 0, 1), PQgetvalue(r, 0, 2));
        PQclear(r);
    } else {
        unavailable(b, "outbox depth");
    }
}

static void overview_probes(struct console *k, struct html *b)
{
    char why[600];
    bool live = liveness_ok(k->ws, k->n, (long long)k->c->live_stall_s * 1000, why, sizeof why);
    int ready = 0;
    html_raw(b, "<h2>Probes</h2><div class=\"wrap\"><table><tr><th>probe</th><th>state</th>"
                "<th>detail</th></tr>");
    for (int i = 0; i < k->n; i++)
        ready += atomic_load(&k->ws[i].ready) ? 1 : 0;
    html_printf(b, "<tr><td>ready</td><td class=\"%s\" id=\"probe-ready\">%s</td>"
                   "<td>%d of %d workers consuming</td></tr>",
                ready == k->n ? "ok" : "bad", ready == k->n ? "ready" : "not ready", ready,
                k->n);
    for (int i = 0; i < k->n; i++) {
        char st[512];
        if (atomic_load(&k->ws[i].ready))
            continue;
        pthread_mutex_lock(&k->ws[i].lock);
        snprintf(st, sizeof st, "%s", k->ws[i].status);
        pthread_mutex_unlock(&k->ws[i].lock);
        html_printf(b, "<tr><td>worker %d</td><td class=\"bad\">not ready</td><td>", i);
        html_text(b, st);
        html_raw(b, "</td></tr>");
    }
    html_printf(b, "<tr><td>live</td><td class=\"%s\" id=\"probe-live\">%s</td><td>",
                live ? "ok" : "bad", live ? "live" : "not live");
    html_text(b, live ? "every worker made progress within metrics.live_stall_s" : why);
    html_raw(b, "</td></tr>");
    if (k->c->outbox_relay) {
        bool stuck = gauges_outbox_stuck(k->g, why, sizeof why);
        html_printf(b, "<tr><td>outbox relay</td><td class=\"%s\">%s</td><td>",
                    stuck ? "bad" : "ok", stuck ? "stuck" : "draining");
        html_text(b, stuck ? why : (k->g ? "" : "(no gauges: metrics.listen is off)"));
        html_raw(b, "</td></tr>");
    }
    html_raw(b, "</table></div>");
}

/* The group table; with_actions adds the action forms. */
static void group_table(struct console *k, struct html *b, PGresult *r, bool with_actions)
{
    char t[33] = "";
    if (with_actions)
        csrf_issue(k, t); /* one for the page: the form sent uses it up */
    html_raw(b, "<div class=\"wrap\"><table class=\"rows\" id=\"groups\"><tr><th>group</th><th>parks</th>"
                "<th class=\"hide-s\">input</th><th>failure</th><th class=\"hide-s\">first / "
                "last park</th><th>keys</th><th>redrivable</th>");
    html_raw(b, with_actions ? "<th>actions</th></tr>" : "</tr>");
    for (int i = 0; i < PQntuples(r); i++) {
        long n = atol(PQgetvalue(r, i, 1)), red = atol(PQgetvalue(r, i, 7));
        const char *g = PQgetvalue(r, i, 0);
        html_raw(b, "<tr><td class=\"k\"><a href=\"/parked?group=");
        html_url(b, g);
        html_raw(b, "\">");
        html_text(b, g);
        html_printf(b, "</a></td><td>%ld</td><td class=\"hide-s\">", n);
        html_text(b, input_of(k->c, PQgetvalue(r, i, 8)));
        html_raw(b, "</td><td>");
        html_text(b, PQgetvalue(r, i, 9));
        html_raw(b, " ");
        html_text(b, PQgetvalue(r, i, 10));
        html_raw(b, " SQLSTATE ");
        html_text(b, PQgetvalue(r, i, 11));
        html_raw(b, "<br><span class=\"mut\">");
        html_text(b, PQgetvalue(r, i, 12));
        html_raw(b, "</span></td><td class=\"hide-s\">");
        html_text(b, PQgetvalue(r, i, 2));
        html_raw(b, "<br>");
        html_text(b, PQgetvalue(r, i, 3));
        html_raw(b, "</td><td class=\"k\">");
        for (int c = 4; c <= 6; c++) {
            if (PQgetisnull(r, i, c))
                continue;
            html_raw(b, c > 4 ? "<br><a href=\"/key?k=" : "<a href=\"/key?k=");
            html_url(b, PQgetvalue(r, i, c));
            html_raw(b, "\">");
            html_text(b, PQgetvalue(r, i, c));
            html_raw(b, "</a>");
        }
        if (atol(PQgetvalue(r, i, 13)) > 3)
            html_printf(b, "<br><span class=\"mut\">%s keys in all</span>", PQgetvalue(r, i, 13));
        html_printf(b, "</td><td>%s</td>",
                    red == n ? "yes" : red == 0 ? "no" : "some");
        if (with_actions) {
            static const char *const acts[] = {"redrive", "discard", "archive"};
            html_raw(b, "<td>");
            for (int a = 0; a < 3; a++) {
                html_printf(b, "<form class=\"inline\" method=\"post\" action=\"/confirm\">"
                               "<input type=\"hidden\" name=\"csrf\" value=\"%s\">"
                               "<input type=\"hidden\" name=\"action\" value=\"%s\">"
                               "<input type=\"hidden\" name=\"group\" value=\"",
                            t, acts[a]);
                html_text(b, g);
                html_printf(b, "\"><button class=\"%s\" name=\"go\" value=\"1\">%s</button>"
                               "</form> ",
                            a == 0 ? "" : "sec", acts[a]);
            }
            html_raw(b, "</td>");
        }
        html_raw(b, "</tr>");
    }
    html_raw(b, "</table></div>");
}

static void page_overview(struct console *k, struct html *b)
{
    PGresult *r = NULL;
    html_page_start(b, "overview", "overview");
    html_raw(b, "<h1>Overview</h1>");
    overview_probes(k, b);
    overview_plots(k, b);
    overview_depth(k, b);
    html_raw(b, "<h2>Parked, by failure group</h2>");
    if (!db_of(k) ||
        PQresultStatus(r = groups_select(k->db, NULL, NULL, NULL, NULL, 10)) != PGRES_TUPLES_OK) {
        if (k->db)
            PQclear(r);
        unavailable(b, "failure groups");
    } else {
        if (PQntuples(r) == 0)
            html_raw(b, "<p class=\"ok\">nothing is parked</p>");
        else
            group_table(k, b, r, false);
        html_raw(b, "<p><a href=\"/groups\">all groups and their actions</a> · "
                    "<a href=\"/parked\">the parked list</a></p>");
        PQclear(r);
    }
    html_page_end(b);
}

/* ---- groups and parked ---- */

/* Outbox rows parked (idemq.outbox), grouped by exchange and masked
 * reason: read only (a row is released by the SQL of consumer/README.md
 * "Outbox"). Producer-controlled text goes through html_text. */
static void outbox_groups(struct console *k, struct html *b)
{
    PGresult *r = query(k,
                        "SELECT exchange, count(*), min(parked_at), max(parked_at),"
                        " idemq.mask_reason(last_error, key) FROM idemq.outbox"
                        " WHERE state = 'parked' GROUP BY 1, 5 ORDER BY 2 DESC, 1, 5 LIMIT 200",
                        0, NULL);
    if (!r) {
        unavailable(b, "outbox rows parked");
        return;
    }
    if (PQntuples(r) > 0) {
        html_raw(b, "<h2>Outbox rows parked</h2><p class=\"mut\">Rows idemq.emit wrote that the "
                    "broker refused, or that cannot be encoded, by exchange and reason "
                    "(<code>idemq parked list</code> shows each row).</p><div class=\"wrap\">"
                    "<table class=\"rows\" id=\"outbox-groups\"><tr><th>exchange</th>"
                    "<th>rows</th><th>first park</th><th>last park</th><th>reason</th></tr>");
        for (int i = 0; i < PQntuples(r); i++) {
            html_raw(b, "<tr><td class=\"k\">");
            html_text(b, PQgetvalue(r, i, 0));
            html_printf(b, "</td><td>%s</td><td>", PQgetvalue(r, i, 1));
            html_text(b, PQgetvalue(r, i, 2));
            html_raw(b, "</td><td>");
            html_text(b, PQgetvalue(r, i, 3));
            html_raw(b, "</td><td>");
            html_text(b, PQgetvalue(r, i, 4));
            html_raw(b, "</td></tr>");
        }
        html_raw(b, "</table></div>");
    }
    PQclear(r);
}

static void page_groups(struct console *k, struct MHD_Connection *conn, struct html *b)
{
    const char *in = arg(conn, "input"), *cls = arg(conn, "class"), *q = NULL;
    PGresult *r = NULL;
    html_page_start(b, "failure groups", "groups");
    html_raw(b, "<h1>Failure groups</h1><p class=\"mut\">Open parks grouped by input, error "
                "class, code, SQLSTATE and the reason with keys, numbers and ids masked "
                "(<code>idemq parked groups</code>). An action asks for confirmation after a dry "
                "run.</p>");
    if (!k->has_token)
        html_raw(b, "<p class=\"note\">Read only: console.token_file is not set, so no action "
                    "can be confirmed.</p>");
    if (in && !(q = queue_of(k->c, in))) {
        html_raw(b, "<p class=\"bad\">no input named ");
        html_text(b, in);
        html_raw(b, "</p>");
        html_page_end(b);
        return;
    }
    if (!db_of(k) ||
        PQresultStatus(r = groups_select(k->db, NULL, cls, NULL, q, 200)) != PGRES_TUPLES_OK) {
        if (k->db)
            PQclear(r);
        unavailable(b, "failure groups");
    } else {
        html_printf(b, "<p>%d group%s</p>", PQntuples(r), PQntuples(r) == 1 ? "" : "s");
        if (PQntuples(r) > 0)
            group_table(k, b, r, true);
        PQclear(r);
    }
    if (!in)
        outbox_groups(k, b);
    html_page_end(b);
}

static void filter_field(struct html *b, const char *name, const char *label, const char *v,
                         const char *hint)
{
    html_printf(b, "<label>%s<input name=\"%s\" placeholder=\"%s\" value=\"", label, name, hint);
    if (v)
        html_text(b, v);
    html_raw(b, "\"></label>");
}

static void page_parked(struct console *k, struct MHD_Connection *conn, struct html *b)
{
    const char *in = arg(conn, "input"), *key = arg(conn, "key"), *cls = arg(conn, "class"),
               *since = arg(conn, "since"), *group = arg(conn, "group"), *pg = arg(conn, "page");
    const char *q = NULL, *params[7];
    long page = pg ? atol(pg) : 0;
    char off[24], lim[24];
    PGresult *r, *cnt;
    long total;
    if (page < 0 || page > 1000000)
        page = 0;
    html_page_start(b, "parked", "parked");
    html_raw(b, "<h1>Parked messages</h1><form class=\"filters\" method=\"get\" "
                "action=\"/parked\">");
    filter_field(b, "input", "input", in, "any");
    filter_field(b, "class", "class", cls, "permanent, ...");
    filter_field(b, "key", "key", key, "exact key");
    filter_field(b, "since", "since", since, "2026-01-31 12:00");
    filter_field(b, "group", "group", group, "12 hex digits");
    html_raw(b, "<button>filter</button> <a href=\"/parked\">clear</a></form>");
    if ((in && !(q = queue_of(k->c, in))) || (group && !is_group_id(group))) {
        html_raw(b, "<p class=\"bad\">no such input, or a group id that is not 12 hex "
                    "digits</p>");
        html_page_end(b);
        return;
    }
    snprintf(off, sizeof off, "%ld", page * PAGE_ROWS);
    snprintf(lim, sizeof lim, "%d", PAGE_ROWS + 1);
    params[0] = key, params[1] = cls, params[2] = since, params[3] = q, params[4] = group;
    params[5] = lim, params[6] = off;
    cnt = query(k, "SELECT count(*)" GROUPS_FROM, 5, params);
    r = query(k,
              "SELECT id, parked_at, key, source_queue, error_class, error_code,"
              " coalesce(sqlstate, '-'), left(reason, " "400" "), attempts, g, redrivable"
              GROUPS_FROM " ORDER BY id DESC LIMIT $6::bigint OFFSET $7::bigint",
              7, params);
    if (!r || !cnt) {
        PQclear(r);
        PQclear(cnt);
        unavailable(b, "the parked list (a bad 'since'?)");
        html_page_end(b);
        return;
    }
    total = atol(PQgetvalue(cnt, 0, 0));
    PQclear(cnt);
    html_printf(b, "<p id=\"parked-total\">%ld open park%s match</p>", total,
                total == 1 ? "" : "s");
    html_raw(b, "<div class=\"wrap\"><table class=\"rows\" id=\"parked\"><tr><th>#</th><th class=\"hide-s\">"
                "parked at</th><th>key</th><th class=\"hide-s\">input</th><th>failure</th>"
                "<th class=\"hide-s\">attempts</th><th class=\"hide-s\">group</th></tr>");
    for (int i = 0; i < PQntuples(r) && i < PAGE_ROWS; i++) {
        html_raw(b, "<tr><td>");
        html_text(b, PQgetvalue(r, i, 0));
        html_raw(b, "</td><td class=\"hide-s\">");
        html_text(b, PQgetvalue(r, i, 1));
        html_raw(b, "</td><td class=\"k\">");
        if (PQgetisnull(r, i, 2)) {
            html_raw(b, "<span class=\"mut\">(no key)</span>");
        } else {
            html_raw(b, "<a href=\"/key?k=");
            html_url(b, PQgetvalue(r, i, 2));
            html_raw(b, "\">");
            html_text(b, PQgetvalue(r, i, 2));
            html_raw(b, "</a>");
        }
        html_raw(b, "</td><td class=\"hide-s\">");
        html_text(b, input_of(k->c, PQgetvalue(r, i, 3)));
        html_raw(b, "</td><td>");
        html_text(b, PQgetvalue(r, i, 4));
        html_raw(b, " ");
        html_text(b, PQgetvalue(r, i, 5));
        html_raw(b, " ");
        html_text(b, PQgetvalue(r, i, 6));
        html_raw(b, "<br><span class=\"mut\">");
        html_text(b, PQgetvalue(r, i, 7));
        html_raw(b, "</span></td><td class=\"hide-s\">");
        html_text(b, PQgetvalue(r, i, 8));
        html_raw(b, "</td><td class=\"k hide-s\"><a href=\"/parked?group=");
        html_url(b, PQgetvalue(r, i, 9));
        html_raw(b, "\">");
        html_text(b, PQgetvalue(r, i, 9));
        html_raw(b, "</a></td></tr>");
    }
    html_raw(b, "</table></div><div class=\"pager\">");
    for (int dir = -1; dir <= 1; dir += 2) {
        long to = page + dir;
        if (to < 0 || (dir > 0 && PQntuples(r) <= PAGE_ROWS))
            continue;
        html_printf(b, "<a rel=\"%s\" href=\"/parked?page=%ld", dir < 0 ? "prev" : "next", to);
        {
            const char *names[] = {"input", "class", "key", "since", "group"};
            const char *vals[] = {in, cls, key, since, group};
            for (int f = 0; f < 5; f++) {
                if (!vals[f])
                    continue;
                html_printf(b, "&amp;%s=", names[f]);
                html_url(b, vals[f]);
            }
        }
        html_printf(b, "\">%s</a>", dir < 0 ? "&larr; newer" : "older &rarr;");
    }
    html_printf(b, "<span class=\"mut\">page %ld</span></div>", page + 1);
    PQclear(r);
    html_page_end(b);
}

/* ---- a key's story ---- */

/* Runs fn's output into a string (malloc'd, caller frees; NULL if no
 * memory); *rc = its return code. */
static char *capture_show(struct console *k, const char *key, int *rc, size_t *len)
{
    char *text = NULL;
    FILE *f = open_memstream(&text, len);
    if (!f)
        return NULL;
    *rc = ops_jobs_show(&k->cc, key, f);
    fclose(f);
    return text;
}

static unsigned page_key(struct console *k, struct MHD_Connection *conn, struct html *b)
{
    const char *key = arg(conn, "k");
    char *text;
    size_t len = 0;
    int rc = 0;
    unsigned status = MHD_HTTP_OK;
    html_page_start(b, key ? key : "key", "");
    html_raw(b, "<h1>Key <code id=\"key\">");
    html_text(b, key ? key : "");
    html_raw(b, "</code></h1>");
    if (!key) {
        html_raw(b, "<p>Give a key (the box at the top).</p>");
        html_page_end(b);
        return MHD_HTTP_BAD_REQUEST;
    }
    html_raw(b, "<p class=\"mut\">The same story as <code>idemq jobs show</code>, oldest first. "
                "<a href=\"/parked?key=");
    html_url(b, key);
    html_raw(b, "\">its open parks</a></p>");
    text = capture_show(k, key, &rc, &len);
    if (!text) {
        html_raw(b, "<p class=\"bad\">out of memory</p>");
        status = MHD_HTTP_INTERNAL_SERVER_ERROR;
    } else {
        if (rc == 1)
            status = MHD_HTTP_NOT_FOUND;
        else if (rc)
            status = MHD_HTTP_SERVICE_UNAVAILABLE;
        html_raw(b, "<pre id=\"story\">");
        html_text_n(b, text, len);
        html_raw(b, rc == 1 ? "the ledger knows nothing of this key\n" : "");
        html_raw(b, rc > 1 ? "the ledger did not answer (see the log)\n" : "");
        html_raw(b, "</pre>");
        free(text);
    }
    html_page_end(b);
    return status;
}

/* ---- the observe baseline ---- */

/* A since filter as the page accepts it: a date or timestamp's characters
 * only (PostgreSQL parses it); anything else is refused before the query. */
static bool since_ok(const char *s)
{
    size_t n = strlen(s);
    if (n == 0 || n > 40)
        return false;
    return strspn(s, "0123456789-:+. TZtz") == n;
}

static unsigned page_observe(struct console *k, struct MHD_Connection *conn, struct html *b)
{
    const char *in = arg(conn, "input"), *since = arg(conn, "since");
    unsigned status = MHD_HTTP_OK;
    char *text = NULL;
    size_t len = 0;
    int rc = 0, modes = 0;
    FILE *f;

    html_page_start(b, "observe baseline", "observe");
    html_raw(b, "<h1>Observe baseline</h1><p class=\"mut\">What inputs with "
                "<code>mode = \"observe\"</code> saw on their copy of live traffic while the "
                "existing consumer applied it: keys claimed, duplicates already present, late "
                "replays and what apply mode would park (<code>idemq observe report</code>). "
                "No effect ran for any of it. After the switch to <code>mode = \"apply\"</code>, "
                "every key observed here is a duplicate: the old consumer applied it, idemq "
                "never will.</p>");
    for (int i = 0; i < k->c->n_inputs; i++)
        if (CONF_INPUT_OBSERVE(&k->c->inputs[i])) {
            html_raw(b, modes++ ? ", " : "<p id=\"observe-inputs\">observing now: ");
            html_text(b, k->c->inputs[i].name);
        }
    html_raw(b, modes ? "</p>" : "<p id=\"observe-inputs\">no input of this process is in "
                                 "observe mode; the ledger's observations are shown</p>");
    html_raw(b, "<form class=\"filters\" method=\"get\" action=\"/observe\">");
    filter_field(b, "input", "input", in, "any");
    filter_field(b, "since", "since", since, "2026-12-01 10:00Z");
    html_raw(b, "<button>filter</button> <a href=\"/observe\">clear</a></form>");
    if ((in && strlen(in) > 200) || (since && !since_ok(since))) {
        html_raw(b, "<p class=\"bad\">since must be a date or timestamp (like 2026-12-01 or "
                    "2026-12-01 10:00Z) and input a name of at most 200 bytes</p>");
        html_page_end(b);
        return MHD_HTTP_BAD_REQUEST;
    }
    if (!db_of(k)) {
        unavailable(b, "the observations");
        html_page_end(b);
        return MHD_HTTP_SERVICE_UNAVAILABLE;
    }
    if (!(f = open_memstream(&text, &len))) {
        html_raw(b, "<p class=\"bad\">out of memory</p>");
        html_page_end(b);
        return MHD_HTTP_INTERNAL_SERVER_ERROR;
    }
    rc = observe_report_db(k->db, in, since, f);
    fclose(f);
    html_raw(b, "<pre id=\"baseline\">");
    if (text)
        html_text_n(b, text, len);
    html_raw(b, rc > 1 ? "the ledger did not answer (see the log)\n" : "");
    html_raw(b, "</pre>");
    free(text);
    if (rc > 1)
        status = MHD_HTTP_SERVICE_UNAVAILABLE;
    html_page_end(b);
    return status;
}

/* ---- actions ---- */

/* The first count after "selects " in a groups_act output, -1 if none. */
static long selected_of(const char *out)
{
    const char *p = out ? strstr(out, " selects ") : NULL;
    return p ? atol(p + 9) : -1;
}

/* Runs groups_act with its output captured; malloc'd text (NULL: no
 * memory), *rc its code. */
static char *run_action(struct console *k, const char *action, const char *group,
                        const char *reason, const char *actor, bool dry, long at_most, int *rc,
                        size_t *len)
{
    char *text = NULL;
    struct ops_filter f;
    FILE *out = open_memstream(&text, len);
    if (!out)
        return NULL;
    memset(&f, 0, sizeof f);
    f.dry_run = dry;
    f.limit = at_most; /* 0 = all */
    *rc = groups_act(&k->cc, action, &f, group, reason, actor, out);
    fclose(out);
    return text;
}

static bool action_ok(const char *a)
{
    return !strcmp(a, "redrive") || !strcmp(a, "discard") || !strcmp(a, "archive");
}

/* POST /confirm: the dry run and the form that confirms it. */
static unsigned page_confirm(struct console *k, const char *action, const char *group,
                             struct html *b)
{
    char t[33], *text;
    size_t len = 0;
    int rc = 0;
    long n;
    html_page_start(b, "confirm", "groups");
    html_raw(b, "<h1>Confirm: ");
    html_text(b, action);
    html_raw(b, " group <code>");
    html_text(b, group);
    html_raw(b, "</code></h1>");
    text = run_action(k, action, group, "(the reason given below)", "console", true, 0, &rc,
                      &len);
    if (!text) {
        html_page_end(b);
        return MHD_HTTP_INTERNAL_SERVER_ERROR;
    }
    n = selected_of(text);
    html_printf(b, "<p class=\"note\" id=\"dry-count\">Dry run: this %s would act on "
                   "<b>%ld</b> open park%s. Nothing has changed yet.</p>",
                action, n < 0 ? 0 : n, n == 1 ? "" : "s");
    html_raw(b, "<pre id=\"dry-run\">");
    html_text_n(b, text, len);
    html_raw(b, "</pre>");
    free(text);
    if (rc) {
        html_printf(b, "<p class=\"bad\">the dry run failed (code %d; see the log)</p>", rc);
    } else if (n > 0) {
        csrf_issue(k, t);
        html_printf(b, "<h2>Confirm</h2><form method=\"post\" action=\"/act\" class=\"filters\">"
                       "<input type=\"hidden\" name=\"csrf\" value=\"%s\">"
                       "<input type=\"hidden\" name=\"action\" value=\"%s\">"
                       "<input type=\"hidden\" name=\"group\" value=\"",
                    t, action);
        html_text(b, group);
        html_printf(b, "\"><input type=\"hidden\" name=\"expect\" value=\"%ld\">"
                       "<label>your name<input name=\"actor\" required maxlength=\"100\" "
                       "autocomplete=\"username\"></label>"
                       "<label>reason<input name=\"reason\" %s maxlength=\"500\"></label>"
                       "<label>console token<input type=\"password\" name=\"token\" required "
                       "autocomplete=\"current-password\"></label>"
                       "<button class=\"danger\" name=\"go\" value=\"1\">%s %ld park%s</button>"
                       " <a href=\"/groups\">cancel</a></form>",
                    n, strcmp(action, "redrive") ? "required" : "", action, n,
                    n == 1 ? "" : "s");
        if (!k->has_token)
            html_raw(b, "<p class=\"note\">console.token_file is not set: the action will be "
                        "refused.</p>");
    }
    html_page_end(b);
    return MHD_HTTP_OK;
}

/* POST /act: the action itself, recorded as the CLI's is. */
static unsigned page_act(struct console *k, const char *body, size_t blen, struct html *b)
{
    char action[16], group[16], actor[FIELD_MAX], reason[FIELD_MAX], token[FIELD_MAX], who[160];
    char expect[24], *text;
    size_t len = 0;
    long at_most = 0;
    int rc = 0;
    if (!html_form_get(body, blen, "action", action, sizeof action) || !action_ok(action) ||
        !html_form_get(body, blen, "group", group, sizeof group) || !is_group_id(group) ||
        !html_form_get(body, blen, "actor", actor, 101) || !actor[0] ||
        !html_form_get(body, blen, "token", token, sizeof token)) {
        html_page_start(b, "refused", "groups");
        html_raw(b, "<h1>Refused</h1><p>the form lacks an action, a group, your name or the "
                    "token</p>");
        html_page_end(b);
        return MHD_HTTP_BAD_REQUEST;
    }
    if (!k->has_token || !same_secret(token, k->token)) {
        log_warn("console: %s of group %s refused: wrong console token", action, group);
        html_page_start(b, "refused", "groups");
        html_raw(b, "<h1>Refused</h1><p>wrong console token (console.token_file)</p>");
        html_page_end(b);
        return MHD_HTTP_FORBIDDEN;
    }
    if (!html_form_get(body, blen, "reason", reason, 501))
        reason[0] = '\0';
    if (!reason[0] && strcmp(action, "redrive") != 0) {
        html_page_start(b, "refused", "groups");
        html_raw(b, "<h1>Refused</h1><p>a discard or an archive needs a reason</p>");
        html_page_end(b);
        return MHD_HTTP_BAD_REQUEST;
    }
    /* At most what the dry run showed: parks that joined the group since
     * wait for another confirmation. */
    if (!html_form_get(body, blen, "expect", expect, sizeof expect) ||
        (at_most = atol(expect)) <= 0 || at_most > 1000000000L) {
        html_page_start(b, "refused", "groups");
        html_raw(b, "<h1>Refused</h1><p>the form lacks the count it confirmed</p>");
        html_page_end(b);
        return MHD_HTTP_BAD_REQUEST;
    }
    snprintf(who, sizeof who, "console:%s", actor);
    html_page_start(b, "done", "groups");
    html_raw(b, "<h1>");
    html_text(b, action);
    html_raw(b, " group <code>");
    html_text(b, group);
    html_raw(b, "</code></h1>");
    text = run_action(k, action, group, reason[0] ? reason : NULL, who, false, at_most, &rc,
                      &len);
    log_info("console: %s of group %s by %s: code %d", action, group, who, rc);
    html_printf(b, "<p class=\"%s\" id=\"act-result\">%s</p>", rc ? "bad" : "ok",
                rc == 0 ? "done" : rc == 2 ? "refused (see below)" : "failed part-way or did "
                                                                     "not run (see the log)");
    html_raw(b, "<pre id=\"act-output\">");
    if (text)
        html_text_n(b, text, len);
    html_raw(b, "</pre><p><a href=\"/groups\">back to the groups</a></p>");
    free(text);
    html_page_end(b);
    return rc == 0 ? MHD_HTTP_OK : rc == 2 ? MHD_HTTP_BAD_REQUEST : MHD_HTTP_SERVICE_UNAVAILABLE;
}

/* ---- the server ---- */

/* 127.0.0.0/8, ::1 and ::ffff:127.0.0.0/104 (a v4 client on a v6 socket). */
static bool client_loopback(struct MHD_Connection *conn)
{
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    const struct sockaddr *a = ci ? ci->client_addr : NULL;
#ifdef IDEMQ_TEST_HOOKS
    if (getenv("IDEMQ_TEST_CONSOLE_REMOTE")) /* every client taken as remote (check_console) */
        return false;
#endif
    if (!a)
        return false;
    if (a->sa_family == AF_INET) {
        const struct sockaddr_in *sa = (const struct sockaddr_in *)(const void *)a;
        return (ntohl(sa->sin_addr.s_addr) >> 24) == 127;
    }
    if (a->sa_family == AF_INET6) {
        const struct in6_addr *x = &((const struct sockaddr_in6 *)(const void *)a)->sin6_addr;
        return IN6_IS_ADDR_LOOPBACK(x) || (IN6_IS_ADDR_V4MAPPED(x) && x->s6_addr[12] == 127);
    }
    return false;
}

static bool same_origin(struct MHD_Connection *conn, char *why, size_t len)
{
    const char *sfs = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Sec-Fetch-Site");
    const char *origin = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Origin");
    const char *host = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Host");
    if (sfs && strcmp(sfs, "same-origin") != 0) {
        snprintf(why, len, "Sec-Fetch-Site is %.40s", sfs);
        return false;
    }
    if (!origin || !host || strncmp(origin, "http://", 7) != 0 || strcmp(origin + 7, host) != 0) {
        snprintf(why, len, "Origin %.100s is not this console", origin ? origin : "(none)");
        return false;
    }
    return true;
}

static enum MHD_Result send_page(struct MHD_Connection *conn, unsigned status, const char *type,
                                 const char *text, size_t len, bool auth_challenge)
{
    struct MHD_Response *r =
        MHD_create_response_from_buffer(len, (void *)text, MHD_RESPMEM_MUST_COPY);
    enum MHD_Result ret;
    if (!r)
        return MHD_NO;
    MHD_add_response_header(r, "Content-Type", type);
    MHD_add_response_header(r, "Content-Security-Policy",
                            "default-src 'none'; style-src 'self'; img-src 'self'; "
                            "form-action 'self'; frame-ancestors 'none'; base-uri 'none'");
    MHD_add_response_header(r, "X-Content-Type-Options", "nosniff");
    MHD_add_response_header(r, "X-Frame-Options", "DENY");
    MHD_add_response_header(r, "Referrer-Policy", "same-origin");
    MHD_add_response_header(r, "Cache-Control", strcmp(type, "text/css") == 0
                                                    ? "max-age=3600"
                                                    : "no-store");
    if (auth_challenge)
        MHD_add_response_header(r, "WWW-Authenticate", "Basic realm=\"idemq console\"");
    ret = MHD_queue_response(conn, status, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result send_html(struct MHD_Connection *conn, unsigned status, struct html *b)
{
    enum MHD_Result ret;
    if (b->full || !b->p) {
        static const char msg[] = "the page did not fit in memory\n";
        ret = send_page(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, "text/plain; charset=utf-8", msg,
                        sizeof msg - 1, false);
    } else {
        ret = send_page(conn, status, "text/html; charset=utf-8", b->p, b->n, false);
    }
    html_free(b);
    return ret;
}

static enum MHD_Result refuse(struct MHD_Connection *conn, unsigned status, const char *what)
{
    struct html b;
    html_init(&b);
    html_page_start(&b, "refused", "");
    html_raw(&b, "<h1>Refused</h1><p id=\"refused\">");
    html_text(&b, what);
    html_raw(&b, "</p>");
    html_page_end(&b);
    return send_html(conn, status, &b);
}

/* Reading from another address than loopback: HTTP Basic with the token as
 * the password (any user name). */
static bool remote_allowed(struct console *k, struct MHD_Connection *conn)
{
    char *pass = NULL, *user;
    bool ok;
    if (!k->has_token)
        return false;
    user = MHD_basic_auth_get_username_password(conn, &pass);
    ok = pass && same_secret(pass, k->token);
    if (user)
        MHD_free(user);
    if (pass)
        MHD_free(pass);
    return ok;
}

static enum MHD_Result answer(void *cls, struct MHD_Connection *conn, const char *url,
                              const char *method, const char *version, const char *upload,
                              size_t *upload_len, void **state)
{
    struct console *k = cls;
    struct req *q = *state;
    struct html b;
    unsigned status = MHD_HTTP_OK;
    bool post = strcmp(method, "POST") == 0;

    (void)version;
    if (!q) { /* first call: headers only */
        if (!(q = calloc(1, sizeof *q)))
            return MHD_NO;
        *state = q;
        return MHD_YES;
    }
    if (*upload_len) { /* a piece of the body */
        if (q->len + *upload_len > BODY_MAX)
            q->too_big = true;
        else
            memcpy(q->body + q->len, upload, *upload_len), q->len += *upload_len;
        *upload_len = 0;
        return MHD_YES;
    }
    if (!client_loopback(conn) && !remote_allowed(k, conn)) {
        static const char msg[] = "the console answers other addresses than loopback only "
                                  "with the token of console.token_file (HTTP Basic)\n";
        return send_page(conn, MHD_HTTP_UNAUTHORIZED, "text/plain; charset=utf-8", msg,
                         sizeof msg - 1, k->has_token);
    }
    if (strcmp(method, "GET") != 0 && !post)
        return refuse(conn, MHD_HTTP_METHOD_NOT_ALLOWED, "GET or POST only");
    if (strcmp(url, "/console.css") == 0)
        return send_page(conn, MHD_HTTP_OK, "text/css", html_css, strlen(html_css), false);
    html_init(&b);
    if (post) {
        char why[200], csrf[40], action[16], group[16];
        if (strcmp(url, "/confirm") != 0 && strcmp(url, "/act") != 0)
            return refuse(conn, MHD_HTTP_NOT_FOUND, "no such action");
        if (!same_origin(conn, why, sizeof why)) {
            log_warn("console: POST %s refused: %s", url, why);
            return refuse(conn, MHD_HTTP_FORBIDDEN, "cross-site request refused");
        }
        if (q->too_big)
            return refuse(conn, 413, "form too large");
        if (!html_form_get(q->body, q->len, "csrf", csrf, sizeof csrf) || !csrf_take(k, csrf)) {
            log_warn("console: POST %s refused: no valid form token", url);
            return refuse(conn, MHD_HTTP_FORBIDDEN,
                          "the form token is missing, used or expired: reload the page");
        }
        if (strcmp(url, "/act") == 0) {
            status = page_act(k, q->body, q->len, &b);
        } else if (!html_form_get(q->body, q->len, "action", action, sizeof action) ||
                   !action_ok(action) ||
                   !html_form_get(q->body, q->len, "group", group, sizeof group) ||
                   !is_group_id(group)) {
            return refuse(conn, MHD_HTTP_BAD_REQUEST, "an action and a group id are needed");
        } else {
            status = page_confirm(k, action, group, &b);
        }
    } else if (strcmp(url, "/") == 0) {
        page_overview(k, &b);
    } else if (strcmp(url, "/groups") == 0) {
        page_groups(k, conn, &b);
    } else if (strcmp(url, "/parked") == 0) {
        page_parked(k, conn, &b);
    } else if (strcmp(url, "/key") == 0) {
        status = page_key(k, conn, &b);
    } else if (strcmp(url, "/observe") == 0) {
        status = page_observe(k, conn, &b);
    } else {
        html_free(&b);
        return refuse(conn, MHD_HTTP_NOT_FOUND, "no such page: try /");
    }
    return send_html(conn, status, &b);
}

static void completed(void *cls, struct MHD_Connection *conn, void **state,
                      enum MHD_RequestTerminationCode why)
{
    (void)cls, (void)conn, (void)why;
    free(*state);
    *state = NULL;
}

/* The token of path into buf (trailing whitespace cut). */
static idemq_err_t read_token(const char *path, char *buf, size_t len, char *errbuf,
                              size_t errlen)
{
    struct stat st;
    ssize_t got;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        snprintf(errbuf, errlen, "console.token_file %s cannot be read", path);
        return IDEMQ_ERR_CONFIG;
    }
    if (fstat(fd, &st) == 0 && (st.st_mode & 077))
        log_warn("console.token_file %s can be read by others than its owner (chmod 600)",
                 path);
    got = read(fd, buf, len - 1);
    close(fd);
    if (got < 0)
        got = 0;
    buf[got] = '\0';
    while (got > 0 && (buf[got - 1] == '\n' || buf[got - 1] == '\r' || buf[got - 1] == ' ' ||
                       buf[got - 1] == '\t'))
        buf[--got] = '\0';
    if (got < 8 || strlen(buf) != (size_t)got) {
        snprintf(errbuf, errlen, "console.token_file %s must hold a secret of 8 to %zu bytes "
                 "(no NUL)", path, len - 1);
        return IDEMQ_ERR_CONFIG;
    }
    return IDEMQ_OK;
}

idemq_err_t console_start(const struct conf *c, struct worker *ws, int n, struct gauges *g,
                          struct console **out, char *errbuf, size_t errlen)
{
    struct console *k;
    struct sockaddr_in sa;
    char host[16];
    int port = 0;

    *out = NULL;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    if (!conf_listen_parse(c->console_listen, host, &port) ||
        inet_pton(AF_INET, host, &sa.sin_addr) != 1) {
        snprintf(errbuf, errlen, "console.listen \"%s\" must be IPv4:port", c->console_listen);
        return IDEMQ_ERR_CONFIG;
    }
    sa.sin_port = htons((uint16_t)port);
    if (!(k = calloc(1, sizeof *k))) {
        snprintf(errbuf, errlen, "out of memory");
        return IDEMQ_ERR_NOMEM;
    }
    k->c = c;
    k->cc = *c;
    k->cc.statement_timeout_ms = c->console_statement_timeout_ms;
    k->ws = ws;
    k->n = n;
    k->g = g;
    if (c->console_token_file[0]) {
        idemq_err_t e = read_token(c->console_token_file, k->token, sizeof k->token, errbuf,
                                   errlen);
        if (e) {
            free(k);
            return e;
        }
        k->has_token = true;
    }
    /* One thread: requests are served one at a time, so the console's
     * session and form tokens need no lock, and a slow action delays only
     * other console pages (never /metrics, never a worker). */
    k->d = MHD_start_daemon(MHD_USE_INTERNAL_POLLING_THREAD, 0, NULL, NULL, answer, k,
                            MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&sa,
                            MHD_OPTION_NOTIFY_COMPLETED, completed, k,
                            MHD_OPTION_CONNECTION_TIMEOUT, (unsigned int)CONN_TIMEOUT_S,
                            MHD_OPTION_CONNECTION_LIMIT, (unsigned int)CONN_MAX,
                            MHD_OPTION_PER_IP_CONNECTION_LIMIT, (unsigned int)CONN_PER_IP,
                            MHD_OPTION_END);
    if (!k->d) {
        snprintf(errbuf, errlen, "cannot listen on %s for the console", c->console_listen);
        free(k);
        return IDEMQ_ERR_CONFIG;
    }
    *out = k;
    return IDEMQ_OK;
}

void console_stop(struct console *k)
{
    if (!k)
        return;
    MHD_stop_daemon(k->d);
    if (k->db)
        PQfinish(k->db);
    memset(k->token, 0, sizeof k->token);
    free(k);
}
