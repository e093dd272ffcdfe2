/*
 * delivery: content header and body frames -> struct job, within limits
 * (see delivery.h). The frames are read one by one rather than through
 * amqp_read_message, which would allocate whatever body size the content
 * header claims before reading a byte of it.
 */
#include "delivery.h"

#include <openssl/evp.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/time.h>

idemq_err_t delivery_reader_init(struct delivery_reader *r)
{
    memset(r, 0, sizeof *r);
    amqp_table_default_limits(&r->limits);
    r->md = EVP_MD_fetch(NULL, "SHA256", NULL);
    r->ctx = EVP_MD_CTX_new();
    if (!r->md || !r->ctx) {
        delivery_reader_free(r);
        return IDEMQ_ERR_NOMEM;
    }
    return IDEMQ_OK;
}

void delivery_reader_free(struct delivery_reader *r)
{
    EVP_MD_CTX_free(r->ctx);
    EVP_MD_free(r->md);
    r->ctx = r->md = NULL;
}

static void copy_short(char *dst, amqp_bytes_t s)
{
    size_t n = s.len < JOB_SHORTSTR - 1 ? s.len : JOB_SHORTSTR - 1;
    if (n)
        memcpy(dst, s.bytes, n);
    dst[n] = '\0';
}

/* Sets j->props[name] to the property's text (or hex form). */
static int prop(struct job *j, const char *name, amqp_bytes_t v)
{
    json_t *s = amqp_table_bytes_to_json(v);
    return s ? json_object_set_new(j->props, name, s) : -1;
}

