/*
 * effect_http: the HTTP provider effect on libcurl's multi
 * interface. One engine per worker thread submits calls to the providers of
 * the provider inputs and is polled with a timeout, so the caller can keep
 * servicing its broker connection between polls. Every finished call comes
 * back classified into exactly one effect_http_class. The engine knows
 * nothing of the ledger: consumer/provider_flow.c decides what a class means
 * for a job.
 *
 * Every call of the CALL kind carries `Idempotency-Key: <business key>`; a key
 * that is not a valid header value is refused before anything is sent. The
 * credential header's value is read once, from an environment variable or a
 * file, and is never logged or put into an error text.
 *
 * API: effect_http_new -> [effect_http_key_check -> effect_http_build_body ->
 *      effect_http_submit(_within)]* + effect_http_poll ... ->
 *      effect_http_result_clear per result -> effect_http_free.
 * A submit starts sending at once; a call never outlives its budget.
 * Thread: an engine belongs to the thread that created it.
 */
#ifndef IDEMQ_EFFECT_HTTP_H
#define IDEMQ_EFFECT_HTTP_H

#include <stdbool.h>
#include <stddef.h>

#include "conf.h"
#include "idemq_err.h"

/* Answers longer than this are cut (body_truncated); a reference is then
 * still found when the cut text parses, else the answer is a bad one. */
#define EFFECT_HTTP_MAX_RESPONSE 65536

/* A Retry-After is never more than this (the ledger takes an int4 of ms). */
#define EFFECT_HTTP_RETRY_AFTER_MAX_MS 2147483647L

/* A bounded call (effect_http_submit_within) is refused, nothing sent,
 * when less than this is left of its budget. */
#define EFFECT_HTTP_MIN_CALL_MS 500

struct effect_http;

enum effect_http_op {
    EFFECT_HTTP_CALL = 0,   /* method url+path with the body and Idempotency-Key */
    EFFECT_HTTP_LOOKUP_KEY, /* GET url+lookup_key_path, {key} = the key */
    EFFECT_HTTP_LOOKUP_REF, /* GET url+lookup_reference_path, {key} = the key */
};

/* What a finished request came to. Exactly one per request. */
enum effect_http_class {
    EFFECT_HTTP_SUCCESS = 0,  /* 2xx: reference holds the configured field ("" if absent) */
    EFFECT_HTTP_PERMANENT,    /* 4xx other than 409 and 429 (lookups: and 404/410) */
    EFFECT_HTTP_CONFLICT,     /* 409: a request with this key is in progress */
    EFFECT_HTTP_RATE_LIMITED, /* 429: retry_after_ms holds Retry-After */
    EFFECT_HTTP_UNKNOWN,      /* sent, then timeout / reset / 5xx / transient-error: true /
                               * any other status: the provider may or may not have acted */
    EFFECT_HTTP_NOT_SENT,     /* nothing was sent: connect, DNS or TLS (handshake,
                               * certificate) failed; safe to send again */
    EFFECT_HTTP_NOT_FOUND,    /* lookups only: 404 or 410, the provider has no such charge */
};

struct effect_http_result {
    void *cookie;          /* as given to effect_http_submit */
    int input;             /* index into conf->inputs */
    enum effect_http_op op;
    enum effect_http_class cls;
    long status;           /* HTTP status; 0 when no answer arrived */
    long retry_after_ms;   /* Retry-After (seconds or HTTP date) in ms; -1 if absent */
    bool transient_header; /* the answer had transient-error: true */
    char reference[256];   /* SUCCESS: the provider reference, "" if the field is absent */
    char *body;            /* the answer, NUL-terminated (owned; effect_http_result_clear) */
    size_t body_len;
    bool body_truncated;
    long long elapsed_ms;
    char detail[256];      /* curl's error text or why the class was chosen */
};

/* Name of a class for logs and the ledger ("success", "unknown", ...). */
const char *effect_http_class_name(enum effect_http_class cls);

/*
 * Creates an engine for the provider inputs of c (c must outlive it): reads
 * each input's credential (provider.auth_env / auth_file) and checks that
 * provider.ca_file is readable. Returns IDEMQ_OK and *out, or
 * IDEMQ_ERR_CONFIG / IDEMQ_ERR_NOMEM with errbuf naming the input and the
 * setting (never the credential). Any thread; the engine then belongs to it.
 */
idemq_err_t effect_http_new(const struct conf *c, struct effect_http **out, char *errbuf,
                            size_t errlen) IDEMQ_MUSTCHECK;

/* Cancels the requests in flight (their results are dropped; what the
 * provider did with them is for the ledger to find out), wipes the
 * credentials and frees h. NULL is fine. */
void effect_http_free(struct effect_http *h);

/* IDEMQ_OK if key can travel as an Idempotency-Key header value: 1 to 255
 * bytes of visible ASCII (0x21-0x7e) and inner spaces; no control
 * characters, CR/LF, DEL or non-ASCII bytes, no blank at either end.
 * Otherwise IDEMQ_ERR_KEY_INVALID_HEADER. Pure. */
