/*
 * liveness: whether every worker is making progress. A worker
 * notes progress on every poll of the broker, every commit, and every
 * reconnect attempt or backoff step while paused (worker_progress); one
 * that noted none for metrics.live_stall_s is stuck, e.g. in a database
 * call that does not return. GET /live and the systemd watchdog use this;
 * GET /ready (consuming or not) is a different question.
 */
#ifndef IDEMQ_LIVENESS_H
#define IDEMQ_LIVENESS_H

#include <stdbool.h>
#include <stddef.h>

#include "worker.h"

/*
 * True when every worker of ws[0..n) made progress within stall_ms. Else
 * false, with why naming the worker, how long it has been and its status.
 * Any thread.
 */
bool liveness_ok(struct worker *ws, int n, long long stall_ms, char *why, size_t len);

/* The longest time (ms) since any worker of ws[0..n) made progress. Any
 * thread. */
long long liveness_max_age_ms(struct worker *ws, int n);

#endif
