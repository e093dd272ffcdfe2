/*
 * broker: the AMQP transport (librabbitmq-c). One struct broker is one
 * connection with its consuming channel (and a side channel for publishes
 * whose refusal must not close that one), used by one thread only (librabbitmq-c has
 * no locking). It owns: connecting (URL list, failover, capabilities),
 * declaring an input's topology, consuming into struct job, acks, and
 * publishing with publisher confirms and the mandatory flag.
 *
 * API: broker_open -> (broker_admin.h: declare, check) / broker_consume ->
 *      broker_next ... broker_settle / broker_reject -> broker_flush_acks
 *      ... -> broker_close.
 *      Publishing: broker_publish ... broker_wait_confirms on the consuming
 *      channel (retry and dead-letter copies, which go with its acks);
 *      broker_side_publish ... broker_side_wait_confirms[_each] on the side
 *      channel (the outbox, Celery replies: a refusal closes only it).
 * Every delivery is tracked from the moment its method frame is read until
 * it is settled: acks are only ever sent for settled deliveries (see
 * acks.h), never by a multiple ack across an unsettled one.
 * Every call services heartbeats; keep the time between calls well under
 * the heartbeat interval.
 */
#ifndef IDEMQ_BROKER_H
#define IDEMQ_BROKER_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "conf.h"
#include "idemq_err.h"
#include "job.h"

struct broker;
struct amqp_connection_state_t_;

#define BROKER_CHANNEL 1 /* the consuming channel (the side channel: see broker_side_publish) */

/* The major version of the broker (its connection.start "version"
 * property: 3 for 3.10.8, 4 for 4.0.5), or 0 when unknown. */
int broker_server_major(struct broker *b);

/*
 * Connects to the first URL of c->urls that answers (then the next ones, in
 * order), logs in advertising connection.blocked, consumer_cancel_notify and
 * publisher confirms, opens channel 1 and, if confirms, puts it in confirm
 * mode. conn_name shows in the management UI. Returns IDEMQ_OK and *out
 * (free with broker_close), or IDEMQ_ERR_BROKER with errbuf set and *out
 * NULL. The caller thread then owns the connection.
 */
idemq_err_t broker_open(const struct conf *c, const char *conn_name, bool confirms,
                        struct broker **out, char *errbuf, size_t errlen) IDEMQ_MUSTCHECK;

/*
 * Before a broker_close that gives deliveries back (a pause, a reconnect, a
 * drain): cancels the consumers, sends the acks settled deliveries allow,
 * then returns every unsettled delivery one at a time, basic.reject(requeue)
 * for failed_tag (the delivery whose own attempt failed; 0 for none) and
 * basic.nack(requeue) for the others, so RabbitMQ 4.3 counts toward the
 * delivery limit only the failure (see giveback.h). Deliveries read but not
 * handed out are given back too. IDEMQ_ERR_BROKER when the connection was
 * already gone or failed on the way (the rest return with it).
 */
idemq_err_t broker_give_back(struct broker *b, uint64_t failed_tag);

/* Closes the channel and connection (gracefully if still healthy) and
 * frees b, including deliveries not yet handed out. NULL is fine. */
void broker_close(struct broker *b);

/* Sets basic.qos prefetch for the channel. */
idemq_err_t broker_qos(struct broker *b, int prefetch) IDEMQ_MUSTCHECK;

/* Starts consuming in->queue; its deliveries get job->input = input_idx.
 * consumer_id becomes part of the consumer tag. */
idemq_err_t broker_consume(struct broker *b, int input_idx, const struct conf_input *in,
                           const char *consumer_id) IDEMQ_MUSTCHECK;

/* Ordered lanes: starts consuming partition queue `queue` (lane `lane`) of
 * input input_idx; its deliveries get job->input and job->lane. */
idemq_err_t broker_consume_lane(struct broker *b, int input_idx, int lane, const char *queue,
                                const struct conf_input *in,
                                const char *consumer_id) IDEMQ_MUSTCHECK;

/*
 * Waits up to timeout_ms for the next delivery and fills j (job_reset
 * first). Returns IDEMQ_OK, IDEMQ_ERR_TIMEOUT when none arrived (other
 * frames such as confirms may have been handled), or IDEMQ_ERR_BROKER when
 * the connection or channel is gone (see broker_error). j->decode is not
 * run here. A delivery the client library cannot decode comes back as a
 * job with wire_err IDEMQ_ERR_UNDECODABLE (tag, routing key and consumer
 * known, no content); after it the connection cannot read
 * (broker_readable false) but can still settle and reject.
 */
idemq_err_t broker_next(struct broker *b, struct job *j, int timeout_ms) IDEMQ_MUSTCHECK;

