/*
 * trace_export: idemq's spans, exported to an OpenTelemetry collector over
 * OTLP/HTTP with JSON bodies (libcurl, jansson). Workers hand finished
 * spans to a bounded queue and never wait: a full queue drops the span,
 * and a collector that is down or slow costs the spans of the requests
 * that failed (counted), not throughput. One exporter thread per process,
 * off unless tracing.endpoint is set.
 */
#ifndef IDEMQ_TRACE_EXPORT_H
#define IDEMQ_TRACE_EXPORT_H

#include <stdbool.h>
#include <stddef.h>

#include "conf.h"
#include "idemq_err.h"
#include "trace.h"

/* Span outcomes (the attribute idemq.outcome). */
enum trace_outcome {
    TRACE_APPLIED = 0, /* committed, acknowledged */
    TRACE_DUPLICATE,   /* its key was applied before: acknowledged, no effect */
    TRACE_RETRY,       /* a transient failure: held for a retry */
    TRACE_PARKED,      /* parked (dead-lettered) */
    TRACE_HELD,        /* waits its turn (an ordered lane, an early retry) */
    TRACE_OBSERVED,    /* observe mode: recorded, not applied */
};

/* A link of a batch span: the context of one message's producer. */
struct trace_link {
    unsigned char trace_id[16], span_id[8];
};

/* One finished span of a job (times: CLOCK_REALTIME, ns since the epoch). */
struct trace_span {
    struct trace_job t;
    long long start_ns, end_ns;
    const struct conf_input *in; /* its input (of the configuration exported with) */
    int attempt;
    enum trace_outcome outcome;
    /* A provider call of the job instead (call_op set): a CLIENT span of its
     * own (call_span_id), the job's span its parent. */
    const char *call_op;     /* "call", "lookup by key", "lookup by reference"; NULL: the job */
    const char *call_method; /* "POST", "GET" */
    const char *call_class;  /* the answer's class (effect_http_class_name) */
    long call_status;        /* HTTP status; 0: no answer */
    unsigned char call_span_id[8];
    /* A batch span instead (batch_op set, t.trace_id/t.span_id its own ids,
     * t.parent_id its parent when batch_parent): "receive" or "settle", with
     * links[0..nlinks) to the producers' contexts (taken by the queue). */
    const char *batch_op;
    const char *settle_op; /* settle: "ack", "nack", "delete" */
    bool batch_parent;
    struct trace_link *links;
    size_t nlinks;
    int batch_size;
};

/* Starts the exporter when c->tracing_endpoint is set (else does nothing
 * and returns IDEMQ_OK). */
idemq_err_t trace_export_start(const struct conf *c, char *errbuf, size_t errlen)
    IDEMQ_MUSTCHECK;

/* Exports what is queued (within tracing.timeout_ms) and stops the thread. */
void trace_export_stop(void);

/* true between trace_export_start (with an endpoint) and trace_export_stop. */
bool trace_export_on(void);

/* Queues a finished span; never blocks on the collector. */
void trace_export_span(const struct trace_span *s);

/* Queues the span of a settled job of input in: from received_mono_ns
 * (CLOCK_MONOTONIC, when the job came) to now_mono_ns. Nothing when the
 * job has no span of its own. */
void trace_export_job(const struct trace_job *t, const struct conf_input *in,
                      long long received_mono_ns, long long now_mono_ns, int attempt,
                      enum trace_outcome outcome);

/* Queues the span of one provider call of a job with a span (a child of
 * it): op and method as in struct trace_span, cls the answer's class,
 * status its HTTP status (0: none), elapsed_ms the call's time to now. */
void trace_export_call(const struct trace_job *t, const struct conf_input *in, const char *op,
                       const char *method, const char *cls, long status, long long elapsed_ms);

/* Queues the two spans of a settled batch of n messages of input in,
 * following the messaging conventions: a "receive" span (kind CLIENT, the
 * root of a trace of its own, from first_mono_ns to last_mono_ns, when
 * the batch's messages came) and a "settle" span (kind CLIENT, its child,
 * from settle_mono_ns to now_mono_ns; settle_op "ack", "nack" or
 * "delete"), each linked to the producer context of every message of jobs
 * that has one (t[0..n), NULL entries skipped). Nothing when tracing is
 * off or no message of the batch has a span. */
void trace_export_batch(const struct conf_input *in, const struct trace_job *const *t, int n,
                        long long first_mono_ns, long long last_mono_ns,
                        long long settle_mono_ns, long long now_mono_ns, const char *settle_op);

/* Counters since start (metrics). */
struct trace_export_counts {
    long exported;  /* spans a collector accepted (2xx) */
    long dropped;   /* spans never sent: the queue was full */
    long failed;    /* spans of requests that failed (no answer, not 2xx) */
    long requests;  /* export requests made */
};
void trace_export_counts(struct trace_export_counts *out);

/* The OTLP JSON request body of spans s[0..n) (malloc'd, or NULL for no
 * memory); for the exporter and its tests. */
char *trace_export_body(const struct conf *c, const struct trace_span *s, size_t n);

#endif
