/*
 * broker: librabbitmq-c connection handling for idemq. All frames are read
 * through one pump (pump_frame) so deliveries, confirms, returns, blocked
 * notices and closes are handled in one place, whichever call is waiting.
 * Every delivery is registered with the ack tracker (acks.c) the moment its
 * method frame is read; its content is read by delivery.c; publisher
 * confirms are tracked per sequence number by confirms.c; tables are
 * converted by amqp_table.c.
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

#include "acks.h"
#include "amqp_table.h"
#include "confirms.h"
#include "delivery.h"
#include "broker_tls.h"
#include "giveback.h"
#include "log.h"

#define CHANNEL BROKER_CHANNEL
/* A channel of its own for RPCs a broker may refuse in normal operation
 * (broker_bind_aside): its channel.close never touches CHANNEL's
 * consumers, deliveries or confirms. */
#define ASIDE_CHANNEL (BROKER_CHANNEL + 9)
#define CONTENT_TIMEOUT_MS 30000 /* a message's frames follow its method frame */
#define SIDE_FIRST 2             /* the side channel's numbers: 2, 3, ... SIDE_LAST, 2, ... */
#define SIDE_LAST 1000
#define SHORTSTR_MAX 255         /* AMQP short strings: names, routing keys, properties */

struct stash {
    struct stash *next;
    struct job job;
};

/* One consumer on the channel: its tag and whose deliveries it brings. */
struct consumer {
    char tag[160];
    char queue[256]; /* for consuming again after broker_quiesce */
    int input;
    int lane; /* partition of an ordered input, or -1 */
};

/* The publishing state of one channel in confirm mode: the consuming
 * channel (CHANNEL) or the side channel. */
struct pubch {
    amqp_channel_t ch; /* side: 0 before its first open */
    bool closed;       /* side: closed (by the broker, or by us after a confirm
                        * timeout) since it was opened; reopened under the next
                        * number by the next publish, so a late frame of the old
                        * one is never taken for the new one's */
    struct confirms cf;
    uint64_t wait_from; /* first publish not yet covered by a wait */
    /* basic.returns since the last wait: their message_ids (a NUL for a
     * message without one), to tell which publish a confirm after a return
     * covered (broker_wait_confirms_each) */
    char (*returned)[JOB_SHORTSTR];
    size_t n_returned, cap_returned;
    size_t returns_seen; /* basic.returns since the last wait, listed or not */
};

struct broker {
    const struct conf *conf;
    amqp_connection_state_t conn;
    bool healthy;
    bool read_wedged; /* an undecodable message: the connection can still send */
    bool cancelled;   /* the broker cancelled a consumer: no more reads; the channel can
                       * still give the other consumers' deliveries back and close */
    bool confirms;
    char err[512];
    struct consumer *cons;
    int n_cons, cap_cons;
    struct pubch main; /* publishes on the consuming channel */
    struct pubch side; /* publishes whose refusal must not close it (broker_side_*) */
    struct acks acks;
    struct delivery_reader rd;
    /* deliveries read while waiting for something else */
    struct stash *stash_head, *stash_tail;
    int cancel_oks; /* basic.cancel-ok frames counted by broker_quiesce */
    bool aside_open;  /* ASIDE_CHANNEL is open on conn */
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

/* Describes an RPC reply on channel ch; returns true if it is a success. A
 * channel.close of the side channel closes only that one. */
static bool reply_ok_on(struct broker *b, amqp_channel_t ch, amqp_rpc_reply_t r,
                        const char *what)
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
            amqp_send_method(b->conn, ch, AMQP_CHANNEL_CLOSE_OK_METHOD, &ok);
            if (ch == CHANNEL)
                b->healthy = false;
            else if (ch == b->side.ch)
                b->side.closed = true;
        } else {
            set_err(b, "%s: unexpected server method 0x%08x", what, r.reply.id);
            b->healthy = false;
        }
        break;
    }
    return false;
}

static bool reply_ok(struct broker *b, amqp_rpc_reply_t r, const char *what)
{
    return reply_ok_on(b, CHANNEL, r, what);
}

/* A new channel in confirm mode: new publish sequence numbers. */
static void pubch_reset(struct pubch *pc)
{
    confirms_reset(&pc->cf);
    pc->wait_from = confirms_next_seq(&pc->cf);
    pc->n_returned = pc->returns_seen = 0;
}

/* Frees deliveries read but not handed out (their channel is gone). */
static void drop_stash(struct broker *b)
{
    while (b->stash_head) {
        struct stash *s = b->stash_head;
        b->stash_head = s->next;
        job_destroy(&s->job);
        free(s);
    }
    b->stash_tail = NULL;
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
    }
    /* A new channel: new delivery tags and publish sequence numbers. */
    drop_stash(b);
    pubch_reset(&b->main);
    acks_reset(&b->acks);
    b->n_cons = 0;
    b->healthy = true;
    b->cancelled = false;
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
    b->aside_open = false;
    if (!(b->conn = amqp_new_connection())) {
        set_err(b, "out of memory");
        goto out;
    }
    if (ci.ssl) { /* broker.tls settings */
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
    b->conf = c;
    b->main.ch = CHANNEL;
    confirms_init(&b->main.cf);
    confirms_init(&b->side.cf);
    acks_init(&b->acks);
    if (delivery_reader_init(&b->rd)) {
        snprintf(errbuf, errlen, "out of memory");
        broker_close(b);
        return IDEMQ_ERR_NOMEM;
    }
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
    broker_close(b);
    return err == IDEMQ_ERR_NOMEM ? err : IDEMQ_ERR_BROKER;
}

