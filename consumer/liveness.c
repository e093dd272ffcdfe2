/*
 * liveness: every worker's last progress against metrics.live_stall_s (see
 * liveness.h).
 */
#include "liveness.h"

#include <stdio.h>
#include <time.h>

static long long mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

long long liveness_max_age_ms(struct worker *ws, int n)
{
    long long now = mono_ms(), max = 0;
    for (int i = 0; i < n; i++) {
        long long age = now - atomic_load(&ws[i].progress_ms);
        if (age > max)
            max = age;
    }
    return max;
}

bool liveness_ok(struct worker *ws, int n, long long stall_ms, char *why, size_t len)
{
    long long now = mono_ms();
    for (int i = 0; i < n; i++) {
        long long age = now - atomic_load(&ws[i].progress_ms);
        if (age > stall_ms) {
            char status[512];
            worker_status(&ws[i], status, sizeof status);
            snprintf(why, len, "worker %d: no progress for %.1f s (limit %lld s; %s)", i,
                     (double)age / 1000.0, stall_ms / 1000, status);
            return false;
        }
    }
    snprintf(why, len, "live");
    return true;
}
