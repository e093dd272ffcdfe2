/*
 * console: the web console of `idemq run` (see console.h).
 */
#include "console.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <math.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/random.h>
#include <sys/select.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <libpq-fe.h>

#include "broker.h"
#include "broker_admin.h"
#include "console_auth.h"
#include "console_pages.h"
#include "groups.h"
#include "html.h"
#include "liveness.h"
#include "log.h"
#include "observe.h"
#include "ops.h"
#include "topology.h"

#define CONN_TIMEOUT_S 10   /* an idle connection is closed after this */
#define ARRIVE_MS 5000      /* a request's headers and body arrive within this, in all */
#define LOOP_MS 250         /* the server thread looks at the clock at least this often */
#define CONN_MAX 32         /* connections at a time */
#define CONN_PER_IP 16      /* of them from one address */
#define BODY_MAX 8192       /* the largest form body read */
#define FIELD_MAX 1024      /* the longest form field kept */
#define PAGE_ROWS 50        /* parked rows per page */
#define CSRF_SLOTS 128      /* form tokens outstanding at once (oldest reused) */
#define CSRF_TTL_MS (30 * 60 * 1000)
#define REASON_SHOWN 300    /* bytes of a reason shown in a table */
#define KEY_SHOWN 120       /* bytes of a key shown in a table */
#define CONFIRM_SLOTS 16    /* dry runs awaiting their action at once (oldest reused) */
#define CONFIRM_TTL_MS (10 * 60 * 1000)
#define CONFIRM_MAX_PARKS 100000 /* parks one console action covers (the oldest) */

struct csrf {
    char v[33];       /* 32 hex digits, "" = free */
    long long exp_ms; /* CLOCK_MONOTONIC */
};

/* A connection and since when its current request has been arriving. */
struct conn_watch {
    bool used;
    int fd;
    long long since_ms; /* 0: no request arriving (being answered) */
};

/* A dry run shown, awaiting its action: the action acts on these parks and
 * no others (kept here, never taken from the form). */
struct confirm {
    char v[33];       /* its form token, "" = free */
    long long exp_ms; /* CLOCK_MONOTONIC */
    char action[16];
    char field[8];  /* what was selected: "group", "park" or "key" */
    char *value;    /* which one (malloc'd) */
    long long *ids; /* the parks the dry run selected, ascending */
    size_t n;
};

struct console {
    struct MHD_Daemon *d;
    const struct conf *c;
    struct conf cc; /* c with the console's statement timeout, for ops and groups */
    struct worker *ws;
    int n;
    struct gauges *g;
    PGconn *db; /* the server thread's own session; NULL until first used */
    int port;   /* of console.listen */
    char *op_url[1]; /* cc.urls when console.operator_broker_url is set */
    struct console_auth auth; /* auth.n == 0: no token file */
    struct csrf csrf[CSRF_SLOTS];
    int csrf_next;
    struct confirm confirm[CONFIRM_SLOTS];
    int confirm_next;
    struct conn_watch watch[CONN_MAX + 1];
    pthread_t thread;
    atomic_bool stop;
};

