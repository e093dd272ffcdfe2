/*
 * broker_admin: the synchronous broker operations of topology and tools on
 * a struct broker's channel: declaring and checking exchanges and queues,
 * binding, passive counts, purging and deleting. A failed RPC closes the
 * channel on the broker; the declare/bind/count ones reopen it (so the
 * broker stays usable, consumers and deliveries of the old channel gone),
 * keeping the failure's text for broker_error.
 */
#include "broker_admin.h"

#include <amqp.h>
#include <stdio.h>

#include "amqp_table.h"

#define CHANNEL BROKER_CHANNEL

static amqp_bytes_t bytes(const char *s)
{
    return amqp_cstring_bytes(s ? s : "");
}

/* The declare/bind RPCs that take an arguments table, in one place. */
enum table_rpc { RPC_EXCHANGE, RPC_QUEUE, RPC_BIND };

static idemq_err_t table_rpc(struct broker *b, enum table_rpc rpc, const char *name,
                             const char *other, const char *key, bool passive, json_t *args)
{
    char what[600];
    amqp_pool_t pool;
    amqp_table_t t;
    idemq_err_t err;

    init_amqp_pool(&pool, 1024);
    if (amqp_table_from_json(args, &t, &pool)) {
        empty_amqp_pool(&pool);
        broker_set_error(b, "out of memory");
        return IDEMQ_ERR_NOMEM;
    }
    switch (rpc) {
    case RPC_EXCHANGE: /* other = exchange type */
        amqp_exchange_declare(broker_amqp(b), CHANNEL, bytes(name), bytes(other), passive, 1, 0, 0,
                              t);
        snprintf(what, sizeof what, "%s exchange %s", passive ? "check" : "declare", name);
        break;
    case RPC_QUEUE:
        amqp_queue_declare(broker_amqp(b), CHANNEL, bytes(name), passive, 1, 0, 0, t);
        snprintf(what, sizeof what, "%s queue %s", passive ? "check" : "declare", name);
        break;
    case RPC_BIND: /* other = exchange */
        amqp_queue_bind(broker_amqp(b), CHANNEL, bytes(name), bytes(other), bytes(key), t);
        snprintf(what, sizeof what, "bind queue %s to %s (key %s)", name, other, key);
        break;
    }
    err = broker_rpc_done(b, what, true);
    empty_amqp_pool(&pool);
    return err;
}

idemq_err_t broker_admin_declare_exchange(struct broker *b, const char *name, const char *type,
                                          bool passive, json_t *args)
{
    return table_rpc(b, RPC_EXCHANGE, name, type, NULL, passive, args);
}

idemq_err_t broker_admin_declare_queue(struct broker *b, const char *name, json_t *args,
                                       bool passive)
{
    return table_rpc(b, RPC_QUEUE, name, NULL, NULL, passive, args);
}

idemq_err_t broker_admin_bind(struct broker *b, const char *queue, const char *exchange,
                              const char *key, json_t *args)
{
    return table_rpc(b, RPC_BIND, queue, exchange, key, false, args);
}

idemq_err_t broker_admin_bind_exchange(struct broker *b, const char *destination,
                                       const char *source, const char *key)
{
    char what[600];
    amqp_exchange_bind(broker_amqp(b), CHANNEL, bytes(destination), bytes(source), bytes(key),
                       amqp_empty_table);
    snprintf(what, sizeof what, "bind exchange %s to %s (key %s)", destination, source, key);
    return broker_rpc_done(b, what, true);
}

idemq_err_t broker_admin_unbind(struct broker *b, const char *queue, const char *exchange,
                                const char *key)
{
    char what[600];
    amqp_queue_unbind(broker_amqp(b), CHANNEL, bytes(queue), bytes(exchange), bytes(key),
                      amqp_empty_table);
    snprintf(what, sizeof what, "unbind queue %s from %s (key %s)", queue, exchange, key);
    return broker_rpc_done(b, what, true);
}

idemq_err_t broker_admin_queue_counts(struct broker *b, const char *queue, uint32_t *messages,
                                      uint32_t *consumers)
{
    amqp_queue_declare_ok_t *ok =
        amqp_queue_declare(broker_amqp(b), CHANNEL, bytes(queue), 1, 0, 0, 0, amqp_empty_table);
    if (broker_rpc_done(b, "passive declare", true))
        return IDEMQ_ERR_BROKER;
    if (messages)
        *messages = ok->message_count;
    if (consumers)
        *consumers = ok->consumer_count;
    return IDEMQ_OK;
}

idemq_err_t broker_admin_purge(struct broker *b, const char *queue)
{
    amqp_queue_purge(broker_amqp(b), CHANNEL, bytes(queue));
    return broker_rpc_done(b, "queue.purge", false);
}

idemq_err_t broker_admin_delete_queue(struct broker *b, const char *queue)
{
    amqp_queue_delete(broker_amqp(b), CHANNEL, bytes(queue), 0, 0);
    return broker_rpc_done(b, "queue.delete", false);
}

idemq_err_t broker_admin_delete_exchange(struct broker *b, const char *exchange)
{
    amqp_exchange_delete(broker_amqp(b), CHANNEL, bytes(exchange), 0);
    return broker_rpc_done(b, "exchange.delete", false);
}
