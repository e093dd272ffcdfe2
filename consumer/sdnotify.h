/*
 * sdnotify: systemd integration of `idemq run` (Type=notify),
 * through libsystemd's sd_notify. A supervisor thread sends READY=1 once
 * every worker consumes, STATUS= lines (readiness, or why not, and the
 * counts), WATCHDOG=1 every half WatchdogSec while every worker makes
 * progress (liveness.h; a stuck worker stops the pings and systemd
 * restarts the service), and STOPPING=1 when a drain begins. Without
 * NOTIFY_SOCKET in the environment nothing is started.
 *
 * API: sdnotify_start (after the workers started) -> sdnotify_stop (after
 *      they were joined).
 */
#ifndef IDEMQ_SDNOTIFY_H
#define IDEMQ_SDNOTIFY_H

#include <stddef.h>

#include "conf.h"
#include "idemq_err.h"
#include "worker.h"

struct sdnotify;

/*
 * Starts the supervisor for workers ws[0..n) (they and c must outlive it)
 * when NOTIFY_SOCKET is set; *out stays NULL otherwise. Returns IDEMQ_OK,
 * or IDEMQ_ERR_NOMEM / IDEMQ_ERR_INTERNAL with errbuf set. Main thread.
 */
idemq_err_t sdnotify_start(const struct conf *c, struct worker *ws, int n, struct sdnotify **out,
                           char *errbuf, size_t errlen) IDEMQ_MUSTCHECK;

/* Sends STOPPING=1 (unless a drain already did) and a last STATUS=, stops
 * the thread and frees s. NULL is fine. Main thread. */
void sdnotify_stop(struct sdnotify *s);

#endif
