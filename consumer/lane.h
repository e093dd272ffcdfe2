/*
 * lane: the in-memory holding of ordered lanes in one worker. A lane is one
 * partition queue of a partitioned input (input + partition). While a lane
 * waits (its head failed transiently and waits for its backoff, in place),
 * its later deliveries are held here, unacknowledged and in delivery order,
 * while other lanes keep flowing. Held deliveries are bounded by the
 * prefetch. All held deliveries belong to the current AMQP channel: drop
 * them (lane_clear) whenever the connection is dropped.
 *
 * API: lane_set_new -> per loop: lane_take_ready (into the batch) ->
 *      lane_blocked / lane_append (new deliveries) -> after the commit
 *      lane_settle_begin, lane_putback ... -> lane_clear -> lane_set_free.
 * One worker thread only.
 */
#ifndef IDEMQ_LANE_H
#define IDEMQ_LANE_H

#include <stdbool.h>
#include <stdint.h>

#include "conf.h"
#include "idemq_err.h"
#include "job.h"

struct lane_set;

/* Lanes for every partition of c's partitioned inputs. NULL when out of
 * memory. c must outlive the set. */
struct lane_set *lane_set_new(const struct conf *c);

/* Frees the set and every held job. NULL is fine. */
void lane_set_free(struct lane_set *ls);

/* True if delivery j (of an ordered input) must wait: its lane holds
 * deliveries or waits for a backoff at now_ms. False for other jobs. */
bool lane_blocked(const struct lane_set *ls, const struct job *j, long long now_ms);

/* Moves delivery j to the tail of its lane. j is left empty (job_init), so
 * its slot can be reused. IDEMQ_ERR_NOMEM leaves j unchanged. */
idemq_err_t lane_append(struct lane_set *ls, struct job *j) IDEMQ_MUSTCHECK;

/* Starts putting back a committed batch's held deliveries: they go before
 * what the lanes still hold, in the order of lane_putback calls. */
void lane_settle_begin(struct lane_set *ls);

/* Moves j back into its lane (see lane_settle_begin); the lane waits until
 * not_before_ms (a later wait already set is kept). j is left empty. */
idemq_err_t lane_putback(struct lane_set *ls, struct job *j,
                         long long not_before_ms) IDEMQ_MUSTCHECK;

/* Moves the held deliveries of every lane whose wait is over into
 * dst[0..max) (those slots are job_destroyed first), in lane order.
 * Returns how many were moved. */
int lane_take_ready(struct lane_set *ls, struct job *dst, int max, long long now_ms);

/* Earliest time a waiting lane becomes ready, or 0 if none holds anything. */
long long lane_next_ready(const struct lane_set *ls);

/* Number of held deliveries, and the smallest delivery tag held (0 if none):
 * a multiple ack must stay below it. */
int lane_held(const struct lane_set *ls);
uint64_t lane_min_tag(const struct lane_set *ls);

/* Drops every held delivery (the broker redelivers them). */
void lane_clear(struct lane_set *ls);

#endif
