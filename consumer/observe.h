/*
 * observe: observe mode's reporting ("Adoption: observe before
 * switching"). An input with mode = "observe" takes a copy of live traffic
 * from its own queue while the existing consumer applies it; batch.c hands
 * its deliveries to idemq.observe_batch (ledger_txn_observe) instead of the
 * apply path, runs no effect, parks nothing and acknowledges everything.
 * This module owns what is reported about it: the process's counters
 * (idemq_observed_total{input,outcome} and
 * idemq_observe_would_park_total{input,code} on /metrics), the baseline
 * `idemq observe report`, and the lines of `idemq jobs show` for a key that
 * was only observed. See consumer/README.md.
 */
#ifndef IDEMQ_OBSERVE_H
#define IDEMQ_OBSERVE_H

#include <stddef.h>
#include <stdio.h>

#include <libpq-fe.h>

#include "conf.h"
#include "idemq_err.h"
#include "ledger_observe.h"

#define OBSERVE_MAX_INPUTS 64 /* inputs beyond these are not counted on /metrics */

/* Counts one committed observation of input (any thread). code: the
 * would-park code (would_park, late_replay), else IDEMQ_OK. */
void observe_count(int input, enum observe_outcome o, idemq_err_t code);

/* The count so far (tests). */
long observe_counted(int input, enum observe_outcome o);

/* Appends the observe metrics of c's observe-mode inputs to buf[0..len)
 * (Prometheus text); nothing without such inputs. Returns the bytes added. */
size_t observe_metrics_render(const struct conf *c, char *buf, size_t len);

/* At the end of `run`: one line per observe-mode input with its counts
 * (nothing without such inputs). */
void observe_log_summary(const struct conf *c);

/* `idemq observe report [--input NAME] [--since TS]`: the baseline, per
 * input: deliveries, observed keys, duplicates (key reuse, in batch), late
 * replays and would-be parks by code. 0, 1 (nothing observed), 4 (database). */
int observe_report(const struct conf *c, const char *input, const char *since, FILE *out);

/* The same report over an open connection (the console's /observe page);
 * input and since may be NULL. Same return codes; db is left open. */
int observe_report_db(PGconn *db, const char *input, const char *since, FILE *out);

/* The observe-mode lines of `jobs show KEY` (observed only, and the key's
 * observations). Returns how many lines were printed (0 when none, or the
 * ledger has no observations table). */
int observe_show(PGconn *db, const char *key, FILE *out);

#endif
