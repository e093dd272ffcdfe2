/*
 * topology: declares and verifies the work, delay and dead-letter objects
 * of an input (names and bucket arithmetic in topology.h).
 */
#include "topology.h"

#include "celery.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "broker_admin.h"
#include "log.h"

void topology_delay_exchange(const struct conf_input *in, char *buf, size_t len)
{
    snprintf(buf, len, "%s.retry", in->queue);
}

void topology_bucket_queue(const struct conf_input *in, long bucket_ms, char *buf, size_t len)
{
    snprintf(buf, len, "%s.retry.%ld", in->queue, bucket_ms);
}

void topology_dlx(const struct conf_input *in, char *buf, size_t len)
{
    snprintf(buf, len, "%s.dlx", in->queue);
}

void topology_dlq(const struct conf_input *in, char *buf, size_t len)
{
    snprintf(buf, len, "%s.dead", in->queue);
}

void topology_partition_queue(const struct conf_input *in, int k, char *buf, size_t len)
{
    snprintf(buf, len, "%s.p%d", in->queue, k);
}

/* Appends "|" (unless first) and s, regex-escaped unless raw, to buf. */
static bool perm_add(char *buf, size_t len, const char *s, bool raw)
{
    size_t o = strlen(buf);
    if (o > 2 && o + 1 < len) /* after "^(" */
        buf[o++] = '|';
    for (; *s; s++) {
        if (o + 2 >= len)
            return false;
        if (!raw && strchr(".^$*+?()[]{}|\\", *s))
            buf[o++] = '\\';
        buf[o++] = *s;
    }
    buf[o] = '\0';
    return true;
}

/* Adds name + suffix (suffix is a regex) to buf. */
static bool perm_add_suffixed(char *buf, size_t len, const char *name, const char *suffix)
{
    if (!perm_add(buf, len, name, false))
        return false;
    /* the "|" of perm_add went before name; suffix follows it directly */
    if (strlen(buf) + strlen(suffix) + 1 > len)
        return false;
    strcat(buf, suffix);
    return true;
}

static bool perm_close(char *buf, size_t len)
{
    if (strlen(buf) == 2) { /* nothing: match no name */
        snprintf(buf, len, "^$");
        return true;
    }
    if (strlen(buf) + 3 > len)
        return false;
    strcat(buf, ")$");
    return true;
}

#define UUID_RE "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"

bool topology_permissions(const struct conf *c, enum topology_user who, char *configure,
                          char *write, char *read, size_t len)
{
    bool ok = len > 8, celery = false;
    if (!ok)
        return false;
    snprintf(configure, len, "^(");
    snprintf(write, len, "^(");
    snprintf(read, len, "^(");
    for (int i = 0; i < c->n_inputs && ok; i++) {
        const struct conf_input *in = &c->inputs[i];
        bool parts = CONF_INPUT_ORDERED(in);
        celery = celery || in->celery;
        if (who == TOPOLOGY_USER_RUN) {
            if (!parts)
                ok = ok && perm_add_suffixed(write, len, in->queue, "\\.retry");
            ok = ok && perm_add_suffixed(write, len, in->queue, "\\.dlx");
            ok = ok && perm_add_suffixed(read, len, in->queue, parts ? "\\.p[0-9]+" : "");
            continue;
        }
        /* the operator: every object of the input */
        for (int k = 0; k < 3 && ok; k++) {
            char *b = k == 0 ? configure : k == 1 ? write : read;
            ok = ok &&
                 perm_add_suffixed(b, len, in->queue,
                                   "(\\.p[0-9]+|\\.retry(\\.[0-9]+)?|\\.dlx|\\.dead)?");
            if (in->exchange[0] && strcmp(in->exchange, in->queue) != 0)
                ok = ok && perm_add(b, len, in->exchange, false);
        }
    }
    if (celery && ok) {
        if (who == TOPOLOGY_USER_RUN) {
            ok = perm_add(write, len, TOPOLOGY_CELERY_REPLIES, false) &&
                 perm_add(write, len, UUID_RE, true) &&
                 perm_add(read, len, TOPOLOGY_CELERY_REPLIES, false);
        } else {
            for (int k = 0; k < 3 && ok; k++)
                ok = perm_add(k == 0 ? configure : k == 1 ? write : read, len,
                              TOPOLOGY_CELERY_REPLIES, false);
        }
    }
    if (who == TOPOLOGY_USER_OPERATOR && ok)
        ok = perm_add(write, len, "amq.default", false);
    if (who == TOPOLOGY_USER_RUN)
        snprintf(configure, len, "^(");
    return ok && perm_close(configure, len) && perm_close(write, len) && perm_close(read, len);
}

