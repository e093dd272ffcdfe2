/*
 * metrics: /ready and /metrics over libmicrohttpd (see metrics.h).
 */
#include "metrics.h"

#include <arpa/inet.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "classify.h"
#include "reconcile.h"
#include "liveness.h"
#include "observe.h"
#include "pgq_worker.h"
#include "sqs_worker.h"
#include "trace_export.h"

#define CONN_TIMEOUT_S 5 /* a connection idle this long is closed */
#define CONN_MAX 64       /* connections at a time */
#define CONN_PER_IP 16    /* of them from one address */

struct metrics_server {
    struct MHD_Daemon *d;
    struct worker *ws;
    int n;
    struct gauges *g;
    long long stall_ms; /* metrics.live_stall_s */
};

#define ADD(fmt, ...)                                                                        \
    do {                                                                                     \
        if (off < len)                                                                       \
            off += (size_t)snprintf(buf + off, len - off, fmt, __VA_ARGS__);                 \
    } while (0)

size_t metrics_render(struct worker *ws, int n, char *buf, size_t len)
{
    static const struct {
        const char *name, *help;
        size_t off;
    } counters[] = {
        {"idemq_admitted_total", "deliveries received", offsetof(struct worker_stats, received)},
        {"idemq_completed_total", "deliveries settled after commit (acked)",
         offsetof(struct worker_stats, settled)},
        {"idemq_applied_total", "effects applied", offsetof(struct worker_stats, applied)},
        {"idemq_duplicates_total", "duplicate-key deliveries acknowledged without effect",
         offsetof(struct worker_stats, duplicates)},
        {"idemq_key_reuse_total",
         "deliveries of an applied key with another body (recorded as key_reuse; parked "
         "with on_key_reuse = park)",
         offsetof(struct worker_stats, key_reuse)},
        {"idemq_retried_total", "deliveries sent to a delay bucket",
         offsetof(struct worker_stats, retried)},
        {"idemq_parked_total", "messages parked (dead-lettered)",
         offsetof(struct worker_stats, parked)},
        {"idemq_batches_total", "transactions committed", offsetof(struct worker_stats, batches)},
    };
    size_t off = 0;
    long ready = 0, age = -1;

    for (size_t c = 0; c < sizeof counters / sizeof counters[0]; c++) {
        long sum = 0;
        for (int i = 0; i < n; i++)
            sum += atomic_load((atomic_long *)((char *)&ws[i].stats + counters[c].off));
        ADD("# HELP %s %s\n# TYPE %s counter\n%s %ld\n", counters[c].name, counters[c].help,
            counters[c].name, counters[c].name, sum);
    }
    if (trace_export_on()) { /* tracing.endpoint */
        struct trace_export_counts k;
        trace_export_counts(&k);
        ADD("# HELP idemq_trace_spans_total spans by fate: exported (the collector took them), "
            "dropped (the queue was full), failed (their request failed)\n"
            "# TYPE idemq_trace_spans_total counter\n"
            "idemq_trace_spans_total{outcome=\"exported\"} %ld\n"
            "idemq_trace_spans_total{outcome=\"dropped\"} %ld\n"
            "idemq_trace_spans_total{outcome=\"failed\"} %ld\n"
            "# HELP idemq_trace_export_requests_total OTLP export requests made\n"
            "# TYPE idemq_trace_export_requests_total counter\n"
            "idemq_trace_export_requests_total %ld\n",
            k.exported, k.dropped, k.failed, k.requests);
    }
    ADD("%s", "# HELP idemq_attempts_total failed attempts and pauses by error class\n"
              "# TYPE idemq_attempts_total counter\n");
    for (int cls = CLASS_TRANSIENT; cls <= CLASS_INFRA; cls++) {
        long sum = 0;
        for (int i = 0; i < n; i++)
            sum += atomic_load(&ws[i].stats.by_class[cls]);
        ADD("idemq_attempts_total{class=\"%s\"} %ld\n", classify_name((enum classify_class)cls),
            sum);
    }
    {
        static const struct {
            const char *outcome;
            size_t off;
        } rep[] = {
            {"sent", offsetof(struct celery_reply_counts, sent)},
            {"refused_reply_to", offsetof(struct celery_reply_counts, refused)},
            {"failed", offsetof(struct celery_reply_counts, failed)},
            {"observe_mode", offsetof(struct celery_reply_counts, observe)},
        };
        ADD("%s", "# HELP idemq_celery_replies_total Celery results by outcome: sent "
                  "(confirmed), refused_reply_to (reply_to is not a Celery reply queue: not "
                  "answered), failed (bind refused, nacked, unconfirmed or unread: dropped), "
                  "observe_mode (never answered)\n"
                  "# TYPE idemq_celery_replies_total counter\n");
        for (size_t k = 0; k < sizeof rep / sizeof rep[0]; k++) {
            long sum = 0;
            for (int i = 0; i < n; i++)
                sum += atomic_load((atomic_long *)((char *)&ws[i].stats.celery + rep[k].off));
            ADD("idemq_celery_replies_total{outcome=\"%s\"} %ld\n", rep[k].outcome, sum);
        }
    }
    for (int i = 0; i < n; i++) {
        long a = atomic_load(&ws[i].stats.head_age_ms);
        ready += atomic_load(&ws[i].ready) ? 1 : 0;
        if (a > age)
            age = a;
    }
    ADD("# HELP idemq_oldest_ready_age_seconds age (by its timestamp property) of the last "
        "delivery taken from the head of a queue; -1 without timestamps\n"
        "# TYPE idemq_oldest_ready_age_seconds gauge\nidemq_oldest_ready_age_seconds %.3f\n",
        age < 0 ? -1.0 : (double)age / 1000.0);
    ADD("# HELP idemq_workers_ready workers consuming\n# TYPE idemq_workers_ready gauge\n"
        "idemq_workers_ready %ld\n# HELP idemq_workers worker threads\n"
        "# TYPE idemq_workers gauge\nidemq_workers %d\n",
        ready, n);
    ADD("# HELP idemq_worker_progress_age_seconds longest time since a worker made progress "
        "(GET /live fails past metrics.live_stall_s)\n"
        "# TYPE idemq_worker_progress_age_seconds gauge\n"
        "idemq_worker_progress_age_seconds %.3f\n",
        (double)liveness_max_age_ms(ws, n) / 1000.0);
    if (off < len && n > 0) /* observe-mode inputs */
        off += observe_metrics_render(ws[0].conf, buf + off, len - off);
    {
        struct sqs_worker_totals q;
        long nr;
        if (off < len && sqs_worker_counts(&q, &nr)) /* Amazon SQS inputs */
            ADD("# HELP idemq_sqs_messages_total SQS messages by what became of them: received, "
                "applied, duplicate, retried (held by their visibility), parked\n"
                "# TYPE idemq_sqs_messages_total counter\n"
                "idemq_sqs_messages_total{outcome=\"received\"} %ld\n"
                "idemq_sqs_messages_total{outcome=\"applied\"} %ld\n"
                "idemq_sqs_messages_total{outcome=\"duplicate\"} %ld\n"
                "idemq_sqs_messages_total{outcome=\"retried\"} %ld\n"
                "idemq_sqs_messages_total{outcome=\"parked\"} %ld\n"
                "# HELP idemq_sqs_deletes_refused_total settled messages SQS did not delete (an "
                "expired receipt: they come back as duplicates)\n"
                "# TYPE idemq_sqs_deletes_refused_total counter\n"
                "idemq_sqs_deletes_refused_total %ld\n"
                "# HELP idemq_sqs_visibility_extended_total visibility extensions of messages "
                "whose job was still running\n"
                "# TYPE idemq_sqs_visibility_extended_total counter\n"
                "idemq_sqs_visibility_extended_total %ld\n"
                "# HELP idemq_sqs_not_ready_total times an SQS worker backed off (SQS or the "
                "database failed)\n"
                "# TYPE idemq_sqs_not_ready_total counter\n"
                "idemq_sqs_not_ready_total %ld\n",
                q.received, q.applied, q.duplicates, q.retried, q.parked, q.delete_failed,
                q.extended, nr);
    }
    {
        struct pgq_input_counts q[64];
        long nr;
        int nq = pgq_worker_counts(q, (int)(sizeof q / sizeof q[0]), &nr);
        if (off < len && nq > 0) { /* PostgreSQL queue inputs */
            static const char *const outcome[] = {"admitted", "completed", "applied",
                                                  "duplicate", "retried", "parked"};
            ADD("%s", "# HELP idemq_pgq_rows_total rows of PostgreSQL queue inputs by what "
                      "became of them (committed only): admitted (taken), completed (applied, "
                      "duplicate or parked: gone from the queue), applied, duplicate, retried "
                      "(held in the row), parked\n"
                      "# TYPE idemq_pgq_rows_total counter\n");
            for (int i = 0; i < nq; i++) {
                long v[] = {q[i].admitted, q[i].completed, q[i].applied,
                            q[i].duplicates, q[i].retried, q[i].parked};
                for (size_t k = 0; k < sizeof v / sizeof v[0]; k++)
                    ADD("idemq_pgq_rows_total{input=\"%s\",outcome=\"%s\"} %ld\n",
                        q[i].input, outcome[k], v[k]);
            }
            ADD("# HELP idemq_pgq_not_ready_total times a PostgreSQL queue worker backed off "
                "(the database failed)\n"
                "# TYPE idemq_pgq_not_ready_total counter\nidemq_pgq_not_ready_total %ld\n",
                nr);
        }
    }
    if (off < len) /* provider intents, refreshed by the reconciler's sweep */
        off += reconcile_metrics_render(buf + off, len - off);
    return off < len ? off : len - 1;
}

