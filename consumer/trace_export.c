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
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ledger_doc.h"
#include "log.h"

/* A queued span, compact: the ring is touched by every job. */
struct slot {
    unsigned char trace_id[16], span_id[8], parent_id[8];
    bool has_parent;
    char *state; /* the producer's tracestate (malloc'd), or NULL */
    long long start_ns, end_ns;
    const struct conf_input *in;
    int attempt;
    enum trace_outcome outcome;
    const char *call_op, *call_method, *call_class; /* constants; call_op NULL: a job */
    long call_status;
    unsigned char call_span_id[8];
    const char *batch_op, *settle_op; /* constants; batch_op NULL: not a batch span */
    struct trace_link *links;         /* malloc'd, or NULL */
    size_t nlinks;
    int batch_size;
};

static void slot_free(struct slot *o)
{
    free(o->state);
    free(o->links);
}

static void slot_of(struct slot *o, const struct trace_span *s)
{
    memcpy(o->trace_id, s->t.trace_id, sizeof o->trace_id);
    memcpy(o->span_id, s->t.span_id, sizeof o->span_id);
    memcpy(o->parent_id, s->t.parent_id, sizeof o->parent_id);
    o->has_parent = s->t.in.parent[0] != '\0';
    o->state = o->has_parent && s->t.in.state[0] ? strdup(s->t.in.state) : NULL;
    o->start_ns = s->start_ns;
    o->end_ns = s->end_ns;
    o->in = s->in;
    o->call_op = s->call_op;
    o->call_method = s->call_method;
    o->call_class = s->call_class;
    o->call_status = s->call_status;
    memcpy(o->call_span_id, s->call_span_id, sizeof o->call_span_id);
    o->attempt = s->attempt;
    o->outcome = s->outcome;
    o->batch_op = s->batch_op;
    o->settle_op = s->settle_op;
    o->has_parent = s->batch_op ? s->batch_parent : o->has_parent;
    o->links = NULL;
    o->nlinks = 0;
    o->batch_size = s->batch_size;
}

struct exporter {
    const struct conf *c;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct slot *ring;
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
    struct slot o;
    if (!trace_export_on() || !s->t.span) {
        free(s->links);
        return;
    }
    slot_of(&o, s);
    o.links = s->links;
    o.nlinks = s->nlinks;
    pthread_mutex_lock(&ex.mu);
    full = ex.n == ex.cap;
    if (!full) {
        ex.ring[(ex.head + ex.n) % ex.cap] = o;
        o.state = NULL;
        o.links = NULL;
        ex.n++;
        if (ex.n == (size_t)ex.c->tracing_batch_max)
            pthread_cond_signal(&ex.cv);
    }
    pthread_mutex_unlock(&ex.mu);
    slot_free(&o);
    if (full)
        atomic_fetch_add(&ex.dropped, 1);
}

void trace_export_job(const struct trace_job *t, const struct conf_input *in,
                      long long received_mono_ns, long long now_mono_ns, int attempt,
                      enum trace_outcome outcome)
{
    struct trace_span sp;
    struct timespec wall;
    if (!t->span || !trace_export_on())
        return;
    clock_gettime(CLOCK_REALTIME, &wall);
    memset(&sp, 0, sizeof sp);
    sp.t = *t;
    sp.end_ns = (long long)wall.tv_sec * 1000000000LL + wall.tv_nsec;
    sp.start_ns = sp.end_ns - (now_mono_ns - received_mono_ns);
    sp.in = in;
    sp.attempt = attempt;
    sp.outcome = outcome;
    trace_export_span(&sp);
}

void trace_export_call(const struct trace_job *t, const struct conf_input *in, const char *op,
                       const char *method, const char *cls, long status, long long elapsed_ms)
{
    struct trace_span sp;
    struct timespec wall;
    if (!t->span || !trace_export_on())
        return;
    clock_gettime(CLOCK_REALTIME, &wall);
    memset(&sp, 0, sizeof sp);
    sp.t = *t;
    sp.end_ns = (long long)wall.tv_sec * 1000000000LL + wall.tv_nsec;
    sp.start_ns = sp.end_ns - (elapsed_ms > 0 ? elapsed_ms : 0) * 1000000LL;
    sp.in = in;
    sp.call_op = op;
    sp.call_method = method;
    sp.call_class = cls;
    sp.call_status = status;
    trace_new_span_id(sp.call_span_id);
    trace_export_span(&sp);
}

