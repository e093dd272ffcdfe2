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