idemq_err_t effect_http_key_check(const char *key) IDEMQ_MUSTCHECK;

/*
 * Builds the request body of input in for key and payload[0..len) (the
 * message body, a JSON object): the payload as is when body_template is
 * empty, else the template with {{key}}, {{payload}} and {{payload.FIELD}}
 * (a top-level field, or null) written as JSON. *out receives a new
 * NUL-terminated string (caller frees) and *outlen its length. Returns
 * IDEMQ_OK, IDEMQ_ERR_BAD_JSON (a template needs fields and the payload does
 * not parse) or IDEMQ_ERR_NOMEM. Pure.
 */
idemq_err_t effect_http_build_body(const struct conf_input *in, const char *key,
                                   const void *payload, size_t len, char **out,
                                   size_t *outlen) IDEMQ_MUSTCHECK;

/* SHA-256 (hex) of what a CALL of input in sends: method, URL and body.
 * The ledger stores it with the intent. Pure. */
void effect_http_request_sha(const struct conf_input *in, const char *body, size_t len,
                             char out[65]);

/*
 * Starts one request of kind op for key on input (an index into
 * conf->inputs; a provider input). body/body_len (CALL only) are copied.
 * Returns IDEMQ_OK (the result comes from effect_http_poll with cookie), or,
 * with nothing sent: IDEMQ_ERR_KEY_INVALID_HEADER, IDEMQ_ERR_PROVIDER_BUSY
 * (provider.max_in_flight requests of this input are in flight),
 * IDEMQ_ERR_CONFIG (not a provider input, or no such lookup path) or
 * IDEMQ_ERR_NOMEM; errbuf says why. The engine's thread only.
 */
idemq_err_t effect_http_submit(struct effect_http *h, int input, enum effect_http_op op,
                               const char *key, const char *body, size_t body_len, void *cookie,
                               char *errbuf, size_t errlen) IDEMQ_MUSTCHECK;

/*
 * effect_http_submit for a request that must be over within budget_ms from
 * now (the lease that covers it, less a margin; < 0: provider.timeout_ms
 * alone): the transfer's timeout is the smaller of the two. The request
 * starts going out before this returns (the first transfer step runs here),
 * so a caller busy elsewhere does not delay it. When budget_ms is below
 * EFFECT_HTTP_MIN_CALL_MS nothing is sent and IDEMQ_ERR_TIMEOUT is
 * returned (the intent stays certain: not sent). Other returns as
 * effect_http_submit. The engine's thread only.
 */
idemq_err_t effect_http_submit_within(struct effect_http *h, int input, enum effect_http_op op,
                                      const char *key, const char *body, size_t body_len,
                                      void *cookie, long budget_ms, char *errbuf,
                                      size_t errlen) IDEMQ_MUSTCHECK;

/*
 * The class of a transfer that failed with libcurl code curl_code, from
 * what libcurl reports of it: pretransfer_us (CURLINFO_PRETRANSFER_TIME_T,
 * 0 when the transfer never began: no connection, no TLS session) and
 * request_size (CURLINFO_REQUEST_SIZE). EFFECT_HTTP_NOT_SENT only when
 * the transfer never began (a DNS, connect or TLS failure, a connect
 * timeout): nothing can have left; any failure once it began is
 * EFFECT_HTTP_UNKNOWN, whatever the code or the byte counters say (a first
 * write of 0 bytes leaves request_size at 0 while the rest goes out
 * later). Pure.
 */
enum effect_http_class effect_http_failure_class(int curl_code, long long pretransfer_us,
                                                 long request_size);

/*
 * A Retry-After header value in ms: delta-seconds, or an HTTP-date
 * (now_s = the current time(NULL)); a date in the past is 0. Clamped to
 * EFFECT_HTTP_RETRY_AFTER_MAX_MS however large. -1 if it is neither. Pure.
 */
long effect_http_retry_after_ms(const char *value, long long now_s);

/*
 * Drives the transfers for at most timeout_ms (0 = only what is ready now)
 * and writes up to max finished results to out, oldest first. Returns as
 * soon as one result is ready, and at once when nothing is in flight.
 * Returns the number of results written; each must be released with
 * effect_http_result_clear. The engine's thread only.
 */
int effect_http_poll(struct effect_http *h, int timeout_ms, struct effect_http_result *out,
                     int max);

/* Requests of input in flight (not yet returned by poll); input < 0: all. */
int effect_http_in_flight(const struct effect_http *h, int input);

/* The answer as JSON text for the ledger: {"status", "body" (the answer
 * parsed as JSON, else as a string, invalid UTF-8 replaced), "detail",
 * "class", "truncated", "elapsed_ms", "retry_after_ms", "transient_error"}.
 * Returns a new string (caller frees) or NULL on no memory. Pure. */
char *effect_http_answer_json(const struct effect_http_result *r);

/* Frees what a result owns and zeroes it. */
void effect_http_result_clear(struct effect_http_result *r);

#endif
