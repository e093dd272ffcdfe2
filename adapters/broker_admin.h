/*
 * broker_admin: the synchronous broker operations that topology and the
 * tools run on a struct broker's channel: declaring and checking
 * exchanges and queues, binding and unbinding, passive counts, purging and
 * deleting. One thread (the broker's owner); each call is one RPC.
 */
#ifndef IDEMQ_BROKER_ADMIN_H
#define IDEMQ_BROKER_ADMIN_H

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

#include "broker.h"
#include "idemq_err.h"

/*
 * Declares a durable exchange (passive: only checks it exists). On failure
 * (e.g. 404 when passive, 406 on a type mismatch) broker_error says why and
 * the channel is reopened, so b stays usable.
 */
idemq_err_t broker_admin_declare_exchange(struct broker *b, const char *name, const char *type,
                                          bool passive, json_t *args) IDEMQ_MUSTCHECK;

/* Declares a durable queue with arguments (a JSON object; strings, integers
 * and booleans), or checks it exists when passive. A queue that exists with
 * other arguments fails with 406 PRECONDITION_FAILED. Reopens the channel
 * on failure, like broker_admin_declare_exchange. */
idemq_err_t broker_admin_declare_queue(struct broker *b, const char *name, json_t *args,
                                       bool passive) IDEMQ_MUSTCHECK;

/* queue.bind (idempotent). args may be NULL. */
idemq_err_t broker_admin_bind(struct broker *b, const char *queue, const char *exchange,
                              const char *key, json_t *args) IDEMQ_MUSTCHECK;

/* exchange.bind (idempotent): messages routed by source with a matching
 * key go on to destination. Reopens the channel on failure. */
idemq_err_t broker_admin_bind_exchange(struct broker *b, const char *destination,
                                       const char *source, const char *key) IDEMQ_MUSTCHECK;

/* queue.unbind (for tests and tools: a shrinking hash ring). */
idemq_err_t broker_admin_unbind(struct broker *b, const char *queue, const char *exchange,
                                const char *key) IDEMQ_MUSTCHECK;

/* Passive queue.declare: message and consumer counts. IDEMQ_ERR_BROKER if
 * the queue does not exist (the channel is reopened). */
idemq_err_t broker_admin_queue_counts(struct broker *b, const char *queue, uint32_t *messages,
                                      uint32_t *consumers) IDEMQ_MUSTCHECK;

/* Purges a queue; for tests and tools. */
idemq_err_t broker_admin_purge(struct broker *b, const char *queue) IDEMQ_MUSTCHECK;

/* Deletes a queue / an exchange (if present); for tests and tools. */
idemq_err_t broker_admin_delete_queue(struct broker *b, const char *queue) IDEMQ_MUSTCHECK;
idemq_err_t broker_admin_delete_exchange(struct broker *b, const char *exchange) IDEMQ_MUSTCHECK;

#endif
