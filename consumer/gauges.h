/*
 * gauges: ledger-derived Prometheus gauges of `idemq run`: per
 * input, the jobs waiting in idemq.deferred and the age of the oldest (and,
 * with outbox.relay, the outbox's pending and parked rows and the age of the
 * oldest unsent one; per PostgreSQL queue input, its rows,
 * ready rows, the oldest ready row's age and the rows holding a retry). One
 * thread refreshes them every few seconds on its own PostgreSQL session,
 * with a client-side deadline on every call, so a slow or stopped database
 * never blocks a scrape (it serves the last values and says how old they
 * are) and never blocks shutdown for more than that deadline.
 *
 * API: gauges_start -> gauges_render (any thread, per scrape) -> gauges_stop.
 */
#ifndef IDEMQ_GAUGES_H
#define IDEMQ_GAUGES_H

#include <stdbool.h>
#include <stddef.h>

#include "conf.h"
#include "idemq_err.h"

struct gauges;

/* Starts the refresh thread for c's inputs (c must outlive it). Returns
 * IDEMQ_OK and *out, or IDEMQ_ERR_NOMEM / IDEMQ_ERR_INTERNAL with errbuf
 * set. Main thread. */
idemq_err_t gauges_start(const struct conf *c, struct gauges **out, char *errbuf,
                         size_t errlen) IDEMQ_MUSTCHECK;

/* Appends the gauges as Prometheus text to buf at *off (at most len bytes
 * in all). g may be NULL (nothing appended). Any thread. */
void gauges_render(struct gauges *g, char *buf, size_t len, size_t *off);

/* Outbox: true, with why set, while the oldest unsent row of
 * idemq.outbox is older than outbox.stuck_s (as last read; outbox.relay on).
 * Any thread. */
bool gauges_outbox_stuck(struct gauges *g, char *why, size_t len);

/* Stops the thread (waits at most one call deadline) and frees g. NULL is
 * fine. Main thread. */
void gauges_stop(struct gauges *g);

/* Appends s to buf at *off as a Prometheus label value (\\, " and newline
 * escaped). Pure. */
void gauges_label(const char *s, char *buf, size_t len, size_t *off);

#endif
