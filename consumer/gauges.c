/*
 * gauges: idemq.deferred counts per input, refreshed by one thread with a
 * client-side deadline per PostgreSQL call (see gauges.h).
 */
#include "gauges.h"

#include <libpq-fe.h>
#include <poll.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ledger_db.h"
#include "log.h"
#include "outbox.h"

#define GAUGES_PERIOD_MS 5000   /* refresh interval */
#define GAUGES_DEADLINE_MS 3000 /* per connect or query */

struct gauge_row {
    long deferred;
    double oldest_s;
};

struct gauges {
    const struct conf *c;
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    bool stop;
    /* guarded by lock */
    struct gauge_row *rows; /* one per input */
    bool up;                /* the last refresh succeeded */
    long long refreshed_ms; /* CLOCK_MONOTONIC of the last success, 0 = never */
    char last_error[256];
    /* with outbox.relay: idemq.outbox_gauges() */
    long ob_pending, ob_parked;
    double ob_oldest_s;
    bool ob_up;
    /* PostgreSQL queue inputs: idemq.queue_gauges(), one per pg input */
    struct pgq_gauge {
        long rows, ready, retrying;
        double oldest_ready_s;
        long leased;          /* rows under a live lease (a provider call) */
        long leases_expired;  /* leases that ran out and were taken again (a counter) */
    } *pgq;
    bool pgq_up;
};

static long long mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

void gauges_label(const char *s, char *buf, size_t len, size_t *off)
{
    for (; *s && *off + 3 < len; s++) {
        if (*s == '\\' || *s == '"') {
            buf[(*off)++] = '\\';
            buf[(*off)++] = *s;
        } else if (*s == '\n') {
            buf[(*off)++] = '\\';
            buf[(*off)++] = 'n';
        } else {
            buf[(*off)++] = *s;
        }
    }
    if (*off < len)
        buf[*off] = '\0';
}

/* Connects with libpq's own connect_timeout and a server-side
 * statement_timeout; NULL on failure (message in g->last_error). */
static PGconn *connect_db(struct gauges *g)
{
    char timeout[16], options[64];
    const char *keys[] = {"dbname", "application_name", "connect_timeout", "options", NULL};
    const char *vals[] = {g->c->dsn, "idemq gauges", timeout, options, NULL};
    PGconn *db;
    snprintf(timeout, sizeof timeout, "%d", GAUGES_DEADLINE_MS / 1000);
    snprintf(options, sizeof options, "-c statement_timeout=%d", GAUGES_DEADLINE_MS);
    db = PQconnectdbParams(keys, vals, 1);
    if (db && PQstatus(db) == CONNECTION_OK) {
        ledger_db_route_notices(db); /* no raw notice text on stderr */
        return db;
    }
    snprintf(g->last_error, sizeof g->last_error, "%s",
             db ? PQerrorMessage(db) : "out of memory");
    g->last_error[strcspn(g->last_error, "\n")] = '\0';
    PQfinish(db);
    return NULL;
}

/* Runs sql with a client-side deadline; the result, or NULL (and the
 * session must be dropped) on error or timeout. */
static PGresult *query(struct gauges *g, PGconn *db, const char *sql)
{
    long long deadline = mono_ms() + GAUGES_DEADLINE_MS;
    PGresult *r, *last = NULL;

    if (!PQsendQuery(db, sql))
        goto fail;
    for (;;) {
        while (PQisBusy(db)) {
            struct pollfd p = {PQsocket(db), POLLIN, 0};
            long long left = deadline - mono_ms();
            if (left <= 0) {
                snprintf(g->last_error, sizeof g->last_error,
                         "no answer within %d ms", GAUGES_DEADLINE_MS);
                PQclear(last);
                return NULL;
            }
            if (poll(&p, 1, (int)left) < 0 || !PQconsumeInput(db))
                goto fail;
        }
        if (!(r = PQgetResult(db)))
            break;
        PQclear(last);
        last = r;
    }
    if (last && PQresultStatus(last) == PGRES_TUPLES_OK)
        return last;
fail:
    snprintf(g->last_error, sizeof g->last_error, "%s", PQerrorMessage(db));
    g->last_error[strcspn(g->last_error, "\n")] = '\0';
    PQclear(last);
    return NULL;
}

/* True if q is queue or one of its partitions "<queue>.p<digits>". */
static bool queue_of(const char *q, const char *queue)
{
    size_t n = strlen(queue);
    if (strncmp(q, queue, n) != 0)
        return false;
    if (q[n] == '\0')
        return true;
    if (q[n] != '.' || q[n + 1] != 'p' || !q[n + 2])
        return false;
    for (q += n + 2; *q; q++)
        if (*q < '0' || *q > '9')
            return false;
    return true;
}