idemq_err_t broker_give_back(struct broker *b, uint64_t failed_tag)
{
    const char **tags;
    int n = 0;
    struct giveback_counts k;
    idemq_err_t err;
    if (!b || !b->conn || !b->healthy)
        return IDEMQ_ERR_BROKER; /* the channel is gone: the broker has them back */
    /* without memory for the tags, no cancel: the broker may hand out more
     * before the close (they return with it). A single active consumer
     * (a lane) is never cancelled here: its deliveries go back with the
     * close, which removes it in the same step (giveback.h). */
    if ((tags = calloc((size_t)b->n_cons + 1, sizeof *tags)))
        for (int i = 0; i < b->n_cons; i++)
            if (b->cons[i].lane < 0)
                tags[n++] = b->cons[i].tag;
    err = giveback_send(b->conn, CHANNEL, &b->acks, tags, n, failed_tag, &k);
    free(tags);
    if (err) {
        set_err(b, "giving deliveries back: the connection failed");
        b->healthy = false;
    }
    drop_stash(b); /* their tags were given back with the others */
    log_debug("gave back %d deliveries (%d basic.nack, %d basic.reject) after %d acks; %d "
              "return with the close",
              k.nacked + k.rejected, k.nacked, k.rejected, k.acked, k.with_close);
    return err;
}

void broker_close(struct broker *b)
{
    if (!b)
        return;
    drop_stash(b);
    if (b->conn) {
        if (b->healthy && !b->read_wedged) {
            amqp_channel_close(b->conn, CHANNEL, AMQP_REPLY_SUCCESS);
            amqp_connection_close(b->conn, AMQP_REPLY_SUCCESS);
        }
        amqp_destroy_connection(b->conn);
    }
    confirms_free(&b->main.cf);
    confirms_free(&b->side.cf);
    free(b->main.returned);
    free(b->side.returned);
    acks_free(&b->acks);
    delivery_reader_free(&b->rd);
    free(b->cons);
    free(b);
}

static idemq_err_t check_rc(struct broker *b, int rc, const char *what)
{
    if (rc == AMQP_STATUS_OK)
        return IDEMQ_OK;
    set_err(b, "%s: %s", what, amqp_error_string2(rc));
    b->healthy = false;
    return IDEMQ_ERR_BROKER;
}

/* Reads the content of the message whose method frame was just read (j
 * NULL: a returned publish, dropped). A message the library cannot decode
 * wedges the connection's reading: noted, and the job says so. */
static idemq_err_t read_content(struct broker *b, amqp_channel_t ch, struct job *j)
{
    size_t max_body = j && j->input >= 0 && j->input < b->conf->n_inputs
                          ? (size_t)b->conf->inputs[j->input].max_body_bytes
                          : (size_t)DELIVERY_PREFIX_BYTES;
    char why[300];
    idemq_err_t err =
        delivery_read(&b->rd, b->conn, ch, j, max_body, CONTENT_TIMEOUT_MS, why, sizeof why);
    switch (err) {
    case IDEMQ_OK:
        return IDEMQ_OK;
    case IDEMQ_ERR_UNDECODABLE:
        set_err(b, "%s", why);
        b->read_wedged = true;
        return j ? IDEMQ_OK : IDEMQ_ERR_BROKER; /* the job carries the failure */
    default:
        set_err(b, "%s", why);
        b->healthy = false;
        return IDEMQ_ERR_BROKER;
    }
}

/* The content of a basic.return just read: its message_id joins the list
 * of returns since the last wait. IDEMQ_ERR_TIMEOUT (the frame was
 * handled, like the other confirm frames) or IDEMQ_ERR_BROKER. */
static idemq_err_t note_return(struct broker *b, struct pubch *pc, amqp_channel_t ch)
{
    struct job j;
    idemq_err_t err;

    pc->returns_seen++;
    if (pc->n_returned == pc->cap_returned) {
        size_t cap = pc->cap_returned ? pc->cap_returned * 2 : 8;
        char(*r)[JOB_SHORTSTR] = realloc(pc->returned, cap * sizeof *r);
        if (!r) { /* unmatched: broker_wait_confirms_each counts it as a nack */
            if (read_content(b, ch, NULL))
                return IDEMQ_ERR_BROKER;
            return IDEMQ_ERR_TIMEOUT;
        }
        pc->returned = r;
        pc->cap_returned = cap;
    }
    job_init(&j);
    j.input = -1; /* a body prefix is enough */
    err = read_content(b, ch, &j);
    if (err == IDEMQ_OK && !j.wire_err)
        snprintf(pc->returned[pc->n_returned++], JOB_SHORTSTR, "%s",
                 j.has_message_id ? j.message_id : "");
    job_destroy(&j);
    return err ? err : IDEMQ_ERR_TIMEOUT;
}

/* The publishing state frames of channel ch belong to; NULL for a side
 * channel closed before (its late confirms and returns are dropped). */
static struct pubch *pubch_of(struct broker *b, amqp_channel_t ch)
{
    if (ch == CHANNEL)
        return &b->main;
    if (ch == b->side.ch && !b->side.closed)
        return &b->side;
    return NULL;
}

