/*
 * confirms: publisher-confirm tracking of one channel in confirm mode, per
 * sequence number. RabbitMQ confirms out of order when publishes go to
 * different queues, and with `multiple` it confirms every earlier pending
 * publish at once; a mandatory publish that cannot be routed gets a
 * basic.return, which comes before that publish's confirm but names no
 * sequence number. So each publish keeps its own state and a caller asks
 * about the range it published: all acked, still pending, or failed. Pure:
 * no sockets, no clock.
 *
 * API: confirms_init -> confirms_reset (confirm.select) ->
 *      [confirms_publish | confirms_ack | confirms_nack | confirms_return |
 *      confirms_range | confirms_seq_state]* -> confirms_free. One thread.
 */
#ifndef IDEMQ_CONFIRMS_H
#define IDEMQ_CONFIRMS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "idemq_err.h"

enum confirms_result {
    CONFIRMS_ACKED = 0, /* every publish of the range was acked */
    CONFIRMS_PENDING,   /* none failed so far, some not confirmed yet */
    CONFIRMS_FAILED,    /* at least one was nacked or returned */
};

/* The state of one publish (confirms_seq). A confirm right after a
 * basic.return covers the returned publish but, with `multiple`, maybe
 * others too: what it covers is RETURN_ACKED, told apart by the caller
 * (broker_wait_confirms_each matches returns by message_id). */
enum confirms_seq {
    CONFIRMS_SEQ_PENDING = 0,
    CONFIRMS_SEQ_ACKED,
    CONFIRMS_SEQ_NACKED,
    CONFIRMS_SEQ_RETURN_ACKED,
    CONFIRMS_SEQ_UNTRACKED, /* never published, or forgotten */
};

struct confirms {
    uint8_t *state;     /* per outstanding seq: an enum confirms_seq */
    uint64_t base;      /* seq of state[0] */
    uint64_t next;      /* seq the next publish gets (first is 1) */
    size_t cap;
    bool return_seen;   /* a basic.return waits for the confirm it precedes */
    uint64_t strays;    /* confirms for sequence numbers never published */
};

void confirms_init(struct confirms *c);
void confirms_free(struct confirms *c);

/* A new channel in confirm mode: the next publish is seq 1. */
void confirms_reset(struct confirms *c);

/* Records one publish; returns its sequence number in *seq. IDEMQ_ERR_NOMEM
 * if the table cannot grow (nothing recorded: do not publish). */
idemq_err_t confirms_publish(struct confirms *c, uint64_t *seq) IDEMQ_MUSTCHECK;

/* The sequence number the next confirms_publish will return. */
uint64_t confirms_next_seq(const struct confirms *c);

/* basic.ack / basic.nack for tag (every pending seq <= tag when multiple).
 * A confirm right after a basic.return marks what it covers failed. */
void confirms_ack(struct confirms *c, uint64_t tag, bool multiple);
void confirms_nack(struct confirms *c, uint64_t tag, bool multiple);

/* basic.return: the publish the next confirm covers was not routed. */
void confirms_return(struct confirms *c);

/* The state of the publishes first..last (inclusive; first > last is an
 * empty range, CONFIRMS_ACKED). */
enum confirms_result confirms_range(const struct confirms *c, uint64_t first, uint64_t last);

/* The state of one publish. */
enum confirms_seq confirms_seq_state(const struct confirms *c, uint64_t seq);

/* Drops the states of sequence numbers below seq (decided ranges), so the
 * table stays as small as what is in flight. */
void confirms_forget_below(struct confirms *c, uint64_t seq);

#endif
