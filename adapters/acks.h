/*
 * acks: which deliveries of one AMQP channel are settled, and the acks that
 * may be sent for them. A delivery is registered when its method frame is
 * read (before anything else can happen to it), settled when its
 * transaction committed (and its republish, if any, was confirmed), or
 * marked gone when it was settled another way (rejected, nacked). The
 * tracker hands out the acks to send: the contiguous settled prefix with one
 * multiple ack, settled tags beyond the first unsettled one one by one. So
 * an ack never covers a delivery that is not settled, and a held or slow
 * delivery never blocks the others' acks. Pure: no sockets, no clock.
 *
 * API: acks_init -> [acks_received | acks_settle | acks_gone |
 *      acks_next]* -> acks_reset (new channel) ... -> acks_free.
 * One thread (the connection's owner).
 */
#ifndef IDEMQ_ACKS_H
#define IDEMQ_ACKS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "idemq_err.h"

enum acks_state {
    ACKS_UNSETTLED = 0, /* received, not settled yet: no ack may cover it */
    ACKS_SETTLED,       /* settled: to be acknowledged */
    ACKS_GONE,          /* settled by reject/nack: never acknowledged */
};

struct acks_entry {
    uint64_t tag;
    enum acks_state state;
    bool with_close; /* unsettled, it goes back only with the channel's close */
};

struct acks {
    struct acks_entry *v; /* outstanding deliveries, increasing tags */
    size_t head, n, cap;  /* live entries are v[head .. head+n) */
    uint64_t last_tag;    /* highest tag registered since the reset */
};

/* One basic.ack to send. */
struct acks_op {
    uint64_t tag;
    bool multiple;
};

void acks_init(struct acks *a);
void acks_free(struct acks *a);

/* Forgets every delivery: the channel they belonged to is gone. */
void acks_reset(struct acks *a);

/*
 * Registers a delivery just read. Tags of a channel increase; a tag that
 * does not (a broker fault) returns IDEMQ_ERR_BROKER, and IDEMQ_ERR_NOMEM
 * when the list cannot grow. The tracker is unchanged on error.
 */
idemq_err_t acks_received(struct acks *a, uint64_t tag) IDEMQ_MUSTCHECK;

/* Marks a registered delivery settled (to be acked) or gone (rejected or
 * nacked: never to be acked). Unknown or already settled tags return false
 * and change nothing. */
bool acks_settle(struct acks *a, uint64_t tag);
bool acks_gone(struct acks *a, uint64_t tag);

/* Forgets tag (and, when multiple, every earlier outstanding tag): for
 * acks, nacks or rejects a caller sent itself. */
void acks_drop(struct acks *a, uint64_t tag, bool multiple);

/*
 * Marks a registered delivery as one that, unsettled, goes back to its
 * queue only with the channel's close, never with a frame of its own (a
 * single-active-consumer queue's: see giveback.h). False if tag is not
 * outstanding.
 */
bool acks_mark_with_close(struct acks *a, uint64_t tag);
/* Whether tag is outstanding and marked so. */
bool acks_with_close(const struct acks *a, uint64_t tag);

/* State of a tag; false if it is not outstanding. */
bool acks_state_of(const struct acks *a, uint64_t tag, enum acks_state *out);

/*
 * The next ack to send, removed from the tracker: true and *op filled, or
 * false when nothing settled can be acknowledged. Call until false. The
 * caller must send each op it is given (or drop the channel).
 */
bool acks_next(struct acks *a, struct acks_op *op);

/* Deliveries still outstanding (unsettled, or settled but not yet handed
 * out by acks_next). */
size_t acks_outstanding(const struct acks *a);

/* The lowest unsettled tag, or 0 if none. */
uint64_t acks_first_unsettled(const struct acks *a);

#endif
