/*
 * provider_flow: the per-job state machine of provider inputs, the
 * part of a worker that turns a decoded delivery into provider calls and,
 * for each job, exactly one decision for the worker. It owns the worker's
 * effect_http engine and the jobs between their first transaction and their
 * decision; the ledger functions (ledger/functions_provider.sql) own every
 * state change, under the job row's lock.
 *
 * For one job: transaction 1 (idemq.provider_begin) claims the key and
 * records the intent as pending with a lease, or finds it settled, held by
 * another call, due for a lookup or a resend; the flow then sends the call
 * (`Idempotency-Key: <business key>`, the same on every attempt) or the
 * lookup; transaction 2 (idemq.provider_result) records the answer: a
 * reference is stored and the input's SQL effect runs in that same
 * transaction, with the answer in meta.provider; anything else becomes a
 * retry with the same key, a lookup, a wait or a park.
 *
 * How the worker drives it (one flow per worker thread, with the worker's
 * own PGconn; no transaction of the worker may be open on it during a call):
 *
 *   provider_flow_new(conf, worker_id)               once, at worker start
 *   for each decoded delivery of a provider input (job_decode OK):
 *       provider_flow_start(flow, db, job, cookie)    cookie = the worker's
 *                                                     handle of the delivery
 *   in the loop, between broker calls:
 *       n = provider_flow_poll(flow, db, timeout_ms, decisions, max)
 *       for each decision: settle the delivery named by its cookie
 *           ACK    basic.ack
 *           RETRY  publish to the delay bucket for delay_ms (as a transient
 *                  retry: republish_delay with attempt), confirm, then ack
 *           WAIT   the same on the broker as RETRY (no attempt was used)
 *           PARK   publish to <queue>.dlx with the park facts
 *                  (republish_dead), confirm, ack, then
 *                  ledger_txn_mark_dead_lettered(park_id)
 *           FAIL   settle nothing; CLASS_INFRA: drop both connections and
 *                  reconnect; CLASS_FATAL: pause as NOT READY. Then call
 *                  provider_flow_detach (its other jobs' deliveries come
 *                  back with the dropped channel).
 *       provider_flow_decision_clear(&decision)
 *   on a broker loss (any reconnect): provider_flow_detach(flow): the
 *       deliveries are forgotten, the calls in flight go on and their
 *       answers are recorded by later polls (the database does not depend
 *       on the channel); a redelivery of such a job takes it over
 *   on a stop (SIGTERM): provider_flow_drain(flow), then poll until
 *       provider_flow_pending is 0 (or a deadline)
 *   provider_flow_free(flow)                          at worker end
 *
 * Every ledger step is one statement (one round trip, one transaction) and
 * a call never blocks: poll waits at most timeout_ms, so heartbeats and
 * other jobs keep flowing while a provider is slow. Deliveries stay
 * unacknowledged until their decision, which may come in any order.
 * Nothing in here touches the broker.
 */
#ifndef IDEMQ_PROVIDER_FLOW_H
#define IDEMQ_PROVIDER_FLOW_H

#include <jansson.h>
#include <libpq-fe.h>

#include "classify.h"
#include "conf.h"
#include "idemq_err.h"
#include "job.h"

struct provider_flow;

/* What the worker does with a delivery; see the top of this file. */
enum provider_decision_kind {
    PROVIDER_FLOW_ACK = 0, /* applied (transaction 2 committed) or a duplicate */
    PROVIDER_FLOW_RETRY,   /* retry later with the same key, after delay_ms */
    PROVIDER_FLOW_WAIT,    /* a pending intent (another call in flight) or a
                            * time not come yet: come back after delay_ms */
    PROVIDER_FLOW_PARK,    /* parked (committed); park holds the facts */
    PROVIDER_FLOW_FAIL,    /* the database failed: settle nothing */
};