static enum MHD_Result answer(void *cls, struct MHD_Connection *conn, const char *url,
                              const char *method, const char *version, const char *upload,
                              size_t *upload_len, void **state)
{
    struct metrics_server *m = cls;
    char buf[32768]; /* the provider gauges add lines per input */
    size_t len = 0;
    unsigned status = MHD_HTTP_OK;
    struct MHD_Response *r;
    enum MHD_Result ret;

    (void)version, (void)upload, (void)upload_len, (void)state;
    if (strcmp(method, "GET") != 0) {
        len = (size_t)snprintf(buf, sizeof buf, "GET only\n");
        status = MHD_HTTP_METHOD_NOT_ALLOWED;
    } else if (strcmp(url, "/metrics") == 0) {
        len = metrics_render(m->ws, m->n, buf, sizeof buf);
        gauges_render(m->g, buf, sizeof buf, &len);
    } else if (strcmp(url, "/live") == 0) {
        char why[600];
        if (liveness_ok(m->ws, m->n, m->stall_ms, why, sizeof why)) {
            len = (size_t)snprintf(buf, sizeof buf, "live\n");
        } else {
            len = (size_t)snprintf(buf, sizeof buf, "not live: %s\n", why);
            status = MHD_HTTP_SERVICE_UNAVAILABLE;
        }
    } else if (strcmp(url, "/ready") == 0) {
        /* terse and unauthenticated: why a worker is not ready (a job key,
         * a database error) is in the log and in idemq_workers_ready */
        len = (size_t)snprintf(buf, sizeof buf, "ready\n");
        for (int i = 0; i < m->n; i++) {
            if (!atomic_load(&m->ws[i].ready)) {
                len = (size_t)snprintf(buf, sizeof buf, "not ready\n");
                status = MHD_HTTP_SERVICE_UNAVAILABLE;
                break;
            }
        }
        if (status == MHD_HTTP_OK && pgq_worker_unready() > 0) { /* reasons in the log */
            len = (size_t)snprintf(buf, sizeof buf,
                                   "not ready: a PostgreSQL queue worker backs off\n");
            status = MHD_HTTP_SERVICE_UNAVAILABLE;
        }
        if (status == MHD_HTTP_OK && sqs_worker_unready() > 0) { /* reasons in the log */
            len = (size_t)snprintf(buf, sizeof buf, "not ready: an SQS worker backs off\n");
            status = MHD_HTTP_SERVICE_UNAVAILABLE;
        }
        if (status == MHD_HTTP_OK) { /* a relay that does not drain */
            char why[300];
            if (gauges_outbox_stuck(m->g, why, sizeof why)) {
                len = (size_t)snprintf(buf, sizeof buf, "not ready: %s\n", why);
                status = MHD_HTTP_SERVICE_UNAVAILABLE;
            }
        }
    } else {
        len = (size_t)snprintf(buf, sizeof buf, "try /ready, /live or /metrics\n");
        status = MHD_HTTP_NOT_FOUND;
    }
    if (len >= sizeof buf)
        len = sizeof buf - 1;
    r = MHD_create_response_from_buffer(len, buf, MHD_RESPMEM_MUST_COPY);
    if (!r)
        return MHD_NO;
    MHD_add_response_header(r, "Content-Type", "text/plain; version=0.0.4; charset=utf-8");
    ret = MHD_queue_response(conn, status, r);
    MHD_destroy_response(r);
    return ret;
}

