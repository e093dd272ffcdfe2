/*
 * worker: one consumer thread and its loop. A worker owns one AMQP
 * connection and one PostgreSQL connection and runs
 *   receive up to batch_max deliveries -> decode -> one transaction
 *   (claim + effect per job, failures recorded, bad input parked) ->
 *   commit -> settle (ack/nack) on the broker.
 * A batch of one is just the smallest batch. Nothing is acknowledged before
 * its transaction committed; on a database or broker failure nothing is
 * acknowledged and the broker redelivers.
 *
 * API: worker_init -> worker_run (in its own thread, or the caller's) ->
 *      read the counters -> worker_destroy.
 */
#ifndef IDEMQ_WORKER_H
#define IDEMQ_WORKER_H

#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#include "celery_reply.h"
#include "conf.h"
#include "idemq_err.h"
#include "latency.h"
#include "rate_gate.h"

struct worker_stats {
    atomic_long received;    /* deliveries taken off the connection */
    atomic_long from_ledger; /* deferred jobs taken from idemq.deferred (no delivery) */
    atomic_long settled; /* acknowledged after commit */
    atomic_long applied;
    atomic_long duplicates;
    atomic_long key_reuse;   /* deliveries of an applied key with another body */
    atomic_long deferred;    /* ordered lanes: stored in the ledger to wait for a predecessor */
    atomic_long retried;
    atomic_long parked;
    atomic_long batches;
    atomic_long by_class[5]; /* failed attempts and pauses, by enum classify_class */
    atomic_long head_age_ms; /* age of the last delivery with a timestamp, -1 if none */
    struct celery_reply_counts celery; /* Celery replies (consumer/celery_reply.h) */
};

struct worker {
    int id;
    const struct conf *conf;
    int until_idle_ms; /* > 0: return once no delivery came for this long */
    struct worker_stats stats;
    /* throughput: set gate after worker_init to share one rate
     * limit; the rest is written by the worker, read after it returned. */
    struct rate_gate *gate;         /* shared by all workers; NULL = no limit */
    struct latency_hist latency;    /* delivery -> ack of every acked delivery */
    struct latency_hist interval;   /* the same since the last interval line (log.perf_interval_s) */
    long long interval_start_ns;
    long long first_delivery_ns;    /* busy window (CLOCK_MONOTONIC), 0 = none */
    long long last_ack_ns;
    idemq_err_t result; /* set when worker_run returns */
    char error[512];
    pthread_t thread;
    atomic_int ready;   /* 1 while consuming; 0 while paused or connecting */
    pthread_mutex_t lock; /* guards status */
    char status[512];   /* why not ready */
    /* liveness: CLOCK_MONOTONIC ms of the worker's last progress
     * (a poll or frame read, a commit, a reconnect attempt or backoff step);
     * read by GET /live and the systemd watchdog */
    atomic_llong progress_ms;
};

/* Notes that w made progress now (see progress_ms). Worker thread. */
static inline void worker_progress(struct worker *w)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    atomic_store(&w->progress_ms, (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000);
}

/* Prepares w; conf must outlive the worker. Cannot fail. */
void worker_init(struct worker *w, int id, const struct conf *conf, int until_idle_ms);

/* Copies why the worker is not ready (or "ready") into buf. Any thread. */
void worker_status(struct worker *w, char *buf, size_t len);

/* Releases what worker_init set up. After the thread ended. */
void worker_destroy(struct worker *w);

/*
 * Runs the loop until a stop is requested (sig), the idle limit passes, or
 * a fatal error occurs. Returns (and stores in w->result) IDEMQ_OK, or the
 * error with w->error set. Database and broker outages are waited out with
 * backoff, not returned. Call from the thread that owns w.
 */
idemq_err_t worker_run(struct worker *w);

/* pthread entry point wrapping worker_run. arg is a struct worker *. */
void *worker_thread(void *arg);

#endif