/* One request: its form body, read in pieces. */
struct req {
    char body[BODY_MAX];
    size_t len;
    bool too_big;
    bool refused; /* a response is queued already (a foreign Host) */
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

static void confirm_free(struct confirm *s)
{
    free(s->ids);
    free(s->value);
    memset(s, 0, sizeof *s);
}

/* Keeps a dry run's parks (ids, n: taken over, freed here on failure) under
 * a fresh form token into out[33] ("" if none could be made). */
static void confirm_issue(struct console *k, const char *action, const char *field,
                          const char *value, long long *ids, size_t n, char *out)
{
    struct confirm *s = &k->confirm[k->confirm_next];
    confirm_free(s);
    csrf_issue(k, out); /* for its 128 random bits; the page token is not kept */
    if (!out[0] || !csrf_take(k, out) || !(s->value = strdup(value))) {
        free(ids);
        out[0] = '\0';
        return;
    }
    snprintf(s->v, sizeof s->v, "%s", out);
    snprintf(s->action, sizeof s->action, "%s", action);
    snprintf(s->field, sizeof s->field, "%s", field);
    s->ids = ids;
    s->n = n;
    s->exp_ms = now_ms() + CONFIRM_TTL_MS;
    k->confirm_next = (k->confirm_next + 1) % CONFIRM_SLOTS;
}

/* The outstanding dry run of form token t, NULL if none (expired ones
 * are freed). The caller frees it with confirm_free once used. */
static struct confirm *confirm_find(struct console *k, const char *t)
{
    long long now = now_ms();
    if (strlen(t) != 32)
        return NULL;
    for (int i = 0; i < CONFIRM_SLOTS; i++) {
        struct confirm *s = &k->confirm[i];
        if (s->v[0] && same_secret(s->v, t)) {
            if (s->exp_ms > now)
                return s;
            confirm_free(s);
            return NULL;
        }
    }
    return NULL;
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
        html_raw(b, "<tr><td class=\"gid\"><a href=\"/parked?group=");
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
        html_text_capped(b, PQgetvalue(r, i, 12), REASON_SHOWN);
        html_raw(b, "</span></td><td class=\"hide-s\">");
        html_text(b, PQgetvalue(r, i, 2));
        html_raw(b, "<br>");
        html_text(b, PQgetvalue(r, i, 3));
        html_raw(b, "</td><td class=\"k keys\">");
        for (int c = 4; c <= 6; c++) {
            if (PQgetisnull(r, i, c))
                continue;
            html_raw(b, c > 4 ? "<br><a href=\"/key?k=" : "<a href=\"/key?k=");
            html_url(b, PQgetvalue(r, i, c));
            html_raw(b, "\">");
            html_text_capped(b, PQgetvalue(r, i, c), KEY_SHOWN);
            html_raw(b, "</a>");
        }
        if (atol(PQgetvalue(r, i, 13)) > 3)
            html_printf(b, "<br><span class=\"mut\">%s keys in all</span>", PQgetvalue(r, i, 13));
        html_printf(b, "</td><td>%s</td>",
                    red == n ? "yes" : red == 0 ? "no" : "some");
        if (with_actions) {
            html_raw(b, "<td class=\"act\">");
            console_pages_actions(b, t, "group", g);
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
            html_raw(b, "</td><td>");
            html_text(b, PQgetvalue(r, i, 1));
            html_raw(b, "</td><td>");
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
    if (k->auth.n == 0)
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

/* The parked list's searches after GROUPS_FROM: $6 a key prefix, $7 text
 * the reason holds (any case; no pattern characters), each NULL = any. */
#define PARKED_SEARCH                                                                        \
    " AND ($6::text IS NULL OR starts_with(key, $6))"                                       \
    " AND ($7::text IS NULL OR strpos(lower(reason), lower($7)) > 0)"

static void page_parked(struct console *k, struct MHD_Connection *conn, struct html *b)
{
    const char *in = arg(conn, "input"), *key = arg(conn, "key"), *cls = arg(conn, "class"),
               *since = arg(conn, "since"), *group = arg(conn, "group"), *pg = arg(conn, "page"),
               *prefix = arg(conn, "prefix"), *why = arg(conn, "reason");
    const char *q = NULL, *params[9];
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
    filter_field(b, "prefix", "key prefix", prefix, "order-17");
    filter_field(b, "reason", "reason has", why, "limit");
    filter_field(b, "since", "since", since, "2026-01-31 12:00");
    filter_field(b, "group", "group", group, "12 hex digits");
    html_raw(b, "<button>filter</button> <a href=\"/parked\">clear</a></form>");
    if ((in && !(q = queue_of(k->c, in))) || (group && !is_group_id(group)) ||
        (prefix && strlen(prefix) > 256) || (why && strlen(why) > 200)) {
        html_raw(b, "<p class=\"bad\">no such input, a group id that is not 12 hex "
                    "digits, or a search too long</p>");
        html_page_end(b);
        return;
    }
    snprintf(off, sizeof off, "%ld", page * PAGE_ROWS);
    snprintf(lim, sizeof lim, "%d", PAGE_ROWS + 1);
    params[0] = key, params[1] = cls, params[2] = since, params[3] = q, params[4] = group;
    params[5] = prefix, params[6] = why, params[7] = lim, params[8] = off;
    cnt = query(k, "SELECT count(*)" GROUPS_FROM PARKED_SEARCH, 7, params);
    r = query(k,
              "SELECT id, parked_at, key, source_queue, error_class, error_code,"
              " coalesce(sqlstate, '-'), left(reason, " "400" "), attempts, g, redrivable"
              GROUPS_FROM PARKED_SEARCH " ORDER BY id DESC LIMIT $8::bigint OFFSET $9::bigint",
              9, params);
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
        html_raw(b, "<tr><td><a href=\"/park?id=");
        html_text(b, PQgetvalue(r, i, 0));
        html_raw(b, "\">");
        html_text(b, PQgetvalue(r, i, 0));
        html_raw(b, "</a></td><td class=\"hide-s\">");
        html_text(b, PQgetvalue(r, i, 1));
        html_raw(b, "</td><td class=\"k keys\">");
        if (PQgetisnull(r, i, 2)) {
            html_raw(b, "<span class=\"mut\">(no key)</span>");
        } else {
            html_raw(b, "<a href=\"/key?k=");
            html_url(b, PQgetvalue(r, i, 2));
            html_raw(b, "\">");
            html_text_capped(b, PQgetvalue(r, i, 2), KEY_SHOWN);
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
        html_text_capped(b, PQgetvalue(r, i, 7), REASON_SHOWN);
        html_raw(b, "</span></td><td class=\"hide-s\">");
        html_text(b, PQgetvalue(r, i, 8));
        html_raw(b, "</td><td class=\"gid hide-s\"><a href=\"/parked?group=");
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
            const char *names[] = {"input", "class", "key", "since", "group", "prefix",
                                   "reason"};
            const char *vals[] = {in, cls, key, since, group, prefix, why};
            for (int f = 0; f < 7; f++) {
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

/* Runs groups_act with its output captured; malloc'd text (NULL: no
 * memory), *rc its code. */
static char *run_action(struct console *k, const char *action, const char *field,
                        const char *value, const char *reason, const char *actor,
                        const struct confirm *only, long long **ids_out, size_t *n_ids_out,
                        int *rc, size_t *len)
{
    char *text = NULL;
    const char *group = NULL;
    struct ops_filter f;
    long long park = 0;
    FILE *out = open_memstream(&text, len);
    if (!out)
        return NULL;
    memset(&f, 0, sizeof f);
    f.dry_run = only == NULL;
    f.limit = CONFIRM_MAX_PARKS;
    if (strcmp(field, "group") == 0) {
        group = value;
    } else if (strcmp(field, "key") == 0) {
        f.key = value;
    } else { /* one park */
        park = atoll(value);
        f.park_ids = &park;
        f.n_park_ids = 1;
    }
    if (only) {
        f.park_ids = only->ids;
        f.n_park_ids = only->n;
    }
    f.ids_out = ids_out;
    f.n_ids_out = n_ids_out;
    *rc = groups_act(&k->cc, action, &f, group, reason, actor, out);
    fclose(out);
    return text;
}

static bool action_ok(const char *a)
{
    return !strcmp(a, "redrive") || !strcmp(a, "discard") || !strcmp(a, "archive");
}

/* POST /confirm: the dry run and the form that confirms it. */
static unsigned page_confirm(struct console *k, const char *action, const char *field,
                             const char *value, struct html *b)
{
    char t[33], *text;
    size_t len = 0, n = 0;
    long long *ids = NULL;
    int rc = 0;
    html_page_start(b, "confirm", "groups");
    html_raw(b, "<h1>Confirm: ");
    html_text(b, action);
    html_printf(b, " %s <code id=\"confirm-of\">", field);
    html_text(b, value);
    html_raw(b, "</code></h1>");
    text = run_action(k, action, field, value, "(the reason given below)", "console", NULL, &ids,
                      &n, &rc, &len);
    if (!text) {
        free(ids);
        html_page_end(b);
        return MHD_HTTP_INTERNAL_SERVER_ERROR;
    }
    html_printf(b, "<p class=\"note\" id=\"dry-count\">Dry run: this %s would act on "
                   "<b>%zu</b> open park%s. Nothing has changed yet; the action will act on "
                   "these parks only (parks that join the group meanwhile wait for the next "
                   "dry run).</p>",
                action, n, n == 1 ? "" : "s");
    html_raw(b, "<pre id=\"dry-run\">");
    html_text_n(b, text, len);
    html_raw(b, "</pre>");
    free(text);
    if (rc) {
        free(ids);
        html_printf(b, "<p class=\"bad\">the dry run failed (code %d; see the log)</p>", rc);
    } else if (n > 0) {
        confirm_issue(k, action, field, value, ids, n, t);
        html_printf(b, "<h2>Confirm</h2><form method=\"post\" action=\"/act\" class=\"filters\">"
                       "<input type=\"hidden\" name=\"csrf\" value=\"%s\">"
                       "<input type=\"hidden\" name=\"action\" value=\"%s\">",
                    t, action);
        html_printf(b, "<label>reason<input name=\"reason\" %s maxlength=\"500\"></label>"
                       "<label>your console token<input type=\"password\" name=\"token\" "
                       "required autocomplete=\"current-password\"></label>"
                       "<button class=\"danger\" name=\"go\" value=\"1\">%s %zu park%s</button>"
                       " <a href=\"/groups\">cancel</a></form><p class=\"mut\">The action is "
                       "recorded as done by the name of the token given.</p>",
                    strcmp(action, "redrive") ? "required" : "", action, n, n == 1 ? "" : "s");
        if (k->auth.n == 0)
            html_raw(b, "<p class=\"note\">console.token_file is not set: the action will be "
                        "refused.</p>");
    }
    html_page_end(b);
    return MHD_HTTP_OK;
}

static unsigned refused_page(struct html *b, unsigned status, const char *why)
{
    html_page_start(b, "refused", "groups");
    html_raw(b, "<h1>Refused</h1><p id=\"refused\">");
    html_text(b, why);
    html_raw(b, "</p>");
    html_page_end(b);
    return status;
}

/* POST /act: the action on the parks of the dry run cf (used up here),
 * recorded as the CLI's is, by the name of the token given. */
static unsigned page_act(struct console *k, struct confirm *cf, const char *body, size_t blen,
                         struct html *b)
{
    char action[16], reason[FIELD_MAX], token[FIELD_MAX], who[160], *text;
    const char *field = cf->field, *what = cf->value;
    const char *name = NULL;
    size_t len = 0;
    int rc = 0;
    unsigned status;
    enum console_auth_result ar;
    snprintf(action, sizeof action, "%s", cf->action);
    if (!html_form_get(body, blen, "token", token, sizeof token) || !token[0]) {
        status = refused_page(b, MHD_HTTP_BAD_REQUEST, "the form lacks your console token");
        goto out;
    }
    ar = k->auth.n ? console_auth_check(&k->auth, NULL, token, &name) : CONSOLE_AUTH_WRONG;
    memset(token, 0, sizeof token);
    if (ar != CONSOLE_AUTH_OK) {
        log_warn("console: %s of %s %.100s refused: %s", action, field, what,
                 ar == CONSOLE_AUTH_THROTTLED ? "too many wrong tokens lately"
                                              : "wrong console token");
        status = ar == CONSOLE_AUTH_THROTTLED
                     ? refused_page(b, MHD_HTTP_TOO_MANY_REQUESTS,
                                    "too many wrong tokens lately: try again in a minute")
                     : refused_page(b, MHD_HTTP_FORBIDDEN,
                                    "wrong console token (console.token_file)");
        goto out;
    }
    if (!html_form_get(body, blen, "reason", reason, 501))
        reason[0] = '\0';
    if (!reason[0] && strcmp(action, "redrive") != 0) {
        status = refused_page(b, MHD_HTTP_BAD_REQUEST, "a discard or an archive needs a reason");
        goto out;
    }
    snprintf(who, sizeof who, "console:%s", name);
    html_page_start(b, "done", "groups");
    html_raw(b, "<h1>");
    html_text(b, action);
    html_printf(b, " %s <code>", field);
    html_text(b, what);
    html_raw(b, "</code></h1>");
    /* exactly the parks the dry run showed: ones that joined the group
     * since wait for the next dry run, ones closed since are skipped */
    text = run_action(k, action, field, what, reason[0] ? reason : NULL, who, cf, NULL, NULL,
                      &rc, &len);
    log_info("console: %s of %s %.100s (%zu parks of a dry run) by %s: code %d", action, field,
             what, cf->n, who, rc);
    html_printf(b, "<p class=\"%s\" id=\"act-result\">%s</p>", rc ? "bad" : "ok",
                rc == 0 ? "done" : rc == 2 ? "refused (see below)" : "failed part-way or did "
                                                                     "not run (see the log)");
    html_raw(b, "<p id=\"act-actor\">by <b>");
    html_text(b, who);
    html_raw(b, "</b></p><pre id=\"act-output\">");
    if (text)
        html_text_n(b, text, len);
    html_raw(b, "</pre><p><a href=\"/groups\">back to the groups</a></p>");
    free(text);
    html_page_end(b);
    status = rc == 0 ? MHD_HTTP_OK : rc == 2 ? MHD_HTTP_BAD_REQUEST
                                              : MHD_HTTP_SERVICE_UNAVAILABLE;
out:
    confirm_free(cf); /* one action per dry run */
    return status;
}

/* ---- the server ---- */

/* The watch of conn, NULL if it has none. */
static struct conn_watch *watch_of(struct MHD_Connection *conn)
{
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return ci ? ci->socket_context : NULL;
}

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

/* True if the request's Host names this console: its listen address,
 * localhost, 127.0.0.1 or [::1] with its port (the bare name too on port
 * 80), or one of console.hosts; compared without case. A page of another
 * site whose name was rebound to 127.0.0.1 sends its own name: refused. */
static bool host_ok(struct console *k, struct MHD_Connection *conn)
{
    const char *h = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Host");
    static const char *const names[] = {"localhost", "127.0.0.1", "[::1]"};
    char want[300];
    if (!h || !*h || strlen(h) > 255)
        return false;
    if (strcasecmp(h, k->c->console_listen) == 0)
        return true;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        snprintf(want, sizeof want, "%s:%d", names[i], k->port);
        if (strcasecmp(h, want) == 0 || (k->port == 80 && strcasecmp(h, names[i]) == 0))
            return true;
    }
    for (int i = 0; i < k->c->console_hosts.n; i++)
        if (strcasecmp(h, k->c->console_hosts.v[i]) == 0)
            return true;
    return false;
}

/* HTTP Basic with a token's name as the user name and the token as the
 * password: 1 when given and right, 0 when not, -1 when guesses are
 * throttled. */
static int basic_allowed(struct console *k, struct MHD_Connection *conn)
{
    char *pass = NULL, *user;
    const char *name = NULL;
    enum console_auth_result ar = CONSOLE_AUTH_WRONG;
    if (k->auth.n == 0)
        return 0;
    user = MHD_basic_auth_get_username_password(conn, &pass);
    if (user && pass)
        ar = console_auth_check(&k->auth, user, pass, &name);
    if (user)
        MHD_free(user);
    if (pass)
        MHD_free(pass);
    return ar == CONSOLE_AUTH_OK ? 1 : ar == CONSOLE_AUTH_THROTTLED ? -1 : 0;
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
        if (!host_ok(k, conn)) {
            static const char msg[] = "this console answers only requests whose Host names it "
                                      "(its listen address, localhost, console.hosts)\n";
            q->refused = true;
            log_warn("console: %s %s refused: Host %.100s is not this console", method, url,
                     MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Host")
                         ? MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Host")
                         : "(none)");
            return send_page(conn, 421, "text/plain; charset=utf-8", msg, sizeof msg - 1,
                             false);
        }
        return MHD_YES;
    }
    if (q->refused) { /* the body of a refused request: dropped */
        *upload_len = 0;
        return MHD_YES;
    }
    if (!*upload_len) { /* the request has arrived whole: it is answered now */
        struct conn_watch *w = watch_of(conn);
        if (w)
            w->since_ms = 0;
    }
    if (*upload_len) { /* a piece of the body */
        if (q->len + *upload_len > BODY_MAX)
            q->too_big = true;
        else
            memcpy(q->body + q->len, upload, *upload_len), q->len += *upload_len;
        *upload_len = 0;
        return MHD_YES;
    }
    if (k->c->console_reads_need_token || !client_loopback(conn)) {
        int ok = basic_allowed(k, conn);
        static const char msg[] = "this console answers only with a token of "
                                  "console.token_file (HTTP Basic: its name and the token)\n";
        static const char slow[] = "too many wrong tokens lately: try again in a minute\n";
        if (ok < 0)
            return send_page(conn, MHD_HTTP_TOO_MANY_REQUESTS, "text/plain; charset=utf-8",
                             slow, sizeof slow - 1, false);
        if (ok == 0)
            return send_page(conn, MHD_HTTP_UNAUTHORIZED, "text/plain; charset=utf-8", msg,
                             sizeof msg - 1, k->auth.n > 0);
    }
    if (strcmp(method, "GET") != 0 && !post)
        return refuse(conn, MHD_HTTP_METHOD_NOT_ALLOWED, "GET or POST only");
    if (strcmp(url, "/console.css") == 0)
        return send_page(conn, MHD_HTTP_OK, "text/css", html_css, strlen(html_css), false);
    html_init(&b);
    if (post) {
        char why[200], csrf[40], action[16], group[16], park[20], key[260], keyhex[520];
        if (strcmp(url, "/confirm") != 0 && strcmp(url, "/act") != 0)
            return refuse(conn, MHD_HTTP_NOT_FOUND, "no such action");
        if (!same_origin(conn, why, sizeof why)) {
            log_warn("console: POST %s refused: %s", url, why);
            return refuse(conn, MHD_HTTP_FORBIDDEN, "cross-site request refused");
        }
        if (q->too_big)
            return refuse(conn, 413, "form too large");
        if (!html_form_get(q->body, q->len, "csrf", csrf, sizeof csrf))
            csrf[0] = '\0';
        if (strcmp(url, "/act") == 0) {
            /* only the form of a dry run: it names the parks to act on */
            struct confirm *cf = confirm_find(k, csrf);
            if (!cf) {
                log_warn("console: POST /act refused: not the form of an outstanding dry run");
                return refuse(conn, MHD_HTTP_FORBIDDEN,
                              "no dry run of this form is outstanding (used, expired or "
                              "never shown): confirm the action again");
            }
            status = page_act(k, cf, q->body, q->len, &b);
        } else if (!csrf_take(k, csrf)) {
            log_warn("console: POST %s refused: no valid form token", url);
            return refuse(conn, MHD_HTTP_FORBIDDEN,
                          "the form token is missing, used or expired: reload the page");
        } else if (!html_form_get(q->body, q->len, "action", action, sizeof action) ||
                   !action_ok(action)) {
            return refuse(conn, MHD_HTTP_BAD_REQUEST, "an action is needed");
        } else if (html_form_get(q->body, q->len, "group", group, sizeof group)) {
            if (!is_group_id(group))
                return refuse(conn, MHD_HTTP_BAD_REQUEST, "a group id is 12 hex digits");
            status = page_confirm(k, action, "group", group, &b);
        } else if (html_form_get(q->body, q->len, "park", park, sizeof park)) {
            if (!park[0] || strspn(park, "0123456789") != strlen(park))
                return refuse(conn, MHD_HTTP_BAD_REQUEST, "a park is its number");
            status = page_confirm(k, action, "park", park, &b);
        } else if (html_form_get(q->body, q->len, "keyhex", keyhex, sizeof keyhex)) {
            size_t n = strlen(keyhex);
            if (n == 0 || n % 2 || strspn(keyhex, "0123456789abcdef") != n)
                return refuse(conn, MHD_HTTP_BAD_REQUEST, "keyhex: the key's bytes in hex");
            for (size_t i = 0; i < n / 2; i++) {
                unsigned v = 0;
                sscanf(keyhex + 2 * i, "%2x", &v);
                key[i] = (char)v;
            }
            key[n / 2] = '\0';
            if (strlen(key) != n / 2)
                return refuse(conn, MHD_HTTP_BAD_REQUEST, "a key holds no NUL");
            status = page_confirm(k, action, "key", key, &b);
        } else {
            return refuse(conn, MHD_HTTP_BAD_REQUEST, "a group, a park or a key is needed");
        }
    } else if (strcmp(url, "/") == 0) {
        page_overview(k, &b);
    } else if (strcmp(url, "/groups") == 0) {
        page_groups(k, conn, &b);
    } else if (strcmp(url, "/parked") == 0) {
        page_parked(k, conn, &b);
    } else if (strcmp(url, "/key") == 0) {
        char t[33];
        csrf_issue(k, t);
        status = console_pages_key(db_of(k), k->c, arg(conn, "k"), t, &b);
    } else if (strcmp(url, "/park") == 0) {
        char t[33];
        csrf_issue(k, t);
        status = console_pages_park(db_of(k), k->c, arg(conn, "id"), t, &b);
    } else if (strcmp(url, "/retrying") == 0) {
        status = console_pages_retrying(db_of(k), k->c, &b);
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
    struct conn_watch *w = watch_of(conn);
    (void)cls, (void)why;
    if (w && w->used) /* the next request on this connection starts arriving */
        w->since_ms = now_ms();
    free(*state);
    *state = NULL;
}

/* Connections start and end: their watches (the server thread). */
static void notify_conn(void *cls, struct MHD_Connection *conn, void **ctx,
                        enum MHD_ConnectionNotificationCode toe)
{
    struct console *k = cls;
    struct conn_watch *w = *ctx;
    if (toe == MHD_CONNECTION_NOTIFY_CLOSED) {
        if (w)
            memset(w, 0, sizeof *w);
        *ctx = NULL;
        return;
    }
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    *ctx = NULL;
    for (int i = 0; ci && i < CONN_MAX + 1; i++)
        if (!k->watch[i].used) {
            k->watch[i].used = true;
            k->watch[i].fd = ci->connect_fd;
            k->watch[i].since_ms = now_ms();
            *ctx = &k->watch[i];
            return;
        }
    if (ci) /* more connections than MHD lets in: cannot happen, and is refused */
        shutdown(ci->connect_fd, SHUT_RDWR);
}

/* Closes the connections whose request has been arriving for longer than
 * ARRIVE_MS: an idle timeout alone lets a client that sends a byte now and
 * then hold a connection slot for ever. busy_ms: how long the thread was
 * answering (not reading anyone's bytes), added to every clock. */
static void sweep(struct console *k, long long busy_ms)
{
    long long now = now_ms();
    for (int i = 0; i < CONN_MAX + 1; i++) {
        struct conn_watch *w = &k->watch[i];
        if (!w->used || !w->since_ms)
            continue;
        if (busy_ms > LOOP_MS)
            w->since_ms += busy_ms;
        if (now - w->since_ms > ARRIVE_MS) {
            shutdown(w->fd, SHUT_RDWR); /* MHD sees the end and closes it */
            w->since_ms = 0;
        }
    }
}

/* The console's thread: MHD's select loop, and the sweep. Connections are
 * opened, answered, swept and closed here only, so a watched fd is open
 * whenever the sweep sees it. */
static void *serve(void *arg)
{
    struct console *k = arg;
    while (!atomic_load(&k->stop)) {
        fd_set rs, ws, es;
        MHD_socket max = 0;
        MHD_UNSIGNED_LONG_LONG to = 0;
        struct timeval tv = {0, LOOP_MS * 1000};
        long long t0;
        FD_ZERO(&rs);
        FD_ZERO(&ws);
        FD_ZERO(&es);
        if (MHD_get_fdset(k->d, &rs, &ws, &es, &max) != MHD_YES) {
            log_error("console: cannot poll its sockets; the console stops");
            break;
        }
        if (MHD_get_timeout(k->d, &to) == MHD_YES && to < LOOP_MS)
            tv.tv_usec = (suseconds_t)to * 1000;
        if (select(max + 1, &rs, &ws, &es, &tv) < 0) {
            if (errno != EINTR) {
                log_error("console: select: %s; the console stops", strerror(errno));
                break;
            }
            continue;
        }
        t0 = now_ms();
        MHD_run_from_select(k->d, &rs, &ws, &es);
        sweep(k, now_ms() - t0);
    }
    return NULL;
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
    k->port = port;
    k->cc = *c;
    k->cc.statement_timeout_ms = c->console_statement_timeout_ms;
    if (c->console_operator_broker_url[0]) { /* actions publish as the operator */
        k->op_url[0] = c->console_operator_broker_url;
        k->cc.urls.v = k->op_url;
        k->cc.urls.n = 1;
    }
    k->ws = ws;
    k->n = n;
    k->g = g;
    if (c->console_token_file[0]) {
        idemq_err_t e = console_auth_load(&k->auth, c->console_token_file, errbuf, errlen);
        if (e) {
            free(k);
            return e;
        }
    } else if (c->console_reads_need_token) {
        snprintf(errbuf, errlen, "console.reads_need_token needs console.token_file");
        free(k);
        return IDEMQ_ERR_CONFIG;
    }
    /* One thread (serve): requests are served one at a time, so the
     * console's session and form tokens need no lock, and a slow action
     * delays only other console pages (never /metrics, never a worker). */
    k->d = MHD_start_daemon(0, 0, NULL, NULL, answer, k,
                            MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&sa,
                            MHD_OPTION_NOTIFY_COMPLETED, completed, k,
                            MHD_OPTION_NOTIFY_CONNECTION, notify_conn, k,
                            MHD_OPTION_CONNECTION_TIMEOUT, (unsigned int)CONN_TIMEOUT_S,
                            MHD_OPTION_CONNECTION_LIMIT, (unsigned int)CONN_MAX,
                            MHD_OPTION_PER_IP_CONNECTION_LIMIT, (unsigned int)CONN_PER_IP,
                            MHD_OPTION_END);
    if (!k->d) {
        snprintf(errbuf, errlen, "cannot listen on %s for the console", c->console_listen);
        free(k);
        return IDEMQ_ERR_CONFIG;
    }
    if (pthread_create(&k->thread, NULL, serve, k) != 0) {
        snprintf(errbuf, errlen, "cannot start the console's thread");
        MHD_stop_daemon(k->d);
        free(k);
        return IDEMQ_ERR_NOMEM;
    }
    *out = k;
    return IDEMQ_OK;
}

void console_stop(struct console *k)
{
    if (!k)
        return;
    atomic_store(&k->stop, true);
    pthread_join(k->thread, NULL); /* within LOOP_MS, or the request in progress */
    MHD_stop_daemon(k->d);
    if (k->db)
        PQfinish(k->db);
    console_auth_clear(&k->auth);
    for (int i = 0; i < CONFIRM_SLOTS; i++)
        confirm_free(&k->confirm[i]);
    free(k);
}
