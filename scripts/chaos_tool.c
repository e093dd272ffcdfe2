/*
 * idemq-chaos: the C helper of scripts/chaos. It publishes the chaos run's
 * jobs through confirmed publishes while brokers fail under it, so the
 * published set is known exactly, and it counts and resets the input's
 * queues. The invariants are checked in SQL (tests/chaos/chaos.sql).
 *
 *   idemq-chaos publish -c CFG -n N --run ID --manifest FILE [--dup-pct P]
 *                       [--poison N] [--badjson N] [--transient N] [--rate R]
 *                       [--input NAME]
 *   idemq-chaos counts  -c CFG   (work, bucket and dead-letter queue messages,
 *                                 summed over every input)
 *   idemq-chaos reset   -c CFG   (delete every input's queues and exchanges,
 *                                 declare them again)
 *   idemq-chaos pgproxy --to HOST:PORT [--listen PORT]
 *                       (the ambiguous commit: a loopback TCP proxy in front
 *                        of PostgreSQL; see cmd_pgproxy)
 *
 * The publisher talks to librabbitmq-c directly instead of adapters/broker.c:
 * it tracks every publish by its sequence number (acks and nacks with and
 * without `multiple`, out of order, basic.return before the ack), republishes
 * whatever was nacked, returned, or unconfirmed when a connection died, and
 * fails over to the next URL of broker.url. Its manifest (one line per unique
 * key: key, kind, confirmed copies, fail_until) is what the checker expects.
 *
 * Jobs: N messages, dup-pct % of them copies of an earlier key (same body).
 * Each unique key is one of: normal (applied at once), transient (the chaos
 * effect fails with IR001 on attempts 1..fail_until, fail_until in 1..3, so
 * it must retry through the delay buckets), poison (the effect raises 22023:
 * parked at once) and badjson (not JSON, no key: parked as bad_json; never
 * duplicated on purpose; its "key" in the manifest is its whole body).
 * --input NAME publishes to that input's queue (default: the first input).
 * Output: one line of key=value pairs on stdout; progress on stderr.
 */
#include <amqp.h>
#include <amqp_tcp_socket.h>
#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "broker.h"
#include "broker_admin.h"
#include "conf.h"
#include "log.h"
#include "topology.h"

#define CHANNEL 1
#define WINDOW 2000          /* publishes awaiting their confirm at most */
#define STALL_S 30.0         /* no confirm for this long: drop the connection */
#define BODY_MAX 512

enum kind { K_NORMAL = 0, K_TRANSIENT, K_POISON, K_BADJSON };
static const char *const kind_names[] = {"normal", "transient", "poison", "badjson"};

struct opts {
    const char *cmd, *config, *run, *manifest, *input;
    long n, poison, badjson, transient;
    int dup_pct;
    double rate;
};

/* One publish awaiting its confirm (ring slot seq % WINDOW). */
struct pending {
    uint64_t seq; /* 0: free */
    long key;
    bool returned; /* basic.return seen: its ack does not count */
};

