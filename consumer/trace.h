/*
 * trace: the W3C Trace Context a producer sends (traceparent, tracestate)
 * read as data: its shape checked against the Trace Context spec, nothing
 * else trusted. A valid context is passed on unchanged (to the effect's
 * meta, the ledger session setting idemq.traceparent that idemq.emit
 * copies into emitted messages, and Celery replies), so a trace continues
 * downstream; an invalid one is dropped, never repaired, and the job runs
 * as if it had none.
 */
#ifndef IDEMQ_TRACE_H
#define IDEMQ_TRACE_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

/* version 00: "00-" 32 hex "-" 16 hex "-" 2 hex */
#define TRACE_PARENT_LEN 55
/* the spec's limit for tracestate: 32 list members, 512 characters kept */
#define TRACE_STATE_MAX 512

struct trace_ctx {
    char parent[TRACE_PARENT_LEN + 1]; /* "" when the producer sent none valid */
    char state[TRACE_STATE_MAX + 1];   /* "" when none, or dropped */
};

/* A job's trace: the producer's context, and, when spans are exported,
 * idemq's own span (a child of the producer's, or the root of a new trace
 * when the producer sent none). */
struct trace_job {
    struct trace_ctx in;          /* what the producer sent (valid or "") */
    bool span;                    /* idemq exports a span for this job */
    unsigned char trace_id[16];   /* span: the trace (the producer's, or new) */
    unsigned char span_id[8];     /* span: idemq's process span */
    unsigned char parent_id[8];   /* span with in.parent: the producer's span */
    unsigned char flags;          /* trace flags (01 = sampled) */
};

/* Sets t from headers; with span set, gives the job a span of its own
 * (random ids from the kernel), unless the producer's context says it is
 * not sampled (then its context is passed on as it came). */
void trace_job_begin(struct trace_job *t, const json_t *headers, bool span);

/* The traceparent a job's downstream work continues (the effect's meta,
 * what it emits, a Celery result): idemq's span when it has one, else the
 * producer's context as it came; "" when neither. out: TRACE_PARENT_LEN + 1. */
void trace_job_parent(const struct trace_job *t, char *out);

/* A new span id (random, not all zeros), for a span below a job's. */
void trace_new_span_id(unsigned char id[8]);

/* Lowercase hex of n bytes into out (2n + 1 bytes). */
void trace_hex(const unsigned char *b, size_t n, char *out);

/* true when s (n bytes) is a traceparent a version-00 reader accepts:
 * lowercase hex, a trace id and a parent id not all zeros, version not ff;
 * a later version may be longer, and only its first 55 characters are kept. */
bool trace_parent_valid(const char *s, size_t n);

/* true when s (n bytes) is a tracestate to pass on: at most 512 characters,
 * printable ASCII, at most 32 comma-separated members, none empty of key. */
bool trace_state_valid(const char *s, size_t n);

/* Reads "traceparent" and "tracestate" of a headers object (AMQP headers,
 * or a Celery message's). Values that are not strings, or not valid, are
 * dropped; a tracestate without a valid traceparent is dropped too.
 * Returns true when c->parent is set. */
bool trace_from_headers(const json_t *headers, struct trace_ctx *c);

#endif