static void refresh(struct gauges *g, PGconn **db)
{
    const struct conf *c = g->c;
    struct gauge_row *rows = calloc((size_t)c->n_inputs + 1, sizeof *rows);
    PGresult *r;

    if (!rows)
        return;
    if (!*db)
        *db = connect_db(g);
    r = *db ? query(g, *db,
                    "SELECT source_queue, count(*), "
                    "extract(epoch FROM clock_timestamp() - min(deferred_at)) "
                    "FROM idemq.deferred GROUP BY source_queue")
            : NULL;
    pthread_mutex_lock(&g->lock);
    if (r) {
        for (int t = 0; t < PQntuples(r); t++) {
            const char *q = PQgetvalue(r, t, 0);
            for (int i = 0; i < c->n_inputs; i++) {
                if (queue_of(q, c->inputs[i].queue)) {
                    double age = strtod(PQgetvalue(r, t, 2), NULL);
                    rows[i].deferred += strtol(PQgetvalue(r, t, 1), NULL, 10);
                    if (age > rows[i].oldest_s)
                        rows[i].oldest_s = age;
                    break;
                }
            }
        }
        free(g->rows);
        g->rows = rows;
        rows = NULL;
        g->up = true;
        g->refreshed_ms = mono_ms();
    } else {
        if (g->up)
            log_warn("metrics: cannot read idemq.deferred for the deferred gauges: %s",
                     g->last_error);
        g->up = false;
    }
    pthread_mutex_unlock(&g->lock);
    free(rows);
    if (r && c->outbox_relay) { /* the outbox's depth and age */
        PGresult *o = query(g, *db, "SELECT r_pending, r_parked, r_oldest_s "
                                    "FROM idemq.outbox_gauges()");
        pthread_mutex_lock(&g->lock);
        if (o && PQntuples(o) == 1) {
            g->ob_pending = strtol(PQgetvalue(o, 0, 0), NULL, 10);
            g->ob_parked = strtol(PQgetvalue(o, 0, 1), NULL, 10);
            g->ob_oldest_s = strtod(PQgetvalue(o, 0, 2), NULL);
            g->ob_up = true;
        } else {
            if (g->ob_up)
                log_warn("metrics: cannot read the outbox gauges: %s", g->last_error);
            g->ob_up = false;
        }
        pthread_mutex_unlock(&g->lock);
        if (!o) {
            PQclear(r);
            r = NULL; /* the session is dropped below */
        }
        PQclear(o);
    }
    if (r && c->n_pg_inputs) { /* PostgreSQL queue inputs: depth and age */
        PGresult *o = query(g, *db, "SELECT r_queue, r_depth, r_ready, r_oldest_ready_s, "
                                    "r_retrying, r_leased, r_leases_expired "
                                    "FROM idemq.queue_gauges()");
        pthread_mutex_lock(&g->lock);
        if (o) {
            memset(g->pgq, 0, (size_t)c->n_pg_inputs * sizeof *g->pgq);
            for (int t = 0; t < PQntuples(o); t++)
                for (int i = 0; i < c->n_pg_inputs; i++)
                    if (strcmp(PQgetvalue(o, t, 0), c->pg_inputs[i].queue) == 0) {
                        g->pgq[i].rows = strtol(PQgetvalue(o, t, 1), NULL, 10);
                        g->pgq[i].ready = strtol(PQgetvalue(o, t, 2), NULL, 10);
                        g->pgq[i].oldest_ready_s = strtod(PQgetvalue(o, t, 3), NULL);
                        g->pgq[i].retrying = strtol(PQgetvalue(o, t, 4), NULL, 10);
                        g->pgq[i].leased = strtol(PQgetvalue(o, t, 5), NULL, 10);
                        g->pgq[i].leases_expired = strtol(PQgetvalue(o, t, 6), NULL, 10);
                    }
            g->pgq_up = true;
        } else {
            if (g->pgq_up)
                log_warn("metrics: cannot read the queue gauges: %s", g->last_error);
            g->pgq_up = false;
        }
        pthread_mutex_unlock(&g->lock);
        if (!o) {
            PQclear(r);
            r = NULL; /* the session is dropped below */
        }
        PQclear(o);
    }
    if (!r && *db) { /* a failed or timed-out session is not reused */
        PQfinish(*db);
        *db = NULL;
    }
    PQclear(r);
}

static void *run(void *arg)
{
    struct gauges *g = arg;
    PGconn *db = NULL;
    pthread_mutex_lock(&g->lock);
    while (!g->stop) {
        struct timespec until;
        pthread_mutex_unlock(&g->lock);
        refresh(g, &db);
        pthread_mutex_lock(&g->lock);
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += GAUGES_PERIOD_MS / 1000;
        while (!g->stop && pthread_cond_timedwait(&g->wake, &g->lock, &until) == 0)
            ;
    }
    pthread_mutex_unlock(&g->lock);
    PQfinish(db);
    return NULL;
}