struct provider_decision {
    void *cookie; /* as given to provider_flow_start */
    int input;
    char key[CONF_KEY_MAX_BYTES + 1];
    enum provider_decision_kind kind;
    long delay_ms;                  /* RETRY, WAIT: at least 100 */
    int attempt;                    /* the job's attempt count (requests sent) */
    json_t *park;                   /* PARK: idemq.park_info facts (owned) */
    enum classify_class fail_class; /* FAIL: CLASS_INFRA or CLASS_FATAL */
    char outcome[32]; /* what it came to: applied, duplicate, unknown, conflict, ... */
    char reason[512];
};

/* Name of a decision kind ("ack", "retry", "wait", "park", "fail"). */
const char *provider_flow_kind_name(enum provider_decision_kind k);

/*
 * Creates the flow of one worker for the provider inputs of c (c must
 * outlive it), with its own effect_http engine. Returns NULL with errbuf
 * set (IDEMQ_ERR_CONFIG-like: a credential or CA file problem) when it
 * cannot. The thread that creates it owns it.
 */
struct provider_flow *provider_flow_new(const struct conf *c, int worker_id, char *errbuf,
                                        size_t errlen);

/* Cancels what is in flight (see provider_flow_abandon) and frees f. NULL is fine. */
void provider_flow_free(struct provider_flow *f);

/*
 * Takes one decoded delivery (j->decode_err == IDEMQ_OK) of a provider
 * input. Copies what it needs from j (j may be reused at once). Runs
 * transaction 1 when the input has a free slot (provider.max_in_flight),
 * else queues the job until one frees. The job's decision comes from
 * provider_flow_poll, never from here. Returns IDEMQ_OK, or
 * IDEMQ_ERR_CONFIG (not a provider input) / IDEMQ_ERR_NOMEM with nothing
 * taken (the delivery stays the worker's). Owner thread; db must be open
 * and idle (no transaction).
 */
idemq_err_t provider_flow_start(struct provider_flow *f, PGconn *db, const struct job *j,
                                void *cookie) IDEMQ_MUSTCHECK;

/*
 * Drives the flow: starts queued jobs, waits up to timeout_ms for provider
 * answers (less when a decision is ready), runs transaction 2 for each,
 * and writes up to max decisions to out. Returns the number written (0 when
 * nothing was decided; it returns at once when nothing is in flight). Each
 * decision must be released with provider_flow_decision_clear. Owner thread; db
 * open and idle.
 */
int provider_flow_poll(struct provider_flow *f, PGconn *db, int timeout_ms,
                       struct provider_decision *out, int max);

/* Drives the requests in flight without waiting: answers that arrived
 * are read (before their timeouts run out) and wait in the engine for the
 * next poll, which records them. Needs no database. Owner thread. */
void provider_flow_pump(struct provider_flow *f);

/* Jobs taken and not yet decided (queued, in flight or decided-unpolled). */
int provider_flow_pending(const struct provider_flow *f);

/*
 * Forgets every job not yet returned by poll, cancelling their requests
 * (as a crash would; provider_flow_free does it). Their intents keep their
 * leases: a redelivery waits for the lease, then looks the request up or
 * resends it under the same key. Owner thread.
 */
void provider_flow_abandon(struct provider_flow *f);

/*
 * The deliveries of every job are gone (a broker reconnect, after a FAIL
 * too): drops the decisions not yet polled (what they record is committed;
 * a redelivery finds it) and the queued jobs (never claimed), and keeps
 * the calls in flight: poll still records their answers (transaction 2)
 * but hands out no decision for them. A redelivery of such a job (same
 * input, key and body) given to provider_flow_start takes it over: its
 * decision comes when the answer is recorded. Owner thread.
 */
void provider_flow_detach(struct provider_flow *f);

/*
 * A stop: queued jobs (no transaction 1 yet, never claimed) are dropped
 * (the caller gives their deliveries back to the broker) and nothing new
 * is sent from now on: a step that would send a request or lookup is
 * recorded as not sent at once. Calls already in flight go on; poll until
 * provider_flow_pending is 0. Owner thread.
 */
void provider_flow_drain(struct provider_flow *f);

/* Releases what a decision owns and zeroes it. */
void provider_flow_decision_clear(struct provider_decision *d);

#endif
