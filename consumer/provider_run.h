/*
 * provider_run: a worker's share of provider inputs. It owns the
 * deliveries handed to provider_flow, each kept whole (a retry or park
 * republishes it) until the flow decides it, turns decisions into settle
 * plans (settle.h) for the worker to carry out, and on worker 0 the
 * reconciler's sweep. The worker keeps the broker: this module never
 * touches it.
 *
 * API: provider_run_new -> per batch provider_run_take -> each loop
 *      provider_run_poll, settle, provider_run_done ... provider_run_sweep
 *      ... provider_run_abandon (broker connection lost) ...
 *      [provider_run_drain (stop) -> provider_run_poll ...] -> provider_run_free.
 * One worker thread.
 */
#ifndef IDEMQ_PROVIDER_RUN_H
#define IDEMQ_PROVIDER_RUN_H

#include <libpq-fe.h>
#include <stdbool.h>
#include <stddef.h>

#include "classify.h"
#include "conf.h"
#include "idemq_err.h"
#include "job.h"
#include "ledger_db.h"
#include "settle.h"

/* Decisions returned by one poll at most. */
#define PROVIDER_RUN_MAX 64

struct provider_run;

/*
 * *out becomes the provider part of worker worker_id, or NULL when c has
 * no provider input (all calls below accept NULL). Returns IDEMQ_OK, or
 * IDEMQ_ERR_CONFIG / IDEMQ_ERR_NOMEM with errbuf set (credentials or CA
 * file unusable). Worker 0 also runs the reconciler.
 */
idemq_err_t provider_run_new(const struct conf *c, int worker_id, struct provider_run **out,
                             char *errbuf, size_t errlen) IDEMQ_MUSTCHECK;

/* Cancels what is in flight and frees pr. NULL is fine. */
void provider_run_free(struct provider_run *pr);

/*
 * Moves the decodable deliveries of provider inputs out of jobs[0..*n)
 * into the flow (the rest stay, compacted, *n updated). A delivery the flow
 * cannot take stays unsettled: *release is set (with why), and the caller
 * gives it back to the broker. db open and idle.
 */
void provider_run_take(struct provider_run *pr, PGconn *db, struct job *jobs, int *n,
                       bool *release, char *why, size_t whylen);

/*
 * Waits up to wait_ms for the flow's decisions and turns up to
 * PROVIDER_RUN_MAX of them into jobs[i] (a view of the kept delivery: the
 * entry keeps owning it) and plans[i]: ack; retry or wait through a delay
 * bucket; park through the dead-letter exchange; a database failure is
 * SETTLE_RELEASE and *fail the class (CLASS_INFRA or CLASS_FATAL, else
 * CLASS_NONE), with why set. Returns how many; settle them, then call
 * provider_run_done. db open and idle.
 */
int provider_run_poll(struct provider_run *pr, PGconn *db, int wait_ms, struct job *jobs,
                      struct plan *plans, enum classify_class *fail, char *why, size_t whylen);

/* After the last poll's plans were carried out (settled = true) or the
 * connection is to be dropped (false): releases those deliveries and the
 * plans' references. */
void provider_run_done(struct provider_run *pr, struct plan *plans, bool settled);

/* Forgets every delivery not decided yet: their channel is gone. Calls in
 * flight go on and later polls record their answers (no decision for
 * them); a redelivery that arrives meanwhile takes its call over (see
 * provider_flow_detach). */
void provider_run_abandon(struct provider_run *pr);

/* A stop: jobs not started (never claimed) are given up (their deliveries
 * return when the connection closes); nothing new is sent; keep polling
 * until provider_run_pending is 0 for the calls in flight. */
void provider_run_drain(struct provider_run *pr);

/* Drives the provider calls in flight without waiting and without the
 * database (their answers wait for the next poll): for the worker's
 * backoff naps. */
void provider_run_pump(struct provider_run *pr);

/* Deliveries awaiting a decision. */
int provider_run_pending(const struct provider_run *pr);

/* True while work keeps `--until-idle` from finishing: deliveries awaiting
 * a decision, or the reconciler with requests in flight. */
bool provider_run_busy(const struct provider_run *pr);

/* The reconciler's short step (worker 0 only; else IDEMQ_OK at once).
 * IDEMQ_OK, or IDEMQ_ERR_DB_CONN / IDEMQ_ERR_SQL with e filled. */
idemq_err_t provider_run_sweep(struct provider_run *pr, PGconn *db,
                               struct ledger_db_error *e) IDEMQ_MUSTCHECK;

#endif