/*
 * `--until-idle`'s last look before a worker finishes: cancels every
 * consumer and waits up to timeout_ms for each basic.cancel-ok. The broker
 * sends a cancel-ok after the deliveries it had already dispatched to the
 * consumer, so those arrive first and are kept for broker_next (RabbitMQ
 * 4.0 can take seconds to hand one over: about 4 s for headers nested
 * 17,000 deep, adapters/README.md "RabbitMQ versions"). Then each consumed
 * queue's ready count is asked (passive declare). *idle is true when nothing
 * arrived and every queue was empty (the consumers stay cancelled);
 * otherwise the consumers consume again and *idle is false. IDEMQ_ERR_BROKER
 * when the connection failed or an ok did not come in time (then not idle:
 * the connection is marked failed).
 */
idemq_err_t broker_quiesce(struct broker *b, int timeout_ms, bool *idle) IDEMQ_MUSTCHECK;

/* Services the connection for ms (heartbeats, confirms, closes) without
 * handing out deliveries: those that arrive are kept for broker_next.
 * IDEMQ_OK, or IDEMQ_ERR_BROKER when the connection failed. */
idemq_err_t broker_service(struct broker *b, int ms) IDEMQ_MUSTCHECK;

/* Marks a delivery of this channel settled: its ack goes out with the next
 * broker_flush_acks. IDEMQ_ERR_INTERNAL if the tag is not outstanding on
 * this channel (for example one of a previous connection: never acked). */
idemq_err_t broker_settle(struct broker *b, uint64_t tag) IDEMQ_MUSTCHECK;

/* basic.reject without requeue (the queue's dead-letter exchange, if any,
 * takes the message); the tag is settled. */
idemq_err_t broker_reject(struct broker *b, uint64_t tag) IDEMQ_MUSTCHECK;

/* Sends the acks the settled deliveries allow: one multiple ack for the
 * contiguous settled prefix, single acks beyond the first unsettled tag. */
idemq_err_t broker_flush_acks(struct broker *b) IDEMQ_MUSTCHECK;

/* False once the connection or channel failed, or after an undecodable
 * message (sending still works then: settle, reject, flush, publish). */
bool broker_readable(const struct broker *b);

/* Raw basic.ack of tag (and every earlier unacked tag when multiple), for
 * tools that do their own bookkeeping (redrive, the benchmark); the worker
 * uses broker_settle. */
idemq_err_t broker_ack(struct broker *b, uint64_t tag, bool multiple) IDEMQ_MUSTCHECK;

/* Raw basic.nack of one tag, requeued or not (tools). */
idemq_err_t broker_nack(struct broker *b, uint64_t tag, bool requeue) IDEMQ_MUSTCHECK;

/* Message properties for broker_publish; all optional. headers: a JSON
 * object whose strings, integers, booleans, reals and nested objects become
 * AMQP table fields. */
struct broker_props {
    const char *message_id;
    const char *content_type;
    json_t *headers;
    bool persistent;
    const char *expiration; /* per-message TTL in ms, as text */
    json_t *original;       /* properties of a received message (job->props) to
                             * carry over: content_type/encoding, correlation_id,
                             * reply_to, message_id, type, app_id, timestamp,
                             * priority; the fields above win */
};

/*
 * Publishes one message with the mandatory flag. Requires a connection
 * opened with confirms; the confirm is collected by broker_wait_confirms.
 * Deliveries that arrive meanwhile are kept for broker_next. A message the
 * client library cannot encode (an exchange, routing key, property or
 * header name over 255 bytes; headers over what one frame of the
 * negotiated frame_max holds) is refused before anything is written:
 * IDEMQ_ERR_UNPUBLISHABLE with broker_error saying why, the connection
 * unharmed and nothing to wait for.
 */
idemq_err_t broker_publish(struct broker *b, const char *exchange, const char *routing_key,
                           const void *body, size_t len,
                           const struct broker_props *props) IDEMQ_MUSTCHECK;

/*
 * Waits until every message published since the previous wait is confirmed
 * (tracked per sequence number: confirms may come out of order and with
 * `multiple`). IDEMQ_OK only if all were acked and none was returned as
 * unroutable; IDEMQ_ERR_BROKER if any was nacked or returned (see
 * broker_error), as soon as that is known, or if the connection failed;
 * IDEMQ_ERR_TIMEOUT after timeout_ms (then drop the connection: the range
 * is not waited for again).
 */
idemq_err_t broker_wait_confirms(struct broker *b, int timeout_ms) IDEMQ_MUSTCHECK;

/* What became of one publish (broker_wait_confirms_each). */
enum broker_confirm {
    BROKER_CONFIRM_PENDING = 0, /* not confirmed (yet): the wait failed or timed out */
    BROKER_CONFIRM_ACKED,
    BROKER_CONFIRM_NACKED,      /* nacked, or its confirm is in doubt */
    BROKER_CONFIRM_RETURNED,    /* basic.return: unroutable */
};