long topology_clamp_delay(const struct conf *c, long delay_ms)
{
    if (delay_ms > c->max_delay_ms)
        delay_ms = c->max_delay_ms;
    if (delay_ms < TOPOLOGY_MIN_DELAY_MS)
        delay_ms = TOPOLOGY_MIN_DELAY_MS;
    return delay_ms;
}

long topology_bucket(long delay_ms)
{
    long b = TOPOLOGY_MIN_DELAY_MS;
    while (b * 2 <= delay_ms)
        b *= 2;
    return b;
}

/*
 * Queue arguments. Quorum queues carry an explicit delivery
 * limit (RabbitMQ 4.x defaults to 20 and then drops or dead-letters behind
 * idemq's back) and dead-letter at-least-once into <queue>.dlx, so the
 * broker's last resort lands in the same <queue>.dead as idemq's parks.
 * The legacy form is what idemq declared before: an existing queue keeps
 * its arguments, so it is still accepted (with a warning).
 */
static json_t *work_queue_args(const struct conf_input *in, bool legacy)
{
    char dlx[TOPOLOGY_NAME_MAX];
    json_t *a = json_pack("{s:s}", "x-queue-type", in->queue_type);
    if (legacy)
        return a;
    /* Every work queue dead-letters into <queue>.dlx: what idemq rejects
     * (a delivery the client library cannot decode) lands in <queue>.dead
     * like every park. */
    topology_dlx(in, dlx, sizeof dlx);
    json_object_set_new(a, "x-dead-letter-exchange", json_string(dlx));
    json_object_set_new(a, "x-dead-letter-routing-key", json_string(in->queue));
    if (strcmp(in->queue_type, "quorum") != 0)
        return a;
    json_object_set_new(a, "x-delivery-limit", json_integer(in->delivery_limit));
    json_object_set_new(a, "x-dead-letter-strategy", json_string("at-least-once"));
    json_object_set_new(a, "x-overflow", json_string("reject-publish"));
    return a;
}

static json_t *partition_args(const struct conf_input *in, bool legacy)
{
    json_t *a = work_queue_args(in, legacy);
    json_object_set_new(a, "x-single-active-consumer", json_true());
    return a;
}

static json_t *bucket_args(const struct conf_input *in, bool legacy)
{
    /* Per-message TTL is what makes a bucket; expired messages go straight
     * back to the work queue (not via the work exchange, which might fan
     * out). A quorum input's buckets are quorum queues: replicated
     * on the cluster's nodes, and dead-lettering at least once (RabbitMQ 3.10
     * keeps the message until the work queue confirmed it), so neither a node
     * crash nor the expiry moment loses a retry, and no single node holds
     * every retry. A classic input's buckets stay classic, on the node that
     * declared them; the ledger's retry copies (consumer/rescue.c) cover them.
     * The legacy form (classic buckets of a quorum input declared by an
     * older idemq) is accepted with a warning. */
    if (!legacy && strcmp(in->queue_type, "quorum") == 0)
        return json_pack("{s:s,s:s,s:s,s:s,s:s}", "x-queue-type", "quorum",
                         "x-dead-letter-exchange", "", "x-dead-letter-routing-key", in->queue,
                         "x-dead-letter-strategy", "at-least-once", "x-overflow",
                         "reject-publish");
    return json_pack("{s:s,s:s,s:s}", "x-queue-type", "classic", "x-dead-letter-exchange", "",
                     "x-dead-letter-routing-key", in->queue);
}

static json_t *dlq_args(const struct conf_input *in, bool legacy)
{
    json_t *a = json_pack("{s:s}", "x-queue-type", in->queue_type);
    /* Tools browse <queue>.dead (get, then requeue), which counts as a
     * delivery of a quorum queue: no practical limit there. */
    if (!legacy && strcmp(in->queue_type, "quorum") == 0)
        json_object_set_new(a, "x-delivery-limit", json_integer(TOPOLOGY_DLQ_DELIVERY_LIMIT));
    return a;
}

enum mode { MODE_DECLARE, MODE_VERIFY, MODE_PASSIVE };

/* Queues accepted in the legacy form, and the delivery limit the broker
 * imposes on each (0: none). */
static pthread_mutex_t legacy_lock = PTHREAD_MUTEX_INITIALIZER;
static char legacy_names[64][TOPOLOGY_NAME_MAX];
static int legacy_limits[64];
static int n_legacy;