struct pub {
    const struct conf *c;
    const struct conf_input *in;
    const struct opts *o;
    amqp_connection_state_t conn;
    int url_next;
    uint64_t seq;       /* last sequence number published on this channel */
    uint64_t low;       /* lowest sequence number not settled yet */
    struct pending ring[WINDOW];
    long n_pending;
    long *redo;         /* keys to publish again (FIFO) */
    long redo_head, redo_tail, redo_cap;
    int *copies;        /* confirmed copies per key */
    unsigned char *kind;
    long unique;
    /* counters */
    long confirmed, nacks, returns, lost, reconnects;
    double last_progress;
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void sleep_s(double s)
{
    if (s > 0) {
        struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
        nanosleep(&ts, NULL);
    }
}

/* xorshift64*: deterministic per run id. */
static uint64_t rnd(uint64_t *s)
{
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 2685821657736338717ull;
}

static int body_for(const struct pub *p, long k, char *buf, size_t len)
{
    const char *run = p->o->run;
    switch ((enum kind)p->kind[k]) {
    case K_BADJSON: return snprintf(buf, len, "chaos:%s:bad:%08ld {not json", run, k);
    case K_POISON:
        return snprintf(buf, len, "{\"job_id\":\"chaos:%s:%08ld\",\"poison\":true}", run, k);
    case K_TRANSIENT:
        return snprintf(buf, len,
                        "{\"job_id\":\"chaos:%s:%08ld\",\"fail_until\":%ld,\"amount_minor\":%ld}",
                        run, k, 1 + k % 3, 100 + k % 9973);
    case K_NORMAL: break;
    }
    return snprintf(
        buf, len, "{\"job_id\":\"chaos:%s:%08ld\",\"amount_minor\":%ld,\"memo\":\"chaos run %s\"}",
        run, k, 100 + k % 9973, run);
}

static int key_for(const struct pub *p, long k, char *buf, size_t len)
{
    if (p->kind[k] == K_BADJSON)
        return body_for(p, k, buf, len);
    return snprintf(buf, len, "chaos:%s:%08ld", p->o->run, k);
}

/* The key index a body was made from (for a basic.return), or -1. */
static long key_of_body(const struct pub *p, const char *body, size_t len)
{
    char pat[128], tmp[BODY_MAX + 1];
    const char *at;
    size_t n = len < BODY_MAX ? len : BODY_MAX;
    memcpy(tmp, body, n);
    tmp[n] = '\0';
    snprintf(pat, sizeof pat, "chaos:%s:", p->o->run);
    if (!(at = strstr(tmp, pat)))
        return -1;
    at += strlen(pat);
    if (strncmp(at, "bad:", 4) == 0)
        at += 4;
    return strtol(at, NULL, 10);
}

static void redo_push(struct pub *p, long k)
{
    if (p->redo_tail == p->redo_cap) { /* compact or grow */
        long live = p->redo_tail - p->redo_head;
        if (p->redo_head > 0) {
            memmove(p->redo, p->redo + p->redo_head, (size_t)live * sizeof *p->redo);
        } else {
            long cap = p->redo_cap ? p->redo_cap * 2 : 4096;
            long *r = realloc(p->redo, (size_t)cap * sizeof *r);
            if (!r) {
                fprintf(stderr, "idemq-chaos: out of memory\n");
                exit(1);
            }
            p->redo = r;
            p->redo_cap = cap;
        }
        p->redo_head = 0;
        p->redo_tail = live;
    }
    p->redo[p->redo_tail++] = k;
}

/* Settles one sequence number: counted when acked and not returned,
 * published again otherwise. */
static void settle(struct pub *p, uint64_t seq, bool ack)
{
    struct pending *e = &p->ring[seq % WINDOW];
    if (e->seq != seq)
        return; /* settled already (or never published on this channel) */
    if (ack && !e->returned) {
        p->confirmed++;
        p->copies[e->key]++;
    } else {
        redo_push(p, e->key);
    }
    e->seq = 0;
    p->n_pending--;
    while (p->low <= p->seq && p->ring[p->low % WINDOW].seq != p->low)
        p->low++;
}

static void on_confirm(struct pub *p, uint64_t tag, bool multiple, bool ack)
{
    if (!ack)
        p->nacks++;
    if (multiple) {
        for (uint64_t s = p->low; s <= tag && s <= p->seq; s++)
            settle(p, s, ack);
    } else {
        settle(p, tag, ack);
    }
    p->last_progress = now_s();
}

/* Every unsettled publish of a dead connection: published again. */
static void drop_connection(struct pub *p, const char *why)
{
    if (p->conn) {
        amqp_destroy_connection(p->conn);
        p->conn = NULL;
    }
    for (uint64_t s = p->low; s <= p->seq; s++) {
        struct pending *e = &p->ring[s % WINDOW];
        if (e->seq == s) {
            redo_push(p, e->key);
            e->seq = 0;
            p->lost++;
        }
    }
    p->n_pending = 0;
    p->seq = 0;
    p->low = 1;
    fprintf(stderr, "idemq-chaos: publisher connection dropped (%s); unconfirmed publishes "
                    "will be sent again\n", why);
}

static bool rpc_ok(amqp_rpc_reply_t r) { return r.reply_type == AMQP_RESPONSE_NORMAL; }

/* Connects to the next URL that answers; confirm mode on channel 1. */
static bool connect_next(struct pub *p)
{
    for (int tries = 0; tries < p->c->urls.n; tries++) {
        struct amqp_connection_info ci;
        char *copy = strdup(p->c->urls.v[p->url_next]);
        amqp_socket_t *sock;
        struct timeval tv = {5, 0};
        amqp_table_entry_t caps_e[3], prop_e[1];
        amqp_table_t caps = {3, caps_e}, props = {1, prop_e};
        bool ok = false;

        p->url_next = (p->url_next + 1) % p->c->urls.n;
        if (!copy)
            return false;
        amqp_default_connection_info(&ci);
        p->conn = amqp_new_connection();
        if (amqp_parse_url(copy, &ci) == AMQP_STATUS_OK && p->conn &&
            (sock = amqp_tcp_socket_new(p->conn)) &&
            amqp_socket_open_noblock(sock, ci.host, ci.port, &tv) == AMQP_STATUS_OK) {
            caps_e[0].key = amqp_cstring_bytes("publisher_confirms");
            caps_e[1].key = amqp_cstring_bytes("basic.nack");
            caps_e[2].key = amqp_cstring_bytes("connection.blocked");
            for (int i = 0; i < 3; i++) {
                caps_e[i].value.kind = AMQP_FIELD_KIND_BOOLEAN;
                caps_e[i].value.value.boolean = 1;
            }
            prop_e[0].key = amqp_cstring_bytes("capabilities");
            prop_e[0].value.kind = AMQP_FIELD_KIND_TABLE;
            prop_e[0].value.value.table = caps;
            ok = rpc_ok(amqp_login_with_properties(p->conn, ci.vhost, 0, AMQP_DEFAULT_FRAME_SIZE,
                                                   10, &props, AMQP_SASL_METHOD_PLAIN, ci.user,
                                                   ci.password));
            if (ok) {
                amqp_channel_open(p->conn, CHANNEL);
                ok = rpc_ok(amqp_get_rpc_reply(p->conn));
            }
            if (ok) {
                amqp_confirm_select(p->conn, CHANNEL);
                ok = rpc_ok(amqp_get_rpc_reply(p->conn));
            }
        }
        free(copy);
        if (ok) {
            p->seq = 0;
            p->low = 1;
            p->last_progress = now_s();
            return true;
        }
        if (p->conn)
            amqp_destroy_connection(p->conn);
        p->conn = NULL;
    }
    return false;
}

/* Reads frames for up to wait_s (0: only what is there). false when the
 * connection failed (the caller drops it). */
static bool pump(struct pub *p, double wait_s)
{
    for (;;) {
        amqp_frame_t f;
        struct timeval tv = {(time_t)wait_s, (long)((wait_s - (double)(time_t)wait_s) * 1e6)};
        int rc;
        if (amqp_release_buffers_ok(p->conn))
            amqp_release_buffers(p->conn);
        rc = amqp_simple_wait_frame_noblock(p->conn, &f, &tv);
        if (rc == AMQP_STATUS_TIMEOUT)
            return true;
        if (rc != AMQP_STATUS_OK)
            return false;
        wait_s = 0; /* after one frame, take only what is already there */
        if (f.frame_type != AMQP_FRAME_METHOD)
            continue;
        switch (f.payload.method.id) {
        case AMQP_BASIC_ACK_METHOD: {
            amqp_basic_ack_t *a = f.payload.method.decoded;
            on_confirm(p, a->delivery_tag, a->multiple, true);
            break;
        }
        case AMQP_BASIC_NACK_METHOD: {
            amqp_basic_nack_t *n = f.payload.method.decoded;
            on_confirm(p, n->delivery_tag, n->multiple, false);
            break;
        }
        case AMQP_BASIC_RETURN_METHOD: {
            amqp_message_t m;
            long k;
            p->returns++;
            if (!rpc_ok(amqp_read_message(p->conn, f.channel, &m, 0)))
                return false;
            k = key_of_body(p, m.body.bytes, m.body.len);
            amqp_destroy_message(&m);
            /* The return comes before that publish's ack: mark the oldest
             * unsettled, unreturned publish of this key. */
            for (uint64_t s = p->low; k >= 0 && s <= p->seq; s++) {
                struct pending *e = &p->ring[s % WINDOW];
                if (e->seq == s && e->key == k && !e->returned) {
                    e->returned = true;
                    break;
                }
            }
            break;
        }
        case AMQP_CHANNEL_CLOSE_METHOD:
        case AMQP_CONNECTION_CLOSE_METHOD: return false;
        default: break;
        }
    }
}

static bool publish_one(struct pub *p, long k)
{
    char body[BODY_MAX];
    int len = body_for(p, k, body, sizeof body);
    amqp_basic_properties_t props;
    struct pending *e;

    memset(&props, 0, sizeof props);
    props._flags = AMQP_BASIC_DELIVERY_MODE_FLAG | AMQP_BASIC_CONTENT_TYPE_FLAG;
    props.delivery_mode = 2;
    props.content_type = amqp_cstring_bytes("application/json");
    if (amqp_basic_publish(p->conn, CHANNEL, amqp_cstring_bytes(""),
                           amqp_cstring_bytes(p->in->queue), 1, 0, &props,
                           (amqp_bytes_t){(size_t)len, body}) != AMQP_STATUS_OK)
        return false;
    p->seq++;
    e = &p->ring[p->seq % WINDOW];
    e->seq = p->seq;
    e->key = k;
    e->returned = false;
    p->n_pending++;
    return true;
}

/* Assigns kinds to the unique keys: exact counts, shuffled, key 0 normal. */
static bool plan(struct pub *p, uint64_t *rng)
{
    const struct opts *o = p->o;
    long dups = o->n * o->dup_pct / 100;
    p->unique = o->n - dups;
    if (o->poison + o->badjson + o->transient >= p->unique)
        return false;
    p->kind = calloc((size_t)p->unique, 1);
    p->copies = calloc((size_t)p->unique, sizeof *p->copies);
    if (!p->kind || !p->copies)
        return false;
    for (long i = 0, k = 1; k < p->unique && i < o->poison + o->badjson + o->transient; i++, k++)
        p->kind[k] = i < o->poison                ? K_POISON
                     : i < o->poison + o->badjson ? K_BADJSON
                                                  : K_TRANSIENT;
    for (long k = p->unique - 1; k > 1; k--) { /* Fisher-Yates over 1..unique-1 */
        long j = 1 + (long)(rnd(rng) % (uint64_t)k);
        unsigned char t = p->kind[k];
        p->kind[k] = p->kind[j];
        p->kind[j] = t;
    }
    return true;
}

static int write_manifest(const struct pub *p)
{
    FILE *f = fopen(p->o->manifest, "w");
    char key[BODY_MAX];
    if (!f) {
        fprintf(stderr, "idemq-chaos: %s: %s\n", p->o->manifest, strerror(errno));
        return -1;
    }
    for (long k = 0; k < p->unique; k++) {
        key_for(p, k, key, sizeof key);
        fprintf(f, "%s\t%s\t%d\t%ld\n", key, kind_names[p->kind[k]], p->copies[k],
                p->kind[k] == K_TRANSIENT ? 1 + k % 3 : 0L);
    }
    return fclose(f);
}

static int cmd_publish(const struct conf *c, const struct opts *o)
{
    struct pub p;
    uint64_t rng = 0x9E3779B97F4A7C15ull;
    long next_unique = 0, planned = 0;
    double t0 = now_s(), last_log = t0, backoff = 0.2;
    int rc = 1;

    if (!o->run || !o->manifest || o->n < 10) {
        fprintf(stderr, "idemq-chaos: publish needs -n N (>= 10), --run and --manifest\n");
        return 2;
    }
    memset(&p, 0, sizeof p);
    p.c = c;
    p.in = &c->inputs[0];
    for (int i = 0; o->input && i < c->n_inputs; i++)
        if (strcmp(c->inputs[i].name, o->input) == 0)
            p.in = &c->inputs[i];
    if (o->input && strcmp(p.in->name, o->input) != 0) {
        fprintf(stderr, "idemq-chaos: no input named %s in %s\n", o->input, o->config);
        return 2;
    }
    p.o = o;
    p.low = 1;
    for (const char *s = o->run; *s; s++)
        rng = (rng ^ (unsigned char)*s) * 0x100000001B3ull;
    if (!plan(&p, &rng)) {
        fprintf(stderr,
                "idemq-chaos: poison + badjson + transient must stay below the unique keys\n");
        goto out;
    }
    while (planned < o->n || p.redo_head < p.redo_tail || p.n_pending > 0) {
        double now = now_s();
        if (!p.conn) {
            if (!connect_next(&p)) {
                fprintf(stderr, "idemq-chaos: no broker URL answered; retrying in %.1f s\n",
                        backoff);
                sleep_s(backoff);
                backoff = backoff < 5 ? backoff * 2 : 5;
                continue;
            }
            if (p.reconnects++ || p.confirmed)
                fprintf(stderr, "idemq-chaos: publisher reconnected\n");
            backoff = 0.2;
        }
        if (now - last_log >= 5) {
            fprintf(stderr, "idemq-chaos: %ld/%ld planned messages sent, %ld confirmed\n",
                    planned, o->n, p.confirmed);
            last_log = now;
        }
        /* Something to send and room in the window (a paced run waits for
         * its schedule; copies to send again go first and are not paced). */
        /* The ring holds sequence numbers low .. low + WINDOW - 1. */
        if (p.seq + 1 < p.low + WINDOW &&
            (p.redo_head < p.redo_tail ||
             (planned < o->n && (o->rate <= 0 || t0 + (double)planned / o->rate <= now)))) {
            long k;
            if (p.redo_head < p.redo_tail) {
                k = p.redo[p.redo_head++];
            } else {
                bool dup = o->dup_pct > 0 && next_unique > 0 &&
                           (planned * o->dup_pct) / 100 != ((planned + 1) * o->dup_pct) / 100;
                if (next_unique >= p.unique)
                    dup = true;
                if (dup) {
                    k = (long)(rnd(&rng) % (uint64_t)next_unique);
                    for (int t = 0; t < 100 && p.kind[k] == K_BADJSON; t++)
                        k = (long)(rnd(&rng) % (uint64_t)next_unique);
                    if (p.kind[k] == K_BADJSON)
                        k = 0;
                } else {
                    k = next_unique++;
                }
                planned++;
            }
            if (!publish_one(&p, k)) {
                redo_push(&p, k);
                drop_connection(&p, "publish failed");
                continue;
            }
            if (!pump(&p, 0))
                drop_connection(&p, "connection lost");
            continue;
        }
        if (!pump(&p, o->rate > 0 ? 0.002 : 0.2)) {
            drop_connection(&p, "connection lost");
            continue;
        }
        if (p.n_pending > 0 && now_s() - p.last_progress > STALL_S)
            drop_connection(&p, "no confirm for 30 s");
    }
    if (write_manifest(&p))
        goto out;
    {
        double secs = now_s() - t0;
        printf("published=%ld planned=%ld unique=%ld poison=%ld badjson=%ld transient=%ld "
               "nacks=%ld returns=%ld unconfirmed_resent=%ld reconnects=%ld seconds=%.1f "
               "rate=%.0f\n",
               p.confirmed, o->n, p.unique, o->poison, o->badjson, o->transient, p.nacks,
               p.returns, p.lost, p.reconnects > 0 ? p.reconnects - 1 : 0, secs,
               (double)p.confirmed / (secs > 0 ? secs : 1));
    }
    rc = 0;
out:
    if (p.conn) {
        amqp_connection_close(p.conn, AMQP_REPLY_SUCCESS);
        amqp_destroy_connection(p.conn);
    }
    free(p.redo);
    free(p.kind);
    free(p.copies);
    return rc;
}

/* Every queue of every input: the work queues, the delay buckets, the DLQs. */
static int cmd_counts(const struct conf *c)
{
    struct broker *b;
    char err[512], name[TOPOLOGY_NAME_MAX];
    uint32_t n = 0;
    unsigned long work = 0, dead = 0, buckets = 0;
    if (broker_open(c, "idemq-chaos counts", false, &b, err, sizeof err)) {
        fprintf(stderr, "idemq-chaos: %s\n", err);
        return 1;
    }
    for (int i = 0; i < c->n_inputs; i++) {
        const struct conf_input *in = &c->inputs[i];
        if (broker_admin_queue_counts(b, in->queue, &n, NULL))
            goto fail;
        work += n;
        topology_dlq(in, name, sizeof name);
        if (broker_admin_queue_counts(b, name, &n, NULL))
            goto fail;
        dead += n;
        for (long bucket = TOPOLOGY_MIN_DELAY_MS; bucket <= c->max_delay_ms; bucket *= 2) {
            topology_bucket_queue(in, bucket, name, sizeof name);
            if (broker_admin_queue_counts(b, name, &n, NULL))
                goto fail;
            buckets += n;
        }
    }
    printf("work=%lu buckets=%lu dead=%lu\n", work, buckets, dead);
    broker_close(b);
    return 0;
fail:
    fprintf(stderr, "idemq-chaos: %s\n", broker_error(b));
    broker_close(b);
    return 1;
}

static int cmd_reset(const struct conf *c)
{
    struct broker *b;
    char err[512], name[TOPOLOGY_NAME_MAX];
    int rc = 0;
    if (broker_open(c, "idemq-chaos reset", false, &b, err, sizeof err)) {
        fprintf(stderr, "idemq-chaos: %s\n", err);
        return 1;
    }
    for (int i = 0; i < c->n_inputs && rc == 0; i++) {
        const struct conf_input *in = &c->inputs[i];
        /* Whatever is missing or fails here, the declare below says so. */
        for (long bucket = TOPOLOGY_MIN_DELAY_MS; bucket <= 86400000L; bucket *= 2) {
            topology_bucket_queue(in, bucket, name, sizeof name);
            if (broker_admin_delete_queue(b, name))
                break;
        }
        topology_dlq(in, name, sizeof name);
        if (broker_admin_delete_queue(b, name) || broker_admin_delete_queue(b, in->queue))
            fprintf(stderr, "idemq-chaos: %s\n", broker_error(b));
        topology_delay_exchange(in, name, sizeof name);
        if (broker_admin_delete_exchange(b, name))
            fprintf(stderr, "idemq-chaos: %s\n", broker_error(b));
        topology_dlx(in, name, sizeof name);
        if (broker_admin_delete_exchange(b, name))
            fprintf(stderr, "idemq-chaos: %s\n", broker_error(b));
        if (topology_declare(b, c, in)) {
            fprintf(stderr, "idemq-chaos: declare %s: %s\n", in->name, broker_error(b));
            rc = 1;
        }
    }
    broker_close(b);
    return rc;
}

/* ---------------------------------------------------------------- pgproxy
 *
 * The ambiguous commit. A loopback TCP proxy between one replica and
 * PostgreSQL that forwards both streams message by message (the v3 wire
 * protocol: an untyped start-up packet, then type byte + length) and, when
 * armed, cuts the next connection that commits, exactly where the client
 * cannot know the outcome. SIGUSR1 arms one cut of an explicit COMMIT (a
 * simple Query "COMMIT"/"END", or a Parse of one at its Sync), by turns:
 *   after     the COMMIT is forwarded, the server's whole reply (up to its
 *             ReadyForQuery) is read and thrown away, then both sides are
 *             closed: committed, the client never hears it
 *   before    a simple Query COMMIT is swallowed and both sides are closed:
 *             the server sees the connection end inside the transaction and
 *             rolls back (a Parse'd COMMIT runs at its Execute, before the
 *             Sync: it only takes "after" cuts)
 * SIGUSR2 arms one cut of kind
 *   implicit  like "after", for a provider step (a Parse naming
 *             idemq.provider_begin or idemq.provider_result, sent outside a
 *             transaction block: one statement that commits by itself)
 * Each signal keeps one cut of its kind armed at most, apart from the other.
 * From the client all look the same (commit sent, connection gone): an
 * idemq that acks then loses the job of a "before" cut, one that applies
 * again without asking the ledger doubles an "after" cut. An
 * SSLRequest or GSSENCRequest is answered 'N' by the proxy itself (the
 * client goes on in plain text, which the proxy can read). Output: a line
 * "listening on PORT" at start, then one line per cut ("cut N
 * after|before|implicit conn C at HH:MM:SS", UTC) on stdout; errors on
 * stderr. Runs until killed.
 */
#define PG_SSL_REQUEST 80877103
#define PG_GSSENC_REQUEST 80877104
#define PG_MSG_MAX (256L * 1024 * 1024)

enum { CUT_AFTER, CUT_BEFORE, CUT_IMPLICIT };
static atomic_int proxy_armed_explicit, proxy_armed_implicit; /* 1: one cut armed */
static atomic_long proxy_cuts, proxy_explicit;                 /* fired so far */
static struct sockaddr_in proxy_upstream;

struct proxy_pair {
    int cfd, sfd;
    long id;
    atomic_int refs;
    atomic_int cut_after; /* the server's next reply is dropped, then both closed */
    atomic_int idle;      /* the last ReadyForQuery said 'I': no transaction block */
};

static void proxy_on_signal(int sig)
{
    atomic_store(sig == SIGUSR1 ? &proxy_armed_explicit : &proxy_armed_implicit, 1);
}

static bool read_full(int fd, void *buf, size_t n)
{
    char *p = buf;
    while (n > 0) {
        ssize_t r = read(fd, p, n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return false;
        p += r;
        n -= (size_t)r;
    }
    return true;
}

static bool write_full(int fd, const void *buf, size_t n)
{
    const char *p = buf;
    while (n > 0) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return false;
        p += w;
        n -= (size_t)w;
    }
    return true;
}

static uint32_t be32(const unsigned char *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* Reads one typed message (type byte, length, body) into *buf (grown as
 * needed); *len is the whole message's size. */
static bool read_msg(int fd, unsigned char **buf, size_t *cap, size_t *len)
{
    unsigned char hdr[5];
    uint32_t n;
    if (!read_full(fd, hdr, 5))
        return false;
    n = be32(hdr + 1);
    if (n < 4 || n > PG_MSG_MAX)
        return false;
    if ((size_t)n + 1 > *cap) {
        unsigned char *g = realloc(*buf, (size_t)n + 1);
        if (!g)
            return false;
        *buf = g;
        *cap = (size_t)n + 1;
    }
    memcpy(*buf, hdr, 5);
    *len = (size_t)n + 1;
    return read_full(fd, *buf + 5, n - 4);
}

/* Is this SQL text a COMMIT (COMMIT, COMMIT WORK, END ...)? */
static bool is_commit_sql(const unsigned char *s, size_t n)
{
    size_t i = 0;
    while (i < n && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r'))
        i++;
    if (n - i >= 6 && strncasecmp((const char *)s + i, "COMMIT", 6) == 0 &&
        (n - i == 6 || !((s[i + 6] | 0x20) >= 'a' && (s[i + 6] | 0x20) <= 'z')))
        return true;
    return n - i >= 3 && strncasecmp((const char *)s + i, "END", 3) == 0 &&
           (n - i == 3 || !((s[i + 3] | 0x20) >= 'a' && (s[i + 3] | 0x20) <= 'z'));
}

static void pair_release(struct proxy_pair *pp)
{
    shutdown(pp->cfd, SHUT_RDWR);
    shutdown(pp->sfd, SHUT_RDWR);
    if (atomic_fetch_sub(&pp->refs, 1) == 1) {
        close(pp->cfd);
        close(pp->sfd);
        free(pp);
    }
}

/* Takes an armed cut for a commit (explicit, or a provider step's
 * implicit one; simple: a simple Query, which may be cut before): its kind
 * in *kind and its number (1, 2, ...), or 0 when none is armed. */
static long take_cut(bool explicit, bool simple, int *kind)
{
    if (!atomic_exchange(explicit ? &proxy_armed_explicit : &proxy_armed_implicit, 0))
        return 0;
    if (!explicit)
        *kind = CUT_IMPLICIT;
    else if (!simple)
        *kind = CUT_AFTER;
    else
        *kind = atomic_fetch_add(&proxy_explicit, 1) % 2 == 0 ? CUT_AFTER : CUT_BEFORE;
    return atomic_fetch_add(&proxy_cuts, 1) + 1;
}

/* Does the text of this Parse name a provider step that writes? */
static bool is_provider_step(const unsigned char *q, size_t n)
{
    static const char *const steps[] = {"idemq.provider_begin", "idemq.provider_result"};
    for (size_t k = 0; k < sizeof steps / sizeof steps[0]; k++) {
        size_t m = strlen(steps[k]);
        for (size_t i = 0; i + m <= n; i++)
            if (memcmp(q + i, steps[k], m) == 0)
                return true;
    }
    return false;
}

/* Client to server: the start-up phase, then typed messages. */
static void *proxy_c2s(void *arg)
{
    struct proxy_pair *pp = arg;
    unsigned char *buf = NULL, hdr[8];
    size_t cap = 0, len = 0;
    bool commit_parsed = false; /* a Parse of COMMIT waits for its Sync */
    bool step_parsed = false;   /* a Parse of a provider step waits for its Sync */

    for (;;) { /* untyped packets: SSL/GSSENC requests, then start-up or cancel */
        uint32_t n, code;
        if (!read_full(pp->cfd, hdr, 8))
            goto out;
        n = be32(hdr);
        code = be32(hdr + 4);
        if (n < 8 || n > 10000)
            goto out;
        if (code == PG_SSL_REQUEST || code == PG_GSSENC_REQUEST) {
            if (!write_full(pp->cfd, "N", 1))
                goto out;
            continue;
        }
        if (!(buf = malloc(n)))
            goto out;
        cap = n;
        memcpy(buf, hdr, 8);
        if (!read_full(pp->cfd, buf + 8, n - 8) || !write_full(pp->sfd, buf, n))
            goto out;
        break;
    }
    while (read_msg(pp->cfd, &buf, &cap, &len)) {
        bool commit = false, commit_ext = false, step = false;
        long cut = 0;
        int kind = CUT_AFTER;
        if (buf[0] == 'Q') {
            commit = is_commit_sql(buf + 5, len - 5);
        } else if (buf[0] == 'P') { /* statement name \0 query \0 ... */
            const unsigned char *q = memchr(buf + 5, '\0', len - 5);
            if (q && ++q < buf + len) {
                size_t qn = strnlen((const char *)q, (size_t)(buf + len - q));
                commit_parsed = commit_parsed || is_commit_sql(q, qn);
                step_parsed = step_parsed || is_provider_step(q, qn);
            }
        } else if (buf[0] == 'S') {
            commit_ext = commit_parsed;
            step = step_parsed && atomic_load(&pp->idle);
            commit_parsed = step_parsed = false;
        }
        if (commit || commit_ext)
            cut = take_cut(true, commit, &kind);
        else if (step)
            cut = take_cut(false, false, &kind);
        if (cut > 0) {
            static const char *const cut_names[] = {"after", "before", "implicit"};
            bool after = kind != CUT_BEFORE;
            time_t now = time(NULL);
            struct tm tm;
            char at[16];
            strftime(at, sizeof at, "%H:%M:%S", gmtime_r(&now, &tm));
            printf("cut %ld %s conn %ld at %s\n", cut, cut_names[kind], pp->id, at);
            fflush(stdout);
            if (!after)
                goto out;
            atomic_store(&pp->cut_after, 1);
            write_full(pp->sfd, buf, len);
            /* The other thread drops the reply and closes both sides. */
            break;
        }
        if (!write_full(pp->sfd, buf, len))
            break;
    }
out:
    free(buf);
    if (!atomic_load(&pp->cut_after))
        pair_release(pp);
    else if (atomic_fetch_sub(&pp->refs, 1) == 1) { /* the other side is done already */
        close(pp->cfd);
        close(pp->sfd);
        free(pp);
    }
    return NULL;
}

/* Server to client: typed messages; after a cut, the reply is dropped up to
 * its ReadyForQuery (or for at most 10 s), then both sides are closed. */
static void *proxy_s2c(void *arg)
{
    struct proxy_pair *pp = arg;
    unsigned char *buf = NULL;
    size_t cap = 0, len = 0;

    for (;;) {
        if (atomic_load(&pp->cut_after)) {
            struct pollfd pfd = {pp->sfd, POLLIN, 0};
            if (poll(&pfd, 1, 10000) <= 0 || !read_msg(pp->sfd, &buf, &cap, &len) ||
                buf[0] == 'Z')
                break;
            continue;
        }
        if (!read_msg(pp->sfd, &buf, &cap, &len))
            break;
        if (buf[0] == 'Z' && len >= 6)
            atomic_store(&pp->idle, buf[5] == 'I');
        if (atomic_load(&pp->cut_after)) { /* came with or after the COMMIT */
            if (buf[0] == 'Z')
                break;
            continue;
        }
        if (!write_full(pp->cfd, buf, len))
            break;
    }
    free(buf);
    pair_release(pp);
    return NULL;
}

static int cmd_pgproxy(int argc, char **argv)
{
    const char *to = NULL;
    long listen_port = 0, conns = 0;
    int lfd, one = 1;
    struct sockaddr_in sa;
    socklen_t sl = sizeof sa;
    struct sigaction act;
    char host[64];
    const char *colon;

    for (int i = 2; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--to") == 0)
            to = argv[i + 1];
        else if (strcmp(argv[i], "--listen") == 0)
            listen_port = strtol(argv[i + 1], NULL, 10);
        else
            to = NULL, i = argc;
    }
    memset(&proxy_upstream, 0, sizeof proxy_upstream);
    proxy_upstream.sin_family = AF_INET;
    if (!to || argc % 2 != 0 || !(colon = strrchr(to, ':')) || colon - to >= (long)sizeof host ||
        listen_port < 0 || listen_port > 65535) {
        fprintf(stderr, "usage: idemq-chaos pgproxy --to HOST:PORT [--listen PORT]\n");
        return 2;
    }
    memcpy(host, to, (size_t)(colon - to));
    host[colon - to] = '\0';
    proxy_upstream.sin_port = htons((uint16_t)strtol(colon + 1, NULL, 10));
    if (inet_pton(AF_INET, host, &proxy_upstream.sin_addr) != 1) {
        fprintf(stderr, "idemq-chaos pgproxy: %s is not an IPv4 address\n", host);
        return 2;
    }
    memset(&act, 0, sizeof act);
    act.sa_handler = proxy_on_signal;
    act.sa_flags = SA_RESTART;
    sigaction(SIGUSR1, &act, NULL);
    sigaction(SIGUSR2, &act, NULL);
    signal(SIGPIPE, SIG_IGN);

    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    sa.sin_port = htons((uint16_t)listen_port);
    if ((lfd = socket(AF_INET, SOCK_STREAM, 0)) < 0 ||
        setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) ||
        bind(lfd, (struct sockaddr *)&sa, sizeof sa) || listen(lfd, 64) ||
        getsockname(lfd, (struct sockaddr *)&sa, &sl)) {
        fprintf(stderr, "idemq-chaos pgproxy: cannot listen: %s\n", strerror(errno));
        return 1;
    }
    printf("listening on %u\n", ntohs(sa.sin_port));
    fflush(stdout);
    for (;;) {
        struct proxy_pair *pp;
        pthread_t t1, t2;
        int cfd = accept(lfd, NULL, NULL), sfd;
        if (cfd < 0) {
            if (errno == EINTR || errno == ECONNABORTED || errno == EMFILE)
                continue;
            fprintf(stderr, "idemq-chaos pgproxy: accept: %s\n", strerror(errno));
            return 1;
        }
        sfd = socket(AF_INET, SOCK_STREAM, 0);
        if (sfd < 0 || connect(sfd, (struct sockaddr *)&proxy_upstream, sizeof proxy_upstream)) {
            /* PostgreSQL is down (a fault of its own): the client sees a
             * refused connection as it would without the proxy. */
            if (sfd >= 0)
                close(sfd);
            close(cfd);
            continue;
        }
        setsockopt(cfd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        setsockopt(sfd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        if (!(pp = calloc(1, sizeof *pp))) {
            close(cfd);
            close(sfd);
            continue;
        }
        pp->cfd = cfd;
        pp->sfd = sfd;
        pp->id = ++conns;
        atomic_init(&pp->refs, 2);
        if (pthread_create(&t1, NULL, proxy_c2s, pp)) {
            close(cfd);
            close(sfd);
            free(pp);
            continue;
        }
        pthread_detach(t1);
        if (pthread_create(&t2, NULL, proxy_s2c, pp)) {
            pair_release(pp); /* the s2c side: ends c2s too */
            continue;
        }
        pthread_detach(t2);
    }
}

static int parse(int argc, char **argv, struct opts *o)
{
    static const struct option longopts[] = {
        {"config", required_argument, NULL, 'c'},    {"jobs", required_argument, NULL, 'n'},
        {"run", required_argument, NULL, 'r'},       {"manifest", required_argument, NULL, 'm'},
        {"dup-pct", required_argument, NULL, 'd'},   {"poison", required_argument, NULL, 'p'},
        {"badjson", required_argument, NULL, 'b'},   {"transient", required_argument, NULL, 't'},
        {"rate", required_argument, NULL, 'R'},      {"input", required_argument, NULL, 'i'},
        {NULL, 0, NULL, 0}};
    int ch;
    char *end = NULL;

    memset(o, 0, sizeof *o);
    o->dup_pct = 10;
    while ((ch = getopt_long(argc, argv, "c:n:", longopts, NULL)) != -1) {
        errno = 0;
        switch (ch) {
        case 'c': o->config = optarg; continue;
        case 'r': o->run = optarg; continue;
        case 'm': o->manifest = optarg; continue;
        case 'i': o->input = optarg; continue;
        case 'n': o->n = strtol(optarg, &end, 10); break;
        case 'd': o->dup_pct = (int)strtol(optarg, &end, 10); break;
        case 'p': o->poison = strtol(optarg, &end, 10); break;
        case 'b': o->badjson = strtol(optarg, &end, 10); break;
        case 't': o->transient = strtol(optarg, &end, 10); break;
        case 'R': o->rate = strtod(optarg, &end); break;
        default: return -1;
        }
        if (errno || !end || *end)
            return -1;
    }
    if (optind != argc - 1 || !o->config)
        return -1;
    o->cmd = argv[optind];
    if (o->dup_pct < 0 || o->dup_pct > 90 || o->n < 0 || o->poison < 0 || o->badjson < 0 ||
        o->transient < 0 || o->rate < 0)
        return -1;
    if (o->run && strspn(o->run, "abcdefghijklmnopqrstuvwxyz0123456789-_") != strlen(o->run))
        return -1;
    return 0;
}

int main(int argc, char **argv)
{
    struct opts o;
    struct conf *c;
    char err[1024];
    int rc;

    if (argc > 1 && strcmp(argv[1], "pgproxy") == 0)
        return cmd_pgproxy(argc, argv);
    if (parse(argc, argv, &o)) {
        fprintf(stderr, "usage: idemq-chaos publish|counts|reset -c CFG [options] (see the top "
                        "of scripts/chaos_tool.c)\n");
        return 2;
    }
    if (conf_load(o.config, &c, err, sizeof err)) {
        fprintf(stderr, "idemq-chaos: %s\n", err);
        return 3;
    }
    log_current_level = LOG_LVL_ERROR;
    if (strcmp(o.cmd, "publish") == 0)
        rc = cmd_publish(c, &o);
    else if (strcmp(o.cmd, "counts") == 0)
        rc = cmd_counts(c);
    else if (strcmp(o.cmd, "reset") == 0)
        rc = cmd_reset(c);
    else {
        fprintf(stderr, "idemq-chaos: unknown command %s\n", o.cmd);
        rc = 2;
    }
    conf_free(c);
    return rc;
}
