/*
 * run_report: the performance line `idemq run` logs when it stops: jobs,
 * busy time (first delivery to last ack) and rate, delivery -> ack latency
 * percentiles over all workers, CPU time and peak RSS of the process.
 * scripts/bench reads it; it is also useful after any run.
 */
#ifndef IDEMQ_RUN_REPORT_H
#define IDEMQ_RUN_REPORT_H

#include "worker.h"

/*
 * Logs one line (level info) of key=value pairs:
 *   perf: jobs=N batches=B busy_s=S jobs_per_s=R latency_p50_ms=A latency_p99_ms=B
 *         latency_max_ms=C cpu_s=U cpu_s_per_1000=V peak_rss_kib=M
 * Call from the main thread after every worker in ws[0..n) returned.
 */
void run_report_log(const struct worker *ws, int n);

/*
 * On worker w's own thread, between batches: once interval_s seconds have
 * passed since its last interval line (or its start), logs (level info)
 *   perf interval: worker=I seconds=S jobs=N latency_p50_ms=A latency_p99_ms=B
 *                  latency_max_ms=C
 * over the deliveries it acknowledged since, and starts a new interval.
 * For watching latency over a long run (scripts/soak); log.perf_interval_s.
 */
void run_report_interval(struct worker *w, long long now_ns, int interval_s);

#endif
