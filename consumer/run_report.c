/*
 * run_report: merges the workers' latency histograms and busy windows and
 * adds the process's own resource usage (getrusage).
 */
#include "run_report.h"

#include <sys/resource.h>

#include "latency.h"
#include "log.h"

void run_report_log(const struct worker *ws, int n)
{
    static struct latency_hist all; /* 8 KiB: kept off the stack */
    struct rusage ru;
    long long first = 0, last = 0;
    long jobs = 0, batches = 0;
    double busy, cpu;

    latency_init(&all);
    for (int i = 0; i < n; i++) {
        latency_merge(&all, &ws[i].latency);
        jobs += (long)ws[i].latency.n;
        batches += atomic_load(&ws[i].stats.batches);
        if (ws[i].first_delivery_ns && (!first || ws[i].first_delivery_ns < first))
            first = ws[i].first_delivery_ns;
        if (ws[i].last_ack_ns > last)
            last = ws[i].last_ack_ns;
    }
    busy = first && last > first ? (double)(last - first) / 1e9 : 0;
    getrusage(RUSAGE_SELF, &ru);
    cpu = (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec / 1e6 +
          (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec / 1e6;
    log_info("perf: jobs=%ld batches=%ld busy_s=%.3f jobs_per_s=%.0f latency_p50_ms=%.2f "
             "latency_p99_ms=%.2f latency_max_ms=%.2f cpu_s=%.3f cpu_s_per_1000=%.4f "
             "peak_rss_kib=%ld",
             jobs, batches, busy, busy > 0 ? (double)jobs / busy : 0,
             (double)latency_percentile_us(&all, 0.50) / 1000.0,
             (double)latency_percentile_us(&all, 0.99) / 1000.0, (double)all.max_us / 1000.0,
             cpu, jobs ? cpu * 1000.0 / (double)jobs : 0, ru.ru_maxrss);
}

void run_report_interval(struct worker *w, long long now_ns, int interval_s)
{
    if (!w->interval_start_ns) {
        w->interval_start_ns = now_ns;
        return;
    }
    if (now_ns - w->interval_start_ns < (long long)interval_s * 1000000000LL)
        return;
    log_info("perf interval: worker=%d seconds=%.1f jobs=%llu latency_p50_ms=%.2f "
             "latency_p99_ms=%.2f latency_max_ms=%.2f",
             w->id, (double)(now_ns - w->interval_start_ns) / 1e9,
             (unsigned long long)w->interval.n,
             (double)latency_percentile_us(&w->interval, 0.50) / 1000.0,
             (double)latency_percentile_us(&w->interval, 0.99) / 1000.0,
             (double)w->interval.max_us / 1000.0);
    latency_init(&w->interval);
    w->interval_start_ns = now_ns;
}
