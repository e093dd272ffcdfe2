/*
 * rate_gate: a token bucket shared by all worker threads (one mutex), so
 * the daemon as a whole applies at most `rate` jobs per second. Generic: no
 * daemon dependencies; time is passed in, so it is unit tested without
 * sleeping.
 *
 * A caller reserves n tokens at once (a whole batch) and is told how long
 * to wait before it may go on. Reservations are granted in arrival order
 * (virtual scheduling, as in GCRA): after an idle spell up to `burst` tokens
 * pass at once; after that each reservation starts where the previous one
 * ended, so the long-run rate never exceeds `rate`.
 *
 * API: rate_gate_new -> rate_gate_reserve (any thread) -> rate_gate_free.
 */
#ifndef IDEMQ_RATE_GATE_H
#define IDEMQ_RATE_GATE_H

#include <stdint.h>

struct rate_gate;

/* A gate of rate tokens per second (> 0) that lets up to burst tokens
 * (>= 1) through at once after idleness. NULL if out of memory. */
struct rate_gate *rate_gate_new(double rate, double burst);

/* Frees g; no thread may use it any more. NULL is fine. */
void rate_gate_free(struct rate_gate *g);

/*
 * Reserves n tokens at time now_ns (any monotonic clock in ns). Returns how
 * many ns the caller must wait before using them (0: go now). The tokens
 * are taken even if the caller then does not wait. Any thread.
 */
int64_t rate_gate_reserve(struct rate_gate *g, int n, int64_t now_ns);

#endif