idemq_err_t delivery_props_to_job(const amqp_basic_properties_t *p, struct job *j,
                                  const struct amqp_table_limits *lim)
{
    amqp_flags_t f = p->_flags;
    int rc = 0;
#define PROP_STR(flag, field)                                                                \
    if (f & (flag))                                                                          \
        rc |= prop(j, #field, p->field);
    PROP_STR(AMQP_BASIC_CONTENT_TYPE_FLAG, content_type)
    PROP_STR(AMQP_BASIC_CONTENT_ENCODING_FLAG, content_encoding)
    PROP_STR(AMQP_BASIC_CORRELATION_ID_FLAG, correlation_id)
    PROP_STR(AMQP_BASIC_REPLY_TO_FLAG, reply_to)
    PROP_STR(AMQP_BASIC_EXPIRATION_FLAG, expiration)
    PROP_STR(AMQP_BASIC_MESSAGE_ID_FLAG, message_id)
    PROP_STR(AMQP_BASIC_TYPE_FLAG, type)
    PROP_STR(AMQP_BASIC_USER_ID_FLAG, user_id)
    PROP_STR(AMQP_BASIC_APP_ID_FLAG, app_id)
#undef PROP_STR
    if (f & AMQP_BASIC_DELIVERY_MODE_FLAG)
        rc |= json_object_set_new(j->props, "delivery_mode", json_integer(p->delivery_mode));
    if (f & AMQP_BASIC_PRIORITY_FLAG)
        rc |= json_object_set_new(j->props, "priority", json_integer(p->priority));
    if (f & AMQP_BASIC_TIMESTAMP_FLAG) {
        /* The same 64 bits, as a signed value (json_int_t), so a copy carries
         * them unchanged; 2^63 and above read negative, which
         * job_timestamp takes as no timestamp. Converted without relying on
         * implementation-defined behaviour. */
        json_int_t ts = p->timestamp <= (uint64_t)INT64_MAX
                            ? (json_int_t)p->timestamp
                            : -(json_int_t)(UINT64_MAX - p->timestamp) - 1;
        rc |= json_object_set_new(j->props, "timestamp", json_integer(ts));
    }
    if (f & AMQP_BASIC_MESSAGE_ID_FLAG) {
        /* A message_id with NUL bytes cannot be a key; keep it invalid. */
        copy_short(j->message_id, p->message_id);
        j->has_message_id = true;
        if (p->message_id.len && memchr(p->message_id.bytes, 0, p->message_id.len))
            j->message_id[0] = '\xff', j->message_id[1] = '\0';
    }
    if (f & AMQP_BASIC_HEADERS_FLAG) {
        struct amqp_table_report rep;
        json_t *h = amqp_table_to_json(&p->headers, lim, &rep), *dc;
        if (!h)
            return IDEMQ_ERR_NOMEM;
        rc |= json_object_update(j->headers, h);
        json_decref(h);
        if (rep.err) {
            j->wire_err = rep.err;
            snprintf(j->wire_reason, sizeof j->wire_reason,
                     rep.err == IDEMQ_ERR_HEADERS_TOO_DEEP
                         ? "headers nest deeper than %d levels (kept truncated)"
                         : "headers exceed %d fields or %zu bytes (kept truncated)",
                     rep.err == IDEMQ_ERR_HEADERS_TOO_DEEP ? lim->max_depth : lim->max_fields,
                     lim->max_bytes);
        }
        dc = json_object_get(j->headers, "x-delivery-count");
        if (json_is_integer(dc) && json_integer_value(dc) >= 0 &&
            json_integer_value(dc) <= DELIVERY_COUNT_MAX)
            j->delivery_count = (int)json_integer_value(dc);
        /* 4.3's count of hand-outs: kept for the attempt's record only (a
         * producer can send any value under this name to a classic queue). */
        dc = json_object_get(j->headers, "x-acquired-count");
        if (json_is_integer(dc) && json_integer_value(dc) >= 0 &&
            json_integer_value(dc) <= DELIVERY_COUNT_MAX)
            j->acquired_count = (int)json_integer_value(dc);
    }
    return rc ? IDEMQ_ERR_NOMEM : IDEMQ_OK;
}

/* Library statuses that mean the connection itself failed; any other
 * failure while a content frame is decoded is the message's. */
static bool connection_failed(int rc)
{
    switch (rc) {
    case AMQP_STATUS_SOCKET_ERROR:
    case AMQP_STATUS_CONNECTION_CLOSED:
    case AMQP_STATUS_SOCKET_CLOSED:
    case AMQP_STATUS_HEARTBEAT_TIMEOUT:
    case AMQP_STATUS_TIMEOUT:
    case AMQP_STATUS_TIMER_FAILURE:
    case AMQP_STATUS_SSL_ERROR:
    case AMQP_STATUS_SSL_HOSTNAME_VERIFY_FAILED:
    case AMQP_STATUS_SSL_PEER_VERIFY_FAILED:
    case AMQP_STATUS_SSL_CONNECTION_FAILED:
    case AMQP_STATUS_TCP_ERROR:
        return true;
    default:
        return false;
    }
}

static int wait_frame(amqp_connection_state_t conn, amqp_frame_t *f, int timeout_ms)
{
    struct timeval tv = {timeout_ms / 1000, (timeout_ms % 1000) * 1000};
    return amqp_simple_wait_frame_noblock(conn, f, &tv);
}

idemq_err_t delivery_read(struct delivery_reader *r, amqp_connection_state_t conn,
                          amqp_channel_t ch, struct job *j, size_t max_body, int timeout_ms,
                          char *errbuf, size_t errlen)
{
    amqp_frame_t f;
    uint64_t size, got = 0;
    idemq_err_t err;
    int rc = wait_frame(conn, &f, timeout_ms);

    if (rc != AMQP_STATUS_OK) {
        if (connection_failed(rc)) {
            snprintf(errbuf, errlen, "reading a message: %s", amqp_error_string2(rc));
            return IDEMQ_ERR_BROKER;
        }
        snprintf(errbuf, errlen, "the client library cannot decode the message's properties "
                                 "(%s); the connection cannot read further",
                 amqp_error_string2(rc));
        if (j) {
            j->wire_err = IDEMQ_ERR_UNDECODABLE;
            snprintf(j->wire_reason, sizeof j->wire_reason,
                     "librabbitmq-c cannot decode the message's properties or headers (%s)",
                     amqp_error_string2(rc));
        }
        return IDEMQ_ERR_UNDECODABLE;
    }
    if (f.frame_type != AMQP_FRAME_HEADER || f.channel != ch) {
        snprintf(errbuf, errlen, "expected a content header on channel %u, got frame type %u on "
                                 "channel %u",
                 ch, f.frame_type, f.channel);
        return IDEMQ_ERR_BROKER;
    }
    size = f.payload.properties.body_size;
    if (j) {
        size_t keep = size <= max_body ? (size_t)size : DELIVERY_PREFIX_BYTES;
        if (keep > size)
            keep = (size_t)size;
        if ((err = delivery_props_to_job(f.payload.properties.decoded, j, &r->limits)) ||
            (err = job_reserve_body(j, keep))) {
            snprintf(errbuf, errlen, "out of memory reading a message");
            return err;
        }
        j->body_len = 0;
        j->body_size = size;
        if (EVP_DigestInit_ex(r->ctx, r->md, NULL) != 1) {
            snprintf(errbuf, errlen, "cannot start SHA-256");
            return IDEMQ_ERR_NOMEM;
        }
    }
    while (got < size) {
        rc = wait_frame(conn, &f, timeout_ms);
        if (rc != AMQP_STATUS_OK) {
            snprintf(errbuf, errlen, "reading a message body: %s", amqp_error_string2(rc));
            return IDEMQ_ERR_BROKER;
        }
        if (f.frame_type != AMQP_FRAME_BODY || f.channel != ch ||
            f.payload.body_fragment.len > size - got) {
            snprintf(errbuf, errlen, "broken message body framing (frame type %u, channel %u)",
                     f.frame_type, f.channel);
            return IDEMQ_ERR_BROKER;
        }
        got += f.payload.body_fragment.len;
        if (j) {
            job_append_body(j, f.payload.body_fragment.bytes, f.payload.body_fragment.len);
            if (EVP_DigestUpdate(r->ctx, f.payload.body_fragment.bytes,
                                 f.payload.body_fragment.len) != 1) {
                snprintf(errbuf, errlen, "SHA-256 failed");
                return IDEMQ_ERR_NOMEM;
            }
        }
    }
    if (j) {
        unsigned char md[EVP_MAX_MD_SIZE];
        unsigned int mdlen = 0;
        if (EVP_DigestFinal_ex(r->ctx, md, &mdlen) != 1 || mdlen != 32) {
            snprintf(errbuf, errlen, "SHA-256 failed");
            return IDEMQ_ERR_NOMEM;
        }
        job_set_digest(j, md);
    }
    return IDEMQ_OK;
}