idemq_err_t gauges_start(const struct conf *c, struct gauges **out, char *errbuf, size_t errlen)
{
    struct gauges *g = calloc(1, sizeof *g);
    *out = NULL;
    if (!g || !(g->rows = calloc((size_t)c->n_inputs + 1, sizeof *g->rows)) ||
        !(g->pgq = calloc((size_t)c->n_pg_inputs + 1, sizeof *g->pgq))) {
        if (g)
            free(g->rows);
        free(g);
        snprintf(errbuf, errlen, "out of memory");
        return IDEMQ_ERR_NOMEM;
    }
    g->c = c;
    pthread_mutex_init(&g->lock, NULL);
    pthread_cond_init(&g->wake, NULL);
    if (pthread_create(&g->thread, NULL, run, g) != 0) {
        pthread_cond_destroy(&g->wake);
        pthread_mutex_destroy(&g->lock);
        free(g->rows);
        free(g->pgq);
        free(g);
        snprintf(errbuf, errlen, "cannot start the ledger gauges thread");
        return IDEMQ_ERR_INTERNAL;
    }
    *out = g;
    return IDEMQ_OK;
}

void gauges_render(struct gauges *g, char *buf, size_t len, size_t *off)
{
#define PUT(...)                                                                             \
    do {                                                                                     \
        if (*off < len)                                                                      \
            *off += (size_t)snprintf(buf + *off, len - *off, __VA_ARGS__);                   \
    } while (0)
    const struct conf *c;
    if (!g)
        return;
    c = g->c;
    pthread_mutex_lock(&g->lock);
    PUT("# HELP idemq_deferred_jobs jobs of ordered inputs waiting in idemq.deferred for a "
        "predecessor or a parked key\n# TYPE idemq_deferred_jobs gauge\n");
    for (int i = 0; i < c->n_inputs; i++) {
        PUT("idemq_deferred_jobs{input=\"");
        gauges_label(c->inputs[i].name, buf, len, off);
        PUT("\"} %ld\n", g->rows[i].deferred);
    }
    PUT("# HELP idemq_oldest_deferred_age_seconds age of the oldest deferred job (0 when "
        "none)\n# TYPE idemq_oldest_deferred_age_seconds gauge\n");
    for (int i = 0; i < c->n_inputs; i++) {
        PUT("idemq_oldest_deferred_age_seconds{input=\"");
        gauges_label(c->inputs[i].name, buf, len, off);
        PUT("\"} %.3f\n", g->rows[i].oldest_s);
    }
    PUT("# HELP idemq_ledger_gauges_up 1 if the last ledger query behind the deferred gauges "
        "succeeded\n# TYPE idemq_ledger_gauges_up gauge\nidemq_ledger_gauges_up %d\n",
        g->up ? 1 : 0);
    PUT("# HELP idemq_ledger_gauges_age_seconds seconds since the deferred gauges were last "
        "read from the ledger (-1 never)\n# TYPE idemq_ledger_gauges_age_seconds gauge\n"
        "idemq_ledger_gauges_age_seconds %.3f\n",
        g->refreshed_ms ? (double)(mono_ms() - g->refreshed_ms) / 1000.0 : -1.0);
    if (c->outbox_relay) {
        long n = atomic_load(&outbox_stats.latency_count);
        PUT("# HELP idemq_outbox_pending outbox rows not sent yet (pending)\n"
            "# TYPE idemq_outbox_pending gauge\nidemq_outbox_pending %ld\n"
            "# HELP idemq_outbox_parked_rows outbox rows parked (unroutable or nacked)\n"
            "# TYPE idemq_outbox_parked_rows gauge\nidemq_outbox_parked_rows %ld\n"
            "# HELP idemq_outbox_oldest_unsent_age_seconds age of the oldest pending outbox row "
            "(0 when none)\n# TYPE idemq_outbox_oldest_unsent_age_seconds gauge\n"
            "idemq_outbox_oldest_unsent_age_seconds %.3f\n"
            "# HELP idemq_outbox_gauges_up 1 if the last read of the outbox gauges succeeded\n"
            "# TYPE idemq_outbox_gauges_up gauge\nidemq_outbox_gauges_up %d\n",
            g->ob_pending, g->ob_parked, g->ob_oldest_s, g->ob_up ? 1 : 0);
        PUT("# HELP idemq_outbox_relayed_total outbox rows published, confirmed and marked sent "
            "by this process\n# TYPE idemq_outbox_relayed_total counter\n"
            "idemq_outbox_relayed_total %ld\n"
            "# HELP idemq_outbox_parked_total outbox rows this process parked\n"
            "# TYPE idemq_outbox_parked_total counter\nidemq_outbox_parked_total %ld\n"
            "# HELP idemq_outbox_refused_total outbox publishes returned or nacked\n"
            "# TYPE idemq_outbox_refused_total counter\nidemq_outbox_refused_total %ld\n"
            "# HELP idemq_outbox_unopened_total outbox rows left unpublished because their "
            "sealed body cannot be opened (key not listed, or the copy altered)\n"
            "# TYPE idemq_outbox_unopened_total counter\nidemq_outbox_unopened_total %ld\n",
            atomic_load(&outbox_stats.relayed), atomic_load(&outbox_stats.parked),
            atomic_load(&outbox_stats.failed), atomic_load(&outbox_stats.unopened));
        PUT("# HELP idemq_outbox_commit_to_confirm_seconds time from emit to the broker's "
            "confirm of relayed rows\n# TYPE idemq_outbox_commit_to_confirm_seconds histogram\n");
        for (int i = 0; i < 6; i++)
            PUT("idemq_outbox_commit_to_confirm_seconds_bucket{le=\"%g\"} %ld\n",
                outbox_latency_bounds_ms[i] / 1000.0, atomic_load(&outbox_stats.latency_le[i]));
        PUT("idemq_outbox_commit_to_confirm_seconds_bucket{le=\"+Inf\"} %ld\n"
            "idemq_outbox_commit_to_confirm_seconds_sum %.6f\n"
            "idemq_outbox_commit_to_confirm_seconds_count %ld\n",
            n, (double)atomic_load(&outbox_stats.latency_us_sum) / 1e6, n);
    }
    if (c->n_pg_inputs) { /* PostgreSQL queue inputs */
        static const struct {
            const char *name, *help;
        } m[] = {
            {"idemq_queue_rows", "rows of a PostgreSQL queue input still to do"},
            {"idemq_queue_ready_rows", "of those, rows whose run_after passed"},
            {"idemq_queue_oldest_ready_age_seconds",
             "how long the oldest ready row has been due (0 when none)"},
            {"idemq_queue_retrying_rows", "rows holding a retry (a failed attempt)"},
            {"idemq_queue_leased_rows",
             "rows under a live lease (a provider call taken by a worker, holder and expiry "
             "in the row)"},
            {"idemq_queue_leases_expired_total",
             "leases that ran out (their holder died or hung) and whose rows were taken again"},
        };
        for (size_t k = 0; k < sizeof m / sizeof m[0]; k++) {
            PUT("# HELP %s %s\n# TYPE %s %s\n", m[k].name, m[k].help, m[k].name,
                k == 5 ? "counter" : "gauge");
            for (int i = 0; i < c->n_pg_inputs; i++) {
                PUT("%s{input=\"", m[k].name);
                gauges_label(c->pg_inputs[i].name, buf, len, off);
                if (k == 2)
                    PUT("\"} %.3f\n", g->pgq[i].oldest_ready_s);
                else
                    PUT("\"} %ld\n", k == 0   ? g->pgq[i].rows
                                      : k == 1 ? g->pgq[i].ready
                                      : k == 3 ? g->pgq[i].retrying
                                      : k == 4 ? g->pgq[i].leased
                                               : g->pgq[i].leases_expired);
            }
        }
        PUT("# HELP idemq_queue_gauges_up 1 if the last read of the queue gauges succeeded\n"
            "# TYPE idemq_queue_gauges_up gauge\nidemq_queue_gauges_up %d\n",
            g->pgq_up ? 1 : 0);
    }
    pthread_mutex_unlock(&g->lock);
    if (*off >= len && len)
        *off = len - 1;
#undef PUT
}

bool gauges_outbox_stuck(struct gauges *g, char *why, size_t len)
{
    bool stuck = false;
    if (!g || !g->c->outbox_relay)
        return false;
    pthread_mutex_lock(&g->lock);
    if (g->ob_up && g->ob_oldest_s > g->c->outbox_stuck_s) {
        stuck = true;
        snprintf(why, len,
                 "outbox: the oldest unsent row waits for %.0f s (outbox.stuck_s = %d), %ld "
                 "pending",
                 g->ob_oldest_s, g->c->outbox_stuck_s, g->ob_pending);
    }
    pthread_mutex_unlock(&g->lock);
    return stuck;
}

void gauges_stop(struct gauges *g)
{
    if (!g)
        return;
    pthread_mutex_lock(&g->lock);
    g->stop = true;
    pthread_cond_signal(&g->wake);
    pthread_mutex_unlock(&g->lock);
    pthread_join(g->thread, NULL);
    pthread_cond_destroy(&g->wake);
    pthread_mutex_destroy(&g->lock);
    free(g->rows);
    free(g->pgq);
    free(g);
}