idemq_err_t metrics_start(const struct conf *c, struct worker *ws, int n, struct gauges *g,
                          struct metrics_server **out, char *errbuf, size_t errlen)
{
    struct metrics_server *m;
    struct sockaddr_in sa;
    char host[16];
    int port = 0;

    *out = NULL;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    /* the check of conf_load: a conf that loaded never fails here */
    if (!conf_listen_parse(c->metrics_listen, host, &port) ||
        inet_pton(AF_INET, host, &sa.sin_addr) != 1) {
        snprintf(errbuf, errlen, "metrics.listen \"%s\" must be IPv4:port, e.g. 127.0.0.1:9187",
                 c->metrics_listen);
        return IDEMQ_ERR_CONFIG;
    }
    sa.sin_port = htons((uint16_t)port);
    if (!(m = calloc(1, sizeof *m))) {
        snprintf(errbuf, errlen, "out of memory");
        return IDEMQ_ERR_NOMEM;
    }
    m->ws = ws;
    m->n = n;
    m->g = g;
    m->stall_ms = (long long)c->live_stall_s * 1000;
    /* Idle or slow clients cannot hold the server: each connection is
     * closed after CONN_TIMEOUT_S without traffic, and one address holds at
     * most CONN_PER_IP of CONN_MAX, so a probe from another still gets in. */
    m->d = MHD_start_daemon(MHD_USE_INTERNAL_POLLING_THREAD, 0, NULL, NULL, answer, m,
                            MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&sa,
                            MHD_OPTION_CONNECTION_TIMEOUT, (unsigned int)CONN_TIMEOUT_S,
                            MHD_OPTION_CONNECTION_LIMIT, (unsigned int)CONN_MAX,
                            MHD_OPTION_PER_IP_CONNECTION_LIMIT, (unsigned int)CONN_PER_IP,
                            MHD_OPTION_END);
    if (!m->d) {
        snprintf(errbuf, errlen, "cannot listen on %s for metrics", c->metrics_listen);
        free(m);
        return IDEMQ_ERR_CONFIG;
    }
    *out = m;
    return IDEMQ_OK;
}

void metrics_stop(struct metrics_server *m)
{
    if (!m)
        return;
    MHD_stop_daemon(m->d);
    free(m);
}