static const struct consumer *find_consumer(const struct broker *b, amqp_bytes_t tag)
{
    for (int i = 0; i < b->n_cons; i++)
        if (strlen(b->cons[i].tag) == tag.len && memcmp(b->cons[i].tag, tag.bytes, tag.len) == 0)
            return &b->cons[i];
    return NULL;
}

static void copy_short(char *dst, amqp_bytes_t s)
{
    size_t n = s.len < JOB_SHORTSTR - 1 ? s.len : JOB_SHORTSTR - 1;
    if (n)
        memcpy(dst, s.bytes, n);
    dst[n] = '\0';
}

/* Fills the delivery facts of the method frame into j (reset first). */
static void delivery_facts(struct job *j, uint64_t tag, bool redelivered, amqp_bytes_t exchange,
                           amqp_bytes_t routing_key)
{
    job_reset(j);
    j->tag = tag;
    j->redelivered = redelivered;
    copy_short(j->exchange, exchange);
    copy_short(j->routing_key, routing_key);
    job_utf8_sanitize(j->exchange);
    job_utf8_sanitize(j->routing_key);
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

    if (!b->healthy || b->read_wedged || b->cancelled)
        return IDEMQ_ERR_BROKER;
    /* Frames an RPC read ahead (deliveries that came while a passive
     * declare waited for its answer) live in the channel pools: releasing
     * those pools with frames still queued would free them unread. */
    if (!amqp_frames_enqueued(b->conn) && amqp_release_buffers_ok(b->conn))
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
        const struct consumer *c = find_consumer(b, d->consumer_tag);
        struct stash *s = NULL;
        struct job *dst = j;
        idemq_err_t err;
        /* Registered first: until it is settled, no ack may cover it. */
        if ((err = acks_received(&b->acks, d->delivery_tag))) {
            set_err(b, err == IDEMQ_ERR_NOMEM ? "out of memory tracking deliveries"
                                              : "delivery tag %llu out of order",
                    (unsigned long long)d->delivery_tag);
            b->healthy = false;
            return IDEMQ_ERR_BROKER;
        }
        if (!c) {
            set_err(b, "delivery %llu for unknown consumer %.*s",
                    (unsigned long long)d->delivery_tag, (int)d->consumer_tag.len,
                    (char *)d->consumer_tag.bytes);
            b->healthy = false; /* dropping the channel gives it back */
            return IDEMQ_ERR_BROKER;
        }
        if (c->lane >= 0) /* a single active consumer's: returned by the close */
            (void)acks_mark_with_close(&b->acks, d->delivery_tag);
        if (!dst) {
            if (!(s = calloc(1, sizeof *s))) {
                set_err(b, "out of memory");
                b->healthy = false;
                return IDEMQ_ERR_BROKER;
            }
            job_init(&s->job);
            dst = &s->job;
        }
        delivery_facts(dst, d->delivery_tag, d->redelivered, d->exchange, d->routing_key);
        dst->input = c->input;
        dst->lane = c->lane;
        err = read_content(b, frame.channel, dst);
        if (err) {
            if (s) {
                job_destroy(&s->job);
                free(s);
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
        struct pubch *pc = pubch_of(b, frame.channel);
        if (pc)
            confirms_ack(&pc->cf, a->delivery_tag, a->multiple);
        return IDEMQ_ERR_TIMEOUT;
    }
    case AMQP_BASIC_NACK_METHOD: {
        amqp_basic_nack_t *n = frame.payload.method.decoded;
        struct pubch *pc = pubch_of(b, frame.channel);
        if (pc) {
            set_err(b, "broker nacked publish %llu", (unsigned long long)n->delivery_tag);
            confirms_nack(&pc->cf, n->delivery_tag, n->multiple);
        }
        return IDEMQ_ERR_TIMEOUT;
    }
    case AMQP_BASIC_RETURN_METHOD: {
        amqp_basic_return_t *r = frame.payload.method.decoded;
        struct pubch *pc = pubch_of(b, frame.channel);
        if (!pc) /* of a side channel closed since: its content is read and dropped */
            return read_content(b, frame.channel, NULL) ? IDEMQ_ERR_BROKER : IDEMQ_ERR_TIMEOUT;
        set_err(b, "message returned as unroutable: %u %.*s (exchange %.*s, key %.*s)",
                r->reply_code, (int)r->reply_text.len, (char *)r->reply_text.bytes,
                (int)r->exchange.len, (char *)r->exchange.bytes, (int)r->routing_key.len,
                (char *)r->routing_key.bytes);
        confirms_return(&pc->cf);
        return note_return(b, pc, frame.channel);
    }
    case AMQP_CHANNEL_CLOSE_METHOD: {
        amqp_channel_close_t *m = frame.payload.method.decoded;
        amqp_channel_close_ok_t ok = {0};
        if (frame.channel != CHANNEL) { /* the side channel: only it is gone */
            if (frame.channel == b->side.ch && !b->side.closed) {
                set_err(b, "side channel closed by broker: %u %.*s", m->reply_code,
                        (int)m->reply_text.len, (char *)m->reply_text.bytes);
                b->side.closed = true;
            }
            if (check_rc(b, amqp_send_method(b->conn, frame.channel,
                                             AMQP_CHANNEL_CLOSE_OK_METHOD, &ok),
                         "channel.close-ok"))
                return IDEMQ_ERR_BROKER;
            return IDEMQ_ERR_TIMEOUT;
        }
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
        /* One consumer is gone (its queue deleted, a consumer timeout, a
         * quorum leader moving); the channel is not. The caller pauses as
         * for any other reason: the give-back returns the other consumers'
         * deliveries one by one on the open channel, not with a connection
         * loss (which RabbitMQ 4.3 counts toward a delivery limit). */
        amqp_basic_cancel_t *m = frame.payload.method.decoded;
        const struct consumer *c = find_consumer(b, m->consumer_tag);
        set_err(b, "broker cancelled consumer %.*s (queue deleted or failed over)",
                (int)m->consumer_tag.len, (char *)m->consumer_tag.bytes);
        if (c) { /* not cancelled again by the give-back */
            int i = (int)(c - b->cons);
            memmove(&b->cons[i], &b->cons[i + 1], (size_t)(b->n_cons - i - 1) * sizeof *c);
            b->n_cons--;
        }
        b->cancelled = true;
        return IDEMQ_ERR_BROKER;
    }
    case AMQP_BASIC_CANCEL_OK_METHOD:
        b->cancel_oks++;
        return IDEMQ_ERR_TIMEOUT;
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

idemq_err_t broker_quiesce(struct broker *b, int timeout_ms, bool *idle)
{
    long long deadline = now_ms() + timeout_ms;
    bool empty;

    *idle = false;
    if (!b->healthy || b->read_wedged)
        return IDEMQ_ERR_BROKER;
    b->cancel_oks = 0;
    for (int i = 0; i < b->n_cons; i++) {
        amqp_basic_cancel_t req;
        req.consumer_tag = bytes(b->cons[i].tag);
        req.nowait = 0;
        if (check_rc(b, amqp_send_method(b->conn, CHANNEL, AMQP_BASIC_CANCEL_METHOD, &req),
                     "basic.cancel"))
            return IDEMQ_ERR_BROKER;
    }
    /* Deliveries dispatched before the cancel come before its ok: stashed. */
    while (b->cancel_oks < b->n_cons) {
        long long left = deadline - now_ms();
        struct timeval tv;
        if (left <= 0) {
            set_err(b, "basic.cancel-ok not received within %d ms", timeout_ms);
            b->healthy = false;
            return IDEMQ_ERR_BROKER;
        }
        tv.tv_sec = left / 1000;
        tv.tv_usec = (left % 1000) * 1000;
        if (pump_frame(b, NULL, &tv) == IDEMQ_ERR_BROKER)
            return IDEMQ_ERR_BROKER;
    }
    empty = !b->stash_head;
    for (int i = 0; empty && i < b->n_cons; i++) {
        amqp_queue_declare_ok_t *ok = amqp_queue_declare(
            b->conn, CHANNEL, bytes(b->cons[i].queue), 1, 0, 0, 0, amqp_empty_table);
        if (!reply_ok(b, amqp_get_rpc_reply(b->conn), "passive declare")) {
            b->healthy = false;
            return IDEMQ_ERR_BROKER;
        }
        if (ok->message_count)
            empty = false;
    }
    if (empty) {
        *idle = true; /* the consumers stay cancelled */
        return IDEMQ_OK;
    }
    for (int i = 0; i < b->n_cons; i++) {
        char what[300];
        amqp_basic_consume(b->conn, CHANNEL, bytes(b->cons[i].queue), bytes(b->cons[i].tag), 0,
                           0, 0, amqp_empty_table);
        snprintf(what, sizeof what, "consume queue %s again", b->cons[i].queue);
        if (!reply_ok(b, amqp_get_rpc_reply(b->conn), what)) {
            b->healthy = false;
            return IDEMQ_ERR_BROKER;
        }
    }
    return IDEMQ_OK;
}

idemq_err_t broker_ack(struct broker *b, uint64_t tag, bool multiple)
{
    if (!b->healthy)
        return IDEMQ_ERR_BROKER;
    acks_drop(&b->acks, tag, multiple);
    return check_rc(b, amqp_basic_ack(b->conn, CHANNEL, tag, multiple), "basic.ack");
}

idemq_err_t broker_nack(struct broker *b, uint64_t tag, bool requeue)
{
    if (!b->healthy)
        return IDEMQ_ERR_BROKER;
    acks_drop(&b->acks, tag, false);
    return check_rc(b, amqp_basic_nack(b->conn, CHANNEL, tag, 0, requeue), "basic.nack");
}

idemq_err_t broker_settle(struct broker *b, uint64_t tag)
{
    if (!acks_settle(&b->acks, tag)) {
        set_err(b, "delivery %llu is not outstanding on this channel",
                (unsigned long long)tag);
        return IDEMQ_ERR_INTERNAL;
    }
    return IDEMQ_OK;
}

idemq_err_t broker_reject(struct broker *b, uint64_t tag)
{
    if (!b->healthy)
        return IDEMQ_ERR_BROKER;
    if (!acks_gone(&b->acks, tag)) {
        set_err(b, "delivery %llu is not outstanding on this channel",
                (unsigned long long)tag);
        return IDEMQ_ERR_INTERNAL;
    }
    return check_rc(b, amqp_basic_reject(b->conn, CHANNEL, tag, 0), "basic.reject");
}

idemq_err_t broker_flush_acks(struct broker *b)
{
    struct acks_op op;
    while (acks_next(&b->acks, &op)) {
        if (!b->healthy)
            return IDEMQ_ERR_BROKER;
        if (check_rc(b, amqp_basic_ack(b->conn, CHANNEL, op.tag, op.multiple), "basic.ack"))
            return IDEMQ_ERR_BROKER;
    }
    return IDEMQ_OK;
}

bool broker_readable(const struct broker *b) { return b && b->healthy && !b->read_wedged; }

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

static idemq_err_t consume(struct broker *b, int input_idx, int lane, const char *queue,
                           const char *tag)
{
    char what[300];
    struct consumer *c;
    if (b->n_cons == b->cap_cons) {
        int cap = b->cap_cons ? b->cap_cons * 2 : 8;
        struct consumer *v = realloc(b->cons, (size_t)cap * sizeof *v);
        if (!v) {
            set_err(b, "out of memory adding a consumer");
            return IDEMQ_ERR_NOMEM;
        }
        b->cons = v;
        b->cap_cons = cap;
    }
    c = &b->cons[b->n_cons];
    snprintf(c->tag, sizeof c->tag, "%s", tag);
    snprintf(c->queue, sizeof c->queue, "%s", queue);
    c->input = input_idx;
    c->lane = lane;
    amqp_basic_consume(b->conn, CHANNEL, bytes(queue), bytes(c->tag), 0, 0, 0,
                       amqp_empty_table);
    snprintf(what, sizeof what, "consume queue %s", queue);
    if (!reply_ok(b, amqp_get_rpc_reply(b->conn), what))
        return IDEMQ_ERR_BROKER;
    b->n_cons++;
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

static idemq_err_t publish(struct broker *b, struct pubch *pc, const char *exchange,
                           const char *routing_key, const void *body, size_t len,
                           const struct broker_props *props, bool mandatory);

idemq_err_t broker_publish(struct broker *b, const char *exchange, const char *routing_key,
                           const void *body, size_t len, const struct broker_props *props)
{
    return publish(b, &b->main, exchange, routing_key, body, len, props, true);
}

/* Opens the side channel (in confirm mode) under the number after the last
 * one, unless it is open. IDEMQ_ERR_BROKER when the connection failed or
 * the broker refused the channel. */
static idemq_err_t side_open(struct broker *b)
{
    struct pubch *s = &b->side;
    int max = amqp_get_channel_max(b->conn);
    amqp_channel_t ch;

    if (s->ch && !s->closed)
        return IDEMQ_OK;
    if (max <= 0 || max > SIDE_LAST)
        max = SIDE_LAST;
    ch = s->ch >= SIDE_FIRST && s->ch < max ? (amqp_channel_t)(s->ch + 1) : SIDE_FIRST;
    s->ch = ch;
    s->closed = true; /* until confirm mode is on */
    amqp_channel_open(b->conn, ch);
    if (!reply_ok_on(b, ch, amqp_get_rpc_reply(b->conn), "side channel.open"))
        return IDEMQ_ERR_BROKER;
    amqp_confirm_select(b->conn, ch);
    if (!reply_ok_on(b, ch, amqp_get_rpc_reply(b->conn), "side confirm.select"))
        return IDEMQ_ERR_BROKER;
    pubch_reset(s);
    s->closed = false;
    return IDEMQ_OK;
}

/* After a confirm timeout: the side channel is closed (its late confirms
 * are dropped, see pubch_of); the next side publish opens another. */
static void side_retire(struct broker *b)
{
    amqp_channel_close_t req = {AMQP_REPLY_SUCCESS, amqp_cstring_bytes("confirms timed out"), 0,
                                0};
    if (b->side.closed || !b->side.ch)
        return;
    b->side.closed = true;
    if (b->healthy)
        (void)check_rc(b, amqp_send_method(b->conn, b->side.ch, AMQP_CHANNEL_CLOSE_METHOD, &req),
                       "side channel.close");
}

idemq_err_t broker_side_publish(struct broker *b, const char *exchange, const char *routing_key,
                                const void *body, size_t len, const struct broker_props *props,
                                bool mandatory)
{
    struct pubch *s = &b->side;
    if (!b->healthy)
        return IDEMQ_ERR_BROKER;
    if (!b->confirms) {
        set_err(b, "publish needs a connection opened with confirms");
        return IDEMQ_ERR_INTERNAL;
    }
    if (s->closed && s->ch && confirms_next_seq(&s->cf) != s->wait_from)
        return IDEMQ_ERR_BROKER; /* closed under publishes not waited for: wait first */
    if (side_open(b))
        return IDEMQ_ERR_BROKER;
    return publish(b, s, exchange, routing_key, body, len, props, mandatory);
}

/* A short string property of p over SHORTSTR_MAX bytes: its name, or NULL. */
static const char *long_shortstr(const amqp_basic_properties_t *p)
{
#define LONG_PROP(flag, field)                                                               \
    if ((p->_flags & (flag)) && p->field.len > SHORTSTR_MAX)                                 \
        return #field;
    LONG_PROP(AMQP_BASIC_CONTENT_TYPE_FLAG, content_type)
    LONG_PROP(AMQP_BASIC_CONTENT_ENCODING_FLAG, content_encoding)
    LONG_PROP(AMQP_BASIC_CORRELATION_ID_FLAG, correlation_id)
    LONG_PROP(AMQP_BASIC_REPLY_TO_FLAG, reply_to)
    LONG_PROP(AMQP_BASIC_EXPIRATION_FLAG, expiration)
    LONG_PROP(AMQP_BASIC_MESSAGE_ID_FLAG, message_id)
    LONG_PROP(AMQP_BASIC_TYPE_FLAG, type)
    LONG_PROP(AMQP_BASIC_APP_ID_FLAG, app_id)
#undef LONG_PROP
    return NULL;
}

/*
 * What the client library would fail to encode half-way (it writes the
 * method frame before it encodes the content header, and a header key's
 * length into one byte), checked before anything is written: an exchange,
 * routing key, property or header name over 255 bytes, or a content header
 * frame over frame_max. Sets b->err and returns IDEMQ_ERR_UNPUBLISHABLE;
 * else IDEMQ_OK.
 */
static idemq_err_t check_encodable(struct broker *b, const char *exchange,
                                   const char *routing_key, const amqp_basic_properties_t *p)
{
    size_t longest = 0, frame = 7 + 1 + 14 + 1 + 1 + 8; /* frame, class, weight, size, flags,
                                                          * delivery mode, priority, timestamp */
    size_t frame_max = (size_t)amqp_get_frame_max(b->conn);
    const char *prop;

    if (strlen(exchange) > SHORTSTR_MAX) {
        set_err(b, "cannot publish: the exchange name is %zu bytes; AMQP allows at most 255",
                strlen(exchange));
        return IDEMQ_ERR_UNPUBLISHABLE;
    }
    if (strlen(routing_key) > SHORTSTR_MAX) {
        set_err(b, "cannot publish: the routing key is %zu bytes; AMQP allows at most 255",
                strlen(routing_key));
        return IDEMQ_ERR_UNPUBLISHABLE;
    }
    if ((prop = long_shortstr(p))) {
        set_err(b, "cannot publish: property %s is over 255 bytes (AMQP's limit)", prop);
        return IDEMQ_ERR_UNPUBLISHABLE;
    }
    frame += 8 * (1 + SHORTSTR_MAX); /* every short string property, at most */
    if (p->_flags & AMQP_BASIC_HEADERS_FLAG) {
        size_t size = amqp_table_wire_size(&p->headers, &longest);
        if (longest > SHORTSTR_MAX) {
            set_err(b, "cannot publish: a header name is %zu bytes; AMQP allows at most 255",
                    longest);
            return IDEMQ_ERR_UNPUBLISHABLE;
        }
        if (frame_max && frame + size > frame_max) {
            set_err(b, "cannot publish: the headers take %zu bytes, over what one content "
                       "header frame holds (frame_max %zu)",
                    size, frame_max);
            return IDEMQ_ERR_UNPUBLISHABLE;
        }
    }
    return IDEMQ_OK;
}

static idemq_err_t publish(struct broker *b, struct pubch *pc, const char *exchange,
                           const char *routing_key, const void *body, size_t len,
                           const struct broker_props *props, bool mandatory)
{
    amqp_basic_properties_t p;
    amqp_pool_t pool;
    amqp_bytes_t data = {len, (void *)body};
    uint64_t seq;
    idemq_err_t err;
    int rc;

    if (!b->healthy)
        return IDEMQ_ERR_BROKER;
    if (!b->confirms) {
        set_err(b, "publish needs a connection opened with confirms");
        return IDEMQ_ERR_INTERNAL;
    }
    exchange = exchange ? exchange : "";
    routing_key = routing_key ? routing_key : "";
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
        if (amqp_table_from_json(props->headers, &p.headers, &pool)) {
            empty_amqp_pool(&pool);
            set_err(b, "out of memory building headers");
            return IDEMQ_ERR_NOMEM;
        }
        p._flags |= AMQP_BASIC_HEADERS_FLAG;
    }
    if ((err = check_encodable(b, exchange, routing_key, &p))) {
        empty_amqp_pool(&pool);
        return err; /* nothing written: the channel stays usable */
    }
    if (confirms_publish(&pc->cf, &seq)) {
        empty_amqp_pool(&pool);
        set_err(b, "out of memory tracking confirms");
        return IDEMQ_ERR_NOMEM;
    }
    rc = amqp_basic_publish(b->conn, pc->ch, bytes(exchange), bytes(routing_key),
                            mandatory ? 1 : 0, 0, &p, data);
    empty_amqp_pool(&pool);
    if (check_rc(b, rc, "basic.publish"))
        return IDEMQ_ERR_BROKER;
    return IDEMQ_OK;
}

/* Waits for the publishes of pc since its last wait (broker_wait_confirms). */
static idemq_err_t wait_range(struct broker *b, struct pubch *pc, int timeout_ms)
{
    long long deadline = now_ms() + timeout_ms;
    uint64_t first = pc->wait_from, last = confirms_next_seq(&pc->cf) - 1;
    enum confirms_result res;

    for (;;) {
        long long left = deadline - now_ms();
        struct timeval tv;
        res = confirms_range(&pc->cf, first, last);
        if (res != CONFIRMS_PENDING)
            break;
        if (pc->closed) /* the side channel: closed under them */
            return IDEMQ_ERR_BROKER;
        if (b->read_wedged) {
            set_err(b, "publishes cannot be confirmed: the connection cannot read past an "
                       "undecodable message");
            return IDEMQ_ERR_BROKER;
        }
        if (left <= 0) {
            set_err(b, "publishes %llu..%llu not all confirmed within %d ms",
                    (unsigned long long)first, (unsigned long long)last, timeout_ms);
            return IDEMQ_ERR_TIMEOUT;
        }
        tv.tv_sec = left / 1000;
        tv.tv_usec = (left % 1000) * 1000;
        if (pump_frame(b, NULL, &tv) == IDEMQ_ERR_BROKER)
            return IDEMQ_ERR_BROKER;
    }
    /* Decided: the next wait covers only what is published after this. */
    pc->wait_from = last + 1;
    pc->n_returned = pc->returns_seen = 0;
    confirms_forget_below(&pc->cf, pc->wait_from);
    if (res == CONFIRMS_FAILED) {
        if (!strstr(b->err, "nacked") && !strstr(b->err, "returned"))
            set_err(b, "a publish of %llu..%llu was nacked or returned",
                    (unsigned long long)first, (unsigned long long)last);
        return IDEMQ_ERR_BROKER;
    }
    return IDEMQ_OK;
}

idemq_err_t broker_wait_confirms(struct broker *b, int timeout_ms)
{
    return wait_range(b, &b->main, timeout_ms);
}

/* A wait on the side channel that did not end with every publish decided:
 * what is outstanding on it is forgotten (a closed channel's confirms never
 * come; after a timeout the channel is closed so they never count). */
static void side_forget(struct broker *b)
{
    struct pubch *s = &b->side;
    side_retire(b);
    s->wait_from = confirms_next_seq(&s->cf);
    s->n_returned = s->returns_seen = 0;
}

idemq_err_t broker_side_wait_confirms(struct broker *b, int timeout_ms)
{
    idemq_err_t err;
    if (!b->side.ch || confirms_next_seq(&b->side.cf) == b->side.wait_from)
        return IDEMQ_OK; /* nothing published since the last wait */
    err = wait_range(b, &b->side, timeout_ms);
    if (err && confirms_next_seq(&b->side.cf) != b->side.wait_from)
        side_forget(b);
    return err;
}

static idemq_err_t recover_channel(struct broker *b)
{
    if (!b->conn)
        return IDEMQ_ERR_BROKER;
    return open_channel(b);
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
    delivery_facts(j, ok->delivery_tag, ok->redelivered, ok->exchange, ok->routing_key);
    if (!ack && acks_received(&b->acks, ok->delivery_tag)) {
        set_err(b, "cannot track delivery %llu", (unsigned long long)ok->delivery_tag);
        b->healthy = false;
        return IDEMQ_ERR_BROKER;
    }
    if (read_content(b, CHANNEL, j))
        return IDEMQ_ERR_BROKER;
    return j->wire_err == IDEMQ_ERR_UNDECODABLE ? IDEMQ_ERR_UNDECODABLE : IDEMQ_OK;
}

struct amqp_connection_state_t_ *broker_amqp(struct broker *b) { return b->conn; }

int broker_server_major(struct broker *b)
{
    const amqp_table_t *t = b->conn ? amqp_get_server_properties(b->conn) : NULL;
    for (int i = 0; t && i < t->num_entries; i++) {
        const amqp_table_entry_t *e = &t->entries[i];
        if (e->key.len == 7 && memcmp(e->key.bytes, "version", 7) == 0 &&
            (e->value.kind == AMQP_FIELD_KIND_UTF8 || e->value.kind == AMQP_FIELD_KIND_BYTES)) {
            const amqp_bytes_t v = e->value.value.bytes;
            int major = 0;
            for (size_t k = 0; k < v.len && k < 6; k++) {
                char ch = ((const char *)v.bytes)[k];
                if (ch < '0' || ch > '9')
                    break;
                major = major * 10 + (ch - '0');
            }
            return major;
        }
    }
    return 0;
}

idemq_err_t broker_rpc_done(struct broker *b, const char *what, bool reopen)
{
    if (reply_ok(b, amqp_get_rpc_reply(b->conn), what))
        return IDEMQ_OK;
    return reopen ? fail_keep(b) : IDEMQ_ERR_BROKER;
}

void broker_set_error(struct broker *b, const char *text) { set_err(b, "%s", text); }

idemq_err_t broker_bind_aside(struct broker *b, const char *queue, const char *exchange,
                              const char *key)
{
    char what[600];
    amqp_rpc_reply_t r;

    snprintf(what, sizeof what, "bind queue %s to %s (key %s)", queue, exchange, key);
    if (!b->conn || !b->healthy) {
        set_err(b, "%s: the connection is down", what);
        return IDEMQ_ERR_BROKER;
    }
    if (!b->aside_open) {
        amqp_channel_open(b->conn, ASIDE_CHANNEL);
        r = amqp_get_rpc_reply(b->conn);
        if (r.reply_type != AMQP_RESPONSE_NORMAL) {
            reply_ok(b, r, "channel.open (aside)");
            return IDEMQ_ERR_BROKER;
        }
        b->aside_open = true;
    }
    amqp_queue_bind(b->conn, ASIDE_CHANNEL, bytes(queue), bytes(exchange), bytes(key),
                    amqp_empty_table);
    r = amqp_get_rpc_reply(b->conn);
    if (r.reply_type == AMQP_RESPONSE_NORMAL)
        return IDEMQ_OK;
    if (r.reply_type == AMQP_RESPONSE_SERVER_EXCEPTION && r.reply.id == AMQP_CHANNEL_CLOSE_METHOD) {
        amqp_channel_close_t *m = r.reply.decoded;
        amqp_channel_close_ok_t ok = {0};
        set_err(b, "%s: refused by the broker: %u %.*s", what, m->reply_code,
                (int)m->reply_text.len, (char *)m->reply_text.bytes);
        amqp_send_method(b->conn, ASIDE_CHANNEL, AMQP_CHANNEL_CLOSE_OK_METHOD, &ok);
        b->aside_open = false;
        return IDEMQ_ERR_BROKER;
    }
    reply_ok(b, r, what); /* the connection failed: b is unhealthy */
    return IDEMQ_ERR_BROKER;
}

/* Was a publish with this message_id returned since the last wait? */
static bool was_returned(const struct pubch *pc, const char *message_id, bool *matched)
{
    for (size_t i = 0; i < pc->n_returned; i++)
        if (message_id && !matched[i] && strcmp(pc->returned[i], message_id) == 0) {
            matched[i] = true;
            return true;
        }
    return false;
}

static idemq_err_t wait_each(struct broker *b, struct pubch *pc, int timeout_ms,
                             const char *const *message_ids, enum broker_confirm *out, size_t n)
{
    long long deadline = now_ms() + timeout_ms;
    uint64_t first = pc->wait_from, last = confirms_next_seq(&pc->cf) - 1;
    idemq_err_t err = IDEMQ_OK;
    bool *matched;
    size_t unmatched = 0;

    for (size_t i = 0; i < n; i++)
        out[i] = BROKER_CONFIRM_PENDING;
    if (last + 1 - first != n) {
        set_err(b, "broker_wait_confirms_each: %zu publishes named, %llu outstanding", n,
                (unsigned long long)(last + 1 - first));
        return IDEMQ_ERR_INTERNAL;
    }
    for (;;) {
        long long left = deadline - now_ms();
        struct timeval tv;
        bool pending = false;
        for (uint64_t s = first; s <= last && !pending; s++)
            pending = confirms_seq_state(&pc->cf, s) == CONFIRMS_SEQ_PENDING;
        if (!pending)
            break;
        if (pc->closed) { /* the side channel: closed under them */
            err = IDEMQ_ERR_BROKER;
            break;
        }
        if (b->read_wedged) {
            set_err(b, "publishes cannot be confirmed: the connection cannot read past an "
                       "undecodable message");
            err = IDEMQ_ERR_BROKER;
            break;
        }
        if (left <= 0) {
            set_err(b, "publishes %llu..%llu not all confirmed within %d ms",
                    (unsigned long long)first, (unsigned long long)last, timeout_ms);
            err = IDEMQ_ERR_TIMEOUT;
            break;
        }
        tv.tv_sec = left / 1000;
        tv.tv_usec = (left % 1000) * 1000;
        if (pump_frame(b, NULL, &tv) == IDEMQ_ERR_BROKER) {
            err = IDEMQ_ERR_BROKER;
            break;
        }
    }
    /* A confirm after a basic.return covers the returned publish, and with
     * `multiple` maybe others: the returned one is found by message_id.
     * A return that matches none (no message_id, or not read) leaves every
     * publish its confirm covered in doubt: counted as nacked. */
    matched = calloc(pc->n_returned ? pc->n_returned : 1, sizeof *matched);
    for (size_t i = 0; i < n; i++) {
        switch (confirms_seq_state(&pc->cf, first + i)) {
        case CONFIRMS_SEQ_ACKED:
            out[i] = BROKER_CONFIRM_ACKED;
            break;
        case CONFIRMS_SEQ_RETURN_ACKED:
            out[i] = matched && was_returned(pc, message_ids ? message_ids[i] : NULL, matched)
                         ? BROKER_CONFIRM_RETURNED
                         : BROKER_CONFIRM_ACKED;
            break;
        case CONFIRMS_SEQ_PENDING:
            out[i] = BROKER_CONFIRM_PENDING;
            break;
        default:
            out[i] = BROKER_CONFIRM_NACKED;
        }
    }
    unmatched = pc->returns_seen;
    for (size_t r = 0; matched && r < pc->n_returned; r++)
        unmatched -= matched[r];
    for (size_t i = 0; i < n && unmatched; i++) /* in doubt */
        if (confirms_seq_state(&pc->cf, first + i) == CONFIRMS_SEQ_RETURN_ACKED &&
            out[i] == BROKER_CONFIRM_ACKED)
            out[i] = BROKER_CONFIRM_NACKED;
    free(matched);
    if (err == IDEMQ_OK) {
        pc->wait_from = last + 1;
        pc->n_returned = pc->returns_seen = 0;
        confirms_forget_below(&pc->cf, pc->wait_from);
    }
    return err;
}

idemq_err_t broker_wait_confirms_each(struct broker *b, int timeout_ms,
                                      const char *const *message_ids, enum broker_confirm *out,
                                      size_t n)
{
    return wait_each(b, &b->main, timeout_ms, message_ids, out, n);
}

idemq_err_t broker_side_wait_confirms_each(struct broker *b, int timeout_ms,
                                           const char *const *message_ids,
                                           enum broker_confirm *out, size_t n)
{
    idemq_err_t err;
    if (!b->side.ch && n == 0)
        return IDEMQ_OK;
    err = wait_each(b, &b->side, timeout_ms, message_ids, out, n);
    if (err && err != IDEMQ_ERR_INTERNAL)
        side_forget(b);
    return err;
}
