/*
 * reconcile: the reconciler of provider intents. Intents left
 * pending (no answer recorded before their lease ran out) or unknown/waiting
 * for longer than provider.reconcile_after_s past their due time are looked
 * up at the provider (by idempotency key while the provider keeps it, else
 * by client reference) and converge to exactly one provider reference; a
 * provider with no record after the deadline parks them (no_record); with
 * no lookup they park as unknown_outcome (or are resent under the same key
 * when the provider deduplicates and its key window is open). It owns the
 * sweep (its own effect_http engine), the `idemq reconcile` command and the
 * provider gauges served on /metrics.
 *
 * API: reconcile_sweep_new -> reconcile_sweep_step ... (periodically, each
 *      call short) -> reconcile_sweep_free; reconcile_cmd for the command;
 *      reconcile_metrics_render for /metrics (any thread).
 */
#ifndef IDEMQ_RECONCILE_H
#define IDEMQ_RECONCILE_H

#include <libpq-fe.h>
#include <stdbool.h>
#include <stdio.h>

#include "conf.h"
#include "idemq_err.h"
#include "ledger_db.h"

struct reconcile_sweep;

/* What the sweep did, summed over steps. */
struct reconcile_counts {
    long taken;     /* overdue intents taken */
    long looked_up; /* lookups sent */
    long resent;    /* requests sent again under the same key */
    long applied;   /* converged on a provider reference (effect committed) */
    long parked;    /* parked (no_record, unknown_outcome, ...) */
    long left;      /* to try again later (the provider did not settle it yet) */
};

/*
 * Creates a sweep for the provider inputs of c (c must outlive it), with
 * its own effect_http engine. who is recorded as the consumer of every
 * attempt row it writes (e.g. "host:pid reconciler"). out, when not NULL,
 * gets one line per key it settles or leaves (the command); else they are
 * logged. Returns NULL with errbuf set (a credential or CA file problem,
 * or no memory). The creating thread owns it.
 */
struct reconcile_sweep *reconcile_sweep_new(const struct conf *c, const char *who, FILE *out,
                                            char *errbuf, size_t errlen);

/* Cancels its requests in flight (their leases run out: the next sweep
 * takes the keys again) and frees s. NULL is fine. */
void reconcile_sweep_free(struct reconcile_sweep *s);

/* Overrides every input's reconcile_after_s (idemq reconcile --age). */
void reconcile_sweep_set_age(struct reconcile_sweep *s, int age_s);

/*
 * One short step, for a run loop: when nothing is in flight and the last
 * scan is older than scan_ms (0 = scan now), takes up to a few overdue
 * intents per provider input (one statement each) and starts what they
 * need; then waits at most budget_ms for answers and records each (one
 * statement each); refreshes the provider gauges with every scan. Adds to
 * *counts (may be NULL). Returns IDEMQ_OK, or IDEMQ_ERR_DB_CONN /
 * IDEMQ_ERR_SQL with e filled (the requests in flight are kept for the next
 * step). db must be open and idle. Owner thread.
 */
idemq_err_t reconcile_sweep_step(struct reconcile_sweep *s, PGconn *db, int scan_ms,
                                 int budget_ms, struct reconcile_counts *counts,
                                 struct ledger_db_error *e) IDEMQ_MUSTCHECK;

/* True while requests of the sweep are in flight, or its last scan took
 * as many intents as it could (there may be more). */
bool reconcile_sweep_busy(const struct reconcile_sweep *s);

/*
 * `idemq reconcile -c FILE [--age SECONDS]`: sweeps until no overdue intent
 * is left or the ones left wait for the provider (at most about 10 min),
 * printing one line per key and a summary to out. age_s < 0 keeps each
 * input's reconcile_after_s. Returns the exit code: 0, 1 (a failure while
 * sweeping), 3 (provider credentials or CA file), 4 (database unreachable).
 */
int reconcile_cmd(const struct conf *c, int age_s, FILE *out);

/*
 * Renders the provider gauges of the last refresh (Prometheus text):
 * idemq_provider_intents{input,state}, idemq_provider_intent_oldest_seconds
 * {input,state}, idemq_provider_confirmed_recent{input} and
 * idemq_provider_confirm_latency_seconds{input,stat=p50|p99|max} (first
 * request -> confirmed reference, intents confirmed in the last 10 min).
 * Nothing before the first refresh. Returns the length written. Any thread.
 */
size_t reconcile_metrics_render(char *buf, size_t len);

/* Refreshes the gauges of the provider inputs of c from the ledger now (the
 * sweep does it every scan). Outside any transaction. IDEMQ_OK, or
 * IDEMQ_ERR_DB_CONN / IDEMQ_ERR_SQL / IDEMQ_ERR_NOMEM with e filled. */
idemq_err_t reconcile_gauges_refresh(PGconn *db, const struct conf *c,
                                     struct ledger_db_error *e) IDEMQ_MUSTCHECK;

#endif
