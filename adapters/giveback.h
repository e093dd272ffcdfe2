/*
 * giveback: returns a channel's unsettled deliveries to their queues
 * before the channel is dropped, in the way that keeps a quorum queue's
 * delivery count honest on every RabbitMQ version (see adapters/README.md,
 * "RabbitMQ 4").
 *
 * RabbitMQ 4.3 counts toward `delivery-limit` only failure-flavoured
 * returns: basic.reject(requeue) and a channel or connection that goes away
 * with the delivery unacknowledged. basic.nack(requeue) of one tag, and any
 * nack with `multiple`, count nothing (x-acquired-count still does).
 * Closing the connection on its own would therefore charge every delivery
 * idemq held (a prefetch worth, a lane's held jobs) with a failure each time
 * idemq pauses for contention, a database outage or a drain. So, in this
 * order, on the open channel:
 *   1. basic.cancel (nowait) of each consumer the caller names: nothing new
 *      is handed out to it;
 *   2. the acks of settled deliveries (the caller's tracker, acks.h);
 *   3. one frame per unsettled delivery, never `multiple`:
 *      basic.reject(requeue) for the one delivery whose own attempt failed
 *      (failed_tag: it counts, so a job that keeps failing meets the limit
 *      and idemq parks its last allowed delivery), basic.nack(requeue,
 *      single) for every other (returned for idemq's reasons: no count).
 * On 3.x and 4.0-4.2 both frames count, as the close did. A delivery still
 * on the wire when the cancel reached the broker returns with the close.
 *
 * Single-active-consumer queues (ordered lanes) are the exception: their
 * consumers are not cancelled and their unsettled deliveries (marked with
 * acks_mark_with_close) get no frame; they go back with the channel's
 * close. Cancelling such a consumer activates the next waiting consumer (a
 * standby replica) at once, which then takes the later messages while the
 * returned earlier ones wait behind them; a return before the cancel goes
 * straight back to the still-active consumer. Only the close returns the
 * deliveries and removes the consumer in one step, so the standby starts
 * with the earliest message. On 4.3 that close counts toward the limit for
 * each held lane delivery.
 *
 * API: giveback_send (pure over a librabbitmq-c connection state: the unit
 * test runs it on a socketpair and reads the frames).
 */
#ifndef IDEMQ_GIVEBACK_H
#define IDEMQ_GIVEBACK_H

#include <amqp.h>
#include <stdint.h>

#include "acks.h"
#include "idemq_err.h"

struct giveback_counts {
    int cancelled;  /* basic.cancel frames */
    int acked;      /* basic.ack frames */
    int nacked;     /* basic.nack(requeue, single) frames */
    int rejected;   /* basic.reject(requeue) frames: 0 or 1 */
    int with_close; /* unsettled deliveries left to the channel's close */
};

/*
 * Sends steps 1-3 above on channel ch for the n_tags consumer tags (those
 * to cancel: not a single active consumer's) and the deliveries tracked in
 * a (emptied: every tag is settled, given back, or left to the close).
 * failed_tag 0: none failed. IDEMQ_OK, or IDEMQ_ERR_BROKER at the first
 * frame that could not be sent (the rest return with the connection).
 * *counts (may be NULL) says what was sent.
 */
idemq_err_t giveback_send(amqp_connection_state_t conn, amqp_channel_t ch, struct acks *a,
                          const char *const *consumer_tags, int n_tags, uint64_t failed_tag,
                          struct giveback_counts *counts) IDEMQ_MUSTCHECK;

#endif
