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

#endif
