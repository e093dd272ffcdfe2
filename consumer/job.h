/*
 * job: one delivery as idemq sees it (delivery facts, body, headers) and its
 * decoding: body size, JSON object check and idempotency-key extraction per
 * the input's key_source. Pure and broker-neutral, so it is unit tested
 * without a broker.
 *
 * API: job_init -> (job_set_body, fill facts) -> job_decode -> job_reset ...
 *      -> job_destroy.
 */
#ifndef IDEMQ_JOB_H
#define IDEMQ_JOB_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "conf.h"
#include "idemq_err.h"
#include "trace.h"

#define JOB_SHORTSTR 256 /* AMQP short strings hold at most 255 bytes */

struct job {
    /* delivery facts, filled by the transport */
    uint64_t tag;
    bool redelivered;
    int delivery_count; /* x-delivery-count of quorum queues; -1 if absent */
    int acquired_count; /* x-acquired-count (RabbitMQ 4.3: every hand-out); -1 if absent
                         * or not a sane integer. Recorded, never used for control:
                         * on a classic queue a producer can set it */
    int input;          /* index into conf->inputs */
    long long received_ns; /* CLOCK_MONOTONIC when the worker took it */
    char exchange[JOB_SHORTSTR];
    char routing_key[JOB_SHORTSTR];
    char message_id[JOB_SHORTSTR];
    bool has_message_id;
    json_t *headers; /* object, owned; never NULL after job_init */
    json_t *props;   /* other AMQP properties as an object, owned */
    unsigned char *body;
    size_t body_len;    /* bytes held in body (all of it, or a prefix) */
    size_t body_cap;
    uint64_t body_size; /* size on the wire (content header); body_len when set
                         * by job_set_body */
    /* what the transport could not take (set before job_decode): a delivery
     * the client library could not decode, a body over max_body_bytes (only
     * a prefix is kept), headers over the table limits (truncated) */
    idemq_err_t wire_err;
    char wire_reason[160];
    /* decoding results */
    char sha256_hex[65]; /* of the whole raw body: set by the transport while
                          * it streams the body, else by job_decode */
    idemq_err_t decode_err;
    bool has_key;
    char key[CONF_KEY_MAX_BYTES + 1];
    char reason[256];
    /* ordered lanes: set by the transport / the deferred store, then decode */
    int lane;               /* partition of an ordered input's delivery; -1 if none */
    long long deferred_id;  /* > 0: taken from idemq.deferred (no delivery, tag 0) */
    bool has_order_key;
    char order_key[CONF_KEY_MAX_BYTES + 1];
    bool has_seq;
    long long seq;          /* sequence_source value, >= 1 */
    /* Celery inputs: set by celery_decode (adapters/celery.h) */
    int effect;             /* effect index of its task route, or -1: the input's own */
    char *payload;          /* the effect's payload when it is not the body (owned) */
    size_t payload_len;
    char *meta_extra;       /* JSON object text added to meta as "celery" (owned) */
    long hold_ms;           /* > 0: held on the broker this long first (eta/countdown) */
    bool reply;             /* answer reply_to once settled (rpc:// results) */
    int celery_err;         /* a Celery decode failure (idemq_err_t), also when the
                             * job is parked for another reason; answered as FAILURE */
    char task_id[JOB_SHORTSTR];
    char reply_to[JOB_SHORTSTR];
    char correlation_id[JOB_SHORTSTR];
    /* the producer's trace context and idemq's span (set by job_decode) */
    struct trace_job trace;
};

/* Prepares an empty job. Cannot fail: buffers are allocated on demand. */
void job_init(struct job *j);

/* Clears per-delivery data, keeping the body buffer for reuse. */
void job_reset(struct job *j);

/* Releases everything the job owns. */
void job_destroy(struct job *j);

/* Copies the body in, growing the reusable buffer if needed; body_size
 * becomes len. Returns IDEMQ_ERR_NOMEM (job unchanged) or IDEMQ_OK. */
idemq_err_t job_set_body(struct job *j, const void *data, size_t len) IDEMQ_MUSTCHECK;

/* Makes room for at least cap body bytes (the body is kept NUL-terminated
 * after its last byte). IDEMQ_ERR_NOMEM or IDEMQ_OK. */
idemq_err_t job_reserve_body(struct job *j, size_t cap) IDEMQ_MUSTCHECK;

/* Appends to the body within the reserved room (job_reserve_body); bytes
 * beyond it are not kept. Returns how many were kept. */
size_t job_append_body(struct job *j, const void *data, size_t len);

/* Sets sha256_hex from a 32-byte digest (the transport hashes the whole
 * body while it streams it). */
void job_set_digest(struct job *j, const unsigned char md[32]);

/*
 * Checks the body and extracts the key per input. A transport failure
 * (wire_err) comes first; then the body: its size (body_size against
 * max_body_bytes), strict JSON (invalid UTF-8, NUL escapes and duplicate
 * field names are refused) that must be an object (and, for inputs with
 * order_key_source / sequence_source, the ordering key and the sequence:
 * a missing one is a permanent decode error). Sets j->decode_err (and
 * returns it): IDEMQ_OK, or a permanent decode error with j->reason
 * explaining it. The key is extracted whenever it can be (even when the body
 * is bad), so a parked message keeps its key if it has one. Last, the
 * redrive headers (seal_check_headers): an x-idemq-generation without
 * idemq's seal is IDEMQ_ERR_FORGED_REDRIVE, and an unsealed
 * x-idemq-redriven-by is removed from j->headers. Pure but for the
 * process's seal secret.
 */
idemq_err_t job_decode(struct job *j, const struct conf_input *in);

/* The key rules of the message contract applied to v (a string or an
 * integer; NULL is missing): sets j->key/has_key, or returns the decode
 * error with j->reason naming `what`. Pure. */
idemq_err_t job_take_key(struct job *j, const json_t *v, const char *what);

/* A producer's AMQP timestamp counts only from 2000-01-01T00:00:00Z to
 * JOB_TIMESTAMP_FUTURE_S ahead of this host's clock. */
#define JOB_TIMESTAMP_MIN 946684800LL
#define JOB_TIMESTAMP_FUTURE_S 600

/*
 * The message's AMQP timestamp (seconds since the epoch, props.timestamp)
 * if it is plausible at time now: true and *ts set. 0 (many libraries'
 * "unset"), anything before 2000, more than JOB_TIMESTAMP_FUTURE_S ahead,
 * or 2^63 and more (kept as the same 64 bits, so read back negative) is no
 * timestamp: false. Pure.
 */
bool job_timestamp(const struct job *j, long long now, long long *ts);

/* Age in seconds (>= 0) of j by a plausible timestamp at time now, or -1
 * when it has none. Never overflows. Pure. */
long long job_age_s(const struct job *j, long long now);

/* Length (1-4) of the valid UTF-8 sequence at s[0..n) (n >= 1), or 0 if the
 * bytes there are not one: NUL, overlong forms, surrogates and code points
 * above U+10FFFF are not. Pure. */
size_t job_utf8_seq(const unsigned char *s, size_t n);

/* True if s[0..n) is valid UTF-8 without NUL bytes. */
bool job_utf8_valid(const unsigned char *s, size_t n);

/* Replaces, in place, every byte of s that is not part of valid UTF-8 with
 * '?', so the text can go into JSON and PostgreSQL (exchange and routing
 * key are any bytes on the wire). */
void job_utf8_sanitize(char *s);

#endif
