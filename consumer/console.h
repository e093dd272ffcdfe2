/*
 * console: the web console of `idemq run`, on console.listen,
 * its own libmicrohttpd server and thread, apart from /metrics. Pages:
 * overview (throughput and commit time over the last hour as SVG plots
 * read from the ledger, queue, dead-letter and outbox depth, parked by
 * group, probe states), failure groups with their actions, the parked list
 * with filters, searches and paging, and the on-call pages of
 * console_pages.h (a parked message, a key's timeline, jobs retrying now).
 * Actions (redrive, discard, archive of a group, a park or a key's open
 * parks) are groups_act of groups.h: a POST guarded against cross-site
 * requests (Host, Origin / Sec-Fetch-Site and a one-time form token),
 * confirmed after a dry run whose park ids the console keeps and acts on,
 * and authorised by a named token of console.token_file (console_auth.h),
 * whose name is recorded as the actor; each is recorded like the CLI's.
 * Requests that take longer than a few seconds to arrive are closed.
 *
 * The server's one thread owns the console's PostgreSQL session (bounded by
 * console.statement_timeout_ms); no page touches a worker's session.
 * Everything stored is shown through html_text (html.h).
 *
 * API: console_start -> console_stop.
 */
#ifndef IDEMQ_CONSOLE_H
#define IDEMQ_CONSOLE_H

#include "conf.h"
#include "gauges.h"
#include "idemq_err.h"
#include "worker.h"

struct console;

/*
 * Starts the console on c->console_listen for workers ws[0..n) and the
 * gauges g (NULL = none; all must outlive it). Reads console.token_file
 * (when set) now and starts the console's thread. Returns IDEMQ_OK and
 * *out (stop with console_stop), or IDEMQ_ERR_CONFIG (bad address, port
 * taken, a token file that is unreadable or not "NAME TOKEN" lines,
 * reads_need_token without a token file) / IDEMQ_ERR_NOMEM with errbuf
 * set. Main thread.
 */
idemq_err_t console_start(const struct conf *c, struct worker *ws, int n, struct gauges *g,
                          struct console **out, char *errbuf, size_t errlen) IDEMQ_MUSTCHECK;

/* Stops the server (waits for the request in progress, else at most a
 * quarter of a second) and frees it. NULL is fine. Main thread. */
void console_stop(struct console *k);

#endif
