/*
 * broker: librabbitmq-c connection handling for idemq. All frames are read
 * through one pump (pump_frame) so deliveries, confirms, returns, blocked
 * notices and closes are handled in one place, whichever call is waiting.
 */
#include "broker.h"

#include <amqp.h>
#include <amqp_ssl_socket.h>
#include <amqp_tcp_socket.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>

#include "broker_tls.h"
#include "log.h"

#define CHANNEL 1
#define MAX_CONSUMERS 64

struct stash {
    struct stash *next;
    struct job job;
};

struct broker {
    amqp_connection_state_t conn;
    bool healthy;
    bool confirms;
    char err[512];
    /* consumers on the channel: tag -> input index */
    char tags[MAX_CONSUMERS][160];
    int tag_input[MAX_CONSUMERS];
    int tag_lane[MAX_CONSUMERS]; /* partition of an ordered input, or -1 */
    int n_tags;
    /* publisher confirms since the last wait */
    uint64_t published;    /* sequence number of the last publish */
    uint64_t confirmed;    /* every seq <= this is confirmed */
    bool confirm_failed;   /* a nack or a return since the last wait */
    /* deliveries read while waiting for something else */
    struct stash *stash_head, *stash_tail;
};

static void set_err(struct broker *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void set_err(struct broker *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(b->err, sizeof b->err, fmt, ap);
    va_end(ap);
}

const char *broker_error(const struct broker *b) { return b ? b->err : "no broker"; }

static amqp_bytes_t bytes(const char *s) { return amqp_cstring_bytes(s ? s : ""); }

/* Describes an RPC reply; returns true if it is a success. */
static bool reply_ok(struct broker *b, amqp_rpc_reply_t r, const char *what)
{
    switch (r.reply_type) {
    case AMQP_RESPONSE_NORMAL:
        return true;
    case AMQP_RESPONSE_NONE:
        set_err(b, "%s: missing RPC reply", what);
        break;
    case AMQP_RESPONSE_LIBRARY_EXCEPTION:
        set_err(b, "%s: %s", what, amqp_error_string2(r.library_error));
        b->healthy = false;
        break;
    case AMQP_RESPONSE_SERVER_EXCEPTION:
        if (r.reply.id == AMQP_CONNECTION_CLOSE_METHOD) {
            amqp_connection_close_t *m = r.reply.decoded;
            set_err(b, "%s: connection closed by broker: %u %.*s", what, m->reply_code,
                    (int)m->reply_text.len, (char *)m->reply_text.bytes);
            amqp_connection_close_ok_t ok = {0};
            amqp_send_method(b->conn, 0, AMQP_CONNECTION_CLOSE_OK_METHOD, &ok);
            b->healthy = false;
        } else if (r.reply.id == AMQP_CHANNEL_CLOSE_METHOD) {
            amqp_channel_close_t *m = r.reply.decoded;
            set_err(b, "%s: channel closed by broker: %u %.*s", what, m->reply_code,
                    (int)m->reply_text.len, (char *)m->reply_text.bytes);
            amqp_channel_close_ok_t ok = {0};
            amqp_send_method(b->conn, CHANNEL, AMQP_CHANNEL_CLOSE_OK_METHOD, &ok);
            b->healthy = false;
        } else {
            set_err(b, "%s: unexpected server method 0x%08x", what, r.reply.id);
            b->healthy = false;
        }
        break;
    }
    return false;
}

static idemq_err_t open_channel(struct broker *b)
{
    amqp_channel_open(b->conn, CHANNEL);
    if (!reply_ok(b, amqp_get_rpc_reply(b->conn), "channel.open"))
        return IDEMQ_ERR_BROKER;
    if (b->confirms) {
        amqp_confirm_select(b->conn, CHANNEL);
        if (!reply_ok(b, amqp_get_rpc_reply(b->conn), "confirm.select"))
            return IDEMQ_ERR_BROKER;
        b->published = b->confirmed = 0;
    }
    b->healthy = true;
    return IDEMQ_OK;
}

static idemq_err_t connect_url(struct broker *b, const struct conf *c, const char *url,
                               const char *conn_name)
{
    struct amqp_connection_info ci;
    char *copy = strdup(url);
    amqp_socket_t *sock;
    struct timeval tv = {c->connect_timeout_ms / 1000, (c->connect_timeout_ms % 1000) * 1000};
    amqp_table_entry_t cap_entries[4], prop_entries[2];
    amqp_table_t caps, props;
    idemq_err_t err = IDEMQ_ERR_BROKER;
    int rc;

    if (!copy) {
        set_err(b, "out of memory");
        return IDEMQ_ERR_NOMEM;
    }
    amqp_default_connection_info(&ci);
    if ((rc = amqp_parse_url(copy, &ci)) != AMQP_STATUS_OK) {
        set_err(b, "cannot parse broker URL: %s", amqp_error_string2(rc));
        goto out;
    }
    if (!(b->conn = amqp_new_connection())) {
        set_err(b, "out of memory");
        goto out;
    }
    if (ci.ssl) { /* broker.tls settings (issue 11) */
        if (!(sock = broker_tls_socket(b->conn, c, b->err, sizeof b->err)))
            goto out;
    } else if (!(sock = amqp_tcp_socket_new(b->conn))) {
        set_err(b, "cannot create socket");
        goto out;
    }
    if ((rc = amqp_socket_open_noblock(sock, ci.host, ci.port, &tv)) != AMQP_STATUS_OK) {
        char tls[sizeof b->err];
        set_err(b, "cannot connect to %s:%d: %s", ci.host, ci.port,
                ci.ssl ? broker_tls_explain(rc, ci.host, c, tls, sizeof tls)
                       : amqp_error_string2(rc));
        goto out;
    }
    cap_entries[0].key = amqp_cstring_bytes("connection.blocked");
    cap_entries[1].key = amqp_cstring_bytes("consumer_cancel_notify");
    cap_entries[2].key = amqp_cstring_bytes("publisher_confirms");
    cap_entries[3].key = amqp_cstring_bytes("basic.nack");
    for (int i = 0; i < 4; i++) {
        cap_entries[i].value.kind = AMQP_FIELD_KIND_BOOLEAN;
        cap_entries[i].value.value.boolean = 1;
    }
    caps.num_entries = 4;
    caps.entries = cap_entries;
    prop_entries[0].key = amqp_cstring_bytes("capabilities");
    prop_entries[0].value.kind = AMQP_FIELD_KIND_TABLE;
    prop_entries[0].value.value.table = caps;
    prop_entries[1].key = amqp_cstring_bytes("connection_name");
    prop_entries[1].value.kind = AMQP_FIELD_KIND_UTF8;
    prop_entries[1].value.value.bytes = amqp_cstring_bytes(conn_name);
    props.num_entries = 2;
    props.entries = prop_entries;
    if (!reply_ok(b,
                  amqp_login_with_properties(b->conn, c->vhost[0] ? c->vhost : ci.vhost, 0,
                                             AMQP_DEFAULT_FRAME_SIZE, c->heartbeat, &props,
                                             AMQP_SASL_METHOD_PLAIN, ci.user, ci.password),
                  "login")) {
        if (ci.ssl) /* e.g. a client certificate the broker wanted (TLS 1.3) */
            broker_tls_explain_login(c, b->err, sizeof b->err);
        goto out;
    }
    err = open_channel(b);
out:
    free(copy);
    if (err && b->conn) {
        amqp_destroy_connection(b->conn);
        b->conn = NULL;
    }
    return err;
}

idemq_err_t broker_open(const struct conf *c, const char *conn_name, bool confirms,
                        struct broker **out, char *errbuf, size_t errlen)
{
    struct broker *b = calloc(1, sizeof *b);
    idemq_err_t err = IDEMQ_ERR_BROKER;
    char red[512];

    *out = NULL;
    if (!b) {
        snprintf(errbuf, errlen, "out of memory");
        return IDEMQ_ERR_NOMEM;
    }
    b->confirms = confirms;
    for (int i = 0; i < c->urls.n; i++) {
        err = connect_url(b, c, c->urls.v[i], conn_name);
        if (err == IDEMQ_OK) {
            log_debug("connected to %s", conf_redact(c->urls.v[i], red, sizeof red));
            *out = b;
            return IDEMQ_OK;
        }
        log_warn("broker %s: %s", conf_redact(c->urls.v[i], red, sizeof red), b->err);
    }
    snprintf(errbuf, errlen, "no broker URL answered; last error: %s", b->err);
    free(b);
    return err == IDEMQ_ERR_NOMEM ? err : IDEMQ_ERR_BROKER;
}

void broker_close(struct broker *b)
{
    if (!b)
        return;
    while (b->stash_head) {
        struct stash *s = b->stash_head;
        b->stash_head = s->next;
        job_destroy(&s->job);
        free(s);
    }
    if (b->conn) {
        if (b->healthy) {
            amqp_channel_close(b->conn, CHANNEL, AMQP_REPLY_SUCCESS);
            amqp_connection_close(b->conn, AMQP_REPLY_SUCCESS);
        }
        amqp_destroy_connection(b->conn);
    }
    free(b);
}

/* ---- AMQP tables <-> JSON ---- */

static json_t *field_to_json(const amqp_field_value_t *v);

static json_t *table_to_json(const amqp_table_t *t)
{
    json_t *o = json_object();
    for (int i = 0; o && i < t->num_entries; i++) {
        char key[256];
        size_t n = t->entries[i].key.len < 255 ? t->entries[i].key.len : 255;
        memcpy(key, t->entries[i].key.bytes, n);
        key[n] = '\0';
        if (job_utf8_valid((unsigned char *)key, n))
            json_object_set_new(o, key, field_to_json(&t->entries[i].value));
    }
    return o;
}

static json_t *bytes_to_json(amqp_bytes_t b)
{
    if (job_utf8_valid(b.bytes, b.len))
        return json_stringn(b.bytes, b.len);
    /* Not text: keep it visible and unambiguous as hex. */
    char *hex = malloc(b.len * 2 + 1);
    json_t *o;
    if (!hex)
        return json_null();
    for (size_t i = 0; i < b.len; i++)
        snprintf(hex + 2 * i, 3, "%02x", ((unsigned char *)b.bytes)[i]);
    o = json_pack("{s:s}", "$bytes_hex", hex);
    free(hex);
    return o;
}

static json_t *field_to_json(const amqp_field_value_t *v)
{
    switch (v->kind) {
    case AMQP_FIELD_KIND_BOOLEAN: return json_boolean(v->value.boolean);
    case AMQP_FIELD_KIND_I8: return json_integer(v->value.i8);
    case AMQP_FIELD_KIND_U8: return json_integer(v->value.u8);
    case AMQP_FIELD_KIND_I16: return json_integer(v->value.i16);
    case AMQP_FIELD_KIND_U16: return json_integer(v->value.u16);
    case AMQP_FIELD_KIND_I32: return json_integer(v->value.i32);
    case AMQP_FIELD_KIND_U32: return json_integer(v->value.u32);
    case AMQP_FIELD_KIND_I64: return json_integer(v->value.i64);
    case AMQP_FIELD_KIND_U64: return json_integer((json_int_t)v->value.u64);
    case AMQP_FIELD_KIND_F32: return json_real(v->value.f32);
    case AMQP_FIELD_KIND_F64: return json_real(v->value.f64);
    case AMQP_FIELD_KIND_TIMESTAMP: return json_integer((json_int_t)v->value.u64);
    case AMQP_FIELD_KIND_DECIMAL:
        return json_pack("{s:i,s:I}", "decimals", v->value.decimal.decimals, "value",
                         (json_int_t)v->value.decimal.value);
    case AMQP_FIELD_KIND_UTF8:
    case AMQP_FIELD_KIND_BYTES: return bytes_to_json(v->value.bytes);
    case AMQP_FIELD_KIND_TABLE: return table_to_json(&v->value.table);
    case AMQP_FIELD_KIND_ARRAY: {
        json_t *a = json_array();
        for (int i = 0; a && i < v->value.array.num_entries; i++)
            json_array_append_new(a, field_to_json(&v->value.array.entries[i]));
        return a;
    }
    case AMQP_FIELD_KIND_VOID: return json_null();
    }
    return json_null();
}

static void copy_short(char *dst, amqp_bytes_t s)
{
    size_t n = s.len < JOB_SHORTSTR - 1 ? s.len : JOB_SHORTSTR - 1;
    memcpy(dst, s.bytes, n);
    dst[n] = '\0';
}

static void props_to_job(const amqp_basic_properties_t *p, struct job *j)
{
    amqp_flags_t f = p->_flags;
#define PROP_STR(flag, field)                                                                \
    if (f & (flag))                                                                          \
        json_object_set_new(j->props, #field, bytes_to_json(p->field));
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
        json_object_set_new(j->props, "delivery_mode", json_integer(p->delivery_mode));
    if (f & AMQP_BASIC_PRIORITY_FLAG)
        json_object_set_new(j->props, "priority", json_integer(p->priority));
    if (f & AMQP_BASIC_TIMESTAMP_FLAG)
        json_object_set_new(j->props, "timestamp", json_integer((json_int_t)p->timestamp));
    if (f & AMQP_BASIC_MESSAGE_ID_FLAG) {
        /* A message_id with NUL bytes cannot be a key; keep it invalid. */
        copy_short(j->message_id, p->message_id);
        j->has_message_id = true;
        if (memchr(p->message_id.bytes, 0, p->message_id.len))
            j->message_id[0] = '\xff', j->message_id[1] = '\0';
    }
    if (f & AMQP_BASIC_HEADERS_FLAG) {
        json_t *h = table_to_json(&p->headers);
        json_t *dc;
        if (h)
            json_object_update(j->headers, h);
        json_decref(h);
        dc = json_object_get(j->headers, "x-delivery-count");
        if (json_is_integer(dc))
            j->delivery_count = (int)json_integer_value(dc);
    }
}

/* Reads the content of the message whose method frame was just read. */
static idemq_err_t read_content(struct broker *b, amqp_channel_t ch, struct job *j)
{
    amqp_message_t msg;
    idemq_err_t err = IDEMQ_OK;

    if (!reply_ok(b, amqp_read_message(b->conn, ch, &msg, 0), "read message"))
        return IDEMQ_ERR_BROKER;
    if (j) {
        props_to_job(&msg.properties, j);
        err = job_set_body(j, msg.body.bytes, msg.body.len);
    }
    amqp_destroy_message(&msg);
    return err;
}

static int tag_index(const struct broker *b, amqp_bytes_t tag)
{
    for (int i = 0; i < b->n_tags; i++)
        if (strlen(b->tags[i]) == tag.len && memcmp(b->tags[i], tag.bytes, tag.len) == 0)
            return i;
    return -1;
}

static void note_confirm(struct broker *b, uint64_t tag, bool multiple, bool ack)
{
    (void)multiple; /* confirms arrive in order: the highest tag is enough */
    if (!ack)
        b->confirm_failed = true;
    if (tag > b->confirmed)
        b->confirmed = tag;
}

/*
 * Reads one frame (waiting up to *tv, NULL = forever) and handles it. A
 * delivery is written to j, or stashed when j is NULL. Returns IDEMQ_OK when
 * a delivery was written to j, IDEMQ_ERR_TIMEOUT when the frame was handled
 * but was no delivery for j (or nothing came), IDEMQ_ERR_BROKER on failure.
 */
static idemq_err_t pump_frame(struct broker *b, struct job *j, struct timeval *tv)
{
    amqp_frame_t frame;
    int rc;

    if (!b->healthy) {
        return IDEMQ_ERR_BROKER;
    }
    if (amqp_release_buffers_ok(b->conn))
        amqp_release_buffers(b->conn);
    rc = amqp_simple_wait_frame_noblock(b->conn, &frame, tv);
    if (rc == AMQP_STATUS_TIMEOUT)
        return IDEMQ_ERR_TIMEOUT;
    if (rc != AMQP_STATUS_OK) {
        set_err(b, "connection lost: %s", amqp_error_string2(rc));
        b->healthy = false;
        return IDEMQ_ERR_BROKER;
    }
    if (frame.frame_type != AMQP_FRAME_METHOD)
        return IDEMQ_ERR_TIMEOUT; /* stray content of a cancelled read */

    switch (frame.payload.method.id) {
    case AMQP_BASIC_DELIVER_METHOD: {
        amqp_basic_deliver_t *d = frame.payload.method.decoded;
        struct stash *s = NULL;
        struct job *dst = j;
        idemq_err_t err;
        if (!dst) {
            if (!(s = calloc(1, sizeof *s))) {
                set_err(b, "out of memory");
                b->healthy = false;
                return IDEMQ_ERR_BROKER;
            }
            job_init(&s->job);
            dst = &s->job;
        } else {
            job_reset(dst);
        }
        dst->tag = d->delivery_tag;
        dst->redelivered = d->redelivered;
        {
            int t = tag_index(b, d->consumer_tag);
            dst->input = t < 0 ? -1 : b->tag_input[t];
            dst->lane = t < 0 ? -1 : b->tag_lane[t];
        }
        copy_short(dst->exchange, d->exchange);
        copy_short(dst->routing_key, d->routing_key);
        job_utf8_sanitize(dst->exchange);
        job_utf8_sanitize(dst->routing_key);
        err = read_content(b, frame.channel, dst);
        if (err) {
            if (s) {
                job_destroy(&s->job);
                free(s);
            }
            if (err == IDEMQ_ERR_NOMEM) {
                set_err(b, "out of memory reading a delivery");
                b->healthy = false;
            }
            return IDEMQ_ERR_BROKER;
        }
        if (s) {
            if (b->stash_tail)
                b->stash_tail->next = s;
            else
                b->stash_head = s;
            b->stash_tail = s;
            return IDEMQ_ERR_TIMEOUT;
        }
        return IDEMQ_OK;
    }
    case AMQP_BASIC_ACK_METHOD: {
        amqp_basic_ack_t *a = frame.payload.method.decoded;
        note_confirm(b, a->delivery_tag, a->multiple, true);
        return IDEMQ_ERR_TIMEOUT;
    }
    case AMQP_BASIC_NACK_METHOD: {
        amqp_basic_nack_t *n = frame.payload.method.decoded;
        set_err(b, "broker nacked publish %llu", (unsigned long long)n->delivery_tag);
        note_confirm(b, n->delivery_tag, n->multiple, false);
        return IDEMQ_ERR_TIMEOUT;
    }
    case AMQP_BASIC_RETURN_METHOD: {
        amqp_basic_return_t *r = frame.payload.method.decoded;
        set_err(b, "message returned as unroutable: %u %.*s (exchange %.*s, key %.*s)",
                r->reply_code, (int)r->reply_text.len, (char *)r->reply_text.bytes,
                (int)r->exchange.len, (char *)r->exchange.bytes, (int)r->routing_key.len,
                (char *)r->routing_key.bytes);
        b->confirm_failed = true;
        if (read_content(b, frame.channel, NULL))
            return IDEMQ_ERR_BROKER;
        return IDEMQ_ERR_TIMEOUT;
    }
    case AMQP_CHANNEL_CLOSE_METHOD: {
        amqp_channel_close_t *m = frame.payload.method.decoded;
        amqp_channel_close_ok_t ok = {0};
        set_err(b, "channel closed by broker: %u %.*s", m->reply_code, (int)m->reply_text.len,
                (char *)m->reply_text.bytes);
        amqp_send_method(b->conn, frame.channel, AMQP_CHANNEL_CLOSE_OK_METHOD, &ok);
        b->healthy = false;
        return IDEMQ_ERR_BROKER;
    }
    case AMQP_CONNECTION_CLOSE_METHOD: {
        amqp_connection_close_t *m = frame.payload.method.decoded;
        amqp_connection_close_ok_t ok = {0};
        set_err(b, "connection closed by broker: %u %.*s", m->reply_code,
                (int)m->reply_text.len, (char *)m->reply_text.bytes);
        amqp_send_method(b->conn, 0, AMQP_CONNECTION_CLOSE_OK_METHOD, &ok);
        b->healthy = false;
        return IDEMQ_ERR_BROKER;
    }
    case AMQP_BASIC_CANCEL_METHOD: {
        amqp_basic_cancel_t *m = frame.payload.method.decoded;
        set_err(b, "broker cancelled consumer %.*s (queue deleted or failed over)",
                (int)m->consumer_tag.len, (char *)m->consumer_tag.bytes);
        b->healthy = false;
        return IDEMQ_ERR_BROKER;
    }
    case AMQP_CONNECTION_BLOCKED_METHOD:
        log_warn("broker blocked this connection (resource alarm): publishes will wait");
        return IDEMQ_ERR_TIMEOUT;
    case AMQP_CONNECTION_UNBLOCKED_METHOD:
        log_info("broker unblocked this connection");
        return IDEMQ_ERR_TIMEOUT;
    default:
        log_debug("ignoring AMQP method 0x%08x", frame.payload.method.id);
        return IDEMQ_ERR_TIMEOUT;
    }
}

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

idemq_err_t broker_next(struct broker *b, struct job *j, int timeout_ms)
{
    long long deadline = now_ms() + timeout_ms;

    if (b->stash_head) {
        struct stash *s = b->stash_head;
        struct job tmp = *j;
        b->stash_head = s->next;
        if (!b->stash_head)
            b->stash_tail = NULL;
        *j = s->job; /* hand the stashed job over; its old buffers go */
        job_destroy(&tmp);
        free(s);
        return IDEMQ_OK;
    }
    for (;;) {
        long long left = deadline - now_ms();
        struct timeval tv;
        idemq_err_t err;
        if (left < 0)
            left = 0;
        tv.tv_sec = left / 1000;
        tv.tv_usec = (left % 1000) * 1000;
        err = pump_frame(b, j, &tv);
        if (err != IDEMQ_ERR_TIMEOUT || left == 0)
            return err;
    }
}

idemq_err_t broker_service(struct broker *b, int ms)
{
    long long deadline = now_ms() + ms;
    for (;;) {
        long long left = deadline - now_ms();
        struct timeval tv;
        if (left <= 0)
            return IDEMQ_OK;
        tv.tv_sec = left / 1000;
        tv.tv_usec = (left % 1000) * 1000;
        if (pump_frame(b, NULL, &tv) == IDEMQ_ERR_BROKER)
            return IDEMQ_ERR_BROKER;
    }
}

static idemq_err_t check_rc(struct broker *b, int rc, const char *what)
{
    if (rc == AMQP_STATUS_OK)
        return IDEMQ_OK;
    set_err(b, "%s: %s", what, amqp_error_string2(rc));
    b->healthy = false;
    return IDEMQ_ERR_BROKER;
}

idemq_err_t broker_ack(struct broker *b, uint64_t tag, bool multiple)
{
    if (!b->healthy)
        return IDEMQ_ERR_BROKER;
    return check_rc(b, amqp_basic_ack(b->conn, CHANNEL, tag, multiple), "basic.ack");
}

idemq_err_t broker_nack(struct broker *b, uint64_t tag, bool requeue)
{
    if (!b->healthy)
        return IDEMQ_ERR_BROKER;
    return check_rc(b, amqp_basic_nack(b->conn, CHANNEL, tag, 0, requeue), "basic.nack");
}

idemq_err_t broker_qos(struct broker *b, int prefetch)
{
    amqp_basic_qos(b->conn, CHANNEL, 0, (uint16_t)prefetch, 0);
    return reply_ok(b, amqp_get_rpc_reply(b->conn), "basic.qos") ? IDEMQ_OK : IDEMQ_ERR_BROKER;
}

/* After a channel-level error (e.g. 404 on a passive declare) reopen. */
static idemq_err_t recover_channel(struct broker *b);

/* Keeps the failure text while the channel is reopened. */
static idemq_err_t fail_keep(struct broker *b)
{
    char keep[sizeof b->err];
    memcpy(keep, b->err, sizeof keep);
    if (recover_channel(b) == IDEMQ_OK)
        memcpy(b->err, keep, sizeof keep);
    return IDEMQ_ERR_BROKER;
}

static int json_to_field(json_t *v, amqp_field_value_t *f, amqp_pool_t *pool);

/* JSON object -> AMQP table allocated in pool (strings point into v). */
static int json_to_table(json_t *v, amqp_table_t *t, amqp_pool_t *pool)
{
    amqp_field_value_t f;
    t->num_entries = 0;
    t->entries = NULL;
    if (!v || !json_object_size(v))
        return 0;
    if (json_to_field(v, &f, pool))
        return -1;
    *t = f.value.table;
    return 0;
}

/* The declare/bind RPCs that take an arguments table, in one place. */
enum table_rpc { RPC_EXCHANGE, RPC_QUEUE, RPC_BIND };

static idemq_err_t table_rpc(struct broker *b, enum table_rpc rpc, const char *name,
                             const char *other, const char *key, bool passive, json_t *args)
{
    char what[600];
    amqp_pool_t pool;
    amqp_table_t t;
    bool ok;

    init_amqp_pool(&pool, 1024);
    if (json_to_table(args, &t, &pool)) {
        empty_amqp_pool(&pool);
        set_err(b, "out of memory");
        return IDEMQ_ERR_NOMEM;
    }
    switch (rpc) {
    case RPC_EXCHANGE: /* other = exchange type */
        amqp_exchange_declare(b->conn, CHANNEL, bytes(name), bytes(other), passive, 1, 0, 0, t);
        snprintf(what, sizeof what, "%s exchange %s", passive ? "check" : "declare", name);
        break;
    case RPC_QUEUE:
        amqp_queue_declare(b->conn, CHANNEL, bytes(name), passive, 1, 0, 0, t);
        snprintf(what, sizeof what, "%s queue %s", passive ? "check" : "declare", name);
        break;
    case RPC_BIND: /* other = exchange */
        amqp_queue_bind(b->conn, CHANNEL, bytes(name), bytes(other), bytes(key), t);
        snprintf(what, sizeof what, "bind queue %s to %s (key %s)", name, other, key);
        break;
    }
    ok = reply_ok(b, amqp_get_rpc_reply(b->conn), what);
    empty_amqp_pool(&pool);
    return ok ? IDEMQ_OK : fail_keep(b);
}

idemq_err_t broker_declare_exchange(struct broker *b, const char *name, const char *type,
                                    bool passive, json_t *args)
{
    return table_rpc(b, RPC_EXCHANGE, name, type, NULL, passive, args);
}

idemq_err_t broker_declare_queue(struct broker *b, const char *name, json_t *args, bool passive)
{
    return table_rpc(b, RPC_QUEUE, name, NULL, NULL, passive, args);
}

idemq_err_t broker_bind(struct broker *b, const char *queue, const char *exchange,
                        const char *key, json_t *args)
{
    return table_rpc(b, RPC_BIND, queue, exchange, key, false, args);
}

idemq_err_t broker_unbind(struct broker *b, const char *queue, const char *exchange,
                          const char *key)
{
    char what[600];
    amqp_queue_unbind(b->conn, CHANNEL, bytes(queue), bytes(exchange), bytes(key),
                      amqp_empty_table);
    snprintf(what, sizeof what, "unbind queue %s from %s (key %s)", queue, exchange, key);
    return reply_ok(b, amqp_get_rpc_reply(b->conn), what) ? IDEMQ_OK : fail_keep(b);
}

static idemq_err_t consume(struct broker *b, int input_idx, int lane, const char *queue,
                           const char *tag)
{
    char what[300];
    if (b->n_tags >= MAX_CONSUMERS) {
        set_err(b, "too many consumers on one channel");
        return IDEMQ_ERR_BROKER;
    }
    snprintf(b->tags[b->n_tags], sizeof b->tags[0], "%s", tag);
    amqp_basic_consume(b->conn, CHANNEL, bytes(queue), bytes(b->tags[b->n_tags]), 0, 0, 0,
                       amqp_empty_table);
    snprintf(what, sizeof what, "consume queue %s", queue);
    if (!reply_ok(b, amqp_get_rpc_reply(b->conn), what))
        return IDEMQ_ERR_BROKER;
    b->tag_input[b->n_tags] = input_idx;
    b->tag_lane[b->n_tags++] = lane;
    return IDEMQ_OK;
}

idemq_err_t broker_consume(struct broker *b, int input_idx, const struct conf_input *in,
                           const char *consumer_id)
{
    char tag[160];
    snprintf(tag, sizeof tag, "idemq/%s/%s", in->name, consumer_id);
    return consume(b, input_idx, -1, in->queue, tag);
}

idemq_err_t broker_consume_lane(struct broker *b, int input_idx, int lane, const char *queue,
                                const struct conf_input *in, const char *consumer_id)
{
    char tag[160];
    snprintf(tag, sizeof tag, "idemq/%s/p%d/%s", in->name, lane, consumer_id);
    return consume(b, input_idx, lane, queue, tag);
}

/* JSON -> AMQP field; strings and bytes point into the JSON (kept alive by
 * the caller until the publish returns); nested tables use the pool. */
static int json_to_field(json_t *v, amqp_field_value_t *f, amqp_pool_t *pool)
{
    if (json_is_string(v)) {
        f->kind = AMQP_FIELD_KIND_UTF8;
        f->value.bytes.bytes = (void *)json_string_value(v);
        f->value.bytes.len = json_string_length(v);
    } else if (json_is_integer(v)) {
        f->kind = AMQP_FIELD_KIND_I64;
        f->value.i64 = json_integer_value(v);
    } else if (json_is_boolean(v)) {
        f->kind = AMQP_FIELD_KIND_BOOLEAN;
        f->value.boolean = json_is_true(v);
    } else if (json_is_real(v)) {
        f->kind = AMQP_FIELD_KIND_F64;
        f->value.f64 = json_real_value(v);
    } else if (json_is_object(v)) {
        const char *k;
        json_t *e;
        int i = 0;
        f->kind = AMQP_FIELD_KIND_TABLE;
        f->value.table.num_entries = (int)json_object_size(v);
        f->value.table.entries =
            amqp_pool_alloc(pool, sizeof(amqp_table_entry_t) * json_object_size(v) + 1);
        if (!f->value.table.entries)
            return -1;
        json_object_foreach(v, k, e)
        {
            f->value.table.entries[i].key = amqp_cstring_bytes(k);
            if (json_to_field(e, &f->value.table.entries[i].value, pool))
                return -1;
            i++;
        }
    } else if (json_is_array(v)) {
        size_t n = json_array_size(v);
        f->kind = AMQP_FIELD_KIND_ARRAY;
        f->value.array.num_entries = (int)n;
        f->value.array.entries = amqp_pool_alloc(pool, sizeof(amqp_field_value_t) * n + 1);
        if (!f->value.array.entries)
            return -1;
        for (size_t i = 0; i < n; i++)
            if (json_to_field(json_array_get(v, i), &f->value.array.entries[i], pool))
                return -1;
    } else {
        f->kind = AMQP_FIELD_KIND_VOID;
    }
    return 0;
}

/* Copies the carried-over properties of a received message (strings point
 * into orig, which the caller keeps alive until the publish returns). */
static void carry_props(json_t *orig, amqp_basic_properties_t *p)
{
#define CARRY_STR(flag, field)                                                               \
    do {                                                                                     \
        json_t *v = json_object_get(orig, #field);                                           \
        if (json_is_string(v)) {                                                             \
            p->_flags |= (flag);                                                             \
            p->field = amqp_cstring_bytes(json_string_value(v));                             \
        }                                                                                    \
    } while (0)
    CARRY_STR(AMQP_BASIC_CONTENT_TYPE_FLAG, content_type);
    CARRY_STR(AMQP_BASIC_CONTENT_ENCODING_FLAG, content_encoding);
    CARRY_STR(AMQP_BASIC_CORRELATION_ID_FLAG, correlation_id);
    CARRY_STR(AMQP_BASIC_REPLY_TO_FLAG, reply_to);
    CARRY_STR(AMQP_BASIC_MESSAGE_ID_FLAG, message_id);
    CARRY_STR(AMQP_BASIC_TYPE_FLAG, type);
    CARRY_STR(AMQP_BASIC_APP_ID_FLAG, app_id);
#undef CARRY_STR
    if (json_is_integer(json_object_get(orig, "timestamp"))) {
        p->_flags |= AMQP_BASIC_TIMESTAMP_FLAG;
        p->timestamp = (uint64_t)json_integer_value(json_object_get(orig, "timestamp"));
    }
    if (json_is_integer(json_object_get(orig, "priority"))) {
        p->_flags |= AMQP_BASIC_PRIORITY_FLAG;
        p->priority = (uint8_t)json_integer_value(json_object_get(orig, "priority"));
    }
}

idemq_err_t broker_publish(struct broker *b, const char *exchange, const char *routing_key,
                           const void *body, size_t len, const struct broker_props *props)
{
    amqp_basic_properties_t p;
    amqp_pool_t pool;
    amqp_bytes_t data = {len, (void *)body};
    int rc;

    if (!b->healthy)
        return IDEMQ_ERR_BROKER;
    if (!b->confirms) {
        set_err(b, "publish needs a connection opened with confirms");
        return IDEMQ_ERR_INTERNAL;
    }
    memset(&p, 0, sizeof p);
    init_amqp_pool(&pool, 4096);
    if (props && props->original)
        carry_props(props->original, &p);
    p._flags |= AMQP_BASIC_DELIVERY_MODE_FLAG;
    p.delivery_mode = (props && !props->persistent) ? 1 : 2;
    if (props && props->message_id) {
        p._flags |= AMQP_BASIC_MESSAGE_ID_FLAG;
        p.message_id = amqp_cstring_bytes(props->message_id);
    }
    if (props && props->content_type) {
        p._flags |= AMQP_BASIC_CONTENT_TYPE_FLAG;
        p.content_type = amqp_cstring_bytes(props->content_type);
    } else if (!(p._flags & AMQP_BASIC_CONTENT_TYPE_FLAG)) {
        p._flags |= AMQP_BASIC_CONTENT_TYPE_FLAG;
        p.content_type = amqp_cstring_bytes("application/json");
    }
    if (props && props->expiration) {
        p._flags |= AMQP_BASIC_EXPIRATION_FLAG;
        p.expiration = amqp_cstring_bytes(props->expiration);
    }
    if (props && props->headers && json_object_size(props->headers)) {
        amqp_field_value_t f;
        if (json_to_field(props->headers, &f, &pool)) {
            empty_amqp_pool(&pool);
            set_err(b, "out of memory building headers");
            return IDEMQ_ERR_NOMEM;
        }
        p._flags |= AMQP_BASIC_HEADERS_FLAG;
        p.headers = f.value.table;
    }
    rc = amqp_basic_publish(b->conn, CHANNEL, bytes(exchange), bytes(routing_key), 1, 0, &p,
                            data);
    empty_amqp_pool(&pool);
    if (check_rc(b, rc, "basic.publish"))
        return IDEMQ_ERR_BROKER;
    b->published++;
    return IDEMQ_OK;
}

idemq_err_t broker_wait_confirms(struct broker *b, int timeout_ms)
{
    long long deadline = now_ms() + timeout_ms;
    idemq_err_t err = IDEMQ_OK;

    while (b->confirmed < b->published) {
        long long left = deadline - now_ms();
        struct timeval tv;
        if (left <= 0) {
            set_err(b, "%llu publishes not confirmed within %d ms",
                    (unsigned long long)(b->published - b->confirmed), timeout_ms);
            return IDEMQ_ERR_TIMEOUT;
        }
        tv.tv_sec = left / 1000;
        tv.tv_usec = (left % 1000) * 1000;
        err = pump_frame(b, NULL, &tv);
        if (err == IDEMQ_ERR_BROKER)
            return err;
    }
    if (b->confirm_failed) {
        b->confirm_failed = false;
        return IDEMQ_ERR_BROKER;
    }
    return IDEMQ_OK;
}

static idemq_err_t recover_channel(struct broker *b)
{
    if (!b->conn)
        return IDEMQ_ERR_BROKER;
    return open_channel(b);
}

idemq_err_t broker_queue_counts(struct broker *b, const char *queue, uint32_t *messages,
                                uint32_t *consumers)
{
    amqp_queue_declare_ok_t *ok =
        amqp_queue_declare(b->conn, CHANNEL, bytes(queue), 1, 0, 0, 0, amqp_empty_table);
    if (!reply_ok(b, amqp_get_rpc_reply(b->conn), "passive declare"))
        return fail_keep(b);
    if (messages)
        *messages = ok->message_count;
    if (consumers)
        *consumers = ok->consumer_count;
    return IDEMQ_OK;
}

idemq_err_t broker_get(struct broker *b, const char *queue, struct job *j, bool ack)
{
    amqp_rpc_reply_t r = amqp_basic_get(b->conn, CHANNEL, bytes(queue), ack);
    amqp_basic_get_ok_t *ok;
    if (!reply_ok(b, r, "basic.get"))
        return IDEMQ_ERR_BROKER;
    if (r.reply.id == AMQP_BASIC_GET_EMPTY_METHOD)
        return IDEMQ_ERR_TIMEOUT;
    ok = r.reply.decoded;
    job_reset(j);
    j->tag = ok->delivery_tag;
    j->redelivered = ok->redelivered;
    copy_short(j->exchange, ok->exchange);
    copy_short(j->routing_key, ok->routing_key);
    job_utf8_sanitize(j->exchange);
    job_utf8_sanitize(j->routing_key);
    return read_content(b, CHANNEL, j);
}

idemq_err_t broker_purge(struct broker *b, const char *queue)
{
    amqp_queue_purge(b->conn, CHANNEL, bytes(queue));
    return reply_ok(b, amqp_get_rpc_reply(b->conn), "queue.purge") ? IDEMQ_OK : IDEMQ_ERR_BROKER;
}

idemq_err_t broker_delete_queue(struct broker *b, const char *queue)
{
    amqp_queue_delete(b->conn, CHANNEL, bytes(queue), 0, 0);
    return reply_ok(b, amqp_get_rpc_reply(b->conn), "queue.delete") ? IDEMQ_OK
                                                                    : IDEMQ_ERR_BROKER;
}

idemq_err_t broker_delete_exchange(struct broker *b, const char *exchange)
{
    amqp_exchange_delete(b->conn, CHANNEL, bytes(exchange), 0);
    return reply_ok(b, amqp_get_rpc_reply(b->conn), "exchange.delete") ? IDEMQ_OK
                                                                       : IDEMQ_ERR_BROKER;
}
