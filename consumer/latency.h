/*
 * latency: a fixed-size log-linear histogram of durations in microseconds
 * (HDR-style: 32 sub-buckets per power of two, so a percentile is exact to
 * within 1/32 = 3 %), from 0 to about 19 hours. Generic: no daemon
 * dependencies, no allocation; one histogram per thread, merged by whoever
 * reads them after the threads are done.
 *
 * API: latency_init -> latency_record ... -> latency_merge /
 *      latency_percentile_us.
 */
#ifndef IDEMQ_LATENCY_H
#define IDEMQ_LATENCY_H

#include <stdint.h>

#define LATENCY_SUB_BITS 5                         /* 32 sub-buckets */
#define LATENCY_MAX_EXP 36                         /* values < 2^36 us */
#define LATENCY_BUCKETS ((LATENCY_MAX_EXP - LATENCY_SUB_BITS + 2) << LATENCY_SUB_BITS)

struct latency_hist {
    uint64_t count[LATENCY_BUCKETS];
    uint64_t n;      /* values recorded */
    uint64_t max_us; /* largest value recorded (before bucketing) */
};

/* Empties h. */
void latency_init(struct latency_hist *h);

/* Records one duration (larger values land in the last bucket). Not
 * thread-safe: one writer per histogram. */
void latency_record(struct latency_hist *h, uint64_t us);

/* Adds src's counts into dst. */
void latency_merge(struct latency_hist *dst, const struct latency_hist *src);

/*
 * The value at or below which a fraction p (0 < p <= 1) of the recorded
 * values lie: the upper bound of the bucket that holds it (never more than
 * max_us). 0 when nothing was recorded.
 */
uint64_t latency_percentile_us(const struct latency_hist *h, double p);

#endif
