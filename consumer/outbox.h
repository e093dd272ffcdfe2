/*
 * outbox: the relay of the transactional outbox. Rows that
 * transactions wrote with idemq.emit (ledger/functions_outbox.sql) are
 * leased (ledger/ledger_outbox.h: taken by the batch transaction that
 * emitted them, before its COMMIT, or claimed afterwards; a lease lasts
 * outbox.lease_s or until its database session is gone), published a
 * lease at a time on the side channel of the worker's connection
 * (broker_side_publish: a refusal never closes the consuming channel;
 * mandatory, persistent, message_id "outbox:<id>", headers x-idemq-key and
 * x-idemq-outbox-id), and marked sent only after the broker's confirm. A
 * basic.return, or a row the client library cannot encode, parks the row
 * at once; a nack, or a publish the broker refuses by closing the side
 * channel (403, 404, 406, ...), counts an attempt on that row and parks it
 * after outbox.max_attempts; a broker that goes away gives the rows back
 * (lease released) and holds them until it is back.
 * The relay is at least once: a crash between the confirm and the mark
 * publishes the row again with the same message_id.
 *
 * Three entries: outbox_publish_taken right after a commit of an input
 * with `emits`, for the rows that transaction leased to the worker before
 * its COMMIT (the worker calls it before acknowledging the batch; then
 * outbox_relay if the transaction emitted rows it could not take), and
 * outbox_tick, the recovery poll (worker 0, every outbox.poll_ms) for rows
 * of applications and of relays that died. All are off unless
 * outbox.relay = 1. Counters for /metrics are process-wide.
 *
 * API: a struct outbox zeroed with its session -> outbox_publish_taken /
 *      outbox_relay / outbox_tick between batches (no transaction open, no
 *      confirm outstanding).
 */
#ifndef IDEMQ_OUTBOX_H
#define IDEMQ_OUTBOX_H

#include <libpq-fe.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>

#include "broker.h"
#include "conf.h"
#include "idemq_err.h"
#include "ledger_outbox.h"

#define OUTBOX_CLAIM_MAX 100 /* rows claimed per round */
#define OUTBOX_ROUNDS 10     /* claim rounds per call at most (then the worker goes on) */

/* Per worker session; all zero is the initial state (a poll at the first tick). */
struct outbox {
    long long next_poll_ms; /* CLOCK_MONOTONIC ms of the next recovery poll */
    char holder[160];       /* lease holder: host:pid:w<worker> */
};

/* Process-wide counters (any thread reads them). */
struct outbox_stats {
    atomic_long relayed;         /* rows confirmed and marked sent */
    atomic_long parked;          /* rows parked (returned, or nacked too often) */
    atomic_long failed;          /* nacked or refused publishes (each attempt) */
    atomic_long unopened;        /* rows not published: their sealed body cannot be opened */
    atomic_long latency_count;   /* commit-to-confirm samples */
    atomic_llong latency_us_sum; /* their sum, microseconds */
    atomic_long latency_le[6];   /* cumulative buckets: 5, 10, 25, 50, 100, 500 ms */
};
extern struct outbox_stats outbox_stats;
extern const double outbox_latency_bounds_ms[6];

/* Sets the lease holder of a worker's relay. */
void outbox_init(struct outbox *o, int worker_id);

/*
 * Publishes what is publishable now, up to OUTBOX_ROUNDS claims. IDEMQ_OK
 * (also when a statement failed: logged, tried again later), or
 * IDEMQ_ERR_DB_CONN / IDEMQ_ERR_BROKER with why set (the caller
 * reconnects; claimed rows not published were given back or stay leased
 * until lease_s passes or the session that leased them is gone). *more:
 * rows may still be waiting (the rounds ran out). Worker thread that owns
 * db and b.
 */
idemq_err_t outbox_relay(struct outbox *o, const struct conf *c, PGconn *db, struct broker *b,
                         bool *more, char *why, size_t whylen) IDEMQ_MUSTCHECK;

/*
 * Publishes the rows the batch transaction leased to o->holder before its
 * COMMIT (ledger_outbox_take), as outbox_relay publishes a claim, and
 * frees them. Same results as outbox_relay.
 */
idemq_err_t outbox_publish_taken(struct outbox *o, const struct conf *c, PGconn *db,
                                 struct broker *b, struct outbox_rows *rows, char *why,
                                 size_t whylen) IDEMQ_MUSTCHECK;

/* True while a row this process's relay refused (nacked, or the side
 * channel closed on it) waits for its next attempt: `--until-idle` is not
 * idle then, so the row is parked or sent before the run ends. Any thread. */
bool outbox_retry_pending(void);

/* The recovery poll: outbox_relay when outbox.poll_ms passed since the last
 * one (sooner while rows remain), else returns at once. */
idemq_err_t outbox_tick(struct outbox *o, const struct conf *c, PGconn *db, struct broker *b,
                        char *why, size_t whylen) IDEMQ_MUSTCHECK;

#endif
