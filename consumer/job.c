/*
 * job: decoding of one delivery into a job: body limits, JSON object check,
 * idempotency key extraction. Every bad input becomes a named decode error
 * with a reason; nothing here crashes on hostile bytes.
 */
#include "job.h"

#include "trace_export.h"

#include "celery.h"
#include "seal.h"

#include <inttypes.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "topology.h"

void job_init(struct job *j)
{
    memset(j, 0, sizeof *j);
    j->delivery_count = -1;
    j->acquired_count = -1;
    j->lane = -1;
    j->effect = -1;
    j->headers = json_object();
    j->props = json_object();
}

void job_reset(struct job *j)
{
    unsigned char *body = j->body;
    size_t cap = j->body_cap;
    json_t *h = j->headers, *p = j->props;

    json_object_clear(h);
    json_object_clear(p);
    free(j->payload);
    free(j->meta_extra);
    memset(j, 0, sizeof *j);
    j->delivery_count = -1;
    j->acquired_count = -1;
    j->lane = -1;
    j->effect = -1;
    j->body = body;
    j->body_cap = cap;
    j->headers = h;
    j->props = p;
}

void job_destroy(struct job *j)
{
    free(j->body);
    free(j->payload);
    free(j->meta_extra);
    json_decref(j->headers);
    json_decref(j->props);
    memset(j, 0, sizeof *j);
}

idemq_err_t job_set_body(struct job *j, const void *data, size_t len)
{
    if (len + 1 > j->body_cap) {
        size_t cap = j->body_cap ? j->body_cap : 512;
        unsigned char *nb;
        while (cap < len + 1)
            cap *= 2;
        if (!(nb = realloc(j->body, cap)))
            return IDEMQ_ERR_NOMEM;
        j->body = nb;
        j->body_cap = cap;
    }
    if (len)
        memcpy(j->body, data, len);
    j->body[len] = '\0';
    j->body_len = len;
    j->body_size = len;
    j->sha256_hex[0] = '\0'; /* job_decode hashes this body */
    return IDEMQ_OK;
}

idemq_err_t job_reserve_body(struct job *j, size_t cap)
{
    if (cap + 1 > j->body_cap) {
        unsigned char *nb = realloc(j->body, cap + 1);
        if (!nb)
            return IDEMQ_ERR_NOMEM;
        j->body = nb;
        j->body_cap = cap + 1;
    }
    if (!j->body_len)
        j->body[0] = '\0';
    return IDEMQ_OK;
}

size_t job_append_body(struct job *j, const void *data, size_t len)
{
    size_t room = j->body_cap ? j->body_cap - 1 - j->body_len : 0;
    size_t n = len < room ? len : room;
    if (n) {
        memcpy(j->body + j->body_len, data, n);
        j->body_len += n;
        j->body[j->body_len] = '\0';
    }
    return n;
}

static void hex32(const unsigned char md[32], char out[65])
{
    static const char hex[] = "0123456789abcdef";
    for (unsigned int i = 0; i < 32; i++) {
        out[2 * i] = hex[md[i] >> 4];
        out[2 * i + 1] = hex[md[i] & 15];
    }
    out[64] = '\0';
}

void job_set_digest(struct job *j, const unsigned char md[32])
{
    hex32(md, j->sha256_hex);
}