int topology_broker_delivery_limit(const char *queue)
{
    int limit = 0;
    pthread_mutex_lock(&legacy_lock);
    for (int i = 0; i < n_legacy; i++)
        if (strcmp(legacy_names[i], queue) == 0)
            limit = legacy_limits[i];
    pthread_mutex_unlock(&legacy_lock);
    return limit;
}

/* Warns once per process and queue that it lacks the arguments of this
 * version (declared by an older idemq), and notes the delivery limit the
 * broker gives such a queue (broker_limit, 0: none). Any thread. */
static void warn_legacy(const char *name, int broker_limit)
{
    bool seen = false;
    pthread_mutex_lock(&legacy_lock);
    for (int i = 0; i < n_legacy && !seen; i++)
        if ((seen = strcmp(legacy_names[i], name) == 0))
            legacy_limits[i] = broker_limit;
    if (!seen && n_legacy < 64) {
        snprintf(legacy_names[n_legacy], sizeof legacy_names[0], "%s", name);
        legacy_limits[n_legacy++] = broker_limit;
    }
    pthread_mutex_unlock(&legacy_lock);
    if (!seen)
        log_warn("queue %s exists without dead-lettering into its .dlx (and, for a quorum "
                 "queue, without x-delivery-limit), declared by an application, or by an older "
                 "idemq; it is used as it is: a delivery idemq "
                 "rejects would be dropped, and a quorum queue gets the broker's delivery limit "
                 "(RabbitMQ 4.x: 20, then dropped or dead-lettered); set them with a policy, "
                 "see adapters/README.md \"Quorum delivery limits\"",
                 name);
}

/*
 * Declares (or, when verifying, checks then redeclares; passive: only
 * checks) one queue. args(in, legacy) builds the arguments; a queue that
 * exists with the legacy arguments is accepted with a warning.
 */
static idemq_err_t queue(struct broker *b, const struct conf_input *in, const char *name,
                         json_t *(*args)(const struct conf_input *, bool), enum mode m)
{
    idemq_err_t err = IDEMQ_OK;
    json_t *a, *old;
    if (m != MODE_DECLARE)
        err = broker_admin_declare_queue(b, name, NULL, true);
    if (err || m == MODE_PASSIVE)
        return err;
    a = args(in, false);
    old = args(in, true);
    err = broker_admin_declare_queue(b, name, a, false);
    if (err && strstr(broker_error(b), "406") && !json_equal(a, old) &&
        broker_admin_declare_queue(b, name, old, false) == IDEMQ_OK) {
        /* RabbitMQ 4 gives a quorum queue without x-delivery-limit one of
         * 20 (then drops the message: no dead-letter exchange either). */
        bool quorum = strcmp(in->queue_type, "quorum") == 0 &&
                      (args == work_queue_args || args == partition_args);
        warn_legacy(name, quorum && broker_server_major(b) >= 4
                              ? TOPOLOGY_BROKER_DEFAULT_DELIVERY_LIMIT
                              : 0);
        err = IDEMQ_OK;
    }
    json_decref(a);
    json_decref(old);
    return err;
}

static idemq_err_t exchange(struct broker *b, const char *name, const char *type, json_t *args,
                           enum mode m)
{
    idemq_err_t err = IDEMQ_OK;
    if (m != MODE_DECLARE)
        err = broker_admin_declare_exchange(b, name, type, true, NULL);
    if (!err && m != MODE_PASSIVE)
        err = broker_admin_declare_exchange(b, name, type, false, args);
    return err;
}

/* queue.bind, except in passive mode (binding needs permissions the
 * least-privileged user lacks, and re-binding would undo an operator). */
static idemq_err_t bind(struct broker *b, const char *queue, const char *ex, const char *key,
                        enum mode m)
{
    return m == MODE_PASSIVE ? IDEMQ_OK : broker_admin_bind(b, queue, ex, key, NULL);
}

static idemq_err_t dead_objects(struct broker *b, const struct conf_input *in, enum mode m)
{
    char name[TOPOLOGY_NAME_MAX], ex[TOPOLOGY_NAME_MAX];
    idemq_err_t err;
    topology_dlx(in, ex, sizeof ex);
    topology_dlq(in, name, sizeof name);
    if ((err = exchange(b, ex, "direct", NULL, m)))
        return err;
    if ((err = queue(b, in, name, dlq_args, m)))
        return err;
    return bind(b, name, ex, in->queue, m);
}

