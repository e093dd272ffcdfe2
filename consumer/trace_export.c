/*
 * trace_export: the bounded span queue and the exporter thread (see
 * trace_export.h). OTLP/HTTP JSON: ids as lowercase hex, times as decimal
 * strings, enums as numbers (the OTLP JSON mapping of
 * opentelemetry/proto/trace/v1/trace.proto). Attributes follow the
 * messaging semantic conventions; the business key and the routing key
 * are left out (personal data, unbounded values).
 */
#include "trace_export.h"

#include <curl/curl.h>
#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "log.h"

struct exporter {
    const struct conf *c;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct trace_span *ring;
    size_t cap, head, n;
    bool stop;
    pthread_t thread;
    atomic_long exported, dropped, failed, requests;
};

static struct exporter ex = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
static atomic_bool on;

bool trace_export_on(void)
{
    return atomic_load_explicit(&on, memory_order_relaxed);
}

void trace_export_counts(struct trace_export_counts *out)
{
    out->exported = atomic_load(&ex.exported);
    out->dropped = atomic_load(&ex.dropped);
    out->failed = atomic_load(&ex.failed);
    out->requests = atomic_load(&ex.requests);
}

void trace_export_span(const struct trace_span *s)
{
    bool full;
    if (!trace_export_on() || !s->t.span)
        return;
    pthread_mutex_lock(&ex.mu);
    full = ex.n == ex.cap;
    if (!full) {
        ex.ring[(ex.head + ex.n) % ex.cap] = *s;
        ex.n++;
        if (ex.n == (size_t)ex.c->tracing_batch_max)
            pthread_cond_signal(&ex.cv);
    }
    pthread_mutex_unlock(&ex.mu);
    if (full)
        atomic_fetch_add(&ex.dropped, 1);
}

static const char *outcome_name(enum trace_outcome o)
{
    switch (o) {
    case TRACE_APPLIED:
        return "applied";
    case TRACE_DUPLICATE:
        return "duplicate";
    case TRACE_RETRY:
        return "retry";
    case TRACE_PARKED:
        return "parked";
    case TRACE_HELD:
        return "held";
    case TRACE_OBSERVED:
        return "observed";
    }
    return "unknown";
}

static json_t *attr_str(const char *k, const char *v)
{
    return json_pack("{s:s, s:{s:s}}", "key", k, "value", "stringValue", v);
}

static json_t *attr_int(const char *k, long long v)
{
    char num[24];
    snprintf(num, sizeof num, "%lld", v); /* int64 travels as a string in OTLP JSON */
    return json_pack("{s:s, s:{s:s}}", "key", k, "value", "intValue", num);
}

static json_t *span_json(const struct conf *c, const struct trace_span *s)
{
    const struct conf_input *in = &c->inputs[s->input];
    char tid[33], sid[17], pid[17], t0[24], t1[24], name[300];
    json_t *o, *attrs;
    trace_hex(s->t.trace_id, 16, tid);
    trace_hex(s->t.span_id, 8, sid);
    snprintf(t0, sizeof t0, "%lld", s->start_ns);
    snprintf(t1, sizeof t1, "%lld", s->end_ns);
    snprintf(name, sizeof name, "process %s", in->queue);
    attrs = json_pack("[o, o, o, o, o, o]", attr_str("messaging.system", "rabbitmq"),
                      attr_str("messaging.operation.type", "process"),
                      attr_str("messaging.operation.name", "process"),
                      attr_str("messaging.destination.name", in->queue),
                      attr_str("idemq.input", in->name),
                      attr_str("idemq.outcome", outcome_name(s->outcome)));
    if (attrs && s->attempt > 0)
        json_array_append_new(attrs, attr_int("idemq.attempt", s->attempt));
    /* kind 5: SPAN_KIND_CONSUMER */
    o = json_pack("{s:s, s:s, s:s, s:i, s:s, s:s, s:o}", "traceId", tid, "spanId", sid, "name",
                  name, "kind", 5, "startTimeUnixNano", t0, "endTimeUnixNano", t1, "attributes",
                  attrs);
    /* status: ERROR for a parked job; else left unset (the default) */
    if (o && s->outcome == TRACE_PARKED)
        json_object_set_new(o, "status", json_pack("{s:i, s:s}", "code", 2, "message", "parked"));
    if (o && s->t.in.parent[0]) {
        trace_hex(s->t.parent_id, 8, pid);
        json_object_set_new(o, "parentSpanId", json_string(pid));
        if (s->t.in.state[0])
            json_object_set_new(o, "traceState", json_string(s->t.in.state));
    }
    /* Span.flags (trace flags, parent is remote) is left out: collectors
     * built on the protocol before 1.1 do not know it */
    return o;
}

char *trace_export_body(const struct conf *c, const struct trace_span *s, size_t n)
{
    json_t *spans = json_array(), *root;
    char *out;
    for (size_t i = 0; spans && i < n; i++)
        if (json_array_append_new(spans, span_json(c, &s[i])) != 0) {
            json_decref(spans);
            return NULL;
        }
    root = json_pack("{s:[{s:{s:[o]}, s:[{s:{s:s, s:s}, s:o}]}]}", "resourceSpans", "resource",
                     "attributes", attr_str("service.name", c->tracing_service_name),
                     "scopeSpans", "scope", "name", "idemq", "version", IDEMQ_VERSION, "spans",
                     spans);
    if (!root)
        return NULL;
    out = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    return out;
}