size_t job_utf8_seq(const unsigned char *s, size_t n)
{
    unsigned char c = s[0];
    size_t extra;
    uint32_t cp;
    if (c == 0)
        return 0;
    if (c < 0x80)
        return 1;
    if ((c & 0xE0) == 0xC0)
        extra = 1, cp = c & 0x1F;
    else if ((c & 0xF0) == 0xE0)
        extra = 2, cp = c & 0x0F;
    else if ((c & 0xF8) == 0xF0)
        extra = 3, cp = c & 0x07;
    else
        return 0;
    if (extra >= n)
        return 0;
    for (size_t k = 1; k <= extra; k++) {
        if ((s[k] & 0xC0) != 0x80)
            return 0;
        cp = (cp << 6) | (s[k] & 0x3F);
    }
    if ((extra == 1 && cp < 0x80) || (extra == 2 && cp < 0x800) ||
        (extra == 3 && cp < 0x10000) || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
        return 0;
    return extra + 1;
}

bool job_utf8_valid(const unsigned char *s, size_t n)
{
    for (size_t i = 0, k; i < n; i += k)
        if (!(k = job_utf8_seq(s + i, n - i)))
            return false;
    return true;
}

bool job_timestamp(const struct job *j, long long now, long long *ts)
{
    json_t *v = json_object_get(j->props, "timestamp");
    long long t;
    if (!json_is_integer(v))
        return false;
    t = (long long)json_integer_value(v);
    /* now is a clock reading, far from LLONG_MAX: the sum cannot overflow */
    if (t < JOB_TIMESTAMP_MIN || t > now + JOB_TIMESTAMP_FUTURE_S)
        return false;
    *ts = t;
    return true;
}

long long job_age_s(const struct job *j, long long now)
{
    long long ts;
    if (!job_timestamp(j, now, &ts))
        return -1;
    return ts < now ? now - ts : 0; /* both within [2000, now + 600 s] */
}

void job_utf8_sanitize(char *s)
{
    size_t n = strlen(s);
    for (size_t i = 0, k; i < n; i += k) {
        if (!(k = job_utf8_seq((unsigned char *)s + i, n - i))) {
            s[i] = '?';
            k = 1;
        }
    }
}

/* Stores a key candidate, or returns the decode error that it is. */
static idemq_err_t take_text(struct job *j, const json_t *v, const char *what, char *dst,
                             bool *has)
{
    const char *s;
    size_t n;
    char num[32];

    if (!v) {
        snprintf(j->reason, sizeof j->reason, "%s is missing", what);
        return IDEMQ_ERR_KEY_MISSING;
    }
    if (json_is_null(v)) {
        snprintf(j->reason, sizeof j->reason, "%s is null", what);
        return IDEMQ_ERR_KEY_NULL;
    }
    if (json_is_integer(v)) {
        snprintf(num, sizeof num, "%" JSON_INTEGER_FORMAT, json_integer_value(v));
        s = num;
        n = strlen(num);
    } else if (json_is_string(v)) {
        s = json_string_value(v);
        n = json_string_length(v);
    } else {
        snprintf(j->reason, sizeof j->reason, "%s must be a string or an integer", what);
        return IDEMQ_ERR_KEY_INVALID;
    }
    if (n == 0) {
        snprintf(j->reason, sizeof j->reason, "%s is empty", what);
        return IDEMQ_ERR_KEY_EMPTY;
    }
    if (n > CONF_KEY_MAX_BYTES) {
        snprintf(j->reason, sizeof j->reason, "%s is %zu bytes long (at most %d)", what, n,
                 CONF_KEY_MAX_BYTES);
        return IDEMQ_ERR_KEY_TOO_LONG;
    }
    if (!job_utf8_valid((const unsigned char *)s, n)) {
        snprintf(j->reason, sizeof j->reason, "%s is not valid UTF-8 text", what);
        return IDEMQ_ERR_KEY_INVALID;
    }
    memcpy(dst, s, n);
    dst[n] = '\0';
    *has = true;
    return IDEMQ_OK;
}

static idemq_err_t take_key(struct job *j, const json_t *v, const char *what)
{
    return take_text(j, v, what, j->key, &j->has_key);
}

idemq_err_t job_take_key(struct job *j, const json_t *v, const char *what)
{
    return take_key(j, v, what);
}

/* Ordering key and sequence of an ordered input (body already an object). */
static idemq_err_t take_order(struct job *j, const struct conf_input *in, json_t *root)
{
    char what[320];
    const json_t *v = NULL;
    json_t *mid = NULL;
    idemq_err_t err;

    j->has_order_key = j->has_seq = false;
    if (!CONF_INPUT_ORDERED(in) || in->order_kind == CONF_KEY_NONE)
        return IDEMQ_OK;
    if (in->order_kind == CONF_KEY_JSON) {
        snprintf(what, sizeof what, "ordering key field %s", in->order_name);
        v = json_object_get(root, in->order_name);
    } else if (in->order_kind == CONF_KEY_HEADER) {
        snprintf(what, sizeof what, "ordering key header %s", in->order_name);
        v = json_object_get(j->headers, in->order_name);
    } else {
        snprintf(what, sizeof what, "ordering key (message_id property)");
        if (j->has_message_id)
            v = mid = json_string(j->message_id);
    }
    err = take_text(j, v, what, j->order_key, &j->has_order_key);
    json_decref(mid);
    if (err || !in->seq_name)
        return err;
    v = json_object_get(root, in->seq_name);
    if (!json_is_integer(v) || json_integer_value(v) < 1) {
        snprintf(j->reason, sizeof j->reason, "sequence field %s must be a positive integer",
                 in->seq_name);
        return IDEMQ_ERR_SEQUENCE_INVALID;
    }
    j->seq = (long long)json_integer_value(v);
    j->has_seq = true;
    return IDEMQ_OK;
}

/* Key from a header or the message_id property: the body is not needed. */
static idemq_err_t key_from_envelope(struct job *j, const struct conf_input *in)
{
    char what[300];
    if (in->key_kind == CONF_KEY_HEADER) {
        snprintf(what, sizeof what, "header %s", in->key_name);
        return take_key(j, json_object_get(j->headers, in->key_name), what);
    }
    if (!j->has_message_id)
        return take_key(j, NULL, "message_id property");
    if (!job_utf8_valid((const unsigned char *)j->message_id, strlen(j->message_id))) {
        snprintf(j->reason, sizeof j->reason, "message_id property is not valid UTF-8 text");
        return IDEMQ_ERR_KEY_INVALID;
    }
    json_t *v = json_string(j->message_id);
    idemq_err_t err = take_key(j, v, "message_id property");
    json_decref(v);
    return err;
}

/* SHA-256, fetched once per process: an implicit fetch by EVP_sha256()
 * on every digest costs more than hashing a small body. Never freed (it
 * stays reachable through this pointer). */
static EVP_MD *sha256_md;
static pthread_once_t sha256_once = PTHREAD_ONCE_INIT;

static void sha256_fetch(void) { sha256_md = EVP_MD_fetch(NULL, "SHA256", NULL); }

/* Writes the lowercase hex SHA-256 of body into out[65]; "" on failure. */
static void sha256_hex(const unsigned char *body, size_t len, char out[65])
{
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int mdlen = 0;

    out[0] = '\0';
    pthread_once(&sha256_once, sha256_fetch);
    if (EVP_Digest(body, len, md, &mdlen, sha256_md ? sha256_md : EVP_sha256(), NULL) != 1 ||
        mdlen != 32)
        return;
    hex32(md, out);
}

/*
 * The delivery limit when this is the last delivery it allows, else 0. A
 * quorum queue counts returns in x-delivery-count and, past its limit,
 * dead-letters the message or (declared by an older idemq: no dead-letter
 * exchange, and on RabbitMQ 4 a default limit of 20) drops it. Such a
 * delivery is parked rather than tried: trying it may be what returned it
 * every time, and one more return would lose it.
 */
static int last_allowed_delivery(const struct job *j, const struct conf_input *in)
{
    char q[TOPOLOGY_NAME_MAX];
    int limit = in->delivery_limit, broker;
    if (j->delivery_count < 0 || strcmp(in->queue_type, "quorum") != 0)
        return 0;
    if (j->lane >= 0)
        topology_partition_queue(in, j->lane, q, sizeof q);
    else
        snprintf(q, sizeof q, "%s", in->queue);
    broker = topology_broker_delivery_limit(q);
    if (broker > 0 && broker < limit)
        limit = broker;
    return j->delivery_count >= limit ? limit : 0;
}

/* Marks j's last allowed delivery to be parked (last_allowed_delivery). */
static void delivery_limit_park(struct job *j, int limit)
{
    snprintf(j->reason, sizeof j->reason,
             "returned %d times before (x-delivery-count %d), the queue's delivery limit %d: "
             "its last delivery is parked, not tried (past the limit the broker "
             "dead-letters or drops it)",
             j->delivery_count, j->delivery_count, limit);
    j->decode_err = IDEMQ_ERR_DELIVERY_LIMIT;
    j->celery_err = IDEMQ_OK;
}

idemq_err_t job_decode(struct job *j, const struct conf_input *in)
{
    json_error_t jerr;
    json_t *root = NULL;
    idemq_err_t body_err = IDEMQ_OK, key_err = IDEMQ_OK;
    char body_reason[sizeof j->reason] = "";
    const unsigned char *nul;
    int limit;

    j->has_key = false;
    j->key[0] = '\0';
    trace_job_begin(&j->trace, j->headers, trace_export_on());
    if (!j->sha256_hex[0])
        sha256_hex(j->body, j->body_len, j->sha256_hex);
    if (j->body_size < j->body_len)
        j->body_size = j->body_len;
    if (j->wire_err == IDEMQ_ERR_UNDECODABLE) { /* nothing of it can be trusted */
        snprintf(j->reason, sizeof j->reason, "%s", j->wire_reason);
        return j->decode_err = j->wire_err;
    }
    if (in->celery) { /* a Celery task message (adapters/celery.h) */
        struct timespec now;
        idemq_err_t err;
        clock_gettime(CLOCK_REALTIME, &now);
        err = celery_decode(j, in, (long long)now.tv_sec * 1000 + now.tv_nsec / 1000000);
        if ((err == IDEMQ_OK || err == IDEMQ_ERR_CELERY_EXPIRED) &&
            (limit = last_allowed_delivery(j, in)) > 0) /* as for every quorum input */
            delivery_limit_park(j, limit);
        return j->decode_err;
    }
    if (j->body_size > (uint64_t)in->max_body_bytes) {
        body_err = IDEMQ_ERR_BODY_TOO_LARGE;
        snprintf(body_reason, sizeof body_reason,
                 "body is %llu bytes, max_body_bytes is %d (a %zu-byte prefix is kept)",
                 (unsigned long long)j->body_size, in->max_body_bytes, j->body_len);
    } else if (j->body_len && (nul = memchr(j->body, 0, j->body_len)) != NULL) {
        /* JSON text never holds a raw NUL, yet jansson 2.14 skips one that
         * follows a number or a literal ({"n":1<NUL>} parses); the body
         * would then be cut at the NUL in the batch document, a C string. */
        body_err = IDEMQ_ERR_BAD_JSON;
        snprintf(body_reason, sizeof body_reason, "invalid JSON: a NUL byte at byte %zu",
                 (size_t)(nul - j->body));
    } else if (!(root = json_loadb((const char *)j->body, j->body_len,
                                   JSON_REJECT_DUPLICATES | JSON_DECODE_ANY, &jerr))) {
        body_err = json_error_code(&jerr) == json_error_duplicate_key ? IDEMQ_ERR_DUPLICATE_FIELD
                                                                      : IDEMQ_ERR_BAD_JSON;
        /* jansson quotes the token it stopped at ("near '...'"): a piece
         * of a body that cannot be masked by path (mask.h) */
        for (int k = 0; k < in->sensitive.n; k++)
            if (in->sensitive.v[k][0] && strstr(jerr.text, " near '"))
                *strstr(jerr.text, " near '") = '\0';
        snprintf(body_reason, sizeof body_reason, "%s at byte %d: %s",
                 body_err == IDEMQ_ERR_BAD_JSON ? "invalid JSON" : "duplicate field name",
                 jerr.position, jerr.text);
    } else if (!json_is_object(root)) {
        body_err = IDEMQ_ERR_NOT_OBJECT;
        snprintf(body_reason, sizeof body_reason, "body is JSON but not an object (%s)",
                 json_is_array(root)     ? "an array"
                 : json_is_string(root)  ? "a string"
                 : json_is_number(root)  ? "a number"
                 : json_is_boolean(root) ? "a boolean"
                                         : "null");
    }

    if (in->key_kind == CONF_KEY_JSON) {
        if (!body_err) {
            char what[300];
            snprintf(what, sizeof what, "field %s", in->key_name);
            key_err = take_key(j, json_object_get(root, in->key_name), what);
        }
    } else {
        key_err = key_from_envelope(j, in);
    }
    if (!body_err && !key_err)
        key_err = take_order(j, in, root);
    json_decref(root);

    if (j->wire_err && body_err != IDEMQ_ERR_BODY_TOO_LARGE) {
        /* headers over the limits: parked, with the key if the body had one */
        snprintf(j->reason, sizeof j->reason, "%s", j->wire_reason);
        j->decode_err = j->wire_err;
    } else if (body_err) {
        snprintf(j->reason, sizeof j->reason, "%s", body_reason);
        j->decode_err = body_err;
    } else if (!key_err && (limit = last_allowed_delivery(j, in)) > 0) {
        delivery_limit_park(j, limit);
    } else {
        j->decode_err = key_err;
    }
    /* A redrive must be idemq's or its operator's (seal.h): a claimed
     * generation without idemq's seal is parked, never applied. */
    if (j->decode_err == IDEMQ_OK && j->has_key &&
        !seal_check_headers(j->headers, j->key, j->reason, sizeof j->reason))
        j->decode_err = IDEMQ_ERR_FORGED_REDRIVE;
    return j->decode_err;
}