static long long wall_of(long long mono_ns, long long now_mono_ns, long long now_wall_ns)
{
    return now_wall_ns - (now_mono_ns - mono_ns);
}

void trace_export_batch(const struct conf_input *in, const struct trace_job *const *t, int n,
                        long long first_mono_ns, long long last_mono_ns,
                        long long settle_mono_ns, long long now_mono_ns, const char *settle_op)
{
    struct trace_span rcv, stl;
    struct trace_link *links, *copy;
    struct timespec wall;
    long long now_wall;
    size_t k = 0;
    bool any = false;
    if (!trace_export_on() || n <= 0)
        return;
    for (int i = 0; i < n; i++)
        any = any || (t[i] && t[i]->span);
    if (!any || !(links = calloc((size_t)n, sizeof *links)))
        return;
    for (int i = 0; i < n; i++)
        if (t[i] && t[i]->span && t[i]->in.parent[0]) {
            memcpy(links[k].trace_id, t[i]->trace_id, 16);
            memcpy(links[k].span_id, t[i]->parent_id, 8);
            k++;
        }
    copy = k ? malloc(k * sizeof *copy) : NULL;
    if (k && !copy) {
        free(links);
        return;
    }
    if (copy)
        memcpy(copy, links, k * sizeof *copy);
    clock_gettime(CLOCK_REALTIME, &wall);
    now_wall = (long long)wall.tv_sec * 1000000000LL + wall.tv_nsec;
    memset(&rcv, 0, sizeof rcv);
    rcv.t.span = true;
    rcv.t.flags = 1;
    trace_new_span_id(rcv.t.span_id);
    trace_new_span_id(rcv.t.trace_id);
    trace_new_span_id(rcv.t.trace_id + 8);
    rcv.in = in;
    rcv.batch_op = "receive";
    rcv.start_ns = wall_of(first_mono_ns, now_mono_ns, now_wall);
    rcv.end_ns = wall_of(last_mono_ns, now_mono_ns, now_wall);
    rcv.links = k ? links : NULL;
    rcv.nlinks = k;
    rcv.batch_size = n;
    stl = rcv;
    memcpy(stl.t.parent_id, rcv.t.span_id, 8);
    trace_new_span_id(stl.t.span_id);
    stl.batch_parent = true;
    stl.batch_op = "settle";
    stl.settle_op = settle_op;
    stl.start_ns = wall_of(settle_mono_ns, now_mono_ns, now_wall);
    stl.end_ns = now_wall;
    stl.links = copy;
    if (!k)
        free(links);
    trace_export_span(&rcv);
    trace_export_span(&stl);
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

/* The request body is written with ledger_doc's JSON writer (jansson
 * objects per span cost several times the rest of a job's CPU in idemq). */
static void puts_(struct ledger_doc *b, const char *s)
{
    ledger_doc_add_raw(b, s);
}

static void put_str(struct ledger_doc *b, const char *s)
{
    ledger_doc_add_string(b, s, strlen(s));
}

static void attr_str(struct ledger_doc *b, bool first, const char *k, const char *v)
{
    puts_(b, first ? "{\"key\":\"" : ",{\"key\":\"");
    puts_(b, k); /* keys are constants of this file */
    puts_(b, "\",\"value\":{\"stringValue\":");
    put_str(b, v);
    puts_(b, "}}");
}

/* messaging.system of an input (a PostgreSQL queue input: no value of the
 * conventions names it) */
static const char *system_name(const struct conf_input *in)
{
    if (in->transport && strcmp(in->transport, "postgres") == 0)
        return "postgresql";
    if (in->transport && strcmp(in->transport, "sqs") == 0)
        return "aws_sqs";
    return "rabbitmq";
}

/* A provider call: a CLIENT span under the job's span (HTTP client
 * conventions: method, status; ERROR without an answer or from 400 on). */
static void call_json(struct ledger_doc *b, const struct slot *s, bool first)
{
    char hex[33], num[96];
    puts_(b, first ? "{\"traceId\":\"" : ",{\"traceId\":\"");
    trace_hex(s->trace_id, 16, hex);
    puts_(b, hex);
    puts_(b, "\",\"spanId\":\"");
    trace_hex(s->call_span_id, 8, hex);
    puts_(b, hex);
    puts_(b, "\",\"parentSpanId\":\"");
    trace_hex(s->span_id, 8, hex);
    puts_(b, hex);
    puts_(b, "\",\"name\":");
    put_str(b, s->call_method);
    /* kind 3: SPAN_KIND_CLIENT */
    snprintf(num, sizeof num, ",\"kind\":3,\"startTimeUnixNano\":\"%lld\"", s->start_ns);
    puts_(b, num);
    snprintf(num, sizeof num, ",\"endTimeUnixNano\":\"%lld\"", s->end_ns);
    puts_(b, num);
    puts_(b, ",\"attributes\":[");
    attr_str(b, true, "http.request.method", s->call_method);
    attr_str(b, false, "idemq.input", s->in->name);
    attr_str(b, false, "idemq.provider.operation", s->call_op);
    attr_str(b, false, "idemq.provider.class", s->call_class);
    if (s->call_status > 0) {
        snprintf(num, sizeof num,
                 ",{\"key\":\"http.response.status_code\",\"value\":{\"intValue\":\"%ld\"}}",
                 s->call_status);
        puts_(b, num);
    }
    puts_(b, "]");
    if (s->call_status == 0 || s->call_status >= 400) {
        puts_(b, ",\"status\":{\"code\":2,\"message\":");
        put_str(b, s->call_class);
        puts_(b, "}");
    }
    puts_(b, "}");
}

static void job_json(struct ledger_doc *b, const struct slot *s, bool first)
{
    const struct conf_input *in = s->in;
    char hex[33], num[64];
    puts_(b, first ? "{\"traceId\":\"" : ",{\"traceId\":\"");
    trace_hex(s->trace_id, 16, hex);
    puts_(b, hex);
    puts_(b, "\",\"spanId\":\"");
    trace_hex(s->span_id, 8, hex);
    puts_(b, hex);
    puts_(b, "\"");
    if (s->has_parent) {
        puts_(b, ",\"parentSpanId\":\"");
        trace_hex(s->parent_id, 8, hex);
        puts_(b, hex);
        puts_(b, "\"");
        if (s->state) {
            puts_(b, ",\"traceState\":");
            put_str(b, s->state);
        }
    }
    puts_(b, ",\"name\":");
    {
        char name[300];
        snprintf(name, sizeof name, "process %s", in->queue);
        put_str(b, name);
    }
    /* kind 5: SPAN_KIND_CONSUMER; 64-bit times travel as strings */
    snprintf(num, sizeof num, ",\"kind\":5,\"startTimeUnixNano\":\"%lld\"", s->start_ns);
    puts_(b, num);
    snprintf(num, sizeof num, ",\"endTimeUnixNano\":\"%lld\"", s->end_ns);
    puts_(b, num);
    puts_(b, ",\"attributes\":[");
    /* a PostgreSQL queue input: no value of the conventions names it */
    attr_str(b, true, "messaging.system", system_name(in));
    attr_str(b, false, "messaging.operation.type", "process");
    attr_str(b, false, "messaging.operation.name", "process");
    attr_str(b, false, "messaging.destination.name", in->queue);
    attr_str(b, false, "idemq.input", in->name);
    attr_str(b, false, "idemq.outcome", outcome_name(s->outcome));
    if (s->attempt > 0) {
        snprintf(num, sizeof num,
                 ",{\"key\":\"idemq.attempt\",\"value\":{\"intValue\":\"%d\"}}", s->attempt);
        puts_(b, num);
    }
    puts_(b, "]");
    /* status: ERROR for a parked job; else left unset (the default).
     * Span.flags is left out: collectors built on the protocol before 1.1
     * do not know it. */
    if (s->outcome == TRACE_PARKED)
        puts_(b, ",\"status\":{\"code\":2,\"message\":\"parked\"}");
    puts_(b, "}");
}

/* A batch span (receive, settle): kind CLIENT, its links to the contexts
 * of the messages' producers. */
static void batch_json(struct ledger_doc *b, const struct slot *s, bool first)
{
    const struct conf_input *in = s->in;
    char hex[33], num[96], name[300];
    puts_(b, first ? "{\"traceId\":\"" : ",{\"traceId\":\"");
    trace_hex(s->trace_id, 16, hex);
    puts_(b, hex);
    puts_(b, "\",\"spanId\":\"");
    trace_hex(s->span_id, 8, hex);
    puts_(b, hex);
    puts_(b, "\"");
    if (s->has_parent) {
        puts_(b, ",\"parentSpanId\":\"");
        trace_hex(s->parent_id, 8, hex);
        puts_(b, hex);
        puts_(b, "\"");
    }
    snprintf(name, sizeof name, "%s %s", s->settle_op ? s->settle_op : s->batch_op, in->queue);
    puts_(b, ",\"name\":");
    put_str(b, name);
    snprintf(num, sizeof num, ",\"kind\":3,\"startTimeUnixNano\":\"%lld\"", s->start_ns);
    puts_(b, num);
    snprintf(num, sizeof num, ",\"endTimeUnixNano\":\"%lld\"", s->end_ns);
    puts_(b, num);
    puts_(b, ",\"attributes\":[");
    attr_str(b, true, "messaging.system", system_name(in));
    attr_str(b, false, "messaging.operation.type", s->batch_op);
    attr_str(b, false, "messaging.operation.name", s->settle_op ? s->settle_op : s->batch_op);
    attr_str(b, false, "messaging.destination.name", in->queue);
    attr_str(b, false, "idemq.input", in->name);
    snprintf(num, sizeof num,
             ",{\"key\":\"messaging.batch.message_count\",\"value\":{\"intValue\":\"%d\"}}",
             s->batch_size);
    puts_(b, num);
    puts_(b, "]");
    if (s->nlinks) /* an empty list is left out, as the protocol's JSON mapping does */
        puts_(b, ",\"links\":[");
    for (size_t i = 0; i < s->nlinks; i++) {
        puts_(b, i ? ",{\"traceId\":\"" : "{\"traceId\":\"");
        trace_hex(s->links[i].trace_id, 16, hex);
        puts_(b, hex);
        puts_(b, "\",\"spanId\":\"");
        trace_hex(s->links[i].span_id, 8, hex);
        puts_(b, hex);
        puts_(b, "\"}");
    }
    puts_(b, s->nlinks ? "]}" : "}");
}

static void span_json(struct ledger_doc *b, const struct slot *s, bool first)
{
    if (s->batch_op)
        batch_json(b, s, first);
    else if (s->call_op)
        call_json(b, s, first);
    else
        job_json(b, s, first);
}

static char *body_of(const struct conf *c, const struct slot *s, size_t n)
{
    struct ledger_doc b;
    ledger_doc_init(&b);
    puts_(&b, "{\"resourceSpans\":[{\"resource\":{\"attributes\":[");
    attr_str(&b, true, "service.name", c->tracing_service_name);
    puts_(&b, "]},\"scopeSpans\":[{\"scope\":{\"name\":\"idemq\",\"version\":");
    put_str(&b, IDEMQ_VERSION);
    puts_(&b, "},\"spans\":[");
    for (size_t i = 0; i < n; i++)
        span_json(&b, &s[i], i == 0);
    puts_(&b, "]}]}]}");
    if (b.nomem) {
        ledger_doc_free(&b);
        return NULL;
    }
    return b.buf; /* the caller frees it */
}

char *trace_export_body(const struct conf *c, const struct trace_span *s, size_t n)
{
    struct slot *o = calloc(n ? n : 1, sizeof *o);
    char *body = NULL;
    if (o) {
        for (size_t i = 0; i < n; i++) {
            slot_of(&o[i], &s[i]);
            o[i].links = s[i].links; /* borrowed */
            o[i].nlinks = s[i].nlinks;
        }
        body = body_of(c, o, n);
        for (size_t i = 0; i < n; i++)
            free(o[i].state);
        free(o);
    }
    return body;
}

static size_t discard(char *p, size_t size, size_t n, void *arg)
{
    (void)p;
    (void)arg;
    return size * n;
}

/* One request of spans s[0..n); returns true when the collector took it. */
static bool post(CURL *h, const struct slot *s, size_t n)
{
    char *body = body_of(ex.c, s, n);
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
    struct slot *batch = calloc(max, sizeof *batch);
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
            for (; ex.n > 0; ex.n--, ex.head = (ex.head + 1) % ex.cap)
                slot_free(&ex.ring[ex.head]);
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
        for (size_t i = 0; i < n; i++)
            slot_free(&batch[i]);
        if (stop && (n < max || !batch)) /* the queue is empty (or cannot be read) */
            break;
    }
    pthread_mutex_lock(&ex.mu);
    for (; ex.n > 0; ex.n--, ex.head = (ex.head + 1) % ex.cap) /* only without a batch */
        slot_free(&ex.ring[ex.head]);
    pthread_mutex_unlock(&ex.mu);
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
