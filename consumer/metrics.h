/*
 * metrics: the HTTP observation endpoint of `idemq run` (libmicrohttpd, its
 * own thread): GET /ready answers 200 when every worker consumes and 503
 * with the reason when any is NOT READY (paused on a bad deploy, a broken
 * topology or an outage); GET /live answers 200 while every worker makes
 * progress (liveness.h) and 503 once one is stuck; GET /metrics serves
 * Prometheus text (counters summed over the workers, and the ledger gauges
 * of gauges.h) that `promtool check metrics` accepts.
 */
#ifndef IDEMQ_METRICS_H
#define IDEMQ_METRICS_H

#include <stddef.h>

#include "conf.h"
#include "gauges.h"
#include "idemq_err.h"
#include "worker.h"

struct metrics_server;

/*
 * Starts serving on c->metrics_listen ("ip:port") for workers ws[0..n) and
 * the ledger gauges g (NULL = none), which must outlive the server. Returns
 * IDEMQ_OK and *out (stop with metrics_stop), or IDEMQ_ERR_CONFIG with
 * errbuf set. Main thread.
 */
idemq_err_t metrics_start(const struct conf *c, struct worker *ws, int n, struct gauges *g,
                          struct metrics_server **out, char *errbuf,
                          size_t errlen) IDEMQ_MUSTCHECK;

/* Stops the server and frees it. NULL is fine. */
void metrics_stop(struct metrics_server *m);

/* Renders the /metrics text into buf (for tests); returns its length. */
size_t metrics_render(struct worker *ws, int n, char *buf, size_t len);

#endif