/*
 * broker_wait_confirms for a batch whose publishes are told apart: waits
 * until every one of the n publishes since the previous wait is decided,
 * and sets out[i] for the i-th. message_ids[i] is the message_id it was
 * published with: a basic.return names no sequence number and the confirm
 * after it may cover several (`multiple`), so the returned publish is
 * found by its message_id (a return that matches none leaves the publishes
 * that confirm covered NACKED). IDEMQ_OK when all are decided (out[] says
 * how); IDEMQ_ERR_BROKER (the connection or channel failed, see
 * broker_error) or IDEMQ_ERR_TIMEOUT (drop the connection) with out[]
 * holding what was decided so far, the rest PENDING; IDEMQ_ERR_INTERNAL
 * when n is not the number of publishes since the previous wait.
 */
idemq_err_t broker_wait_confirms_each(struct broker *b, int timeout_ms,
                                      const char *const *message_ids, enum broker_confirm *out,
                                      size_t n) IDEMQ_MUSTCHECK;

/*
 * The side channel: a second channel of the connection, in confirm mode,
 * opened by the first side publish, that carries no consumer. The broker
 * answers a publish it refuses (403 ACCESS_REFUSED, 404 NOT_FOUND for a
 * missing exchange, 406 PRECONDITION_FAILED for a body over
 * max_message_size) by closing the channel it came on; on this one that
 * costs no delivery of the consuming channel. After a close the next side
 * publish opens a new one (another channel number, so a late confirm of
 * the old one is never counted).
 *
 * broker_side_publish: like broker_publish, with the mandatory flag or
 * without (a Celery result to a reply queue that may be gone is dropped by
 * the broker, not returned); IDEMQ_ERR_UNPUBLISHABLE as there;
 * IDEMQ_ERR_BROKER when the connection failed, or when the side channel
 * was closed under publishes not yet waited for (wait for them first).
 *
 * broker_side_wait_confirms / broker_side_wait_confirms_each: as their
 * consuming-channel twins, for the side publishes since the last side
 * wait. IDEMQ_ERR_BROKER with broker_readable(b) still true means the
 * broker closed the side channel (broker_error has its code and text; the
 * publishes after the refused one were dropped, those before it may or may
 * not have been routed); with broker_readable(b) false the connection
 * failed. IDEMQ_ERR_TIMEOUT: the side channel is closed, the connection
 * can stay. Whatever the result, the next side wait covers only later
 * publishes. message_ids may be NULL (no return is matched: a publish a
 * confirm after a return covered counts as NACKED). Worker thread only.
 */
idemq_err_t broker_side_publish(struct broker *b, const char *exchange, const char *routing_key,
                                const void *body, size_t len, const struct broker_props *props,
                                bool mandatory) IDEMQ_MUSTCHECK;
idemq_err_t broker_side_wait_confirms(struct broker *b, int timeout_ms) IDEMQ_MUSTCHECK;
idemq_err_t broker_side_wait_confirms_each(struct broker *b, int timeout_ms,
                                           const char *const *message_ids,
                                           enum broker_confirm *out, size_t n) IDEMQ_MUSTCHECK;

/* basic.get of one message into j (auto-ack when ack is true).
 * IDEMQ_ERR_TIMEOUT if the queue is empty; IDEMQ_ERR_UNDECODABLE for a
 * message the client library cannot decode (j->tag set; the connection
 * cannot read any more, see broker_next). For tests and tools. */
idemq_err_t broker_get(struct broker *b, const char *queue, struct job *j,
                       bool ack) IDEMQ_MUSTCHECK;

/*
 * queue.bind of queue to exchange with key on a channel of its own, opened
 * on first use: a refusal (403 without write on the queue, 404 for a queue
 * that is gone) closes only that channel, never the one that holds the
 * consumers, their deliveries and the publisher confirms. IDEMQ_OK, or
 * IDEMQ_ERR_BROKER with broker_error saying why (b stays usable after a
 * refusal; after a connection failure it is not). The broker's owner
 * thread, outside any wait.
 */
idemq_err_t broker_bind_aside(struct broker *b, const char *queue, const char *exchange,
                              const char *key) IDEMQ_MUSTCHECK;

/* Text of the last failure on b (never NULL). */
const char *broker_error(const struct broker *b);

/* For adapters/broker_admin.c only: the connection, and the end of a
 * synchronous RPC just sent on BROKER_CHANNEL: IDEMQ_OK, or
 * IDEMQ_ERR_BROKER with broker_error set (and, when reopen, the channel
 * reopened so b stays usable). */
struct amqp_connection_state_t_ *broker_amqp(struct broker *b);
idemq_err_t broker_rpc_done(struct broker *b, const char *what, bool reopen) IDEMQ_MUSTCHECK;
void broker_set_error(struct broker *b, const char *text);

#endif