/* Ordered lanes: the consistent-hash exchange and its partition queues. */
static idemq_err_t walk_partitioned(struct broker *b, const struct conf_input *in, enum mode m)
{
    char name[TOPOLOGY_NAME_MAX];
    json_t *xargs = in->hash_header[0] ? json_pack("{s:s}", "hash-header", in->hash_header)
                                       : NULL;
    idemq_err_t err = exchange(b, in->exchange, "x-consistent-hash", xargs, m);

    json_decref(xargs);
    for (int k = 0; !err && k < in->partitions; k++) {
        topology_partition_queue(in, k, name, sizeof name);
        err = queue(b, in, name, partition_args, m);
        if (!err)
            err = bind(b, name, in->exchange, "1", m); /* equal weights */
    }
    if (!err)
        err = dead_objects(b, in, m);
    return err;
}

/* ---- Celery >= 5.5 native delayed delivery (kombu) ---- */

void topology_celery_delayed_exchange(int level, char *buf, size_t len)
{
    snprintf(buf, len, "celery_delayed_%d", level);
}

void topology_celery_delayed_key(int level, bool onward, char *buf, size_t len)
{
    size_t off = 0;
    buf[0] = '\0';
    for (int i = level; i < TOPOLOGY_CELERY_DELAYED_LEVELS - 1 && off + 2 < len; i++)
        off += (size_t)snprintf(buf + off, len - off, "*.");
    if (off < len)
        snprintf(buf + off, len - off, "%s", onward ? "0.#" : "1.#");
}

void topology_celery_delayed_binding(const struct conf_input *in, char *buf, size_t len)
{
    snprintf(buf, len, "%s%s", in->routing_key[0] == '#' ? "" : "#.", in->routing_key);
}

bool topology_celery_delayed(const struct conf_input *in)
{
    return in->celery && strcmp(in->queue_type, "quorum") == 0 &&
           strcmp(in->exchange_type, "direct") != 0 && in->exchange[0];
}

/* The arguments kombu declares level's queue with (quorum). */
static json_t *delayed_queue_args(int level)
{
    char next[64];
    if (level > 0)
        topology_celery_delayed_exchange(level - 1, next, sizeof next);
    else
        snprintf(next, sizeof next, "%s", TOPOLOGY_CELERY_DELAYED_DELIVERY);
    return json_pack("{s:s, s:s, s:I, s:s, s:s}", "x-queue-type", "quorum", "x-overflow",
                     "reject-publish", "x-message-ttl", (json_int_t)1000 << level,
                     "x-dead-letter-exchange", next, "x-dead-letter-strategy", "at-least-once");
}

/*
 * What a Celery >= 5.5 producer on quorum queues sends countdown/ETA tasks
 * through (kombu.transport.native_delayed_delivery, declared by Celery's
 * worker, which idemq replaces): the chain celery_delayed_27 .. 0 (topic
 * exchanges and quorum queues with TTL 2^level s dead-lettering to the next
 * level), celery_delayed_delivery, and the input's own bindings from it
 * back to its exchange and queue (key "#.<routing_key>"). Declared in full
 * by `idemq declare`; a verify checks the chain's ends exist and (full)
 * re-binds the input's part.
 */
static idemq_err_t celery_delayed(struct broker *b, const struct conf_input *in, enum mode m)
{
    char name[64], other[64], key[128];
    idemq_err_t err = IDEMQ_OK;

    if (m == MODE_DECLARE) {
        for (int level = TOPOLOGY_CELERY_DELAYED_LEVELS - 1; level >= 0 && !err; level--) {
            json_t *args = delayed_queue_args(level);
            topology_celery_delayed_exchange(level, name, sizeof name);
            topology_celery_delayed_key(level, false, key, sizeof key);
            if (!args)
                return IDEMQ_ERR_NOMEM;
            if (!(err = broker_admin_declare_exchange(b, name, "topic", false, NULL)) &&
                !(err = broker_admin_declare_queue(b, name, args, false)))
                err = broker_admin_bind(b, name, name, key, NULL);
            json_decref(args);
        }
        for (int level = TOPOLOGY_CELERY_DELAYED_LEVELS - 1; level > 0 && !err; level--) {
            topology_celery_delayed_exchange(level, name, sizeof name);
            topology_celery_delayed_exchange(level - 1, other, sizeof other);
            topology_celery_delayed_key(level, true, key, sizeof key);
            err = broker_admin_bind_exchange(b, other, name, key);
        }
        if (!err)
            err = broker_admin_declare_exchange(b, TOPOLOGY_CELERY_DELAYED_DELIVERY, "topic",
                                                false, NULL);
        if (!err) {
            topology_celery_delayed_exchange(0, name, sizeof name);
            topology_celery_delayed_key(0, true, key, sizeof key);
            err = broker_admin_bind_exchange(b, TOPOLOGY_CELERY_DELAYED_DELIVERY, name, key);
        }
    } else {
        topology_celery_delayed_exchange(TOPOLOGY_CELERY_DELAYED_LEVELS - 1, name, sizeof name);
        if (!(err = broker_admin_declare_exchange(b, name, "topic", true, NULL)))
            err = broker_admin_declare_exchange(b, TOPOLOGY_CELERY_DELAYED_DELIVERY, "topic",
                                                true, NULL);
    }
    if (err || m == MODE_PASSIVE)
        return err;
    topology_celery_delayed_binding(in, key, sizeof key);
    if (!(err = broker_admin_bind_exchange(b, in->exchange, TOPOLOGY_CELERY_DELAYED_DELIVERY,
                                           key)))
        err = broker_admin_bind(b, in->queue, in->exchange, key, NULL);
    return err;
}