static size_t discard(char *p, size_t size, size_t n, void *arg)
{
    (void)p;
    (void)arg;
    return size * n;
}

/* One request of spans s[0..n); returns true when the collector took it. */
static bool post(CURL *h, const struct trace_span *s, size_t n)
{
    char *body = trace_export_body(ex.c, s, n);
    struct curl_slist *hdr = curl_slist_append(NULL, "Content-Type: application/json");
    long status = 0;
    CURLcode rc = CURLE_OUT_OF_MEMORY;
    if (body && hdr) {
        curl_easy_reset(h);
        curl_easy_setopt(h, CURLOPT_URL, ex.c->tracing_endpoint);
        curl_easy_setopt(h, CURLOPT_HTTPHEADER, hdr);
        curl_easy_setopt(h, CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, (long)ex.c->tracing_timeout_ms);
        curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
        curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, discard);
        curl_easy_setopt(h, CURLOPT_PROTOCOLS_STR, "http,https");
        rc = curl_easy_perform(h);
        if (rc == CURLE_OK)
            curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &status);
    }
    curl_slist_free_all(hdr);
    free(body);
    atomic_fetch_add(&ex.requests, 1);
    if (rc == CURLE_OK && status >= 200 && status < 300) {
        atomic_fetch_add(&ex.exported, (long)n);
        return true;
    }
    atomic_fetch_add(&ex.failed, (long)n);
    /* the endpoint is never logged (it may hold a token) */
    log_debug("tracing: %zu span(s) not exported: %s (HTTP %ld)", n,
              rc == CURLE_OK ? "refused" : curl_easy_strerror(rc), status);
    return false;
}

static long long mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void *run(void *arg)
{
    CURL *h = curl_easy_init();
    size_t max = (size_t)ex.c->tracing_batch_max;
    struct trace_span *batch = calloc(max, sizeof *batch);
    bool failing = false;
    long long stop_at = 0;
    (void)arg;
    for (;;) {
        size_t n = 0;
        bool stop;
        pthread_mutex_lock(&ex.mu);
        if (ex.n < max && !ex.stop) {
            struct timespec until;
            clock_gettime(CLOCK_REALTIME, &until);
            until.tv_sec += ex.c->tracing_flush_ms / 1000;
            until.tv_nsec += (long)(ex.c->tracing_flush_ms % 1000) * 1000000L;
            if (until.tv_nsec >= 1000000000L) {
                until.tv_sec++;
                until.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&ex.cv, &ex.mu, &until);
        }
        stop = ex.stop;
        if (stop && !stop_at)
            stop_at = mono_ms();
        if (stop && mono_ms() - stop_at > ex.c->tracing_timeout_ms) {
            /* stopping, and the collector is slow: the rest is dropped */
            atomic_fetch_add(&ex.failed, (long)ex.n);
            ex.n = 0;
        }
        while (batch && n < max && ex.n > 0) {
            batch[n++] = ex.ring[ex.head];
            ex.head = (ex.head + 1) % ex.cap;
            ex.n--;
        }
        pthread_mutex_unlock(&ex.mu);
        if (n && h && batch) {
            bool ok = post(h, batch, n);
            if (!ok && !failing)
                log_warn("tracing: the collector did not take %zu span(s); spans are dropped "
                         "(counted) until it does", n);
            else if (ok && failing)
                log_info("tracing: the collector takes spans again");
            failing = !ok;
        } else if (n) {
            atomic_fetch_add(&ex.failed, (long)n);
        }
        if (stop && n < max) /* the queue is empty (or the last pass ran) */
            break;
    }
    free(batch);
    curl_easy_cleanup(h);
    return NULL;
}

idemq_err_t trace_export_start(const struct conf *c, char *errbuf, size_t errlen)
{
    if (!c->tracing_endpoint[0])
        return IDEMQ_OK;
    if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) {
        snprintf(errbuf, errlen, "tracing: libcurl does not start");
        return IDEMQ_ERR_NOMEM;
    }
    ex.c = c;
    ex.cap = (size_t)c->tracing_queue_max;
    ex.head = ex.n = 0;
    ex.stop = false;
    if (!(ex.ring = calloc(ex.cap, sizeof *ex.ring))) {
        snprintf(errbuf, errlen, "tracing: out of memory for %zu spans", ex.cap);
        return IDEMQ_ERR_NOMEM;
    }
    if (pthread_create(&ex.thread, NULL, run, NULL) != 0) {
        free(ex.ring);
        ex.ring = NULL;
        snprintf(errbuf, errlen, "tracing: cannot start the exporter thread");
        return IDEMQ_ERR_NOMEM;
    }
    atomic_store(&on, true);
    return IDEMQ_OK;
}

void trace_export_stop(void)
{
    struct trace_export_counts k;
    if (!trace_export_on())
        return;
    atomic_store(&on, false);
    pthread_mutex_lock(&ex.mu);
    ex.stop = true;
    pthread_cond_signal(&ex.cv);
    pthread_mutex_unlock(&ex.mu);
    pthread_join(ex.thread, NULL);
    free(ex.ring);
    ex.ring = NULL;
    trace_export_counts(&k);
    log_info("tracing: spans exported %ld, dropped %ld (queue full), failed %ld (%ld requests)",
             k.exported, k.dropped, k.failed, k.requests);
}
