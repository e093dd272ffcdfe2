/*
 * topology: declares and verifies the work, delay and dead-letter objects
 * of an input (names and bucket arithmetic in topology.h).
 */
#include "topology.h"

#include <stdio.h>
#include <string.h>

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

static json_t *work_queue_args(const struct conf_input *in)
{
    return json_pack("{s:s}", "x-queue-type", in->queue_type);
}

static json_t *bucket_args(const struct conf_input *in)
{
    /* Per-message TTL is what makes a bucket; expired messages go straight
     * back to the work queue (not via the work exchange, which might fan
     * out). A quorum input's buckets are quorum queues (issue 12): replicated
     * on the cluster's nodes, and dead-lettering at least once (RabbitMQ 3.10
     * keeps the message until the work queue confirmed it), so neither a node
     * crash nor the expiry moment loses a retry, and no single node holds
     * every retry. A classic input's buckets stay classic, on the node that
     * declared them; the ledger's retry copies (consumer/rescue.c) cover them. */
    if (strcmp(in->queue_type, "quorum") == 0)
        return json_pack("{s:s,s:s,s:s,s:s,s:s}", "x-queue-type", "quorum",
                         "x-dead-letter-exchange", "", "x-dead-letter-routing-key", in->queue,
                         "x-dead-letter-strategy", "at-least-once", "x-overflow",
                         "reject-publish");
    return json_pack("{s:s,s:s,s:s}", "x-queue-type", "classic", "x-dead-letter-exchange", "",
                     "x-dead-letter-routing-key", in->queue);
}

static json_t *dlq_args(const struct conf_input *in)
{
    return json_pack("{s:s}", "x-queue-type", in->queue_type);
}

/* Declares (or, when verify, checks then redeclares) one queue. */
static idemq_err_t queue(struct broker *b, const char *name, json_t *args, bool verify)
{
    idemq_err_t err = IDEMQ_OK;
    if (verify)
        err = broker_declare_queue(b, name, NULL, true);
    if (!err)
        err = broker_declare_queue(b, name, args, false);
    json_decref(args);
    return err;
}

static idemq_err_t exchange(struct broker *b, const char *name, const char *type, bool verify)
{
    idemq_err_t err = IDEMQ_OK;
    if (verify)
        err = broker_declare_exchange(b, name, type, true, NULL);
    if (!err)
        err = broker_declare_exchange(b, name, type, false, NULL);
    return err;
}

static idemq_err_t dead_objects(struct broker *b, const struct conf_input *in, bool verify)
{
    char name[TOPOLOGY_NAME_MAX], ex[TOPOLOGY_NAME_MAX];
    idemq_err_t err;
    topology_dlx(in, ex, sizeof ex);
    topology_dlq(in, name, sizeof name);
    if ((err = exchange(b, ex, "direct", verify)))
        return err;
    if ((err = queue(b, name, dlq_args(in), verify)))
        return err;
    return broker_bind(b, name, ex, in->queue, NULL);
}

/* Ordered lanes: the consistent-hash exchange and its partition queues. */
static idemq_err_t walk_partitioned(struct broker *b, const struct conf_input *in, bool verify)
{
    char name[TOPOLOGY_NAME_MAX];
    json_t *xargs = in->hash_header[0] ? json_pack("{s:s}", "hash-header", in->hash_header)
                                       : NULL;
    idemq_err_t err = IDEMQ_OK;

    if (verify)
        err = broker_declare_exchange(b, in->exchange, "x-consistent-hash", true, NULL);
    if (!err)
        err = broker_declare_exchange(b, in->exchange, "x-consistent-hash", false, xargs);
    json_decref(xargs);
    for (int k = 0; !err && k < in->partitions; k++) {
        topology_partition_queue(in, k, name, sizeof name);
        err = queue(b, name,
                    json_pack("{s:s,s:b}", "x-queue-type", in->queue_type,
                              "x-single-active-consumer", 1),
                    verify);
        if (!err)
            err = broker_bind(b, name, in->exchange, "1", NULL); /* equal weights */
    }
    if (!err)
        err = dead_objects(b, in, verify);
    return err;
}

static idemq_err_t walk(struct broker *b, const struct conf *c, const struct conf_input *in,
                        bool verify)
{
    char name[TOPOLOGY_NAME_MAX], ex[TOPOLOGY_NAME_MAX], key[32];
    idemq_err_t err;

    if (CONF_INPUT_ORDERED(in))
        return walk_partitioned(b, in, verify);
    if (in->exchange[0] && (err = exchange(b, in->exchange, in->exchange_type, verify)))
        return err;
    if ((err = queue(b, in->queue, work_queue_args(in), verify)))
        return err;
    if (in->exchange[0] && (err = broker_bind(b, in->queue, in->exchange, in->routing_key, NULL)))
        return err;

    topology_delay_exchange(in, ex, sizeof ex);
    if ((err = exchange(b, ex, "direct", verify)))
        return err;
    for (long bucket = TOPOLOGY_MIN_DELAY_MS; bucket <= c->max_delay_ms; bucket *= 2) {
        topology_bucket_queue(in, bucket, name, sizeof name);
        snprintf(key, sizeof key, "%ld", bucket);
        if ((err = queue(b, name, bucket_args(in), verify)))
            return err;
        if ((err = broker_bind(b, name, ex, key, NULL)))
            return err;
    }

    return dead_objects(b, in, verify);
}

idemq_err_t topology_declare(struct broker *b, const struct conf *c, const struct conf_input *in)
{
    return walk(b, c, in, false);
}

idemq_err_t topology_verify(struct broker *b, const struct conf *c, const struct conf_input *in,
                            char *errbuf, size_t errlen)
{
    idemq_err_t err = walk(b, c, in, true);
    if (err)
        snprintf(errbuf, errlen, "input %s: unsafe topology: %s; run `idemq declare`", in->name,
                 broker_error(b));
    return err;
}