static idemq_err_t walk(struct broker *b, const struct conf *c, const struct conf_input *in,
                        enum mode m)
{
    char name[TOPOLOGY_NAME_MAX], ex[TOPOLOGY_NAME_MAX], key[32];
    idemq_err_t err;

    if (CONF_INPUT_ORDERED(in))
        return walk_partitioned(b, in, m);
    if (in->exchange[0] && (err = exchange(b, in->exchange, in->exchange_type, NULL, m)))
        return err;
    if ((err = queue(b, in, in->queue, work_queue_args, m)))
        return err;
    if (in->exchange[0] && (err = bind(b, in->queue, in->exchange, in->routing_key, m)))
        return err;

    topology_delay_exchange(in, ex, sizeof ex);
    if ((err = exchange(b, ex, "direct", NULL, m)))
        return err;
    for (long bucket = TOPOLOGY_MIN_DELAY_MS; bucket <= c->max_delay_ms; bucket *= 2) {
        topology_bucket_queue(in, bucket, name, sizeof name);
        snprintf(key, sizeof key, "%ld", bucket);
        if ((err = queue(b, in, name, bucket_args, m)))
            return err;
        if ((err = bind(b, name, ex, key, m)))
            return err;
    }

    if ((err = dead_objects(b, in, m)))
        return err;
    /* Celery results go through a direct exchange that reaches only the
     * reply queues bound to it, never through amq.default */
    if (in->celery && (err = exchange(b, CELERY_REPLIES_EXCHANGE, "direct", NULL, m)))
        return err;
    if (topology_celery_delayed(in) && (err = celery_delayed(b, in, m)))
        return err;
    return IDEMQ_OK;
}

idemq_err_t topology_declare(struct broker *b, const struct conf *c, const struct conf_input *in)
{
    return walk(b, c, in, MODE_DECLARE);
}

idemq_err_t topology_verify(struct broker *b, const struct conf *c, const struct conf_input *in,
                            char *errbuf, size_t errlen)
{
    static atomic_int said_passive;
    idemq_err_t err = walk(b, c, in, c->topology_passive ? MODE_PASSIVE : MODE_VERIFY);
    if (err) {
        const char *e = broker_error(b);
        snprintf(errbuf, errlen, "input %s: unsafe topology: %s; run `idemq declare`%s", in->name,
                 e,
                 strstr(e, "403") && !c->topology_passive
                     ? " (a user without configure permission can run with topology.verify "
                       "= \"passive\")"
                     : "");
    } else if (c->topology_passive && !atomic_exchange(&said_passive, 1)) {
        log_info("topology.verify = passive: checked that every exchange and queue of the "
                 "inputs exists; NOT checked: queue arguments (x-queue-type, x-delivery-limit, "
                 "dead-lettering, single active consumer) and bindings (that needs configure "
                 "permission: run `idemq declare` as an administrator, or compare them in the "
                 "management UI or API)");
    }
    return err;
}

bool topology_is_input_queue(const struct conf_input *in, const char *queue)
{
    char q[TOPOLOGY_NAME_MAX];
    if (!queue)
        return false;
    if (!CONF_INPUT_ORDERED(in))
        return strcmp(queue, in->queue) == 0;
    for (int k = 0; k < in->partitions; k++) {
        topology_partition_queue(in, k, q, sizeof q);
        if (strcmp(queue, q) == 0)
            return true;
    }
    return false;
}
